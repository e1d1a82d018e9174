"""LoadLoRAAdapter / UnloadLoRAAdapter over real gRPC (in-process server, tiny model, PEFT adapters):
refused unless the server allows runtime LoRA updating; then an adapter loaded while serving gives the
offline tokens, an unloaded one is refused by name, and each refusal has the status that fits it
(ALREADY_EXISTS, NOT_FOUND, FAILED_PRECONDITION while in use, INVALID_ARGUMENT for a bad adapter),
with streams beside the changes unharmed."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from inprocess_server import InProcessServer, is_idle, wait_for
from lora_serving import build_adapters, offline, start_server
from pagedserve.rpc.v1 import generate_pb2 as pb

PROMPT = [1, *range(300, 331)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return build_adapters(tmp_path_factory.mktemp("lora-runtime"), tiny_llama_dir)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: str, adapters: dict[str, str]) -> dict[str | None, list[int]]:
    names: list[str | None] = ["sql", "chat", None]
    outputs = offline(tiny_llama_dir, adapters, [(PROMPT, name) for name in names], MAX_TOKENS)
    return {name: list(out.token_ids) for name, out in zip(names, outputs)}


@pytest.fixture(scope="module", params=[False, True], ids=["engine-thread", "engine-process"])
def srv(
    tiny_llama_dir: str, adapters: dict[str, str], request: pytest.FixtureRequest
) -> Iterator[InProcessServer]:
    """The engine on the server's torch thread, then in a process of its own (--engine-process): the
    changes run there, and the front end follows the adapters it holds."""
    server = start_server(
        tiny_llama_dir,
        {"sql": adapters["sql"]},
        allow_runtime_lora_updating=True,
        engine_process=request.param,
    )
    yield server
    server.stop()


def generate(
    srv: InProcessServer, request_id: str, lora_name: str = "", max_tokens: int = MAX_TOKENS
) -> list[int]:
    params = pb.SamplingParameters(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    request = pb.GenerateRequest(
        request_id=request_id, token_ids=pb.TokenIds(ids=PROMPT), sampling=params, lora_name=lora_name
    )
    return [t for r in srv.stub.Generate(request, timeout=120) for t in r.token_ids]


def load(srv: InProcessServer, name: str, path: str) -> list[str]:
    request = pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
    return list(srv.stub.LoadLoRAAdapter(request, timeout=60).lora_adapters)


def unload(srv: InProcessServer, name: str) -> list[str]:
    return list(
        srv.stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name=name), timeout=60).lora_adapters
    )


def refused(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value


def test_load_use_and_unload_while_serving(
    srv: InProcessServer, adapters: dict[str, str], expected: dict[str | None, list[int]]
) -> None:
    assert generate(srv, "before", "sql") == expected["sql"]
    assert load(srv, "chat", adapters["chat"]) == ["sql", "chat"]
    assert generate(srv, "loaded", "chat") == expected["chat"]
    assert list(srv.stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).lora_adapters) == ["sql", "chat"]
    assert unload(srv, "chat") == ["sql"]
    error = refused(lambda: generate(srv, "gone", "chat"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("lora_name: unknown adapter 'chat' (this server has: sql)")
    assert generate(srv, "after", "sql") == expected["sql"]
    assert generate(srv, "base", "") == expected[None]


def test_each_refusal_has_its_status(srv: InProcessServer, adapters: dict[str, str]) -> None:
    served = srv.stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).model_name
    cases = [
        (
            lambda: load(srv, "sql", adapters["chat"]),
            grpc.StatusCode.ALREADY_EXISTS,
            "lora_name: an adapter named 'sql'",
        ),
        (
            lambda: load(srv, "", adapters["chat"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "lora_name: must not be empty",
        ),
        (lambda: load(srv, "x", ""), grpc.StatusCode.INVALID_ARGUMENT, "lora_path: must not be empty"),
        (
            lambda: load(srv, "x", "/nowhere"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "lora_path: adapter 'x' (/nowhere)",
        ),
        (
            lambda: unload(srv, "nope"),
            grpc.StatusCode.NOT_FOUND,
            "lora_name: no adapter named 'nope' is loaded",
        ),
        (  # a request's `model` picks the served model first: the adapter would never run by its name
            lambda: load(srv, served, adapters["chat"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"lora_name: adapter name {served!r} is the served model's name",
        ),
        (
            lambda: load(srv, "a\tb", adapters["chat"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "lora_name: adapter name 'a\\tb' has characters that do not print",
        ),
    ]
    for call, code, message in cases:
        error = refused(call)
        assert (error.code(), error.details()[: len(message)]) == (code, message)
    assert list(srv.stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).lora_adapters) == ["sql"]


def test_an_adapter_in_use_stays_until_its_requests_end(
    srv: InProcessServer, expected: dict[str | None, list[int]]
) -> None:
    params = pb.SamplingParameters(temperature=0, max_tokens=200, ignore_eos=True)
    request = pb.GenerateRequest(
        request_id="long", token_ids=pb.TokenIds(ids=PROMPT), sampling=params, lora_name="sql"
    )
    stream = srv.stub.Generate(request, timeout=120)
    tokens = list(next(stream).token_ids)  # running (its first message may carry several tokens)
    error = refused(lambda: unload(srv, "sql"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details().startswith("lora_name: 'sql' is in use by 1 request(s)")
    code, text = post(srv, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert (code, json.loads(text)["type"]) == (409, "ConflictError"), text
    tokens += [t for r in stream for t in r.token_ids]
    assert len(tokens) == 200  # the refused unload cut nothing short
    wait_for(lambda: is_idle(srv), what="the server idle")
    assert unload(srv, "sql") == []
    assert load(srv, "sql", srv.settings.lora_modules.partition("=")[2]) == ["sql"]  # type: ignore[union-attr]
    assert generate(srv, "again", "sql") == expected["sql"]


def post(srv: InProcessServer, route: str, body: Any) -> tuple[int, str]:
    """POST `body` (JSON, or bytes as they are) to the HTTP port: (status, response text)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        srv.http_url(route), data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_vllms_http_routes_load_and_unload(
    srv: InProcessServer, adapters: dict[str, str], expected: dict[str | None, list[int]]
) -> None:
    """`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` as vLLM answers them, for tools that manage
    vLLM's adapters; refusals are vLLM's error object."""
    body = {"lora_name": "web", "lora_path": adapters["chat"]}
    assert post(srv, "/v1/load_lora_adapter", body) == (
        200,
        "Success: LoRA adapter 'web' added successfully.",
    )
    assert generate(srv, "web", "web") == expected["chat"]
    refusals = [
        (
            "/v1/load_lora_adapter",
            body,
            400,
            "BadRequestError",
            "lora_name: an adapter named 'web' is loaded",
        ),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x"},
            400,
            "InvalidUserInput",
            "Both 'lora_name' and 'lora_path'",
        ),
        ("/v1/load_lora_adapter", b"{not json", 400, "InvalidUserInput", "the body must be a JSON object"),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": "/nowhere"},
            400,
            "BadRequestError",
            "lora_path:",
        ),
        (
            "/v1/unload_lora_adapter",
            {"lora_name": "nope"},
            404,
            "NotFoundError",
            "lora_name: no adapter named",
        ),
        ("/v1/unload_lora_adapter", {}, 400, "InvalidUserInput", "'lora_name' must be provided."),
    ]
    for route, request, status, kind, message in refusals:
        code, text = post(srv, route, request)
        error = json.loads(text)
        assert (code, error["object"], error["type"], error["code"]) == (status, "error", kind, status), text
        assert error["message"].startswith(message), text
    assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "web"}) == (
        200,
        "Success: LoRA adapter 'web' removed successfully.",
    )
    assert "web" not in srv.stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).lora_adapters


def test_runtime_changes_need_the_flag(tiny_llama_dir: str, adapters: dict[str, str]) -> None:
    server = start_server(tiny_llama_dir, {"sql": adapters["sql"]})
    try:
        for call in (lambda: load(server, "chat", adapters["chat"]), lambda: unload(server, "sql")):
            error = refused(call)
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "--allow-runtime-lora-updating" in error.details()
        code, text = post(
            server, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["chat"]}
        )
        assert code == 404 and "--allow-runtime-lora-updating" in json.loads(text)["message"]
        assert list(server.stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).lora_adapters) == ["sql"]
    finally:
        server.stop()
