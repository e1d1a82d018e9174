"""A sampler's batch description for the sampler's unit tests: nothing asked for but what is given."""

from __future__ import annotations

import torch
from pagedserve.layers.sampler import SamplingTensors


def sampling_tensors(rows: int, temperature: float, **changes: object) -> SamplingTensors:
    """`rows` rows at `temperature` (0: greedy) with no cut, penalty, ban, seed or logprobs, but what
    `changes` sets (temperatures among them)."""
    fields: dict[str, object] = dict(
        temperatures=torch.full((rows,), temperature),
        top_ks=None,
        top_ps=None,
        min_ps=None,
        repetition_penalties=None,
        presence_penalties=None,
        frequency_penalties=None,
        prompt_token_ids=None,
        output_token_ids=None,
        banned_tokens=[],
        seeded_rows=[],
        max_num_logprobs=None,
    )
    fields.update(changes)
    return SamplingTensors(**fields)  # type: ignore[arg-type]
