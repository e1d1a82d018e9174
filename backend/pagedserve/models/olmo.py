"""Ai2's OLMo family as transformers computes it, on the Llama family's tensor-parallel layers: OLMo 1
(`OlmoForCausalLM`), OLMo 2 (`Olmo2ForCausalLM`), OLMo 3 (`Olmo3ForCausalLM`) and OLMoE
(`OlmoeForCausalLM`). What each adds to Llama's layer:

- OLMo 1: LayerNorms of no weight or bias where Llama has RMSNorms, q, k and v clamped to
  +-`clip_qkv` where config.json sets it;
- OLMo 2, 3 and OLMoE: q and k RMS-normed over the whole projection (all of q's heads together, all of k's),
  where Qwen3 norms each head apart; under tensor parallelism a rank holds its heads' share of each
  weight and the ranks add up their sums of squares (one all-reduce a layer, `norm_q_and_k`);
- OLMo 2 and 3: no norm before attention or the MLP; the output of each is normed instead, before
  it joins the residual stream; every norm multiplies by its weight in float32 and rounds once
  (`Float32RMSNorm`), and q and k turn by float32 tables, as transformers' do;
- OLMo 3: three sliding layers (a window of 4,096) to one global (`layer_types`); the global layers
  turn by the model's rope with its scaling (YaRN in the long-context checkpoints), the sliding ones
  by the same theta without it (`config.olmo3_rope_config`);
- OLMoE: Llama's layer (norms before attention and the MLP) with those q and k norms, q, k and v
  clamped to +-`clip_qkv` where config.json sets it, and every MLP experts (64, 8 a token, weighted
  by the softmax over all 64, not renormalized unless `norm_topk_prob`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.config import olmo3_rope_config
from pagedserve.distributed import all_reduce, get_tp_rank, get_tp_size
from pagedserve.layers import ops
from pagedserve.layers.attention import AttentionBackend, AttentionMetadata
from pagedserve.layers.moe import Experts
from pagedserve.layers.norm import Float32RMSNorm, RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.models.llama import (
    LayerOptions,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    PostNormDecoderLayer,
    Rotary,
    check_silu,
    head_dim_of,
    rms_norm_eps,
)
from pagedserve.models.moe import MoeForCausalLM, num_experts_of, per_expert_weights


class ProjectionRMSNorm(RMSNorm):
    """RMSNorm over a whole projection (every query head, or every key head), of which this rank holds
    the columns of its `num_heads` heads, and of the weight the same columns (a KV head replicated on
    `replicas` ranks: its columns on each). `scale` applies it given the mean square over the whole
    projection (`norm_q_and_k`)."""

    def __init__(
        self, num_heads: int, head_dim: int, replicas: int, eps: float, float32_weight: bool
    ) -> None:
        super().__init__(num_heads * head_dim, eps)
        self.replicas = replicas
        self.float32_weight = float32_weight  # OLMo 2's: multiplied in float32; OLMoE's: as Llama's
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        width, shards = param.shape[0], get_tp_size() // self.replicas
        if loaded.shape != (width * shards,):
            raise ValueError(
                f"checkpoint's q or k norm has shape {tuple(loaded.shape)}; config.json's heads make {width * shards}"
            )
        param.data.copy_(loaded.narrow(0, get_tp_rank() // self.replicas * width, width))

    def scale(self, x: torch.Tensor, mean_square: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(mean_square + self.eps)
        if self.float32_weight:
            return (self.weight.float() * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def norm_q_and_k(
    q: torch.Tensor, k: torch.Tensor, q_norm: ProjectionRMSNorm, k_norm: ProjectionRMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [tokens, this rank's width of each], RMS-normed over their whole projections: the ranks'
    sums of squares added up in one all-reduce. A KV head replicated on r ranks is counted r times,
    and so is its width: each sum divides by the ranks' widths added up alike."""
    squares = torch.stack((q.float().square().sum(-1), k.float().square().sum(-1)), dim=-1)
    squares = all_reduce(squares)
    tp_size = get_tp_size()
    q_mean = squares[:, :1] / (tp_size * q.shape[-1])
    k_mean = squares[:, 1:] / (tp_size * k.shape[-1])
    return q_norm.scale(q, q_mean), k_norm.scale(k, k_mean)


def read_clip_qkv(cfg: dict[str, Any]) -> float | None:
    """config.json's `clip_qkv` (OLMo 1's, OLMoE's): q, k and v clamped to +-it (None: not)."""
    clip = cfg.get("clip_qkv")
    if clip is not None and not (isinstance(clip, int | float) and clip > 0):
        raise ValueError(f"model: config.json's clip_qkv must be a positive number, got {clip!r}")
    return None if clip is None else float(clip)


class OlmoAttention(LlamaAttention):
    """Llama's attention with q and k normed whole (OLMo 2's norms: in float32) and, in a sliding
    layer, OLMo 3's sliding rope (the last two tables of the step's four)."""

    float32_norms = True
    reads_clip_qkv = False  # OLMoE's `clip_qkv` (transformers' OLMo 2 and 3 read none)

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__(cfg, backend, dataclasses.replace(options, qk_norm=False), layer_index)
        eps, replicas = rms_norm_eps(cfg), self.qkv_proj.num_kv_head_replicas
        self.q_norm = ProjectionRMSNorm(self.num_heads, self.head_dim, 1, eps, self.float32_norms)
        self.k_norm = ProjectionRMSNorm(self.num_kv_heads, self.head_dim, replicas, eps, self.float32_norms)
        self.clip = read_clip_qkv(cfg) if self.reads_clip_qkv else None
        self.sliding_rope = options.window > 0

    def forward(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = norm_q_and_k(q, k, cast(ProjectionRMSNorm, self.q_norm), cast(ProjectionRMSNorm, self.k_norm))
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        cos, sin = rotary[2:] if self.sliding_rope else rotary[:2]
        q = ops.apply_rotary(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = ops.apply_rotary(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        return self.o_proj(self.attn(q, k, v, metadata))


class Olmo2DecoderLayer(PostNormDecoderLayer):
    """OLMo 2's norms after attention and the MLP, multiplied in float32, and OLMo's attention."""

    attention_class = OlmoAttention

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return Float32RMSNorm(cfg["hidden_size"], rms_norm_eps(cfg))


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 (see the module docstring); OLMo 3 sets `sliding_rope`."""

    decoder_layer_class = Olmo2DecoderLayer
    sliding_rope = False  # OLMo 3: the sliding layers turn by a rope of their own

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        super().__init__(cfg, max_position, backend)
        self.sliding_rotary_emb = (
            RotaryEmbedding(head_dim_of(cfg), max_position, olmo3_rope_config(cfg, "sliding_attention"))
            if self.sliding_rope
            else None
        )

    def step_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        """The global layers' tables, then the sliding layers' (the same but in OLMo 3), in float32
        whatever the model's dtype, as transformers' OLMo 2 keeps them."""
        cos, sin = self.rotary_emb(positions, torch.float32)
        if self.sliding_rotary_emb is None:
            return cos, sin, cos, sin
        return cos, sin, *self.sliding_rotary_emb(positions, torch.float32)


class FlexOlmoForCausalLM(Olmo2ForCausalLM):
    """Ai2's FlexOlmo (FlexOlmo-7x7B): OLMo 2's layer (norms after attention and the MLP, q and k normed
    whole) with every MLP `num_experts` experts (7), `num_experts_per_tok` a token (5), weighted by
    their softmax over all of them, renormalized where `norm_topk_prob` (off by default: OLMoE's
    router); FlexOlmoConfig's defaults where config.json leaves a key out."""

    def layer_options(self, cfg: dict[str, Any]) -> list[LayerOptions]:
        check_silu(cfg)
        spec = Experts(
            num_experts=num_experts_of(cfg, 7),
            top_k=int(cfg.get("num_experts_per_tok", 5)),
            intermediate_size=int(cfg["intermediate_size"]),
            renormalize=bool(cfg.get("norm_topk_prob", False)),
        )
        return [dataclasses.replace(options, experts=spec) for options in super().layer_options(cfg)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(per_expert_weights(weights, hidden_size=self.embed_tokens.weight.shape[1]))


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 2's layers, three sliding to one global by default (`config.layer_windows`), the rope's
    scaling in the global layers alone."""

    sliding_rope = True

    @staticmethod
    def rope_config(cfg: dict[str, Any]) -> dict[str, Any]:
        return olmo3_rope_config(cfg, "full_attention")


class OlmoeAttention(OlmoAttention):
    """OLMoE's: the whole-projection norms rounded before they multiply (as Llama's), q, k and v then
    clamped to +-`clip_qkv`."""

    float32_norms = False
    reads_clip_qkv = True


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_class = OlmoeAttention


class OlmoeForCausalLM(MoeForCausalLM):
    """Llama's layer with OLMoE's attention; every MLP `num_experts` experts (OlmoeConfig's defaults
    where config.json leaves a key out)."""

    decoder_layer_class = OlmoeDecoderLayer

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        spec = Experts(
            num_experts=num_experts_of(cfg, 64),
            top_k=int(cfg.get("num_experts_per_tok", 8)),
            intermediate_size=int(cfg["intermediate_size"]),
            renormalize=bool(cfg.get("norm_topk_prob", False)),
        )
        return [spec] * cfg["num_hidden_layers"]


class NonAffineLayerNorm(Float32RMSNorm):
    """OLMo 1's LayerNorm: no weight and no bias, eps 1e-5, in float32 and rounded once, with RMSNorm's
    call form (transformers' OlmoLayerNorm)."""

    def __init__(self, hidden_size: int) -> None:
        nn.Module.__init__(self)  # (no parameters)
        self.eps = 1e-5

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps).to(x.dtype)


class Olmo1Attention(LlamaAttention):
    """Llama's attention with q, k and v clamped to +-`clip_qkv` where config.json sets it."""

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__(cfg, backend, options, layer_index)
        self.clip = read_clip_qkv(cfg)

    def project_qkv(self, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        return qkv if self.clip is None else qkv.clamp(-self.clip, self.clip)


class Olmo1DecoderLayer(LlamaDecoderLayer):
    attention_class = Olmo1Attention

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return NonAffineLayerNorm(cfg["hidden_size"])


class OlmoForCausalLM(LlamaForCausalLM):
    """Ai2's OLMo 1 (OLMo-1B-hf, OLMo-7B-hf, OLMo-7B-0424-hf): Llama's layer with LayerNorms of no
    weight or bias (`NonAffineLayerNorm`) and q, k and v clamped by `clip_qkv` where set."""

    decoder_layer_class = Olmo1DecoderLayer
