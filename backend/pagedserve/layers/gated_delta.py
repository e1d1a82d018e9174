"""The gated delta rule's linear attention (Gated DeltaNet: the linear-attention layers of Qwen3.5 and
Qwen3-Next), with the state it carries for each request from step to step (`layers.recurrent`);
`DeltaRuleLayer` is what it shares with Kimi Linear's (`layers.kimi_delta`), whose decay is a key
channel's (`chunked_channel_delta_rule`).

in_proj_qkv gives each token the inputs of a causal depthwise convolution (then SiLU) that split into
queries and keys (`num_k_heads` of `head_k_dim`) and values (`num_v_heads` of `head_v_dim`, each key
head shared by num_v_heads / num_k_heads of them); in_proj_z a gate, in_proj_b and in_proj_a a beta
and a decay a value head. Queries and keys are L2-normed, queries scaled by head_k_dim^-1/2. Each value
head keeps a state S [head_k_dim, head_v_dim], advanced by every token as

    S <- exp(g) S,    S <- S + k (beta (v - S^T k))^T,    o = S^T q,
    beta = sigmoid(b),    g = -exp(A_log) softplus(a + dt_bias)

and o, RMS-normed over each head then gated by SiLU(z), goes through out_proj. A request keeps its
convolution's last inputs and every value head's S.

A step's one-token sequences (decodes) advance together, in two passes over their states where the
C++ kernels build (`cpu_kernels.gated_delta_decode`), else through `delta_rule_step`; each longer one (a prompt or a chunk of one)
runs the rule's chunked form (`chunked_delta_rule`): within a chunk the updates are solved at once as
a triangular system, chunk to chunk the state carries. Both in float32, the states kept in the
model's dtype (as vLLM keeps them by default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pagedserve_kernels import cpu as cpu_kernels
from torch import nn

from pagedserve.distributed import get_tp_size
from pagedserve.layers.linear import ReplicatedLinear, RowParallelLinear
from pagedserve.layers.recurrent import RecurrentLayer, RecurrentStep, causal_conv, rank_rows, rows_loader

L2_NORM_EPS = 1e-6  # the rule's L2 norm of queries and keys (FLA's and transformers')


@dataclass(frozen=True)
class GatedDeltaDims:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_width: int
    norm_eps: float
    chunk_size: int = 64

    def check_split(self, tp_size: int) -> None:
        """Key heads split evenly across ranks (and so their value heads)."""
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"model: config.json's {self.num_k_heads} linear-attention key heads do not divide its "
                f"{self.num_v_heads} value heads"
            )
        if self.num_k_heads % tp_size:
            raise ValueError(
                f"tensor_parallel_size: {tp_size} does not divide the {self.num_k_heads} linear-attention key heads"
            )


class DeltaRuleLayer(RecurrentLayer):
    """What the delta rule's layers share (`GatedDeltaNet`; Kimi Linear's, `layers.kimi_delta`): this
    rank's share of the key heads and of the value heads they serve, a causal convolution over their
    queries, keys and values (`conv_weight`: this rank's rows of the checkpoint's [q | k | v]), a
    state per request and value head, and one input projection (`in_proj`) of the parts
    `in_proj_parts` names, each this rank's rows of a checkpoint tensor (`load_in_proj`)."""

    in_proj: ReplicatedLinear

    def __init__(self, dims: GatedDeltaDims) -> None:
        super().__init__()
        tp_size = get_tp_size()
        dims.check_split(tp_size)
        self.dims, self.width = dims, dims.conv_width
        self.num_k_heads, self.num_v_heads = dims.num_k_heads // tp_size, dims.num_v_heads // tp_size
        self.key_dim, self.value_dim = self.num_k_heads * dims.head_k_dim, self.num_v_heads * dims.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        full_key = dims.num_k_heads * dims.head_k_dim
        keys, values = rank_rows(self.key_dim), rank_rows(self.value_dim)
        self.qkv_rows = torch.cat((keys, full_key + keys, 2 * full_key + values))
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, dims.conv_width), requires_grad=False)
        self.conv_weight.weight_loader = rows_loader(self.qkv_rows)  # type: ignore[attr-defined]
        self.in_proj_parts: dict[str, torch.Tensor] = {}  # set by `set_in_proj`
        self.in_proj_sizes: list[int] = []
        self.conv_state: torch.Tensor | None = None  # [rows, width - 1, conv_dim], set by `bind_state`
        self.delta_state: torch.Tensor | None = None  # [rows, v heads, head_k_dim, head_v_dim]

    def set_in_proj(self, parts: dict[str, torch.Tensor]) -> None:
        """`in_proj`: the checkpoint's `parts` (each its rows on this rank) as one matmul, in order."""
        self.in_proj_parts = parts
        self.in_proj_sizes = [len(rows) for rows in parts.values()]
        self.in_proj = ReplicatedLinear(self.dims.hidden_size, sum(self.in_proj_sizes), bias=False)
        self.in_proj.weight.weight_loader = self.load_in_proj  # type: ignore[attr-defined]

    def load_in_proj(self, param: nn.Parameter, loaded: torch.Tensor, part: str) -> None:
        """The checkpoint's projection `part`: this rank's rows of it, in its place in `in_proj`."""
        start = 0
        for name, rows in self.in_proj_parts.items():
            if name == part:
                param.data[start : start + len(rows)].copy_(loaded[rows])
                return
            start += len(rows)
        raise ValueError(f"no in_proj part {part!r}")

    def state_bytes(self, rows: int) -> int:
        conv = (self.width - 1) * self.conv_dim
        delta = self.num_v_heads * self.dims.head_k_dim * self.dims.head_v_dim
        return rows * (conv + delta) * self.conv_weight.element_size()

    def bind_state(self, rows: int) -> None:
        dtype, device = self.conv_weight.dtype, self.conv_weight.device
        self.conv_state = torch.zeros(rows, self.width - 1, self.conv_dim, dtype=dtype, device=device)
        shape = (rows, self.num_v_heads, self.dims.head_k_dim, self.dims.head_v_dim)
        self.delta_state = torch.zeros(shape, dtype=dtype, device=device)

    def reset_state(self, row: int) -> None:
        assert self.conv_state is not None and self.delta_state is not None, "bind_state() first"
        self.conv_state[row] = 0
        self.delta_state[row] = 0

    def conv_qkv(
        self, qkv: torch.Tensor, step: RecurrentStep
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k [tokens, v heads, head_k_dim] (L2-normed, q scaled by head_k_dim^-1/2, each key head
        repeated for its value heads) and v [tokens, v heads, head_v_dim], in float32, from the
        projected [q | k | v] through the convolution and SiLU (the requests' convolution states
        advanced)."""
        assert self.conv_state is not None, "bind_state() first"
        dims = self.dims
        qkv = causal_conv(qkv, self.conv_state, self.conv_weight, None, step.rows, step.windows[self.width])
        q, k, v = F.silu(qkv).float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        repeat = self.num_v_heads // self.num_k_heads
        q = l2_normed(q.unflatten(-1, (self.num_k_heads, dims.head_k_dim))) * dims.head_k_dim**-0.5
        k = l2_normed(k.unflatten(-1, (self.num_k_heads, dims.head_k_dim)))
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        return q, k, v.unflatten(-1, (self.num_v_heads, dims.head_v_dim))

    def scan(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        step: RecurrentStep,
    ) -> torch.Tensor:
        """o [tokens, v heads, head_v_dim] (float32) of the step's tokens, each request's state advanced;
        q and k [tokens, v heads, head_k_dim] (each key head repeated for its value heads); g the decay
        [tokens, v heads] a head's, or [tokens, v heads, head_k_dim] a key channel's (Kimi's)."""
        assert self.delta_state is not None
        o = torch.empty_like(v)
        rows, tokens = step.single_tokens
        if tokens.numel() and self.delta_state.is_cpu and cpu_kernels.load():
            o[tokens] = cpu_kernels.gated_delta_decode(
                self.delta_state, rows, q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens]
            )
        elif tokens.numel():
            state = self.delta_state[rows].float()
            o[tokens] = delta_rule_step(state, q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens])
            self.delta_state[rows] = state.to(self.delta_state.dtype)
        rule = chunked_channel_delta_rule if g.dim() == 3 else chunked_delta_rule
        for row, start, n in step.runs:
            span = slice(start, start + n)
            o[span], state = rule(
                q[span],
                k[span],
                v[span],
                g[span],
                beta[span],
                self.delta_state[row].float(),
                self.dims.chunk_size,
            )
            self.delta_state[row] = state.to(self.delta_state.dtype)
        return o


class GatedDeltaNet(DeltaRuleLayer):
    """Qwen3.5's: in_proj_qkv, in_proj_z, in_proj_b and in_proj_a one matmul. Under tensor parallelism
    each rank holds its share of the key heads and of the value heads they serve: their rows of the
    projections and the convolution, their A_log and dt_bias, their states; out_proj sums the ranks'
    parts."""

    def __init__(self, dims: GatedDeltaDims) -> None:
        super().__init__(dims)
        values, heads = rank_rows(self.value_dim), rank_rows(self.num_v_heads)
        self.set_in_proj({"qkv": self.qkv_rows, "z": values, "b": heads, "a": heads})
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        for param in (self.dt_bias, self.A_log):
            param.weight_loader = rows_loader(heads)  # type: ignore[attr-defined]
        self.norm_weight = nn.Parameter(torch.ones(dims.head_v_dim), requires_grad=False)  # (every head's)
        self.out_proj = RowParallelLinear(dims.num_v_heads * dims.head_v_dim, dims.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        qkv, z, b, a = self.in_proj(hidden).split(self.in_proj_sizes, dim=-1)
        q, k, v = self.conv_qkv(qkv, step)
        beta = torch.sigmoid(b).float()
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        o = self.scan(q, k, v, g, beta, step)
        return self.out_proj(self.gated_norm(o.to(hidden.dtype), z).flatten(1))

    def gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Each head of o RMS-normed (in float32, rounded to o's dtype), times the weight in o's dtype,
        then gated by SiLU(z) in float32 and rounded once (transformers' Qwen3_5RMSNormGated)."""
        normed = F.rms_norm(o.float(), (o.shape[-1],), eps=self.dims.norm_eps).to(o.dtype) * self.norm_weight
        gate = F.silu(z.unflatten(-1, (self.num_v_heads, self.dims.head_v_dim)).float())
        return (normed.float() * gate).to(o.dtype)


def l2_normed(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_NORM_EPS)


def delta_rule_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """One token of each sequence: `state` [sequences, heads, dk, dv] advanced in place, its output
    [sequences, heads, dv] returned; g [sequences, heads] a head's decay, or [sequences, heads, dk] a
    key channel's."""
    state.mul_(torch.exp(g)[..., None] if g.dim() == 3 else torch.exp(g)[..., None, None])
    predicted = torch.einsum("nhkv,nhk->nhv", state, k)
    state.add_(k[..., :, None] * ((v - predicted) * beta[..., None])[..., None, :])
    return torch.einsum("nhkv,nhk->nhv", state, q)


def in_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[tokens, heads, ...] -> [heads, chunks, chunk_size, ...], the last chunk padded with zeros (a
    padded token's beta and g are 0: it changes no state)."""
    padded = torch.cat((x, x.new_zeros(-x.shape[0] % chunk_size, *x.shape[1:])))
    return padded.transpose(0, 1).unflatten(1, (-1, chunk_size))


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens [tokens, heads, ...] from `state` [heads, dk, dv]: (its outputs [tokens,
    heads, dv], the state after them). In a chunk of C tokens with G_t the sum of g up to t, token t's
    update u_t = beta_t (v_t - S_t^T k_t) reads the state the chunk's earlier updates left, so the
    chunk's updates solve (I + L) U = beta (V - exp(G) K S) with L[t, s] = beta_t exp(G_t - G_s) k_t.k_s
    for s < t; then o_t = exp(G_t) S^T q_t + sum over s <= t of exp(G_t - G_s) (q_t.k_s) u_s and the
    state leaves as exp(G_C) S + sum of exp(G_C - G_s) k_s u_s^T."""
    num_tokens = q.shape[0]
    q, k, v, g, beta = (in_chunks(x, chunk_size) for x in (q, k, v, g, beta))
    cumulative = g.cumsum(-1)
    decay = (cumulative[..., :, None] - cumulative[..., None, :]).tril().exp().tril()  # [.., t, s]
    strictly_lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril(-1)
    k_beta = k * beta[..., None]
    system = torch.where(strictly_lower, (k_beta @ k.transpose(-1, -2)) * decay, 0.0)
    system = system + torch.eye(chunk_size, device=q.device)
    # U = W (beta V) - W (beta exp(G) K) S, W = (I + L)^-1
    updates_free = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False)
    updates_per_state = torch.linalg.solve_triangular(
        system, k_beta * cumulative.exp()[..., None], upper=False
    )
    attention = (q @ k.transpose(-1, -2)) * decay  # (t >= s)
    q_decayed = q * cumulative.exp()[..., None]
    k_to_end = k * (cumulative[..., -1:] - cumulative).exp()[..., None]
    chunk_decay = cumulative[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        updates = updates_free[:, c] - updates_per_state[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + attention[:, c] @ updates
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ updates
    return out.flatten(1, 2)[:, :num_tokens].transpose(0, 1), state


def chunked_channel_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_delta_rule` with a decay a key channel (g [tokens, heads, dk]: Kimi Linear's), S's row
    d decayed by exp(g_d): in a chunk each pair (t, s <= t) decays channel d by exp(G_t,d - G_s,d),
    summed into L[t, s] = beta_t sum_d k_t,d k_s,d exp(G_t,d - G_s,d) (s < t) and the queries' weights
    sum_d q_t,d k_s,d exp(G_t,d - G_s,d) (s <= t), each chunk's [heads, C, C, dk] differences taken
    under the mask before exp (no exp(-G) to overflow); the rest as the scalar rule's, exp(G) a row of
    S at a time."""
    num_tokens = q.shape[0]
    q, k, v, g, beta = (in_chunks(x, chunk_size) for x in (q, k, v, g, beta))
    cumulative = g.cumsum(2)  # [heads, chunks, C, dk]
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(chunk_size, device=q.device)
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        G = cumulative[:, c]
        differences = G[:, :, None, :] - G[:, None, :, :]  # [heads, t, s, dk]
        pair_decay = differences.masked_fill(~lower[:, :, None], float("-inf")).exp()
        k_c, q_c, beta_c = k[:, c], q[:, c], beta[:, c]
        kk = torch.einsum("htd,hsd,htsd->hts", k_c, k_c, pair_decay)
        system = eye + torch.tril(kk, diagonal=-1) * beta_c[..., None]
        k_beta = k_c * beta_c[..., None]
        updates_free = torch.linalg.solve_triangular(system, v[:, c] * beta_c[..., None], upper=False)
        updates_per_state = torch.linalg.solve_triangular(system, k_beta * G.exp(), upper=False)
        updates = updates_free - updates_per_state @ state
        attention = torch.einsum("htd,hsd,htsd->hts", q_c, k_c, pair_decay)
        out[:, c] = (q_c * G.exp()) @ state + attention @ updates
        to_end = (G[:, -1:] - G).exp()  # [heads, C, dk]
        state = state * G[:, -1].exp()[..., None] + (k_c * to_end).transpose(-1, -2) @ updates
    return out.flatten(1, 2)[:, :num_tokens].transpose(0, 1), state
