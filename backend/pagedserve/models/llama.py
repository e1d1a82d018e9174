"""Llama-family decoder (Llama, Mistral, Ministral 3, Qwen2, Qwen3, Granite 3, Phi-3, SmolLM3, InternLM3,
Seed-OSS, ERNIE 4.5, GLM-4, EXAONE 4.0, Hunyuan layouts): GQA, RoPE, RMSNorm, SwiGLU, tied or untied
embeddings, Qwen3's RMSNorm of each query and key head, Granite's multipliers, Phi-3's fused
checkpoint tensors, SmolLM3's layers without rotary, GPT-J's rotary (ERNIE's, GLM's) as NeoX's over
reordered rows, norms after attention and the MLP (EXAONE's, OLMo's), and the sliding windows of
Mistral, Phi-3 and Qwen's, SmolLM3's and EXAONE's sliding layers. Mirrors Hugging Face's
LlamaForCausalLM; the difference is paged attention and tensor-parallel layers. Input is one packed
batch of tokens, [num_tokens]."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from pagedserve.config import (
    architecture_of,
    default_head_dim,
    default_layer_types,
    layer_windows,
    rope_parameters,
    smollm3_rotary_layers,
)
from pagedserve.layers import ops
from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.attention import Attention, AttentionBackend, AttentionMetadata
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedserve.layers.moe import Experts, SparseMoeBlock
from pagedserve.layers.norm import Float32RMSNorm, RMSNorm
from pagedserve.layers.recurrent import RecurrentLayer
from pagedserve.layers.rotary import RotaryEmbedding

# a step's cos and sin tables, shared by every layer (and after them a model's own: Gemma's and OLMo 3's
# sliding layers' tables, Ministral 3's query scales)
Rotary = tuple[torch.Tensor, ...]
Biases = tuple[bool, bool]  # whether the q/k/v projections and the o projection carry a bias


def head_dim_of(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def rms_norm_eps(cfg: dict[str, Any]) -> float:
    """transformers' default (LlamaConfig, MistralConfig, Qwen2Config) where config.json omits it."""
    return float(cfg.get("rms_norm_eps", 1e-6))


@dataclass(frozen=True)
class Scales:
    """The constants Granite multiplies by where Llama multiplies by none: the embeddings, q.k (in
    place of 1 / sqrt(head_dim)), each layer's attention and MLP output before it joins the residual
    stream, and the logits (divided by `logits`). The defaults are Llama's."""

    embedding: float = 1.0
    attention: float | None = None  # None: 1 / sqrt(head_dim)
    residual: float = 1.0
    logits: float = 1.0


@dataclass(frozen=True)
class LayerOptions:
    """How one decoder layer departs from Llama's (`LlamaForCausalLM.layer_options`)."""

    biases: Biases = (False, False)
    qk_norm: bool = False  # Qwen3's RMSNorm of each query and key head
    scales: Scales = field(default_factory=Scales)
    rotary: bool = True  # False: SmolLM3's NoPE layers, whose q and k turn by no position
    window: int = 0  # a sliding window: queries see the last `window` positions alone (0: all)
    experts: Experts | None = None  # an MLP of experts (`layers.moe`) in place of the dense one
    sinks: bool = False  # GPT-OSS's attention sinks: a learned logit a head joins each softmax


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__()
        hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        head_dim = head_dim_of(cfg)
        qkv_bias, o_bias = options.biases
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=o_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.head_dim = head_dim
        # Qwen3: every query head and every key head RMS-normed over its head_dim before the rotation,
        # with one weight for all query heads and one for all key heads (whole on every rank)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps(cfg)) if options.qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps(cfg)) if options.qk_norm else None
        self.rotary = options.rotary
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            head_dim,
            backend,
            layer_index,
            scale=options.scales.attention,
            window=options.window,
            sinks=options.sinks,
        )

    def forward(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attn(*self.rotated_qkv(rotary, hidden), metadata))

    def rotated_qkv(
        self, rotary: Rotary, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k [tokens, heads, head_dim] normed where the model norms them and turned, v [tokens,
        kv heads x head_dim]."""
        qkv = self.project_qkv(hidden)  # each row: [ q heads | k heads | v heads ]
        # q and k sit side by side in every row, so one rotation covers both
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat(
                (
                    ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps),
                    ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps),
                ),
                dim=1,
            )
        if self.rotary:
            qk = ops.apply_rotary(qk, *rotary)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, qkv[:, self.q_size + self.kv_size :]

    def project_qkv(self, hidden: torch.Tensor) -> torch.Tensor:
        """q, k and v side by side in each row (OLMo 1's clamped)."""
        return self.qkv_proj(hidden)


class HunYuanAttention(LlamaAttention):
    """Llama's attention with Hunyuan's query and key head norms after the rotation (Qwen3's come
    before it)."""

    def rotated_qkv(
        self, rotary: Rotary, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.qkv_proj(hidden)
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = ops.apply_rotary(qk, *rotary[:2]).split([self.num_heads, self.num_kv_heads], dim=1)
        assert self.q_norm is not None and self.k_norm is not None  # (`HunYuanDenseV1ForCausalLM.qk_norm`)
        q = ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
        k = ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        return q, k, qkv[:, self.q_size + self.kv_size :]


class Ministral3Attention(LlamaAttention):
    """Llama's attention with Ministral 3's queries scaled by their positions after the rotation (Llama
    4's scaling: the step's third table, `Ministral3ForCausalLM.step_rotary`)."""

    def forward(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.rotated_qkv(rotary[:2], hidden)
        return self.o_proj(self.attn(q * rotary[2].to(q.dtype), k, v, metadata))


def check_silu(cfg: dict[str, Any]) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model: config.json's hidden_act {cfg['hidden_act']!r} is not supported (silu is)")


class LlamaMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, inter, bias = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("mlp_bias", False)
        check_silu(cfg)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_class: type[LlamaAttention] = LlamaAttention  # OLMoE's: its q and k normed whole

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__()
        self.self_attn = self.attention_class(cfg, backend, options, layer_index)
        self.mlp = (
            self.dense_mlp(cfg)
            if options.experts is None
            else SparseMoeBlock(cfg["hidden_size"], options.experts)
        )
        self.residual_multiplier = options.scales.residual
        self.input_layernorm = self.norm(cfg)
        self.post_attention_layernorm = self.norm(cfg)

    def dense_mlp(self, cfg: dict[str, Any]) -> nn.Module:
        """The MLP of a layer without experts: Llama's SwiGLU (ungated ones: `models.ungated`)."""
        return LlamaMLP(cfg)

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        """Each of the layer's norms, and the model's final one (`LlamaForCausalLM`): Llama's RMSNorm
        (LayerNorms: `models.ungated`, `models.neox`...)."""
        return RMSNorm(cfg["hidden_size"], rms_norm_eps(cfg))

    def normed_input(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input normed, and the residual stream with the last layer's output added (the
        embeddings themselves at the first layer, which has no residual yet)."""
        if residual is None:
            return cast(torch.Tensor, self.input_layernorm(hidden)), hidden
        return cast(tuple[torch.Tensor, torch.Tensor], self.input_layernorm(hidden, residual))

    def mix(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The layer's token mixer: attention (a hybrid's recurrent layers: `models.hybrid`)."""
        return cast(torch.Tensor, self.self_attn(rotary, hidden, metadata))

    def forward(
        self,
        rotary: Rotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.normed_input(hidden, residual)
        hidden = self.mix(rotary, hidden, metadata)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.residual_multiplier != 1.0:  # (the next layer's norm or the final one adds it)
            hidden = hidden * self.residual_multiplier
        return hidden, residual


def residual_stream(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The residual stream a layer takes under Llama's layer protocol: the previous layer's output and
    its residual added (the embeddings alone at the first layer)."""
    return hidden if residual is None else residual + hidden


class PostNormDecoderLayer(LlamaDecoderLayer):
    """Llama's layer protocol (it takes the residual stream as `hidden + residual` and returns its own
    pair) with the norms after attention and the MLP instead of before them (OLMo 2's, EXAONE 4's):
    each one's output normed, then added to the residual stream."""

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        nn.Module.__init__(self)  # (not Llama's norms)
        self.self_attn = self.attention_class(cfg, backend, options, layer_index)
        self.mlp = (  # (FlexOlmo's experts)
            self.dense_mlp(cfg)
            if options.experts is None
            else SparseMoeBlock(cfg["hidden_size"], options.experts)
        )
        self.post_attention_layernorm = self.norm(cfg)  # (OLMo's: multiplied in float32)
        self.post_feedforward_layernorm = self.norm(cfg)

    def forward(
        self,
        rotary: Rotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = residual_stream(hidden, residual)
        attended = self.self_attn(rotary, stream, metadata)
        stream = stream + cast(torch.Tensor, self.post_attention_layernorm(attended))
        return cast(torch.Tensor, self.post_feedforward_layernorm(self.mlp(stream))), stream


def run_layer(
    layer: nn.Module,
    rotary: Rotary,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    metadata: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer's step, as a function of the layer: what the model runner compiles once for
    every layer of a model."""
    return layer(rotary, hidden, residual, metadata)


LayerStep = Callable[
    [nn.Module, Rotary, torch.Tensor, torch.Tensor | None, AttentionMetadata],
    tuple[torch.Tensor, torch.Tensor],
]


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (our merged parameter, shard id)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False  # Qwen3's RMSNorm of each query and key head
    rotates_part_of_a_head = False  # Phi-3's `partial_rotary_factor`: the first part of each head turns
    # the config class's partial_rotary_factor where config.json names none (GLM-4's 0.5...; None: 1)
    default_partial_rotary: float | None = None
    decoder_layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer  # OLMo's put their norms elsewhere
    # ERNIE 4.5's and GLM-4's rotary turns neighbouring dimensions, (x0, x1), (x2, x3), ... (GPT-J's):
    # their q and k rows are reordered on load (`checkpoint_rows`) so that NeoX's rotation does the same
    interleaved_rotary = False

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        super().__init__()
        if not self.rotates_part_of_a_head:
            _check_full_rotary(self.rope_config(cfg), architecture_of(cfg, "LlamaForCausalLM"))
        self.scales = self.read_scales(cfg)
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.rotary_emb = RotaryEmbedding(head_dim_of(cfg), max_position, self.rope_config(cfg))
        self.layers = nn.ModuleList(
            self.decoder_layer_class(cfg, backend, options, index)
            for index, options in enumerate(self.layer_options(cfg))
        )
        self.norm = self.decoder_layer_class.norm(cfg)  # (the layers' kind of norm)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"])
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        """Llama's `attention_bias` covers all four projections (as in transformers)."""
        bias = bool(cfg.get("attention_bias", False))
        return bias, bias

    @staticmethod
    def read_scales(cfg: dict[str, Any]) -> Scales:
        """Llama's: none (transformers' Llama reads no multiplier a config.json might carry)."""
        return Scales()

    @classmethod
    def rope_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """The config `rotary_emb` reads its rope from: config.json itself, with the config class's
        `default_partial_rotary` where it names no partial_rotary_factor (OLMo 3's global layers have
        a rope of their own)."""
        if cls.default_partial_rotary is None or "partial_rotary_factor" in rope_parameters(cfg):
            return cfg
        return {**cfg, "partial_rotary_factor": cls.default_partial_rotary}

    @staticmethod
    def rotary_layers(cfg: dict[str, Any]) -> list[bool]:
        """Which layers turn q and k by their positions: all of Llama's."""
        return [True] * cfg["num_hidden_layers"]

    def layer_options(self, cfg: dict[str, Any]) -> list[LayerOptions]:
        biases, qk_norm, scales = self.attention_biases(cfg), self.qk_norm, self.scales
        windows = layer_windows(cfg, architecture_of(cfg, "LlamaForCausalLM"))
        return [
            LayerOptions(biases, qk_norm, scales, rotary, window)
            for rotary, window in zip(self.rotary_layers(cfg), windows, strict=True)
        ]

    @property
    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """`layers` typed for set-up code: nn.ModuleList is not generic, so its items type as Module;
        `__init__` fills it with LlamaDecoderLayer alone. (`forward` iterates `layers` as it is.)"""
        return cast(list[LlamaDecoderLayer], list(self.layers))

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.decoder_layers]

    @property
    def recurrent_layers(self) -> list[RecurrentLayer]:
        """The layers that carry a state per request from step to step (LFM2's, Mamba2's)."""
        return [module for module in self.modules() if isinstance(module, RecurrentLayer)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        layer_step: LayerStep | None = None,
    ) -> torch.Tensor:
        """The hidden states of the last layer, normed. `layer_step`, where given, runs each decoder
        layer in place of calling it (the model runner's layer compiled alone, `ModelRunner._compile`)."""
        hidden = self.embed(input_ids, positions)
        # Layers compiled one at a time take the rotary tables in float32, as the whole model's graph
        # read them (inductor fuses the tables' cast to bf16 away): tables rounded to bf16 between
        # graphs put the default model's bf16 logprobs further from float32's (mean error on
        # test_hf_parity's chat prompts 0.0605 against 0.0541, the whole graph 0.050)
        rotary = self.step_rotary(positions, hidden.dtype if layer_step is None else torch.float32)
        hidden, residual = self.run_layers(rotary, hidden, metadata, layer_step)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (times Granite's multiplier; GPT-2's add their positions')."""
        hidden = self.embed_tokens(input_ids)
        if self.scales.embedding != 1.0:
            hidden = hidden * self.scales.embedding
        return hidden

    def run_layers(
        self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata, layer_step: LayerStep | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers over the embeddings `hidden`: the last layer's output and the residual
        stream beside it (their sum, normed, is the model's hidden state)."""
        residual = None
        for layer in self.layers:
            if layer_step is None:
                hidden, residual = layer(rotary, hidden, residual, metadata)
            else:
                hidden, residual = layer_step(layer, rotary, hidden, residual, metadata)
        assert residual is not None, "a model of no layers"
        return hidden, residual

    def checkpoint_rows(self, projection: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint's `projection` tensor (a weight, a bias, a LoRA's lora_B) with its rows as this
        model reads them: the same but under `interleaved_rotary`, whose q_proj and k_proj rows are
        reordered in each head, the rotated dimensions' evens first, then their odds (the pairs GPT-J
        turns together become NeoX's halves, turned by the same frequencies), the rest as they are.
        q.k sums the same products in another order."""
        if not self.interleaved_rotary or projection not in ("q_proj", "k_proj"):
            return tensor
        head_dim, rotary_dim = self.decoder_layers[0].self_attn.head_dim, self.rotary_emb.rotary_dim
        order = torch.cat(
            (
                torch.arange(0, rotary_dim, 2),
                torch.arange(1, rotary_dim, 2),
                torch.arange(rotary_dim, head_dim),
            )
        )
        if tensor.shape[0] % head_dim:
            raise ValueError(
                f"checkpoint's {projection} has {tensor.shape[0]} rows, no whole number of heads"
            )
        return tensor.unflatten(0, (-1, head_dim))[:, order].flatten(0, 1)

    def step_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        """What every layer of a step turns q and k by: the cos and sin tables of its positions (and
        Ministral 3's scale of its queries)."""
        return self.rotary_emb(positions, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        return logits if self.scales.logits == 1.0 else logits / self.scales.logits

    def greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`compute_logits(hidden)`'s argmax a row, without the logits where the LM head's kernel takes
        it (`ParallelLMHead.greedy_token_ids`); None elsewhere. (Dividing by a positive logits scale,
        `read_scales` checks it is one, moves no argmax.)"""
        return self.lm_head.greedy_token_ids(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for checkpoint_name, tensor in text_decoder_weights(weights):
            name = checkpoint_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            for ckpt_part, (our_part, shard_id) in self.stacked_params.items():
                if f".{ckpt_part}." in name:
                    target = name.replace(ckpt_part, our_part)
                    if _zero_bias_absent(params, target, tensor):
                        break
                    param = _param(params, target, checkpoint_name)
                    rows = self.checkpoint_rows(ckpt_part, tensor)
                    param.weight_loader(param, rows, shard_id)  # type: ignore[attr-defined]
                    loaded.add(target)
                    break
            else:
                if _zero_bias_absent(params, name, tensor):
                    continue
                param = _param(params, name, checkpoint_name)
                getattr(param, "weight_loader", _default_loader)(param, tensor)
                loaded.add(name)
        missing = {
            n for n in params if n not in loaded and not (self.tie_word_embeddings and n == "lm_head.weight")
        }
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]} ...")


# a multimodal checkpoint's language model (transformers 5's names, the Hub's) -> a text-only one's
_TEXT_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_IMAGE_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "visual.",  # Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision towers
    "model.visual.",
    "vision_model.",  # Llama 4's
    "model.vision_model.",
    "vision_embed_tokens.",  # Fuyu's
    "model.vision_embed_tokens.",
)


def text_decoder_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a text-only checkpoint, under its names: a multimodal checkpoint's language
    model (Gemma3ForConditionalGeneration's, Mistral3ForConditionalGeneration's) renamed, its vision
    tower and projector left out (`config.text_decoder_config`); a text-only checkpoint's as they are."""
    for name, tensor in weights:
        if name.startswith(_IMAGE_PREFIXES):
            continue
        prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
        yield (name if prefix is None else _TEXT_PREFIXES[prefix] + name.removeprefix(prefix)), tensor


def _zero_bias_absent(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> bool:
    """A bias of zeros where the model has none: AutoGPTQ and AutoAWQ save one for every layer they
    quantize (vLLM skips them too); it adds nothing."""
    return name.endswith(".bias") and name not in params and not bool(tensor.any())


def _param(params: dict[str, nn.Parameter], name: str, checkpoint_name: str) -> nn.Parameter:
    if name not in params:
        raise ValueError(f"checkpoint has a weight this model does not: {checkpoint_name!r}")
    return params[name]


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        """Qwen2 always biases q, k and v and never o; transformers reads no `attention_bias` for it."""
        return True, False


class InternLM3ForCausalLM(LlamaForCausalLM):
    """Shanghai AI Lab's InternLM3 (8B): Llama's layer with q, k and v biased by `qkv_bias` and o and the
    MLP by `bias` (InternLM3Config's names; transformers reads them as Llama's attention_bias and
    mlp_bias, which it requires equal), head_dim 128 by default."""

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        bias = cfg.get("bias", cfg.get("mlp_bias", False))
        super().__init__({**default_head_dim(cfg), "mlp_bias": bias}, max_position, backend)

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        qkv = cfg.get("qkv_bias", cfg.get("attention_bias", False))
        return bool(qkv), bool(cfg.get("bias", cfg.get("attention_bias", False)))


class SeedOssForCausalLM(LlamaForCausalLM):
    """ByteDance's Seed-OSS: Llama's layer with q, k and v biased by `attention_bias` (on by default)
    and o by `attention_out_bias` (off), as transformers' SeedOssAttention reads them."""

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        return bool(cfg.get("attention_bias", True)), bool(cfg.get("attention_out_bias", False))


class Ernie4_5ForCausalLM(LlamaForCausalLM):  # noqa: N801 (transformers' name)
    """Baidu's ERNIE 4.5 dense models (ERNIE-4.5-0.3B): Llama's layer with every projection biased by
    `use_bias`, the LM head tied by default, and GPT-J's rotary (`interleaved_rotary`) computed in
    float32, as transformers' Ernie4_5 does (its tables float32, q and k turned in float32, rounded
    once)."""

    interleaved_rotary = True

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        # (Ernie4_5Config's defaults: a tied head; its MLP biased as its attention is)
        tie = cfg.get("tie_word_embeddings", True)
        super().__init__(
            {**cfg, "mlp_bias": cfg.get("use_bias", False), "tie_word_embeddings": tie}, max_position, backend
        )

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        bias = bool(cfg.get("use_bias", False))
        return bias, bias

    def step_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        return self.rotary_emb(positions, torch.float32)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama's layout (`attention_bias` covers q, k, v and o, as in transformers' Qwen3) with each
    query and key head RMS-normed before the rotation (`q_norm`, `k_norm`)."""

    qk_norm = True


class GraniteForCausalLM(LlamaForCausalLM):
    """Llama's layout (`attention_bias` and `mlp_bias` as Llama's) with IBM Granite's four multipliers
    (`Scales`), as transformers' GraniteForCausalLM applies them."""

    @staticmethod
    def read_scales(cfg: dict[str, Any]) -> Scales:
        scales = Scales(
            embedding=float(cfg.get("embedding_multiplier", 1.0)),
            attention=float(cfg.get("attention_multiplier", 1.0)),
            residual=float(cfg.get("residual_multiplier", 1.0)),
            logits=float(cfg.get("logits_scaling", 1.0)),
        )
        if not scales.logits > 0:  # (a greedy step takes the argmax of the logits before dividing)
            raise ValueError(f"model: config.json's logits_scaling must be positive, got {scales.logits}")
        return scales


def granite_swa_thetas(cfg: dict[str, Any]) -> list[float]:
    """Granite SWA's rope theta a layer (`layer_rope_theta`; 0: no rope), the model's where config.json
    names none."""
    thetas = cfg.get("layer_rope_theta") or [rope_parameters(cfg)["rope_theta"]] * cfg["num_hidden_layers"]
    if len(thetas) != cfg["num_hidden_layers"]:
        raise ValueError(
            f"model: config.json's layer_rope_theta has {len(thetas)} entries for {cfg['num_hidden_layers']} layers"
        )
    return [float(theta) for theta in thetas]


class GraniteSWAAttention(LlamaAttention):
    """Llama's attention turned by its layer's rope: the step's tables `table` (two a theta)."""

    table = 0

    def forward(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        tables = rotary[2 * self.table : 2 * self.table + 2]
        return self.o_proj(self.attn(*self.rotated_qkv(tables, hidden), metadata))


class GraniteSWADecoderLayer(LlamaDecoderLayer):
    attention_class = GraniteSWAAttention


class LayerThetas(nn.Module):
    """Granite SWA's ropes: one table pair a distinct non-zero `layer_rope_theta`, each layer's
    attention told which pair is its (`GraniteSWAAttention.table`); theta 0 turns none (its layer's
    `rotary_layers` entry is False)."""

    def __init__(self, cfg: dict[str, Any], max_position: int, attentions: list[GraniteSWAAttention]) -> None:
        super().__init__()
        thetas = granite_swa_thetas(cfg)
        distinct = sorted({theta for theta in thetas if theta})
        rope = {key: value for key, value in cfg.items() if key not in ("rope_scaling", "rope_theta")}
        self.rotary_embs = nn.ModuleList(
            RotaryEmbedding(
                head_dim_of(cfg),
                max_position,
                {**rope, "rope_parameters": {**rope_parameters(cfg), "rope_theta": theta}},
            )
            for theta in distinct
        )
        for attention, theta in zip(attentions, thetas, strict=True):
            if theta:
                attention.table = distinct.index(theta)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        return tuple(table for rotary in self.rotary_embs for table in rotary(positions, dtype))


def swa_attentions(model: LlamaForCausalLM) -> list[GraniteSWAAttention]:
    return [cast(GraniteSWAAttention, layer.self_attn) for layer in model.decoder_layers]


class GraniteSWALayers(LlamaForCausalLM):
    """What Granite SWA's layers add to a model, its dense one or its MoE one (put first among the
    bases): a learned sink a head in every layer's attention (GPT-OSS's), a window of `sliding_window`
    (128) in the layers `layer_types` names (every one but each fourth from the first by default),
    each layer's rope at its `layer_rope_theta` (0: none: `LayerThetas`), the LM head tied by default."""

    decoder_layer_class: type[LlamaDecoderLayer] = GraniteSWADecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        cfg = {**cfg, "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
        super().__init__(cfg, max_position, backend)
        self.layer_thetas = LayerThetas(cfg, max_position, swa_attentions(self))

    @staticmethod
    def rotary_layers(cfg: dict[str, Any]) -> list[bool]:
        return [bool(theta) for theta in granite_swa_thetas(cfg)]

    def layer_options(self, cfg: dict[str, Any]) -> list[LayerOptions]:
        return [dataclasses.replace(options, sinks=True) for options in super().layer_options(cfg)]

    def step_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        return cast(Rotary, self.layer_thetas(positions, dtype))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(sinks_renamed(weights))


class GraniteSWAForCausalLM(GraniteSWALayers, GraniteForCausalLM):
    """IBM's Granite SWA: Granite's layer and multipliers in Granite SWA's layers (`GraniteSWALayers`);
    GraniteSWAConfig's defaults where config.json leaves a key out."""


def sinks_renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's attention sinks (`self_attn.sinks`) under our name (its `Attention`'s)."""
    for name, tensor in weights:
        yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor


class HyperCLOVAXDecoderLayer(LlamaDecoderLayer):
    """Granite's layer with each branch's output normed (`post_norm1`, `post_norm2`, where
    `use_post_norm`) before the residual multiplier scales it."""

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__(cfg, backend, options, layer_index)
        post_norms = bool(cfg.get("use_post_norm", True))
        self.post_norm1 = self.norm(cfg) if post_norms else None
        self.post_norm2 = self.norm(cfg) if post_norms else None

    def forward(
        self,
        rotary: Rotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.normed_input(hidden, residual)
        hidden = self.mix(rotary, hidden, metadata)
        if self.post_norm1 is not None:
            hidden = cast(torch.Tensor, self.post_norm1(hidden))
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.post_norm2 is not None:
            hidden = cast(torch.Tensor, self.post_norm2(hidden))
        if self.residual_multiplier != 1.0:  # (the next layer's norm or the final one adds it)
            hidden = hidden * self.residual_multiplier
        return hidden, residual


class HyperCLOVAXForCausalLM(GraniteForCausalLM):
    """NAVER's HyperCLOVA X SEED (Think 14B, Text Instruct): Granite's layer and multipliers, each branch's
    output normed before the residual multiplier (`HyperCLOVAXDecoderLayer`), q.k by
    `attention_multiplier` (head_dim^-1/2 by default), the logits multiplied by `logits_scaling` (Granite
    divides by its); HyperCLOVAXConfig's defaults where config.json leaves a key out (every multiplier 1)."""

    decoder_layer_class = HyperCLOVAXDecoderLayer

    @staticmethod
    def read_scales(cfg: dict[str, Any]) -> Scales:
        logits = float(cfg.get("logits_scaling", 1.0))
        if not logits > 0:  # (a greedy step takes the argmax of the logits before scaling)
            raise ValueError(f"model: config.json's logits_scaling must be positive, got {logits}")
        attention = cfg.get("attention_multiplier")
        return Scales(
            embedding=float(cfg.get("embedding_multiplier", 1.0)),
            attention=None if attention is None else float(attention),
            residual=float(cfg.get("residual_multiplier", 1.0)),
            logits=1.0 / logits,
        )


def granite_shared_mlp(
    weights: Iterable[tuple[str, torch.Tensor]], ours: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Granite's `shared_mlp` tensors under Llama's names in our module `ours` (Granite 4.0's dense
    MLP, `mlp`; Granite MoE's shared expert, `mlp.shared_expert`): `input_linear` [2 x intermediate,
    hidden] is gate then up, `output_linear` down."""
    for name, tensor in weights:
        if name.endswith(".shared_mlp.input_linear.weight"):
            gate, up = tensor.chunk(2)
            yield name.replace("shared_mlp.input_linear", f"{ours}.gate_proj"), gate
            yield name.replace("shared_mlp.input_linear", f"{ours}.up_proj"), up
        else:
            yield name.replace(".shared_mlp.output_linear.", f".{ours}.down_proj."), tensor


class HunYuanDecoderLayer(LlamaDecoderLayer):
    attention_class = HunYuanAttention


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    """Tencent's Hunyuan dense models (Hunyuan-0.5B to 7B): Llama's layer with each query and key
    head RMS-normed after the rotation (`query_layernorm`, `key_layernorm`), and the rope its
    checkpoints call "dynamic" with a fixed `alpha` (the base stretched once: `layers.rotary`)."""

    decoder_layer_class = HunYuanDecoderLayer
    qk_norm = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((hunyuan_name(name), tensor) for name, tensor in weights)


def hunyuan_name(name: str) -> str:
    """Hunyuan's head norms (`query_layernorm`, `key_layernorm`) under our names."""
    return name.replace(".query_layernorm.", ".q_norm.").replace(".key_layernorm.", ".k_norm.")


class Ministral3DecoderLayer(LlamaDecoderLayer):
    attention_class = Ministral3Attention


class Ministral3ForCausalLM(LlamaForCausalLM):
    """Mistral AI's Ministral 3 (the text decoder of its Mistral3ForConditionalGeneration checkpoints):
    Mistral's layer (a window in every layer where config.json sets `sliding_window`), YaRN, and each
    query multiplied after its rotation by 1 + beta ln(1 + floor(position / the pretraining length))
    (`llama_4_scaling_beta` and `original_max_position_embeddings` of its rope), in the query's dtype,
    as transformers' Ministral3Attention does: 1 within the pretraining length."""

    decoder_layer_class = Ministral3DecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        super().__init__(cfg, max_position, backend)
        rope = rope_parameters(cfg)
        beta, length = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
        if not (isinstance(beta, int | float) and isinstance(length, int) and length > 0):
            raise ValueError(
                "model: config.json's rope needs a numeric llama_4_scaling_beta and a positive integer "
                f"original_max_position_embeddings for Ministral3ForCausalLM, got {beta!r} and {length!r}"
            )
        self.query_scaling_beta, self.query_scaling_length = float(beta), length

    def step_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        cos, sin = self.rotary_emb(positions, dtype)
        periods = torch.floor(positions.float() / self.query_scaling_length)
        scale = 1.0 + self.query_scaling_beta * torch.log1p(periods)
        return cos, sin, scale[:, None, None].to(dtype)  # (in float32 a compiled layer casts it to q's)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's layout, stored as Microsoft's Phi-3 checkpoints store it: q, k and v in one tensor
    (`qkv_proj`) and gate and up in another (`gate_up_proj`). Each is cut into its parts on load, so
    that the parts shard across ranks as Llama's do (a rank's q heads and k/v heads come from
    different rows of the fused tensor). transformers' Phi3 turns the first `partial_rotary_factor` of
    each head (Phi-4-mini: 0.75) and passes the rest, as `ops.apply_rotary` does."""

    rotates_part_of_a_head = True

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        super().__init__(cfg, max_position, backend)
        head_dim, num_heads = head_dim_of(cfg), cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        self.qkv_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each fused tensor as its parts, under the names Llama's checkpoints give them."""
        for name, tensor in weights:
            if name.endswith(".self_attn.qkv_proj.weight"):
                if tensor.shape[0] != sum(self.qkv_sizes):
                    raise ValueError(
                        f"checkpoint's {name!r} has {tensor.shape[0]} rows; config.json's heads make "
                        f"{sum(self.qkv_sizes)}"
                    )
                for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split(self.qkv_sizes)):
                    yield name.replace("qkv_proj", part), rows
            elif name.endswith(".mlp.gate_up_proj.weight"):
                gate, up = tensor.chunk(2)
                yield name.replace("gate_up_proj", "gate_proj"), gate
                yield name.replace("gate_up_proj", "up_proj"), up
            else:
                yield name, tensor


class Glm4DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with GLM-4's two more norms: of the attention's output and of the MLP's, each
    before it joins the residual stream (Llama's RMSNorm)."""

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__(cfg, backend, options, layer_index)
        self.post_self_attn_layernorm = RMSNorm(cfg["hidden_size"], rms_norm_eps(cfg))
        self.post_mlp_layernorm = RMSNorm(cfg["hidden_size"], rms_norm_eps(cfg))

    def forward(
        self,
        rotary: Rotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.normed_input(hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(rotary, hidden, metadata))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class Glm4ForCausalLM(Phi3ForCausalLM):
    """Zhipu's GLM-4-0414 (GLM-4-9B, GLM-4-32B, GLM-Z1): q, k and v biased (`attention_bias`, on by
    default), o not; gate and up in one checkpoint tensor (`gate_up_proj`, cut as Phi-3's); norms
    after the attention and the MLP too (`Glm4DecoderLayer`); GPT-J's rotary over the first
    `partial_rotary_factor` of each head (0.5 by default), `interleaved_rotary`."""

    decoder_layer_class: type[LlamaDecoderLayer] = Glm4DecoderLayer
    interleaved_rotary = True
    default_partial_rotary = 0.5  # Glm4Config's

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        eps = cfg.get("rms_norm_eps", 1.5625e-07)  # (Glm4Config's and GlmConfig's default)
        super().__init__({**cfg, "rms_norm_eps": eps}, max_position, backend)

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        return bool(cfg.get("attention_bias", True)), False


class GlmForCausalLM(Glm4ForCausalLM):
    """Zhipu's GLM-4 (GLM-4-9B-Chat, GLM-4-9B-0414's predecessor; glm-edge): GLM-4-0414's attention,
    fused gate/up and partial GPT-J rotary in Llama's layer (no norms after attention and the MLP);
    GlmConfig's defaults where config.json leaves a key out."""

    decoder_layer_class = LlamaDecoderLayer


class HeliumDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with norms that multiply by their weights in float32 (HeliumRMSNorm)."""

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return Float32RMSNorm(cfg["hidden_size"], rms_norm_eps(cfg))


class HeliumForCausalLM(LlamaForCausalLM):
    """Kyutai's Helium (2B): Llama's layer with float32-weighted norms (eps 1e-8 by default), q, k and v
    biased by `attention_bias` (o never), GPT-J's rotary (`interleaved_rotary`), head_dim 128 by
    default (HeliumConfig's)."""

    decoder_layer_class = HeliumDecoderLayer
    interleaved_rotary = True

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        defaults = {"head_dim": cfg.get("head_dim") or 128, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-8)}
        super().__init__({**cfg, **defaults}, max_position, backend)

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        return bool(cfg.get("attention_bias", False)), False


class Exaone4ForCausalLM(LlamaForCausalLM):
    """LG's EXAONE 4.0: norms after attention and the MLP (`PostNormDecoderLayer`), each query and key
    head RMS-normed before the rotation (Qwen3's), three sliding layers to one global by default
    (`sliding_window_pattern` 4), the global ones turning by no rope (NoPE) where the model has a
    window at all, as transformers' Exaone4Attention does."""

    decoder_layer_class = PostNormDecoderLayer
    qk_norm = True

    @staticmethod
    def rotary_layers(cfg: dict[str, Any]) -> list[bool]:
        if not cfg.get("sliding_window"):
            return [True] * cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types") or default_layer_types(cfg, "Exaone4ForCausalLM")
        return [kind == "sliding_attention" for kind in layer_types]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama's layout with no rotary in some layers (NoPE; by default every fourth)."""

    @staticmethod
    def rotary_layers(cfg: dict[str, Any]) -> list[bool]:
        return smollm3_rotary_layers(cfg)


def _check_full_rotary(rope_cfg: dict[str, Any], architecture: str) -> None:
    """transformers' Llama, Mistral and Qwen2 rotate the whole head: their default rope ignores a
    `partial_rotary_factor` and their scaled ropes fail on it. Which dimensions such a checkpoint
    was trained to rotate is unknown, so it is refused rather than guessed."""
    factor = rope_parameters(rope_cfg).get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise ValueError(
            f"model: config.json's partial_rotary_factor {factor} is not supported for {architecture} "
            "(the whole head rotates)"
        )


def _default_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    assert param.shape == loaded.shape, f"shape mismatch: {tuple(param.shape)} vs {tuple(loaded.shape)}"
    param.data.copy_(loaded)
