"""Decode-only steps of a Llama-family model in one C++ call (`pagedserve_kernels.cpu.decode_layers`).

At decode batch sizes on a CPU the compiled forward pass spends ~2 ms a step between and in its small
kernels (inductor's Python wrapper calls ~8 ops a layer); the weights and the KV cache are read at the
machine's streaming rate already. The eager pass dispatches an op for every norm, rotary, SiLU and
add on top (the 64-request chat benchmark, eager: 425.0 tok/s with its decode steps through it,
680.1 through `decode_layers`; bench/README.md). `decode_layers` runs every layer of the step in C++:
the same multiplies (AMX tiles, else AVX512-BF16 panels or oneDNN), KV writes and decode attention,
with its own norm, rotary and SiLU loops. Steps with prefill tokens keep the forward pass, compiled
or eager (its attention in bfloat16 the C++ prefill kernel, `layers.attention`).

Used on CPUs with AVX512-BF16 with one rank (the kernel has no all-reduce) and the torch attention
backend's C++ kernels, whether or not the forward pass is compiled (--enforce-eager turns off
torch.compile, not the C++ kernels), for bfloat16 models whose linear layers are all packed
(`LinearBase.packed_weight`) and carry no bias but an optional qkv bias, with or without Qwen3's query
and key head norms; Granite's embedding and residual multipliers passed to it (its attention scale is
the kernel's `scale`, its logits scale applies after it), rotary over each head or an even part of it
(Phi-3's partial rotary) and in the layers that turn (not SmolLM3's NoPE layers); each layer's sliding
window its own.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
from pagedserve_kernels import cpu as cpu_kernels

from pagedserve.distributed import get_tp_size
from pagedserve.layers.attention import AttentionMetadata, TorchAttentionBackend
from pagedserve.layers.linear import LinearBase
from pagedserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

logger = logging.getLogger(__name__)


class FusedDecode:
    def __init__(self, model: LlamaForCausalLM) -> None:
        layers = model.decoder_layers
        attention = layers[0].self_attn
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.scale = attention.attn.scale
        self.eps = model.norm.eps
        self.embedding = model.embed_tokens.weight
        self.cos_sin_cache = model.rotary_emb.cos_sin_cache
        self.norms: list[torch.Tensor] = [
            w
            for layer in layers
            for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        ]
        self.qkv = [_packed(layer.self_attn.qkv_proj) for layer in layers]
        biases = [layer.self_attn.qkv_proj.bias for layer in layers]
        self.qkv_bias: list[torch.Tensor] = [b for b in biases if b is not None]
        self.qk_norms: list[torch.Tensor] = [
            norm.weight
            for layer in layers
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm)
            if norm is not None
        ]
        self.o_proj = [_packed(layer.self_attn.o_proj) for layer in layers]
        mlps = [cast(LlamaMLP, layer.mlp) for layer in layers]  # dense: `_unsupported` refuses experts
        self.gate_up = [_packed(mlp.gate_up_proj) for mlp in mlps]
        self.down = [_packed(mlp.down_proj) for mlp in mlps]
        self.final_norm = model.norm.weight
        self.attention_layers = model.attention_layers
        self.windows = [attn.window for attn in self.attention_layers]  # sliding windows (0: none)
        self.embedding_scale, self.residual_scale = model.scales.embedding, model.scales.residual
        self.rotary_layers = [layer.self_attn.rotary for layer in layers]  # False: SmolLM3's NoPE layers

    @classmethod
    def build(cls, model: torch.nn.Module, backend: object, dtype: torch.dtype) -> FusedDecode | None:
        """A FusedDecode for `model`, or None where `decode_layers` cannot run it (then say why)."""
        reason = _unsupported(model, backend, dtype)
        if reason:
            logger.info("decode steps run the forward pass: %s", reason)
            return None
        assert isinstance(model, LlamaForCausalLM)
        logger.info("decode steps run every decoder layer in one C++ call (decode_layers)")
        return cls(model)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The final-normed hidden states [tokens, hidden] of a step whose tokens are all decodes."""
        caches = [layer.kv_cache for layer in self.attention_layers]
        assert all(c is not None for c in caches), "KV cache not bound"
        return cpu_kernels.decode_layers(
            input_ids,
            positions,
            self.embedding,
            self.cos_sin_cache,
            self.norms,
            self.qkv,
            self.qkv_bias,
            self.qk_norms,
            self.o_proj,
            self.gate_up,
            self.down,
            self.final_norm,
            [c[0] for c in caches],  # type: ignore[index]
            [c[1] for c in caches],  # type: ignore[index]
            metadata.slot_mapping,
            metadata.decode_block_tables,
            metadata.decode_context_lens,
            self.num_heads,
            self.num_kv_heads,
            self.eps,
            self.scale,
            self.windows,
            self.embedding_scale,
            self.residual_scale,
            self.rotary_layers,
        )


def _packed(linear: LinearBase) -> torch.Tensor:
    """`linear`'s packed weight, which `_unsupported` has checked is there."""
    assert linear.packed_weight is not None, "linear layer not packed"
    return linear.packed_weight


def _unsupported(model: torch.nn.Module, backend: object, dtype: torch.dtype) -> str:
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-family model"
    if dtype != torch.bfloat16:
        return f"dtype {dtype} (bfloat16 only)"
    if get_tp_size() > 1:
        return "tensor parallel (one rank only: the kernel has no all-reduce)"
    if not (isinstance(backend, TorchAttentionBackend) and backend.cpu_kernels):
        return "no C++ decode attention"
    if not cpu_kernels.decode_layers_supported():
        return "the C++ kernels have no decode_layers for this CPU (it needs AVX512-BF16)"
    layers = model.decoder_layers
    if not layers:
        return "no decoder layers"
    if any(
        type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not LlamaAttention
        for layer in layers
    ):
        return f"{type(layers[0]).__name__}'s layers (Gemma's, OLMo's, LFM2's...: not Llama's layer)"
    rotary_dim, head_dim = model.rotary_emb.rotary_dim, layers[0].self_attn.head_dim
    if rotary_dim > head_dim or rotary_dim % 2:
        return f"rotary over {rotary_dim} of {head_dim} dimensions (an even part of a head only)"
    if model.embed_tokens.weight.dim() != 2 or model.embed_tokens.weight.dtype != dtype:
        return "the embedding is not a bfloat16 table"
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, LlamaMLP):
            return "MLPs made of experts (a mixture of experts)"
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if linear.packed_weight is None:
                return "a linear layer is not packed"
        if any(m.bias is not None for m in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return "biases beyond qkv"
        if attn.attn.sinks is not None:
            return "attention sinks"
    qkv_biases = [layer.self_attn.qkv_proj.bias is not None for layer in layers]
    if any(qkv_biases) and not all(qkv_biases):
        return "qkv bias on some layers only"
    qk_norms = [layer.self_attn.q_norm is not None for layer in layers]
    if any(qk_norms) and not all(qk_norms):
        return "query and key head norms on some layers only"
    return ""
