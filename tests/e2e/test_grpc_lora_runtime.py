"""LoadLoRAAdapter / UnloadLoRAAdapter over real gRPC (in-process server, tiny model, PEFT adapters):
refused unless the server allows runtime LoRA updating; then an adapter loaded while serving gives the
offline tokens, an unloaded one is refused by name, and each refusal has the status that fits it
(ALREADY_EXISTS, NOT_FOUND, FAILED_PRECONDITION while in use, INVALID_ARGUMENT for a bad adapter),
with streams beside the changes unharmed."""

from __future__ import annotations

from collections.abc import Iterator

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


@pytest.fixture(scope="module")
def srv(tiny_llama_dir: str, adapters: dict[str, str]) -> Iterator[InProcessServer]:
    server = start_server(tiny_llama_dir, {"sql": adapters["sql"]}, allow_runtime_lora_updating=True)
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
    next(stream)  # running
    error = refused(lambda: unload(srv, "sql"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details().startswith("lora_name: 'sql' is in use by 1 request(s)")
    tokens = [t for r in stream for t in r.token_ids]
    assert len(tokens) == 199  # the refused unload cut nothing short
    wait_for(lambda: is_idle(srv), what="the server idle")
    assert unload(srv, "sql") == []
    assert load(srv, "sql", srv.settings.lora_modules.partition("=")[2]) == ["sql"]  # type: ignore[union-attr]
    assert generate(srv, "again", "sql") == expected["sql"]


def test_runtime_changes_need_the_flag(tiny_llama_dir: str, adapters: dict[str, str]) -> None:
    server = start_server(tiny_llama_dir, {"sql": adapters["sql"]})
    try:
        for call in (lambda: load(server, "chat", adapters["chat"]), lambda: unload(server, "sql")):
            error = refused(call)
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "--allow-runtime-lora-updating" in error.details()
        assert list(server.stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).lora_adapters) == ["sql"]
    finally:
        server.stop()
