"""Mamba2's mixer (the state space layers of IBM's Granite 4.0 hybrids, Nemotron-H's, Falcon-H1's), with
the state it carries for each request from step to step (`layers.recurrent`).

in_proj gives each token a gate z, the inputs xBC of a causal depthwise convolution (then SiLU), and a
time step dt per head; the convolution's output splits into x (heads of `head_dim`), B and C (`groups`
of `state_size`, each shared by heads / groups heads). Each head h keeps a state S [head_dim,
state_size], advanced by every token as

    S <- exp(dt A) S + dt x B^T,    y = S C + D x,    dt = softplus(dt + dt_bias), A = -exp(A_log)

and y, gated by SiLU(z) and RMS-normed in groups, goes through out_proj. A request keeps its
convolution's last inputs and every head's S.

A step's one-token sequences (decodes) advance together, in one pass over their states where the
C++ kernels build (`cpu_kernels.mamba2_decode`), else through `decode_states`; each longer one (a
prompt or a chunk of one) runs the state-space duality's chunked form (Mamba2's SSD): within a chunk
of `chunk_size` tokens its outputs are a masked, decayed attention of C over B, plus the state before
the chunk read through C; chunk to chunk, the state carries. Both in float32, the states kept in the model's dtype (vLLM's
default and transformers' cache) unless the model names another (Nemotron-H's float32).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pagedserve_kernels import cpu as cpu_kernels
from torch import nn

from pagedserve.distributed import all_reduce, get_tp_rank, get_tp_size
from pagedserve.layers.linear import ReplicatedLinear, RowParallelLinear
from pagedserve.layers.recurrent import RecurrentLayer, RecurrentStep, causal_conv, rank_rows, rows_loader


@dataclass(frozen=True)
class Mamba2Dims:
    hidden_size: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_width: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    norm_eps: float
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    state_dtype: torch.dtype | None = None  # the states' (None: the model's)
    out_bias: bool | None = None  # out_proj's bias (None: as in_proj's, `proj_bias`; Falcon-H1's its own)
    # y and the gate z: "gate_then_norm" (Mamba2's RMSNormGated), "norm_then_gate" or "gate_only"
    # (Falcon-H1's, by mamba_norm_before_gate and mamba_rms_norm)
    norm: str = "gate_then_norm"

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.num_groups * self.state_size


def check_split(dims: Mamba2Dims, tp_size: int) -> None:
    """Heads split evenly across ranks; groups too, or (one group) whole on every rank."""
    if dims.num_heads % dims.num_groups:
        raise ValueError(
            f"model: config.json's {dims.num_groups} Mamba2 groups do not divide its {dims.num_heads} heads"
        )
    if dims.num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size: {tp_size} does not divide the {dims.num_heads} Mamba2 heads")
    if dims.num_groups % tp_size and dims.num_groups != 1:
        raise ValueError(
            f"tensor_parallel_size: {tp_size} does not divide the {dims.num_groups} Mamba2 groups (nor is "
            "there one group, which each rank would hold whole)"
        )


class GatedRMSNorm(nn.Module):
    """y * SiLU(z), RMS-normed over each of its groups of `group_size`, times the weight; in float32,
    rounded once (Mamba2's RMSNormGated, the gate before the norm); or (`norm_first`, Falcon-H1's) y
    normed, times the weight, then gated. This rank's `size` channels; where one group spans every
    rank (`across_ranks`), its sum of squares is all-reduced."""

    def __init__(
        self, size: int, group_size: int, eps: float, across_ranks: bool = False, norm_first: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.weight.weight_loader = rows_loader(rank_rows(size))  # type: ignore[attr-defined]
        self.group_size, self.eps, self.across_ranks = group_size, eps, across_ranks
        self.norm_first = norm_first

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        values = y.float() if self.norm_first else y.float() * F.silu(gate.float())
        values = values.unflatten(-1, (-1, min(self.group_size, values.shape[-1])))
        squares = values.pow(2).sum(-1, keepdim=True)
        if self.across_ranks:
            squares = all_reduce(squares)
        normed = self.weight.float() * (values * torch.rsqrt(squares / self.group_size + self.eps)).flatten(
            -2
        )
        return (normed * F.silu(gate.float()) if self.norm_first else normed).to(gate.dtype)


class Mamba2Mixer(RecurrentLayer):
    """Under tensor parallelism each rank holds its share of the heads (their z, x and dt rows of
    in_proj, their convolution channels, A, D, dt_bias and norm weights, their states) and its groups'
    B and C, or the one group's whole; out_proj sums the ranks' parts."""

    def __init__(self, dims: Mamba2Dims) -> None:
        super().__init__()
        tp_size, rank = get_tp_size(), get_tp_rank()
        check_split(dims, tp_size)
        self.dims, self.width = dims, dims.conv_width
        # this rank's sizes
        self.num_heads, self.head_dim, self.state_size = (
            dims.num_heads // tp_size,
            dims.head_dim,
            dims.state_size,
        )
        self.num_groups = dims.num_groups // tp_size if dims.num_groups % tp_size == 0 else 1
        self.inner = self.num_heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.num_groups * self.state_size
        # the checkpoint's rows this rank keeps: of in_proj's [z | x | B | C | dt], of the convolution's
        # [x | B | C], of each head's A, D and dt_bias
        inner, groups, size = dims.intermediate_size, dims.num_groups * dims.state_size, self.state_size
        first_group = rank * self.num_groups if dims.num_groups % tp_size == 0 else 0
        x_rows = rank_rows(self.inner)
        b_rows = torch.arange(first_group * size, (first_group + self.num_groups) * size)
        heads = rank_rows(self.num_heads)
        conv_rows = torch.cat((x_rows, inner + b_rows, inner + groups + b_rows))
        in_proj_rows = torch.cat((x_rows, inner + conv_rows, 2 * inner + 2 * groups + heads))
        self.in_proj = ReplicatedLinear(dims.hidden_size, len(in_proj_rows), bias=dims.proj_bias)
        for param in (self.in_proj.weight, self.in_proj.bias):
            if param is not None:
                param.weight_loader = rows_loader(in_proj_rows)  # type: ignore[attr-defined]
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, dims.conv_width), requires_grad=False)
        self.conv_weight.weight_loader = rows_loader(conv_rows)  # type: ignore[attr-defined]
        self.conv_bias: nn.Parameter | None = None
        if dims.conv_bias:
            self.conv_bias = nn.Parameter(torch.empty(self.conv_dim), requires_grad=False)
            self.conv_bias.weight_loader = rows_loader(conv_rows)  # type: ignore[attr-defined]
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        for param in (self.dt_bias, self.A_log, self.D):
            param.weight_loader = rows_loader(heads)  # type: ignore[attr-defined]
        one_group_across = dims.num_groups == 1 and tp_size > 1
        if dims.norm not in ("gate_then_norm", "norm_then_gate", "gate_only"):
            raise ValueError(f"Mamba2's norm {dims.norm!r} (gate_then_norm, norm_then_gate or gate_only)")
        self.norm: GatedRMSNorm | None = None
        if dims.norm != "gate_only":
            self.norm = GatedRMSNorm(
                self.inner,
                inner // dims.num_groups,
                dims.norm_eps,
                one_group_across,
                norm_first=dims.norm == "norm_then_gate",
            )
        out_bias = dims.proj_bias if dims.out_bias is None else dims.out_bias
        self.out_proj = RowParallelLinear(inner, dims.hidden_size, bias=out_bias)
        self.conv_state: torch.Tensor | None = None  # [rows, width - 1, conv_dim], set by `bind_state`
        self.ssm_state: torch.Tensor | None = None  # [rows, heads, head_dim, state_size]

    def state_bytes(self, rows: int) -> int:
        conv = (self.width - 1) * self.conv_dim * self.conv_weight.element_size()
        ssm_dtype = self.dims.state_dtype or self.conv_weight.dtype
        return rows * (conv + self.num_heads * self.head_dim * self.state_size * ssm_dtype.itemsize)

    def bind_state(self, rows: int) -> None:
        dtype, device = self.conv_weight.dtype, self.conv_weight.device
        self.conv_state = torch.zeros(rows, self.width - 1, self.conv_dim, dtype=dtype, device=device)
        shape = (rows, self.num_heads, self.head_dim, self.state_size)
        self.ssm_state = torch.zeros(shape, dtype=self.dims.state_dtype or dtype, device=device)

    def reset_state(self, row: int) -> None:
        assert self.conv_state is not None and self.ssm_state is not None, "bind_state() first"
        self.conv_state[row] = 0
        self.ssm_state[row] = 0

    def forward(self, hidden: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        assert self.conv_state is not None, "bind_state() first"
        gate, xbc, dt = self.in_proj(hidden).split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        windows = step.windows[self.width]
        xbc = F.silu(causal_conv(xbc, self.conv_state, self.conv_weight, self.conv_bias, step.rows, windows))
        groups = self.num_groups * self.state_size
        x, b, c = xbc.float().split([self.inner, groups, groups], dim=-1)
        y = self.scan(
            x.unflatten(-1, (self.num_heads, self.head_dim)),
            F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dims.time_step_limit),
            b.unflatten(-1, (self.num_groups, self.state_size)),
            c.unflatten(-1, (self.num_groups, self.state_size)),
            step,
        )
        if self.norm is None:  # (Falcon-H1's without mamba_rms_norm: y gated alone)
            return self.out_proj((y.flatten(1) * F.silu(gate)).to(gate.dtype))
        return self.out_proj(self.norm(y.flatten(1), gate))

    def scan(
        self, x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, step: RecurrentStep
    ) -> torch.Tensor:
        """y [tokens, heads, head_dim] (float32) of the step's tokens, each request's state advanced;
        b and c [tokens, groups, state_size], each group's shared by its heads."""
        assert self.ssm_state is not None
        a = -torch.exp(self.A_log.float())
        repeat = self.num_heads // self.num_groups
        per_head = lambda groups: groups.repeat_interleave(repeat, dim=1)  # noqa: E731 (a group's B or C for each of its heads)
        y = torch.empty_like(x)
        rows, tokens = step.single_tokens
        if tokens.numel():  # one token each: S <- exp(dt A) S + dt x B^T, y = S C
            decode = (
                cpu_kernels.mamba2_decode if self.ssm_state.is_cpu and cpu_kernels.load() else decode_states
            )
            y[tokens] = decode(self.ssm_state, rows, x[tokens], dt[tokens], a, b[tokens], c[tokens])
        for row, start, n in step.runs:
            span = slice(start, start + n)
            b_heads, c_heads = per_head(b[span]), per_head(c[span])
            y[span], state = ssd(
                x[span], dt[span], a, b_heads, c_heads, self.ssm_state[row].float(), self.dims.chunk_size
            )
            self.ssm_state[row] = state.to(self.ssm_state.dtype)
        return y + self.D.float()[:, None] * x


def decode_states(
    states: torch.Tensor,
    rows: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
) -> torch.Tensor:
    """`cpu_kernels.mamba2_decode` in torch (GPUs; CPUs without the C++ kernels): the requests' states
    (rows of `states`) gathered, advanced in float32, S <- exp(dt A) S + (dt x) B^T, and written back;
    y = S C returned [requests, heads, head_dim]. B and C [requests, groups, state_size]."""
    k, (heads, head_dim, state_size) = rows.shape[0], states.shape[1:]
    repeat = heads // b.shape[1]
    held, work = _decode_buffers(states)
    state = work[:k].copy_(torch.index_select(states, 0, rows, out=held[:k])).flatten(0, 1)
    state.mul_(torch.exp(dt * a).flatten()[:, None, None])
    b_heads, c_heads = (t.repeat_interleave(repeat, dim=1).flatten(0, 1) for t in (b, c))
    state.baddbmm_((dt[:, :, None] * x).flatten(0, 1)[:, :, None], b_heads[:, None, :])  # (rank 1: exact)
    y = torch.bmm(state, c_heads[:, :, None]).view(k, heads, head_dim)
    states.index_copy_(0, rows, held[:k].copy_(state.view(k, heads, head_dim, state_size)))
    return y


def _decode_buffers(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for a decode step's gathered states, in their dtype and in float32, for as many requests
    as `states` has rows: shared by the model's Mamba2 layers of the same sizes."""
    return _buffers(tuple(states.shape), states.dtype, states.device)


@functools.lru_cache(maxsize=1)
def _buffers(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    # Fresh tensors each step cost more than the step's arithmetic: page faults on every new 50 MB
    # (64 requests of 24 heads x 64 x 128 states: 58.7 ms a layer against 17.2 with these; bench/README.md)
    return torch.empty(shape, dtype=dtype, device=device), torch.empty(
        shape, dtype=torch.float32, device=device
    )


def ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens (x [n, heads, head_dim], dt [n, heads], b and c [n, heads, state_size])
    through the state space from `state` [heads, head_dim, state_size], a chunk at a time: their y
    (without D's skip) and the state after them. Within a chunk, with L_t the sum of dt A up to token t,
    y_t = sum over s <= t of exp(L_t - L_s) (c_t . b_s) dt_s x_s, plus exp(L_t) times the state before
    the chunk read through c_t; the state after it decays every token's dt x b^T by what follows it."""
    outputs = []
    for begin in range(0, x.shape[0], chunk_size):
        xs, dts, bs, cs = (t[begin : begin + chunk_size] for t in (x, dt, b, c))
        decay = torch.cumsum(dts * a, dim=0)  # [t, heads]: L_t
        n = decay.shape[0]
        later = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)[..., None]  # s > t
        weights = torch.exp((decay[:, None] - decay[None]).masked_fill(later, float("-inf")))  # [t, s, heads]
        xdt = xs * dts[..., None]
        scores = torch.einsum("thn,shn->tsh", cs, bs) * weights
        y = torch.einsum("tsh,shp->thp", scores, xdt)
        y += torch.einsum("thn,hpn->thp", cs, state) * torch.exp(decay)[..., None]
        remaining = torch.exp(decay[-1] - decay)  # [s, heads]: each token's decay to the chunk's end
        state = state * torch.exp(decay[-1])[:, None, None] + torch.einsum(
            "sh,shp,shn->hpn", remaining, xdt, bs
        )
        outputs.append(y)
    return torch.cat(outputs), state
