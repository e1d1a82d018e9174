"""Liquid AI's LFM2 (LFM2-350M, -700M, -1.2B, -2.6B): a hybrid whose layers mix their tokens by
attention (Llama's, each query and key head RMS-normed before the rotation, as Qwen3's) or by a gated
short convolution (`layers.short_conv`), which carries a state per sequence from step to step in
place of a KV cache; every layer then runs a SwiGLU MLP. Lfm2Config's defaults where config.json
leaves a key out: theta 1e6, norms at eps `norm_eps` 1e-5, a tied LM head, the MLP's width derived
from `block_ff_dim` (`intermediate_size`) as Lfm2MLP derives it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from pagedserve.config import lfm2_layer_types
from pagedserve.layers.attention import Attention, AttentionBackend, AttentionMetadata
from pagedserve.layers.short_conv import ShortConv
from pagedserve.models.llama import (
    LayerOptions,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    Rotary,
)


def lfm2_intermediate_size(cfg: dict[str, Any]) -> int:
    """Lfm2MLP's width: under `block_auto_adjust_ff_dim` (on by default) two thirds of the configured
    one, times `block_ffn_dim_multiplier` rounded up to a multiple of `block_multiple_of`."""
    size = int(cfg.get("block_ff_dim", cfg.get("intermediate_size", 12288)))
    if cfg.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = int(cfg.get("block_multiple_of", 256))
            size = multiple * -(-int(multiplier * size) // multiple)
    return size


class Lfm2DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer (`operator_norm`, `ffn_norm`) whose mixer is attention or LFM2's short
    convolution (`conv`), by config.json's layer types."""

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        nn.Module.__init__(self)
        layer_types = cfg["layer_types"]
        self.conv = ShortConv(cfg) if layer_types[layer_index] == "conv" else None
        if self.conv is None:  # its attention's index among the attention layers (their KV caches)
            self.self_attn = LlamaAttention(
                cfg, backend, options, layer_types[:layer_index].count("full_attention")
            )
        self.mlp = LlamaMLP(cfg)
        self.residual_multiplier = 1.0
        self.input_layernorm = self.norm(cfg)
        self.post_attention_layernorm = self.norm(cfg)

    def forward(
        self,
        rotary: Rotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.conv is None:
            hidden = self.self_attn(rotary, hidden, metadata)
        else:
            hidden = self.conv(hidden, metadata.conv_windows)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Lfm2ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    decoder_layer_class = Lfm2DecoderLayer
    stacked_params = {
        **LlamaForCausalLM.stacked_params,
        # the convolution's in_proj, B, C and x in one tensor, split on load (`_renamed`)
        "b_proj": ("in_proj", 0),
        "c_proj": ("in_proj", 1),
        "x_proj": ("in_proj", 2),
    }

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        cfg = {
            **cfg,
            "layer_types": lfm2_layer_types(cfg),
            "rms_norm_eps": float(cfg.get("norm_eps", 1e-5)),
            "intermediate_size": lfm2_intermediate_size(cfg),
            "tie_word_embeddings": cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True)),
        }
        super().__init__(cfg, max_position, backend)

    @property
    def attention_layers(self) -> list[Attention]:
        layers = cast(list[Lfm2DecoderLayer], self.decoder_layers)
        return [layer.self_attn.attn for layer in layers if layer.conv is None]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_renamed(weights))


# LFM2's checkpoint names -> Llama's (`LlamaForCausalLM.load_weights` merges q, k, v, gate and up)
_NAMES = {
    ".operator_norm.": ".input_layernorm.",
    ".ffn_norm.": ".post_attention_layernorm.",
    ".feed_forward.w1.": ".mlp.gate_proj.",
    ".feed_forward.w3.": ".mlp.up_proj.",
    ".feed_forward.w2.": ".mlp.down_proj.",
    ".self_attn.out_proj.": ".self_attn.o_proj.",
    ".self_attn.q_layernorm.": ".self_attn.q_norm.",
    ".self_attn.k_layernorm.": ".self_attn.k_norm.",
    ".conv.conv.weight": ".conv.conv_weight",
    ".conv.conv.bias": ".conv.conv_bias",
    "model.embedding_norm.": "model.norm.",  # (the final norm, despite its name)
}


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for theirs, ours in _NAMES.items():
            name = name.replace(theirs, ours)
        if ".conv.in_proj." in name:
            for part, rows in zip(("b_proj", "c_proj", "x_proj"), tensor.chunk(3), strict=True):
                yield name.replace(".in_proj.", f".{part}."), rows
        else:
            yield name, tensor
