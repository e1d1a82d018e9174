"""Client churn against a tensor-parallel server leaves no per-request state behind on any rank.

Every rank's model runner holds a block-table row and sampling state per request, dropped when rank
0's step plan lists the request in `freed_request_ids`. Rank 1's tables are not visible from here, so
the check is black-box: `pagedserve serve --tensor-parallel-size 2` on the tiny model, with
--max-num-seqs 4 and a KV pool small enough that requests are preempted (by swap while the CPU pool
has room, else by recompute), goes through rounds of churn over real clients: streams cancelled
after 0, 1 or several responses, n = 3 requests and seeded n = 2 requests with penalties (whose
runners keep token histories) cancelled mid-way, deadlines, the Abort RPC (n = 1 and n = 3), a
channel closed under an open stream, a duplicate request id, requests that fail validation, a
completion cut at a stop string, deep health probes, and a REST `/generate_stream` client that
hangs up. After each round:

- the engine is idle (Health: nothing running or waiting, no KV block in use);
- a full batch of max_num_seqs greedy requests runs, each equal token for token to the same prompt
  on a quiet single-rank engine: a row leaked on any rank makes such a batch fail ('no free
  block-table row') or desynchronizes the ranks;

and at the end the log holds no ERROR or traceback line, and SIGTERM drains the requests in flight,
exits 0 and leaves no rank process behind.
"""

from __future__ import annotations

import json
import random
import signal
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_helpers import ServerProcess, metric_sample, request, wait_until
from pagedserve import LLM, SamplingParams
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.rpc.v1 import generate_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

MODEL = "tiny"
MAX_NUM_SEQS = 4
BLOCK_SIZE = 8
NUM_KV_BLOCKS = 24  # 192 tokens: neither a full batch nor four churn requests fit, so they preempt
NUM_CPU_BLOCKS = 8  # room to swap out one victim; the next ones are recomputed
BATCH_MAX_TOKENS = 40
LONG_PROMPT = "Once upon a time, " * 8  # 41 tokens: 6 blocks
LONG_MAX_TOKENS = 120  # 21 blocks with its prompt: outlives every churn client here
DEADLINE_MAX_TOKENS = 180  # 23 blocks with "Hello": at 4 ms a step or more (measured), well past 0.3 s
NUM_ROUNDS = 3
CALL_TIMEOUT_S = 30.0  # any call here takes a few seconds at most
IDLE_TIMEOUT_S = 15.0

_rng = random.Random(20250101)
# distinct prompts of 9..32 tokens: each full batch runs prompts no request has run before
BATCH_PROMPTS = [
    [1, *(_rng.randrange(100, 40000) for _ in range(_rng.randrange(8, 32)))]
    for _ in range(MAX_NUM_SEQS * NUM_ROUNDS)
]


def start(tiny_llama_dir: str, tmp_path: Path) -> ServerProcess:
    return ServerProcess(
        "--model", tiny_llama_dir, "--served-model-name", MODEL, "--dtype", "float32",
        "--device", "cpu", "--tensor-parallel-size", "2", "--max-num-seqs", str(MAX_NUM_SEQS),
        "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS),
        "--num-cpu-kv-blocks", str(NUM_CPU_BLOCKS), "--preemption-mode", "swap",
        "--log-level", "debug",  # each preemption's line, by swap or by recompute (a warning only every 50th)
        log=tmp_path / "server.log",
    ).wait_ready()  # fmt: skip


def long_request(request_id: str = "", n: int = 1) -> pb.GenerateRequest:
    return request(LONG_PROMPT, LONG_MAX_TOKENS, request_id, n=n)


def ids_request(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    params = pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params)


# -- churn clients: each returns what it saw, for the failure message ----------------------------------


def cancel_after(stub: pb_grpc.GenerationStub, num_responses: int, n: int = 1) -> str:
    call = stub.Generate(long_request(n=n), timeout=CALL_TIMEOUT_S)
    for _ in range(num_responses):
        next(call)
    call.cancel()
    return f"cancelled after {num_responses} (n={n})"


def deadline(stub: pb_grpc.GenerationStub) -> str:
    with pytest.raises(grpc.RpcError) as info:
        for _ in stub.Generate(request("Hello", DEADLINE_MAX_TOKENS), timeout=0.3):
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
    return "deadline"


def sampled_cancelled(stub: pb_grpc.GenerationStub) -> str:
    """Seeded sampling with penalties and logprobs, n = 2: the runners keep token histories for it."""
    sampled = request(
        LONG_PROMPT, LONG_MAX_TOKENS, temperature=0.8, seed=7, repetition_penalty=1.2, logprobs=2, n=2
    )
    call = stub.Generate(sampled, timeout=CALL_TIMEOUT_S)
    for _ in range(12):
        next(call)
    call.cancel()
    return "sampled, cancelled"


def stopped(stub: pb_grpc.GenerationStub) -> str:
    """Read to the end of a completion cut at a stop string (the detokenizer ends it, not the runner)."""
    responses = list(stub.Generate(request(LONG_PROMPT, 64, stop=["e"]), timeout=CALL_TIMEOUT_S))
    return f"stopped: {pb.FinishReason.Name(responses[-1].finish_reason)}"


def deep_health(stub: pb_grpc.GenerationStub) -> str:
    reply = stub.Health(pb.HealthRequest(deep=True), timeout=CALL_TIMEOUT_S)
    assert reply.ready, reply
    return "deep health"


def abort_rpc(stub: pb_grpc.GenerationStub, request_id: str, n: int = 1) -> str:
    call = stub.Generate(long_request(request_id, n), timeout=CALL_TIMEOUT_S)
    next(call)
    reply = stub.Abort(pb.AbortRequest(request_ids=[request_id, "never-was"]), timeout=CALL_TIMEOUT_S)
    assert list(reply.aborted_request_ids) == [request_id]
    try:
        rest = list(call)
    except grpc.RpcError as exc:  # how a front end ends an aborted stream is not this test's concern
        return f"abort rpc: {exc.code()}"
    assert len(rest) < LONG_MAX_TOKENS  # it did not run to the end
    return "abort rpc"


def closed_channel(port: int) -> str:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = pb_grpc.GenerationStub(channel).Generate(long_request(n=2), timeout=CALL_TIMEOUT_S)
    next(call)
    channel.close()
    return "channel closed"


INVALID = [
    request(temperature=-1.0),
    request(n=MAX_NUM_SEQS + 1),
    request(max_tokens=100000),
    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**9])),
    ids_request([1, *range(100, 1100)], 8),  # longer than the context
]


def invalid(stub: pb_grpc.GenerationStub, bad: pb.GenerateRequest) -> str:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(bad, timeout=CALL_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    return "invalid"


def duplicate_id(stub: pb_grpc.GenerationStub, request_id: str) -> str:
    call = stub.Generate(long_request(request_id), timeout=CALL_TIMEOUT_S)
    next(call)
    try:
        invalid(stub, long_request(request_id))
    finally:
        call.cancel()
    return "duplicate id"


def rest_hang_up(http_port: int) -> str:
    body = json.dumps(
        {
            "text_input": LONG_PROMPT,
            "parameters": {"max_tokens": LONG_MAX_TOKENS, "ignore_eos": True, "temperature": 0},
        }
    ).encode()
    head = (
        f"POST /v2/models/{MODEL}/generate_stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", http_port), timeout=CALL_TIMEOUT_S) as sock:
        sock.sendall(head.encode() + body)
        received = b""
        while b"data: " not in received:  # its first token arrived: the request runs in the engine
            chunk = sock.recv(65536)
            assert chunk, f"the server closed the connection: {received!r}"
            received += chunk
        assert received.startswith(b"HTTP/1.1 200"), received
    return "rest hang-up"


def churn(proc: ServerProcess, round_index: int) -> list[str]:
    stub = proc.stub
    clients: list[Callable[[], str]] = [
        lambda: cancel_after(stub, 0),
        lambda: cancel_after(stub, 1),
        lambda: cancel_after(stub, 5),
        lambda: cancel_after(stub, 40),
        lambda: cancel_after(stub, 30, n=3),
        lambda: deadline(stub),
        lambda: abort_rpc(stub, f"abort-{round_index}"),
        lambda: abort_rpc(stub, f"abort-n-{round_index}", n=3),
        lambda: sampled_cancelled(stub),
        lambda: stopped(stub),
        lambda: deep_health(stub),
        lambda: closed_channel(proc.port),
        lambda: duplicate_id(stub, f"dup-{round_index}"),
        lambda: rest_hang_up(proc.http_port),
        *(lambda bad=bad: invalid(stub, bad) for bad in INVALID),
    ]
    with ThreadPoolExecutor(max_workers=len(clients)) as pool:
        futures = [pool.submit(client) for client in clients]
        try:
            return [f.result() for f in futures]
        except grpc.RpcError as exc:
            pytest.fail(f"a churn client failed: {exc.code()} {exc.details()}\n{error_lines(proc.log)}")


# -- checks ----------------------------------------------------------------------------------------------


def full_batch(proc: ServerProcess, prompts: list[list[int]]) -> list[list[int]]:
    """max_num_seqs requests at once, read to the end. A rank that lost rows cannot take them on: its
    step fails and the ranks fall out of step (rank 0 waits in a collective) until a deadline."""

    def run(prompt: list[int]) -> list[int]:
        responses = proc.stub.Generate(ids_request(prompt, BATCH_MAX_TOKENS), timeout=CALL_TIMEOUT_S)
        return [t for r in responses for t in r.token_ids]

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        try:
            return list(pool.map(run, prompts))
        except grpc.RpcError as exc:
            pytest.fail(f"a full batch failed: {exc.code()} {exc.details()}\n{error_lines(proc.log)}")


def error_lines(log: Path) -> str:
    """ERROR records, tracebacks and the exceptions they end with, of every rank."""
    marks = (" ERROR ", "Traceback", "Error:")
    return "\n".join(line for line in log.read_text().splitlines() if any(m in line for m in marks))


def single_rank_outputs(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=256, block_size=BLOCK_SIZE)
    greedy = SamplingParams(temperature=0.0, max_tokens=BATCH_MAX_TOKENS, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(prompts, greedy)]


def is_alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_client_churn_leaves_no_state_on_any_rank(tiny_llama_dir: str, tmp_path: Path) -> None:
    expected = single_rank_outputs(tiny_llama_dir, BATCH_PROMPTS)
    proc = start(tiny_llama_dir, tmp_path)
    log = tmp_path / "server.log"
    try:
        ranks = proc.rank_processes()
        assert len(ranks) == 1, ranks
        for round_index in range(NUM_ROUNDS):
            seen = churn(proc, round_index)
            assert proc.engine_idle(IDLE_TIMEOUT_S), f"round {round_index} ({seen}) left the engine busy"
            prompts = BATCH_PROMPTS[MAX_NUM_SEQS * round_index : MAX_NUM_SEQS * (round_index + 1)]
            outputs = full_batch(proc, prompts)
            for i, (got, want) in enumerate(zip(outputs, expected[MAX_NUM_SEQS * round_index :])):
                assert got == want, f"round {round_index}, request {i}: {got} != single-rank {want}"
            assert proc.engine_idle(IDLE_TIMEOUT_S)
        aborts = metric_sample(proc.http_port, "pagedserve:request_aborts_total", cause="client_cancel")
        assert aborts >= NUM_ROUNDS * 5  # the churn did reach the engine
        text = log.read_text()
        assert "by swapping" in text and "by recompute" in text, "the rounds should preempt both ways"

        # SIGTERM with requests in flight: they finish, the server exits 0, rank 1 with it
        calls = [
            proc.stub.Generate(ids_request(p, BATCH_MAX_TOKENS), timeout=CALL_TIMEOUT_S) for p in prompts
        ]
        for call in calls:
            next(call)
        proc.proc.send_signal(signal.SIGTERM)
        drained = [[t for r in call for t in r.token_ids] for call in calls]
        assert drained == [want[1:] for want in expected[-MAX_NUM_SEQS:]]
        assert proc.proc.wait(timeout=60) == 0
        assert wait_until(lambda: not any(is_alive(r) for r in ranks), 10.0), ranks
    finally:
        proc.stop()
    assert not error_lines(log)
