"""What LoRA adapters cost: offline throughput of the chat workload through adapters against the base
model, in one engine, and against PEFT on Hugging Face `generate` (static batches) in the same run.

    python bench/lora.py                          # 4 adapters of rank 16 on every projection, 3 rounds
    python bench/lora.py --rank 64 --num-adapters 8 --rounds 5

The adapters are random (normal, std 0.01), made here for the model in PEFT's format. One `LLM`
serves them all (`lora_modules`); each round runs the workload four ways, in turn (the order rotates
round by round): `base` (no adapter), `one` (every request through adapter 0), `mixed` (request i
through adapter i % (N + 1), the base model included) and, on a second `LLM` without adapters,
`no-lora` (what loading adapters costs requests that name none). The table gives each way's
median tok/s and its ratio to `base`. `peft-static` runs every request through adapter 0 on PEFT's
model (`PeftModel`, unmerged, as a server serving several adapters must run it) in static batches
of 64, once; needs `peft` (the test extras).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from throughput import hf_generate, load_hf_model, machine_line
from workloads import build_workload, prompt_token_ids

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(dest: Path, model_dir: str, rank: int, seed: int) -> str:
    """A random LoRA of every projection of every layer, as PEFT saves one."""
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    shapes = {
        "self_attn.q_proj": (hidden, q_out),
        "self_attn.k_proj": (hidden, kv_out),
        "self_attn.v_proj": (hidden, kv_out),
        "self_attn.o_proj": (q_out, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    dest.mkdir(parents=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS),
        "bias": "none",
        "base_model_name_or_path": model_dir,
    }
    (dest / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return str(dest)


def timed_round(llm: Any, prompts: list[list[int]], params: list[Any], lora: list[Any]) -> float:
    """Output tok/s of one run of the workload."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=lora)
    seconds = time.perf_counter() - start
    return sum(len(c.token_ids) for out in outputs for c in out.outputs) / seconds


@torch.inference_mode()
def peft_static(
    model_dir: str, adapter: str, prompts: list[list[int]], lengths: list[int], dtype: str
) -> float:
    from peft import PeftModel

    model, tokenizer = load_hf_model(model_dir, getattr(torch, dtype))
    model = PeftModel.from_pretrained(model, adapter).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hf_generate(model, prompts[:2], 4, pad_id)  # warm-up
    start = time.perf_counter()
    for first in range(0, len(prompts), 64):
        hf_generate(model, prompts[first : first + 64], max(lengths[first : first + 64]), pad_id)
    return sum(lengths) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", help="Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-peft", action="store_true", help="skip the PEFT peer")
    args = parser.parse_args()

    from pagedserve import LLM, LoRARequest, SamplingParams
    from pagedserve.default_model import resolve_model_path
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    model_dir = resolve_model_path(args.model)
    requests = build_workload("chat", None)
    lengths = [r.max_tokens for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    print(f"machine: {machine_line(args.dtype)}")
    print(
        f"{args.num_adapters} adapters of rank {args.rank} on every projection; chat workload, {sum(lengths)} tokens"
    )
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {
            f"a{i}": write_adapter(Path(tmp) / f"a{i}", model_dir, args.rank, seed=i)
            for i in range(args.num_adapters)
        }
        names = list(adapters)
        served = LLM(model_dir, dtype=args.dtype, lora_modules=adapters)
        plain = LLM(model_dir, dtype=args.dtype)
        prompts = prompt_token_ids(served.get_tokenizer(), requests)  # the engines' (PAGEDSERVE_TOKENIZER's)
        cycle = [LoRARequest(name) for name in names] + [None]
        ways = {
            "base": (served, [None] * len(prompts)),
            "one": (served, [cycle[0]] * len(prompts)),
            "mixed": (served, [cycle[i % len(cycle)] for i in range(len(prompts))]),
            "no-lora": (plain, [None] * len(prompts)),
        }
        for llm, lora in ways.values():  # warm-up: every path once
            llm.generate(prompts[:8], params[:8], lora_request=lora[:8])
        rates: dict[str, list[float]] = {way: [] for way in ways}
        order = list(ways)
        for round_number in range(args.rounds):
            for way in order[round_number % len(order) :] + order[: round_number % len(order)]:
                llm, lora = ways[way]
                rates[way].append(timed_round(llm, prompts, params, lora))
                print(f"round {round_number + 1}, {way}: {rates[way][-1]:.1f} tok/s", flush=True)
        peft_rate = (
            None if args.no_peft else peft_static(model_dir, adapters[names[0]], prompts, lengths, args.dtype)
        )
    base = statistics.median(rates["base"])
    print(f"\n| way | tok/s (median of {args.rounds}) | / base |\n|---|---:|---:|")
    for way, values in rates.items():
        print(f"| {way} | {statistics.median(values):.1f} | {statistics.median(values) / base:.3f} |")
    if peft_rate is not None:
        one_rate = statistics.median(rates["one"])
        print(f"| peft-static (adapter a0, batches of 64) | {peft_rate:.1f} | {peft_rate / base:.3f} |")
        print(f"\npagedserve `one` / peft-static: {one_rate / peft_rate:.2f}x")


if __name__ == "__main__":
    main()
