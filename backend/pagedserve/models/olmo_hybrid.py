"""Ai2's OLMo Hybrid (`OlmoHybridForCausalLM`) as transformers computes it: OLMo 3's attention layers
(norms after attention and the MLP, q and k normed over the whole projection, the rope's tables in
float32; NoPE where config.json's rope names no theta) among Gated DeltaNet layers (`layers.gated_delta`,
a state per request), three to one by default (`layer_types`: every fourth full, the last where none is).

A Gated DeltaNet layer is Llama's pre-norm layer around Qwen3-Next's rule with OLMo's own projections:
q, k and v each of their own (`q_proj`, `k_proj`, `v_proj`, into one causal convolution, no bias),
the output gate `g_proj`, the decay's `a_proj` and the update's `b_proj`; where
`linear_allow_neg_eigval` (the default) the update's beta is 2 sigmoid(b), reaching [0, 2]. Its key
heads are `linear_key_head_dim` (0.75 x hidden / `linear_num_key_heads`) wide, its value heads twice
that by default; its output norm's eps is 1e-5 whatever `rms_norm_eps` says. Every norm multiplies
its weight in float32 (OLMo 2's).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F

from pagedserve.config import olmo_hybrid_config
from pagedserve.layers.attention import Attention, AttentionBackend, AttentionMetadata
from pagedserve.layers.gated_delta import GatedDeltaDims, GatedDeltaNet
from pagedserve.layers.norm import Float32RMSNorm, RMSNorm
from pagedserve.layers.recurrent import RecurrentLayer, RecurrentStep, rank_rows
from pagedserve.models.hybrid import HybridDecoderLayer, attention_of
from pagedserve.models.llama import LayerOptions, LlamaForCausalLM, Rotary, residual_stream, rms_norm_eps
from pagedserve.models.olmo import OlmoAttention


def olmo_hybrid_delta_dims(cfg: dict[str, Any]) -> GatedDeltaDims:
    """OlmoHybridConfig's linear-attention sizes, its defaults where config.json leaves a key out."""
    key_heads = int(cfg.get("linear_num_key_heads") or cfg["num_attention_heads"])
    key_dim = int(cfg.get("linear_key_head_dim") or int(0.75 * cfg["hidden_size"] / key_heads))
    return GatedDeltaDims(
        hidden_size=cfg["hidden_size"],
        num_k_heads=key_heads,
        num_v_heads=int(cfg.get("linear_num_value_heads") or cfg["num_attention_heads"]),
        head_k_dim=key_dim,
        head_v_dim=int(cfg.get("linear_value_head_dim") or 2 * key_dim),
        conv_width=int(cfg.get("linear_conv_kernel_dim", 4)),
        norm_eps=1e-5,
    )


class OlmoHybridGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's Gated DeltaNet over OLMo Hybrid's six projections, one matmul here (`in_proj`: q, k,
    v, the gate, a and b, each this rank's rows); beta doubled where `negative_eigenvalues`."""

    def __init__(self, dims: GatedDeltaDims, negative_eigenvalues: bool) -> None:
        super().__init__(dims)
        keys, values, heads = rank_rows(self.key_dim), rank_rows(self.value_dim), rank_rows(self.num_v_heads)
        self.set_in_proj({"q": keys, "k": keys, "v": values, "g": values, "a": heads, "b": heads})
        self.beta_scale = 2.0 if negative_eigenvalues else 1.0

    def forward(self, hidden: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        q, k, v, gate, a, b = self.in_proj(hidden).split(self.in_proj_sizes, dim=-1)
        q, k, v = self.conv_qkv(torch.cat((q, k, v), dim=-1), step)
        beta = torch.sigmoid(b).float() * self.beta_scale
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        o = self.scan(q, k, v, g, beta, step)
        return self.out_proj(self.gated_norm(o.to(hidden.dtype), gate).flatten(1))


class OlmoHybridDecoderLayer(HybridDecoderLayer):
    """An attention layer as OLMo 3's (its norms after attention and the MLP), a Gated DeltaNet layer
    as Llama's (its norms before them); every norm in float32. Llama's layer protocol."""

    attention_class = OlmoAttention

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return Float32RMSNorm(cfg["hidden_size"], rms_norm_eps(cfg))

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__(cfg, backend, options, layer_index)
        if self.mixer is None:  # (OLMo 3's: no norm before attention, one after the MLP)
            del self.input_layernorm
            self.post_feedforward_layernorm = self.norm(cfg)

    def recurrent_mixer(self, cfg: dict[str, Any], layer_index: int) -> RecurrentLayer:
        return OlmoHybridGatedDeltaNet(
            olmo_hybrid_delta_dims(cfg), bool(cfg.get("linear_allow_neg_eigval", True))
        )

    def forward(
        self,
        rotary: Rotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = residual_stream(hidden, residual)
        if self.mixer is None:  # post-norm
            attended = self.mix(rotary, stream, metadata)
            stream = stream + cast(torch.Tensor, self.post_attention_layernorm(attended))
            return cast(torch.Tensor, self.post_feedforward_layernorm(self.mlp(stream))), stream
        normed = cast(torch.Tensor, self.input_layernorm(stream))
        stream = stream + self.mix(rotary, normed, metadata)
        return self.mlp(self.post_attention_layernorm(stream)), stream


class OlmoHybridForCausalLM(LlamaForCausalLM):
    """OLMo Hybrid (see the module docstring); OlmoHybridConfig's defaults where config.json leaves a
    key out (`config.olmo_hybrid_config` reads its layers)."""

    decoder_layer_class = OlmoHybridDecoderLayer
    stacked_params = {
        **LlamaForCausalLM.stacked_params,
        **{f"in_proj_{part}": ("in_proj", part) for part in ("q", "k", "v", "g", "a", "b")},
    }

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        cfg = olmo_hybrid_config(cfg)
        nope = cfg["rope_parameters"].get("rope_theta") is None
        if nope:  # (a table never read, of the default theta)
            cfg = {**cfg, "rope_parameters": {**cfg["rope_parameters"], "rope_theta": 10_000.0}}
        super().__init__(cfg, max_position, backend)
        self.nope = nope
        self.linear_layers = {i for i, kind in enumerate(cfg["layer_types"]) if kind == "linear_attention"}

    def step_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        """OLMo 2's float32 tables; under NoPE, tables that turn nothing."""
        cos, sin = self.rotary_emb(positions, torch.float32)
        if self.nope:
            cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
        return cos, sin, cos, sin

    @property
    def attention_layers(self) -> list[Attention]:
        return attention_of(self.layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._delta_names(weights))

    def _delta_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The Gated DeltaNet layers' tensors (`linear_attn.*`) under our names."""
        for name, tensor in weights:
            if ".linear_attn." in name:
                name = name.replace(".linear_attn.conv1d.weight", ".mixer.conv_weight")
                name = name.replace(".linear_attn.o_norm.weight", ".mixer.norm_weight")
                name = name.replace(".linear_attn.o_proj.", ".mixer.out_proj.")
                for part in ("q", "k", "v", "g", "a", "b"):
                    name = name.replace(f".linear_attn.{part}_proj.", f".mixer.in_proj_{part}.")
                name = name.replace(".linear_attn.", ".mixer.")
            yield name, tensor
