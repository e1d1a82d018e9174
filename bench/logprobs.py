"""Output throughput of requests that ask for logprobs: the sampler's C++ logprob kernel against torch's
path, on one engine, in the same run.

    python bench/logprobs.py                                   # the chat workload, logprobs=1, greedy
    python bench/logprobs.py --logprobs 5 --temperature 1.0    # sampled, top 5 alternatives a token
    python bench/logprobs.py --prompt-logprobs 1               # and every prompt token scored
    python bench/logprobs.py --rounds 4 --num-requests 256 --workload random

The workload is bench/workloads.py's (forced output lengths, `ignore_eos`). The engine is built once;
its rounds alternate its sampler's `logprob_rows` (the CPU kernel, where it builds) and none (torch's
log_softmax, topk and count over a float32 copy of the logits) in ABBA order, each round on an empty
prefix cache, so a drift of the machine weighs on both alike. Prints each round, the median output
tok/s of each and kernel / torch; then one sampler call on 64 rows of the model's vocabulary, timed
both ways. A CPU benchmark: elsewhere the sampler has no logprob kernel and this says so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import build_workload, prompt_token_ids  # noqa: E402


def sampler_call_ms(
    sampler: object, vocab: int, logprobs: int, temperature: float, repeats: int = 20
) -> float:
    """The median time of one sampler call over 64 bfloat16 rows asking for `logprobs` each."""
    from pagedserve.layers.sampler import SamplingTensors

    rows = 64
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    tensors = SamplingTensors(temperatures=torch.full((rows,), temperature), max_num_logprobs=logprobs)
    times = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        sampler(logits, tensors)  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="chat", help="chat (64 requests) or random (256)")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument(
        "--logprobs", type=int, default=1, help="alternatives a token (SamplingParams.logprobs)"
    )
    parser.add_argument("--prompt-logprobs", type=int, help="score every prompt token too, with this many")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded draws")
    parser.add_argument("--rounds", type=int, default=2, help="ABBA pairs: 2 -> 4 rounds a side")
    parser.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    from pagedserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
    requests = build_workload(args.workload, args.num_requests)
    prompts = prompt_token_ids(llm.get_tokenizer(), requests)  # the engine's (PAGEDSERVE_TOKENIZER's)
    sampler = llm.engine.executor.worker.model_runner.sampler  # type: ignore[attr-defined]
    kernel = sampler.logprob_rows
    if kernel is None:
        print("this engine's sampler has no logprob kernel (not on a CPU, or the C++ kernels did not build)")
        return
    params = [
        SamplingParams(
            max_tokens=r.max_tokens,
            ignore_eos=True,
            temperature=args.temperature,
            logprobs=args.logprobs,
            prompt_logprobs=args.prompt_logprobs,
            seed=1 if args.temperature > 0 else None,
        )
        for r in requests
    ]
    llm.generate(prompts[:4], params[:4])  # warm-up
    print(
        f"workload {args.workload}: {len(requests)} requests, {sum(r.max_tokens for r in requests)} output "
        f"tokens forced; logprobs {args.logprobs}, prompt_logprobs {args.prompt_logprobs}, "
        f"temperature {args.temperature:g}; {torch.get_num_threads()} torch threads"
    )
    rounds: dict[str, list[float]] = {"torch": [], "kernel": []}
    for name in ["torch", "kernel", "kernel", "torch"] * args.rounds:
        sampler.logprob_rows = kernel if name == "kernel" else None
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        rounds[name].append(tokens / seconds)
        print(
            f"round, {name}: {tokens} output tokens in {seconds:.2f} s ({tokens / seconds:.1f} tok/s)",
            flush=True,
        )
    torch_median, kernel_median = statistics.median(rounds["torch"]), statistics.median(rounds["kernel"])
    print(
        f"output tok/s, medians of {len(rounds['torch'])} rounds: torch's path {torch_median:.1f}, "
        f"the kernel {kernel_median:.1f}: kernel / torch {kernel_median / torch_median:.3f}"
    )
    vocab = llm.engine.config.model.vocab_size
    sampler.logprob_rows = None
    torch_ms = sampler_call_ms(sampler, vocab, args.logprobs, args.temperature)
    sampler.logprob_rows = kernel
    kernel_ms = sampler_call_ms(sampler, vocab, args.logprobs, args.temperature)
    print(
        f"one sampler call, 64 rows of {vocab} tokens asking for {args.logprobs} logprobs: torch's path "
        f"{torch_ms:.2f} ms, the kernel {kernel_ms:.2f} ms ({torch_ms / kernel_ms:.1f}x)"
    )


if __name__ == "__main__":
    main()
