"""gRPC load generator: a workload streamed through `pagedserve serve`, with request and token throughput
and latency percentiles, optionally against the offline engine on the same workload.

    python bench/serving.py --spawn --compare-offline                 # saturation: all 64 chat requests at once
    python bench/serving.py --spawn --compare-offline --rounds 5      # the same, median of five rounds each
    python bench/serving.py --target localhost:8001 --request-rate 2  # Poisson arrivals, 2 requests/s
    python bench/serving.py --spawn --concurrency 16 --workload random --num-requests 64
    python bench/serving.py --spawn --compare-tracing --num-requests 16  # tracing off / on / off
    python bench/serving.py --spawn --rounds 8 --twin-server-arg=--stream-interval=2  # one setting vs another
    python bench/serving.py --spawn --rounds 8 --twin-server-arg=--uds=/tmp/ps.sock  # loopback TCP vs a Unix socket

Each request is one server-streaming `Generate` call (greedy, ignore_eos, the workload's forced
max_tokens; chat workloads send messages and the server applies the chat template). Measured per
request on the client:

- TTFT  time to first token: call start -> first response carrying a token
- TPOT  time per output token after the first: (end - first token) / (output tokens - 1)
- ITL   inter-token latency: the gap between consecutive responses carrying tokens (one gap per
        response; a response carrying k tokens counts once, as in vLLM's serving benchmark)
- E2E   call start -> last response

Throughput is over the benchmark's duration (first call start -> last call end). "Saturation" means
--request-rate inf (the default) with no concurrency limit: the server sees every request at once, as
the offline engine does. --compare-offline also runs the offline engine (`LLM`) with the same
workload and engine settings in this process, one offline round beside each server round, never at
the same time: the server is idle while the offline engine runs and the other way round.
--offline-tokens-per-s compares with a figure measured earlier instead.

One round's share moves by several points from run to run on a small machine shared with others: the
machine itself speeds up and slows down by several percent within minutes. --rounds N runs the
workload N times on the same server after its warm-up and N times on one offline engine, in ABBA
order (server then offline in odd rounds, offline then server in even ones), so a drift weighs on
both sides alike, and compares the median rounds; repeated prompts hit the prefix cache from the
second round on, on both sides alike.

The client shares the machine with a spawned server: on a small CPU its own work (gRPC, its event
loop) takes cycles from the server, which this benchmark does not hide but keeps small: uvloop
(--client-loop) and grpc's client reading responses on its completion queue's own thread
(GRPC_EXPERIMENTS=-event_engine_client, unless the caller sets the variable). grpc.aio's plain client:
`GRPC_EXPERIMENTS= python bench/serving.py --client-loop asyncio ...`.

--twin-server-arg starts a second server beside the first, the same but for the extra arguments, and
alternates the rounds between the two (A then B in odd rounds, B then A in even ones): the most
sensitive way to see what a server setting costs or buys, both sides seeing the machine's drift.

A spawned server given `--uds=PATH` (--server-arg or --twin-server-arg, in that one form) serves gRPC
on that Unix socket, and this client dials `unix:PATH` (--target takes `unix:PATH` too).

--engine-cores CPUS (with --spawn; Linux) lays a GPU host out on a CPU: the spawned servers' engine
(the engine process, or with --server-arg=--no-engine-process the server's torch thread) runs on
those CPUs with as many OpenMP threads, and the rest of the server and this client on the others, as a GPU
host gives its engine's host work cores of its own; the offline engine's rounds run on those CPUs too
(bench/placement.py).

--compare-tracing runs the workload three times on fresh spawned servers, tracing off, on, off
(ABA order, so the two "off" runs show the machine's noise): "on" is `--traces-exporter console`,
every request's spans built, batched and written as JSON to the server's log file, and the spans
found in that log are counted to prove it. "Off" is the default: no tracer provider at all.
"""

from __future__ import annotations

import os

# The client's gRPC reads the server's responses on the completion queue's polling thread instead of
# on EventEngine threads of its own: one thread hand-over less a response, and ~25% less of this
# process's CPU a response here (31 -> 23 us in a grpc.aio microbenchmark), CPU it would otherwise
# take from a server on the same cores. grpc reads the setting once, when it loads: set before the
# imports below. A GRPC_EXPERIMENTS the caller set, even empty, is kept; spawned servers get the
# environment as it was (SERVER_ENV).
SERVER_ENV = dict(os.environ)
os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_client")

import argparse
import asyncio
import atexit
import contextlib
import importlib.util
import json
import math
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import placement
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.rpc.v1 import generate_pb2_grpc as pb_grpc
from workloads import BenchRequest, build_workload, through_adapters

READINESS_SERVICE = "pagedserve.rpc.v1.Generation"
SATURATION = "inf (all at once)"
ENGINE_FLAGS = ("dtype", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "block_size")


@dataclass
class RequestRecord:
    """What the client saw of one call; times are `time.perf_counter()` seconds."""

    start: float
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one per response carrying tokens
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        """The call streamed tokens and ended without an error."""
        return not self.error and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.end - self.token_times[0]) / (self.num_output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class ServerCpu:
    """CPU seconds a spawned server spent over a round: its own process (the front end: gRPC, HTTP,
    tokenizing, metrics; with --no-engine-process the engine's steps too) and its descendants (the
    engine process and the tensor-parallel ranks). On a GPU host the front end near one core means it
    bounds the server's throughput there (a core's worth of Python)."""

    front_end_s: float
    engine_s: float


def server_cpu(pid: int) -> ServerCpu:
    process = psutil.Process(pid)
    engine_s = 0.0
    for child in process.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            engine_s += _cpu_seconds(child)
    return ServerCpu(_cpu_seconds(process), engine_s)


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


@dataclass
class RoundResult:
    records: list[RequestRecord]
    client_cpu_s: float  # this load generator's own
    server_cpu: ServerCpu | None  # a spawned server's (None for a --target server)


# -- the load --------------------------------------------------------------------------------------------


def to_proto(request: BenchRequest) -> pb.GenerateRequest:
    sampling = pb.SamplingParameters(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
    if request.is_chat:
        messages = [pb.ChatMessage(role=role, content=content) for role, content in request.messages]
        return pb.GenerateRequest(
            messages=pb.ChatMessages(messages=messages), sampling=sampling, lora_name=request.lora_name
        )
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=request.prompt_token_ids), sampling=sampling, lora_name=request.lora_name
    )


async def send(stub: pb_grpc.GenerationStub, request: BenchRequest, timeout: float) -> RequestRecord:
    record = RequestRecord(start=time.perf_counter())
    try:
        async for response in stub.Generate(to_proto(request), timeout=timeout):
            now = time.perf_counter()
            if response.error:
                record.error = response.error
            if response.token_ids:
                record.token_times.append(now)
                record.num_output_tokens += len(response.token_ids)
            record.num_prompt_tokens = response.prompt_tokens or record.num_prompt_tokens
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    record.end = time.perf_counter()
    if not record.error and record.num_output_tokens != request.max_tokens:
        record.error = f"got {record.num_output_tokens} tokens, asked for {request.max_tokens}"
    return record


async def run_load(
    stub: pb_grpc.GenerationStub,
    requests: list[BenchRequest],
    request_rate: float,
    concurrency: int | None,
    seed: int,
    timeout: float,
) -> list[RequestRecord]:
    """Start calls at Poisson arrivals (exponential gaps at `request_rate`; all at once when inf),
    never more than `concurrency` in flight when given."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency) if concurrency else None

    async def limited(request: BenchRequest) -> RequestRecord:
        if limit is None:
            return await send(stub, request, timeout)
        async with limit:
            return await send(stub, request, timeout)

    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(limited(request)))
        if math.isfinite(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
    return list(await asyncio.gather(*tasks))


async def benchmark(
    args: argparse.Namespace,
    targets: list[str],
    requests: list[BenchRequest],
    rounds: int = 1,
    offline: OfflineEngine | None = None,
    servers: Sequence[SpawnedServer] = (),
) -> list[list[RoundResult]]:
    """Per target, per round, the records of every timed call and the CPU seconds this client process
    and a spawned server (`servers`, one per target) spent on them. Each target gets one warm-up,
    then `--warmup-rounds` untimed rounds of the workload (as does the offline engine); the rounds
    run one after another. Two targets (twin servers) take turns in ABBA order (A then B in odd
    rounds, B then A in even ones). With `offline` (one target), one offline round runs next to each
    server round, after it in odd rounds and before it in even ones (this blocks the event loop,
    which has no call in flight then). `servers`, the spawned ones, are placed on --engine-cores
    once warm."""
    async with contextlib.AsyncExitStack() as stack:
        stubs = []
        for target in targets:
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(target))
            stubs.append(await warm_up(args, channel))
        for server in servers:
            server.place()
        for round_ in range(1, args.warmup_rounds + 1):
            for i, stub in enumerate(stubs):
                records = await run_load(
                    stub, requests, args.request_rate, args.concurrency, args.seed, args.timeout
                )
                which = f"server {chr(ord('A') + i)}, " if len(targets) > 1 else ""
                print(
                    f"{which}untimed round {round_}: {output_tokens_per_s(records):.1f} output tok/s",
                    flush=True,
                )
            if offline is not None:
                offline.run_round(timed=False)
        results: list[list[RoundResult]] = [[] for _ in targets]
        for round_ in range(1, rounds + 1):
            if offline is not None and round_ % 2 == 0:
                offline.run_round()
            order = list(range(len(targets)))
            for i in order if round_ % 2 == 1 else order[::-1]:
                spawned = servers[i] if servers else None
                server_start = spawned.cpu() if spawned else None  # (outside the client's own count)
                start = os.times()
                records = await run_load(
                    stubs[i], requests, args.request_rate, args.concurrency, args.seed, args.timeout
                )
                end = os.times()
                server_end = spawned.cpu() if spawned else None
                client_cpu_s = end.user - start.user + end.system - start.system
                spent = None
                if server_start is not None and server_end is not None:
                    spent = ServerCpu(
                        server_end.front_end_s - server_start.front_end_s,
                        server_end.engine_s - server_start.engine_s,
                    )
                results[i].append(RoundResult(records, client_cpu_s, spent))
                which = f"server {chr(ord('A') + i)}, " if len(targets) > 1 else ""
                print(f"{which}round {round_}: {output_tokens_per_s(records):.1f} output tok/s", flush=True)
            if offline is not None and round_ % 2 == 1:
                offline.run_round()
        return results


async def warm_up(args: argparse.Namespace, channel: grpc.aio.Channel) -> pb_grpc.GenerationStub:
    """Wait for the server, send the untimed warm-up requests and say what it serves."""
    await wait_ready(channel, args.ready_timeout)
    stub = pb_grpc.GenerationStub(channel)
    warmup = [BenchRequest(8, messages=(("user", "Warm up."),))] * args.num_warmup
    for record in await asyncio.gather(*(send(stub, r, args.timeout) for r in warmup)):
        if record.error:
            raise RuntimeError(f"warm-up request failed: {record.error}")
    info = await stub.ModelInfo(pb.ModelInfoRequest())
    print(
        f"server: {info.model_name} ({info.dtype}), {info.num_kv_blocks} KV blocks of {info.block_size}, "
        f"max_num_seqs {info.max_num_seqs}, version {info.version}",
        flush=True,
    )
    return stub


async def wait_ready(channel: grpc.aio.Channel, timeout: float) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.aio.AioRpcError):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=READINESS_SERVICE), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the server was not ready within {timeout:.0f} s")


# -- a spawned server ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SpawnedServer:
    """`python -m pagedserve serve` on loopback with the engine flags given here; log in a temp file."""

    def __init__(self, args: argparse.Namespace, extra_args: list[str] | None = None) -> None:
        self.port = free_port()
        # `--uds=PATH` among its arguments: gRPC on that Unix socket, in place of a port
        self.uds = next(
            (a.partition("=")[2] for a in args.server_arg + (extra_args or []) if a.startswith("--uds=")),
            None,
        )
        command = [sys.executable, "-m", "pagedserve", "serve", "--host", "127.0.0.1", "--http-port", "-1"]
        if self.uds is None:
            command += ["--port", str(self.port)]
        for name in ENGINE_FLAGS:
            if getattr(args, name) is not None:
                command += ["--" + name.replace("_", "-"), str(getattr(args, name))]
        if args.model:
            command += ["--model", args.model]
        if args.lora_modules:
            command += ["--lora-modules", args.lora_modules]
        command += args.server_arg + (extra_args or [])
        self.log = Path(tempfile.mkstemp(prefix="pagedserve-serve-", suffix=".log")[1])
        print(f"spawning: {' '.join(command)} (log {self.log})", flush=True)
        env = dict(SERVER_ENV)
        self.engine_cpus: set[int] | None = args.engine_cores
        if self.engine_cpus is not None:
            env["OMP_NUM_THREADS"] = str(len(self.engine_cpus))
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def cpu(self) -> ServerCpu:
        """The CPU seconds its processes have spent so far."""
        return server_cpu(self.proc.pid)

    def place(self) -> None:
        """Pin the ready server on --engine-cores (nothing without it)."""
        if self.engine_cpus is not None:
            print(f"placed: {placement.place_server(self.proc.pid, self.engine_cpus)}", flush=True)

    @property
    def target(self) -> str:
        return f"unix:{self.uds}" if self.uds is not None else f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def tail(self) -> str:
        return self.log.read_text()[-3000:]


# -- offline reference ---------------------------------------------------------------------------------


class OfflineEngine:
    """The offline engine (`LLM`) in this process on the same workload and engine settings as the
    server, one timed round at a time (model load and warm-up untimed)."""

    def __init__(self, args: argparse.Namespace, requests: list[BenchRequest]) -> None:
        from pagedserve import LLM, LoRARequest, SamplingParams

        self.cpus = args.engine_cores  # its rounds run there (and this client elsewhere between them)
        if self.cpus is not None:
            import torch

            torch.set_num_threads(len(self.cpus))
        settings = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
        self.llm = LLM(args.model, lora_modules=args.lora_modules, **settings)
        self.llm.chat([{"role": "user", "content": "Warm up."}], SamplingParams(temperature=0, max_tokens=8))
        self.requests = requests
        self.params = [
            SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
        ]
        self.lora = [LoRARequest(r.lora_name) if r.lora_name else None for r in requests]
        self.rates: list[float] = []  # output tok/s of each round so far

    def run_round(self, timed: bool = True) -> None:
        """One round; `timed` False: printed, not counted (a warm-up round)."""
        if self.cpus is not None:
            placement.pin_process(os.getpid(), self.cpus)
        try:
            self._run_round(timed)
        finally:
            if self.cpus is not None:
                placement.pin_process(os.getpid(), placement.split(self.cpus)[1])

    def _run_round(self, timed: bool) -> None:
        start = time.perf_counter()
        if self.requests[0].is_chat:
            outputs = self.llm.chat(
                [r.chat_messages() for r in self.requests], self.params, lora_request=self.lora
            )
        else:
            prompts = [list(r.prompt_token_ids) for r in self.requests]
            outputs = self.llm.generate(prompts, self.params, lora_request=self.lora)
        seconds = time.perf_counter() - start
        num_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        if timed:
            self.rates.append(num_tokens / seconds)
        which = f"round {len(self.rates)}" if timed else "untimed round"
        print(
            f"offline engine, {which}: {num_tokens} output tokens in {seconds:.2f} s "
            f"({num_tokens / seconds:.1f} tok/s)",
            flush=True,
        )


# -- report --------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def duration_s(records: list[RequestRecord]) -> float:
    """The benchmark's duration: first call start -> last call end."""
    return max(r.end for r in records) - min(r.start for r in records)


def completed(records: list[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.ok]


def output_tokens_per_s(records: list[RequestRecord]) -> float:
    return sum(r.num_output_tokens for r in completed(records)) / duration_s(records)


def summarize(records: list[RequestRecord]) -> dict[str, Any]:
    ok = completed(records)
    duration = duration_s(records)
    num_output = sum(r.num_output_tokens for r in ok)
    num_prompt = sum(r.num_prompt_tokens for r in ok)
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "num_completed": len(ok),
        "num_failed": len(records) - len(ok),
        "duration_s": duration,
        "num_output_tokens": num_output,
        "num_prompt_tokens": num_prompt,
        "num_token_responses": sum(len(r.token_times) for r in ok),
        "request_throughput": len(ok) / duration,
        "output_tokens_per_s": num_output / duration,
        "total_tokens_per_s": (num_output + num_prompt) / duration,
    }
    series = {
        "ttft_s": [r.ttft for r in ok],
        "tpot_s": [t for r in ok if (t := r.tpot) is not None],
        "itl_s": [gap for r in ok for gap in r.itls],
        "e2e_s": [r.e2e for r in ok],
    }
    for name, values in series.items():
        summary[name] = {
            "mean": sum(values) / len(values) if values else math.nan,
            "p50": percentile(values, 50),
            "p99": percentile(values, 99),
            "max": max(values, default=math.nan),
        }
    return summary


def median_round(
    results: list[RoundResult],
) -> tuple[dict[str, Any], list[RequestRecord], list[RequestRecord]]:
    """The summary and records of the round with the median output throughput (the lower middle one
    for an even count), and the failed calls of every round, not only of that one."""
    rates = [output_tokens_per_s(result.records) for result in results]
    median = results[rates.index(statistics.median_low(rates))]
    summary = summarize(median.records)
    summary["client_cpu_s"] = median.client_cpu_s
    if median.server_cpu is not None:
        summary["server_cpu_s"] = asdict(median.server_cpu)
    summary["rounds_output_tokens_per_s"] = rates
    failed = [r for result in results for r in result.records if not r.ok]
    summary["num_failed_all_rounds"] = len(failed)
    return summary, median.records, failed


def print_summary(summary: dict[str, Any], errors: list[str]) -> None:
    print(
        f"\nrequests: {summary['num_completed']} completed, {summary['num_failed']} failed, "
        f"in {summary['duration_s']:.1f} s"
    )
    for error in errors[:5]:
        print(f"  error: {error}")
    print(f"request throughput: {summary['request_throughput']:.3f} req/s")
    print(
        f"output throughput:  {summary['output_tokens_per_s']:.1f} tok/s ({summary['num_output_tokens']} tokens)"
    )
    print(f"total throughput:   {summary['total_tokens_per_s']:.1f} tok/s (prompt + output)")
    responses = summary["num_token_responses"]
    print(
        f"responses with tokens: {responses} "
        f"({summary['num_output_tokens'] / max(1, responses):.2f} tokens each; see the server's --stream-interval)"
    )
    print(
        f"client CPU time: {summary['client_cpu_s']:.1f} s, "
        f"{summary['client_cpu_s'] / summary['duration_s']:.2f} cores over the benchmark's duration"
    )
    if "server_cpu_s" in summary:
        front_end_s, engine_s = summary["server_cpu_s"]["front_end_s"], summary["server_cpu_s"]["engine_s"]
        print(
            f"server CPU time: its own process (the front end) {front_end_s:.1f} s, "
            f"{front_end_s / summary['duration_s']:.2f} cores, "
            f"{1e6 * front_end_s / max(1, summary['num_output_tokens']):.0f} us an output token; "
            f"its engine process and ranks {engine_s:.1f} s, {engine_s / summary['duration_s']:.2f} cores"
        )
    latencies = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E"))
    print_table(
        ["latency (ms)", "mean", "p50", "p99", "max"],
        "lrrrr",
        [
            [label, *(_ms(summary[name][stat]) for stat in ("mean", "p50", "p99", "max"))]
            for name, label in latencies
        ],
    )
    rounds = len(summary["rounds_output_tokens_per_s"])
    if rounds > 1:
        print(f"\nrounds, server output tok/s: {_figures(summary['rounds_output_tokens_per_s'])}")
        if "offline_rounds_tokens_per_s" in summary:
            print(f"rounds, offline output tok/s: {_figures(summary['offline_rounds_tokens_per_s'])}")
    if "offline_tokens_per_s" in summary:
        which = f" (the median of {rounds} rounds each)" if rounds > 1 else ""
        print(
            f"\nserver / offline output throughput{which}: {summary['output_tokens_per_s']:.1f} / "
            f"{summary['offline_tokens_per_s']:.1f} tok/s = {100 * summary['share_of_offline']:.1f}%"
        )
        if summary["arrivals"] != SATURATION or summary["concurrency"]:
            print(
                "  (not at saturation: the arrival rate or the concurrency limit caps the server's throughput)"
            )


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of `minimum` or more."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        return value

    return parse


def _cpus(text: str) -> set[int]:
    try:
        return placement.parse_cpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def print_table(header: list[str], align: str, rows: list[list[str]]) -> None:
    """A markdown table after a blank line; `align` has a letter a column: l (text) or r (numbers)."""
    print("\n| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" if a == "r" else "---" for a in align) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def write_json(path: str | None, report: dict[str, Any]) -> None:
    """The report as JSON at `path` (--json-out), when given."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, default=sorted)  # (--engine-cores: a set of CPUs)


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def _figures(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


# -- main ----------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="localhost:8001", help="host:port of a running server")
    parser.add_argument(
        "--spawn", action="store_true", help="start `pagedserve serve` on loopback and use it"
    )
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra argument for the spawned server (repeatable)"
    )
    parser.add_argument("--workload", choices=("chat", "random"), default="chat")
    parser.add_argument("--num-requests", type=int, help="default: 64 (chat) or 256 (random)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    parser.add_argument("--concurrency", type=int, help="most calls in flight (default: no limit)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrivals and the random workload")
    parser.add_argument("--num-warmup", type=int, default=2, help="short untimed requests first")
    parser.add_argument(
        "--warmup-rounds",
        type=_int_at_least(0),
        default=0,
        help="untimed rounds of the whole workload first, on every server and the offline engine "
        "(a GPU captures a CUDA graph the first time a batch size and context length come up)",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="per-call deadline in seconds")
    parser.add_argument(
        "--rounds",
        type=_int_at_least(1),
        default=1,
        help="run the workload this many times on the server (and on the offline engine) and report "
        "the median round",
    )
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--model", help="model directory for a spawned server and the offline engine")
    parser.add_argument("--dtype", help="engine setting for a spawned server and the offline engine")
    parser.add_argument("--max-num-seqs", type=int, help="engine setting (spawned server, offline engine)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="engine setting")
    parser.add_argument("--kv-cache-memory", help="engine setting, e.g. 1GiB")
    parser.add_argument("--block-size", type=int, help="engine setting")
    offline = parser.add_mutually_exclusive_group()
    offline.add_argument("--compare-offline", action="store_true", help="also run the offline engine here")
    offline.add_argument("--offline-tokens-per-s", type=float, help="offline output tok/s measured earlier")
    parser.add_argument(
        "--compare-tracing",
        action="store_true",
        help="with --spawn: run the workload on servers with tracing off, on (console exporter), off",
    )
    parser.add_argument(
        "--twin-server-arg",
        action="append",
        default=[],
        help="with --spawn: also start a twin server with this extra argument (repeatable) and alternate "
        "the rounds between the two",
    )
    parser.add_argument(
        "--lora-adapters",
        type=int,
        default=0,
        help="with --spawn: serve this many random LoRA adapters (bench/lora.py writes them) and send "
        "request i through adapter i %% (N + 1), the last slot the base model",
    )
    parser.add_argument(
        "--client-loop",
        choices=("uvloop", "asyncio"),
        default="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        help="this client's event loop (default: uvloop when installed; it takes less CPU a response)",
    )
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of --lora-adapters' adapters")
    parser.add_argument(
        "--engine-cores",
        type=_cpus,
        help="with --spawn: CPUs (e.g. 1 or 2-3) for the servers' engine and the offline engine, the "
        "others for the rest of the server and this client: a GPU host's layout (Linux)",
    )
    parser.add_argument("--json-out", help="also write the summary to this JSON file")
    args = parser.parse_args()
    args.lora_modules = None  # set by main() once --lora-adapters are written
    if args.lora_adapters and not args.spawn:
        parser.error("--lora-adapters starts its own server: add --spawn")
    if args.compare_tracing and not args.spawn:
        parser.error("--compare-tracing starts its own servers: add --spawn")
    if args.compare_tracing and args.rounds > 1:
        parser.error("--compare-tracing runs one round a server: leave out --rounds")
    if args.twin_server_arg and not args.spawn:
        parser.error("--twin-server-arg starts its own servers: add --spawn")
    if args.engine_cores is not None and not args.spawn:
        parser.error("--engine-cores places the servers it starts: add --spawn")
    if args.twin_server_arg and (args.compare_offline or args.offline_tokens_per_s or args.compare_tracing):
        parser.error(
            "--twin-server-arg compares two servers: leave out --compare-offline, "
            "--offline-tokens-per-s and --compare-tracing"
        )
    return args


def run_client(args: argparse.Namespace, load: Any) -> Any:
    """Run the load generator's coroutine on the event loop --client-loop names."""
    if args.client_loop == "uvloop":
        import uvloop

        return uvloop.run(load)
    return asyncio.run(load)


# -- tracing off / on ----------------------------------------------------------------------------------

TRACING_RUNS = (("off", []), ("on", ["--traces-exporter", "console"]), ("off", []))


def compare_tracing(args: argparse.Namespace, requests: list[BenchRequest]) -> list[dict[str, Any]]:
    """The workload on a fresh spawned server per run, tracing off, on, off."""
    rows = []
    for label, extra in TRACING_RUNS:
        server = SpawnedServer(args, extra)
        try:
            # one target, one round
            (one_round,) = run_client(args, benchmark(args, [server.target], requests, servers=[server]))
            records = one_round[0].records
        except Exception:
            print(server.tail(), file=sys.stderr)
            raise
        finally:
            server.stop()  # flushes the batched spans before exit
        summary = summarize(records)
        summary["tracing"] = label
        summary["num_spans_exported"] = server.log.read_text().count('"name": "llm_request"')
        rows.append(summary)
        print(f"tracing {label}: {summary['output_tokens_per_s']:.1f} output tok/s", flush=True)
    return rows


def print_tracing_table(rows: list[dict[str, Any]]) -> None:
    base = rows[0]["output_tokens_per_s"]
    print_table(
        ["run", "tracing", "failed", "server spans exported", "output tok/s", "vs first run"]
        + ["TTFT p50 (ms)", "TPOT p50 (ms)", "E2E p50 (ms)"],
        "llrrrrrrr",
        [
            [str(i), row["tracing"], str(row["num_failed"]), str(row["num_spans_exported"])]
            + [f"{row['output_tokens_per_s']:.1f}", f"{row['output_tokens_per_s'] / base:.3f}"]
            + [_ms(row["ttft_s"]["p50"]), _ms(row["tpot_s"]["p50"]), _ms(row["e2e_s"]["p50"])]
            for i, row in enumerate(rows, 1)
        ],
    )


# -- twin servers ---------------------------------------------------------------------------------------


def compare_twins(args: argparse.Namespace, requests: list[BenchRequest]) -> list[dict[str, Any]]:
    """The workload on two spawned servers loaded side by side, the second with --twin-server-arg as
    well, their rounds taking turns (ABBA): one setting against another at the same moments."""
    server_args = (args.server_arg, args.server_arg + args.twin_server_arg)
    servers = [SpawnedServer(args), SpawnedServer(args, args.twin_server_arg)]
    try:
        results = run_client(
            args,
            benchmark(args, [server.target for server in servers], requests, args.rounds, servers=servers),
        )
    except Exception:
        for server in servers:
            print(server.tail(), file=sys.stderr)
        raise
    finally:
        for server in servers:
            server.stop()
    rows = []
    for name, args_of_side, side in zip("AB", server_args, results):
        summary, _, failed = median_round(side)
        summary["server"] = name
        summary["server_args"] = args_of_side
        for error in sorted({r.error for r in failed if r.error})[:5]:
            print(f"server {name} error: {error}")
        rows.append(summary)
    return rows


def print_twin_table(rows: list[dict[str, Any]]) -> None:
    base = rows[0]["output_tokens_per_s"]
    print_table(
        [
            "server",
            "server arguments",
            "failed",
            "output tok/s, rounds",
            "median",
            "vs A",
            "tokens a response",
        ]
        + ["TTFT p50 (ms)", "TPOT p50 (ms)", "ITL p50 (ms)"],
        "llrlrrrrrr",
        [
            [row["server"], " ".join(row["server_args"]) or "(none)", str(row["num_failed_all_rounds"])]
            + [_figures(row["rounds_output_tokens_per_s"]), f"{row['output_tokens_per_s']:.1f}"]
            + [f"{row['output_tokens_per_s'] / base:.3f}"]
            + [f"{row['num_output_tokens'] / max(1, row['num_token_responses']):.2f}"]
            + [_ms(row["ttft_s"]["p50"]), _ms(row["tpot_s"]["p50"]), _ms(row["itl_s"]["p50"])]
            for row in rows
        ],
    )
    print("(median round of each server; rounds alternate A B B A ...)")


def main() -> int:
    args = parse_args()
    if args.engine_cores is not None:  # before any thread starts: they inherit it
        placement.pin_process(os.getpid(), placement.split(args.engine_cores)[1])
    requests = build_workload(args.workload, args.num_requests, args.seed)
    if args.lora_adapters:
        from lora import write_adapter
        from pagedserve.default_model import resolve_model_path

        model_dir, adapter_root = resolve_model_path(args.model), Path(tempfile.mkdtemp(prefix="lora-"))
        atexit.register(shutil.rmtree, adapter_root, ignore_errors=True)
        names = [f"a{i}" for i in range(args.lora_adapters)]
        args.lora_modules = ",".join(
            f"{name}={write_adapter(adapter_root / name, model_dir, args.lora_rank, seed=i)}"
            for i, name in enumerate(names)
        )
        requests = through_adapters(requests, names)
        print(
            f"{len(names)} LoRA adapters of rank {args.lora_rank}: request i through a(i % {len(names) + 1})"
        )
    rate = SATURATION if math.isinf(args.request_rate) else f"{args.request_rate}/s Poisson"
    print(
        f"workload {args.workload}: {len(requests)} requests, {sum(r.max_tokens for r in requests)} output "
        f"tokens forced; arrivals {rate}; concurrency {args.concurrency or 'unlimited'}; "
        f"{os.cpu_count()} CPU cores here; client loop {args.client_loop}, "
        f"GRPC_EXPERIMENTS={os.environ['GRPC_EXPERIMENTS']!r}",
        flush=True,
    )
    if args.compare_tracing:
        rows = compare_tracing(args, requests)
        print_tracing_table(rows)
        write_json(args.json_out, {"args": vars(args), "runs": rows})
        return 0 if all(row["num_failed"] == 0 for row in rows) else 1
    if args.twin_server_arg:
        rows = compare_twins(args, requests)
        print_twin_table(rows)
        write_json(args.json_out, {"args": vars(args), "servers": rows})
        return 0 if all(row["num_failed_all_rounds"] == 0 for row in rows) else 1
    server = SpawnedServer(args) if args.spawn else None
    target = server.target if server else args.target
    try:
        # loaded here while a spawned server loads
        offline_engine = OfflineEngine(args, requests) if args.compare_offline else None
        (results,) = run_client(
            args,
            benchmark(args, [target], requests, args.rounds, offline_engine, [server] if server else []),
        )
    except Exception:
        if server is not None:
            print(server.tail(), file=sys.stderr)
        raise
    finally:
        if server is not None:
            server.stop()
    summary, records, failed = median_round(results)
    summary["arrivals"] = rate
    summary["concurrency"] = args.concurrency
    offline = args.offline_tokens_per_s
    if offline_engine is not None:
        summary["offline_rounds_tokens_per_s"] = offline_engine.rates
        offline = statistics.median_low(offline_engine.rates)
    if offline:
        summary["offline_tokens_per_s"] = offline
        summary["share_of_offline"] = summary["output_tokens_per_s"] / offline
    print_summary(summary, [r.error for r in failed if r.error])
    write_json(
        args.json_out, {"args": vars(args), "summary": summary, "records": [asdict(r) for r in records]}
    )
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
