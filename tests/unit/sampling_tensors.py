"""A sampler's batch description for the sampler's unit tests: nothing asked for but what is given."""

from __future__ import annotations

import torch
from pagedserve.layers.sampler import SamplingTensors


def sampling_tensors(rows: int, temperature: float, **changes: object) -> SamplingTensors:
    """`rows` rows at `temperature` (0: greedy) with no cut, penalty, ban, seed or logprobs, but what
    `changes` sets (temperatures among them)."""
    fields: dict[str, object] = {"temperatures": torch.full((rows,), temperature), **changes}
    return SamplingTensors(**fields)  # type: ignore[arg-type]
