"""Alibaba's Qwen3.5 (`Qwen3_5ForCausalLM`; its mixtures of experts, `Qwen3_5MoeForCausalLM`; and the
text decoders of the Hub's `Qwen3_5ForConditionalGeneration` and `Qwen3_5MoeForConditionalGeneration`
checkpoints, `config.text_decoder_config`): a hybrid of Gated DeltaNet linear attention
(`layers.gated_delta`, a state per request in place of a KV cache) and gated full attention, by
`layer_types` (by default three linear layers, then one full, as `full_attention_interval` 4
reads), every layer then a SwiGLU MLP (experts in the MoE). What it adds to Llama's layer:

- every RMSNorm scales by (1 + weight), in float32 (Gemma's, `GemmaRMSNorm`), the query and key
  heads' too;
- full attention: q_proj gives each head its query and an output gate side by side (a head's
  2 x head_dim rows); q and k normed, then turned over their first quarter (`partial_rotary_factor`
  0.25, theta 1e7 in its configs; M-RoPE's sections turn a text token by its one position), and the
  attention's output times sigmoid(gate) before o_proj.

Qwen3-Next (`Qwen3NextForCausalLM`, Qwen3-Next-80B-A3B), its forerunner, has the same layers and
experts (by `decoder_sparse_step` and `mlp_only_layers`, the others a dense MLP); its checkpoints
store in_proj_qkv and in_proj_z as one tensor (`in_proj_qkvz`) and in_proj_b and in_proj_a as
another (`in_proj_ba`), each interleaved by key head, cut into Qwen3.5's four on load.

The multi-token-prediction layers (`mtp.*`) are left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from pagedserve.config import qwen3_5_layer_types
from pagedserve.layers import ops
from pagedserve.layers.attention import Attention, AttentionBackend, AttentionMetadata
from pagedserve.layers.gated_delta import GatedDeltaDims, GatedDeltaNet
from pagedserve.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedserve.layers.moe import Experts
from pagedserve.layers.recurrent import RecurrentLayer
from pagedserve.models.gemma import GemmaRMSNorm
from pagedserve.models.hybrid import HybridDecoderLayer, attention_of
from pagedserve.models.llama import (
    LayerOptions,
    LlamaAttention,
    LlamaForCausalLM,
    Rotary,
    check_silu,
    head_dim_of,
    rms_norm_eps,
)
from pagedserve.models.moe import num_experts_of, per_expert_weights, qwen_experts


class GatedAttention(LlamaAttention):
    """Qwen3.5's full attention: Llama's with an output gate a head (from q_proj, beside its query),
    q and k normed by (1 + weight) (where `head_norms`), the output times sigmoid(gate) before o_proj."""

    head_norms = True

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        nn.Module.__init__(self)  # (not Llama's projections)
        hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        head_dim = head_dim_of(cfg)
        qkv_bias, o_bias = options.biases
        # each query head's rows and its gate's side by side: q_proj as 2 x num_heads heads (a rank's
        # share of them whole pairs)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, 2 * num_heads, num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=o_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.head_dim = head_dim
        self.q_norm = GemmaRMSNorm(head_dim, rms_norm_eps(cfg)) if self.head_norms else None
        self.k_norm = GemmaRMSNorm(head_dim, rms_norm_eps(cfg)) if self.head_norms else None
        self.rotary = True
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, backend, layer_index)

    def forward(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # each row: [ (q, gate) a head | k heads | v heads ]
        query_gate = qkv[:, : 2 * self.q_size].view(-1, self.num_heads, 2, self.head_dim)
        k = qkv[:, 2 * self.q_size : 2 * self.q_size + self.kv_size].view(
            -1, self.num_kv_heads, self.head_dim
        )
        q = query_gate[:, :, 0]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = cast(GemmaRMSNorm, self.q_norm).normed(q), cast(GemmaRMSNorm, self.k_norm).normed(k)
        q, k = ops.apply_rotary(q, *rotary[:2]), ops.apply_rotary(k, *rotary[:2])
        out = self.attn(q, k, qkv[:, 2 * self.q_size + self.kv_size :], metadata)
        gate = query_gate[:, :, 1].reshape(out.shape)
        return self.o_proj(out * torch.sigmoid(gate))


class Qwen3_5DecoderLayer(HybridDecoderLayer):
    attention_class = GatedAttention

    @staticmethod
    def norm(cfg: dict[str, Any]) -> GemmaRMSNorm:
        return GemmaRMSNorm(cfg["hidden_size"], rms_norm_eps(cfg))

    def recurrent_mixer(self, cfg: dict[str, Any], layer_index: int) -> RecurrentLayer:
        return GatedDeltaNet(gated_delta_dims(cfg))


def gated_delta_dims(cfg: dict[str, Any]) -> GatedDeltaDims:
    """Qwen3_5TextConfig's defaults where config.json leaves a key out."""
    return GatedDeltaDims(
        hidden_size=cfg["hidden_size"],
        num_k_heads=int(cfg.get("linear_num_key_heads", 16)),
        num_v_heads=int(cfg.get("linear_num_value_heads", 32)),
        head_k_dim=int(cfg.get("linear_key_head_dim", 128)),
        head_v_dim=int(cfg.get("linear_value_head_dim", 128)),
        conv_width=int(cfg.get("linear_conv_kernel_dim", 4)),
        norm_eps=rms_norm_eps(cfg),
    )


# the checkpoint's linear-attention names -> ours
_NAMES = {
    ".linear_attn.conv1d.weight": ".mixer.conv_weight",
    ".linear_attn.norm.weight": ".mixer.norm_weight",
    ".linear_attn.": ".mixer.",
}


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Qwen3_5DecoderLayer
    stacked_params = {
        **LlamaForCausalLM.stacked_params,
        # the linear attention's four input projections as one (`GatedDeltaNet.in_proj`)
        "in_proj_qkv": ("in_proj", "qkv"),
        "in_proj_z": ("in_proj", "z"),
        "in_proj_b": ("in_proj", "b"),
        "in_proj_a": ("in_proj", "a"),
    }
    rotates_part_of_a_head = True
    default_partial_rotary = 0.25  # Qwen3_5TextConfig's

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        cfg = {
            **cfg,
            "layer_types": qwen3_5_layer_types(cfg),
            "head_dim": head_dim_of({"head_dim": 256, **cfg}),
            "rms_norm_eps": rms_norm_eps({"rms_norm_eps": 1e-6, **cfg}),
        }
        super().__init__(cfg, max_position, backend)

    @property
    def attention_layers(self) -> list[Attention]:
        return attention_of(self.layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_served(weights))


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5's mixtures of experts: its layers, every MLP `num_experts` experts (256) of
    `moe_intermediate_size` (512), `num_experts_per_tok` (8) a token weighted by their softmax
    renormalized over the top k, beside a shared expert (`shared_expert_intermediate_size`, 512)
    under a sigmoid gate (Qwen2-MoE's); the experts stacked (transformers 5) or one by one."""

    def layer_options(self, cfg: dict[str, Any]) -> list[LayerOptions]:
        check_silu(cfg)
        spec = Experts(
            num_experts=int(cfg.get("num_experts", 256)),
            top_k=int(cfg.get("num_experts_per_tok", 8)),
            intermediate_size=int(cfg.get("moe_intermediate_size", 512)),
            renormalize=True,
            shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 512)),
        )
        return [dataclasses.replace(options, experts=spec) for options in super().layer_options(cfg)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(per_expert_weights(weights, hidden_size=self.embed_tokens.weight.shape[1]))


# Qwen3NextConfig's experts where config.json leaves a key out
QWEN3_NEXT_EXPERTS = Experts(
    num_experts=512, top_k=10, intermediate_size=512, renormalize=True, shared_intermediate_size=512
)


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: Qwen3.5's layers; every `decoder_sparse_step`-th MLP (1) but `mlp_only_layers`
    `num_experts` experts (512, 10 a token, weights renormalized where `norm_topk_prob`, by default)
    beside a shared expert under a sigmoid gate, the others (every one where num_experts is 0) a
    dense MLP of `intermediate_size`; the linear attention's projections fused by key head
    (`_unfused`)."""

    def layer_options(self, cfg: dict[str, Any]) -> list[LayerOptions]:
        check_silu(cfg)
        if num_experts_of(cfg, QWEN3_NEXT_EXPERTS.num_experts):
            experts = qwen_experts(cfg, QWEN3_NEXT_EXPERTS)
        else:
            experts = [None] * cfg["num_hidden_layers"]
        return [
            dataclasses.replace(options, experts=spec)
            for options, spec in zip(super().layer_options(cfg), experts, strict=True)
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = per_expert_weights(weights, hidden_size=self.embed_tokens.weight.shape[1])
        mixers = [cast(GatedDeltaNet, layer) for layer in self.recurrent_layers]
        super().load_weights(_unfused(weights, mixers[0].dims) if mixers else weights)


def _unfused(
    weights: Iterable[tuple[str, torch.Tensor]], dims: GatedDeltaDims
) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-Next's in_proj_qkvz (each key head's rows: its query, its key, then the values and the
    gates of the num_v_heads / num_k_heads value heads it serves) as Qwen3.5's in_proj_qkv (every
    query, every key, every value) and in_proj_z; its in_proj_ba (each key head's value heads' b,
    then their a) as in_proj_b and in_proj_a."""
    served = dims.num_v_heads // dims.num_k_heads
    values = served * dims.head_v_dim
    for name, tensor in weights:
        if name.endswith(".linear_attn.in_proj_qkvz.weight"):
            by_key_head = tensor.unflatten(0, (dims.num_k_heads, -1))
            q, k, v, z = by_key_head.split([dims.head_k_dim, dims.head_k_dim, values, values], dim=1)
            qkv = torch.cat([part.flatten(0, 1) for part in (q, k, v)])
            yield name.replace(".in_proj_qkvz.", ".in_proj_qkv."), qkv
            yield name.replace(".in_proj_qkvz.", ".in_proj_z."), z.flatten(0, 1)
        elif name.endswith(".linear_attn.in_proj_ba.weight"):
            b, a = tensor.unflatten(0, (dims.num_k_heads, -1)).split([served, served], dim=1)
            yield name.replace(".in_proj_ba.", ".in_proj_b."), b.flatten(0, 1)
            yield name.replace(".in_proj_ba.", ".in_proj_a."), a.flatten(0, 1)
        else:
            yield name, tensor


def _served(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith("mtp."):  # (multi-token prediction: not served)
            continue
        for theirs, ours in _NAMES.items():
            if theirs in name:
                name = name.replace(theirs, ours)
                break
        yield name, tensor
