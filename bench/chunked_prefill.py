"""Inter-token latency of running decodes while a long prompt arrives, with and without chunked prefill.

    python bench/chunked_prefill.py [--decodes 30] [--long-prompt 2000] [--chunk 256]

Without chunking the whole long prompt runs in one step and every running decode waits for it;
with a token budget of --chunk the prompt is prefilled in pieces between decode steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import EngineSettings


def measure(budget: int, args: argparse.Namespace) -> dict[str, float]:
    engine = LLMEngine.from_settings(
        EngineSettings(max_num_batched_tokens=budget, enable_prefix_caching=False, dtype=args.dtype)
    )
    decode = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    for i in range(args.decodes):
        engine.add_request(f"d{i}", engine.encode_prompt(f"Count slowly from {i} to one hundred:"), decode)
    last_token: dict[str, float] = {}
    gaps: list[float] = []
    steps = 0
    long_added = long_done = False
    while engine.has_unfinished_requests():
        deltas = engine.step()
        now = time.perf_counter()
        steps += 1
        for delta in deltas:
            if delta.request_id == "long":
                long_done = True
            elif delta.request_id in last_token and long_added and not long_done:
                gaps.append(now - last_token[delta.request_id])
            last_token[delta.request_id] = now
        if steps == args.warmup_steps:  # the decodes are running: now the long prompt arrives
            engine.add_request(
                "long",
                [1] + [(7 * j) % 40000 + 100 for j in range(args.long_prompt)],
                SamplingParams(temperature=0, max_tokens=1),
            )
            long_added = True
    gaps.sort()
    return {
        "p50": statistics.median(gaps),
        "p99": gaps[int(0.99 * (len(gaps) - 1))],
        "max": gaps[-1],
        "samples": len(gaps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--decodes", type=int, default=30)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--long-prompt", type=int, default=2000)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    unchunked = measure(max(4096, args.long_prompt + args.decodes), args)
    chunked = measure(args.chunk, args)
    print(
        f"\ninter-token latency of {args.decodes} running decodes while a {args.long_prompt}-token prompt "
        f"is prefilled (seconds)"
    )
    print(f"{'mode':<28}{'p50':>10}{'p99':>10}{'max':>10}{'samples':>10}")
    for name, row in (("unchunked (one step)", unchunked), (f"chunked ({args.chunk} tokens/step)", chunked)):
        print(f"{name:<28}{row['p50']:>10.3f}{row['p99']:>10.3f}{row['max']:>10.3f}{row['samples']:>10}")
    print(f"worst-case stall, unchunked / chunked: {unchunked['max'] / chunked['max']:.1f}x")


if __name__ == "__main__":
    main()
