"""Rotary position embedding with the scaling variants Llama-family checkpoints use (default, linear,
llama3). The cos/sin table is computed once, in float32, exactly as Hugging Face computes it."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedserve.layers import ops


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters transformers 5 reads from a 4.x (`rope_theta` + `rope_scaling`) or 5.x
    (`rope_parameters`) config: `rope_scaling` wins where both are set, so a config both carry is
    refused when they differ (transformers would also drop the other's `rope_theta`)."""
    scaling, params = hf_config.get("rope_scaling"), hf_config.get("rope_parameters")
    chosen = _standardized(scaling or params or {}, hf_config)
    if scaling and params and _standardized(params, hf_config) != chosen:
        raise ValueError(
            f"model: config.json sets both rope_scaling {scaling} and rope_parameters {params}, which "
            "differ; keep the one the model was trained with"
        )
    return chosen


def _standardized(raw: dict[str, Any], hf_config: dict[str, Any]) -> dict[str, Any]:
    """Top-level `rope_theta` and `partial_rotary_factor` fill in what the dict lacks, as in
    transformers' `standardize_rope_params`; so does llama3's pretraining length (a top-level
    `original_max_position_embeddings` first, else the dict's, else `max_position_embeddings`)."""
    params = {k: v for k, v in raw.items() if k != "type"}
    params["rope_type"] = raw.get("rope_type") or raw.get("type") or "default"
    params.setdefault("rope_theta", hf_config.get("rope_theta") or 10000.0)
    if hf_config.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", hf_config["partial_rotary_factor"])
    if params["rope_type"] == "llama3":
        params["original_max_position_embeddings"] = (
            hf_config.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or hf_config.get("max_position_embeddings", 2048)
        )
    return params


def _inv_freq(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise ValueError(
        f"model: config.json's rope_type {kind!r} (rope_scaling / rope_parameters) is not supported "
        "(default, linear, llama3 are)"
    )


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
        self.rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        freqs = (
            torch.arange(max_position, dtype=torch.float32)[:, None]
            * _inv_freq(self.rotary_dim, params)[None, :]
        )
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rotary_cos_sin(positions, self.cos_sin_cache, dtype)
