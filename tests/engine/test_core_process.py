"""The engine process's side of --engine-process, without a front end: a request whose grammar is not
compiled yet waits apart while the grammar thread compiles it, and the inboxes go on without it (the
other requests' adds and aborts, the steps); an abort ends it where it waits. The inboxes merge as
the torch thread's core merges them (a later abort replaces an earlier one, the later KV setting wins)."""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time
import uuid
from collections.abc import Callable
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any, cast

import pytest
from pagedserve.engine import core_process
from pagedserve.engine.core import Abort, Add, Inbox
from pagedserve.engine.core_process import (
    _INBOX,
    _STOP,
    CorePass,
    _Admission,
    _MetricCalls,
    _run_passes,
    _sendable,
    send_tokenizer,
)
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import AdapterInUseError
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.settings import EngineSettings
from pagedserve.telemetry import EngineMetrics

PAIR = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def big_schema() -> dict[str, object]:
    """A schema of 120 patterned fields, new to this process (xgrammar caches what it compiled):
    its compile takes tens of milliseconds at least."""
    tag = uuid.uuid4().hex[:8]
    fields = {f"f{i}_{tag}": {"type": "string", "pattern": "[a-z]{1,8}[0-9]{2}"} for i in range(120)}
    return {"type": "object", "properties": fields, "required": list(fields)}


def add(request_id: str, structured: StructuredOutputsParams | None = None) -> Add:
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=structured)
    return Add(request_id, [1, 5, 9], params, time.monotonic(), 0, None)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def tiny_engine(tiny_llama_dir: str) -> LLMEngine:
    return LLMEngine.from_settings(EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64))


def test_a_request_waits_apart_for_its_grammar_and_its_inbox_goes_on(tiny_llama_dir: str) -> None:
    """Until the grammar compiles, the inboxes (another request's add, an abort) are applied without
    the request that needs it; it comes in a later pass, first among that pass's adds."""
    admission = _Admission(tiny_engine(tiny_llama_dir))
    schema = StructuredOutputsParams(json=json.dumps(big_schema()))
    admission.receive(0, Inbox(adds=[add("with-grammar", schema)]))
    admission.receive(1, Inbox(adds=[add("plain")], aborts={"gone": Abort("bye", None)}))
    numbers, inbox, ended = admission.take()
    assert numbers == [0, 1] and [a.request_id for a in inbox.adds] == ["plain"] and ended == []
    assert list(inbox.aborts) == ["gone"] and admission.num_waiting == 1
    wait_until(lambda: admission.ready, "the grammar to compile")
    admission.receive(2, Inbox(adds=[add("no-grammar")]))
    numbers, inbox, ended = admission.take()
    assert numbers == [2] and [a.request_id for a in inbox.adds] == ["with-grammar", "no-grammar"]
    assert admission.num_waiting == 0 and not admission.ready


def test_a_grammar_compiled_before_enters_with_its_inbox(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """xgrammar's cache answers for a schema compiled before: the pass waits for it (a bound generous
    here, so that a loaded host cannot make the test flaky) and the request does not wait apart."""
    llm = tiny_engine(tiny_llama_dir)
    schema = StructuredOutputsParams(json=json.dumps(PAIR))
    llm.structured_outputs.compile(schema)  # (builds the compiler, then the grammar into the cache)
    monkeypatch.setattr(core_process, "_CACHED_COMPILE_WAIT_S", 60.0)
    admission = _Admission(llm)
    admission.receive(0, Inbox(adds=[add("plain"), add("with-grammar", schema), add("after")]))
    numbers, inbox, ended = admission.take()
    assert [a.request_id for a in inbox.adds] == ["plain", "with-grammar", "after"]
    assert numbers == [0] and ended == [] and admission.num_waiting == 0


def test_an_abort_ends_a_request_waiting_for_its_grammar(tiny_llama_dir: str) -> None:
    admission = _Admission(tiny_engine(tiny_llama_dir))
    admission.receive(
        0, Inbox(adds=[add("with-grammar", StructuredOutputsParams(json=json.dumps(big_schema())))])
    )
    assert admission.take()[1].adds == [] and admission.num_waiting == 1
    admission.receive(1, Inbox(aborts={"with-grammar": Abort("bye", "client_cancel")}))
    numbers, inbox, ended = admission.take()
    assert numbers == [1] and [a.request_id for a in ended] == ["with-grammar"] and inbox.adds == []
    assert admission.num_waiting == 0  # (its compile goes on into the cache; the request is gone)


def test_the_engine_process_serves_others_while_a_grammar_compiles(tiny_llama_dir: str) -> None:
    """The engine process's loop (`_run_passes`, on a thread here, the front end's end of the pipe in
    the test) with a compile held until the test lets it go: a plain request sent after the grammar's
    runs to its end meanwhile, the waiting one counted among the waiting; an abort then ends the
    waiting request with an aborted final delta (logged by the front end's replay of its metrics)."""
    llm = tiny_engine(tiny_llama_dir)
    recorder = _MetricCalls()
    llm.metrics = cast(EngineMetrics, recorder)
    release, compile_ = threading.Event(), llm.structured_outputs.compile

    def held_compile(params: StructuredOutputsParams | None) -> Any:
        if params is not None:  # (add_request asks for every request's: None without a grammar)
            assert release.wait(60)
        return compile_(params)

    llm.structured_outputs.compile = held_compile  # type: ignore[method-assign]
    front, engine_end = Pipe()
    loop = threading.Thread(target=_run_passes, args=(engine_end, llm, recorder))
    loop.start()
    try:
        front.send(
            (_INBOX, 0, Inbox(adds=[add("with-grammar", StructuredOutputsParams(json=json.dumps(PAIR)))]))
        )
        front.send((_INBOX, 1, Inbox(adds=[add("plain")])))
        passes: list[CorePass] = []
        while not any(d.request_id == "plain" and d.request_finished for p in passes for d in p.done.deltas):
            assert front.poll(60), "no pass came"
            passes.append(front.recv())
        assert all(d.request_id == "plain" for p in passes for d in p.done.deltas)
        assert passes[-1].stats.num_waiting == 1 and passes[-1].stats.num_unfinished == 1
        # the front end's gauges are set from the replayed record_step: the waiting one counts there too
        steps = [args[0] for name, args in passes[-1].metric_calls if name == "record_step"]
        assert steps and all((s.num_waiting, s.num_unfinished) == (1, 1) for s in steps)
        front.send((_INBOX, 2, Inbox(aborts={"with-grammar": Abort("bye", "client_cancel")})))
        ending = next(
            p for p in iter(lambda: front.recv() if front.poll(60) else None, None) if 2 in p.numbers
        )
        (aborted,) = ending.done.aborted
        assert (aborted.request_id, aborted.finish_reason, aborted.request_finished) == (
            "with-grammar",
            "aborted",
            True,
        )
        assert ("record_aborted", (ending.stats, [aborted], aborted.metrics.finished_time)) in [
            (name, args) for name, args in ending.metric_calls
        ]
        assert ending.stats.num_waiting == 0 and ending.stats.num_unfinished == 0
    finally:
        release.set()
        front.send((_STOP,))
        loop.join(60)
    assert not loop.is_alive()


def test_inboxes_merge_as_the_torch_threads_core_merges_them() -> None:
    first, second = Abort("first", None), Abort("second", "client_cancel")
    merged = Inbox(aborts={"r": first}, adds=[add("a")], kv_snapshot=True)
    merged.take_in(
        Inbox(aborts={"r": second}, adds=[add("b")], lora_changes=[("unload_lora_adapter", ("x",), None)])
    )
    assert merged.aborts == {"r": second} and [a.request_id for a in merged.adds] == ["a", "b"]
    assert merged.kv_snapshot and not merged.kv_stop  # the later inbox left the KV setting alone
    merged.take_in(Inbox(kv_stop=True))
    assert (merged.kv_snapshot, merged.kv_stop) == (False, True)
    sent = merged.for_sending()
    assert sent.lora_changes == [("unload_lora_adapter", ("x",), None)] and sent.adds == merged.adds
    assert sent.aborts is not merged.aborts  # a copy: the front end's inbox stays as it was


class _Unpicklable(RuntimeError):
    def __init__(self) -> None:
        super().__init__("holds a lock")
        self.lock = threading.Lock()


def test_an_error_that_does_not_pickle_crosses_as_its_repr() -> None:
    """A fault or a LoRA change's error goes to the front end pickled: one that cannot be still says
    what it was, and one that can keeps its type and field (InvalidRequestError names the field)."""
    crossed = pickle.loads(pickle.dumps(_sendable(_Unpicklable())))
    assert type(crossed) is RuntimeError and str(crossed) == "_Unpicklable('holds a lock')"
    refused = pickle.loads(pickle.dumps(_sendable(AdapterInUseError("lora_name", "'sql' is in use"))))
    assert type(refused) is AdapterInUseError and (refused.field, refused.message) == (
        "lora_name",
        "'sql' is in use",
    )


def test_a_tokenizer_that_does_not_pickle_goes_to_the_front_end_as_none(
    tiny_llama_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine process hands the front end its tokenizer; one that does not pickle (an attribute
    pickle cannot take) is said not to and goes as None, and the front end loads its own
    (EngineProcess.receive_handover; that side: test_engine_process.py). One that pickles arrives
    whole: it tokenizes as the engine process's does."""
    from pagedserve.tokenizer import load_tokenizer

    class Model:
        path = tokenizer_path = tiny_llama_dir

    tokenizer = load_tokenizer(Model())  # type: ignore[arg-type]
    ours, theirs = socket.socketpair()
    with Connection(ours.detach()) as sender, Connection(theirs.detach()) as front_end:
        # (sent from a thread: a tokenizer's MBs fill the socket's buffer until the front end reads)
        sent = threading.Thread(target=send_tokenizer, args=(sender, tokenizer))
        sent.start()
        text = "The capital of France is"
        assert front_end.recv()(text).input_ids == tokenizer(text).input_ids
        sent.join()
        tokenizer.callback = lambda: None  # (a lambda does not pickle)
        send_tokenizer(sender, tokenizer)
        assert front_end.recv() is None
    assert any("the tokenizer does not pickle" in r.getMessage() for r in caplog.records)
