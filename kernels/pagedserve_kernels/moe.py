# Layouts (as in reference.fused_moe_reference):
#   x            [T, H], contiguous, float16/bfloat16/float32
#   w13          [E, 2I, H], contiguous, x's dtype: expert e's gate rows [:I], then its up rows [I:]
#                (each expert's merged gate/up projection weight)
#   w2           [E, H, I], contiguous, x's dtype: expert e's down projection weight
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
# gate/up product, the SiLU, the SwiGLU product, the expert's output):
#   h[p] = silu(x[t] @ gate_e.T) * (x[t] @ up_e.T)      [T*k, I] in x's dtype
#   y[p] = weights[p] * round(h[p] @ down_e.T)             [T*k, H] in float32
#   out[t] = sum_j y[t * k + j]                            a torch sum over k: no atomics, deterministic
"""Fused mixture-of-experts MLP: every (token, expert) pair's SwiGLU expert in two grouped-GEMM
kernels, weighted by the router and summed per token, with no host synchronization."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from pagedserve_kernels._checks import FLOAT_DTYPES, INDEX_DTYPES

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
def _gate_up_kernel(
    x_ptr: tl.tensor,
    w13_ptr: tl.tensor,
    h_ptr: tl.tensor,
    sorted_pair_ids_ptr: tl.tensor,
    block_expert_ids_ptr: tl.tensor,
    num_valid_rows_ptr: tl.tensor,
    num_pairs: tl.tensor,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
) -> None:
    """Program (block, column tile): h[p, cols] = silu(x[t] @ gate_e[cols].T) * (x[t] @ up_e[cols].T)
    for the block's pairs p, of tokens t = p // TOP_K, and its expert e."""
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

    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):  # each x tile is read once, for both products
        a = _load_rows(x_ptr, pair_ids // TOP_K, row_mask, k0, HIDDEN, BLOCK_K)
        gate += _dot(a, _load_columns(gate_ptr, cols, col_mask, k0, HIDDEN, BLOCK_K), UPCAST)
        up += _dot(a, _load_columns(up_ptr, cols, col_mask, k0, HIDDEN, BLOCK_K), UPCAST)

    # as reference.silu_and_mul of the rounded projection: silu in float32 rounded, times up, rounded
    dtype = h_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    h = (silu.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(h_ptr + pair_ids[:, None] * INTER + cols[None, :], h, mask=mask)


@triton.jit
def _down_kernel(
    h_ptr: tl.tensor,
    w2_ptr: tl.tensor,
    weights_ptr: tl.tensor,
    y_ptr: tl.tensor,
    sorted_pair_ids_ptr: tl.tensor,
    block_expert_ids_ptr: tl.tensor,
    num_valid_rows_ptr: tl.tensor,
    num_pairs: tl.tensor,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
) -> None:
    """Program (block, column tile): y[p, cols] = weights[p] * round(h[p] @ down_e[cols].T), in
    float32, for the block's pairs p and its expert e."""
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

    # the expert's output is rounded to the model's dtype before the weighting, as an Expert's is
    weight = tl.load(weights_ptr + pair_ids, mask=row_mask, other=0.0)
    y = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
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
    devices = {
        "x": x.device,
        "w13": w13.device,
        "w2": w2.device,
        "weights": weights.device,
        "expert_ids": expert_ids.device,
    }
    _require(len(set(devices.values())) == 1, f"tensors on different devices: {devices}")
    _require(
        x.is_cuda or triton.knobs.runtime.interpret,
        f"x: on {x.device}; Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 on CPU",
    )
    return hidden, inter


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
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = expert_ids[t, j]:
    [T, H] in x's dtype (see the layouts at the top and reference.fused_moe_reference)."""
    hidden, inter = _check_moe_args(x, w13, w2, weights, expert_ids)
    num_tokens, top_k = expert_ids.shape
    if num_tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)
    num_pairs = num_tokens * top_k
    block_m = _block_m(num_pairs, w13.shape[0])
    sorted_pair_ids, block_expert_ids, num_valid_rows = align_by_expert(expert_ids, w13.shape[0], block_m)
    num_blocks = sorted_pair_ids.numel() // block_m
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    blocks = (sorted_pair_ids, block_expert_ids, num_valid_rows, num_pairs)
    sizes = {"HIDDEN": hidden, "INTER": inter, "BLOCK_M": block_m, "BLOCK_N": _BLOCK_N, "BLOCK_K": _BLOCK_K}
    upcast = triton.knobs.runtime.interpret
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, _BLOCK_N))](
        x, w13, h, *blocks, TOP_K=top_k, UPCAST=upcast, **sizes
    )
    _down_kernel[(num_blocks, triton.cdiv(hidden, _BLOCK_N))](
        h, w2, weights, y, *blocks, UPCAST=upcast, **sizes
    )
    return y.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
