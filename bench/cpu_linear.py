"""The linear layers of one forward pass on CPU, bfloat16: the AMX kernel (`pagedserve_kernels.cpu.linear_amx`)
against oneDNN on the same weights packed its way (what the engine runs without AMX, and what
inductor's freezing gives a compiled model) and plain `F.linear` (which reorders its weight on every
call), at decode and prefill row counts.

    python bench/cpu_linear.py                       # SmolLM2-135M: 30 layers of qkv, o, gate_up, down + LM head
    python bench/cpu_linear.py --rows 1 16 64 --repeats 9

Each figure is the median over --repeats passes over every layer's weight (distinct tensors, 270 MB
for the default model, so nothing is read from cache that a real pass would not), as ms a pass and
the weight bytes read per second; the ratio columns are peer time / AMX time (above 1: AMX faster).
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


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64, 128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not (cpu.load() and cpu.linear_amx_supported()):
        raise SystemExit("this machine has no AMX bfloat16 (or no C++ compiler): nothing to compare")

    torch.manual_seed(0)
    weights = [torch.randn(n, k).to(torch.bfloat16) for n, k, count in DEFAULT_LAYERS for _ in range(count)]
    amx = [cpu.pack_linear_weight(w) for w in weights]
    num_bytes = sum(w.numel() * w.element_size() for w in weights)
    print(
        f"{len(weights)} weights, {num_bytes / 1e6:.0f} MB, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print("| rows | AMX ms | AMX GB/s | oneDNN packed ms | F.linear ms | oneDNN / AMX | F.linear / AMX |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        inputs = [torch.randn(rows, w.shape[1]).to(torch.bfloat16) for w in weights]
        arms = {
            "amx": lambda x=inputs: [cpu.linear_amx(a, p) for a, p in zip(x, amx)],
            "onednn": lambda x=inputs, packed=onednn: [
                torch.ops.mkldnn._linear_pointwise(a, p, None, "none", [], None) for a, p in zip(x, packed)
            ],
            "plain": lambda x=inputs: [F.linear(a, w) for a, w in zip(x, weights)],
        }
        for fn in arms.values():
            fn()  # warm-up: oneDNN creates its primitives for this shape
        t_amx, t_onednn, t_plain = (median_ms(fn, args.repeats) for fn in arms.values())
        gbps = num_bytes / t_amx / 1e6
        print(
            f"| {rows} | {t_amx:.2f} | {gbps:.1f} | {t_onednn:.2f} | {t_plain:.2f} "
            f"| {t_onednn / t_amx:.2f}x | {t_plain / t_amx:.2f}x |"
        )


if __name__ == "__main__":
    main()
