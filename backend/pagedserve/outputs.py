"""What the engine hands back: per-step deltas for streaming, and whole results for the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedserve.lora_request import LoRARequest


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob, holding the sampled token and the top-k.
TokenLogprobs = dict[int, Logprob]
# One entry per prompt token, holding that token and the top-k there; None for the first (no context).
PromptLogprobs = list[TokenLogprobs | None]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # the request's n and max_tokens (vLLM's request_params_* histograms); None on a record made
    # outside the engine, for a request that never reached it
    n: int | None = None
    max_tokens: int | None = None
    # prompt tokens found in the prefix cache when the request was first scheduled (vLLM's
    # num_cached_tokens); None until then
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    lora_name: str | None = None  # the LoRA adapter the request runs through (None: the base model)
    # (monotonic time, swap | recompute | swap_in): preempted by swapping out or by freeing the blocks,
    # and resumed from the CPU pool
    preemption_events: list[tuple[float, str]] = field(default_factory=list)
    # (finish reason, output tokens) of each finished completion, by index: a request's final delta
    # is one completion's, so its n > 1 siblings' ends are read here (spans, the finished-request log)
    completion_ends: dict[int, tuple[str, int]] = field(default_factory=dict)

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestDelta:
    """What one engine step produced for one completion of a request: only the new tokens and text.

    `finished` ends completion `index`; `request_finished` is set on the last delta of the whole
    request (all its `n` completions finished). With n = 1 the two coincide. `prompt_logprobs` (asked
    for in the request's parameters) come once, on completion 0's first delta with tokens (as vLLM
    streams them with the first output).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    metrics: RequestMetrics
    index: int = 0
    request_finished: bool = True
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    embedding: list[float] | None = None  # an embedding request's vector, on its one final delta
    # on a completion's last delta: the stop string or stop token id that ended it (vLLM's stop_reason)
    stop_reason: str | int | None = None
    # a beam search's beam (its one delta): its generated tokens' summed logprob, which the delta's
    # new_logprobs (None: beam search returns no per-token logprobs) cannot give
    cumulative_logprob: float | None = None

    def completion_ends(self) -> list[tuple[str, int]]:
        """(finish reason, output tokens) of each of the n completions of the request this final delta
        ended: the engine's record when it holds all n, else this delta's own (a request its front
        end ended early: the caller went away, or the engine died, before the engine ended them all;
        or one that never reached the engine)."""
        ends, n = self.metrics.completion_ends, self.metrics.n
        if n is not None and len(ends) == n:
            return [ends[index] for index in range(n)]
        return [(self.finish_reason or "unknown", self.num_output_tokens)]

    def prepend(self, earlier: RequestDelta) -> None:
        """Take in an earlier delta of the same completion that was held back, unsent (a stream that
        sends every `stream_interval` tokens): its tokens, text and logprobs go in front of ours."""
        self.new_token_ids = earlier.new_token_ids + self.new_token_ids
        self.new_text = earlier.new_text + self.new_text
        if earlier.new_logprobs is not None:
            self.new_logprobs = earlier.new_logprobs + (self.new_logprobs or [])
        self.prompt_logprobs = earlier.prompt_logprobs or self.prompt_logprobs

    @classmethod
    def aborted_before_output(
        cls, request_id: str, num_prompt_tokens: int, metrics: RequestMetrics, error: str | None = None
    ) -> RequestDelta:
        """The final delta of a request that ended, aborted, before it produced anything."""
        return cls(
            request_id=request_id,
            new_token_ids=[],
            new_text="",
            new_logprobs=None,
            finished=True,
            finish_reason="aborted",
            num_prompt_tokens=num_prompt_tokens,
            num_output_tokens=0,
            metrics=metrics,
            error=error,
        )

    @classmethod
    def ended_early(
        cls,
        request_id: str,
        last: RequestDelta | None,
        num_prompt_tokens: int,
        arrival_time: float,
        error: str | None,
    ) -> RequestDelta:
        """The final delta of a request that ended after delta `last` (None: before any) without the
        engine's final delta: aborted (the caller went away), or failed with `error` (the engine died
        under it, or one of its completions failed)."""
        if last is None:
            last = cls.aborted_before_output(request_id, num_prompt_tokens, RequestMetrics(arrival_time))
        return replace(
            last,
            new_token_ids=[],
            new_text="",
            new_logprobs=None,
            prompt_logprobs=None,  # sent with the first tokens, if any
            finished=True,
            finish_reason="aborted" if error is None else "error",
            request_finished=True,
            error=error,
        )


@dataclass
class CompletionOutput:
    """One completion, shaped like vLLM's: `cumulative_logprob` is the sum of the sampled tokens'
    logprobs where logprobs were asked for (else None); `stop_reason` the stop string or stop token id
    that ended it (None for any other end: length, end of sequence)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A whole request's result, shaped like vLLM's `RequestOutput`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics | None = field(default=None, repr=False)
    prompt_logprobs: PromptLogprobs | None = None  # when asked: one entry per prompt token, None first
    lora_request: LoRARequest | None = None  # the adapter it ran through (None: the base model)

    @property
    def num_cached_tokens(self) -> int | None:
        """Prompt tokens found in the prefix cache (vLLM's field); None before it was scheduled."""
        return None if self.metrics is None else self.metrics.num_cached_tokens


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """An embedding request's result, shaped like vLLM's (`.outputs.embedding`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
