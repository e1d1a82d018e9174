"""Rotary position embedding with the scaling variants Llama-family checkpoints use (default, linear,
llama3, yarn, Phi-3's longrope, Gemma 4's proportional). The cos/sin table is computed once, in float32, exactly as Hugging
Face computes it (YaRN's and LongRoPE's attention factors included: they scale cos and sin alike)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedserve.config import rope_parameters
from pagedserve.layers import ops


def _inv_freq(rotary_dim: int, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies, and the factor cos and sin are scaled by (1 but for yarn and longrope),
    for a table of `max_position` positions."""
    base = params["rope_theta"]
    kind = params["rope_type"]
    if kind == "dynamic" and params.get("alpha"):
        # Hunyuan's "dynamic" with a fixed alpha: the base stretched once, by alpha^(d / (d - 2)), the
        # same at every length (transformers' HunYuan rotary reads it so, as "ntk_alpha")
        base, kind = base * params["alpha"] ** (rotary_dim / (rotary_dim - 2)), "default"
    if kind == "proportional":  # Gemma 4's full layers: the whole head's pairs, the first ones turning
        angles = int(params.get("partial_rotary_factor", 1.0) * rotary_dim // 2)
        turning = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / rotary_dim))
        still = torch.zeros(rotary_dim // 2 - angles)
        return torch.cat((turning, still)) / params.get("factor", 1.0), 1.0
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / params["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(rotary_dim, params)
    if kind == "longrope":
        return _longrope_inv_freq(rotary_dim, params, max_position)
    raise ValueError(
        f"model: config.json's rope_type {kind!r} (rope_scaling / rope_parameters) is not supported "
        "(default, linear, llama3, yarn, longrope, proportional, and dynamic with a fixed alpha are)"
    )


def _longrope_inv_freq(dim: int, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3's 128K and Phi-3.5's, Phi-4-mini's): each frequency divided by its own factor,
    `short_factor`'s within the pretraining length, `long_factor`'s past it; cos and sin scaled by the
    attention factor (Phi-3.5-MoE's `short_mscale` or `long_mscale` likewise, else `attention_factor`,
    else sqrt(1 + ln(factor) / ln(pretraining length))).

    transformers picks the factors for a whole sequence by its length, and recomputes the sequence's
    cache when it grows past the pretraining length. A paged cache keeps every block it wrote, so the
    choice is made once for all sequences, as vLLM makes it: long factors when the context served
    (`max_position`, the max_model_len) reaches past the pretraining length, short ones otherwise. A
    max_model_len within it gives transformers' tokens for every request; a longer one gives them for
    requests past it."""
    old_len = params["original_max_position_embeddings"]
    name = "long_factor" if max_position > old_len else "short_factor"
    factors = params.get(name)
    if not (isinstance(factors, list) and len(factors) == dim // 2):
        raise ValueError(
            f"model: config.json's longrope {name} must list {dim // 2} numbers (one a rotated pair of "
            f"dimensions), got {str(factors)[:100]}"
        )
    factor = params["factor"]
    # (Phi-3.5-MoE's: an attention factor of each kind, `short_mscale` and `long_mscale`)
    attention_factor = params.get("long_mscale" if name == "long_factor" else "short_mscale")
    if attention_factor is None:
        attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * params["rope_theta"] ** shape)
    return inv_freq, float(attention_factor)


def _yarn_inv_freq(dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023) as transformers computes it: the low frequencies interpolated by
    `factor`, the high ones kept, a linear ramp between the dimensions that turn `beta_slow` and
    `beta_fast` times over the pretraining length; cos and sin scaled by the attention factor
    (0.1 ln(factor) + 1 unless given, or DeepSeek's ratio of two such when mscale and mscale_all_dim
    are set)."""
    base, factor = params["rope_theta"], params["factor"]
    old_len = params["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1 - ramp  # the share of each frequency kept as trained
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq, float(attention_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """One per model: `forward` turns a step's positions into the cos/sin tables every layer applies."""

    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim] cos | sin, a buffer (register_buffer)

    def __init__(self, head_dim: int, max_position: int, hf_config: dict[str, Any]) -> None:
        super().__init__()
        params = rope_parameters(hf_config)
        # (a proportional rope turns pairs across the whole head, some by a frequency of 0)
        partial = 1.0 if params["rope_type"] == "proportional" else params.get("partial_rotary_factor", 1.0)
        self.rotary_dim = int(head_dim * partial)
        inv_freq, scale = _inv_freq(self.rotary_dim, params, max_position)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        table = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rotary_cos_sin(positions, self.cos_sin_cache, dtype)
