"""Micro-benchmarks of the Triton kernels: achieved memory bandwidth (GB/s) or FLOP/s against the
device's peak, and time ratios against the pure-torch reference and, for attention, against
`torch.nn.functional.scaled_dot_product_attention` on the same shapes.

    python bench/kernel_speed.py                              # GPU: serving-sized shapes
    python bench/kernel_speed.py --peak-gbps 3350 --peak-tflops 989
    python bench/kernel_speed.py --interpret                  # CPU: Triton's interpreter, tiny shapes

Ratios are reference time / Triton time, so above 1 means the kernel is faster. Bytes count each
tensor the kernel must touch once (K/V of every context token, inputs read, outputs written);
FLOPs count the two matrix products of attention (causal pairs only for prefill). The SDPA rows
use dense, contiguous K/V of the same sizes: what attention costs when nothing is paged.
With --interpret every figure is the interpreter's, which proves the harness and the kernels
run, and says nothing about performance.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from pagedserve_kernels import reference  # pure torch: importing it loads no Triton kernel

# Dense (no sparsity) vendor datasheet figures: HBM bandwidth in GB/s and 16-bit tensor-core
# TFLOP/s, matched in order against torch.cuda.get_device_name().
PEAKS = [
    ("H200", 4800, 989),
    ("H100 NVL", 3900, 835),
    ("H100 PCIe", 2000, 756),
    ("H100", 3350, 989),  # SXM5 80GB HBM3
    ("A100-SXM4-80GB", 2039, 312),
    ("A100 80GB PCIe", 1935, 312),
    ("A100", 1555, 312),  # 40GB, SXM4 or PCIe
    ("L40S", 864, 362),
    ("L4", 300, 121),
    ("A10", 600, 125),
]


@dataclass(frozen=True)
class Peak:
    gbps: float | None
    tflops: float | None
    source: str


@dataclass
class Case:
    """One kernel on one shape: `run` launches the Triton kernel, `references` the torch ones."""

    kernel: str
    shape: str
    run: Callable[[], object]
    num_bytes: int
    num_flops: int = 0  # attention only
    references: dict[str, Callable[[], object]] = field(default_factory=dict)


# -- shapes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    decode: list[tuple[int, int, int, int, int]]  # (num_seqs, context_len, num_heads, num_kv_heads, head_dim)
    prefill: list[tuple[int, int, int, int, int, int]]  # (+ query_len) chunk of query_len over context_len
    block_size: int
    num_tokens: int  # write_kv, rotary, norms, activation
    hidden: int
    intermediate: int
    num_block_pairs: int


GPU_SHAPES = Shapes(
    decode=[(16, 8192, 32, 8, 128), (128, 1024, 32, 8, 128), (1, 32768, 32, 8, 128)],
    prefill=[(4, 2048, 32, 8, 128, 2048), (1, 8192, 32, 8, 128, 512)],
    block_size=16,
    num_tokens=4096,
    hidden=4096,
    intermediate=14336,
    num_block_pairs=256,
)
TINY_SHAPES = Shapes(
    decode=[(3, 100, 4, 2, 64), (1, 600, 8, 1, 64)],  # the second splits its context (split-K)
    prefill=[(2, 40, 4, 2, 64, 40), (1, 70, 4, 2, 64, 20)],
    block_size=16,
    num_tokens=16,
    hidden=128,
    intermediate=256,
    num_block_pairs=4,
)


# -- paged cache ------------------------------------------------------------------------------------


def paged_kv(
    num_seqs: int,
    context_len: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V caches holding num_seqs contexts in randomly ordered blocks (a fragmented pool)."""
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq).to(torch.int32)
    return k_cache, v_cache, tables


def dense_kv(k_cache: torch.Tensor, tables: torch.Tensor, context_len: int) -> torch.Tensor:
    """[num_seqs, num_kv_heads, context_len, head_dim]: the same keys, contiguous, for SDPA."""
    return reference.gather_kv(k_cache, tables, tables.shape[1])[:, :context_len].transpose(1, 2).contiguous()


def decode_case(
    shape: tuple[int, int, int, int, int], block_size: int, dtype: torch.dtype, device: torch.device
) -> Case:
    from pagedserve_kernels import attention

    num_seqs, context_len, num_heads, num_kv_heads, head_dim = shape
    k_cache, v_cache, tables = paged_kv(
        num_seqs, context_len, num_kv_heads, head_dim, block_size, dtype, device
    )
    context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device=device)
    query = torch.randn(num_seqs, num_heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    args = (query, k_cache, v_cache, tables, context_lens, scale)
    keys, values = dense_kv(k_cache, tables, context_len), dense_kv(v_cache, tables, context_len)
    q4 = query.unsqueeze(2)
    itemsize = dtype.itemsize
    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * head_dim * itemsize
    check_close(attention.paged_attention_decode(*args), reference.paged_attention_decode(*args))
    return Case(
        "decode",
        f"{num_seqs}x{context_len} h{num_heads}/{num_kv_heads} d{head_dim}",
        lambda: attention.paged_attention_decode(*args, max_context_len=context_len),
        kv_bytes + 2 * query.numel() * itemsize + tables.numel() * 4,
        4 * num_seqs * context_len * num_heads * head_dim,
        {
            "torch ref": lambda: reference.paged_attention_decode(*args),
            "sdpa dense": lambda: F.scaled_dot_product_attention(
                q4, keys, values, scale=scale, enable_gqa=True
            ),
        },
    )


def prefill_case(
    shape: tuple[int, int, int, int, int, int], block_size: int, dtype: torch.dtype, device: torch.device
) -> Case:
    """num_seqs chunks of query_len tokens, each ending a context of context_len tokens."""
    from pagedserve_kernels import attention

    num_seqs, context_len, num_heads, num_kv_heads, head_dim, query_len = shape
    k_cache, v_cache, tables = paged_kv(
        num_seqs, context_len, num_kv_heads, head_dim, block_size, dtype, device
    )
    context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device=device)
    starts = torch.arange(0, (num_seqs + 1) * query_len, query_len, dtype=torch.int32, device=device)
    query = torch.randn(num_seqs * query_len, num_heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    args = (query, k_cache, v_cache, tables, starts, context_lens, scale)
    keys, values = dense_kv(k_cache, tables, context_len), dense_kv(v_cache, tables, context_len)
    q4 = query.view(num_seqs, query_len, num_heads, head_dim).transpose(1, 2)
    positions = torch.arange(context_len - query_len, context_len, device=device)
    mask = torch.arange(context_len, device=device)[None, :] <= positions[:, None]
    causal_pairs = sum(context_len - query_len + i + 1 for i in range(query_len))
    itemsize = dtype.itemsize
    check_close(attention.paged_attention_prefill(*args), reference.paged_attention_prefill(*args))
    return Case(
        "prefill",
        f"{num_seqs}x{query_len}/{context_len} h{num_heads}/{num_kv_heads} d{head_dim}",
        lambda: attention.paged_attention_prefill(*args, max_query_len=query_len),
        2 * num_seqs * context_len * num_kv_heads * head_dim * itemsize + 2 * query.numel() * itemsize,
        4 * num_seqs * causal_pairs * num_heads * head_dim,
        {
            "torch ref": lambda: reference.paged_attention_prefill(*args),
            "sdpa dense": lambda: F.scaled_dot_product_attention(
                q4, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            ),
        },
    )


def cache_cases(shapes: Shapes, dtype: torch.dtype, device: torch.device) -> list[Case]:
    from pagedserve_kernels import cache

    _, _, _, num_kv_heads, head_dim = shapes.decode[0]
    num_tokens, block_size = shapes.num_tokens, shapes.block_size
    num_blocks = 2 * max(-(-num_tokens // block_size), 2 * shapes.num_block_pairs)
    k_cache, v_cache, _ = paged_kv(
        1, num_blocks * block_size, num_kv_heads, head_dim, block_size, dtype, device
    )
    key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    write_args = (key, value, k_cache, v_cache, slots)
    pairs = torch.randperm(num_blocks, device=device)[: 2 * shapes.num_block_pairs].view(2, -1).T.contiguous()
    block_bytes = k_cache[0].numel() * dtype.itemsize
    return [
        Case(
            "write_kv_cache",
            f"{num_tokens} tok kv{num_kv_heads} d{head_dim}",
            lambda: cache.write_kv_cache(*write_args),
            4 * key.numel() * dtype.itemsize + slots.numel() * 8,
            references={"torch ref": lambda: reference.write_kv_cache(*write_args)},
        ),
        Case(
            "copy_blocks",
            f"{shapes.num_block_pairs} pairs of {block_bytes} B",
            lambda: cache.copy_blocks(k_cache, v_cache, pairs),
            2 * 2 * shapes.num_block_pairs * block_bytes,
            references={"torch ref": lambda: reference.copy_blocks(k_cache, v_cache, pairs)},
        ),
    ]


def elementwise_cases(shapes: Shapes, dtype: torch.dtype, device: torch.device) -> list[Case]:
    from pagedserve_kernels import activation, norm, rotary

    _, _, num_heads, num_kv_heads, head_dim = shapes.decode[0]
    rows, hidden, itemsize = shapes.num_tokens, shapes.hidden, dtype.itemsize
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    residual, weight = torch.randn_like(x), torch.randn(hidden, dtype=dtype, device=device)
    gate_up = torch.randn(rows, 2 * shapes.intermediate, dtype=dtype, device=device)
    query = torch.randn(rows, num_heads, head_dim, dtype=dtype, device=device)
    key = torch.randn(rows, num_kv_heads, head_dim, dtype=dtype, device=device)
    positions = torch.randint(0, 4096, (rows,), device=device)
    cos_sin = torch.randn(4096, head_dim, device=device)
    rope_args = (positions, query, key, cos_sin)
    check_close(rotary.rotary_embedding(*rope_args)[0], reference.rotary_embedding(*rope_args)[0])
    check_close(norm.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    return [
        Case(
            "rms_norm",
            f"{rows}x{hidden}",
            lambda: norm.rms_norm(x, weight, 1e-6),
            2 * x.numel() * itemsize + hidden * itemsize,
            references={"torch ref": lambda: reference.rms_norm(x, weight, 1e-6)},
        ),
        Case(
            "fused_add_rms_norm",
            f"{rows}x{hidden}",
            lambda: norm.fused_add_rms_norm(x, residual, weight, 1e-6),
            4 * x.numel() * itemsize + hidden * itemsize,
            references={"torch ref": lambda: reference.fused_add_rms_norm(x, residual, weight, 1e-6)},
        ),
        Case(
            "rotary_embedding",
            f"{rows} tok h{num_heads}/{num_kv_heads} d{head_dim}",
            lambda: rotary.rotary_embedding(*rope_args),
            2 * (query.numel() + key.numel()) * itemsize + rows * (head_dim * 4 + 8),
            references={"torch ref": lambda: reference.rotary_embedding(*rope_args)},
        ),
        Case(
            "silu_and_mul",
            f"{rows}x{shapes.intermediate}",
            lambda: activation.silu_and_mul(gate_up),
            gate_up.numel() * itemsize * 3 // 2,
            references={"torch ref": lambda: reference.silu_and_mul(gate_up)},
        ),
    ]


def check_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """A benchmark of a wrong kernel is worthless: compare once before timing."""
    torch.testing.assert_close(actual.float(), expected.float(), atol=3e-2, rtol=3e-2)


# -- measuring --------------------------------------------------------------------------------------


def seconds_per_call(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median time of one call. On GPU, triton's do_bench (CUDA events, L2 flushed between calls,
    so no call reads K/V the previous one left in cache); on CPU, wall-clock."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_peak(args: argparse.Namespace, device: torch.device) -> Peak:
    if device.type != "cuda":
        return Peak(args.peak_gbps, args.peak_tflops, "CPU: no peak table; pass --peak-gbps/--peak-tflops")
    name = torch.cuda.get_device_name(device)
    known = next(((gbps, tflops) for key, gbps, tflops in PEAKS if key in name), (None, None))
    gbps = args.peak_gbps if args.peak_gbps is not None else known[0]
    tflops = args.peak_tflops if args.peak_tflops is not None else known[1]
    source = "command line" if args.peak_gbps or args.peak_tflops else "datasheet table"
    return Peak(gbps, tflops, f"{name}, {source}" if gbps or tflops else f"{name}: unknown, pass --peak-*")


def percent(value: float, peak: float | None) -> str:
    return f"{100 * value / peak:.0f}%" if peak else "n/a"


def report_row(case: Case, peak: Peak, reps: int, device: torch.device) -> str:
    seconds = seconds_per_call(case.run, reps, device)
    gbps = case.num_bytes / seconds / 1e9
    achieved = f"{gbps:.3g} GB/s ({percent(gbps, peak.gbps)})"
    if case.num_flops:  # decode is judged by its GB/s, prefill by its FLOP/s: show both
        tflops = case.num_flops / seconds / 1e12
        achieved += f", {tflops:.3g} TFLOP/s ({percent(tflops, peak.tflops)})"
    ratios = ", ".join(
        f"{name} {seconds_per_call(fn, reps, device) / seconds:.3g}x" for name, fn in case.references.items()
    )
    return f"| {case.kernel} | {case.shape} | {seconds * 1e6:.1f} | {achieved} | {ratios} |"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--interpret", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--peak-gbps", type=float, default=None, help="device memory bandwidth, GB/s")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device 16-bit matrix TFLOP/s")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per kernel on CPU")
    parser.add_argument("--only", default=None, help="comma-separated kernel names to run")
    args = parser.parse_args()
    device = setup(args.interpret)
    dtype = getattr(torch, args.dtype)
    shapes = TINY_SHAPES if args.interpret else GPU_SHAPES
    torch.manual_seed(0)
    peak = device_peak(args, device)
    print(f"device: {peak.source}; peak {peak.gbps or '?'} GB/s, {peak.tflops or '?'} TFLOP/s; {args.dtype}")
    if args.interpret:
        print("Triton interpreter on CPU: the figures prove the harness runs, not performance.")
    print("\n| kernel | shape | us | achieved (of peak) | reference time / Triton time |")
    print("|---|---|---|---|---|")
    only = set(args.only.split(",")) if args.only else None
    for case in build_cases(shapes, dtype, device):
        if only is None or case.kernel in only:
            print(report_row(case, peak, args.reps, device), flush=True)


def build_cases(shapes: Shapes, dtype: torch.dtype, device: torch.device) -> list[Case]:
    cases = [decode_case(s, shapes.block_size, dtype, device) for s in shapes.decode]
    cases += [prefill_case(s, shapes.block_size, dtype, device) for s in shapes.prefill]
    return cases + cache_cases(shapes, dtype, device) + elementwise_cases(shapes, dtype, device)


def setup(interpret: bool) -> torch.device:
    """Triton wraps a kernel for its interpreter or its GPU compiler when the kernel's module is
    imported (inside the case builders), so the choice is made here, before any of them."""
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --interpret to exercise the kernels on CPU")
    return torch.device("cpu" if interpret else "cuda")


if __name__ == "__main__":
    main()
