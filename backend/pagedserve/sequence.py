"""Request state as the scheduler sees it: tokens so far and how many of them are in the KV cache."""

from __future__ import annotations

import enum
import time
from itertools import count

from pagedserve.sampling_params import SamplingParams

_arrival_counter = count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV blocks moved to the CPU pool
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    LENGTH = "length"  # max_tokens or the model's context length reached
    STOP = "stop"  # a stop string or stop token id
    EOS = "eos"  # the model's end-of-sequence token
    ABORTED = "aborted"  # cancelled by the client, a deadline or a drain
    ERROR = "error"  # the engine failed while running it


class Sequence:
    """One generation stream.

    Invariant: `num_computed_tokens <= num_tokens`. Prefill, chunked prefill and recompute after
    preemption are all just "computed tokens catching up with tokens"; a sequence is sampled from
    in the step where its scheduled tokens reach `num_tokens`.

        token_ids:  [ prompt .............. | output ...... ]
                    [ in KV cache (computed) ....... | new  ]
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        # an int for the scheduler and the stop checks: the engine resolves vLLM's None (until the context
        # is full) for the prompt before it makes the sequences
        if sampling_params.max_tokens is None:
            raise ValueError("max_tokens: None must be resolved for the prompt (LLMEngine.add_request)")
        self.max_tokens = sampling_params.max_tokens
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_order = next(_arrival_counter)  # a later arrival is preempted first
        self.priority = priority  # under --scheduling-policy priority: lower runs first, then arrival
        self.lora_name = lora_name  # the LoRA adapter it runs through (None: the base model)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_new_tokens = 0  # appended by the last step: 1, or more with speculative decoding
        self.block_table: list[int] = []  # written only by the block manager
        self.finish_reason: FinishReason | None = None
        # vLLM's stop_reason: the stop string or stop token id that ended it (None: any other end)
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        # (time.monotonic(), "swap" | "recompute" | "swap_in")
        self.preemption_events: list[tuple[float, str]] = []
        # parallel sampling (n > 1): siblings forked from this sequence once its prompt is computed
        self.pending_forks: list[Sequence] = []
        self.is_multi_sequence = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def max_num_tokens(self) -> int:
        """Tokens this sequence can ever hold: prompt + max_tokens."""
        return self.num_prompt_tokens + self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop_token(self, max_model_len: int) -> FinishReason | None:
        """Token-level stop conditions after the last appended token (stop strings are checked on text)."""
        params = self.sampling_params
        last = self.token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return FinishReason.EOS
            if last in params.stop_token_ids:
                return FinishReason.STOP
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table}, {self.status.value})"
        )
