"""The engine process's side of --engine-process, without a front end: an inbox whose request needs a
grammar is held, with every inbox after it, while the grammar thread compiles it (the steps of the
requests running go on), and then applied in the order received; the inboxes merge as the torch
thread's core merges them (a later abort replaces an earlier one, the later KV setting wins)."""

from __future__ import annotations

import json
import pickle
import threading
import time
import uuid

from pagedserve.engine.core import Abort, Add, Inbox
from pagedserve.engine.core_process import _Admission, _sendable
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import AdapterInUseError
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.settings import EngineSettings


def big_schema() -> dict[str, object]:
    """A schema of 120 patterned fields, new to this process (xgrammar caches what it compiled):
    its compile takes tens of milliseconds at least."""
    tag = uuid.uuid4().hex[:8]
    fields = {f"f{i}_{tag}": {"type": "string", "pattern": "[a-z]{1,8}[0-9]{2}"} for i in range(120)}
    return {"type": "object", "properties": fields, "required": list(fields)}


def add(request_id: str, structured: StructuredOutputsParams | None = None) -> Add:
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=structured)
    return Add(request_id, [1, 5, 9], params, time.monotonic(), 0, None)


def test_an_inbox_waits_for_its_grammar_and_the_inboxes_after_it_wait_behind(tiny_llama_dir: str) -> None:
    llm = LLMEngine.from_settings(EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64))
    admission = _Admission(llm)
    schema = StructuredOutputsParams(json=json.dumps(big_schema()))
    admission.receive(0, Inbox(adds=[add("with-grammar", schema)]))
    admission.receive(1, Inbox(adds=[add("plain")], aborts={"gone": Abort("bye", None)}))
    assert admission.take() == ([], Inbox())  # the grammar is compiling: nothing overtakes it
    assert admission.waiting
    deadline = time.monotonic() + 60
    while not admission.ready and time.monotonic() < deadline:
        time.sleep(0.005)
    numbers, inbox = admission.take()
    assert numbers == [0, 1] and not admission.waiting
    assert [a.request_id for a in inbox.adds] == ["with-grammar", "plain"] and list(inbox.aborts) == ["gone"]
    admission.receive(2, Inbox(adds=[add("no-grammar")]))
    assert admission.take()[0] == [2]  # nothing to compile: at once


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
