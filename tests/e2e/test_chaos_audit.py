"""Many misbehaving clients at once against one real server, then nothing left behind.

For a few seconds, seeded asyncio clients drive one in-process server (tiny model, a KV cache small
enough that requests are preempted, by swap or by recompute) over every front end at once: our
`Generate` streams (greedy and seeded, n = 1..3, stop strings; structured outputs with prompt
logprobs and logit controls) read to the end, cancelled after k
responses, cut by short deadlines, aborted by id together with finished and unknown ids, dropped with
their channel, or duplicated while running; Triton `ModelStreamInfer` / `ModelInfer` through
`tritonclient.grpc.aio`, some cancelled or timed out; KServe REST `/generate_stream` and `/infer`, some
connections dropped; a client process SIGKILLed with its streams open; garbage requests over every
protocol; deep health probes and `/metrics` scrapes throughout.

Once the server is idle: every greedy completion read to the end equals a quiet run of the same
request alone; every per-request table of every layer (async engine, engine, scheduler, block
manager, model runner, metrics) is empty and every KV and swap block free; each admitted request is
counted exactly once, as finished or aborted; a normal request is still served at once; and a second
identical round grows neither those tables nor the process.

A second, shorter chaos does the same to beam searches (cancelled, timed out by a gRPC deadline or
Triton's request timeout, aborted by id, dropped over REST, or read to the end) beside plain requests.

The focused tests below reproduce, one at a time, what the chaos found.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import logging
import random
import re
import sys
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import aiohttp
import grpc
import numpy as np
import psutil
import pytest
import tritonclient.grpc.aio as triton_aio
from inprocess_server import InProcessServer, Samples, parse_metrics, scrape, wait_for
from pagedserve.engine.async_engine import in_torch_thread
from pagedserve.engine.core_process import EngineFace
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import RequestDelta
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.rpc.v1 import generate_pb2_grpc as pb_grpc
from pagedserve_adapters.llm_model import LLMModel, LLMRequest, Tensor, parse_request
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

MODEL = "tiny"
SEED = 20240611
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 32  # 512 tokens: three 150-token requests fill it, so requests are preempted
NUM_CPU_BLOCKS = 48
MAX_NUM_SEQS = 16
CHAOS_S = 9.0  # per round (every kind of client runs in it: OUTCOMES)
BEAM_CHAOS_S = 8.0
LONG_MAX_TOKENS = 200  # 13 blocks with its prompt: outlives k responses and any short deadline here
GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_swapped",
    "vllm:kv_cache_usage_perc",
)

_pool = random.Random(SEED)
ID_PROMPTS = [[1, *(_pool.randrange(100, 40000) for _ in range(_pool.randrange(5, 60)))] for _ in range(8)]
TEXT_PROMPTS = ["The capital of France is", "Water boils at", "Once upon a time", "1, 2, 3, 4,"]
STOPS: list[list[str]] = [[], [], ["e"], ["the", "\n"]]
MAX_TOKENS = [8, 24, 64, 120]

# (prompt kind "ids" or "text", prompt, max_tokens, stop, ignore_eos) of a greedy request
GreedyKey = tuple[str, Any, int, tuple[str, ...], bool]
# (prompt token ids, beam width, max_tokens) of a beam search read to the end
BeamKey = tuple[tuple[int, ...], int, int]

# A client process holding two streams open, unread, until it is SIGKILLed: its connection vanishes.
KILLED_CLIENT = r"""
import sys, threading, grpc
from pagedserve.rpc.v1 import generate_pb2 as pb, generate_pb2_grpc as pb_grpc
port, num_streams, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
started = threading.Semaphore(0)
def hold(i):
    params = pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for _ in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 500 + i]), sampling=params)):
        started.release()
        threading.Event().wait()
for i in range(num_streams):
    threading.Thread(target=hold, args=(i,), daemon=True).start()
for _ in range(num_streams):
    started.acquire()
print("streaming", flush=True)
threading.Event().wait()
"""


@dataclass
class Ledger:
    """What the clients saw, over every round."""

    greedy: dict[GreedyKey, list[tuple[list[int] | None, str]]] = field(default_factory=dict)
    finished_ids: list[str] = field(default_factory=list)  # our ids of requests read to the end
    problems: list[str] = field(default_factory=list)  # outcomes no client should see
    outcomes: Counter[str] = field(default_factory=Counter)
    beams: dict[BeamKey, list[list[list[int]]]] = field(default_factory=dict)  # searches read to the end

    def record_greedy(self, key: GreedyKey, token_ids: list[int] | None, text: str) -> None:
        self.greedy.setdefault(key, []).append((token_ids, text))


@dataclass
class Clients:
    """One round's connections, and where its clients report."""

    server: InProcessServer
    stub: pb_grpc.GenerationStub
    triton: triton_aio.InferenceServerClient
    http: aiohttp.ClientSession
    ledger: Ledger
    deadline: float
    round_tag: str
    ids: Counter[str] = field(default_factory=Counter)

    def new_id(self, kind: str) -> str:
        self.ids[kind] += 1
        return f"{self.round_tag}-{kind}-{self.ids[kind]}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def prioritized(self, request: pb.GenerateRequest, rng: random.Random) -> pb.GenerateRequest:
        """Under --scheduling-policy priority, a random priority (more urgent ones preempt the rest)."""
        if self.server.settings.scheduling_policy == "priority":
            request.priority = rng.randrange(-2, 3)
        return request


# -- requests -------------------------------------------------------------------------------------------


def greedy_request(rng: random.Random, n: int, request_id: str) -> tuple[pb.GenerateRequest, GreedyKey]:
    prompt = rng.choice(ID_PROMPTS)
    max_tokens, stop, ignore_eos = rng.choice(MAX_TOKENS), rng.choice(STOPS), rng.random() < 0.5
    params = pb.SamplingParameters(
        max_tokens=max_tokens, temperature=0.0, stop=stop, ignore_eos=ignore_eos, n=n
    )
    request = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt), sampling=params)
    return request, ("ids", tuple(prompt), max_tokens, tuple(stop), ignore_eos)


def long_request(rng: random.Random, request_id: str = "", n: int = 1) -> pb.GenerateRequest:
    params = pb.SamplingParameters(max_tokens=LONG_MAX_TOKENS, temperature=0.0, ignore_eos=True, n=n)
    prompt = rng.choice(ID_PROMPTS)[:20]
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt), sampling=params)


def text_key(rng: random.Random, long: bool = False) -> GreedyKey:
    max_tokens = LONG_MAX_TOKENS if long else rng.choice(MAX_TOKENS)
    stop = () if long else tuple(rng.choice(STOPS))
    return ("text", rng.choice(TEXT_PROMPTS), max_tokens, stop, True)


def sampling_json(key: GreedyKey) -> dict[str, Any]:
    _, _, max_tokens, stop, ignore_eos = key
    return {"temperature": 0, "max_tokens": max_tokens, "stop": list(stop), "ignore_eos": ignore_eos}


def completions(responses: list[pb.GenerateResponse], n: int) -> tuple[list[list[int]], list[str], list[int]]:
    """Token ids, text and finish reason of each of the n completions of a stream's responses."""
    token_ids: list[list[int]] = [[] for _ in range(n)]
    texts, reasons = [""] * n, [0] * n
    for r in responses:
        token_ids[r.index].extend(r.token_ids)
        texts[r.index] += r.text
        reasons[r.index] = r.finish_reason or reasons[r.index]
    return token_ids, texts, reasons


GARBAGE_GRPC = [
    pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(temperature=-1.0)),
    pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(top_p=2.0)),
    pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(n=0)),
    pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(max_tokens=0)),
    pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(max_tokens=100000)),
    pb.GenerateRequest(text=""),
    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**9])),
    pb.GenerateRequest(text="hi", model="not-this-model"),
    pb.GenerateRequest(text="hi", request_id="bad\nid"),
]
GARBAGE_REST: list[tuple[str, Any]] = [
    ("generate_stream", b"{not json"),
    ("generate_stream", {"text_input": "hi", "parameters": {"temperature": -1}}),
    ("generate_stream", {"text_input": "hi", "parameters": {"max_tokens": "many"}}),
    ("generate", {"parameters": {"max_tokens": 4}}),
    ("infer", {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}]}),
    ("infer", {"inputs": "nope"}),
]


# -- our Generate -----------------------------------------------------------------------------------------


async def generate_to_the_end(c: Clients, rng: random.Random) -> None:
    """Greedy, n = 1..3, stop strings or none: every completion is checked against a quiet run."""
    n = rng.choice([1, 1, 2, 3])
    rid = c.new_id("full")
    request, key = greedy_request(rng, n, rid)
    responses = [r async for r in c.stub.Generate(c.prioritized(request, rng), timeout=120)]
    token_ids, texts, reasons = completions(responses, n)
    for i in range(n):
        if reasons[i] not in (pb.LENGTH, pb.STOP, pb.EOS) or len(token_ids[i]) > key[2]:
            c.ledger.problems.append(f"{rid}#{i}: finish reason {reasons[i]}, {len(token_ids[i])} tokens")
        c.ledger.record_greedy(key, token_ids[i], texts[i])
    c.ledger.finished_ids.append(rid)
    c.ledger.outcomes["grpc_full"] += 1


async def generate_seeded(c: Clients, rng: random.Random) -> None:
    """Random sampling with a seed, read to the end: it ends properly within max_tokens."""
    n = rng.choice([1, 2])
    max_tokens = rng.choice(MAX_TOKENS)
    params = pb.SamplingParameters(max_tokens=max_tokens, temperature=0.8, seed=rng.randrange(1000), n=n)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=rng.choice(ID_PROMPTS)), sampling=params)
    token_ids, _, reasons = completions([r async for r in c.stub.Generate(request, timeout=120)], n)
    for i in range(n):
        if reasons[i] not in (pb.LENGTH, pb.STOP, pb.EOS) or len(token_ids[i]) > max_tokens:
            c.ledger.problems.append(f"seeded #{i}: finish reason {reasons[i]}, {len(token_ids[i])} tokens")
    c.ledger.outcomes["grpc_seeded"] += 1


async def cancel_after_k(c: Clients, rng: random.Random) -> None:
    call = c.stub.Generate(c.prioritized(long_request(rng, n=rng.choice([1, 2])), rng), timeout=120)
    k, received = rng.randrange(0, 6), 0
    while received < k and await call.read() is not grpc.aio.EOF:
        received += 1
    call.cancel()
    c.ledger.outcomes["grpc_cancel"] += 1


async def short_deadline(
    c: Clients,
    rng: random.Random,
    request: Callable[[random.Random], pb.GenerateRequest] = long_request,
    outcome: str = "grpc_deadline",
) -> None:
    """A long request (`request` makes it: a beam search's too) cut by a gRPC deadline."""
    timeout = rng.choice([0.01, 0.05, 0.2, 0.5])
    try:  # under this load it cannot finish in time; if it did, nothing is wrong either
        async for _ in c.stub.Generate(request(rng), timeout=timeout):
            pass
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            c.ledger.problems.append(f"{outcome} {timeout}: {exc.code()} {exc.details()}")
    c.ledger.outcomes[outcome] += 1


CONSTRAINTS = [
    (pb.StructuredOutputs(regex=r"[0-9]{2,6}"), re.compile(r"[0-9]{2,6}")),
    (pb.StructuredOutputs(choice=pb.Choices(choices=["left", "right", "up"])), re.compile("left|right|up")),
    (pb.StructuredOutputs(grammar='root ::= "<" [a-z]+ ">"'), re.compile("<[a-z]+>")),
]


async def constrained(c: Clients, rng: random.Random) -> None:
    """Structured outputs, prompt logprobs, logit controls, mixed: read to the end, the text matches its
    constraint; or cancelled after k responses."""
    structured, pattern = rng.choice(CONSTRAINTS)
    prompt = rng.choice(ID_PROMPTS)
    params = pb.SamplingParameters(
        max_tokens=rng.choice([6, 12, 40]),
        temperature=rng.choice([0.0, 0.8]),
        structured_outputs=structured,
        prompt_logprobs=rng.choice([0, 3]),
        bad_words=["zz"],
        logit_bias={rng.randrange(100, 40000): 5.0},
        n=rng.choice([1, 2]),
    )
    request = c.prioritized(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params), rng)
    call = c.stub.Generate(request, timeout=120)
    if int(c.new_id("constrained").rsplit("-", 1)[1]) % 2 == 0:  # every other one, so both kinds run
        await call.read()
        call.cancel()
        c.ledger.outcomes["grpc_constrained_cancel"] += 1
        return
    responses = [r async for r in call]
    _, texts, reasons = completions(responses, params.n)
    first = [r for r in responses if r.index == 0][0]
    if len(first.prompt_logprobs) != len(prompt) - 1:
        c.ledger.problems.append(f"constrained: {len(first.prompt_logprobs)} prompt logprobs")
    for text, reason in zip(texts, reasons, strict=True):
        done = reason == pb.EOS  # the grammar completed; LENGTH may cut it short
        if reason not in (pb.EOS, pb.LENGTH) or (done and not pattern.fullmatch(text)):
            c.ledger.problems.append(f"constrained {structured}: {reason} {text!r}")
    c.ledger.outcomes["grpc_constrained"] += 1


async def abort_by_id(c: Clients, rng: random.Random) -> None:
    """Abort a live request by id, with an unknown id and ids of requests already finished: only the
    live one is reported aborted, and its stream then ends with ABORTED."""
    rid = c.new_id("abort")
    call = c.stub.Generate(c.prioritized(long_request(rng, rid), rng), timeout=120)
    responses = [await call.read() for _ in range(rng.randrange(1, 6))]
    finished = c.ledger.finished_ids[-2:]
    reply = await c.stub.Abort(pb.AbortRequest(request_ids=[rid, c.new_id("unknown"), *finished]))
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    _, _, reasons = completions(responses, 1)
    if list(reply.aborted_request_ids) != [rid] or reasons[0] != pb.ABORTED:
        c.ledger.problems.append(
            f"Abort({rid}, unknown, {finished}): reported {list(reply.aborted_request_ids)}, ended {reasons[0]}"
        )
    c.ledger.outcomes["grpc_abort"] += 1


async def drop_channel(c: Clients, rng: random.Random) -> None:
    """A client that closes its whole channel, with two streams on it, mid-stream."""
    async with grpc.aio.insecure_channel(c.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        calls = [stub.Generate(long_request(rng, n=rng.choice([1, 2])), timeout=120) for _ in range(2)]
        await calls[0].read()
    c.ledger.outcomes["grpc_drop_channel"] += 1


async def duplicate_id(c: Clients, rng: random.Random) -> None:
    """A second request under the id of one still running is refused; the first goes on unharmed."""
    rid = c.new_id("dup")
    request = long_request(rng, rid)
    call = c.stub.Generate(request, timeout=120)
    responses = [await call.read()]
    try:
        async for _ in c.stub.Generate(greedy_request(rng, 1, rid)[0], timeout=30):
            pass
        c.ledger.problems.append(f"duplicate {rid} was accepted")
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
            c.ledger.problems.append(f"duplicate {rid}: {exc.code()} {exc.details()}")
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    token_ids, texts, reasons = completions(responses, 1)
    if reasons[0] != pb.LENGTH:
        c.ledger.problems.append(f"{rid}, duplicated: finish reason {reasons[0]}")
    c.ledger.record_greedy(
        ("ids", tuple(request.token_ids.ids), LONG_MAX_TOKENS, (), True), token_ids[0], texts[0]
    )
    c.ledger.finished_ids.append(rid)
    c.ledger.outcomes["grpc_duplicate"] += 1


async def garbage(c: Clients, rng: random.Random) -> None:
    """Invalid requests over every protocol: refused naming the problem, disturbing nobody."""
    request = rng.choice(GARBAGE_GRPC)
    try:
        async for _ in c.stub.Generate(request, timeout=30):
            pass
        c.ledger.problems.append(f"garbage accepted: {request}")
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
            c.ledger.problems.append(f"garbage {request}: {exc.code()} {exc.details()}")
    route, body = rng.choice(GARBAGE_REST)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with c.http.post(c.server.http_url(f"/v2/models/{MODEL}/{route}"), data=data) as reply:
        if reply.status != 400:
            c.ledger.problems.append(f"REST garbage {route} {body!r}: HTTP {reply.status}")
    try:
        await c.triton.infer(MODEL, [text_input("hi"), sampling_input({"temperature": "hot"})])
        c.ledger.problems.append("Triton garbage accepted")
    except InferenceServerException as exc:
        if exc.status() != "StatusCode.INVALID_ARGUMENT":
            c.ledger.problems.append(f"Triton garbage: {exc.status()} {exc.message()}")
    c.ledger.outcomes["garbage"] += 1
    await asyncio.sleep(0.05)  # a steady trickle, not a busy loop that starves the server of CPU


# -- Triton (tritonclient.grpc.aio) -------------------------------------------------------------------------


def text_input(prompt: str) -> InferInput:
    tensor = InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    return tensor


def sampling_input(params: dict[str, Any]) -> InferInput:
    tensor = InferInput("sampling_parameters", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
    return tensor


def flag_input(name: str) -> InferInput:
    tensor = InferInput(name, [1], "BOOL")
    tensor.set_data_from_numpy(np.array([True]))
    return tensor


async def triton_stream(c: Clients, rng: random.Random, cancel: bool) -> None:
    """Two requests on one decoupled stream, read to the end or cancelled after k responses."""
    cancel_at = rng.choice([1, 3]) if cancel else None
    keys = [text_key(rng, long=cancel_at is not None) for _ in range(2)]
    all_final = asyncio.Event()

    async def requests() -> AsyncIterator[dict[str, Any]]:
        for i, key in enumerate(keys):
            inputs = [text_input(key[1]), flag_input("stream"), sampling_input(sampling_json(key))]
            yield {"model_name": MODEL, "inputs": inputs, "request_id": str(i)}
        await all_final.wait()  # then half-close: the server ends the stream

    stream = c.triton.stream_infer(requests())
    texts, num_final, received = ["", ""], 0, 0
    async for result, error in stream:
        if error is not None:
            c.ledger.problems.append(f"Triton stream error: {error}")
            break
        response = result.get_response()
        texts[int(response.id)] += result.as_numpy("text_output")[0].decode()
        received += 1
        if received == cancel_at:
            stream.cancel()
            break
        num_final += response.parameters["triton_final_response"].bool_param
        if num_final == len(keys):
            all_final.set()
    if cancel_at is None:
        for key, text in zip(keys, texts, strict=True):
            c.ledger.record_greedy(key, None, text)
    c.ledger.outcomes["triton_stream" if cancel_at is None else "triton_stream_cancel"] += 1


async def triton_unary(c: Clients, rng: random.Random, timeout: float | None) -> None:
    """ModelInfer: the whole completion, or a client timeout that leaves the server to abort it."""
    key = text_key(rng, long=timeout is not None)
    inputs = [text_input(key[1]), sampling_input(sampling_json(key)), flag_input("exclude_input_in_output")]
    try:
        result = await c.triton.infer(MODEL, inputs, client_timeout=timeout)
    except InferenceServerException as exc:
        if timeout is None or exc.status() != "StatusCode.DEADLINE_EXCEEDED":
            c.ledger.problems.append(f"Triton infer: {exc.status()} {exc.message()}")
        c.ledger.outcomes["triton_unary_timeout"] += 1
        return
    c.ledger.record_greedy(key, None, result.as_numpy("text_output")[0].decode())
    c.ledger.outcomes["triton_unary"] += 1


# -- KServe REST (aiohttp) -------------------------------------------------------------------------------


async def rest_stream(c: Clients, rng: random.Random, drop: bool) -> None:
    """/generate_stream read to the end, or its connection dropped after k events."""
    drop_at = rng.choice([1, 4]) if drop else None
    key = text_key(rng, long=drop_at is not None)
    body = {"text_input": key[1], "parameters": sampling_json(key)}
    text, num_events = "", 0
    # a connection of its own, so that dropping it drops nobody else's requests
    async with (
        aiohttp.ClientSession() as session,
        session.post(c.server.http_url(f"/v2/models/{MODEL}/generate_stream"), json=body) as reply,
    ):
        assert reply.status == 200, await reply.text()
        async for line in reply.content:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                c.ledger.problems.append(f"generate_stream error: {event['error']}")
            text += event.get("text_output", "")
            num_events += 1
            if num_events == drop_at:
                connection = reply.connection  # None once the whole response is in
                if connection is not None and connection.transport is not None:
                    connection.transport.abort()  # no FIN handshake: the peer just vanishes
                break
    if drop_at is None:
        c.ledger.record_greedy(key, None, text)
    c.ledger.outcomes["rest_stream" if drop_at is None else "rest_stream_drop"] += 1


async def rest_infer(c: Clients, rng: random.Random, timeout: float | None) -> None:
    """/infer read whole, or the client giving up after a short timeout."""
    key = text_key(rng, long=timeout is not None)
    inputs = [
        {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [key[1]]},
        {
            "name": "sampling_parameters",
            "datatype": "BYTES",
            "shape": [1],
            "data": [json.dumps(sampling_json(key))],
        },
        {"name": "exclude_input_in_output", "datatype": "BOOL", "shape": [1], "data": [True]},
    ]
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.post(c.server.http_url(f"/v2/models/{MODEL}/infer"), json={"inputs": inputs}) as reply,
        ):
            doc = await reply.json()
    except TimeoutError:
        c.ledger.outcomes["rest_infer_timeout"] += 1
        return
    if reply.status != 200:
        c.ledger.problems.append(f"/infer: HTTP {reply.status}: {doc}")
        return
    c.ledger.record_greedy(
        key, None, next(o["data"][0] for o in doc["outputs"] if o["name"] == "text_output")
    )
    c.ledger.outcomes["rest_infer"] += 1


# -- probes and the killed client process -------------------------------------------------------------------


async def probe(c: Clients, rng: random.Random) -> None:
    """A deep health check and a /metrics scrape: ready, and no gauge ever out of range."""
    health = await c.stub.Health(pb.HealthRequest(deep=True), timeout=60)
    if not health.ready:
        c.ledger.problems.append(f"deep health check not ready: {health}")
    async with c.http.get(c.server.http_url("/metrics")) as reply:
        samples = parse_metrics(await reply.text())
    for (name, _), value in samples.items():
        if name in GAUGES and not 0 <= value <= (
            1 if name == "vllm:kv_cache_usage_perc" else MAX_NUM_SEQS * 8
        ):
            c.ledger.problems.append(f"gauge {name} = {value}")
    c.ledger.outcomes["probe"] += 1
    await asyncio.sleep(0.2)


async def kill_client_processes(c: Clients) -> None:
    while time.monotonic() < c.deadline:
        args = [str(c.server.port), "2", str(LONG_MAX_TOKENS)]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", KILLED_CLIENT, *args, stdout=asyncio.subprocess.PIPE
        )
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)  # type: ignore[union-attr]
            if line.strip() != b"streaming":
                c.ledger.problems.append(f"client process said {line!r}")
        finally:
            proc.kill()
            await proc.wait()
        c.ledger.outcomes["killed_process"] += 1
        await asyncio.sleep(1.0)


Action = Callable[[Clients, random.Random], Awaitable[None]]
GRPC_ACTIONS: list[Action] = [
    generate_to_the_end,
    generate_to_the_end,
    generate_seeded,
    cancel_after_k,
    short_deadline,
    abort_by_id,
    drop_channel,
    duplicate_id,
    constrained,
]
TRITON_ACTIONS: list[Action] = [
    partial(triton_stream, cancel=False),
    partial(triton_stream, cancel=True),
    partial(triton_unary, timeout=None),
    partial(triton_unary, timeout=None),
    partial(triton_unary, timeout=0.05),
]
REST_ACTIONS: list[Action] = [
    partial(rest_stream, drop=False),
    partial(rest_stream, drop=True),
    partial(rest_stream, drop=True),
    partial(rest_infer, timeout=None),
    partial(rest_infer, timeout=None),
    partial(rest_infer, timeout=0.1),
]
WORKERS: list[list[Action]] = [
    *[GRPC_ACTIONS] * 4,
    *[TRITON_ACTIONS] * 2,
    *[REST_ACTIONS] * 2,
    [garbage],
    [probe],
]
OUTCOMES = {
    "grpc_full",
    "grpc_seeded",
    "grpc_cancel",
    "grpc_deadline",
    "grpc_abort",
    "grpc_drop_channel",
    "grpc_duplicate",
    "grpc_constrained",
    "grpc_constrained_cancel",
    "triton_stream",
    "triton_stream_cancel",
    "triton_unary",
    "triton_unary_timeout",
    "rest_stream",
    "rest_stream_drop",
    "rest_infer",
    "rest_infer_timeout",
    "garbage",
    "probe",
    "killed_process",
}


async def worker(c: Clients, actions: list[Action], seed: int) -> None:
    """Every action once in each seeded shuffle of them, so that even a slow machine runs each kind."""
    rng = random.Random(seed)
    while True:
        for action in rng.sample(actions, len(actions)):
            if time.monotonic() >= c.deadline:
                return
            try:
                await action(c, rng)
            except (grpc.aio.AioRpcError, InferenceServerException, aiohttp.ClientError) as exc:
                c.ledger.problems.append(f"{action}: {exc!r}"[:500])


async def chaos_round(
    server: InProcessServer,
    ledger: Ledger,
    round_tag: str,
    workers: list[list[Action]] = WORKERS,
    duration_s: float = CHAOS_S,
    kill_clients: bool = True,
) -> None:
    """`workers` clients at once for `duration_s`, and client processes killed meanwhile."""
    address = f"127.0.0.1:{server.port}"
    async with (
        grpc.aio.insecure_channel(address) as channel,
        triton_aio.InferenceServerClient(address) as triton,
        aiohttp.ClientSession() as http,
    ):
        stub = pb_grpc.GenerationStub(channel)
        c = Clients(server, stub, triton, http, ledger, time.monotonic() + duration_s, round_tag)
        tasks = [worker(c, actions, SEED * 100 + i) for i, actions in enumerate(workers)]
        await asyncio.gather(*tasks, *([kill_client_processes(c)] if kill_clients else []))


# -- the server's own state -------------------------------------------------------------------------------


class CountingStreams(dict[str, Any]):
    """The async engine's `_streams`, counting the client requests it admits (not its health checks)."""

    num_admitted = 0

    def __setitem__(self, key: str, value: Any) -> None:
        if not key.startswith("health-"):
            self.num_admitted += 1
        super().__setitem__(key, value)


def leftovers(server: InProcessServer) -> dict[str, int]:
    """Every per-request table of every layer, and every block in use: all zero once idle. With the
    engine in a process of its own, the front end's tables, the metrics it replays and what the engine
    process's stats say of its requests and blocks."""
    engine = server.server.engine
    llm = engine.engine
    sizes = {
        "async_engine._streams": len(engine._streams),
        "async_engine._num_pending_adds": engine._num_pending_adds,
        "async_engine._pending_aborts": len(engine._pending_aborts),
        "async_engine._reserved": len(engine._reserved),
        "async_engine._searches": len(engine._searches),
        "async_engine._unread_finals": len(engine._unread_finals),
        "metrics.last_token": len(llm.metrics._streams.last_token),
        "metrics.unmetered_request_ids": len(llm.metrics.unmetered_request_ids),
    }
    if isinstance(llm, EngineFace):
        stats = llm.stats()
        sizes["engine_process.unfinished"] = stats.num_unfinished
        sizes["engine_process.used_blocks"] = stats.num_total_blocks - stats.num_free_blocks
        sizes["engine_process.used_cpu_blocks"] = stats.num_total_cpu_blocks - stats.num_free_cpu_blocks
    else:
        sizes |= engine_leftovers(llm)
    return {name: size for name, size in sizes.items() if size}


def engine_leftovers(llm: LLMEngine) -> dict[str, int]:
    scheduler = llm.scheduler
    bm = scheduler.block_manager
    runner = llm.executor.worker.model_runner  # type: ignore[attr-defined]  # one rank, in process
    return {
        "llm_engine._requests": len(llm._requests),
        "llm_engine._completions": len(llm._completions),
        "scheduler.waiting": len(scheduler.waiting),
        "scheduler.running": len(scheduler.running),
        "scheduler.swapped": len(scheduler.swapped),
        "scheduler.requests": len(scheduler.requests),
        "scheduler._forked_ids": len(scheduler._forked_ids),
        "scheduler._freed_request_ids": len(scheduler._freed_request_ids),
        "scheduler._swap_out": len(scheduler._swap_out),
        "block_manager.seq_hashes": len(bm.seq_hashes),
        "block_manager.cpu_block_tables": len(bm.cpu_block_tables),
        "block_manager.blocks_to_copy": len(bm.blocks_to_copy),
        "block_manager.used_blocks": bm.num_used_blocks,
        "block_manager.referenced_blocks": sum(1 for count in bm.ref_counts if count),
        "block_manager.used_cpu_blocks": bm.num_cpu_blocks - bm.num_free_cpu_blocks,
        "structured_outputs.matchers": len(llm.structured_outputs._matchers),
        "model_runner.requests": len(runner.requests),
        "model_runner.prompt_token_ids": len(runner.prompt_token_ids),
        "model_runner.used_rows": len(runner.block_tables) - len(runner.free_rows),
    }


def wait_idle(server: InProcessServer) -> None:
    """Until no request runs or waits and no KV block is in use, as our Health RPC tells clients."""

    def idle() -> bool:
        health = server.stub.Health(pb.HealthRequest(), timeout=10)
        return (health.num_running, health.num_waiting, health.kv_cache_usage) == (0, 0, 0.0)

    wait_for(idle, timeout=15, what="an idle server")


def settle(server: InProcessServer) -> None:
    """Until the server is idle all through: every table of `leftovers` empty."""
    wait_idle(server)
    try:
        wait_for(lambda: not server.call(_on_loop(leftovers, server)), timeout=5, what="empty tables")
    except TimeoutError:
        raise AssertionError(f"left behind: {server.call(_on_loop(leftovers, server))}") from None


async def _on_loop(fn: Callable[[InProcessServer], Any], server: InProcessServer) -> Any:
    return fn(server)  # on the server's event loop: no step or callback runs meanwhile


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and labels.items() <= dict(sample_labels).items()
    )


def quiet_run(server: InProcessServer, key: GreedyKey) -> tuple[list[int], str]:
    kind, prompt, max_tokens, stop, ignore_eos = key
    params = pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, stop=stop, ignore_eos=ignore_eos)
    request = pb.GenerateRequest(sampling=params)
    if kind == "ids":
        request.token_ids.ids.extend(prompt)
    else:
        request.text = prompt
    responses = list(server.stub.Generate(request, timeout=60))
    return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses)


def rss_mb() -> float:
    """Resident memory once glibc has returned the free pages it keeps (its heaps grow and shrink by
    tens of MB between rounds as threads free what they took): what is still in use, not a leak."""
    gc.collect()
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    return psutil.Process().memory_info().rss / 2**20


def start_server(model_dir: str, **settings: Any) -> InProcessServer:
    return InProcessServer(
        model_dir,
        None,
        dtype="float32",
        served_model_name=MODEL,
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
        num_cpu_kv_blocks=NUM_CPU_BLOCKS,
        max_num_seqs=MAX_NUM_SEQS,
        seed=SEED,
        **settings,
    ).start()


# -- the chaos -------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preemption_mode", "num_rounds", "scheduling_policy", "engine_process"),
    [("swap", 2, "fcfs", False), ("recompute", 1, "priority", False), ("swap", 1, "fcfs", True)],
)
def test_chaos_leaves_correct_tokens_and_nothing_behind(
    tiny_llama_dir: str,
    preemption_mode: str,
    num_rounds: int,
    scheduling_policy: str,
    engine_process: bool,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The recompute run schedules by priority: our Generate clients send random priorities. The last
    runs the engine in a process of its own, as `serve` does by default (adds, aborts and deltas
    crossing between the processes), where the engine's own tables are seen through its stats."""
    server = start_server(
        tiny_llama_dir,
        preemption_mode=preemption_mode,
        scheduling_policy=scheduling_policy,
        engine_process=engine_process,
    )
    try:
        streams = server.server.engine._streams = CountingStreams()  # set while idle
        before, stats_before = scrape(server), server.llm.stats()
        ledger, rss = Ledger(), []
        caplog.set_level(logging.ERROR)
        for round_index in range(num_rounds):
            asyncio.run(chaos_round(server, ledger, f"r{round_index}"))
            settle(server)  # every table back to zero after each round
            rss.append(rss_mb())

        assert not ledger.problems, "\n".join(ledger.problems[:20])
        assert not OUTCOMES - set(ledger.outcomes), ledger.outcomes  # every kind of client ran
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, errors[:5]  # clients misbehaving is no server error
        assert "Traceback" not in capfd.readouterr().err  # nor in the engine process's log

        stats, after = server.llm.stats(), scrape(server)
        preemptions = {
            "swap": stats.num_swap_preemptions - stats_before.num_swap_preemptions,
            "recompute": stats.num_recompute_preemptions - stats_before.num_recompute_preemptions,
        }
        assert preemptions[preemption_mode] > 0, preemptions  # the KV cache ran full
        assert stats.num_free_blocks == stats.num_total_blocks and stats.num_unfinished == 0
        assert stats.num_free_cpu_blocks == stats.num_total_cpu_blocks
        assert {gauge: total(after, gauge) for gauge in GAUGES} == dict.fromkeys(GAUGES, 0.0)
        assert total(after, "vllm:num_preemptions_total") == stats.num_preemptions
        swapped_out = total(after, "pagedserve:swapped_blocks_total", direction="out")
        assert swapped_out == stats.num_swapped_out_blocks
        # each admitted request ended exactly once: finished (any reason, failures too) or aborted
        ended = {
            name: total(after, name) - total(before, name)
            for name in ("vllm:request_success_total", "pagedserve:request_aborts_total")
        }
        assert sum(ended.values()) == streams.num_admitted, (ended, streams.num_admitted, ledger.outcomes)

        started = time.monotonic()  # still serving, at once
        assert len(quiet_run(server, ("ids", (1, 2, 3), 16, (), True))[0]) == 16
        assert time.monotonic() - started < 5.0

        mismatches = []
        for key, seen in ledger.greedy.items():
            token_ids, text = quiet_run(server, key)
            mismatches += [
                (key, s, (token_ids, text)) for s in seen if s[1] != text or s[0] not in (None, token_ids)
            ]
        assert not mismatches, mismatches[:5]
        if num_rounds > 1:  # a second round grows nothing
            assert rss[-1] - rss[0] < 50, rss
    finally:
        server.stop()


# -- beam searches under the same abuse --------------------------------------------------------------------
# A search runs as rounds of one-token requests (AsyncEngine.beam_search), each round's opened and
# closed while the caller may be leaving: cancelled, timed out by its gRPC deadline or Triton's request
# timeout, aborted by id, its REST connection dropped. The rounds' requests count as requests of their
# own and the search's abort once, so the chaos's admitted == finished + aborted does not hold here;
# the rest does: searches read to the end equal a quiet run, nothing is left in any table, no error.

BEAM_MAX_TOKENS = [4, 8]


def beam_request(key: BeamKey, request_id: str = "") -> pb.GenerateRequest:
    prompt, n, max_tokens = key
    params = pb.SamplingParameters(use_beam_search=True, n=n, max_tokens=max_tokens, temperature=0.0)
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt), sampling=params)


def long_beam_request(rng: random.Random, request_id: str = "") -> pb.GenerateRequest:
    request = beam_request((tuple(rng.choice(ID_PROMPTS)[:20]), 2, LONG_MAX_TOKENS), request_id)
    request.sampling.ignore_eos = True
    return request


async def beam_to_the_end(c: Clients, rng: random.Random) -> None:
    key = (tuple(rng.choice(ID_PROMPTS)), rng.choice([2, 3]), rng.choice(BEAM_MAX_TOKENS))
    responses = [r async for r in c.stub.Generate(beam_request(key), timeout=120)]
    token_ids, _, reasons = completions(responses, key[1])
    if any(reason not in (pb.LENGTH, pb.EOS) for reason in reasons):
        c.ledger.problems.append(f"beam search {key}: finish reasons {reasons}")
    c.ledger.beams.setdefault(key, []).append(token_ids)
    c.ledger.outcomes["beam_full"] += 1


async def beam_cancel(c: Clients, rng: random.Random) -> None:
    call = c.stub.Generate(long_beam_request(rng), timeout=120)
    await asyncio.sleep(rng.choice([0.0, 0.01, 0.1, 0.3]))
    call.cancel()
    c.ledger.outcomes["beam_cancel"] += 1


async def beam_abort_by_id(c: Clients, rng: random.Random) -> None:
    """Abort a search by id mid-rounds: reported aborted, its stream ends with one ABORTED response."""
    rid = c.new_id("beam-abort")
    call = c.stub.Generate(long_beam_request(rng, rid), timeout=120)
    while rid not in c.server.server.engine._reserved and not call.done():  # held from admission to end
        await asyncio.sleep(0.005)
    await asyncio.sleep(rng.choice([0.0, 0.05, 0.2]))  # admitted, in its first rounds or later ones
    reply = await c.stub.Abort(pb.AbortRequest(request_ids=[rid]))
    responses = [r async for r in call]
    reasons = [r.finish_reason for r in responses]
    if list(reply.aborted_request_ids) != [rid] or reasons != [pb.ABORTED]:
        c.ledger.problems.append(f"Abort({rid}): reported {list(reply.aborted_request_ids)}, ended {reasons}")
    c.ledger.outcomes["beam_abort"] += 1


async def beam_triton_timeout(c: Clients, rng: random.Random) -> None:
    """Triton's request timeout (microseconds) ends the search on the server: DEADLINE_EXCEEDED."""
    params = {"use_beam_search": True, "n": 2, "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}
    inputs = [text_input(rng.choice(TEXT_PROMPTS)), sampling_input(params)]
    timeout_us = rng.choice([10_000, 100_000, 300_000])
    try:  # as short_deadline's, it may finish in time
        await c.triton.infer(MODEL, inputs, timeout=timeout_us)
    except InferenceServerException as exc:
        if exc.status() != "StatusCode.DEADLINE_EXCEEDED":
            c.ledger.problems.append(f"Triton search timeout: {exc.status()} {exc.message()}")
    c.ledger.outcomes["beam_triton_timeout"] += 1


async def beam_rest_drop(c: Clients, rng: random.Random) -> None:
    """/generate of a search, its client gone after a moment (its connection closed unanswered)."""
    params = {"use_beam_search": True, "n": 2, "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}
    body = {"text_input": rng.choice(TEXT_PROMPTS), "parameters": params}
    timeout = aiohttp.ClientTimeout(total=rng.choice([0.05, 0.3]))
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(c.server.http_url(f"/v2/models/{MODEL}/generate"), json=body) as reply,
        ):
            if reply.status != 200:  # it may finish in time, as short_deadline's
                c.ledger.problems.append(f"/generate of a search: HTTP {reply.status}: {await reply.text()}")
    except TimeoutError:
        pass
    c.ledger.outcomes["beam_rest_drop"] += 1


BEAM_ACTIONS: list[Action] = [
    beam_to_the_end,
    beam_to_the_end,
    beam_cancel,
    partial(short_deadline, request=long_beam_request, outcome="beam_deadline"),
    beam_abort_by_id,
    beam_triton_timeout,
    beam_rest_drop,
]
BEAM_OUTCOMES = {
    "beam_full",
    "beam_cancel",
    "beam_deadline",
    "beam_abort",
    "beam_triton_timeout",
    "beam_rest_drop",
    "grpc_full",
    "grpc_cancel",
}


BEAM_WORKERS: list[list[Action]] = [
    *[BEAM_ACTIONS] * 4,
    [generate_to_the_end, cancel_after_k],  # plain requests in the same batches
]


@pytest.mark.slow
def test_beam_search_chaos_leaves_correct_beams_and_nothing_behind(
    tiny_llama_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What it found: a round's requests whose callers, the round's reads, were cancelled after the
    engine finished them left their final deltas kept for front ends that never ask (256 at most)."""
    server = start_server(tiny_llama_dir, preemption_mode="recompute")
    try:
        ledger = Ledger()
        caplog.set_level(logging.ERROR)
        asyncio.run(chaos_round(server, ledger, "beam", BEAM_WORKERS, BEAM_CHAOS_S, kill_clients=False))
        settle(server)

        assert not ledger.problems, "\n".join(ledger.problems[:20])
        assert not BEAM_OUTCOMES - set(ledger.outcomes), ledger.outcomes  # every kind of client ran
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, errors[:5]
        stats = server.llm.stats()
        assert stats.num_free_blocks == stats.num_total_blocks and stats.num_unfinished == 0

        mismatches = []
        for key, seen in ledger.beams.items():
            token_ids, _, _ = completions(list(server.stub.Generate(beam_request(key), timeout=60)), key[1])
            mismatches += [(key, s, token_ids) for s in seen if s != token_ids]
        assert not mismatches, mismatches[:3]
        assert len(quiet_run(server, ("ids", (1, 2, 3), 16, (), True))[0]) == 16  # still serving
    finally:
        server.stop()


# -- what the chaos found, one at a time ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[InProcessServer]:
    srv = start_server(tiny_llama_dir)
    yield srv
    srv.stop()


def adapter_request(max_tokens: int) -> LLMRequest:
    """What the KServe / Triton front ends make of a request (`text_input` and sampling parameters)."""
    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return parse_request([Tensor("text_input", "BYTES", [1], ["Hello"])], params)


async def started_and_finished_unread(
    srv: InProcessServer,
) -> tuple[AsyncGenerator[RequestDelta, None], str]:
    """A KServe / Triton request whose caller read its first delta and no more while the engine
    finished it: its final delta waits, unread (a slow client, or one about to go away)."""
    deltas = LLMModel(srv.server).generate(adapter_request(4), {})
    await anext(deltas)
    (request_id,) = srv.server.engine.live_request_ids()
    while srv.llm.has_unfinished_requests():
        await asyncio.sleep(0.01)
    # It ended inside a step that may still be returning on the torch thread: the engine loop hands
    # that step's deltas to their streams before a later job of that thread is seen done.
    await in_torch_thread(lambda: None)
    return deltas, request_id


async def read_to_the_end(deltas: AsyncIterator[RequestDelta]) -> list[RequestDelta]:
    return [delta async for delta in deltas]


async def close(deltas: AsyncGenerator[RequestDelta, None]) -> None:
    await deltas.aclose()


def test_a_caller_gone_after_its_request_finished_is_counted_once(server: InProcessServer) -> None:
    """The engine finished the request and counted it in vllm:request_success; its caller then went
    away before reading the last delta. It was counted under pagedserve:request_aborts as well: in the
    chaos, finished + aborted came to more than the requests admitted."""
    wait_idle(server)
    before = scrape(server)
    deltas, _ = server.call(started_and_finished_unread(server))
    server.call(close(deltas))  # the client goes away
    wait_idle(server)
    after = scrape(server)
    assert total(after, "vllm:request_success_total") - total(before, "vllm:request_success_total") == 1
    assert total(after, "pagedserve:request_aborts_total") == total(before, "pagedserve:request_aborts_total")


def test_abort_of_a_request_the_engine_finished_aborts_nothing(server: InProcessServer) -> None:
    """An Abort RPC for a request the engine already finished (its final delta not yet read): the
    reply named it aborted and counted an abort, while its stream ended with its tokens and `length`."""
    wait_idle(server)
    before = scrape(server)
    deltas, request_id = server.call(started_and_finished_unread(server))
    reply = server.stub.Abort(pb.AbortRequest(request_ids=[request_id, request_id]))
    rest = server.call(read_to_the_end(deltas))
    assert rest[-1].finish_reason == "length" and rest[-1].num_output_tokens == 4
    assert list(reply.aborted_request_ids) == []
    wait_idle(server)
    after = scrape(server)
    assert total(after, "pagedserve:request_aborts_total") == total(before, "pagedserve:request_aborts_total")


def test_an_idle_engine_holds_no_worker_state(server: InProcessServer) -> None:
    """The workers drop a request's state with the step after it ended; the engine stepped only while
    requests were unfinished, so its last requests' states (rows, sampling parameters, token history)
    stayed in the model runner for as long as the server was idle."""
    runner = server.llm.executor.worker.model_runner
    params = pb.SamplingParameters(max_tokens=4, temperature=0.0, ignore_eos=True)
    list(server.stub.Generate(pb.GenerateRequest(text="Hello", sampling=params), timeout=60))
    cancelled = server.stub.Generate(long_request(random.Random(SEED)), timeout=60)
    next(cancelled)
    cancelled.cancel()
    wait_for(lambda: not runner.requests and len(runner.free_rows) == MAX_NUM_SEQS, 5, "no worker state")


def test_a_client_dropping_a_rest_stream_logs_no_error(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that drops /generate_stream is an everyday event: the request is aborted, quietly. It
    was logged at ERROR with a traceback (aiohttp's "Error handling request"), once per client."""
    caplog.set_level(logging.ERROR)
    asyncio.run(drop_a_rest_stream(server))
    wait_idle(server)  # the server has written into the dropped connection (and aborted) by now
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def drop_a_rest_stream(srv: InProcessServer) -> None:
    body = {"text_input": "Hello", "parameters": {"max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}}
    async with (
        aiohttp.ClientSession() as session,
        session.post(srv.http_url(f"/v2/models/{MODEL}/generate_stream"), json=body) as reply,
    ):
        await reply.content.readline()  # the first event
        reply.connection.transport.abort()  # type: ignore[union-attr]


def test_a_response_sent_as_its_grpc_client_leaves_logs_no_error(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    """grpc.aio logs an ERROR with a traceback when a streaming handler's response fails to send because
    its client has just gone, before grpc marks the call closed: the chaos rounds met it now and then (a
    probe cancelling 16 Generate streams at a time after 1-30 responses logged ten in 40 s). Here the
    line grpc writes then, through grpc's own logger: kept at debug, off the error logs."""
    caplog.set_level(logging.DEBUG)
    message = "ExecuteBatchError raised in core by servicer method [/pagedserve.rpc.v1.Generation/Generate]"
    try:
        raise RuntimeError("Failed execute_batch")
    except RuntimeError:
        logging.getLogger("grpc._cython.cygrpc").exception(message)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r for r in caplog.records if r.levelno == logging.DEBUG and message in r.getMessage()]
