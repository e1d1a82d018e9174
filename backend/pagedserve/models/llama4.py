"""Meta's Llama 4 (Scout 17B-16E, Maverick 17B-128E): the text decoder of their
`Llama4ForConditionalGeneration` checkpoints (`config.text_decoder_config`; images are not served),
as transformers' Llama4ForCausalLM runs it. Llama's layer with:

- GPT-J's rotary (neighbouring dimensions turned together: `interleaved_rotary`) by Llama 3's scaled
  rope, in three of every four layers (`no_rope_layers`: 1 turns, 0 does not; by default every
  `no_rope_layer_interval`-th, 4, is NoPE); on those layers q and k then RMS-normed without a weight
  (`use_qk_norm`, in float32 at `rms_norm_eps`);
- on the NoPE layers each query scaled by 1 + attn_scale ln(1 + floor((position + 1) / floor_scale))
  (`attn_temperature_tuning`: 1 below floor_scale's 8,192 positions), in float32, rounded once;
- the rope layers' chunked attention (`attention_chunk_size`, 8,192: a token attends within its
  chunk; `layer_types`' chunked_attention, `layers.chunked`), the NoPE layers' over the whole context;
- MoE layers (`moe_layers`, by default every `interleave_moe_layer_step`-th: Scout's every layer,
  Maverick's every other one): `num_local_experts` SwiGLU experts of `intermediate_size`, the top
  `num_experts_per_tok` (1) by the router's logits, each expert's input scaled by the sigmoid of its
  logit (`Experts.weighted_inputs`), beside a shared expert of the same width; the other layers' MLPs
  dense, of `intermediate_size_mlp`. Experts stored stacked input by output (gate_up [experts,
  hidden, 2 x intermediate]), under `feed_forward` with a `router`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedserve.config import attention_chunk, llama4_layer_types, smollm3_rotary_layers
from pagedserve.layers.attention import AttentionBackend, AttentionMetadata
from pagedserve.layers.moe import Experts
from pagedserve.layers.norm import weightless_rms_norm
from pagedserve.models.llama import (
    LayerOptions,
    LlamaAttention,
    LlamaDecoderLayer,
    Rotary,
    check_silu,
    rms_norm_eps,
)
from pagedserve.models.moe import MoeForCausalLM, num_experts_of


class Llama4Attention(LlamaAttention):
    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__(cfg, backend, options, layer_index)
        if llama4_layer_types(cfg)[layer_index] == "chunked_attention":
            self.attn.chunk = attention_chunk(cfg)
        self.qk_norm_eps = rms_norm_eps(cfg) if self.rotary and cfg.get("use_qk_norm", True) else None
        self.temperature_tuning = not self.rotary and bool(cfg.get("attn_temperature_tuning", True))

    def forward(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.rotated_qkv(rotary[:2], hidden)
        if self.qk_norm_eps is not None:
            q, k = weightless_rms_norm(q, self.qk_norm_eps), weightless_rms_norm(k, self.qk_norm_eps)
        if self.temperature_tuning:
            q = (q.float() * rotary[2]).to(q.dtype)
        return self.o_proj(self.attn(q, k, v, metadata))


class Llama4DecoderLayer(LlamaDecoderLayer):
    attention_class = Llama4Attention


class Llama4ForCausalLM(MoeForCausalLM):
    decoder_layer_class = Llama4DecoderLayer
    interleaved_rotary = True

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        # the dense MLPs' width (the experts' is `intermediate_size`, kept in `read_experts`)
        self.expert_width = int(cfg.get("intermediate_size", 8192))
        dense = {**cfg, "intermediate_size": int(cfg.get("intermediate_size_mlp", 16384))}
        super().__init__({"rms_norm_eps": 1e-5, **dense}, max_position, backend)
        self.floor_scale = float(cfg.get("floor_scale", 8192))
        self.attn_scale = float(cfg.get("attn_scale", 0.1))

    @staticmethod
    def rotary_layers(cfg: dict[str, Any]) -> list[bool]:
        return smollm3_rotary_layers(cfg)  # (the same `no_rope_layers`, the same default)

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        check_silu(cfg)
        num_layers = cfg["num_hidden_layers"]
        step = cfg.get("interleave_moe_layer_step", 1)
        if not (isinstance(step, int) and step > 0):
            raise ValueError(
                f"model: config.json's interleave_moe_layer_step must be a positive integer, got {step!r}"
            )
        moe_layers = set(cfg.get("moe_layers") or range(step - 1, num_layers, step))
        spec = Experts(
            num_experts=num_experts_of(cfg, 16),
            top_k=int(cfg.get("num_experts_per_tok", 1)),
            intermediate_size=self.expert_width,
            renormalize=False,
            shared_intermediate_size=self.expert_width,
            shared_gate=False,
            scoring="sigmoid",
            weighted_inputs=True,
        )
        return [spec if i in moe_layers else None for i in range(num_layers)]

    def step_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        """The rope layers' tables, and the NoPE layers' query scales (float32, [tokens, 1, 1])."""
        cos, sin = self.rotary_emb(positions, torch.float32)[:2]  # (turned in float32, rounded once)
        floors = torch.floor((positions.float() + 1.0) / self.floor_scale)
        return cos, sin, (torch.log1p(floors) * self.attn_scale + 1.0)[:, None, None]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_as_ours(weights))


def _as_ours(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Llama 4's `feed_forward` as our `mlp`, its `router` as the experts' `gate`."""
    for name, tensor in weights:
        yield _FEED_FORWARD.sub(".mlp.", name).replace(".mlp.router.", ".mlp.gate."), tensor


_FEED_FORWARD = re.compile(r"\.feed_forward\.")
