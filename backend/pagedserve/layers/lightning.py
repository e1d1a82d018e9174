"""Lightning attention (MiniMax-Text-01's and MiniMax-M1's linear-attention layers), with the state it
carries for each request from step to step (`layers.recurrent`).

qkv_proj gives each head its query, key and value (side by side a head), each through SiLU. Each
head h keeps a state S [head_dim, head_dim], decayed by a rate of its own at every token,

    S <- exp(-s_h) S + k v^T,    o = S^T q,
    s_h = (2^(-8 / heads))^(h + 1) x (1 - layer / (layers - 1 + 1e-5) + 1e-5)

(the rates fall head by head, and layer by layer from the first to the last). o, RMS-normed over all
heads at once (across ranks), gated by the sigmoid of `output_gate`, goes through out_proj.

A step's one-token sequences (decodes) advance together, in the states' dtype (the model's, as
transformers' cache keeps and advances them); each longer one (a prompt or a chunk of one) runs the
chunked form (`chunked_lightning`) in float32: within a chunk its outputs are a decayed, masked
attention of q over k, plus the state before the chunk read through q; chunk to chunk, the state
carries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed import all_reduce, get_tp_rank, get_tp_size
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.layers.recurrent import RecurrentLayer, RecurrentStep, rank_rows, rows_loader


@dataclass(frozen=True)
class LightningDims:
    hidden_size: int
    num_heads: int
    head_dim: int
    layer_index: int  # (the decay rates fall with it)
    num_layers: int
    norm_eps: float = 1e-6
    chunk_size: int = 64

    def check_split(self, tp_size: int) -> None:
        if self.num_heads % tp_size:
            raise ValueError(
                f"tensor_parallel_size: {tp_size} does not divide the {self.num_heads} lightning-attention heads"
            )

    def decay_rates(self) -> torch.Tensor:
        """[heads] float32: each head's s_h, as transformers computes it."""
        base = 1 / (2 ** (8 / self.num_heads))
        factor = 1 - self.layer_index / (self.num_layers - 1 + 1e-5) + 1e-5
        return base ** torch.arange(1, self.num_heads + 1) * factor


class LightningAttention(RecurrentLayer):
    """Under tensor parallelism each rank holds its share of the heads (their rows of qkv_proj,
    output_gate and the norm's weight, their decay rates, their states); the norm's sum of squares is
    all-reduced, out_proj sums the ranks' parts."""

    width = 1  # (no convolution)

    def __init__(self, dims: LightningDims) -> None:
        super().__init__()
        tp_size = get_tp_size()
        dims.check_split(tp_size)
        self.dims, self.num_heads, self.head_dim = dims, dims.num_heads // tp_size, dims.head_dim
        inner = dims.num_heads * dims.head_dim
        self.qkv_proj = ColumnParallelLinear(dims.hidden_size, 3 * inner)
        self.output_gate = ColumnParallelLinear(dims.hidden_size, inner)
        self.out_proj = RowParallelLinear(inner, dims.hidden_size)
        self.norm_weight = nn.Parameter(torch.ones(inner // tp_size), requires_grad=False)
        self.norm_weight.weight_loader = rows_loader(rank_rows(inner // tp_size))  # type: ignore[attr-defined]
        rank = get_tp_rank()
        rates = dims.decay_rates()[rank * self.num_heads : (rank + 1) * self.num_heads]
        self.rates: torch.Tensor  # (in the model's dtype, as transformers' buffers are)
        self.register_buffer("rates", rates, persistent=False)
        self.state: torch.Tensor | None = None  # [rows, heads, head_dim, head_dim], set by `bind_state`

    def state_bytes(self, rows: int) -> int:
        return rows * self.num_heads * self.head_dim**2 * self.norm_weight.element_size()

    def bind_state(self, rows: int) -> None:
        weight = self.norm_weight
        shape = (rows, self.num_heads, self.head_dim, self.head_dim)
        self.state = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        # a decode step's decay of each head's state, once (the rates are fixed)
        self.step_decay = torch.exp(-self.rates.float()).to(weight.dtype)[:, None, None]

    def reset_state(self, row: int) -> None:
        assert self.state is not None, "bind_state() first"
        self.state[row] = 0

    def forward(self, hidden: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        qkv = F.silu(self.qkv_proj(hidden)).unflatten(-1, (self.num_heads, 3 * self.head_dim))
        q, k, v = qkv.float().split(self.head_dim, dim=-1)
        o = self.scan(q, k, v, step).to(hidden.dtype).flatten(1)
        return self.out_proj(torch.sigmoid(self.output_gate(hidden)) * self.normed(o))

    def normed(self, o: torch.Tensor) -> torch.Tensor:
        """o RMS-normed over all heads (every rank's), in float32, rounded, times the weight."""
        o32 = o.float()
        squares = o32.pow(2).sum(-1, keepdim=True)
        if get_tp_size() > 1:
            squares = all_reduce(squares)
        width = self.dims.num_heads * self.head_dim
        return (o32 * torch.rsqrt(squares / width + self.dims.norm_eps)).to(o.dtype) * self.norm_weight

    def scan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        """o [tokens, heads, head_dim] (float32) of the step's tokens, each request's state advanced."""
        assert self.state is not None, "bind_state() first"
        o = torch.empty_like(v)
        rows, tokens = step.single_tokens
        if tokens.numel():  # (in the states' dtype, as transformers advances its cache: a float32 copy
            # of every state, 64 KB a head, took ~8x as long on a CPU)
            dtype = self.state.dtype
            state = self.state[rows]
            state.mul_(self.step_decay)
            state.add_(k[tokens].to(dtype).unsqueeze(-1) * v[tokens].to(dtype).unsqueeze(-2))
            o[tokens] = torch.einsum("nhd,nhde->nhe", q[tokens].to(dtype), state).float()
            self.state[rows] = state
        for row, start, n in step.runs:
            span = slice(start, start + n)
            o[span], state = chunked_lightning(
                q[span], k[span], v[span], self.rates.float(), self.state[row].float(), self.dims.chunk_size
            )
            self.state[row] = state.to(self.state.dtype)
        return o


def chunked_lightning(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rates: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's outputs [tokens, heads, head_dim] and its state after them, from q, k, v
    [tokens, heads, head_dim], the heads' decay rates [heads] and its state before them [heads,
    head_dim, head_dim], all float32, `chunk_size` tokens at a time."""
    outputs = []
    rate = rates[:, None]  # [heads, 1]
    for start in range(0, q.shape[0], chunk_size):
        qc, kc, vc = (x[start : start + chunk_size].transpose(0, 1) for x in (q, k, v))  # [heads, L, d]
        size = qc.shape[1]
        position = torch.arange(1, size + 1, dtype=torch.float32, device=q.device)
        apart = position[:, None] - position[None, :]  # query's position less key's
        decay = torch.where(apart >= 0, torch.exp(-rate[:, :, None] * apart.clamp(min=0)), 0.0)
        within = ((qc @ kc.transpose(1, 2)) * decay) @ vc
        before = (qc * torch.exp(-rate * position)[..., None]) @ state
        outputs.append((within + before).transpose(0, 1))
        state = (
            state * torch.exp(-rate * size)[..., None]
            + (kc * torch.exp(-rate * (size - position))[..., None]).transpose(1, 2) @ vc
        )
    return torch.cat(outputs), state
