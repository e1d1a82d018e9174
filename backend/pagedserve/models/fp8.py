"""FP8 checkpoints, dequantized on load: each float8 weight times its scale, in float32, then held
in the model's dtype as every other weight (transformers' own path on a CPU; the activations and
the KV cache stay in the model's dtype). Three layouts of the same product, told apart by config.json's
`quantization_config.quant_method`:

- "fp8" (transformers' FineGrainedFP8: DeepSeek-V3/R1, Kimi K2, Qwen3-*-FP8, GLM-4.5-FP8...): a
  `weight_scale_inv` a block of `weight_block_size` (128 x 128), the last blocks of a row or a column
  partial, as vLLM reads them; float32, bfloat16, or a power of two a byte (ue8m0, 2^(byte - 127));
  without `weight_block_size` one scale a tensor (`weight_scale_inv`, or vLLM's `weight_scale`).
- "fbgemm_fp8" (Meta's Llama 3.1 405B FP8): a `weight_scale` an output row.
- "compressed-tensors" of float weights (Red Hat's and Neural Magic's FP8, FP8-dynamic, FP8-block):
  a `weight_scale` a tensor, a row or a block (`block_structure`), by each config group's strategy;
  a weight padded to whole blocks carries its own shape (`weight_shape_original`), cut back to it.

Activation and KV-cache scales (`input_scale`, `activation_scale`, `input_scale_ub`, `k_scale`,
`v_scale`, vLLM's older `kv_scale`) are read by nothing here and dropped. A scale may lie in
another shard than its weight.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from pagedserve.config import Fp8Layout

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
WEIGHT_SCALES = ("_scale_inv", "_scale")  # after a weight's name: DeepSeek's / the others'
ORIGINAL_SHAPE = "_shape_original"  # after a padded weight's name (compressed-tensors' blocks)
DROPPED = ("input_scale", "activation_scale", "input_scale_ub", ".k_scale", ".v_scale", ".kv_scale")


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """`weight` [..., rows, cols] (float8) times `scale` in float32: one scale (any shape of one
    element), one a row ([..., rows, 1] or [rows]), or one a block of `block` ([..., ceil(rows /
    block rows), ceil(cols / block cols)]: the last ones partial)."""
    values = weight.float()
    scales = torch.exp2(scale.float() - 127.0) if scale.dtype == torch.uint8 else scale.float()
    if scales.numel() == 1:
        return values * scales.reshape(())
    rows, cols = values.shape[-2:]
    if scales.shape in ((rows,), (*values.shape[:-1], 1)):
        return values * scales.reshape(*values.shape[:-1], 1)
    if block is not None:
        grid = (*values.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        if tuple(scales.shape) == grid:
            scales = scales.repeat_interleave(block[0], dim=-2)[..., :rows, :]
            return values * scales.repeat_interleave(block[1], dim=-1)[..., :cols]
    raise ValueError(
        f"scale {tuple(scale.shape)} is not one a tensor, a row or a block of {block} "
        f"of the weight {tuple(weight.shape)}"
    )


def dequantized_tensors(where: dict[str, Any], layout: Fp8Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors (`where`: each name -> its open file) with its FP8 weights times their
    scales (float32), the scales and the activations' and KV cache's left out."""
    for name, f in where.items():
        if name.endswith(DROPPED) or _scale_of(name, where):
            continue
        tensor = f.get_tensor(name)
        if tensor.dtype in FP8_DTYPES:
            tensor = _dequantized(name, tensor, where, layout)
        yield name, tensor


def _scale_of(name: str, where: dict[str, Any]) -> bool:
    """Whether `name` is a weight's scale or original shape (the weight beside it)."""
    return any(
        name.endswith(suffix) and name.removesuffix(suffix) in where
        for suffix in (*WEIGHT_SCALES, ORIGINAL_SHAPE)
    )


def _dequantized(name: str, tensor: torch.Tensor, where: dict[str, Any], layout: Fp8Layout) -> torch.Tensor:
    """The float8 tensor `name` times its scale (read from its file in `where`), or refused naming it."""
    scale_name = next((name + suffix for suffix in WEIGHT_SCALES if name + suffix in where), None)
    if scale_name is None:
        raise ValueError(f"model: the FP8 weight {name!r} has no scale ({name}_scale_inv or {name}_scale)")
    try:
        weight = dequantize_fp8(tensor, where[scale_name].get_tensor(scale_name), layout.block)
    except ValueError as e:
        raise ValueError(f"model: {name!r}: {e}") from None
    if name + ORIGINAL_SHAPE in where:  # (padded to whole blocks)
        rows, cols = (int(n) for n in where[name + ORIGINAL_SHAPE].get_tensor(name + ORIGINAL_SHAPE))
        weight = weight[:rows, :cols]
    return weight
