"""TII's Falcon-H1 (0.5B to 34B, Falcon-H1R): a parallel hybrid, every layer's normed input going both
through Llama's attention and through Mamba2 (`layers.mamba2`), their outputs summed into the residual
stream, then a SwiGLU MLP; μP's multipliers throughout, as FalconH1Config names them:

- `embedding_multiplier` on the embeddings and `lm_head_multiplier` on the logits (`Scales`);
- `attention_in_multiplier` on the attention's input, `key_multiplier` on its keys,
  `attention_out_multiplier` on its output; `ssm_in_multiplier` on Mamba2's input, `ssm_multipliers`
  on its in_proj's z, x, B, C and dt rows (transformers' `mup_vector`), `ssm_out_multiplier` on its
  output; `mlp_multipliers` on the MLP's gate and on its output.

Each multiplier but the embeddings' and the logits' is folded into the weights it follows or precedes
on load (their float32 products rounded once to the model's dtype): a linear layer of a scaled input
is the layer with its weight scaled, a scaled output the layer with its weight and bias scaled.
Mamba2's gated norm is optional (`mamba_rms_norm`: else y x SiLU(z) alone) and may norm before the
gate (`mamba_norm_before_gate`, FalconH1Config's default); its inner width may be set apart from
the hidden size (`mamba_d_ssm`); in_proj biased by `mamba_proj_bias`, out_proj by `projectors_bias`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedserve.layers.attention import AttentionBackend, AttentionMetadata
from pagedserve.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from pagedserve.models.hybrid import granite_mamba_dims
from pagedserve.models.llama import LayerOptions, LlamaDecoderLayer, LlamaForCausalLM, Rotary, Scales


def falcon_h1_mamba_dims(cfg: dict[str, Any]) -> Mamba2Dims:
    """Falcon-H1's Mamba2 sizes: Granite 4.0's keys (`mamba_*`) with FalconH1Config's defaults (an inner
    width `mamba_d_ssm` of 1,024, norms at eps 1e-5), out_proj biased by `projectors_bias`, the gated
    norm as `mamba_rms_norm` and `mamba_norm_before_gate` ask."""
    if not cfg.get("mamba_rms_norm", False):
        norm = "gate_only"
    else:
        norm = "norm_then_gate" if cfg.get("mamba_norm_before_gate", True) else "gate_then_norm"
    dims = granite_mamba_dims({"mamba_d_ssm": 1024, **cfg}, norm_eps=1e-5)
    return dataclasses.replace(dims, out_bias=bool(cfg.get("projectors_bias", False)), norm=norm)


class FalconH1DecoderLayer(LlamaDecoderLayer):
    """Llama's layer whose token mixer is its attention and Mamba2 side by side, their outputs summed."""

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__(cfg, backend, options, layer_index)
        self.mamba = Mamba2Mixer(falcon_h1_mamba_dims(cfg))

    def mix(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        assert metadata.recurrent is not None, "a step of a model with a state per request"
        return super().mix(rotary, hidden, metadata) + self.mamba(hidden, metadata.recurrent)


class FalconH1ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = FalconH1DecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        super().__init__({"rms_norm_eps": 1e-5, **cfg}, max_position, backend)
        self.multipliers = _folded_multipliers(cfg)

    @staticmethod
    def read_scales(cfg: dict[str, Any]) -> Scales:
        return Scales(
            embedding=float(cfg.get("embedding_multiplier", 1.0)),
            logits=1.0 / float(cfg.get("lm_head_multiplier", 1.0)),
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._as_ours(weights))

    def _as_ours(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Falcon-H1's names as Llama's (`feed_forward` the MLP, `pre_ff_layernorm` its norm,
        `final_layernorm` the model's; the convolution's as `Mamba2Mixer` holds it), each tensor times
        the multipliers folded into it."""
        for name, tensor in weights:
            for theirs, ours in _NAMES.items():
                name = name.replace(theirs, ours)
            suffix = name.split(".layers.", 1)[-1].split(".", 1)[-1]  # (past the layer's number)
            factor = self.multipliers.get(suffix)
            if factor is not None:
                scale = factor if isinstance(factor, float) else factor.reshape(-1, *[1] * (tensor.dim() - 1))
                tensor = tensor.float() * scale
            yield name, tensor


_NAMES = {
    ".feed_forward.": ".mlp.",
    ".pre_ff_layernorm.": ".post_attention_layernorm.",
    "model.final_layernorm.": "model.norm.",
    ".mamba.conv1d.weight": ".mamba.conv_weight",
    ".mamba.conv1d.bias": ".mamba.conv_bias",
}


def _folded_multipliers(cfg: dict[str, Any]) -> dict[str, float | torch.Tensor]:
    """Each weight's multiplier (a row's, for in_proj's), by its name past the layer: the attention's
    input multiplier on q, k and v's weights, the key multiplier on k's weight and bias, ...; those
    of 1 left out (their tensors load as they are, with no float32 copy)."""
    attn_in, key = float(cfg.get("attention_in_multiplier", 1.0)), float(cfg.get("key_multiplier", 1.0))
    attn_out = float(cfg.get("attention_out_multiplier", 1.0))
    ssm_in, ssm_out = float(cfg.get("ssm_in_multiplier", 1.0)), float(cfg.get("ssm_out_multiplier", 1.0))
    gate, down = (float(m) for m in (cfg.get("mlp_multipliers") or (1.0, 1.0)))
    rows = _mup_vector(cfg)
    factors: dict[str, float | torch.Tensor] = {
        "self_attn.q_proj.weight": attn_in,
        "self_attn.k_proj.weight": attn_in * key,
        "self_attn.k_proj.bias": key,
        "self_attn.v_proj.weight": attn_in,
        "self_attn.o_proj.weight": attn_out,
        "self_attn.o_proj.bias": attn_out,
        "mamba.in_proj.weight": rows * ssm_in,
        "mamba.in_proj.bias": rows,
        "mamba.out_proj.weight": ssm_out,
        "mamba.out_proj.bias": ssm_out,
        "mlp.gate_proj.weight": gate,
        "mlp.gate_proj.bias": gate,
        "mlp.down_proj.weight": down,
        "mlp.down_proj.bias": down,
    }
    return {name: m for name, m in factors.items() if bool((torch.as_tensor(m) != 1.0).any())}


def _mup_vector(cfg: dict[str, Any]) -> torch.Tensor:
    """`ssm_multipliers` over in_proj's rows, the checkpoint's [z | x | B | C | dt] (float32)."""
    dims = falcon_h1_mamba_dims(cfg)
    multipliers = cfg.get("ssm_multipliers") or [1.0] * 5
    if len(multipliers) != 5:
        raise ValueError(
            f"model: config.json's ssm_multipliers must be 5 numbers (z, x, B, C, dt), got {multipliers!r}"
        )
    inner, groups = dims.intermediate_size, dims.num_groups * dims.state_size
    sizes = (inner, inner, groups, groups, dims.num_heads)
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, multipliers, strict=True)])
