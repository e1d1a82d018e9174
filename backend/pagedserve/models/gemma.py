"""Google's Gemma family as transformers computes it, on the Llama family's tensor-parallel layers:
Gemma (`GemmaForCausalLM`: Gemma 1, CodeGemma), Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3
(`Gemma3ForCausalLM`: Gemma 3 1B; and the text decoder of the multimodal 4B, 12B and 27B,
`Gemma3ForConditionalGeneration`, see `config.text_decoder_config`). What each adds to Llama's layer:

- every one: the embeddings times sqrt(hidden_size), rounded to the model's dtype; RMSNorm by
  (1 + weight), computed in float32 (`GemmaRMSNorm`); GELU (tanh approximation) in place of SiLU;
- Gemma 2 and 3: norms after attention and after the MLP too (four a layer, `sandwich_norms`);
  q.k scaled by query_pre_attn_scalar^-1/2; local layers sliding a window beside global ones
  (`layer_types`: by default every other layer in Gemma 2, five of six in Gemma 3); logits
  soft-capped where the config says (`final_logit_softcapping`: c * tanh(logits / c));
- Gemma 2: attention scores soft-capped too (`attn_logit_softcapping`, in every attention kernel);
- Gemma 3: each query and key head normed; the local layers turn by their own rope
  (`rope_local_base_freq`), the global ones by the model's (with its scaling).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.config import default_layer_types, layer_windows
from pagedserve.layers import ops
from pagedserve.layers.attention import Attention, AttentionBackend, AttentionMetadata
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedserve.layers.norm import Float32RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.models.llama import LayerStep, LlamaForCausalLM, head_dim_of, residual_stream, rms_norm_eps

# a step's cos and sin tables: the global layers', then the local layers' (the same for Gemma 1 and 2)
GemmaRotary = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class GemmaRMSNorm(Float32RMSNorm):
    """x / rms(x) * (1 + weight), all in float32, rounded to x's dtype once (transformers' GemmaRMSNorm)."""

    weight_offset = 1.0

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        self.weight.data.zero_()


def gemma3_rope_config(hf: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """A Gemma 3 layer type's rope (as a config `RotaryEmbedding` reads), as transformers'
    Gemma3TextConfig reads it: `rope_parameters` keyed by layer type (transformers 5's layout), else
    the global layers' `rope_theta` (1e6) and `rope_scaling`, the local layers' `rope_local_base_freq`
    (1e4) without scaling (4.x's)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        chosen = dict(params[layer_type] or {"rope_type": "default"})
    elif layer_type == "full_attention":
        chosen = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e6)}
    else:
        chosen = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 1e4)}
    chosen.setdefault("rope_theta", 1e6 if layer_type == "full_attention" else 1e4)
    return {"rope_parameters": chosen, "max_position_embeddings": hf.get("max_position_embeddings")}


class GemmaAttention(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        backend: AttentionBackend,
        layer_index: int,
        *,
        qk_norm: bool,
        local: bool,
        window: int,
        scale: float,
        softcap: float,
    ) -> None:
        super().__init__()
        hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        head_dim = head_dim_of(cfg)
        bias = bool(cfg.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.head_dim = head_dim
        self.q_norm = GemmaRMSNorm(head_dim, rms_norm_eps(cfg)) if qk_norm else None
        self.k_norm = GemmaRMSNorm(head_dim, rms_norm_eps(cfg)) if qk_norm else None
        self.local = local  # turns by the local rope
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            head_dim,
            backend,
            layer_index,
            scale=scale,
            window=window,
            softcap=softcap,
        )

    def forward(self, rotary: GemmaRotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.normed(q), self.k_norm.normed(k)
        cos, sin = rotary[2:] if self.local else rotary[:2]
        # (tables in the hidden dtype, as transformers casts them: its apply_rotary_pos_emb exactly)
        q, k = ops.apply_rotary(q, cos, sin), ops.apply_rotary(k, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :]
        return self.o_proj(self.attn(q, k, v, metadata))


class GemmaMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any], legacy_gelu: bool) -> None:
        """`legacy_gelu`: "gelu" names the tanh approximation too (GemmaConfig's reading of Gemma 1's
        configs)."""
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if not (activation == "gelu_pytorch_tanh" or (legacy_gelu and activation == "gelu")):
            raise ValueError(
                f"model: config.json's hidden_activation {activation!r} is not supported (gelu_pytorch_tanh is)"
            )
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=False)
        self.down_proj = RowParallelLinear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    """Llama's layer protocol: it takes the residual stream as `hidden + residual` (the previous
    layer's output and its residual, added here as transformers adds them at that layer's end) and
    returns its own pair. Gemma 1's `post_attention_layernorm` is the norm before the MLP (Llama's
    place); Gemma 2's and 3's norms the attention's output, `pre_feedforward_layernorm` comes before
    the MLP and `post_feedforward_layernorm` after it."""

    def __init__(
        self, cfg: dict[str, Any], mlp: GemmaMLP, attention: GemmaAttention, sandwich_norms: bool
    ) -> None:
        super().__init__()
        eps, size = rms_norm_eps(cfg), cfg["hidden_size"]
        self.self_attn, self.mlp = attention, mlp
        self.sandwich_norms = sandwich_norms
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        if sandwich_norms:
            self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        rotary: GemmaRotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = residual_stream(hidden, residual)
        attended = self.self_attn(rotary, self.input_layernorm.normed(stream), metadata)
        if not self.sandwich_norms:
            stream = stream + attended
            return self.mlp(self.post_attention_layernorm.normed(stream)), stream
        stream = stream + self.post_attention_layernorm.normed(attended)
        mlp_out = self.mlp(self.pre_feedforward_layernorm.normed(stream))
        return self.post_feedforward_layernorm.normed(mlp_out), stream


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1 (see the module docstring); Gemma 2 and 3 set the class attributes of what they add.
    The checkpoint names its tensors as Llama's do (q/k/v and gate/up merged on load), plus the norms
    around the MLP and the head norms where the version has them."""

    architecture = "GemmaForCausalLM"
    sandwich_norms = False  # Gemma 2, 3: norms after attention and after the MLP
    qk_norm = False  # Gemma 3: each query and key head normed
    local_rope = False  # Gemma 3: the local layers turn by their own rope
    legacy_gelu = True  # Gemma 1: its configs' "gelu" is the tanh approximation (GemmaConfig's reading)
    # the config.json keys transformers' model of the version reads, with its config class's defaults
    # for them: query_pre_attn_scalar (else q.k by head_dim^-1/2), attn_logit_softcapping and
    # final_logit_softcapping (None or absent: none)
    reads: dict[str, float | None] = {}

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        nn.Module.__init__(self)
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("model: config.json's use_bidirectional_attention is not supported for Gemma")
        head_dim, hidden = head_dim_of(cfg), cfg["hidden_size"]
        read = {key: cfg.get(key, default) for key, default in self.reads.items()}
        scalar = read.get("query_pre_attn_scalar") or head_dim
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], hidden)
        self.embedding_scale = math.sqrt(hidden)  # rounded to the dtype, as transformers rounds it
        num_layers = cfg["num_hidden_layers"]
        windows = layer_windows(cfg, self.architecture)
        local = [False] * num_layers
        if self.local_rope:
            layer_types = cfg.get("layer_types") or default_layer_types(cfg, self.architecture)
            local = [kind == "sliding_attention" for kind in layer_types]
            self.rotary_emb = RotaryEmbedding(
                head_dim, max_position, gemma3_rope_config(cfg, "full_attention")
            )
            self.local_rotary_emb = RotaryEmbedding(
                head_dim, max_position, gemma3_rope_config(cfg, "sliding_attention")
            )
        else:
            self.rotary_emb = RotaryEmbedding(head_dim, max_position, cfg)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(
                cfg,
                GemmaMLP(cfg, self.legacy_gelu),
                GemmaAttention(
                    cfg,
                    backend,
                    index,
                    qk_norm=self.qk_norm,
                    local=local[index],
                    window=windows[index],
                    scale=float(scalar) ** -0.5,
                    softcap=float(read.get("attn_logit_softcapping") or 0.0),
                ),
                self.sandwich_norms,
            )
            for index in range(num_layers)
        )
        self.norm = GemmaRMSNorm(hidden, rms_norm_eps(cfg))
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(cfg["vocab_size"], hidden)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.softcap = float(read.get("final_logit_softcapping") or 0.0)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        layer_step: LayerStep | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        local = self.local_rotary_emb(positions, hidden.dtype) if self.local_rope else (cos, sin)
        hidden, residual = self.run_layers((cos, sin, *local), hidden, metadata, layer_step)
        return cast(GemmaRMSNorm, self.norm).normed(residual + hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(Soft-capping is monotonic: `greedy_token_ids`' argmax of the LM head stands.)"""
        logits = self.lm_head.compute_logits(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class Gemma2ForCausalLM(GemmaForCausalLM):
    architecture = "Gemma2ForCausalLM"
    sandwich_norms = True
    legacy_gelu = False
    reads = {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


class Gemma3ForCausalLM(GemmaForCausalLM):
    architecture = "Gemma3ForCausalLM"
    sandwich_norms = True
    legacy_gelu = False
    qk_norm = True
    local_rope = True
    # (transformers' Gemma 3 reads no attn_logit_softcapping: its attention passes none on)
    reads = {"query_pre_attn_scalar": 256, "final_logit_softcapping": None}


class VaultGemmaForCausalLM(Gemma2ForCausalLM):
    """Google's VaultGemma (1B, trained with differential privacy): Gemma 2's layer without its norms
    after attention and the MLP, the norm before the MLP named `pre_feedforward_layernorm`."""

    architecture = "VaultGemmaForCausalLM"
    sandwich_norms = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(
            (name.replace(".pre_feedforward_layernorm.", ".post_attention_layernorm."), tensor)
            for name, tensor in weights
        )
