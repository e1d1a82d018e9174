"""The sampler's draws in float64, for the tests of the C++ kernels that make them: a row's tokens in the
order it draws them and their cumulative weights. Uncut, every token in id order (`_draw`); cut by
top-k, top-p or min-p, what `_top_cut` keeps, most likely first and ties by id (`_draw_from_top`).
The weights are exp((x - max) / T) of the logits as given, 0 below e^-87 as the kernels make them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# How far from an edge a target (or a cut) may be and still differ: float32 weights (each within a few
# ulp, 2.4e-7 relative) against float64 ones, relative to the row's total.
EDGE = 2e-6


@dataclass
class Cut:
    """One row's cut, as the kernels take it: top_k of n or more, top_p 1 and min_p 0 are none."""

    top_k: int
    top_p: float = 1.0
    min_p: float = 0.0


@dataclass
class RowDraws:
    ids: torch.Tensor  # the tokens that can be drawn, in draw order
    cdf: torch.Tensor  # float64 cumulative weights, in that order
    margin: float  # how close the cut came to keeping one more or one fewer token, relative

    def interval(self, token: int) -> tuple[float, float] | None:
        """The token's [lower, upper] share of the cumulative weight, or None where it is not kept."""
        where = (self.ids == token).nonzero()
        if len(where) == 0:
            return None
        j = int(where[0, 0])
        return (float(self.cdf[j - 1]) if j > 0 else 0.0), float(self.cdf[j])


def row_draws(logits: torch.Tensor, temperature: float, cut: Cut | None = None) -> RowDraws:
    x = logits.double()
    n = len(x)
    z = (x - x.max()) / temperature
    weights = torch.where(z < -87.0, 0.0, torch.exp(z))
    if cut is None or (cut.top_k >= n and cut.top_p >= 1.0 and cut.min_p <= 0.0):
        return RowDraws(torch.arange(n), weights.cumsum(0), 1.0)
    order = torch.sort(-weights, stable=True).indices  # the likeliest first, ties by id
    w = weights[order]
    kept, margin = int((w > 0).sum()), 1.0
    if cut.top_k < n:  # the k-th and its ties
        kept = min(kept, int((w >= w[cut.top_k - 1]).sum()))
    if cut.top_p < 1.0:  # on what top-k kept, and of its mass
        mass = float(w[:kept].sum()) if cut.top_k < n else float(weights.sum())
        before = w[:kept].cumsum(0) - w[:kept]
        target = cut.top_p * mass
        starts = torch.ones(kept, dtype=torch.bool)  # the set changes only where a tie group starts
        starts[1:] = w[1:kept] != w[: kept - 1]
        margin = min(margin, float((before[starts] - target).abs().min()) / mass)
        num = max(1, int((before < target).sum()))
        kept = int((w[:kept] >= w[num - 1]).sum())
    if cut.min_p > 0.0:  # those at least min_p times as likely as the likeliest (weight 1)
        margin = min(margin, float((w[:kept] - cut.min_p).abs().min()) / cut.min_p)
        kept = max(1, int((w[:kept] >= cut.min_p).sum()))
    return RowDraws(order[:kept], w[:kept].cumsum(0), margin)


def check_draws(
    tokens: torch.Tensor,
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    uniforms: torch.Tensor,
    cuts: list[Cut | None],
) -> list[bool]:
    """Asserts each row's token is one its cut keeps and that its interval holds the row's target
    (1 - u) * total, but for rows whose cut lies within EDGE of keeping another set. Returns, a row,
    whether its target lies within EDGE of its token's interval's edge (where float32 rounding may
    draw the neighbour instead)."""
    near = []
    for r in range(len(tokens)):
        draws = row_draws(logits[r], float(temperatures[r]), cuts[r])
        if draws.margin < EDGE:
            near.append(True)
            continue
        total = float(draws.cdf[-1])
        target = (1.0 - float(uniforms[r])) * total
        interval = draws.interval(int(tokens[r]))
        assert interval is not None, f"row {r} drew {int(tokens[r])}, which its cut does not keep"
        lower, upper = interval
        assert lower - EDGE * total <= target <= upper + EDGE * total, f"row {r} drew outside its interval"
        near.append(min(abs(target - lower), abs(target - upper)) < EDGE * total)
    return near


def masked_rows(block: int, count: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """`count` bfloat16 rows of 3 * block tokens, -inf (a grammar's mask) but for three before, between
    and after block edges (returned), and `count` uniforms over [0, 1), 0 first (the target at the
    total: the last token that can be drawn, not the -inf ones after it)."""
    logits = torch.full((3 * block,), -math.inf)
    allowed = [block - 1, block, 2 * block + 5]
    logits[allowed] = torch.tensor([0.2, 1.3, -0.5])
    uniforms = torch.linspace(0.0, 1.0 - 1e-12, count, dtype=torch.float64)
    return logits.expand(count, 3 * block).contiguous().bfloat16(), allowed, uniforms
