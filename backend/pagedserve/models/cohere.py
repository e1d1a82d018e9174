"""Cohere's Command R7B and Command A (`Cohere2ForCausalLM`) as transformers computes them, on the
Llama family's tensor-parallel layers. What they add to Llama's layer:

- attention and the MLP side by side: both read the same normed input, and both outputs join the
  residual stream at once (`ParallelDecoderLayer`);
- LayerNorm without a bias (the mean taken out, then scaled by the variance), in float32, where Llama
  takes RMSNorm (`LayerNorm`);
- GPT-J's rotary (neighbouring dimensions turned together: `interleaved_rotary`, q and k rows
  reordered on load), computed in float32, and only in the sliding layers (three of every four by
  default, a window of 4,096): the global layers turn by no position (NoPE);
- the logits multiplied by `logit_scale` (1/16 by default); the LM head tied by default.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from pagedserve.config import default_layer_types
from pagedserve.layers.attention import AttentionBackend, AttentionMetadata
from pagedserve.layers.norm import LayerNorm, RMSNorm
from pagedserve.models.llama import (
    LayerOptions,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    Rotary,
)


def layer_norm_eps(cfg: dict[str, Any]) -> float:
    return float(cfg.get("layer_norm_eps", 1e-5))


class ParallelDecoderLayer(LlamaDecoderLayer):
    """Llama's layer protocol (it takes the residual stream as `hidden + residual` and returns its own
    pair) with attention and the MLP reading the same input, normed, their outputs added together:
    normed once for both (Cohere's, StableLM's, Phi-2's), or each by a norm of its own where
    `mlp_norm_of_its_own` (`mlp_layernorm`: GPT-NeoX's checkpoints call it post_attention_layernorm)."""

    mlp_norm_of_its_own = False

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        nn.Module.__init__(self)  # (not Llama's norms)
        self.self_attn = self.attention_class(cfg, backend, options, layer_index)
        self.mlp = self.dense_mlp(cfg)
        self.input_layernorm = self.norm(cfg)
        self.mlp_layernorm = self.norm(cfg) if self.mlp_norm_of_its_own else None

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        """Cohere's LayerNorm: no bias (StableLM's parallel layers have one)."""
        return LayerNorm(cfg["hidden_size"], layer_norm_eps(cfg), bias=False)

    def forward(
        self,
        rotary: Rotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else residual + hidden
        normed = cast(torch.Tensor, self.input_layernorm(stream))
        mlp_normed = normed if self.mlp_layernorm is None else self.mlp_layernorm(stream)
        return self.self_attn(rotary, normed, metadata) + self.mlp(mlp_normed), stream


class Cohere2ForCausalLM(LlamaForCausalLM):
    """Command R7B and Command A (see the module docstring); Cohere2Config's defaults where config.json
    leaves a key out."""

    decoder_layer_class = ParallelDecoderLayer
    interleaved_rotary = True

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        super().__init__(
            {**cfg, "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}, max_position, backend
        )
        self.logit_scale = float(cfg.get("logit_scale", 0.0625))
        if not self.logit_scale > 0:  # (a greedy step takes the argmax before the logits are scaled)
            raise ValueError(f"model: config.json's logit_scale must be positive, got {self.logit_scale}")

    @staticmethod
    def rotary_layers(cfg: dict[str, Any]) -> list[bool]:
        """The sliding layers turn q and k; the global ones do not (where the model has a window)."""
        if not cfg.get("sliding_window"):
            return [True] * cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types") or default_layer_types(cfg, "Cohere2ForCausalLM")
        return [kind == "sliding_attention" for kind in layer_types]

    def step_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        """The tables rounded to the model's dtype, then applied in float32, as transformers' Cohere2
        turns q and k."""
        return tuple(table.float() for table in self.rotary_emb(positions, dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden) * self.logit_scale
