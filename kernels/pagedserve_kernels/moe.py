# Layouts (as in reference.fused_moe_reference):
#   x            [T, H], contiguous, float16/bfloat16/float32
#   w13          [E, 2I, H], contiguous, x's dtype: expert e's gate rows [:I], then its up rows [I:]
#                (each expert's merged gate/up projection weight)
#   w2           [E, H, I], contiguous, x's dtype: expert e's down projection weight
#   w13_bias     [E, 2I], contiguous, x's dtype, optional: gate biases [:I], then up biases [I:]
#   w2_bias      [E, H], contiguous, x's dtype, optional (GPT-OSS's experts have both biases)
#   weights      [T, k] float32, contiguous: the router's weight of each (token, expert) pair
#   expert_ids   [T, k] int32/int64, contiguous, values in [0, E): not checked, as that would read
#                them on the host (an id out of range fails in a device-side index check)
#   out          [T, H], a new tensor of x's dtype
#
# Pair p = t * k + j is token t's j-th expert (the flattened [T, k]). `align_by_expert` sorts the
# pairs by expert and pads each expert's run to a multiple of BLOCK_M rows, so every block of
# BLOCK_M rows belongs to one expert and multiplies one weight matrix (a grouped GEMM):
#
#   pair p             0  1  2  3  4               T*k = 5, E = 3, BLOCK_M = 4
#   its expert         2  0  2  2  0
#   sorted_pair_ids    [ 1  4  5  5 | 0  2  3  5 | 5  5  5  5 | 5  5  5  5 ]   5 (= T*k): padding
#   block_expert_ids   [ 0          | 2          | -1         | -1         ]   idle expert 1: no block
#   num_valid_rows     [ 8 ]
#
# 16 rows: the bound T*k + min(E, T*k) * (BLOCK_M - 1) = 14 (an expert with pairs pads its run by
# at most BLOCK_M - 1 rows), rounded up to a multiple of BLOCK_M.
#
# Every size is an upper bound that depends on T*k, E and BLOCK_M only, and nothing is read back
# to the host: the grids cover the bound and the programs whose block starts at or past
# num_valid_rows (a device tensor) return at once. So the whole layer is one fixed sequence of
# launches, which a CUDA graph can capture.
#
# Two grouped GEMMs accumulate in float32 and round where the reference rounds (in x's dtype: the
# gate/up product with its bias, each op of the activation, the expert's output with its bias):
#   g, u = round(x[t] @ gate_e.T + b13[e, :I]), round(x[t] @ up_e.T + b13[e, I:])   (no bias: + 0)
#   h[p] = act(g, u)                                       [T*k, I] in x's dtype
#   y[p] = weights[p] * round(h[p] @ down_e.T + b2[e])     [T*k, H] in float32
# (a bias joins its product in float32, before the one rounding, as F.linear adds it: on the CPU
# too, checked for float16 and bfloat16)
#   out[t] = sum_j y[t * k + j]                            a torch sum over k: no atomics, deterministic
# Under WEIGHTED_INPUTS (Llama 4's experts) the weight scales the expert's input instead, rounded to
# x's dtype as the router's sigmoid is, and x[t] * weight rounded too; the output goes unweighted:
#   g, u = round(round(x[t] * round(weights[p])) @ gate_e.T ...),   y[p] = round(h[p] @ down_e.T + b2[e])
# act, a constexpr of the gate/up kernel (so each compiles only its own):
#   "silu"        silu(g) * u                                             (Mixtral, Qwen, ...)
#   "swiglu_oai"  g' * sigmoid(alpha * g') * (u' + 1), g' = min(g, limit),
#                 u' = clamp(u, -limit, limit)                            (GPT-OSS)
#   alpha and limit are runtime scalars: a model's own values compile nothing new.
# The biases are constexpr too (HAS_BIAS): without them the kernels compile no bias load.
"""Fused mixture-of-experts MLP: every (token, expert) pair's SwiGLU expert (GPT-OSS's clamped one and
biases too) in two grouped-GEMM kernels, weighted by the router and summed per token, with no host
synchronization."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from pagedserve_kernels._checks import FLOAT_DTYPES, INDEX_DTYPES
from pagedserve_kernels.reference import MOE_ACTIVATIONS

# tl.dot needs every block dimension >= 16 on GPUs, so BLOCK_M is at least 16 (padding rows are masked).
_MIN_BLOCK_M = 16
_MAX_BLOCK_M = 64
_BLOCK_N = 64
_BLOCK_K = 32


@triton.jit
def _dot(a: tl.tensor, b: tl.tensor, UPCAST: tl.constexpr) -> tl.tensor:
    """a @ b with float32 accumulation; "ieee" keeps float32 products exact (TF32 would not). UPCAST
    (under TRITON_INTERPRET) feeds 16-bit inputs as float32: the interpreter multiplies bfloat16's raw
    bits. The products are exact either way, so the results agree (see attention._dot)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _load_rows(
    a_ptr: tl.tensor,
    rows: tl.tensor,
    row_mask: tl.tensor,
    k0: tl.tensor,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> tl.tensor:
    """[BLOCK_M, BLOCK_K]: columns k0.. of a [*, K]'s `rows`; padding rows and columns past K read 0."""
    ks = k0 + tl.arange(0, BLOCK_K)
    mask = row_mask[:, None] & (ks[None, :] < K)
    return tl.load(a_ptr + rows[:, None] * K + ks[None, :], mask=mask, other=0.0)


@triton.jit
def _load_columns(
    w_ptr: tl.tensor,
    cols: tl.tensor,
    col_mask: tl.tensor,
    k0: tl.tensor,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> tl.tensor:
    """[BLOCK_K, BLOCK_N]: w [N, K]'s rows `cols`, columns k0.., transposed (the tile of w.T a row
    block multiplies); rows past N and columns past K read 0."""
    ks = k0 + tl.arange(0, BLOCK_K)
    mask = col_mask[None, :] & (ks[:, None] < K)
    return tl.load(w_ptr + cols[None, :] * K + ks[:, None], mask=mask, other=0.0)


@triton.jit
def _round(x: tl.tensor, dtype: tl.constexpr) -> tl.tensor:
    """x (float32) rounded to `dtype` and back: where an eager torch op in the model's dtype rounds."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _add_bias(
    acc: tl.tensor, b_ptr: tl.tensor, offsets: tl.tensor, col_mask: tl.tensor, HAS_BIAS: tl.constexpr
) -> tl.tensor:
    """acc [BLOCK_M, BLOCK_N] plus the bias at `offsets` (its columns' in the expert's bias row), in
    float32 before the one rounding, as F.linear adds it; without HAS_BIAS (b_ptr is then None) acc
    itself."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offsets, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _silu_and_mul(gate: tl.tensor, up: tl.tensor, dtype: tl.constexpr) -> tl.tensor:
    """As reference.silu_and_mul of the rounded projections: silu in float32 rounded, times up, rounded."""
    silu = _round(gate / (1.0 + tl.exp(-gate)), dtype)
    return silu * up


@triton.jit
def _gelu_tanh_and_mul(gate: tl.tensor, up: tl.tensor, dtype: tl.constexpr) -> tl.tensor:
    """As reference.gelu_tanh_and_mul of the rounded projections: GELU's tanh approximation in float32
    (tanh(u) as 2 / (1 + exp(-2u)) - 1), rounded, times up."""
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    tanh = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
    return _round(0.5 * gate * (1.0 + tanh), dtype) * up


@triton.jit
def _swiglu_oai_and_mul(
    gate: tl.tensor, up: tl.tensor, alpha: tl.tensor, limit: tl.tensor, dtype: tl.constexpr
) -> tl.tensor:
    """As reference.swiglu_oai_and_mul of the rounded projections, rounded after each op as eager torch
    rounds: gate * sigmoid(alpha * gate) * (up + 1) of the clamped gate and up. The clamps round
    too, for a limit `dtype` cannot hold (torch's clamp returns a value of x's dtype)."""
    gate = _round(tl.minimum(gate, limit), dtype)
    up = _round(tl.minimum(tl.maximum(up, -limit), limit), dtype)
    sigmoid = _round(1.0 / (1.0 + tl.exp(-_round(gate * alpha, dtype))), dtype)
    glu = _round(gate * sigmoid, dtype)
    return glu * _round(up + 1.0, dtype)


@triton.jit
def _gate_up_kernel(
    x_ptr: tl.tensor,
    w13_ptr: tl.tensor,
    b13_ptr: tl.tensor,
    h_ptr: tl.tensor,
    sorted_pair_ids_ptr: tl.tensor,
    block_expert_ids_ptr: tl.tensor,
    num_valid_rows_ptr: tl.tensor,
    num_pairs: tl.tensor,
    weights_ptr: tl.tensor,
    alpha: tl.tensor,
    limit: tl.tensor,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    WEIGHTED_INPUTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
) -> None:
    """Program (block, column tile): h[p, cols] = act(x[t] @ gate_e[cols].T + gate bias,
    x[t] @ up_e[cols].T + up bias) for the block's pairs p, of tokens t = p // TOP_K, and its expert
    e; act is ACTIVATION ("silu" or "swiglu_oai", with alpha and limit); under WEIGHTED_INPUTS x[t]
    scaled first by the pair's weight (both rounded to x's dtype)."""
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_valid_rows_ptr):
        return
    pair_ids = tl.load(sorted_pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = pair_ids < num_pairs
    expert = tl.load(block_expert_ids_ptr + block).to(tl.int64)
    gate_ptr = w13_ptr + expert * (2 * INTER * HIDDEN)
    up_ptr = gate_ptr + INTER * HIDDEN
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    col_mask = cols < INTER

    dtype = h_ptr.dtype.element_ty
    if WEIGHTED_INPUTS:
        weight = _round(tl.load(weights_ptr + pair_ids, mask=row_mask, other=0.0), dtype).to(tl.float32)
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):  # each x tile is read once, for both products
        a = _load_rows(x_ptr, pair_ids // TOP_K, row_mask, k0, HIDDEN, BLOCK_K)
        if WEIGHTED_INPUTS:
            a = _round(a.to(tl.float32) * weight[:, None], dtype).to(a.dtype)
        gate += _dot(a, _load_columns(gate_ptr, cols, col_mask, k0, HIDDEN, BLOCK_K), UPCAST)
        up += _dot(a, _load_columns(up_ptr, cols, col_mask, k0, HIDDEN, BLOCK_K), UPCAST)

    # the projections rounded as F.linear (with its bias) rounds them, then the activation
    gate_bias = expert * (2 * INTER) + cols  # b13 [E, 2I]: the expert's gate biases, then its up biases
    gate = _round(_add_bias(gate, b13_ptr, gate_bias, col_mask, HAS_BIAS), dtype)
    up = _round(_add_bias(up, b13_ptr, gate_bias + INTER, col_mask, HAS_BIAS), dtype)
    if ACTIVATION == "swiglu_oai":
        h = _swiglu_oai_and_mul(gate, up, alpha, limit, dtype)
    elif ACTIVATION == "gelu_tanh":
        h = _gelu_tanh_and_mul(gate, up, dtype)
    else:
        h = _silu_and_mul(gate, up, dtype)
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(h_ptr + pair_ids[:, None] * INTER + cols[None, :], h.to(dtype), mask=mask)


@triton.jit
def _down_kernel(
    h_ptr: tl.tensor,
    w2_ptr: tl.tensor,
    b2_ptr: tl.tensor,
    weights_ptr: tl.tensor,
    y_ptr: tl.tensor,
    sorted_pair_ids_ptr: tl.tensor,
    block_expert_ids_ptr: tl.tensor,
    num_valid_rows_ptr: tl.tensor,
    num_pairs: tl.tensor,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHTED_INPUTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
) -> None:
    """Program (block, column tile): y[p, cols] = weights[p] * round(h[p] @ down_e[cols].T + down
    bias), in float32, for the block's pairs p and its expert e (unweighted under WEIGHTED_INPUTS:
    the gate/up kernel scaled the input)."""
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_valid_rows_ptr):
        return
    pair_ids = tl.load(sorted_pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = pair_ids < num_pairs
    expert = tl.load(block_expert_ids_ptr + block).to(tl.int64)
    down_ptr = w2_ptr + expert * (HIDDEN * INTER)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    col_mask = cols < HIDDEN

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        a = _load_rows(h_ptr, pair_ids, row_mask, k0, INTER, BLOCK_K)
        acc += _dot(a, _load_columns(down_ptr, cols, col_mask, k0, INTER, BLOCK_K), UPCAST)

    # the expert's output (with its bias) is rounded to the model's dtype before the weighting, as an
    # Expert's is
    acc = _add_bias(acc, b2_ptr, expert * HIDDEN + cols, col_mask, HAS_BIAS)
    y = _round(acc, h_ptr.dtype.element_ty)
    if not WEIGHTED_INPUTS:
        y = y * tl.load(weights_ptr + pair_ids, mask=row_mask, other=0.0)[:, None]
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(y_ptr + pair_ids[:, None] * HIDDEN + cols[None, :], y, mask=mask)


# -- argument checks ------------------------------------------------------------------------------
# A refusal here is a ValueError, not an assert: it names the argument and survives `python -O`.


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_operand(name: str, tensor: torch.Tensor, ndim: int, dtypes: Sequence[torch.dtype]) -> None:
    """Type, rank, dtype and a dense layout (the kernels index with the shapes, not the strides)."""
    _require(
        isinstance(tensor, torch.Tensor), f"{name}: expected a torch.Tensor, got {type(tensor).__name__}"
    )
    _require(tensor.dim() == ndim, f"{name}: expected {ndim} dimensions, got shape {tuple(tensor.shape)}")
    _require(tensor.dtype in dtypes, f"{name}: dtype {tensor.dtype} not in {tuple(dtypes)}")
    _require(tensor.is_contiguous(), f"{name}: must be contiguous, got strides {tensor.stride()}")


def _check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int]) -> None:
    _require(
        tuple(tensor.shape) == tuple(expected),
        f"{name}: expected shape {tuple(expected)}, got {tuple(tensor.shape)}",
    )


def _check_moe_args(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
) -> tuple[int, int]:
    """The hidden and intermediate sizes, once every argument agrees with them."""
    _check_operand("x", x, 2, FLOAT_DTYPES)
    _check_operand("w13", w13, 3, FLOAT_DTYPES)
    _check_operand("w2", w2, 3, FLOAT_DTYPES)
    _check_operand("weights", weights, 2, (torch.float32,))
    _check_operand("expert_ids", expert_ids, 2, INDEX_DTYPES)
    num_tokens, hidden = x.shape
    num_experts, two_inter = w13.shape[:2]
    inter = two_inter // 2
    _require(hidden > 0, f"x: hidden size must be positive, got shape {tuple(x.shape)}")
    _require(w13.dtype == x.dtype, f"w13: dtype {w13.dtype} must be x's dtype {x.dtype}")
    _require(w2.dtype == x.dtype, f"w2: dtype {w2.dtype} must be x's dtype {x.dtype}")
    _require(
        num_experts > 0 and inter > 0 and two_inter % 2 == 0,
        f"w13: expected [experts > 0, 2 * intermediate > 0, hidden], got shape {tuple(w13.shape)}",
    )
    _check_shape("w13", w13, (num_experts, 2 * inter, hidden))
    _check_shape("w2", w2, (num_experts, hidden, inter))
    _require(
        weights.shape[0] == num_tokens and weights.shape[1] > 0,
        f"weights: expected shape ({num_tokens}, top_k > 0), got {tuple(weights.shape)}",
    )
    _check_shape("expert_ids", expert_ids, weights.shape)
    return hidden, inter


def _check_bias(name: str, bias: torch.Tensor | None, x: torch.Tensor, expected: Sequence[int]) -> None:
    """An optional bias: None, or [E, N] of x's dtype, contiguous."""
    if bias is None:
        return
    _check_operand(name, bias, 2, FLOAT_DTYPES)
    _require(bias.dtype == x.dtype, f"{name}: dtype {bias.dtype} must be x's dtype {x.dtype}")
    _check_shape(name, bias, expected)


def _check_activation(activation: str, swiglu_alpha: float, swiglu_limit: float) -> None:
    _require(
        activation in MOE_ACTIVATIONS, f"activation: expected one of {MOE_ACTIVATIONS}, got {activation!r}"
    )
    # a bool is an int to Python, and a tensor would be read back to the host: both refused
    is_number = isinstance(swiglu_alpha, (int, float)) and not isinstance(swiglu_alpha, bool)
    _require(is_number and math.isfinite(swiglu_alpha), f"swiglu_alpha: must be finite, got {swiglu_alpha!r}")
    is_number = isinstance(swiglu_limit, (int, float)) and not isinstance(swiglu_limit, bool)
    _require(
        is_number and math.isfinite(swiglu_limit) and swiglu_limit > 0,
        f"swiglu_limit: must be positive and finite, got {swiglu_limit!r}",
    )


def _check_devices(x: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Every tensor on x's device, and that one a GPU's, or the CPU under the interpreter."""
    devices = {"x": x.device} | {name: t.device for name, t in tensors.items() if t is not None}
    _require(len(set(devices.values())) == 1, f"tensors on different devices: {devices}")
    _require(
        x.is_cuda or triton.knobs.runtime.interpret,
        f"x: on {x.device}; Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 on CPU",
    )


# -- launchers ------------------------------------------------------------------------------------


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on align_by_expert's padded rows: each expert that has pairs (at most
    min(E, T*k) of them) pads its run by at most block_m - 1 rows; a multiple of block_m."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def align_by_expert(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs grouped by expert, each expert's run padded to a multiple of
    `block_m` rows (see the diagram at the top), computed with torch ops on expert_ids' device (any
    device: no kernel of ours) with no host sync:

      sorted_pair_ids   [max_padded_rows] int32: the pairs (indices into expert_ids.flatten()) in
                        expert order, stable within an expert; T*k marks a padding row
      block_expert_ids  [max_padded_rows / block_m] int32: each block's expert; -1 past the last
      num_valid_rows    [1] int32: the padded rows in use (a multiple of block_m)
    """
    _check_operand("expert_ids", expert_ids, 2, INDEX_DTYPES)
    _require(num_experts > 0, f"num_experts: must be positive, got {num_experts}")
    _require(block_m > 0, f"block_m: must be positive, got {block_m}")
    device = expert_ids.device
    num_pairs = expert_ids.numel()
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)

    pair_experts = expert_ids.flatten().long()
    order = pair_experts.argsort(stable=True)
    # counts by scatter_add_ (torch.bincount reads the largest id back to size its output)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, pair_experts, torch.ones_like(pair_experts))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    # a sorted pair moves from its place in the unpadded runs to the same place in its padded run
    shift = (padded_ends - padded_counts) - (counts.cumsum(0) - counts)
    destinations = torch.arange(num_pairs, device=device) + shift[pair_experts[order]]
    sorted_pair_ids = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, destinations, order.to(torch.int32))

    # a block's expert is the first whose padded run ends after the block's first row
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_expert_ids = torch.searchsorted(padded_ends, block_starts, right=True, out_int32=True)
    block_expert_ids = block_expert_ids.masked_fill_(block_expert_ids == num_experts, -1)
    return sorted_pair_ids, block_expert_ids, padded_ends[-1:].to(torch.int32)


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block from the shapes alone: about the mean rows per expert, so small batches
    waste few padding rows, from tl.dot's 16 to 64."""
    mean_rows = triton.cdiv(num_pairs, num_experts)
    return min(_MAX_BLOCK_M, max(_MIN_BLOCK_M, triton.next_power_of_2(mean_rows)))


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    weighted_inputs: bool = False,
) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * down_e(act(gate_e(x[t]), up_e(x[t]))), e = expert_ids[t, j]:
    [T, H] in x's dtype. `activation` "silu" is silu(gate) * up; "swiglu_oai" GPT-OSS's clamped
    SwiGLU (`swiglu_alpha`, `swiglu_limit`); "gelu_tanh" GELU's tanh approximation of gate times up
    (Gemma 4's); the projections add `w13_bias` [E, 2I] and `w2_bias`
    [E, H] when given; `weighted_inputs` (Llama 4's): out[t] = sum_j down_e(act(... x[t] weights[t, j]))
    (see the layouts at the top and reference.fused_moe_reference)."""
    hidden, inter = _check_moe_args(x, w13, w2, weights, expert_ids)
    num_experts, num_tokens, top_k = w13.shape[0], *expert_ids.shape
    _check_bias("w13_bias", w13_bias, x, (num_experts, 2 * inter))
    _check_bias("w2_bias", w2_bias, x, (num_experts, hidden))
    _check_activation(activation, swiglu_alpha, swiglu_limit)
    _check_devices(
        x, w13=w13, w2=w2, weights=weights, expert_ids=expert_ids, w13_bias=w13_bias, w2_bias=w2_bias
    )
    if num_tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)
    num_pairs = num_tokens * top_k
    block_m = _block_m(num_pairs, num_experts)
    sorted_pair_ids, block_expert_ids, num_valid_rows = align_by_expert(expert_ids, num_experts, block_m)
    num_blocks = sorted_pair_ids.numel() // block_m
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    blocks = (sorted_pair_ids, block_expert_ids, num_valid_rows, num_pairs)
    sizes = {"HIDDEN": hidden, "INTER": inter, "BLOCK_M": block_m, "BLOCK_N": _BLOCK_N, "BLOCK_K": _BLOCK_K}
    upcast = triton.knobs.runtime.interpret
    # a missing bias goes in as None (HAS_BIAS=False compiles its loads out); "silu" ignores alpha, limit
    swiglu = (float(swiglu_alpha), float(swiglu_limit))
    gate_up = {"TOP_K": top_k, "HAS_BIAS": w13_bias is not None, "ACTIVATION": activation}
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, _BLOCK_N))](
        x,
        w13,
        w13_bias,
        h,
        *blocks,
        weights,
        *swiglu,
        UPCAST=upcast,
        WEIGHTED_INPUTS=weighted_inputs,
        **gate_up,
        **sizes,
    )
    down = {"HAS_BIAS": w2_bias is not None, "WEIGHTED_INPUTS": weighted_inputs}
    _down_kernel[(num_blocks, triton.cdiv(hidden, _BLOCK_N))](
        h, w2, w2_bias, weights, y, *blocks, UPCAST=upcast, **down, **sizes
    )
    return y.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
