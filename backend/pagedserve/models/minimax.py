"""MiniMax-M2 (`MiniMaxM2ForCausalLM`: MiniMax-M2, M2.1) as transformers computes it, on the Llama
family's tensor-parallel layers. What it adds to Mixtral's layer:

- q and k RMS-normed over the whole projection (all query heads together, all key heads), each norm
  multiplied by its weight in float32 (OLMo 2's norms: `models.olmo.OlmoAttention`), before the rotation;
- NeoX's rotary over the first `rotary_dim` dimensions of each head (64 of 128), the rest as they are;
- every MLP `num_local_experts` experts (256), `num_experts_per_tok` a token (8), each scored by the
  sigmoid of its logit and picked by its score plus the router's `e_score_correction_bias`, the picked
  scores renormalized; no shared expert; the router in float32 (vLLM's).

The checkpoints' next-token prediction layers (numbered past `num_hidden_layers`) are left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedserve.config import rope_parameters
from pagedserve.layers.attention import AttentionBackend
from pagedserve.layers.moe import Experts
from pagedserve.models.llama import LlamaDecoderLayer, head_dim_of
from pagedserve.models.moe import MoeForCausalLM, num_experts_of, past_layer, sigmoid_biased_experts
from pagedserve.models.olmo import OlmoAttention


class MiniMaxM2Attention(OlmoAttention):
    """Llama's attention with q and k normed whole (in float32), turned by the model's rope."""


class MiniMaxM2DecoderLayer(LlamaDecoderLayer):
    attention_class = MiniMaxM2Attention


class MiniMaxM2ForCausalLM(MoeForCausalLM):
    """MiniMax-M2 (see the module docstring); MiniMaxM2Config's defaults where config.json leaves a key
    out."""

    decoder_layer_class = MiniMaxM2DecoderLayer
    rotates_part_of_a_head = True

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        norm_type = cfg.get("qk_norm_type", "per_layer")
        if norm_type != "per_layer":
            raise ValueError(
                f"model: config.json's qk_norm_type {norm_type!r} is not supported for "
                "MiniMaxM2ForCausalLM (per_layer: q and k normed over the whole projection)"
            )
        super().__init__(cfg, max_position, backend)

    @classmethod
    def rope_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """The checkpoints name the turned part of a head by `rotary_dim` (transformers reads it as a
        partial_rotary_factor of rotary_dim / head_dim); without either, the whole head turns."""
        rotary_dim = cfg.get("rotary_dim")
        if rotary_dim is None or "partial_rotary_factor" in rope_parameters(cfg):
            return cfg
        return {**cfg, "partial_rotary_factor": rotary_dim / head_dim_of(cfg)}

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        spec = sigmoid_biased_experts(
            num_experts=num_experts_of(cfg, 256),
            top_k=int(cfg.get("num_experts_per_tok", 8)),
            width=int(cfg.get("intermediate_size", 1536)),
            num_shared=0,
            scale=1.0,
        )
        return [spec] * cfg["num_hidden_layers"]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_minimax_names(weights, len(self.layers)))


def _minimax_names(
    weights: Iterable[tuple[str, torch.Tensor]], num_layers: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The picking bias under the router (the Hub's `block_sparse_moe.e_score_correction_bias`,
    transformers' `mlp.e_score_correction_bias`); the next-token prediction layers left out."""
    for name, tensor in weights:
        if past_layer(name, num_layers):
            continue
        for old in (".block_sparse_moe.e_score_correction_bias", ".mlp.e_score_correction_bias"):
            name = name.replace(old, ".mlp.gate.e_score_correction_bias")
        yield name, tensor
