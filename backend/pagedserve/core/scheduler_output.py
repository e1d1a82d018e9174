"""The plain-data contracts of one engine step: scheduler -> workers and workers -> scheduler.

Nothing here references a live `Sequence`, so both can be pickled and broadcast to worker ranks as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedserve.outputs import TokenLogprobs
from pagedserve.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's work in this step.

    `token_ids` are the tokens to run, at positions `num_computed_tokens ..` of the request.
    `new_block_ids` extend the request's block table (the whole table when `is_new`).
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    new_block_ids: list[int]
    do_sample: bool  # this step's tokens reach the end of the known tokens: sample the next one
    is_new: bool = False  # first scheduled, or resumed after preemption: workers (re)build its state
    num_prompt_tokens: int = 0  # set when is_new
    sampling_params: SamplingParams | None = None  # set when is_new
    # when is_new: the tokens already in the cache (prefix-cache hit, swap-in or fork), for penalties
    computed_token_ids: list[int] = field(default_factory=list)
    # when is_new and the request still owes prompt logprobs: its whole prompt (a chunk's last position
    # scores the first token of the next chunk, which the workers have not seen yet)
    prompt_token_ids: list[int] | None = None
    lora_name: str | None = None  # set when is_new: the LoRA adapter the request runs through
    # speculative decoding: the last `num_spec_tokens` of `token_ids` are drafts, each to be verified
    # by the token sampled at the position before it (do_sample is set)
    num_spec_tokens: int = 0


@dataclass
class SchedulerOutput:
    """Workers perform, in this order: swap out, swap in, copy blocks, then the forward pass."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    # Requests whose blocks were freed since the last step (finished, aborted or preempted):
    # workers drop their per-request state.
    freed_request_ids: list[str] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Structured outputs (set by the engine, None when no request sampled this step has a grammar):
    # the int32 bitmask [rows, ceil(vocab / 32)] holds 1 + num_spec_tokens rows for each of
    # structured_output_request_ids in turn, constraining the token sampled at its last token and at
    # each of its drafts; bit t % 32 of word t // 32 set = token t allowed.
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Sampled tokens, one per request whose `do_sample` was set, in scheduling order; prompt logprobs."""

    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # parallel to request_ids; {} where not asked
    # Speculative decoding: request id -> the drafts the step accepted (each equal to the token
    # sampled at its position), which come before its sampled token; and their logprobs when asked.
    accepted_drafts: dict[str, list[int]] = field(default_factory=dict)
    draft_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Prompt logprobs of the prompt positions run this step (sampled or not), for requests that ask:
    # request id -> (p, entries), entries[i] scoring prompt token p + i (p >= 1: token 0 has none).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Embedding requests run this step: request id -> (p, values), p their first position this step;
    # values the sum of those positions' final hidden states ("mean" pooling), or the last prompt
    # position's alone ("last", only in the step that runs it).
    pooled: dict[str, tuple[int, list[float]]] = field(default_factory=dict)
