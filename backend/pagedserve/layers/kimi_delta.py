"""Kimi Delta Attention (KDA: the linear-attention layers of Moonshot's Kimi Linear), the gated delta
rule with a decay a key channel where Gated DeltaNet has one a head (`layers.gated_delta`, whose
state, convolution and scan it shares).

q_proj, k_proj and v_proj give each token `num_heads` heads of `head_dim` each (as many key heads as
value heads), through a causal depthwise convolution (the checkpoint's q_conv1d, k_conv1d and v_conv1d,
or transformers' one conv1d) then SiLU; queries and keys L2-normed, queries scaled by head_dim^-1/2.
Each head keeps a state S [head_dim, head_dim], advanced by every token as

    S <- diag(exp(g)) S,    S <- S + k (beta (v - S^T k))^T,    o = S^T q,
    beta = sigmoid(b_proj x),    g = -exp(A_log) softplus(f_b_proj(f_a_proj x) + dt_bias)

g a channel's (dt_bias one a channel, in float32; A_log one a head), f_a_proj a low-rank bottleneck
of head_dim. o, RMS-normed over each head in float32, times the norm's weight, gated by the sigmoid of
g_b_proj(g_a_proj x), all in float32 and rounded once (transformers' KimiLinearRMSNormGated), then
o_proj.

Under tensor parallelism each rank holds its share of the heads: their rows of q, k, v, b, f_b, g_b,
the convolution, dt_bias and A_log, their states; f_a_proj and g_a_proj whole on every rank; o_proj
sums the ranks' parts. Decodes advance as Gated DeltaNet's do (the C++ kernel, `delta_rule_step`
where it does not build), a decay a channel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.gated_delta import DeltaRuleLayer, GatedDeltaDims
from pagedserve.layers.linear import ReplicatedLinear, RowParallelLinear
from pagedserve.layers.recurrent import RecurrentStep, rank_rows, rows_loader

# the chunked rule's chunk: each chunk's pairwise channel decays take [heads, C, C, head_dim] floats
KDA_CHUNK = 32


class KimiDeltaAttention(DeltaRuleLayer):
    def __init__(self, dims: GatedDeltaDims) -> None:
        super().__init__(dims)
        if dims.num_k_heads != dims.num_v_heads or dims.head_k_dim != dims.head_v_dim:
            raise ValueError("model: Kimi Delta Attention has as many key heads as value heads, of one size")
        head_dim, heads = dims.head_k_dim, rank_rows(self.num_v_heads)
        channels, every = rank_rows(self.key_dim), torch.arange(head_dim)
        self.set_in_proj(
            {"q": channels, "k": channels, "v": channels, "b": heads, "f_a": every, "g_a": every}
        )
        # the low-rank up-projections: this rank's channels
        self.f_b_proj = ReplicatedLinear(head_dim, self.key_dim, bias=False)
        self.g_b_proj = ReplicatedLinear(head_dim, self.value_dim, bias=False)
        for linear in (self.f_b_proj, self.g_b_proj):
            linear.weight.weight_loader = rows_loader(channels)  # type: ignore[attr-defined]
        self.dt_bias = nn.Parameter(torch.empty(self.key_dim, dtype=torch.float32), requires_grad=False)
        self.dt_bias.weight_loader = rows_loader(channels)  # type: ignore[attr-defined]
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log.weight_loader = lambda param, loaded: param.data.copy_(loaded.reshape(-1)[heads])  # type: ignore[attr-defined]
        self.norm_weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)  # (every head's)
        self.out_proj = RowParallelLinear(dims.num_v_heads * head_dim, dims.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        head_dim = self.dims.head_k_dim
        qkv, b, forget, gate = self.in_proj(hidden).split(
            [self.conv_dim, self.num_v_heads, head_dim, head_dim], dim=-1
        )
        q, k, v = self.conv_qkv(qkv, step)
        decay_rate = self.f_b_proj(forget).float() + self.dt_bias
        g = -torch.exp(self.A_log.float())[:, None] * F.softplus(decay_rate.unflatten(-1, (-1, head_dim)))
        o = self.scan(q, k, v, g, torch.sigmoid(b).float(), step)
        return self.out_proj(self.gated_norm(o.to(hidden.dtype), self.g_b_proj(gate)).flatten(1))

    def gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Each head of o RMS-normed, times the weight, gated by sigmoid(gate), in float32 throughout,
        rounded once to o's dtype."""
        normed = F.rms_norm(o.float(), (o.shape[-1],), eps=self.dims.norm_eps) * self.norm_weight.float()
        return (normed * torch.sigmoid(gate.unflatten(-1, (-1, o.shape[-1])).float())).to(o.dtype)
