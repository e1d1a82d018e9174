"""Llama-family decoders whose MLPs are mixtures of experts (`layers.moe`): Mixtral (Mistral's layer,
every MLP 8 experts, 2 a token), IBM's Granite MoE (Granite's layer), Qwen2-MoE (Qwen2's layer, with a
shared expert), Granite MoE with a shared expert, Qwen3-MoE (Qwen3's layer), GLM-4.5 (DeepSeek-V3's routing), ERNIE 4.5 MoE (a
picking bias on a softmax), dots.llm1 (Qwen3's layer, DeepSeek-V3's experts), Phi-3.5-MoE (LayerNorms,
biased projections and LM head, Mixtral's experts picked by `route_sparsemixer`) and Hunyuan-A13B
(Hunyuan's dense layer, experts beside a shared MLP). Qwen's
`decoder_sparse_step` and `mlp_only_layers`, GLM's and dots.llm1's `first_k_dense_replace` and
ERNIE's `moe_layer_*` keep some layers dense.

Checkpoints come in several layouts, all read: the hub's, one tensor per expert and projection
(Mixtral's `block_sparse_moe.experts.N.w1`/`w3`/`w2`, Qwen's `mlp.experts.N.gate_proj`/`up_proj`/
`down_proj`), Granite's, every expert in one tensor (`block_sparse_moe.input_linear` [experts,
2 x intermediate, hidden], `output_linear` [experts, hidden, intermediate]), and transformers 5's
in-memory one, stacked as Granite's (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); each
becomes the hub's per-expert Qwen names on load."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

from pagedserve.config import default_layer_types, mellum_config
from pagedserve.layers import ops
from pagedserve.layers.attention import AttentionBackend, AttentionMetadata
from pagedserve.layers.embedding import ParallelLMHead
from pagedserve.layers.linear import ColumnParallelLinear
from pagedserve.layers.moe import Experts
from pagedserve.layers.norm import Float32RMSNorm, LayerNorm, RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.models.gemma import gemma3_rope_config
from pagedserve.models.llama import (
    Biases,
    Ernie4_5ForCausalLM,
    Exaone4ForCausalLM,
    GraniteForCausalLM,
    GraniteSWALayers,
    HunYuanDecoderLayer,
    LayerOptions,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    Rotary,
    Scales,
    check_silu,
    granite_shared_mlp,
    head_dim_of,
    hunyuan_name,
    residual_stream,
    rms_norm_eps,
)

_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# each checkpoint layout's names as the hub's Qwen names (stacked experts as transformers 5 names them)
_RENAMES: list[tuple[re.Pattern[str], Any]] = [
    # Mixtral's experts
    (
        re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\."),
        lambda m: f".mlp.experts.{m[1]}.{_MIXTRAL_NAMES[m[2]]}.",
    ),
    # Granite's stacked experts and router
    (re.compile(r"\.block_sparse_moe\.input_linear\.weight$"), ".mlp.experts.gate_up_proj"),
    (re.compile(r"\.block_sparse_moe\.output_linear\.weight$"), ".mlp.experts.down_proj"),
    (re.compile(r"\.block_sparse_moe\.router(\.layer)?\.weight$"), ".mlp.gate.weight"),
    # the rest of `block_sparse_moe` (Mixtral's router `gate`, transformers 5's stacked experts)
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
]
_STACKED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family model some of whose layers' MLPs are experts (`read_experts`)."""

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        raise NotImplementedError

    def layer_options(self, cfg: dict[str, Any]) -> list[LayerOptions]:
        check_silu(cfg)
        experts = self.read_experts(cfg)
        return [
            dataclasses.replace(options, experts=spec)
            for options, spec in zip(super().layer_options(cfg), experts, strict=True)
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(per_expert_weights(weights, hidden_size=self.embed_tokens.weight.shape[1]))


def per_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor]], hidden_size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every expert's tensors under the hub's Qwen names: Mixtral's and Granite's renamed, stacked
    tensors (transformers 5's, Granite's) cut into their experts. Stacked tensors stored input by
    output (Qwen3-VL-MoE's checkpoints: gate_up [experts, hidden, 2 x intermediate], down [experts,
    intermediate, hidden]) are turned to output by input, told apart by where the hidden size stands
    (where 2 x intermediate, or intermediate, equals it, the tensors are read as transformers holds them)."""
    for name, tensor in weights:
        for pattern, replacement in _RENAMES:
            name = pattern.sub(replacement, name)
        stacked = _STACKED.search(name)
        if stacked is None:
            yield name, tensor
            continue
        prefix = name[: stacked.start()] + ".mlp.experts"
        if tensor.dim() != 3:
            raise ValueError(f"checkpoint's {name!r} has {tensor.dim()} dimensions; stacked experts have 3")
        hidden_at = 1 if stacked[1] == "down_proj" else 2  # where transformers' layout holds the hidden size
        if tensor.shape[hidden_at] != hidden_size and tensor.shape[3 - hidden_at] == hidden_size:
            tensor = tensor.transpose(1, 2)
        for number, expert in enumerate(tensor.unbind(0)):
            if stacked[1] == "down_proj":
                yield f"{prefix}.{number}.down_proj.weight", expert
            else:
                gate, up = expert.chunk(2)
                yield f"{prefix}.{number}.gate_proj.weight", gate
                yield f"{prefix}.{number}.up_proj.weight", up


def _sparse_layers(cfg: dict[str, Any]) -> list[bool]:
    """Qwen's layers with experts: every `decoder_sparse_step`-th but `mlp_only_layers`."""
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    if not (isinstance(step, int) and step > 0):
        raise ValueError(f"model: config.json's decoder_sparse_step must be a positive integer, got {step!r}")
    return [(i + 1) % step == 0 and i not in dense for i in range(cfg["num_hidden_layers"])]


def num_experts_of(cfg: dict[str, Any], default: int) -> int:
    """config.json names them `num_experts` (Qwen's hub configs) or `num_local_experts` (Mixtral's,
    and transformers 5 saves Qwen3-MoE's so); transformers reads either for each."""
    return int(cfg.get("num_local_experts", cfg.get("num_experts", default)))


def qwen_experts(cfg: dict[str, Any], defaults: Experts) -> list[Experts | None]:
    """Qwen's experts, with the config class's defaults where config.json leaves a key out."""
    shared = defaults.shared_intermediate_size  # Qwen2-MoE's shared expert (Qwen3-MoE has none: 0)
    spec = Experts(
        num_experts=num_experts_of(cfg, defaults.num_experts),
        top_k=cfg.get("num_experts_per_tok", defaults.top_k),
        intermediate_size=cfg.get("moe_intermediate_size", defaults.intermediate_size),
        renormalize=bool(cfg.get("norm_topk_prob", defaults.renormalize)),
        shared_intermediate_size=cfg.get("shared_expert_intermediate_size", shared) if shared else 0,
    )
    return [spec if sparse else None for sparse in _sparse_layers(cfg)]


def _every_layer_experts(cfg: dict[str, Any]) -> list[Experts | None]:
    """Mixtral's and Granite's: every MLP `num_local_experts` experts (8) of `intermediate_size`,
    `num_experts_per_tok` (2) a token, their weights renormalized."""
    spec = Experts(
        num_experts=num_experts_of(cfg, 8),
        top_k=cfg.get("num_experts_per_tok", 2),
        intermediate_size=cfg["intermediate_size"],
        renormalize=True,
    )
    return [spec] * cfg["num_hidden_layers"]


class MixtralForCausalLM(MoeForCausalLM):
    """Mistral's layer; every MLP is experts (`_every_layer_experts`)."""

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        return _every_layer_experts(cfg)


class GraniteMoeForCausalLM(MoeForCausalLM):
    """Granite's layer (its four multipliers, `attention_bias` on all four projections); every MLP
    `num_local_experts` experts, `num_experts_per_tok` a token, weighted by the softmax of their
    logits alone (the top k renormalized), stacked in the checkpoint (`input_linear`, `output_linear`)."""

    read_scales = staticmethod(GraniteForCausalLM.read_scales)

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        return _every_layer_experts(cfg)


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """IBM's Granite MoE with a shared expert (GraniteMoeShared): Granite MoE's layer, and beside its
    experts an ungated SwiGLU every token goes through, of `shared_intermediate_size` (none where 0,
    GraniteMoeSharedConfig's default), stored as `shared_mlp` (`input_linear`: gate then up,
    `output_linear`)."""

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        shared = int(cfg.get("shared_intermediate_size", 0))
        return [
            None
            if spec is None
            else dataclasses.replace(spec, shared_intermediate_size=shared, shared_gate=False)
            for spec in super().read_experts(cfg)
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(granite_shared_mlp(weights, "mlp.shared_expert"))


class GraniteMoeSWAForCausalLM(GraniteSWALayers, GraniteMoeSharedForCausalLM):
    """IBM's Granite MoE SWA: Granite MoE's experts (a shared expert where `shared_intermediate_size`,
    none by default) in Granite SWA's layers (`GraniteSWALayers`); GraniteMoeSWAConfig's defaults where
    config.json leaves a key out."""


class AfmoeAttention(LlamaAttention):
    """Arcee's AFMoE attention: each query and key head RMS-normed (in float32), turned in the sliding
    layers alone, the output gated by the sigmoid of a projection of the layer's input
    (`output_gate`: the checkpoint's `self_attn.gate_proj`)."""

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__(cfg, backend, dataclasses.replace(options, qk_norm=False), layer_index)
        self.q_norm = Float32RMSNorm(self.head_dim, rms_norm_eps(cfg))
        self.k_norm = Float32RMSNorm(self.head_dim, rms_norm_eps(cfg))
        heads = cfg["num_attention_heads"]
        self.output_gate = ColumnParallelLinear(cfg["hidden_size"], heads * self.head_dim, bias=False)

    def forward(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = cast(Float32RMSNorm, self.q_norm).normed(q.view(-1, self.num_heads, self.head_dim))
        k = cast(Float32RMSNorm, self.k_norm).normed(k.view(-1, self.num_kv_heads, self.head_dim))
        if self.rotary:
            q, k = ops.apply_rotary(q, *rotary), ops.apply_rotary(k, *rotary)
        attended = self.attn(q, k, v, metadata) * torch.sigmoid(self.output_gate(hidden))
        return self.o_proj(attended)


class AfmoeDecoderLayer(LlamaDecoderLayer):
    """Norms before and after attention and the MLP (four a layer, multiplied in float32), AFMoE's
    attention; the MLP dense or experts."""

    attention_class = AfmoeAttention

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__(cfg, backend, options, layer_index)
        self.pre_mlp_layernorm = self.norm(cfg)
        self.post_mlp_layernorm = self.norm(cfg)

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
        stream = residual_stream(hidden, residual)
        attended = self.self_attn(rotary, cast(Float32RMSNorm, self.input_layernorm).normed(stream), metadata)
        stream = stream + cast(Float32RMSNorm, self.post_attention_layernorm).normed(attended)
        out = self.mlp(cast(Float32RMSNorm, self.pre_mlp_layernorm).normed(stream))
        return cast(Float32RMSNorm, self.post_mlp_layernorm).normed(out), stream


class AfmoeForCausalLM(MoeForCausalLM):
    """Arcee's AFMoE (Trinity Mini, Nano, Large): AFMoE's attention (`AfmoeAttention`; every
    `global_attn_every_n_layers`-th layer global, without rope, the others sliding a window of
    `sliding_window`) and norms around it and the MLP; the first `num_dense_layers` MLPs dense, the
    others `num_experts` experts, `num_experts_per_tok` a token, scored by a sigmoid, picked by it plus
    the router's `expert_bias`, renormalized and scaled by `route_scale`, beside an ungated shared
    expert of `num_shared_experts` experts' width; the embeddings times sqrt(hidden) where
    `mup_enabled`; AfmoeConfig's defaults where config.json leaves a key out (head_dim 128)."""

    decoder_layer_class = AfmoeDecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        super().__init__({**cfg, "head_dim": cfg.get("head_dim") or 128}, max_position, backend)

    @staticmethod
    def read_scales(cfg: dict[str, Any]) -> Scales:
        return Scales(embedding=cfg["hidden_size"] ** 0.5 if cfg.get("mup_enabled") else 1.0)

    @staticmethod
    def rotary_layers(cfg: dict[str, Any]) -> list[bool]:
        """The sliding layers turn q and k; the global ones do not."""
        layer_types = cfg.get("layer_types") or default_layer_types(cfg, "AfmoeForCausalLM")
        return [kind == "sliding_attention" for kind in layer_types]

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        spec = sigmoid_biased_experts(
            num_experts=num_experts_of(cfg, 64),
            top_k=int(cfg.get("num_experts_per_tok", 6)),
            width=int(cfg.get("moe_intermediate_size", 1408)),
            num_shared=int(cfg.get("num_shared_experts", 2)),
            scale=float(cfg.get("route_scale", 1.0)),
        )
        dense = int(cfg.get("num_dense_layers", 1))
        return [None if i < dense else spec for i in range(cfg["num_hidden_layers"])]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        renamed = (
            (
                name.replace(".self_attn.gate_proj.", ".self_attn.output_gate.")
                .replace(".mlp.router.gate.", ".mlp.gate.")
                .replace(".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
                tensor,
            )
            for name, tensor in weights
        )
        super().load_weights(deepseek_v3_names(renamed, len(self.layers)))


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2's attention (q, k and v biased by `qkv_bias`, o never); experts with a shared one."""

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        return bool(cfg.get("qkv_bias", True)), False

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        return qwen_experts(cfg, Experts(60, 4, 1408, renormalize=False, shared_intermediate_size=5632))


class Glm4MoeForCausalLM(MoeForCausalLM):
    """Zhipu's GLM-4.5 and GLM-4.6 (GLM-4.5-Air...): Llama's layer with q, k and v biased
    (`attention_bias`), each query and key head normed where `use_qk_norm`, the rope over the first
    `partial_rotary_factor` (0.5) of each head (NeoX's halves); the first `first_k_dense_replace`
    MLPs dense, the rest `n_routed_experts` experts routed as DeepSeek-V3's (a sigmoid a score, the
    top k picked by the scores plus the router's `e_score_correction_bias` among the best `topk_group`
    of `n_group` groups, weights renormalized where `norm_topk_prob` and scaled by
    `routed_scaling_factor`) beside an ungated shared expert of `n_shared_experts` experts' width.
    Glm4MoeConfig's defaults where config.json leaves a key out. The checkpoint's next-token
    prediction layers (past `num_hidden_layers`) are not loaded."""

    default_partial_rotary = 0.5  # Glm4MoeConfig's

    rotates_part_of_a_head = True

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        return bool(cfg.get("attention_bias", False)), False

    def layer_options(self, cfg: dict[str, Any]) -> list[LayerOptions]:
        qk_norm = bool(cfg.get("use_qk_norm", False))
        return [dataclasses.replace(options, qk_norm=qk_norm) for options in super().layer_options(cfg)]

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        spec = grouped_sigmoid_experts(cfg, GLM4_MOE_EXPERTS)
        dense = int(cfg.get("first_k_dense_replace", 1))
        return [None if i < dense else spec for i in range(cfg["num_hidden_layers"])]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(deepseek_v3_names(weights, len(self.layers)))


def sigmoid_biased_experts(
    num_experts: int, top_k: int, width: int, num_shared: int, scale: float
) -> Experts:
    """Experts of `width` each scored by a sigmoid and picked by the score plus the router's
    `e_score_correction_bias` (no groups), the picked scores renormalized and times `scale`, beside an
    ungated shared expert of `num_shared` experts' width (none where 0); the router in float32
    (MiniMax-M2's, HY 3's, AFMoE's)."""
    return Experts(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=width,
        renormalize=True,
        shared_intermediate_size=width * num_shared,
        shared_gate=False,
        scoring="sigmoid",
        selection_bias=True,
        routed_scaling_factor=scale,
        router_float32=True,
    )


def deepseek_v3_names(
    weights: Iterable[tuple[str, torch.Tensor]], num_layers: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """DeepSeek-V3's layout (GLM-4.5's, dots.llm1's) under our names: its `shared_experts` our
    `shared_expert`, its next-token prediction layers (past `num_layers`) left out."""
    for name, tensor in weights:
        if not past_layer(name, num_layers):
            yield name.replace(".mlp.shared_experts.", ".mlp.shared_expert."), tensor


# DeepSeek-V3's routing as config.json names it, and each config class's defaults for what it leaves out
GLM4_MOE_EXPERTS = {
    "n_routed_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1408,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
}


def grouped_sigmoid_experts(cfg: dict[str, Any], defaults: dict[str, Any]) -> Experts:
    """DeepSeek-V3's experts (GLM-4.5's, GLM-4.7-Flash's): `n_routed_experts` of
    `moe_intermediate_size`, `num_experts_per_tok` a token, each scored by a sigmoid and picked by its
    score plus the router's `e_score_correction_bias` among the best `topk_group` of `n_group` groups
    (a group worth its best two), the weights renormalized where `norm_topk_prob` and scaled by
    `routed_scaling_factor`; beside an ungated shared expert of `n_shared_experts` experts' width; the
    router in float32. `defaults`: the config class's, for the keys config.json leaves out."""

    def read(key: str) -> Any:
        value = cfg.get(key, defaults[key])
        return defaults[key] if value is None else value

    width = int(read("moe_intermediate_size"))
    return Experts(
        num_experts=int(
            cfg.get("n_routed_experts", cfg.get("num_local_experts", defaults["n_routed_experts"]))
        ),
        top_k=int(read("num_experts_per_tok")),
        intermediate_size=width,
        renormalize=bool(read("norm_topk_prob")),
        shared_intermediate_size=width * int(read("n_shared_experts")),
        shared_gate=False,
        scoring="sigmoid",
        selection_bias=True,
        num_groups=int(read("n_group")),
        topk_groups=int(read("topk_group")),
        routed_scaling_factor=float(read("routed_scaling_factor")),
        router_float32=True,
    )


def past_layer(name: str, num_layers: int) -> bool:
    """A tensor of a layer numbered past the model's (GLM-4.5's and DeepSeek-V3's next-token
    prediction layers)."""
    match = re.match(r"^(?:model\.)?layers\.(\d+)\.", name)
    return match is not None and int(match[1]) >= num_layers


class Ernie4_5_MoeForCausalLM(MoeForCausalLM):  # noqa: N801 (transformers' name)
    """Baidu's ERNIE 4.5 MoE models (ERNIE-4.5-21B-A3B): ERNIE 4.5's attention (GPT-J's rotary in
    float32, `Ernie4_5ForCausalLM`), its LM head tied by default; the MLPs from `moe_layer_start_index`
    to `moe_layer_end_index`, every `moe_layer_interval`-th, `moe_num_experts` experts, `moe_k` a token,
    picked by their softmax plus the router's `e_score_correction_bias`, weighted by the softmax
    renormalized, beside an ungated shared expert of `moe_num_shared_experts` experts' width; the
    others dense. The router in float32. Ernie4_5_MoeConfig's defaults where config.json leaves a key
    out; `use_bias` (biased MLPs) refused; the checkpoint's next-token prediction tensors (`mtp`) not
    loaded. (transformers clamps the renormalizing sum at `moe_norm_min`, 1e-12, which a sum of the
    top k of a softmax never reaches.)"""

    interleaved_rotary = True
    attention_biases = staticmethod(Ernie4_5ForCausalLM.attention_biases)
    step_rotary = Ernie4_5ForCausalLM.step_rotary

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        if cfg.get("use_bias"):
            raise ValueError("model: config.json's use_bias is not supported for Ernie4_5_MoeForCausalLM")
        tie = cfg.get("tie_word_embeddings", True)
        super().__init__({**cfg, "tie_word_embeddings": tie}, max_position, backend)

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        width = int(cfg.get("moe_intermediate_size", 1536))
        spec = Experts(
            num_experts=int(cfg.get("moe_num_experts", cfg.get("num_experts", 64))),
            top_k=int(cfg.get("moe_k", cfg.get("num_experts_per_tok", 6))),
            intermediate_size=width,
            renormalize=True,
            shared_intermediate_size=width * int(cfg.get("moe_num_shared_experts", 2)),
            shared_gate=False,
            selection_bias=True,
            router_float32=True,
        )
        num_layers, interval = cfg["num_hidden_layers"], cfg.get("moe_layer_interval", 1)
        if not (isinstance(interval, int) and interval > 0):
            raise ValueError(
                f"model: config.json's moe_layer_interval must be a positive integer, got {interval!r}"
            )
        start, end = int(cfg.get("moe_layer_start_index", 1)), int(cfg.get("moe_layer_end_index", -1))
        end = num_layers - 1 if end == -1 else end
        return [spec if (i + 1) % interval == 0 and start <= i <= end else None for i in range(num_layers)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_ernie_names(weights))


def _ernie_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """ERNIE 4.5 MoE's tensors under our names: its picking bias ([1, experts], under `moe_statics`,
    the Hub's or transformers 5's place) the router's, its shared experts ours; next-token prediction
    tensors left out."""
    for name, tensor in weights:
        if "mtp" in name:
            continue
        if name.endswith("moe_statics.e_score_correction_bias"):
            yield re.sub(r"\.mlp\.(gate\.)?moe_statics\.", ".mlp.gate.", name), tensor.reshape(-1)
        else:
            yield name.replace(".mlp.shared_experts.", ".mlp.shared_expert."), tensor


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3's attention (each query and key head RMS-normed); experts without a shared one."""

    qk_norm = True

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        return qwen_experts(cfg, Experts(128, 8, 768, renormalize=False))


class LayerTypeRopeAttention(LlamaAttention):
    """Llama's attention turned by its layer type's rope: a sliding layer's (`local`, set by its layer)
    the last two of the step's four tables."""

    local = False

    def forward(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.rotated_qkv(rotary[2:4] if self.local else rotary[:2], hidden)
        return self.o_proj(self.attn(q, k, v, metadata))


class MellumDecoderLayer(LlamaDecoderLayer):
    attention_class = LayerTypeRopeAttention

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__(cfg, backend, options, layer_index)
        cast(LayerTypeRopeAttention, self.self_attn).local = (
            cfg["layer_types"][layer_index] == "sliding_attention"
        )


class MellumForCausalLM(Qwen3MoeForCausalLM):
    """JetBrains' Mellum 2 (Mellum2-12B-A2.5B): Qwen3-MoE's layers, sliding attention layers by
    `layer_types` (a window of `sliding_window`, 1,024, and a rope of their own: theta 1e4 against the
    full layers' 5e5 by default), dense MLPs by `mlp_layer_types` (every layer experts by default: 64
    of 896, 8 a token, renormalized); MellumConfig's defaults where config.json leaves a key out
    (`config.mellum_config`). The next-token prediction layers (`mtp.*`) are left out."""

    decoder_layer_class = MellumDecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        cfg = mellum_config(cfg)
        super().__init__(cfg, max_position, backend)
        self.sliding_rotary_emb = RotaryEmbedding(
            head_dim_of(cfg), max_position, gemma3_rope_config(cfg, "sliding_attention")
        )

    @classmethod
    def rope_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        return gemma3_rope_config(mellum_config(cfg), "full_attention")

    def step_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        """The full layers' tables, then the sliding layers'."""
        return (*self.rotary_emb(positions, dtype), *self.sliding_rotary_emb(positions, dtype))

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        spec = Experts(
            num_experts=num_experts_of(cfg, 64),
            top_k=int(cfg.get("num_experts_per_tok", 8)),
            intermediate_size=int(cfg.get("moe_intermediate_size", 896)),
            renormalize=bool(cfg.get("norm_topk_prob", True)),
        )
        sparse = sparse_by_kind(cfg, [True] * cfg["num_hidden_layers"])
        return [spec if is_sparse else None for is_sparse in sparse]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, tensor) for name, tensor in weights if not name.startswith("mtp."))


DOTS1_EXPERTS = {
    "n_routed_experts": None,
    "num_experts_per_tok": None,
    "moe_intermediate_size": 1408,
    "n_shared_experts": None,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
}


class Dots1ForCausalLM(Qwen3MoeForCausalLM):
    """rednote's dots.llm1: Qwen3's attention (each query and key head normed, `attention_bias` on all
    four projections), a window from `max_window_layers` on where config.json sets one (Qwen2's rule,
    on unless `use_sliding_window` is false); the first `first_k_dense_replace` MLPs dense (0 by
    default), the rest DeepSeek-V3's experts (`grouped_sigmoid_experts`: Dots1Config names no default
    for the number of experts, of experts a token, or of shared experts, which config.json must give).
    The checkpoint's shared experts and next-token prediction layers as GLM-4.5's."""

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        for key in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts"):
            if not isinstance(cfg.get(key), int):
                raise ValueError(f"model: config.json's {key} must be an integer, got {cfg.get(key)!r}")
        spec = grouped_sigmoid_experts(cfg, DOTS1_EXPERTS)
        dense = int(cfg.get("first_k_dense_replace") or 0)
        return [None if i < dense else spec for i in range(cfg["num_hidden_layers"])]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(deepseek_v3_names(weights, len(self.layers)))


SOLAR_OPEN_EXPERTS = {
    "n_routed_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1280,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
}


class SolarOpenForCausalLM(MoeForCausalLM):
    """Upstage's Solar Open: Llama's layer with q, k and v biased by `attention_bias` (o never), every
    MLP DeepSeek-V3's experts (`grouped_sigmoid_experts`, SolarOpenConfig's defaults) beside a shared
    one; theta 1,000,000 by default."""

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        return bool(cfg.get("attention_bias", False)), False

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        return [grouped_sigmoid_experts(cfg, SOLAR_OPEN_EXPERTS)] * cfg["num_hidden_layers"]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(deepseek_v3_names(weights, len(self.layers)))


class HYV3ForCausalLM(MoeForCausalLM):
    """Tencent's HY 3 (`HYV3ForCausalLM`): Llama's layer with each query and key head RMS-normed before
    the rotation (Qwen3's); the MLPs dense or experts by `mlp_layer_types` (the first dense, the others
    experts by default): `num_experts` (192), `num_experts_per_tok` (8) a token, each scored by a
    sigmoid and picked by its score plus `e_score_correction_bias`, the picked scores renormalized and
    scaled by `router_scaling_factor` (2.826), the router in float32, beside an ungated shared expert
    of `num_shared_experts` experts' width; theta 11,158,840 by default (HYV3Config's). Its next-token
    prediction layers (past `num_hidden_layers`) are left out."""

    qk_norm = True

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        spec = sigmoid_biased_experts(
            num_experts=num_experts_of(cfg, 192),
            top_k=int(cfg.get("num_experts_per_tok", 8)),
            width=int(cfg.get("moe_intermediate_size", 1536)),
            num_shared=int(cfg.get("num_shared_experts", 1)),
            scale=float(cfg.get("router_scaling_factor", 2.826)),
        )
        first_dense = [i > 0 for i in range(cfg["num_hidden_layers"])]
        return [spec if sparse else None for sparse in sparse_by_kind(cfg, first_dense)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(deepseek_v3_names(_hy_v3_names(weights), len(self.layers)))


# HY 3's names (the Hub's, then transformers') -> DeepSeek-V3's layout
_HY_V3_RENAMES = (
    (".mlp.router.gate.", ".mlp.gate."),
    (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
    (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
    (".mlp.shared_mlp.", ".mlp.shared_experts."),
)


def _hy_v3_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for old, new in _HY_V3_RENAMES:
            name = name.replace(old, new)
        yield name, tensor


def sparse_by_kind(cfg: dict[str, Any], otherwise: list[bool]) -> list[bool]:
    """Which layers' MLPs are experts by `mlp_layer_types` ("dense" or "sparse" a layer: GLM-4.7-Flash's,
    K-EXAONE's), `otherwise` where config.json names none."""
    kinds = cfg.get("mlp_layer_types")
    if kinds is None:
        return otherwise
    if not (isinstance(kinds, list) and len(kinds) == cfg["num_hidden_layers"]):
        raise ValueError(
            f"model: config.json's mlp_layer_types must list one kind a layer "
            f"({cfg['num_hidden_layers']}), got {str(kinds)[:100]}"
        )
    for number, kind in enumerate(kinds):
        if kind not in ("dense", "sparse"):
            raise ValueError(
                f"model: config.json's mlp_layer_types: layer {number} is {kind!r} (dense or sparse)"
            )
    return [kind == "sparse" for kind in kinds]


EXAONE_MOE_EXPERTS = {
    "n_routed_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1024,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}


class ExaoneMoeForCausalLM(MoeForCausalLM):
    """LG's K-EXAONE (ExaoneMoe): EXAONE 4.0's attention (each query and key head normed, three sliding
    layers to one global, the global ones without rope where there is a window) in Llama's pre-norm
    layer (OLMoE's, not EXAONE 4.0's norms after); the MLPs dense or DeepSeek-V3's experts
    (`grouped_sigmoid_experts`: `num_experts`, `num_shared_experts`) by `mlp_layer_types`, else the
    first `first_k_dense_replace` (1) dense; ExaoneMoeConfig's defaults. The checkpoint's next-token
    prediction tensors (`mtp.*`) are not loaded."""

    qk_norm = True
    rotary_layers = staticmethod(Exaone4ForCausalLM.rotary_layers)

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        names = {
            "n_routed_experts": cfg.get("num_experts", 64),
            "n_shared_experts": cfg.get("num_shared_experts", 1),
        }
        spec = grouped_sigmoid_experts({**cfg, **names}, EXAONE_MOE_EXPERTS)
        dense = int(cfg.get("first_k_dense_replace", 1))
        sparse = sparse_by_kind(cfg, [i >= dense for i in range(cfg["num_hidden_layers"])])
        return [spec if is_sparse else None for is_sparse in sparse]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(
            deepseek_v3_names(
                ((n, t) for n, t in weights if not n.startswith(("mtp.", "model.mtp."))), len(self.layers)
            )
        )


class PhimoeDecoderLayer(LlamaDecoderLayer):
    """Phi-3.5-MoE's layer: Mixtral's, its norms LayerNorms (with a bias) at `rms_norm_eps`."""

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return LayerNorm(cfg["hidden_size"], rms_norm_eps(cfg))


class PhimoeForCausalLM(MoeForCausalLM):
    """Microsoft's Phi-3.5-MoE (`PhimoeForCausalLM`): Mixtral's layout with LayerNorms, q, k, v and o
    biased by `attention_bias`, an LM head biased by `lm_head_bias`; every MLP `num_local_experts`
    (16) experts, the 2 `route_sparsemixer` picks (within `router_jitter_noise` 0.01); the rope's
    LongRoPE with its own attention factors (`short_mscale`, `long_mscale`). PhimoeConfig's defaults
    where config.json leaves a key out (theta 1e6)."""

    decoder_layer_class = PhimoeDecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        super().__init__({"rms_norm_eps": 1e-5, **cfg}, max_position, backend)
        if cfg.get("lm_head_bias", False):
            self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"], bias=True)
            if self.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The hub's Mixtral names, or transformers 5's (the router `mlp.router`, the experts stacked)."""
        super().load_weights((name.replace(".mlp.router.", ".mlp.gate."), tensor) for name, tensor in weights)

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        spec = Experts(
            num_experts=num_experts_of(cfg, 16),
            top_k=cfg.get("num_experts_per_tok", 2),
            intermediate_size=cfg.get("intermediate_size", 6400),
            renormalize=False,
            scoring="sparsemixer",
            sparsemixer_eps=float(cfg.get("router_jitter_noise", 0.01)),
        )
        return [spec] * cfg["num_hidden_layers"]


class HunYuanMoEV1ForCausalLM(MoeForCausalLM):
    """Tencent's Hunyuan-A13B (`HunYuanMoEV1ForCausalLM`): Hunyuan's dense layer (each query and key
    head RMS-normed after the rotation) with every MLP `num_experts` experts, the top `moe_topk` (an
    int, or one a layer) by a float32 router's softmax (`gate.wg`), renormalized, beside a shared MLP
    (`shared_mlp`, ungated by any weight); experts and shared MLP `intermediate_size` wide, as
    transformers builds them."""

    decoder_layer_class = HunYuanDecoderLayer
    qk_norm = True

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        num_layers, top_ks = cfg["num_hidden_layers"], cfg.get("moe_topk", 1)
        top_ks = top_ks if isinstance(top_ks, list) else [top_ks] * num_layers
        if len(top_ks) != num_layers:
            raise ValueError(
                f"model: config.json's moe_topk lists {len(top_ks)} values for {num_layers} layers"
            )
        return [
            Experts(
                num_experts=int(cfg.get("num_experts", 1)),
                top_k=int(top_k),
                intermediate_size=cfg["intermediate_size"],
                renormalize=True,
                shared_intermediate_size=cfg["intermediate_size"],
                shared_gate=False,
                router_float32=True,
            )
            for top_k in top_ks
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((_hunyuan_moe_name(name), tensor) for name, tensor in weights)


def _hunyuan_moe_name(name: str) -> str:
    """Hunyuan-A13B's names as ours: Hunyuan's head norms, its router (`gate.wg`) and its shared MLP."""
    return (
        hunyuan_name(name)
        .replace(".mlp.gate.wg.", ".mlp.gate.")
        .replace(".mlp.shared_mlp.", ".mlp.shared_expert.")
    )
