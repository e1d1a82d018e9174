"""What n-gram speculative decoding (`--speculative-config '{"method": "ngram", ...}'`) buys: output
tok/s with and without drafts, in one run, against Hugging Face `generate` with and without its own
prompt lookup decoding (`prompt_lookup_num_tokens`), the same model, dtype and prompts.

    python bench/spec_decode.py                        # both workloads, 3 rounds, 4 drafts
    python bench/spec_decode.py --num-speculative-tokens 6 --prompt-lookup-min 2 --rounds 5
    python bench/spec_decode.py --disable-by-batch-size 8    # no drafts while more than 8 requests run

Workloads (greedy, forced output lengths): `copy`, 8 chat requests whose answers repeat their
prompt (copy a paragraph, add type hints to code, number a list, fix a sentence), 128 tokens each, run
one at a time (latency: one request in flight, where drafts matter most); and `chat`, the throughput
benchmark's 64 chat requests all at once (free text in large batches: what drafts cost where little
repeats). Each round runs pagedserve both ways in turn (order alternating); the table gives the
median tok/s, the ratio of drafting to not, and the share of draft tokens accepted. The Hugging Face
peers run the `copy` workload once each, one request at a time (prompt lookup takes batches of one).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from throughput import load_hf_model, machine_line
from workloads import build_workload, prompt_token_ids

PARAGRAPH = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
    "the members agreed to increase funding for the library, reduce spending on travel, and set aside "
    "a reserve for unexpected repairs to the community center."
)
CODE = (
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\ndef clamp(x, low, high):\n    return max(low, min(x, high))\n"
)
COPY_TASKS = [
    f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
    f"Add type hints to these Python functions and change nothing else:\n\n{CODE}",
    "Number each item of this list: apples, bread, milk, eggs, butter, cheese, rice, beans, onions, "
    "tomatoes, carrots, potatoes, garlic, lemons.",
    "Fix the spelling and repeat the sentence: Teh quick brown fox jumpd over teh lazy dog and ran "
    "into teh forest where it foud a river.",
    f"Translate nothing; just quote this paragraph back to me twice:\n\n{PARAGRAPH}",
    f"Rename the variable `total` to `acc` in this code and print the whole code:\n\n{CODE}",
    "Write the numbers from one to thirty in words, separated by commas.",
    "List the days of the week three times, one per line.",
]
COPY_TOKENS = 128


def timed(llm: Any, prompts: list[list[int]], params: list[Any], one_at_a_time: bool) -> float:
    start = time.perf_counter()
    if one_at_a_time:
        outputs = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    else:
        outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(out.outputs[0].token_ids) for out in outputs) / seconds


@torch.inference_mode()
def hf_one_at_a_time(model: Any, prompts: list[list[int]], num_tokens: int, lookup: int | None) -> float:
    """Greedy `generate`, one request at a time, with prompt lookup decoding when `lookup` is set."""
    extra = {} if lookup is None else {"prompt_lookup_num_tokens": lookup}
    model.generate(input_ids=torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, **extra)
    start = time.perf_counter()
    for ids in prompts:
        model.generate(
            input_ids=torch.tensor([ids]),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            **extra,
        )
    return len(prompts) * num_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", help="Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument(
        "--disable-by-batch-size", type=int, help="no drafts while more requests than this are in the engine"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peers")
    args = parser.parse_args()

    from pagedserve import LLM, SamplingParams
    from pagedserve.default_model import resolve_model_path
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    model_dir = resolve_model_path(args.model)
    chat = build_workload("chat", None)
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
        "disable_by_batch_size": args.disable_by_batch_size,
    }
    print(f"machine: {machine_line(args.dtype)}")
    print(f"speculative_config: {ngram}")
    engines = {
        "plain": LLM(model_dir, dtype=args.dtype),
        "ngram": LLM(model_dir, dtype=args.dtype, speculative_config=ngram),
    }
    copy_prompts = [
        engines["plain"].engine.encode_chat([{"role": "user", "content": task}]) for task in COPY_TASKS
    ]
    workloads = {
        "copy (one at a time)": (
            copy_prompts,
            [SamplingParams(temperature=0, max_tokens=COPY_TOKENS, ignore_eos=True)] * len(copy_prompts),
            True,
        ),
        "chat (64 at once)": (
            prompt_token_ids(engines["plain"].get_tokenizer(), chat),
            [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in chat],
            False,
        ),
    }
    for llm in engines.values():  # warm-up: both step kinds
        llm.generate(copy_prompts[:2], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    rows = []
    for workload, (prompts, params, one_at_a_time) in workloads.items():
        rates: dict[str, list[float]] = {name: [] for name in engines}
        stats_before = engines["ngram"].engine.stats()
        for round_number in range(args.rounds):
            names = list(engines) if round_number % 2 == 0 else list(reversed(engines))
            for name in names:
                rates[name].append(timed(engines[name], prompts, params, one_at_a_time))
                print(
                    f"{workload}, round {round_number + 1}, {name}: {rates[name][-1]:.1f} tok/s", flush=True
                )
        stats = engines["ngram"].engine.stats()
        drafted = stats.num_draft_tokens - stats_before.num_draft_tokens
        accepted = stats.num_accepted_draft_tokens - stats_before.num_accepted_draft_tokens
        plain, drafting = statistics.median(rates["plain"]), statistics.median(rates["ngram"])
        rows.append((workload, plain, drafting, accepted / max(drafted, 1)))

    print(
        "\n| workload | plain tok/s | ngram tok/s | ngram / plain | drafts accepted |\n|---|---:|---:|---:|---:|"
    )
    for workload, plain, drafting, share in rows:
        print(f"| {workload} | {plain:.1f} | {drafting:.1f} | {drafting / plain:.2f} | {share:.1%} |")
    if not args.no_hf:
        model, _ = load_hf_model(model_dir, getattr(torch, args.dtype))
        hf_plain = hf_one_at_a_time(model, copy_prompts, COPY_TOKENS, None)
        hf_lookup = hf_one_at_a_time(model, copy_prompts, COPY_TOKENS, args.num_speculative_tokens)
        ngram_copy = rows[0][2]
        print(
            f"\nHugging Face generate, copy workload one at a time: {hf_plain:.1f} tok/s, with prompt lookup "
            f"({args.num_speculative_tokens} tokens) {hf_lookup:.1f} tok/s"
        )
        print(
            f"pagedserve ngram / HF prompt lookup: {ngram_copy / hf_lookup:.2f}x; / HF plain: {ngram_copy / hf_plain:.2f}x"
        )


if __name__ == "__main__":
    main()
