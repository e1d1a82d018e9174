"""The linear layers of one forward pass on CPU, bfloat16: our kernel (`pagedserve_kernels.cpu.linear_amx` on
CPUs with AMX tiles, else `linear_avx512` on CPUs with AVX512-BF16, as `layers.linear.pack_weight`
picks) against oneDNN on the same weights packed its way (what the engine runs where neither fits, and
what inductor's freezing gives a compiled model) and plain `F.linear` (which reorders its weight on
every call), at decode and prefill row counts.

    python bench/cpu_linear.py                       # SmolLM2-135M: 30 layers of qkv, o, gate_up, down + LM head
    python bench/cpu_linear.py --rows 1 16 64 --repeats 9
    python bench/cpu_linear.py --kernel avx512       # the AVX512-BF16 kernel on a CPU that has AMX too

Each figure is the median over --repeats passes over every layer's weight (distinct tensors, 270 MB
for the default model, so nothing is read from cache that a real pass would not), the arms' passes
taken in turn (a machine that speeds up and slows down weighs on all of them alike), as ms a pass
and the weight bytes our kernel reads per second; the ratio columns are peer time / our time (above 1:
ours faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from pagedserve_kernels import cpu

# (out_features, in_features, count): SmolLM2-135M-Instruct's projections and its tied LM head
DEFAULT_LAYERS = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)]


def median_ms_each(arms: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each arm's median time in ms over `repeats` passes, the arms taken in turn."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, fn in arms.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def our_kernel(
    choice: str,
) -> tuple[str, Callable[[torch.Tensor], torch.Tensor], Callable[..., torch.Tensor]]:
    """(name, pack, multiply) of the kernel asked for ("auto": the one the engine picks here)."""
    if not cpu.load():
        raise SystemExit("the C++ kernels do not build here (no C++ compiler?): nothing to compare")
    if choice in ("auto", "amx") and cpu.linear_amx_supported():
        return "AMX", cpu.pack_linear_weight, cpu.linear_amx
    if choice in ("auto", "avx512") and cpu.linear_avx512_supported():
        return "AVX512-BF16", cpu.pack_linear_weight_avx512, cpu.linear_avx512
    raise SystemExit(
        f"this machine has no {'AMX or AVX512-BF16' if choice == 'auto' else choice}: nothing to compare"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64, 128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kernel", choices=["auto", "amx", "avx512"], default="auto")
    args = parser.parse_args()
    name, pack, multiply = our_kernel(args.kernel)

    torch.manual_seed(0)
    weights = [torch.randn(n, k).to(torch.bfloat16) for n, k, count in DEFAULT_LAYERS for _ in range(count)]
    ours = [pack(w) for w in weights]
    num_bytes = sum(w.numel() * w.element_size() for w in weights)
    print(
        f"{len(weights)} weights, {num_bytes / 1e6:.0f} MB, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"| rows | {name} ms | {name} GB/s | oneDNN packed ms | F.linear ms | oneDNN / {name} | F.linear / {name} |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        inputs = [torch.randn(rows, w.shape[1]).to(torch.bfloat16) for w in weights]
        arms = {
            "ours": lambda x=inputs: [multiply(a, p) for a, p in zip(x, ours)],
            "onednn": lambda x=inputs, packed=onednn: [
                torch.ops.mkldnn._linear_pointwise(a, p, None, "none", [], None) for a, p in zip(x, packed)
            ],
            "plain": lambda x=inputs: [F.linear(a, w) for a, w in zip(x, weights)],
        }
        for fn in arms.values():
            fn()  # warm-up: oneDNN creates its primitives for this shape
        ms = median_ms_each(arms, args.repeats)
        gbps = num_bytes / ms["ours"] / 1e6
        print(
            f"| {rows} | {ms['ours']:.2f} | {gbps:.1f} | {ms['onednn']:.2f} | {ms['plain']:.2f} "
            f"| {ms['onednn'] / ms['ours']:.2f}x | {ms['plain'] / ms['ours']:.2f}x |"
        )


if __name__ == "__main__":
    main()
