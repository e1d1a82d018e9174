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
from pagedserve.models.moe import per_expert_weights


class GatedAttention(LlamaAttention):
    """Qwen3.5's full attention: Llama's with an output gate a head (from q_proj, beside its query),
    q and k normed by (1 + weight), the output times sigmoid(gate) before o_proj."""

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
        self.q_norm = GemmaRMSNorm(head_dim, rms_norm_eps(cfg))
        self.k_norm = GemmaRMSNorm(head_dim, rms_norm_eps(cfg))
        self.rotary = True
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, backend, layer_index)

    def forward(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # each row: [ (q, gate) a head | k heads | v heads ]
        query_gate = qkv[:, : 2 * self.q_size].view(-1, self.num_heads, 2, self.head_dim)
        k = qkv[:, 2 * self.q_size : 2 * self.q_size + self.kv_size].view(
            -1, self.num_kv_heads, self.head_dim
        )
        q_norm, k_norm = cast(GemmaRMSNorm, self.q_norm), cast(GemmaRMSNorm, self.k_norm)
        q, k = q_norm.normed(query_gate[:, :, 0]), k_norm.normed(k)
        q, k = ops.apply_rotary(q, *rotary[:2]), ops.apply_rotary(k, *rotary[:2])
        out = self.attn(q, k, qkv[:, 2 * self.q_size + self.kv_size :], metadata)
        gate = query_gate[:, :, 1].reshape(out.shape)
        return self.o_proj(out * torch.sigmoid(gate))


class Qwen3_5DecoderLayer(HybridDecoderLayer):
    attention_class = GatedAttention

    @staticmethod
    def norm(cfg: dict[str, Any]) -> GemmaRMSNorm:
        return GemmaRMSNorm(cfg["hidden_size"], rms_norm_eps(cfg))

    def recurrent_mixer(self, cfg: dict[str, Any]) -> RecurrentLayer:
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


def _served(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith("mtp."):  # (multi-token prediction: not served)
            continue
        for theirs, ours in _NAMES.items():
            if theirs in name:
                name = name.replace(theirs, ours)
                break
        yield name, tensor
