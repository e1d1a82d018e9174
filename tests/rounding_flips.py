"""Where two float32 runs of the same requests may part by rounding alone, and nowhere else.

Two runs whose logits differ by float32 rounding (tensor parallelism sums a row-parallel layer's
partial products in another order; a step that verifies drafts runs more rows, and MKL's sgemm, which
float32 linear layers use on Intel's CPUs, sums a row differently at some row counts) draw the same
tokens except where a draw sits on a boundary that rounding can move:
- a greedy row whose two likeliest tokens are tied within NEAR_TIE takes either;
- a random row draws by inversion (pagedserve.layers.sampler): an uncut row walks the vocabulary in id
  order, so a target on the edge between two tokens lands on the one beside it (ids one apart); a row
  cut by top-k, top-p or min-p walks its kept tokens likeliest first, so two tokens tied within NEAR_TIE
  may swap places and the same target lands on the other.
After such a flip the runs' contexts differ and so does the rest of the completion. A bookkeeping
error (a seed's output index, a penalty's history, a row read for another) changes a draw's uniform
or its distribution: the token drawn is then another one, almost never a neighbour or a tie.

Kept out of conftest.py so tests import it by a name no other folder's conftest shares.
"""

from __future__ import annotations

NEAR_TIE = 1e-3


def first_difference(ours: list[int], reference: list[int]) -> int | None:
    """The first position where the two completions hold different tokens; None where one is the
    other or begins it (a length difference is the caller's to judge, with the finish reasons)."""
    return next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), None)


def is_rounding_flip(
    ours: int,
    reference: int,
    *,
    greedy: bool,
    our_logprob: float | None = None,
    reference_logprob: float | None = None,
) -> bool:
    """Whether a draw of `ours` in one run and `reference` in the other, after equal contexts, can come
    from rounding (above). The logprobs are each run's own of the token it drew (raw logprobs, as
    `logprobs=0` returns them), None where the request asked for none."""
    tied = (
        our_logprob is not None
        and reference_logprob is not None
        and abs(our_logprob - reference_logprob) < NEAR_TIE
    )
    return tied or (not greedy and abs(ours - reference) == 1)
