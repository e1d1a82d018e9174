"""Llama-family decoders whose MLP is ungated: one projection up, an activation, one down (no gate
beside the up projection), as transformers' NemotronMLP and Starcoder2MLP compute it.

- Arcee's AFM (`ArceeForCausalLM`): Llama's layer, ReLU² (relu(x)²).
- NVIDIA's Nemotron (`NemotronForCausalLM`: Nemotron-4, Minitron): ReLU², LayerNorms whose weight is
  stored less 1 (LayerNorm1P), the rope over the first half of each head by default.
- BigCode's StarCoder2: GELU (tanh approximation), LayerNorms, every projection biased by `use_bias`,
  a window in every layer where config.json sets `sliding_window`, the LM head tied by default.
- Inception's Jais 2: LayerNorms, ReLU², every projection biased.
- Swiss AI's Apertus: xIELU (`XIELU`, an activation with learned parameters of its own a layer),
  each query and key head RMS-normed before the rotation (Qwen3's), its norms stored under names of
  their own.

Each reads transformers' config class defaults where config.json leaves a key out."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.attention import AttentionBackend
from pagedserve.layers.embedding import ParallelLMHead
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.layers.norm import LayerNorm, RMSNorm, WeightlessRMSNorm, weightless_rms_norm
from pagedserve.models.cohere import ParallelDecoderLayer
from pagedserve.models.llama import (
    Biases,
    LayerOptions,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    Rotary,
    rms_norm_eps,
)


class ReLU2(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(x))


class GELUTanh(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


class GELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


class XIELU(nn.Module):
    """xIELU (Huang and Schlag, 2024), as transformers' XIELUActivation computes it: for x > 0,
    softplus(alpha_p) x² + beta x; else (expm1(min(x, eps)) - x)(beta + softplus(alpha_n)) + beta x.
    alpha_p and alpha_n are a layer's learned parameters, beta and eps its constants, all from the
    checkpoint (`mlp.act_fn.*`)."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.empty(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.empty(1), requires_grad=False)
        self.beta = nn.Parameter(torch.empty(()), requires_grad=False)
        self.eps = nn.Parameter(torch.empty(()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        negative = (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n
        return torch.where(x > 0, alpha_p * x * x, negative) + self.beta * x


ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "relu2": ReLU2,
    "gelu_pytorch_tanh": GELUTanh,
    "gelu_new": GELUTanh,  # (the same tanh approximation, written out in transformers' NewGELUActivation)
    "gelu": GELU,
    "xielu": XIELU,
}


class UngatedMLP(nn.Module):
    """up_proj (column-parallel), the activation, down_proj (row-parallel), both biased where
    `mlp_bias`; the activation by `hidden_act` (`ACTIVATIONS`)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        activation = cfg["hidden_act"]
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"model: config.json's hidden_act {activation!r} is not supported for an ungated MLP "
                f"({', '.join(ACTIVATIONS)} are)"
            )
        hidden, inter, bias = cfg["hidden_size"], cfg["intermediate_size"], bool(cfg.get("mlp_bias", False))
        self.up_proj = ColumnParallelLinear(hidden, inter, bias=bias)
        self.act_fn = ACTIVATIONS[activation]()
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class UngatedDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with an ungated MLP."""

    def dense_mlp(self, cfg: dict[str, Any]) -> nn.Module:
        return UngatedMLP(cfg)


class LayerNormDecoderLayer(UngatedDecoderLayer):
    """StarCoder2's, Jais 2's and GPT-NeoX's sequential layer: LayerNorms with a bias (eps
    `rms_norm_eps`, which each model sets from its own key), an ungated MLP."""

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return LayerNorm(cfg["hidden_size"], rms_norm_eps(cfg))


class LayerNorm1PDecoderLayer(UngatedDecoderLayer):
    """Nemotron's layer: LayerNorms of weight 1 + the stored one, an ungated MLP."""

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return LayerNorm(cfg["hidden_size"], rms_norm_eps(cfg), weight_offset=1.0)


class UngatedForCausalLM(LlamaForCausalLM):
    """A Llama-family model whose MLPs are ungated: q, k and v load into one projection, up_proj and
    down_proj as they are."""

    decoder_layer_class: type[LlamaDecoderLayer] = UngatedDecoderLayer
    stacked_params = {
        name: merged for name, merged in LlamaForCausalLM.stacked_params.items() if merged[0] == "qkv_proj"
    }


class ArceeForCausalLM(UngatedForCausalLM):
    """Arcee's AFM-4.5B: Llama's layer, an ungated ReLU² MLP (ArceeConfig's `hidden_act` relu2)."""

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        super().__init__({**cfg, "hidden_act": cfg.get("hidden_act", "relu2")}, max_position, backend)


class NemotronForCausalLM(UngatedForCausalLM):
    """NVIDIA's Nemotron (Nemotron-4, Minitron, Nemotron-Mini): LayerNorm1P before attention, before the
    MLP and at the end (eps `norm_eps`), an ungated ReLU² MLP (biased by `mlp_bias`), q, k, v and o
    biased by `attention_bias`, the rope over the first `partial_rotary_factor` of each head (0.5
    where config.json names none)."""

    decoder_layer_class = LayerNorm1PDecoderLayer
    rotates_part_of_a_head = True
    default_partial_rotary = 0.5  # NemotronConfig's

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        eps = float(cfg.get("norm_eps", 1e-5))
        cfg = {**cfg, "rms_norm_eps": eps, "hidden_act": cfg.get("hidden_act", "relu2")}
        super().__init__(cfg, max_position, backend)


class Starcoder2ForCausalLM(UngatedForCausalLM):
    """BigCode's StarCoder2 (3B, 7B, 15B): LayerNorms (eps `norm_epsilon`), q, k, v, o and the ungated
    GELU MLP (`c_fc`, `c_proj`) biased by `use_bias` (on by default), a window in every layer where
    config.json sets `sliding_window`, the LM head tied by default (Starcoder2Config's)."""

    decoder_layer_class = LayerNormDecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        eps, bias = float(cfg.get("norm_epsilon", 1e-5)), bool(cfg.get("use_bias", True))
        cfg = {
            **cfg,
            "rms_norm_eps": eps,
            "mlp_bias": bias,
            "hidden_act": cfg.get("hidden_act", "gelu_pytorch_tanh"),
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
        }
        super().__init__(cfg, max_position, backend)

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        bias = bool(cfg.get("use_bias", True))
        return bias, bias

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(
            (name.replace(".mlp.c_fc.", ".mlp.up_proj.").replace(".mlp.c_proj.", ".mlp.down_proj."), tensor)
            for name, tensor in weights
        )


class Jais2ForCausalLM(UngatedForCausalLM):
    """Inception's Jais 2: Llama's layer with LayerNorms (with a bias, eps `layer_norm_eps`), every
    projection biased (`attention_bias`, `mlp_bias`: on by default), an ungated ReLU² MLP (Jais2Config's
    defaults)."""

    decoder_layer_class = LayerNormDecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        eps = float(cfg.get("layer_norm_eps", 1e-5))
        cfg = {
            **cfg,
            "rms_norm_eps": eps,
            "mlp_bias": cfg.get("mlp_bias", True),
            "hidden_act": cfg.get("hidden_act", "relu2"),
        }
        super().__init__(cfg, max_position, backend)

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        bias = bool(cfg.get("attention_bias", True))
        return bias, bias


class ApertusForCausalLM(UngatedForCausalLM):
    """Swiss AI's Apertus (8B, 70B): Llama's layer with each query and key head RMS-normed before the
    rotation (Qwen3's `q_norm`, `k_norm`), its norms stored as `attention_layernorm` and
    `feedforward_layernorm`, and an ungated xIELU MLP without biases (ApertusMLP's)."""

    qk_norm = True

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        cfg = {**cfg, "mlp_bias": False, "hidden_act": cfg.get("hidden_act", "xielu")}
        super().__init__(cfg, max_position, backend)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(
            (
                name.replace(".attention_layernorm.", ".input_layernorm.").replace(
                    ".feedforward_layernorm.", ".post_attention_layernorm."
                ),
                tensor,
            )
            for name, tensor in weights
        )


class PhiDecoderLayer(ParallelDecoderLayer):
    """Phi-2's layer: attention and the ungated MLP side by side on one LayerNorm (with a bias)."""

    def dense_mlp(self, cfg: dict[str, Any]) -> nn.Module:
        return UngatedMLP(cfg)

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return LayerNorm(cfg["hidden_size"], rms_norm_eps(cfg))


class PhiForCausalLM(UngatedForCausalLM):
    """Microsoft's Phi-1, Phi-1.5 and Phi-2: attention and an ungated GELU MLP (`fc1`, `fc2`, biased)
    side by side on one LayerNorm, q, k, v and o (`dense`) biased, the rope over the first
    `partial_rotary_factor` of each head (0.5 by default), a final LayerNorm (`final_layernorm`) and an
    LM head with a bias. PhiConfig's defaults where config.json leaves a key out; LayerNorms of q and
    k (`qk_layernorm`) are refused by name."""

    decoder_layer_class = PhiDecoderLayer
    rotates_part_of_a_head = True
    default_partial_rotary = 0.5  # PhiConfig's

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        if cfg.get("qk_layernorm"):
            raise ValueError("model: config.json's qk_layernorm (LayerNorms of q and k) is not supported")
        eps = float(cfg.get("layer_norm_eps", 1e-5))
        cfg = {**cfg, "rms_norm_eps": eps, "mlp_bias": True, "hidden_act": cfg.get("hidden_act", "gelu_new")}
        super().__init__(cfg, max_position, backend)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"], bias=True)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        return True, True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(
            (
                name.replace(".self_attn.dense.", ".self_attn.o_proj.")
                .replace(".mlp.fc1.", ".mlp.up_proj.")
                .replace(".mlp.fc2.", ".mlp.down_proj.")
                .replace("model.final_layernorm.", "model.norm."),
                tensor,
            )
            for name, tensor in weights
        )


class GPTJForCausalLM(PhiForCausalLM):
    """EleutherAI's GPT-J (GPT-J-6B and its fine-tunes): Phi-2's layer (attention and an ungated GELU MLP
    side by side on one LayerNorm, the MLP's `fc_in` and `fc_out` biased, an LM head with a bias), no
    attention biases, GPT-J's rotary (neighbouring dimensions turned together: `interleaved_rotary`)
    over the first `rotary_dim` (64) of each head; its sizes read under GPT-2's names
    (`config.gpt2_config`), GPTJConfig's defaults where config.json leaves a key out (an untied LM
    head)."""

    interleaved_rotary = True

    @classmethod
    def rope_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        rotary_dim = cfg.get("rotary_dim", 64)
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        return {**cfg, "partial_rotary_factor": rotary_dim / head_dim if rotary_dim else 1.0}

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        return False, False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        LlamaForCausalLM.load_weights(self, _gptj_names(weights))


_GPTJ_NAMES = (
    (re.compile(r"^transformer\.wte\."), "model.embed_tokens."),
    (re.compile(r"^transformer\.ln_f\."), "model.norm."),
    (re.compile(r"^transformer\.h\.(\d+)\.ln_1\."), r"model.layers.\1.input_layernorm."),
    (re.compile(r"^transformer\.h\.(\d+)\.attn\.out_proj\."), r"model.layers.\1.self_attn.o_proj."),
    (re.compile(r"^transformer\.h\.(\d+)\.attn\."), r"model.layers.\1.self_attn."),
    (re.compile(r"^transformer\.h\.(\d+)\.mlp\.fc_in\."), r"model.layers.\1.mlp.up_proj."),
    (re.compile(r"^transformer\.h\.(\d+)\.mlp\.fc_out\."), r"model.layers.\1.mlp.down_proj."),
)


def _gptj_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """GPT-J's names as Llama's; the older checkpoints' causal masks (`attn.bias`, `attn.masked_bias`)
    left out."""
    for name, tensor in weights:
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        for pattern, replacement in _GPTJ_NAMES:
            name = pattern.sub(replacement, name)
        yield name, tensor


class NanoChatAttention(LlamaAttention):
    """Llama's attention with NanoChat's head norms (no weight) after the rotation."""

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__(cfg, backend, options, layer_index)
        self.eps = rms_norm_eps(cfg)

    def rotated_qkv(
        self, rotary: Rotary, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().rotated_qkv(rotary, hidden)
        return weightless_rms_norm(q, self.eps), weightless_rms_norm(k, self.eps), v


class NanoChatDecoderLayer(UngatedDecoderLayer):
    """Llama's layer with weightless RMSNorms, NanoChat's attention and an ungated ReLU² MLP."""

    attention_class = NanoChatAttention

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return WeightlessRMSNorm(cfg["hidden_size"], rms_norm_eps(cfg))


class NanoChatForCausalLM(UngatedForCausalLM):
    """Andrej Karpathy's nanochat (`NanoChatForCausalLM`): Llama's layer with RMSNorms of no weight (the
    embeddings normed too, by the final norm, before the first layer), each query and key head normed
    (no weight) after the rotation, which turns the other way (sin negated: its rotate_half is
    [x2, -x1]), an ungated ReLU² MLP (`fc1`, `fc2`), the logits soft-capped at
    `final_logit_softcapping` (15); NanoChatConfig's defaults where config.json leaves a key out."""

    decoder_layer_class = NanoChatDecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        cfg = {**cfg, "hidden_act": cfg.get("hidden_act", "relu2")}
        super().__init__(cfg, max_position, backend)
        self.softcap = float(cfg.get("final_logit_softcapping", 15.0) or 0.0)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return cast(WeightlessRMSNorm, self.norm).normed(self.embed_tokens(input_ids))

    def step_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        cos, sin = self.rotary_emb(positions, dtype)
        return cos, -sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(Soft-capping is monotonic: the greedy argmax of the LM head stands.)"""
        logits = self.lm_head.compute_logits(hidden)
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(
            (name.replace(".mlp.fc1.", ".mlp.up_proj.").replace(".mlp.fc2.", ".mlp.down_proj."), tensor)
            for name, tensor in weights
        )
