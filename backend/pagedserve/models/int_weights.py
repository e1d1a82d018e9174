"""Integer-quantized checkpoints, dequantized on load: each weight's ints less their zero points
times their scales, in float32, then held in the model's dtype as every other weight (the
activations and the KV cache stay in it too). Values of `bits` (2, 4 or 8) packed into int32s, the
low bits first; a scale (and zero point) a group of `group_size` input columns:

- GPTQ (AutoGPTQ, GPTQModel; `quant_method` "gptq"): `qweight` [in / pack, out] packed along the
  inputs, `qzeros` [groups, out / pack] along the outputs, `scales` [groups, out], `g_idx` [in]
  each input's group (act-order checkpoints; else input // group_size); v1 checkpoints store each
  zero point less one.
- AWQ (AutoAWQ's GEMM layout; "awq"): `qweight` [in, out / pack] and `qzeros` [groups, out / pack]
  along the outputs, eight 4-bit values an int32 in the order 0, 2, 4, 6, 1, 3, 5, 7; `scales`
  [groups, out].
- compressed-tensors' ints (Red Hat's W4A16, W8A16: "pack-quantized"; W8A8: "int-quantized"):
  `weight_packed` [out, ceil(in / pack)] along the inputs, each value offset by 2^(bits - 1), the
  last int's unused values past `weight_shape`'s inputs; or `weight` int8 as it is; `weight_scale`
  [out, groups], `weight_g_idx` [in] where act-ordered; where not symmetric `weight_zero_point`
  [out, groups] (packed along the outputs as the values are along the inputs, or int8 as it is).

Each is yielded under its weight's name (`x.weight`); its other tensors, and activation and
KV-cache scales, are read by nothing else here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pagedserve.config import IntLayout

# AWQ's place of each column of eight in an int32's nibbles: column AWQ_ORDER[i] in nibble i
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# a packed weight's name after its layer's -> the tensors read with it
PACKED = {
    "gptq": (".qweight", (".qzeros", ".scales", ".g_idx")),
    "awq": (".qweight", (".qzeros", ".scales")),
    "compressed-tensors": (
        ".weight_packed",
        (".weight_scale", ".weight_zero_point", ".weight_g_idx", ".weight_shape"),
    ),
}
# read by nothing here: activations and the KV cache stay in the model's dtype
DROPPED = (".input_scale", ".input_zero_point", ".output_scale", ".k_scale", ".v_scale", ".kv_scale")


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] int32 -> [rows * 32 / bits, cols]: row r's int holds rows r * pack + i, i from
    the low bits."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return values.flatten(0, 1)


def unpack_columns(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[rows, cols] int32 -> [rows, cols * 32 / bits]: column c's int holds columns c * pack + i, i
    from the low bits, or column c * pack + order[i] in its i-th value."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed[:, :, None] >> shifts) & ((1 << bits) - 1)  # [rows, cols, pack]: by value
    if order is not None:
        values = values[..., torch.argsort(torch.tensor(order))]  # (value i is column order[i])
    return values.flatten(1, 2)


def group_of_inputs(num_inputs: int, group_size: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.long()
    if group_size == -1:
        return torch.zeros(num_inputs, dtype=torch.long)
    return torch.arange(num_inputs) // group_size


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    layout: IntLayout,
) -> torch.Tensor:
    """GPTQ's packed tensors -> the weight [out, in] in float32."""
    values = unpack_rows(qweight, layout.bits)  # [in, out]
    zeros = unpack_columns(qzeros, layout.bits)[:, : values.shape[1]] + int(layout.zeros_less_one)
    groups = group_of_inputs(values.shape[0], layout.group_size, g_idx)
    return ((values - zeros[groups]).float() * scales.float()[groups]).T


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, layout: IntLayout
) -> torch.Tensor:
    """AWQ's packed tensors -> the weight [out, in] in float32."""
    values = unpack_columns(qweight, layout.bits, AWQ_ORDER)  # [in, out]
    zeros = unpack_columns(qzeros, layout.bits, AWQ_ORDER)
    groups = group_of_inputs(values.shape[0], layout.group_size, None)
    return ((values - zeros[groups]).float() * scales.float()[groups]).T


def dequantize_compressed(
    values: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    layout: IntLayout,
) -> torch.Tensor:
    """compressed-tensors' signed ints [out, in] less their zero points (none: symmetric) times their
    scales, each [out, groups] -> float32."""
    groups = group_of_inputs(values.shape[1], layout.group_size, g_idx)
    if zero_points is not None:
        values = values.int() - zero_points.int()[:, groups]
    return values.float() * scales.float()[:, groups]


def dequantized_tensors(where: dict[str, Any], layout: IntLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors (`where`: each name -> its open file) with its integer weights
    dequantized under their weights' names and the tensors read with them left out."""
    packed_suffix, read_with = PACKED[layout.method]
    for name, f in where.items():
        if name.endswith(DROPPED):
            continue
        if any(name.endswith(s) and name.removesuffix(s) + packed_suffix in where for s in read_with):
            continue
        if (
            layout.method == "compressed-tensors"
            and name.endswith((".weight_scale", ".weight_zero_point"))
            and not layout.packed
        ):
            continue  # (int-quantized: read with its int8 weight below)
        if layout.packed and name.endswith(packed_suffix):
            layer = name.removesuffix(packed_suffix)
            try:
                weight = _dequantized(layer, where, layout)
            except (KeyError, ValueError, RuntimeError, IndexError) as e:
                raise ValueError(f"model: the {layout.method} weight {name!r} cannot be read: {e}") from None
            yield layer + ".weight", weight
            continue
        tensor = f.get_tensor(name)
        if tensor.dtype == torch.int8 and not layout.packed and name.endswith(".weight"):
            scale, zero_point = name + "_scale", name + "_zero_point"
            for needed in (scale, zero_point) if layout.zero_points else (scale,):
                if needed not in where:
                    raise ValueError(f"model: the int8 weight {name!r} has no {needed}")
            zero_points = where[zero_point].get_tensor(zero_point) if layout.zero_points else None
            tensor = dequantize_compressed(tensor, where[scale].get_tensor(scale), zero_points, None, layout)
        yield name, tensor


def _dequantized(layer: str, where: dict[str, Any], layout: IntLayout) -> torch.Tensor:
    def read(suffix: str) -> torch.Tensor:
        name = layer + suffix
        if name not in where:
            raise KeyError(f"{name} is not in the checkpoint")
        return where[name].get_tensor(name)

    def read_if(suffix: str) -> torch.Tensor | None:
        return read(suffix) if layer + suffix in where else None

    if layout.method == "gptq":
        return dequantize_gptq(read(".qweight"), read(".qzeros"), read(".scales"), read_if(".g_idx"), layout)
    if layout.method == "awq":
        return dequantize_awq(read(".qweight"), read(".qzeros"), read(".scales"), layout)
    offset = 1 << (layout.bits - 1)
    values = unpack_columns(read(".weight_packed"), layout.bits) - offset
    shape = read_if(".weight_shape")
    if shape is not None:  # (the last int of a row holds values past the inputs)
        values = values[:, : int(shape[1])]
    zero_points = None
    if layout.zero_points:
        zero_points = unpack_rows(read(".weight_zero_point"), layout.bits)[: values.shape[0]] - offset
    return dequantize_compressed(values, read(".weight_scale"), zero_points, read_if(".weight_g_idx"), layout)
