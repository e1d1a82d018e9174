"""Mamba's selective state space (Mamba 1: state-spaces' mamba-130m to 2.8b, TII's FalconMamba, AI21's
Jamba's Mamba layers), with
the state it carries for each request from step to step (`layers.recurrent`).

in_proj gives each token x and a gate z (`intermediate_size` channels each); x goes through a causal
depthwise convolution (then SiLU), and x_proj turns it into the time step's low-rank part
(`time_step_rank`), B and C (`state_size` each, shared by every channel); dt = softplus(dt_proj(low
rank) + its bias). Each channel c keeps a state h [state_size], advanced by every token as

    h <- exp(dt_c A_c) h + dt_c x_c B,    y_c = h . C + D_c x_c,    A = -exp(A_log) [channels, state_size]

and y times SiLU(z) goes through out_proj. FalconMamba RMS-normalizes the low-rank part, B and C
(without weights) before they are used, Jamba's Mamba layers with weights. Each state decays by its
own rate (A_c is a row, Mamba2's a scalar a head), so a prompt's tokens advance the state one at a
time: on a CPU in the C++ kernels, every request's tokens in one call (csrc/mamba.cpp, threads taking
channels); elsewhere a step's one-token sequences together and a prompt a token at a time from
Python. In float32, the states kept in the model's dtype (transformers' cache)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from pagedserve_kernels import cpu as cpu_kernels
from torch import nn

from pagedserve.config import architecture_of
from pagedserve.distributed import get_tp_size
from pagedserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedserve.layers.norm import RMSNorm, weightless_rms_norm
from pagedserve.layers.recurrent import RecurrentLayer, RecurrentStep, causal_conv, rank_rows, rows_loader


@dataclass(frozen=True)
class MambaDims:
    hidden_size: int
    intermediate_size: int
    state_size: int
    conv_width: int
    time_step_rank: int
    conv_bias: bool
    proj_bias: bool
    # FalconMamba's RMS norms (no weight) of the time step's low-rank part, B and C (0: none); Jamba's
    # with weights (`inner_norm_weights`: dt_layernorm, b_layernorm, c_layernorm)
    inner_norm_eps: float = 0.0
    inner_norm_weights: bool = False

    def check_split(self, tp_size: int) -> None:
        """The channels split evenly across ranks."""
        if self.intermediate_size % tp_size:
            raise ValueError(
                f"tensor_parallel_size: {tp_size} does not divide Mamba's {self.intermediate_size} channels"
            )


def mamba_dims(cfg: dict[str, Any]) -> MambaDims:
    """A Mamba (1) model's sizes, MambaConfig's (FalconMambaConfig's) defaults where config.json leaves
    a key out: intermediate_size `expand` x hidden, time_step_rank "auto" ceil(hidden / 16)."""
    hidden = int(cfg["hidden_size"])
    rank = cfg.get("time_step_rank", "auto")
    falcon = architecture_of(cfg) == "FalconMambaForCausalLM"
    return MambaDims(
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or int(cfg.get("expand", 2)) * hidden),
        state_size=int(cfg.get("state_size", 16)),
        conv_width=int(cfg.get("conv_kernel", 4)),
        time_step_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
        conv_bias=bool(cfg.get("use_conv_bias", True)),
        proj_bias=bool(cfg.get("use_bias", False)),
        inner_norm_eps=float(cfg.get("mixer_rms_eps", 1e-6)) if falcon else 0.0,
    )


class MambaMixer(RecurrentLayer):
    """Under tensor parallelism each rank holds its share of the channels (their x and z rows of
    in_proj, convolution taps, dt_proj rows, A and D rows, states); x_proj reads every channel, so its
    ranks' partial sums are all-reduced; out_proj sums the ranks' parts."""

    def __init__(self, dims: MambaDims) -> None:
        super().__init__()
        tp_size = get_tp_size()
        dims.check_split(tp_size)
        self.dims, self.width = dims, dims.conv_width
        self.inner = dims.intermediate_size // tp_size
        channels = rank_rows(self.inner)  # this rank's, of in_proj's x [0, I) and z [I, 2I), and the rest
        in_proj_rows = torch.cat((channels, dims.intermediate_size + channels))
        self.in_proj = ReplicatedLinear(dims.hidden_size, 2 * self.inner, bias=dims.proj_bias)
        for param in (self.in_proj.weight, self.in_proj.bias):
            if param is not None:
                param.weight_loader = rows_loader(in_proj_rows)  # type: ignore[attr-defined]
        self.conv_weight = nn.Parameter(torch.empty(self.inner, dims.conv_width), requires_grad=False)
        self.conv_weight.weight_loader = rows_loader(channels)  # type: ignore[attr-defined]
        self.conv_bias: nn.Parameter | None = None
        if dims.conv_bias:
            self.conv_bias = nn.Parameter(torch.empty(self.inner), requires_grad=False)
            self.conv_bias.weight_loader = rows_loader(channels)  # type: ignore[attr-defined]
        low_rank, size = dims.time_step_rank, dims.state_size
        self.x_proj = RowParallelLinear(dims.intermediate_size, low_rank + 2 * size, bias=False)
        self.dt_proj = ColumnParallelLinear(low_rank, dims.intermediate_size, bias=False)
        # (the checkpoint's dt_proj.bias: added in float32, as transformers adds it)
        self.dt_bias = nn.Parameter(torch.empty(self.inner), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.inner, size), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.inner), requires_grad=False)
        for param in (self.dt_bias, self.A_log, self.D):
            param.weight_loader = rows_loader(channels)  # type: ignore[attr-defined]
        self.out_proj = RowParallelLinear(dims.intermediate_size, dims.hidden_size, bias=dims.proj_bias)
        self.dt_layernorm = self.b_layernorm = self.c_layernorm = None
        if dims.inner_norm_weights:  # (whole on every rank: x_proj's outputs are)
            self.dt_layernorm = RMSNorm(low_rank, dims.inner_norm_eps)
            self.b_layernorm = RMSNorm(size, dims.inner_norm_eps)
            self.c_layernorm = RMSNorm(size, dims.inner_norm_eps)
        self.conv_state: torch.Tensor | None = None  # [rows, width - 1, channels], set by `bind_state`
        self.ssm_state: torch.Tensor | None = None  # [rows, channels, state_size]

    def state_bytes(self, rows: int) -> int:
        per_row = ((self.width - 1) * self.inner + self.inner * self.dims.state_size) * self.D.element_size()
        return rows * per_row

    def bind_state(self, rows: int) -> None:
        dtype, device = self.D.dtype, self.D.device
        self.conv_state = torch.zeros(rows, self.width - 1, self.inner, dtype=dtype, device=device)
        self.ssm_state = torch.zeros(rows, self.inner, self.dims.state_size, dtype=dtype, device=device)

    def reset_state(self, row: int) -> None:
        assert self.conv_state is not None and self.ssm_state is not None, "bind_state() first"
        self.conv_state[row] = 0
        self.ssm_state[row] = 0

    def inner_norms(
        self, low_rank: torch.Tensor, b: torch.Tensor, c: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """FalconMamba's RMS norms (no weight) of the time step's low-rank part, B and C, Jamba's with
        weights (Llama's RMSNorm); none else."""
        eps = self.dims.inner_norm_eps
        if self.dt_layernorm is not None and self.b_layernorm is not None and self.c_layernorm is not None:
            norms = (self.dt_layernorm, self.b_layernorm, self.c_layernorm)
            return tuple(cast(torch.Tensor, norm(t)) for norm, t in zip(norms, (low_rank, b, c), strict=True))
        if not eps:
            return low_rank, b, c
        return tuple(weightless_rms_norm(t, eps) for t in (low_rank, b, c))

    def forward(self, hidden: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        assert self.conv_state is not None, "bind_state() first"
        x, gate = self.in_proj(hidden).split([self.inner, self.inner], dim=-1)
        x = F.silu(
            causal_conv(
                x, self.conv_state, self.conv_weight, self.conv_bias, step.rows, step.windows[self.width]
            )
        )
        size = self.dims.state_size
        low_rank, b, c = self.x_proj(x).split([self.dims.time_step_rank, size, size], dim=-1)
        low_rank, b, c = self.inner_norms(low_rank, b, c)
        dt = F.softplus(self.dt_proj(low_rank).float() + self.dt_bias.float())
        y = self.scan(x.float(), dt, b.float(), c.float(), step)
        return self.out_proj((y * F.silu(gate.float())).to(hidden.dtype))

    def scan(
        self, x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, step: RecurrentStep
    ) -> torch.Tensor:
        """y [tokens, channels] (float32, with D's skip) of the step's tokens, each request's state
        advanced; b and c [tokens, state_size]. On a CPU the C++ kernels scan every request's tokens
        in one call (`cpu_kernels.mamba_scan`), elsewhere `scan_states`."""
        assert self.ssm_state is not None
        a = -torch.exp(self.A_log.float())
        if self.ssm_state.is_cpu and cpu_kernels.load():
            y = cpu_kernels.mamba_scan(self.ssm_state, step.rows, step.token_starts, x, dt, a, b, c)
        else:
            y = scan_states(self.ssm_state, step, x, dt, a, b, c)
        return y + self.D.float() * x


def scan_states(
    states: torch.Tensor,
    step: RecurrentStep,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
) -> torch.Tensor:
    """`cpu_kernels.mamba_scan` in torch (GPUs; CPUs without the C++ kernels): the decodes' states
    advanced together, each prompt's a token at a time (each state its own decay); y [tokens,
    channels] without D's skip."""
    y = torch.empty_like(x)
    rows, tokens = step.single_tokens
    if tokens.numel():  # one token each, advanced together
        state = states[rows].float()
        y[tokens] = advance(state, x[tokens], dt[tokens], a, b[tokens], c[tokens])
        states[rows] = state.to(states.dtype)
    for row, start, n in step.runs:
        state = states[row].float()
        for t in range(start, start + n):
            y[t] = advance(state, x[t], dt[t], a, b[t], c[t])
        states[row] = state.to(states.dtype)
    return y


def advance(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor
) -> torch.Tensor:
    """One token of each of `state`'s sequences ([..., channels, state_size], float32, advanced in
    place): h <- exp(dt A) h + dt x B; returns h . C [..., channels]. x and dt [..., channels], b and c
    [..., state_size]."""
    state.mul_(torch.exp(dt[..., None] * a)).add_((dt * x)[..., None] * b[..., None, :])
    return (state * c[..., None, :]).sum(-1)
