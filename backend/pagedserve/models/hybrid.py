"""Hybrid decoders, whose layers mix their tokens by attention or by a layer that carries a state per
request from step to step in place of a KV cache (`layers.recurrent`):

- Liquid AI's LFM2 (LFM2-350M, -700M, -1.2B, -2.6B): gated short convolutions (`layers.short_conv`)
  beside Llama's attention with each query and key head RMS-normed (Qwen3's), every layer then a
  SwiGLU MLP. Lfm2Config's defaults where config.json leaves a key out: theta 1e6, norms at eps
  `norm_eps` 1e-5, a tied LM head, the MLP's width derived from `block_ff_dim` as Lfm2MLP derives it.
  LFM2-MoE (LFM2-8B-A1B): experts past its first dense layers.
- IBM's Granite 4.0 (granite-4.0-h-micro, -h-tiny, -h-small, -h-1b, -h-350m, and the attention-only
  granite-4.0-micro, -1b, -350m): Mamba2 layers (`layers.mamba2`) beside Granite's attention (q and k
  turned by the rope where `position_embedding_type` is "rope", by none otherwise), Granite's
  multipliers, every MLP `shared_mlp` (of `shared_intermediate_size`), beside experts where
  `num_local_experts` is not 0 (Granite MoE's, stacked in the checkpoint).
- IBM's Bamba: Granite 4.0's Mamba2 layers beside attention over half of each head, Llama's MLPs.
- NVIDIA's Nemotron-H, Nemotron Nano 2 and Nemotron 3: a layer a block, Mamba2, attention without
  rope, an ungated ReLU² MLP or experts (`NemotronHBlock`, `nemotron_h_experts`).
- Mamba2 alone (Mamba-Codestral-7B): every layer Mamba2, no attention, no KV cache.

A model with any recurrent layer runs without prefix caching or swapping (`ModelConfig.recurrent`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn

from pagedserve.config import (
    architecture_of,
    default_head_dim,
    granite_layer_types,
    hybrid_layer_types,
    jamba_layer_types,
    lfm2_layer_types,
    lfm3_config,
    nemotron_h_layer_types,
    rope_parameters,
)
from pagedserve.layers.attention import Attention, AttentionBackend, AttentionMetadata
from pagedserve.layers.linear import ColumnParallelLinear
from pagedserve.layers.mamba import MambaDims, MambaMixer, mamba_dims
from pagedserve.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from pagedserve.layers.moe import Experts, SparseMoeBlock
from pagedserve.layers.norm import Float32RMSNorm, RMSNorm
from pagedserve.layers.recurrent import RecurrentLayer
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.layers.short_conv import ShortConv
from pagedserve.models.gemma import gemma3_rope_config
from pagedserve.models.llama import (
    Biases,
    LayerOptions,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    Rotary,
    check_silu,
    granite_shared_mlp,
    head_dim_of,
    residual_stream,
    rms_norm_eps,
)
from pagedserve.models.moe import GraniteMoeSharedForCausalLM, LayerTypeRopeAttention, per_expert_weights
from pagedserve.models.ungated import UngatedMLP


class HybridDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer whose token mixer is attention where the model's `layer_types` (in its
    config, as the model reads it) names the layer "full_attention", else `recurrent_mixer`'s layer
    (`mixer`)."""

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        nn.Module.__init__(self)
        layer_types = cfg["layer_types"]
        recurrent = layer_types[layer_index] != "full_attention"
        self.mixer = self.recurrent_mixer(cfg, layer_index) if recurrent else None
        if self.mixer is None:  # its attention's index among the attention layers (their KV caches)
            attention_index = layer_types[:layer_index].count("full_attention")
            self.self_attn = self.attention_class(cfg, backend, options, attention_index)
        self.mlp = (
            self.dense_mlp(cfg)
            if options.experts is None
            else SparseMoeBlock(cfg["hidden_size"], options.experts)
        )
        self.residual_multiplier = options.scales.residual
        self.input_layernorm = self.norm(cfg)
        self.post_attention_layernorm = self.norm(cfg)

    def recurrent_mixer(self, cfg: dict[str, Any], layer_index: int) -> RecurrentLayer:
        """Layer `layer_index`'s token mixer where it is not attention."""
        raise NotImplementedError

    def mix(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        if self.mixer is None:
            return super().mix(rotary, hidden, metadata)
        assert metadata.recurrent is not None, "a step of a model with a state per request"
        return cast(torch.Tensor, self.mixer(hidden, metadata.recurrent))


def attention_of(layers: Iterable[nn.Module]) -> list[Attention]:
    """A hybrid's attention layers, in order (the KV caches they are bound to)."""
    decoder_layers = cast(list[LlamaDecoderLayer], list(layers))
    return [layer.self_attn.attn for layer in decoder_layers if getattr(layer, "mixer", None) is None]


def _renamed(
    weights: Iterable[tuple[str, torch.Tensor]], names: dict[str, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for theirs, ours in names.items():
            name = name.replace(theirs, ours)
        yield name, tensor


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


def jamba_mamba_dims(cfg: dict[str, Any]) -> MambaDims:
    """Jamba's Mamba layers' sizes, JambaConfig's defaults where config.json leaves a key out."""
    hidden, rank = int(cfg["hidden_size"]), cfg.get("mamba_dt_rank", "auto")
    return MambaDims(
        hidden_size=hidden,
        intermediate_size=int(cfg.get("mamba_expand", 2)) * hidden,
        state_size=int(cfg.get("mamba_d_state", 16)),
        conv_width=int(cfg.get("mamba_d_conv", 4)),
        time_step_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        inner_norm_eps=rms_norm_eps(cfg),
        inner_norm_weights=True,
    )


class JambaDecoderLayer(HybridDecoderLayer):
    def recurrent_mixer(self, cfg: dict[str, Any], layer_index: int) -> RecurrentLayer:
        return MambaMixer(jamba_mamba_dims(cfg))


class JambaForCausalLM(LlamaForCausalLM):
    """AI21's Jamba (Jamba v0.1, 1.5 and 1.6 Mini and Large, Jamba Reasoning 3B): Llama's pre-norm layers
    whose token mixer is attention without positions (no rotary) every `attn_layer_period`-th layer
    from `attn_layer_offset`, else Mamba's state space with its time step, B and C RMS-normed by weights
    of their own (`layers.mamba`); the MLP experts every `expert_layer_period`-th layer from
    `expert_layer_offset` (`num_experts`, `num_experts_per_tok` a token, weighted by their softmax over
    all experts, not renormalized), else dense; JambaConfig's defaults where config.json leaves a key
    out."""

    decoder_layer_class = JambaDecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        cfg = {**cfg, "layer_types": jamba_layer_types(cfg), "rms_norm_eps": rms_norm_eps(cfg)}
        super().__init__(cfg, max_position, backend)

    @staticmethod
    def rotary_layers(cfg: dict[str, Any]) -> list[bool]:
        return [False] * cfg["num_hidden_layers"]

    def layer_options(self, cfg: dict[str, Any]) -> list[LayerOptions]:
        check_silu(cfg)
        spec = Experts(
            num_experts=int(cfg.get("num_experts", 16)),
            top_k=int(cfg.get("num_experts_per_tok", 2)),
            intermediate_size=int(cfg["intermediate_size"]),
            renormalize=False,
        )
        period, offset = int(cfg.get("expert_layer_period", 2)), int(cfg.get("expert_layer_offset", 1))
        return [
            replace(options, experts=spec if index % period == offset and spec.num_experts > 1 else None)
            for index, options in enumerate(super().layer_options(cfg))
        ]

    @property
    def attention_layers(self) -> list[Attention]:
        return attention_of(self.layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        renamed = _renamed(weights, _JAMBA_NAMES)
        super().load_weights(per_expert_weights(renamed, hidden_size=self.embed_tokens.weight.shape[1]))


_JAMBA_NAMES = {
    ".mamba.conv1d.weight": ".mixer.conv_weight",
    ".mamba.conv1d.bias": ".mixer.conv_bias",
    ".mamba.dt_proj.bias": ".mixer.dt_bias",
    ".mamba.": ".mixer.",
    ".feed_forward.router.": ".mlp.gate.",
    ".feed_forward.": ".mlp.",
    ".pre_ff_layernorm.": ".post_attention_layernorm.",
    "model.final_layernorm.": "model.norm.",
}


class Lfm2DecoderLayer(HybridDecoderLayer):
    def recurrent_mixer(self, cfg: dict[str, Any], layer_index: int) -> RecurrentLayer:
        return ShortConv(cfg)


class Lfm2ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    decoder_layer_class = Lfm2DecoderLayer
    stacked_params = {
        **LlamaForCausalLM.stacked_params,
        # the convolution's in_proj, B, C and x in one tensor, split on load (`load_weights`)
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
        return attention_of(self.layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_split_in_proj(_renamed(weights, _LFM2_NAMES)))


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """Liquid AI's LFM2-8B-A1B: LFM2's layers, the first `num_dense_layers` with a dense MLP of
    `intermediate_size` (as configured: not derived), the others `num_experts` experts of
    `moe_intermediate_size`, `num_experts_per_tok` a token, each scored by a sigmoid, picked by its
    score plus the router's `expert_bias` (`use_expert_bias`), their weights renormalized
    (`norm_topk_prob`) and scaled by `routed_scaling_factor`; Lfm2MoeConfig's defaults where
    config.json leaves a key out."""

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        # (Lfm2MoeConfig's dense width is the MLP's own: no block_auto_adjust_ff_dim)
        dense = {
            "intermediate_size": int(cfg.get("intermediate_size", 7168)),
            "block_auto_adjust_ff_dim": False,
        }
        super().__init__({**cfg, **dense}, max_position, backend)

    def layer_options(self, cfg: dict[str, Any]) -> list[LayerOptions]:
        spec = Experts(
            num_experts=int(cfg.get("num_experts", 32)),
            top_k=int(cfg.get("num_experts_per_tok", 4)),
            intermediate_size=int(cfg.get("moe_intermediate_size", 1792)),
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            scoring="sigmoid",
            selection_bias=bool(cfg.get("use_expert_bias", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            router_float32=True,
        )
        num_dense = int(cfg.get("num_dense_layers", 2))
        return [
            replace(options, experts=None if index < num_dense else spec)
            for index, options in enumerate(super().layer_options(cfg))
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        experts = _renamed_by_pattern(weights, _LFM2_EXPERT_NAMES)
        super().load_weights(per_expert_weights(experts, hidden_size=self.embed_tokens.weight.shape[1]))


class Lfm3Attention(LayerTypeRopeAttention):
    """Qwen3's attention (each query and key head RMS-normed) turned by its layer type's rope, each
    head's output times the sigmoid of its gate (`g_proj`, where `use_attention_gate`)."""

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__(cfg, backend, options, layer_index)
        gated = bool(cfg.get("use_attention_gate", True))
        self.g_proj = ColumnParallelLinear(cfg["hidden_size"], cfg["num_attention_heads"]) if gated else None

    def forward(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.rotated_qkv(rotary[2:4] if self.local else rotary[:2], hidden)
        out = self.attn(q, k, v, metadata)
        if self.g_proj is not None:
            gates = torch.sigmoid(self.g_proj(hidden))[..., None]
            out = (out.view(-1, self.num_heads, self.head_dim) * gates).flatten(1)
        return self.o_proj(out)


class Lfm3DecoderLayer(Lfm2DecoderLayer):
    """LFM2's layer (a convolution or attention, then a SwiGLU MLP), a sliding layer's attention of its
    own rope and window, each part's output RMS-normed before it joins the stream where
    `use_sandwich_norm`."""

    attention_class = Lfm3Attention

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        kinds = cfg["layer_types"]
        mixers = ["conv" if kind == "conv" else "full_attention" for kind in kinds]
        super().__init__({**cfg, "layer_types": mixers}, backend, options, layer_index)
        if self.mixer is None:
            cast(Lfm3Attention, self.self_attn).local = kinds[layer_index] == "sliding_attention"
        sandwich = bool(cfg.get("use_sandwich_norm", True))
        self.post_operator_norm = self.norm(cfg) if sandwich else None
        self.post_ffn_norm = self.norm(cfg) if sandwich else None

    def forward(
        self,
        rotary: Rotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = residual_stream(hidden, residual)
        mixed = self.mix(rotary, cast(torch.Tensor, self.input_layernorm(stream)), metadata)
        if self.post_operator_norm is not None:
            mixed = cast(torch.Tensor, self.post_operator_norm(mixed))
        stream = stream + mixed
        out = self.mlp(self.post_attention_layernorm(stream))
        if self.post_ffn_norm is not None:
            out = self.post_ffn_norm(out)
        return out, stream


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    """Liquid AI's LFM3 (LFM3-1.7B): LFM2's convolutions and attention, sliding attention layers of a
    window (`sliding_window`, 256) and a rope of their own (`rope_parameters["sliding_attention"]`),
    the full layers' rope proportional, attention heads gated, sandwich norms (`Lfm3DecoderLayer`), the
    MLP `intermediate_size` wide as configured; Lfm3Config's defaults where config.json leaves a key
    out (`config.lfm3_config`). Both ropes' tables in float32, as transformers turns q and k."""

    decoder_layer_class = Lfm3DecoderLayer
    rotates_part_of_a_head = True  # (the full layers' proportional rope turns half the head's pairs)

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        cfg = lfm3_config(cfg)
        cfg = {
            **cfg,
            "rms_norm_eps": float(cfg.get("norm_eps", 1e-5)),
            "tie_word_embeddings": cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True)),
        }
        LlamaForCausalLM.__init__(self, cfg, max_position, backend)
        self.sliding_rotary_emb = RotaryEmbedding(
            head_dim_of(cfg), max_position, gemma3_rope_config(cfg, "sliding_attention")
        )

    @classmethod
    def rope_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        return gemma3_rope_config(lfm3_config(cfg), "full_attention")

    def step_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        """The full layers' tables, then the sliding layers'."""
        return (
            *self.rotary_emb(positions, torch.float32),
            *self.sliding_rotary_emb(positions, torch.float32),
        )


# LFM2-MoE's experts and router (the hub's per-expert w1/w3/w2, transformers 5's stacked ones) as Qwen's
_LFM2_EXPERT_NAMES = [
    (re.compile(r"\.feed_forward\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
    (re.compile(r"\.feed_forward\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
    (re.compile(r"\.feed_forward\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
    (re.compile(r"\.feed_forward\.experts\."), ".mlp.experts."),
    (re.compile(r"\.feed_forward\.gate\."), ".mlp.gate."),
    (re.compile(r"\.feed_forward\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
]


def _renamed_by_pattern(
    weights: Iterable[tuple[str, torch.Tensor]], patterns: list[tuple[re.Pattern[str], str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for pattern, replacement in patterns:
            name = pattern.sub(replacement, name)
        yield name, tensor


# LFM2's checkpoint names -> ours (`LlamaForCausalLM.load_weights` merges q, k, v, gate and up)
_LFM2_NAMES = {
    ".operator_norm.": ".input_layernorm.",
    ".ffn_norm.": ".post_attention_layernorm.",
    ".feed_forward.w1.": ".mlp.gate_proj.",
    ".feed_forward.w3.": ".mlp.up_proj.",
    ".feed_forward.w2.": ".mlp.down_proj.",
    ".self_attn.out_proj.": ".self_attn.o_proj.",
    ".self_attn.q_layernorm.": ".self_attn.q_norm.",
    ".self_attn.k_layernorm.": ".self_attn.k_norm.",
    ".conv.conv.weight": ".mixer.conv_weight",
    ".conv.conv.bias": ".mixer.conv_bias",
    ".conv.": ".mixer.",
    "model.embedding_norm.": "model.norm.",  # (the final norm, despite its name)
}


def _split_in_proj(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """LFM2's in_proj, B, C and x in one tensor, as three (`Lfm2ForCausalLM.stacked_params`)."""
    for name, tensor in weights:
        if ".mixer.in_proj." in name:
            for part, rows in zip(("b_proj", "c_proj", "x_proj"), tensor.chunk(3), strict=True):
                yield name.replace(".in_proj.", f".{part}."), rows
        else:
            yield name, tensor


def granite_mamba_dims(cfg: dict[str, Any], norm_eps: float = 1e-6) -> Mamba2Dims:
    """Granite 4.0's Mamba2 sizes (Bamba's, Falcon-H1's), GraniteMoeHybridConfig's defaults where
    config.json leaves a key out; the gated norm at `rms_norm_eps`, `norm_eps` by default; the inner
    width `mamba_d_ssm` where set (Falcon-H1's), else mamba_expand x hidden_size."""
    hidden, heads = cfg["hidden_size"], int(cfg.get("mamba_n_heads", 128))
    inner = cfg.get("mamba_d_ssm")
    inner = int(cfg.get("mamba_expand", 2)) * hidden if inner is None else int(inner)
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else int(head_dim)
    if head_dim * heads != inner:
        raise ValueError(
            f"model: config.json's mamba_d_head ({head_dim}) times mamba_n_heads ({heads}) must be its "
            f"Mamba2 width ({inner}: mamba_d_ssm, else mamba_expand x hidden_size)"
        )
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    return Mamba2Dims(
        hidden_size=hidden,
        num_heads=heads,
        head_dim=head_dim,
        num_groups=int(cfg.get("mamba_n_groups", 1)),
        state_size=int(cfg.get("mamba_d_state", 256)),
        conv_width=int(cfg.get("mamba_d_conv", 4)),
        chunk_size=int(cfg.get("mamba_chunk_size", 256)),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        norm_eps=float(cfg.get("rms_norm_eps", norm_eps)),
        time_step_limit=(float(limit[0]), float(limit[1])),
    )


class GraniteHybridDecoderLayer(HybridDecoderLayer):
    def recurrent_mixer(self, cfg: dict[str, Any], layer_index: int) -> RecurrentLayer:
        return Mamba2Mixer(granite_mamba_dims(cfg))


class GraniteMoeHybridForCausalLM(GraniteMoeSharedForCausalLM):
    """IBM's Granite 4.0: Granite's layer and multipliers, its MLP stored as `shared_mlp` (gate and up in
    one tensor, `input_linear`; down, `output_linear`) of `shared_intermediate_size`, beside Granite
    MoE's experts where `num_local_experts` is not 0 (GraniteMoeHybridConfig's 8 where config.json
    leaves it out); q and k turned by the rope where `position_embedding_type` is "rope", by none
    otherwise; the layers `layer_types` names mamba, Mamba2's (`layers.mamba2`), the checkpoints of
    attention alone in Llama's layer."""

    decoder_layer_class: type[LlamaDecoderLayer] = GraniteHybridDecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        # (GraniteMoeHybridConfig's defaults where config.json leaves them out)
        shared = int(cfg.get("shared_intermediate_size", 1024))
        cfg = {**cfg, "layer_types": granite_layer_types(cfg), "shared_intermediate_size": shared}
        if _dense(cfg):  # every MLP the shared one alone
            cfg["intermediate_size"] = shared
        if "mamba" not in cfg["layer_types"]:  # attention alone: Llama's layer (and its fused decode steps)
            self.decoder_layer_class = LlamaDecoderLayer
        super().__init__(cfg, max_position, backend)

    @staticmethod
    def rotary_layers(cfg: dict[str, Any]) -> list[bool]:
        return [cfg.get("position_embedding_type") == "rope"] * cfg["num_hidden_layers"]

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        return [None] * cfg["num_hidden_layers"] if _dense(cfg) else super().read_experts(cfg)

    @property
    def attention_layers(self) -> list[Attention]:
        return attention_of(self.layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = _renamed(weights, _GRANITE_NAMES)
        if not isinstance(self.decoder_layers[0].mlp, SparseMoeBlock):  # the shared MLP is the MLP
            weights = granite_shared_mlp(weights, "mlp")
        super().load_weights(weights)


def _dense(cfg: dict[str, Any]) -> bool:
    return int(cfg.get("num_local_experts", 8)) == 0


_GRANITE_NAMES = {
    ".mamba.conv1d.weight": ".mixer.conv_weight",
    ".mamba.conv1d.bias": ".mixer.conv_bias",
    ".mamba.": ".mixer.",
}


class BambaDecoderLayer(HybridDecoderLayer):
    def recurrent_mixer(self, cfg: dict[str, Any], layer_index: int) -> RecurrentLayer:
        return Mamba2Mixer(granite_mamba_dims(cfg, norm_eps=1e-5))


class BambaForCausalLM(LlamaForCausalLM):
    """IBM's Bamba (Bamba-9B): Mamba2 layers (Granite 4.0's) but at `attn_layer_indices`, where Llama's
    attention turns half of each head (BambaConfig sets partial_rotary_factor 0.5 whatever config.json
    says), q, k, v and o biased by `attention_bias`; every layer's MLP Llama's (`feed_forward`), its
    norms `input_layernorm` and `pre_ff_layernorm`, the final one `final_layernorm`; BambaConfig's
    defaults where config.json leaves a key out (norms at eps 1e-5, an untied LM head)."""

    decoder_layer_class = BambaDecoderLayer
    rotates_part_of_a_head = True

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        attention = cfg.get("attn_layer_indices") or ()
        layer_types = [
            "full_attention" if i in attention else "mamba" for i in range(cfg["num_hidden_layers"])
        ]
        cfg = {**cfg, "layer_types": layer_types, "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-5))}
        super().__init__(cfg, max_position, backend)

    @classmethod
    def rope_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        rope = {**rope_parameters(cfg), "partial_rotary_factor": 0.5}
        return {
            **{key: value for key, value in cfg.items() if key != "rope_scaling"},
            "rope_parameters": rope,
        }

    @property
    def attention_layers(self) -> list[Attention]:
        return attention_of(self.layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_renamed(weights, _BAMBA_NAMES))


_BAMBA_NAMES = {
    ".feed_forward.": ".mlp.",
    ".pre_ff_layernorm.": ".post_attention_layernorm.",
    "model.final_layernorm.": "model.norm.",
    **_GRANITE_NAMES,
}


def _first(cfg: dict[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    """The first of `keys` config.json names (NemotronHConfig's aliases before its own names)."""
    return next((cfg[key] for key in keys if key in cfg), default)


def nemotron_h_mamba_dims(cfg: dict[str, Any]) -> Mamba2Dims:
    """Nemotron-H's Mamba2 sizes, NemotronHConfig's defaults (and its `mamba_*` aliases) where
    config.json leaves a key out; the states in `mamba_ssm_cache_dtype` (float32 by default)."""
    limit = _first(cfg, ("mamba_dt_limit", "time_step_limit"), None) or (0.0, float("inf"))
    state_dtype = cfg.get("mamba_ssm_cache_dtype", "float32")
    if state_dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(
            f"model: config.json's mamba_ssm_cache_dtype must be auto, float32, bfloat16 or float16, "
            f"got {state_dtype!r}"
        )
    return Mamba2Dims(
        hidden_size=cfg["hidden_size"],
        num_heads=int(cfg.get("mamba_num_heads", 128)),
        head_dim=int(cfg.get("mamba_head_dim", 64)),
        num_groups=int(_first(cfg, ("mamba_n_groups", "n_groups"), 8)),
        state_size=int(cfg.get("ssm_state_size", 128)),
        conv_width=int(_first(cfg, ("mamba_d_conv", "conv_kernel"), 4)),
        chunk_size=int(_first(cfg, ("mamba_chunk_size", "chunk_size"), 128)),
        conv_bias=bool(_first(cfg, ("mamba_conv_bias", "use_conv_bias"), True)),
        proj_bias=bool(cfg.get("use_bias", False)),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        time_step_limit=(float(limit[0]), float(limit[1])),
        state_dtype=None if state_dtype == "auto" else getattr(torch, state_dtype),
    )


def nemotron_h_experts(cfg: dict[str, Any]) -> Experts:
    """Nemotron 3's experts (NemotronHConfig's defaults where config.json leaves a key out):
    `n_routed_experts` (8) ungated ReLU² experts of `moe_intermediate_size` (7,688), routed as
    DeepSeek-V3's (a sigmoid a score, picked by it plus `e_score_correction_bias` among the best
    `topk_group` of `n_group` groups, `num_experts_per_tok` (2) a token, renormalized where
    `norm_topk_prob`, scaled by `routed_scaling_factor`; the router in float32), beside an ungated
    shared expert of `moe_shared_expert_intermediate_size` (7,688). A latent projection around the
    experts (`moe_latent_size`) and biased MLPs (`mlp_bias`) are refused by name."""
    if cfg.get("moe_latent_size") is not None:
        raise ValueError("model: config.json's moe_latent_size (experts in a latent space) is not served")
    if cfg.get("mlp_bias"):
        raise ValueError("model: config.json's mlp_bias is not served for Nemotron-H's experts")
    return Experts(
        num_experts=int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 8))),
        top_k=int(cfg.get("num_experts_per_tok", 2)),
        intermediate_size=int(cfg.get("moe_intermediate_size", 7688)),
        renormalize=bool(cfg.get("norm_topk_prob", True)),
        shared_intermediate_size=int(cfg.get("moe_shared_expert_intermediate_size", 7688)),
        shared_gate=False,
        activation=cfg.get("mlp_hidden_act", "relu2"),
        gated=False,
        scoring="sigmoid",
        selection_bias=True,
        num_groups=int(cfg.get("n_group", 1)),
        topk_groups=int(cfg.get("topk_group", 1)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        router_float32=True,
    )


class NemotronHBlock(LlamaDecoderLayer):
    """Nemotron-H's layer: one norm (NemotronHRMSNorm's, in float32), then one block, `mixer`: attention
    without rope, Mamba2, an ungated ReLU² MLP, or Nemotron 3's experts (`nemotron_h_experts`), by the
    layer's type; its output joins the residual stream."""

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        nn.Module.__init__(self)
        layer_types = cfg["layer_types"]
        kind = layer_types[layer_index]
        self.mixer: nn.Module
        if kind == "full_attention":
            attention_index = layer_types[:layer_index].count("full_attention")
            self.mixer = LlamaAttention(cfg, backend, options, attention_index)
        elif kind == "mamba":
            self.mixer = Mamba2Mixer(self.mamba_dims(cfg))
        elif kind == "mlp":
            self.mixer = UngatedMLP(cfg)
        else:
            assert kind == "moe", kind  # (`nemotron_h_layer_types` names no other)
            self.mixer = SparseMoeBlock(cfg["hidden_size"], nemotron_h_experts(cfg))
        self.input_layernorm = self.norm(cfg)

    mamba_dims = staticmethod(nemotron_h_mamba_dims)

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return Float32RMSNorm(cfg["hidden_size"], rms_norm_eps(cfg))

    def forward(
        self,
        rotary: Rotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.normed_input(hidden, residual)
        return self.mix(rotary, hidden, metadata), residual

    def mix(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        if isinstance(self.mixer, LlamaAttention):
            return cast(torch.Tensor, self.mixer(rotary, hidden, metadata))
        if isinstance(self.mixer, RecurrentLayer):  # (Mamba2's, Mamba's)
            assert metadata.recurrent is not None, "a step of a model with a state per request"
            return cast(torch.Tensor, self.mixer(hidden, metadata.recurrent))
        return cast(torch.Tensor, self.mixer(hidden))


class NemotronHForCausalLM(LlamaForCausalLM):
    """NVIDIA's Nemotron-H (8B, 47B, 56B), Nemotron Nano 2 (9B, 12B) and Nemotron 3 (Nano 30B-A3B): a
    layer a block, each Mamba2, attention (no rope), an ungated ReLU² MLP or experts (`NemotronHBlock`),
    as `hybrid_override_pattern` lays them out; NemotronHConfig's defaults where config.json leaves a key out (head_dim 128, norms
    at eps `layer_norm_epsilon` 1e-5, an untied LM head, the Mamba2 states in float32)."""

    decoder_layer_class = NemotronHBlock
    stacked_params = {
        name: merged for name, merged in LlamaForCausalLM.stacked_params.items() if merged[0] == "qkv_proj"
    }

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        layer_types = nemotron_h_layer_types(cfg)
        cfg = {
            **default_head_dim(cfg),
            "layer_types": layer_types,
            "num_hidden_layers": len(layer_types),
            "rms_norm_eps": float(cfg.get("layer_norm_epsilon", 1e-5)),
            "hidden_act": cfg.get("mlp_hidden_act", "relu2"),
        }
        super().__init__(cfg, max_position, backend)

    @staticmethod
    def rotary_layers(cfg: dict[str, Any]) -> list[bool]:
        return [False] * cfg["num_hidden_layers"]

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        """None (NemotronHAttention's projections have no bias, whatever `attention_bias` says)."""
        return False, False

    @property
    def attention_layers(self) -> list[Attention]:
        blocks = cast(list[NemotronHBlock], list(self.layers))
        return [block.mixer.attn for block in blocks if isinstance(block.mixer, LlamaAttention)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_nemotron_h_renamed(weights))


def mamba2_model_dims(cfg: dict[str, Any]) -> Mamba2Dims:
    """A Mamba2 model's sizes, Mamba2Config's defaults where config.json leaves a key out."""
    hidden, heads = cfg["hidden_size"], int(cfg.get("num_heads", 128))
    head_dim = int(cfg.get("head_dim", 64))
    if head_dim * heads != int(cfg.get("expand", 2)) * hidden:
        raise ValueError(
            f"model: config.json's head_dim ({head_dim}) times num_heads ({heads}) must be expand x "
            f"hidden_size ({int(cfg.get('expand', 2)) * hidden})"
        )
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    return Mamba2Dims(
        hidden_size=hidden,
        num_heads=heads,
        head_dim=head_dim,
        num_groups=int(cfg.get("n_groups", 8)),
        state_size=int(cfg.get("state_size", 128)),
        conv_width=int(cfg.get("conv_kernel", 4)),
        chunk_size=int(cfg.get("chunk_size", 256)),
        conv_bias=bool(cfg.get("use_conv_bias", True)),
        proj_bias=bool(cfg.get("use_bias", False)),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        time_step_limit=(float(limit[0]), float(limit[1])),
    )


class Mamba2Block(NemotronHBlock):
    """A Mamba2 model's layer: Llama's RMSNorm, then Mamba2."""

    mamba_dims = staticmethod(mamba2_model_dims)

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return RMSNorm(cfg["hidden_size"], rms_norm_eps(cfg))


class Mamba2ForCausalLM(NemotronHForCausalLM):
    """Mamba2 alone (Mamba-Codestral-7B, state-spaces' mamba2-130m to -2.7b): every layer a norm and
    Mamba2 (`Mamba2Block`), no attention and so no KV cache; Mamba2Config's defaults where config.json
    leaves a key out (norms at eps `layer_norm_epsilon` 1e-5, an untied LM head). Its residual stream
    stays in the model's dtype where config.json asks float32 (`residual_in_fp32`, which transformers
    honours): in bfloat16 its tokens are held to transformers' float32 as every model's are."""

    decoder_layer_class = Mamba2Block

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        layer_types = ["mamba"] * cfg["num_hidden_layers"]
        cfg = {**cfg, "layers_block_type": layer_types}
        super().__init__(cfg, max_position, backend)


class MambaBlock(Mamba2Block):
    """A Mamba (1) model's layer: Llama's RMSNorm, then Mamba's selective state space."""

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        nn.Module.__init__(self)
        self.mixer = MambaMixer(mamba_dims(cfg))
        self.input_layernorm = self.norm(cfg)


class MambaForCausalLM(Mamba2ForCausalLM):
    """Mamba (1) alone (state-spaces' mamba-130m to 2.8b) and TII's FalconMamba-7B (its B, C and time
    step RMS-normed, `layers.mamba`): every layer a norm and Mamba's state space, no attention;
    MambaConfig's defaults where config.json leaves a key out (norms at eps `layer_norm_epsilon`
    1e-5, the LM head tied)."""

    decoder_layer_class = MambaBlock

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        # (no attention: the rotary table Llama's model keeps is one of a head of 2, never read)
        cfg = {
            **cfg,
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
            "num_attention_heads": 1,
            "head_dim": 2,
        }
        super().__init__(cfg, max_position, backend)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(
            (
                name.replace(".mixer.dt_proj.bias", ".mixer.dt_bias").replace(
                    "backbone.embedding.", "backbone.embeddings."
                ),
                tensor,
            )
            for name, tensor in weights
        )


_NEMOTRON_H_NAMES = {  # (NVIDIA's checkpoints name the model `backbone`, transformers 5 saves it `model`)
    "backbone.": "model.",
    "model.embeddings.": "model.embed_tokens.",
    "model.norm_f.": "model.norm.",
    ".mixer.conv1d.weight": ".mixer.conv_weight",
    ".mixer.conv1d.bias": ".mixer.conv_bias",
    ".mixer.shared_experts.": ".mixer.shared_expert.",
}
_LAYER_NORM = re.compile(r"^model\.layers\.(\d+)\.norm\.")
_STACKED_EXPERTS = re.compile(r"\.mixer\.experts\.(up_proj|down_proj)$")


def _nemotron_h_renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Nemotron-H's names as ours: `backbone` as `model`, the embeddings and final norm as Llama's,
    each layer's norm as `input_layernorm` (its `norm` is Llama's norm builder), the Mamba2
    convolution's tensors as `Mamba2Mixer` holds them, the experts one by one (transformers 5 stacks
    them: up_proj [experts, intermediate, hidden], down_proj [experts, hidden, intermediate]), the
    shared expert as `SparseMoeBlock` names it; the multi-token prediction layers (`mtp.*`) left out."""
    for name, tensor in _renamed(weights, _NEMOTRON_H_NAMES):
        if name.startswith("mtp."):
            continue
        name = _LAYER_NORM.sub(r"model.layers.\1.input_layernorm.", name)
        stacked = _STACKED_EXPERTS.search(name)
        if stacked is None:
            yield name, tensor
            continue
        for number, expert in enumerate(tensor.unbind(0)):
            yield f"{name[: stacked.start()]}.mixer.experts.{number}.{stacked[1]}.weight", expert


def mamba1_dims(cfg: dict[str, Any]) -> MambaDims | None:
    """A model's Mamba (1) sizes, as its layers read config.json (None: no Mamba (1) layer)."""
    architecture = architecture_of(cfg)
    if architecture in ("MambaForCausalLM", "FalconMambaForCausalLM"):
        return mamba_dims(cfg)
    if architecture == "JambaForCausalLM":
        return jamba_mamba_dims(cfg)
    return None


def mamba2_dims(cfg: dict[str, Any]) -> Mamba2Dims | None:
    """A hybrid model's Mamba2 sizes, as its layers read config.json (None: no Mamba2 layer)."""
    if not {"mamba", "parallel"} & set(hybrid_layer_types(cfg) or ()):
        return None
    architecture = architecture_of(cfg)
    if architecture == "FalconH1ForCausalLM":
        from pagedserve.models.falcon_h1 import falcon_h1_mamba_dims  # (it builds on this module)

        return falcon_h1_mamba_dims(cfg)
    if architecture == "NemotronHForCausalLM":
        return nemotron_h_mamba_dims(cfg)
    if architecture == "Mamba2ForCausalLM":
        return mamba2_model_dims(cfg)
    if architecture == "Zamba2ForCausalLM":
        from pagedserve.models.zamba2 import zamba2_mamba_dims  # (it builds on llama's, as this does)

        return zamba2_mamba_dims(cfg)
    return granite_mamba_dims(cfg, norm_eps=1e-5 if architecture == "BambaForCausalLM" else 1e-6)
