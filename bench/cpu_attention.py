"""Paged attention on CPU, bfloat16: the C++ kernels (`pagedserve_kernels.cpu`) against the pure-torch
reference on scaled_dot_product_attention (what the engine runs where the kernels do not build). Decode
steps: `paged_attention_decode`. Prefills: `paged_attention_prefill` (tiles of 16 query-token/head
lanes, what the engine runs for bf16 prefills), the decode kernel over one row a prompt token
(`reference.prefill_rows`, what it ran before), and the SDPA layout (one padded call where
`reference.plan_prefill_batch` plans one, else a call a sequence).

    python bench/cpu_attention.py                    # SmolLM2-135M's heads: 9 query, 3 KV, head size 64
    python bench/cpu_attention.py --repeats 15 --block-size 16
    python bench/cpu_attention.py --head-dim 256 --tables decode prefill   # Gemma's head size

Decode shapes read one cache a layer for 30 layers, so a pass reads from memory as a forward pass does
(cold); prefill shapes one layer, many times (the cache warm, as after the step's K/V writes). Each
figure is the median over --repeats passes, the arms taken in turn, as ms a layer; a ratio is the
other arm's time / ours (above 1: ours faster). Every shape is checked against the reference first.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from cpu_linear import median_ms_each
from pagedserve_kernels import cpu, reference

LAYERS = 30
TABLES = ("decode", "prefill", "window", "softcap")


@dataclass(frozen=True)
class Heads:
    """The attention heads of the model measured (by default SmolLM2-135M's)."""

    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


def paged_cache(
    context_lens: list[int], block_size: int, heads: Heads, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables): random K/V, each sequence's blocks scattered over the pool."""
    blocks = [-(-n // block_size) for n in context_lens]
    shape = (sum(blocks) + 1, block_size, heads.num_kv_heads, heads.head_dim)
    k = torch.randn(shape, generator=generator).to(torch.bfloat16)
    v = torch.randn(shape, generator=generator).to(torch.bfloat16)
    pool = torch.randperm(sum(blocks), generator=generator).add(1).tolist()
    rows, start = [], 0
    for n in blocks:
        rows.append(pool[start : start + n] + [0] * (max(blocks) - n))
        start += n
    return k, v, torch.tensor(rows, dtype=torch.int32)


def timed(arms: dict[str, Callable[[], object]], repeats: int, per: int = 1) -> dict[str, float]:
    """Each arm's median ms (divided by `per`) over `repeats` passes, the arms in turn, after one
    untimed pass each."""
    for fn in arms.values():
        fn()
    return {name: ms / per for name, ms in median_ms_each(arms, repeats).items()}


def decode_case(
    context_lens: list[int],
    block_size: int,
    heads: Heads,
    repeats: int,
    gen: torch.Generator,
    window: int = 0,
    softcap: float = 0.0,
) -> dict[str, float]:
    """Under a `window` or a `softcap`, "full" times our kernel without them on the same caches."""
    layers = [paged_cache(context_lens, block_size, heads, gen) for _ in range(LAYERS)]
    lens = torch.tensor(context_lens, dtype=torch.int32)
    query = torch.randn(len(context_lens), heads.num_heads, heads.head_dim, generator=gen).to(torch.bfloat16)
    scale = heads.scale
    k, v, tables = layers[0]
    limits = {"window": window, "softcap": softcap}
    ours = cpu.paged_attention_decode(query, k, v, tables, lens, scale, **limits)
    exact = reference.paged_attention_decode(
        query.float(), k.float(), v.float(), tables, lens, scale, **limits
    )
    assert (ours.float() - exact).abs().max() < 0.05, "the kernel disagrees with the reference"
    arms = {
        "ours": lambda: [
            cpu.paged_attention_decode(query, k, v, t, lens, scale, **limits) for k, v, t in layers
        ],
        "reference": lambda: [
            reference.paged_attention_decode(query, k, v, t, lens, scale, **limits) for k, v, t in layers
        ],
    }
    if window or softcap:
        arms["full"] = lambda: [cpu.paged_attention_decode(query, k, v, t, lens, scale) for k, v, t in layers]
    return timed(arms, repeats, per=LAYERS)


def prefill_case(
    lens: list[tuple[int, int]],
    block_size: int,
    heads: Heads,
    repeats: int,
    gen: torch.Generator,
    window: int = 0,
    softcap: float = 0.0,
) -> dict[str, float]:
    """(query_len, context_len) a sequence; context_len > query_len: earlier tokens already cached.
    Under a `window` or a `softcap`, "full" times our kernel without them."""
    k, v, tables = paged_cache([c for _, c in lens], block_size, heads, gen)
    starts = torch.tensor([0, *(q for q, _ in lens)]).cumsum(0).to(torch.int32)
    context = torch.tensor([c for _, c in lens], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), heads.num_heads, heads.head_dim, generator=gen).to(torch.bfloat16)
    scale = heads.scale
    limits = {"window": window, "softcap": softcap}

    def ours() -> torch.Tensor:
        return cpu.paged_attention_prefill(query, k, v, tables, starts, context, scale, **limits)

    def rows() -> torch.Tensor:
        return cpu.paged_attention_decode(
            query, k, v, *reference.prefill_rows(tables, starts, context), scale, **limits
        )

    def sdpa() -> torch.Tensor:
        batch = reference.plan_prefill_batch(starts, context, block_size, torch.bfloat16, window)
        return reference.paged_attention_prefill(
            query, k, v, tables, starts, context, scale, batch=batch, **limits
        )

    def full() -> torch.Tensor:
        return cpu.paged_attention_prefill(query, k, v, tables, starts, context, scale)

    exact = reference.paged_attention_prefill(
        query.float(), k.float(), v.float(), tables, starts, context, scale, **limits
    )
    for arm in (ours, rows):
        assert (arm().float() - exact).abs().max() < 0.05, f"{arm.__name__} disagrees with the reference"
    arms = {"ours": ours, "rows": rows, "reference": sdpa} | ({"full": full} if window or softcap else {})
    return timed(arms, repeats)


def decode_table(args: argparse.Namespace, heads: Heads, gen: torch.Generator) -> None:
    print("\n| decode rows x context | ours ms | reference ms | reference / ours |\n|---|---:|---:|---:|")
    for seqs, ctx in ((64, 45), (16, 140), (64, 300), (16, 1000), (1, 1000)):
        t = decode_case([ctx] * seqs, args.block_size, heads, args.repeats, gen)
        print(
            f"| {seqs} x {ctx} | {t['ours']:.3f} | {t['reference']:.3f} | {t['reference'] / t['ours']:.2f}x |"
        )


def prefill_table(args: argparse.Namespace, heads: Heads, gen: torch.Generator) -> None:
    rng = random.Random(0)
    chat = [rng.randint(12, 22) for _ in range(64)]
    fresh = [rng.randint(36, 44) for _ in range(64)]
    prefills = {
        "64 chat prompts, 12-22 new tokens after 24 cached": [(q, q + 24) for q in chat],
        "64 prompts of 36-44 tokens": [(q, q) for q in fresh],
        "8 prompts of 100-1,000 tokens": [(n, n) for n in (100, 250, 400, 550, 700, 850, 1000, 300)],
        "1 prompt of 2,048 tokens": [(2048, 2048)],
        "a 512-token chunk after 1,488 cached": [(512, 2000)],
    }
    print(
        "\n| prefill | ours ms | rows ms | SDPA ms | rows / ours | SDPA / ours |\n|---|---:|---:|---:|---:|---:|"
    )
    for name, lens in prefills.items():
        t = prefill_case(lens, args.block_size, heads, args.repeats, gen)
        print(
            f"| {name} | {t['ours']:.2f} | {t['rows']:.2f} | {t['reference']:.2f} | "
            f"{t['rows'] / t['ours']:.2f}x | {t['reference'] / t['ours']:.2f}x |"
        )


def window_table(args: argparse.Namespace, heads: Heads, gen: torch.Generator) -> None:
    """A sliding window (Mistral v0.1's 4,096 against 32K contexts, scaled down): ours under it, ours
    over the whole context, and the reference's masked SDPA under it."""
    print(
        "\n| window 512 | ours ms | ours without the window ms | SDPA ms | without / ours | SDPA / ours |"
        "\n|---|---:|---:|---:|---:|---:|"
    )
    bs, repeats = args.block_size, args.repeats
    windowed = {
        "decode 16 x 4,000": lambda: decode_case([4000] * 16, bs, heads, repeats, gen, 512),
        "prefill 1 prompt of 4,096": lambda: prefill_case([(4096, 4096)], bs, heads, repeats, gen, 512),
    }
    for name, case in windowed.items():
        t = case()
        print(
            f"| {name} | {t['ours']:.3f} | {t['full']:.3f} | {t['reference']:.3f} | "
            f"{t['full'] / t['ours']:.2f}x | {t['reference'] / t['ours']:.2f}x |"
        )


def softcap_table(args: argparse.Namespace, heads: Heads, gen: torch.Generator) -> None:
    """Gemma 2's attention soft-capping (50): what the capped scores cost in our kernels, against the
    same kernels without it, and the reference's float32 capped attention."""
    print(
        "\n| softcap 50 | ours ms | ours without the cap ms | reference ms | ours / without | reference / ours |"
        "\n|---|---:|---:|---:|---:|---:|"
    )
    bs, repeats = args.block_size, args.repeats
    capped = {
        "decode 16 x 1,000": lambda: decode_case([1000] * 16, bs, heads, repeats, gen, softcap=50.0),
        "prefill 1 prompt of 2,048": lambda: prefill_case(
            [(2048, 2048)], bs, heads, repeats, gen, softcap=50.0
        ),
    }
    for name, case in capped.items():
        t = case()
        print(
            f"| {name} | {t['ours']:.3f} | {t['full']:.3f} | {t['reference']:.3f} | "
            f"{t['ours'] / t['full']:.2f}x | {t['reference'] / t['ours']:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--block-size", type=int, default=8, help="the engine's default on CPU: 8")
    parser.add_argument(
        "--head-dim", type=int, default=64, help="64 (SmolLM2), 96 (Phi-3), 128 (Llama), 256 (Gemma)"
    )
    parser.add_argument(
        "--heads", type=int, nargs=2, default=[9, 3], metavar=("QUERY", "KV"), help="default: 9 3"
    )
    parser.add_argument("--tables", nargs="+", choices=TABLES, default=list(TABLES), help="default: all")
    args = parser.parse_args()
    if not cpu.load():
        raise SystemExit("the C++ kernels do not build here (no C++ compiler?): nothing to compare")
    heads = Heads(args.heads[0], args.heads[1], args.head_dim)
    gen = torch.Generator().manual_seed(0)
    print(
        f"decode attention ({cpu.decode_isa()}), bf16, {heads.num_heads}/{heads.num_kv_heads} heads of "
        f"{heads.head_dim}, block size {args.block_size}, {torch.get_num_threads()} threads; ms a layer"
    )
    tables = {
        "decode": decode_table,
        "prefill": prefill_table,
        "window": window_table,
        "softcap": softcap_table,
    }
    for name in args.tables:
        tables[name](args, heads, gen)


if __name__ == "__main__":
    main()
