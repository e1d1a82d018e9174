"""MiniMax's models as transformers computes them, on the Llama family's tensor-parallel layers.

MiniMax-Text-01 and MiniMax-M1 (`MiniMaxForCausalLM`): Mixtral's experts in every layer; the token
mixer lightning attention (`layers.lightning`) where `layer_types` says "linear_attention", Llama's
attention (GQA, the rope over the whole head, `sliding_window` where config.json names one) where it
says "full_attention"; each layer post-norm, DeepNet's way: the mixer's input normed, and the normed
input times an alpha plus the mixer's output times a beta, normed, the MLP's input (`*_alpha_factor`,
`*_beta_factor`, by the mixer's kind and the MLP's), the next layer's input the MLP's normed input times
its alpha plus its output times its beta.

MiniMax-M2 (`MiniMaxM2ForCausalLM`: MiniMax-M2, M2.1). What it adds to Mixtral's layer:

- q and k RMS-normed over the whole projection (all query heads together, all key heads), each norm
  multiplied by its weight in float32 (OLMo 2's norms: `models.olmo.OlmoAttention`), before the rotation;
- NeoX's rotary over the first `rotary_dim` dimensions of each head (64 of 128), the rest as they are;
- every MLP `num_local_experts` experts (256), `num_experts_per_tok` a token (8), each scored by the
  sigmoid of its logit and picked by its score plus the router's `e_score_correction_bias`, the picked
  scores renormalized; no shared expert; the router in float32 (vLLM's).

The checkpoints' next-token prediction layers (numbered past `num_hidden_layers`) are left out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

from pagedserve.config import minimax_config, rope_parameters
from pagedserve.layers.attention import Attention, AttentionBackend, AttentionMetadata
from pagedserve.layers.lightning import LightningAttention, LightningDims
from pagedserve.layers.moe import Experts
from pagedserve.layers.recurrent import RecurrentLayer
from pagedserve.models.hybrid import HybridDecoderLayer, attention_of
from pagedserve.models.llama import LayerOptions, LlamaDecoderLayer, Rotary, head_dim_of, residual_stream
from pagedserve.models.moe import (
    MixtralForCausalLM,
    MoeForCausalLM,
    num_experts_of,
    past_layer,
    sigmoid_biased_experts,
)
from pagedserve.models.olmo import OlmoAttention


class MiniMaxDecoderLayer(HybridDecoderLayer):
    """MiniMax-Text-01's post-norm layer (see the module docstring). Llama's layer protocol: its output
    is `hidden + residual`, the MLP's part and the normed input's."""

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__(cfg, backend, options, layer_index)
        kind = "full_attn" if self.mixer is None else "linear_attn"
        self.mix_alpha, self.mix_beta = (
            float(cfg.get(f"{kind}_{part}_factor", 1)) for part in ("alpha", "beta")
        )
        self.mlp_alpha, self.mlp_beta = (
            float(cfg.get(f"mlp_{part}_factor", 1)) for part in ("alpha", "beta")
        )

    def recurrent_mixer(self, cfg: dict[str, Any], layer_index: int) -> RecurrentLayer:
        dims = LightningDims(
            hidden_size=cfg["hidden_size"],
            num_heads=cfg["num_attention_heads"],
            head_dim=head_dim_of(cfg),
            layer_index=layer_index,
            num_layers=cfg["num_hidden_layers"],
        )
        return LightningAttention(dims)

    def forward(
        self,
        rotary: Rotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = residual_stream(hidden, residual)
        normed = cast(torch.Tensor, self.input_layernorm(stream))
        stream = normed * self.mix_alpha + self.mix(rotary, normed, metadata) * self.mix_beta
        normed = cast(torch.Tensor, self.post_attention_layernorm(stream))
        return self.mlp(normed) * self.mlp_beta, normed * self.mlp_alpha


class MiniMaxForCausalLM(MixtralForCausalLM):
    """MiniMax-Text-01 and MiniMax-M1 (see the module docstring); MiniMaxConfig's defaults where
    config.json leaves a key out (`config.minimax_config` reads its layers and residual factors)."""

    decoder_layer_class = MiniMaxDecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        super().__init__(minimax_config(cfg), max_position, backend)

    @property
    def attention_layers(self) -> list[Attention]:
        return attention_of(self.layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        linear = {i for i, layer in enumerate(self.layers) if isinstance(layer.mixer, LightningAttention)}
        super().load_weights(_lightning_names(weights, linear))


def _lightning_names(
    weights: Iterable[tuple[str, torch.Tensor]], linear: set[int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The lightning layers' tensors (`self_attn.*` of the layers in `linear`) under our names; the
    decays transformers saves with them (`slope_rate`, `*_decay`) left out: they are the config's."""
    for name, tensor in weights:
        layer = re.match(r"^model\.layers\.(\d+)\.self_attn\.", name)
        if layer is not None and int(layer[1]) in linear:
            if name.endswith(("_decay", ".slope_rate")):
                continue
            name = name.replace(".self_attn.norm.weight", ".self_attn.norm_weight").replace(
                ".self_attn.", ".mixer."
            )
        yield name, tensor


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
