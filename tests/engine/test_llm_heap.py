"""`LLM` freezes the heap once its engine is built (full collections then skip the start-up's objects,
as in `pagedserve serve`), and thaws it when one is freed, so that its engine's reference cycles
are still collected: a process that builds one LLM after another, or drops one of several, keeps
no engine behind. A heap the caller froze is theirs: left as it is."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from pagedserve import LLM, SamplingParams
from pagedserve import llm as llm_module


@pytest.fixture(autouse=True)
def thawed_heap(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A heap nobody froze, as LLM finds it in a program of its own (the suite's conftest.py freezes
    the collected heap, which an earlier LLM of this process may have found as the caller's; frozen
    again after each test)."""
    gc.unfreeze()
    monkeypatch.setattr(llm_module._HEAP, "callers", False)
    yield
    gc.collect()
    gc.freeze()


def test_llm_freezes_the_start_up_heap_and_thaws_it_when_freed(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=16, max_num_seqs=4)
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # the engine's modules, tokenizer and code
    assert not any(obj is llm.engine for obj in gc.get_objects())  # out of the collector's scans
    out = llm.generate([[1, 306, 4658, 278]], SamplingParams(temperature=0, max_tokens=4, logprobs=2))
    assert len(out[0].outputs[0].token_ids) == 4
    assert 0 < gc.get_freeze_count() <= frozen  # still frozen; generating freezes nothing more

    engine = weakref.ref(llm.engine)
    del llm, out
    assert gc.get_freeze_count() == 0  # thawed as the LLM went
    gc.collect()
    assert engine() is None  # the engine's cycles were collected, not left frozen


def test_freeing_one_of_two_llms_frees_its_engine_and_the_other_freezes_again(tiny_llama_dir: str) -> None:
    """Two LLMs alive: freeing the first thaws the heap, so that the collector frees its engine's
    cycles while the second lives (frozen with the second's, they stayed until the second went: a
    dropped compiled engine's ~600 MB of generated code and weights); the second's next call freezes
    the heap again, after a full collection, and freeing it thaws it."""
    first = LLM(model=tiny_llama_dir, dtype="float32", block_size=16, max_num_seqs=4)
    second = LLM(model=tiny_llama_dir, dtype="float32", block_size=16, max_num_seqs=4)
    engines = [weakref.ref(first.engine), weakref.ref(second.engine)]
    del first
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert engines[0]() is None
    params = SamplingParams(temperature=0, max_tokens=2)
    assert len(second.generate([[1, 306]], params)[0].outputs[0].token_ids) == 2
    assert gc.get_freeze_count() > 10_000
    assert not any(obj is second.engine for obj in gc.get_objects())
    del second
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert engines[1]() is None


def test_an_llm_built_after_another_was_freed_does_not_freeze_its_cycles(tiny_llama_dir: str) -> None:
    """The heap thawed for a freed LLM is collected before a new LLM freezes it: the freed engine's
    cycles are not frozen again with the new one's start-up."""
    first = LLM(model=tiny_llama_dir, dtype="float32", block_size=16, max_num_seqs=4)
    tie: list[object] = [first.engine]  # the engine in a cycle, as a compiled one's generated code is
    tie.append(tie)
    second = LLM(model=tiny_llama_dir, dtype="float32", block_size=16, max_num_seqs=4)  # freezes `tie`
    engine = weakref.ref(first.engine)
    del first, tie
    third = LLM(model=tiny_llama_dir, dtype="float32", block_size=16, max_num_seqs=4)
    assert engine() is None
    assert not any(obj is third.engine or obj is second.engine for obj in gc.get_objects())
    del second, third
    assert gc.get_freeze_count() == 0


def test_a_heap_the_caller_froze_is_left_as_it_is(tiny_llama_dir: str) -> None:
    """The caller's own freeze: the LLM neither freezes more of the heap nor thaws it when freed, and
    its engine, never frozen, is collected."""
    gc.freeze()
    try:
        theirs = gc.get_freeze_count()
        llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=16, max_num_seqs=4)
        assert gc.get_freeze_count() <= theirs  # nothing more frozen (some frozen objects died)
        assert any(obj is llm.engine for obj in gc.get_objects())
        engine = weakref.ref(llm.engine)
        del llm
        assert gc.get_freeze_count() > theirs // 2  # not thawed
        gc.collect()
        assert engine() is None
    finally:
        gc.unfreeze()


def test_the_callers_freeze_once_found_holds_without_counting_again(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found once, the caller's freeze holds for the process's later LLMs: none counts the frozen
    objects again (`gc.get_freeze_count` walks them all), and none freezes the heap, even once the
    caller has thawed it."""
    settings = {"model": tiny_llama_dir, "dtype": "float32", "block_size": 16, "max_num_seqs": 4}
    gc.freeze()
    try:
        LLM(**settings)  # finds the caller's freeze (and is freed at once)
    finally:
        gc.unfreeze()
    counted: list[int] = []
    monkeypatch.setattr(gc, "get_freeze_count", lambda: counted.append(1) or 0)
    llm = LLM(**settings)
    assert counted == []
    assert any(obj is llm.engine for obj in gc.get_objects())  # not frozen
