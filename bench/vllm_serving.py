"""vLLM's OpenAI server against vLLM's own offline engine on one workload: the serving bar that
bench/serving.py measures for pagedserve (the server's output throughput at saturation as a share of
its offline engine's), measured on the incumbent in the same way.

    python bench/vllm_serving.py --vllm-python VENV/bin/python --rounds 4
    python bench/vllm_serving.py --vllm-python VENV/bin/python --rounds 4 \
        --vllm-env VLLM_CPU_OMP_THREADS_BIND=0-1        # vLLM's worker on both cores of two

vLLM lives in a virtual environment of its own (`vllm`, or `vllm-cpu` on a CPU). This script starts
its OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`) on loopback and, beside
it, its offline engine (`LLM`, through bench/vllm_peer.py as for throughput.py's vllm peer). Every
request goes to `/v1/completions` as prompt token ids (the chat template applied here, as
throughput.py applies it for every peer), greedy, `ignore_eos`, its forced `max_tokens`, streamed;
`return_token_ids` makes each event say how many tokens it carries. All requests start at once
(saturation). Rounds alternate with the offline engine's in ABBA order, as in bench/serving.py, and
both sides empty their prefix cache before each round (the server through its development endpoint
`/reset_prefix_cache`). TTFT, TPOT, ITL and E2E are measured as bench/serving.py measures them, one
ITL gap an event carrying tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from serving import (
    SATURATION,
    SERVER_ENV,
    RequestRecord,
    free_port,
    median_round,
    output_tokens_per_s,
    print_summary,
    write_json,
)
from throughput import GREEDY, VllmRunner, add_vllm_arguments, check_vllm_arguments
from workloads import build_workload, prompt_token_ids


class VllmServer:
    """vLLM's OpenAI server on loopback, its log in a temp file."""

    def __init__(self, args: argparse.Namespace, model: str) -> None:
        self.port = free_port()
        command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", args.dtype]
        if args.device == "cpu":  # as throughput.py's vllm peer: vLLM's default 0.92 is more than is free
            command += ["--gpu-memory-utilization", "0.3"]
        command += args.vllm_server_arg
        env = SERVER_ENV | dict(item.partition("=")[::2] for item in args.vllm_env)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # for /reset_prefix_cache
        self.log = Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        print(f"spawning: {' '.join(command)} (log {self.log})", flush=True)
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    async def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM's server exited with status {self.proc.returncode}")
                try:
                    async with session.get(f"{self.url}/health") as reply:
                        if reply.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(1)
        raise TimeoutError(f"vLLM's server was not ready within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def tail(self) -> str:
        return self.log.read_text()[-3000:]


async def send(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int
) -> RequestRecord:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    record = RequestRecord(start=time.perf_counter(), num_prompt_tokens=len(prompt))
    try:
        async with session.post(f"{url}/v1/completions", json=body) as reply:
            if reply.status != 200:
                record.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
            async for line in reply.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                now = time.perf_counter()
                event = json.loads(line[6:])
                num_tokens = sum(len(choice.get("token_ids") or ()) for choice in event.get("choices", ()))
                if num_tokens:
                    record.token_times.append(now)
                    record.num_output_tokens += num_tokens
                if "error" in event:
                    record.error = str(event["error"])[:200]
    except aiohttp.ClientError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter()
    if not record.error and record.num_output_tokens != max_tokens:
        record.error = f"got {record.num_output_tokens} tokens, asked for {max_tokens}"
    return record


async def server_round(
    server: VllmServer, model: str, prompts: list[list[int]], lengths: list[int]
) -> tuple[list[RequestRecord], float]:
    """Every request at once on a session of its own (the server closes idle connections after a
    few seconds, and an offline round lies between two server rounds); this process's CPU time."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.post(f"{server.url}/reset_prefix_cache") as reply:
            if reply.status != 200:
                raise RuntimeError(f"/reset_prefix_cache: HTTP {reply.status}")
        start = os.times()
        records = await asyncio.gather(
            *(send(session, server.url, model, p, n) for p, n in zip(prompts, lengths, strict=True))
        )
        end = os.times()
    return list(records), end.user - start.user + end.system - start.system


async def benchmark(
    args: argparse.Namespace,
    server: VllmServer,
    offline: VllmRunner,
    model: str,
    prompts: list[list[int]],
    lengths: list[int],
) -> tuple[list[tuple[list[RequestRecord], float]], list[float]]:
    await server.wait_ready(args.ready_timeout)
    async with aiohttp.ClientSession() as session:  # untimed warm-up
        warmup = await asyncio.gather(*(send(session, server.url, model, prompts[0], 8) for _ in range(2)))
    if any(record.error for record in warmup):
        raise RuntimeError(f"warm-up request failed: {[r.error for r in warmup]}")
    results: list[tuple[list[RequestRecord], float]] = []
    offline_rates: list[float] = []

    def offline_round() -> None:  # blocks the loop, which has no call in flight then
        result = offline.run(prompts, lengths, GREEDY)  # as the server's requests are
        offline_rates.append(result.tokens_per_s)
        print(
            f"offline engine, round {len(offline_rates)}: {result.tokens_per_s:.1f} tok/s ({result.note})",
            flush=True,
        )

    for round_ in range(1, args.rounds + 1):
        if round_ % 2 == 0:
            offline_round()
        results.append(await server_round(server, model, prompts, lengths))
        print(f"round {round_}: {output_tokens_per_s(results[-1][0]):.1f} output tok/s", flush=True)
        if round_ % 2 == 1:
            offline_round()
    return results, offline_rates


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_vllm_arguments(parser, required=True)
    parser.add_argument("--workload", choices=("chat", "random"), default="chat")
    parser.add_argument("--num-requests", type=int, help="default: 64 (chat) or 256 (random)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random workload")
    parser.add_argument(
        "--model", help="local Hugging Face directory (default: embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where vLLM runs")
    parser.add_argument("--rounds", type=int, default=1, help="server and offline rounds, ABBA (default 1)")
    parser.add_argument(
        "--vllm-server-arg",
        action="append",
        default=[],
        help="an extra argument of vLLM's server (repeatable), e.g. --vllm-server-arg=--max-num-seqs=128; "
        "--vllm-arg gives the offline engine the same",
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--json-out", help="also write the summary to this JSON file")
    args = parser.parse_args()
    check_vllm_arguments(parser, args)
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")
    return args


def main() -> int:
    args = parse_args()
    from pagedserve.default_model import resolve_model_path
    from transformers import AutoTokenizer

    model = resolve_model_path(args.model)
    requests = build_workload(args.workload, args.num_requests, args.seed)
    prompts = prompt_token_ids(AutoTokenizer.from_pretrained(model), requests)
    lengths = [r.max_tokens for r in requests]
    print(
        f"workload {args.workload}: {len(requests)} requests, {sum(lengths)} output tokens forced; "
        f"arrivals {SATURATION}; {os.cpu_count()} CPU cores here; vLLM environment {' '.join(args.vllm_env)}",
        flush=True,
    )
    server = VllmServer(args, model)
    offline = None
    try:
        offline = VllmRunner(args, model)  # loads while the server loads
        results, offline_rates = asyncio.run(benchmark(args, server, offline, model, prompts, lengths))
    except Exception:
        print(server.tail(), file=sys.stderr)
        raise
    finally:
        server.stop()
        if offline is not None:
            offline.close()
    summary, records, failed = median_round(results)
    summary["arrivals"], summary["concurrency"] = SATURATION, None
    summary["offline_rounds_tokens_per_s"] = offline_rates
    summary["offline_tokens_per_s"] = statistics.median_low(offline_rates)
    summary["share_of_offline"] = summary["output_tokens_per_s"] / summary["offline_tokens_per_s"]
    print(f"vLLM {offline.version}")
    print_summary(summary, [r.error for r in failed if r.error])
    write_json(args.json_out, {"args": vars(args), "summary": summary})
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
