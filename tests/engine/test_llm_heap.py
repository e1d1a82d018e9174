"""`LLM` freezes the heap once its engine is built (full collections then skip the start-up's objects,
as in `pagedserve serve`), and thaws it when the last one alive is freed, so that the engines'
reference cycles are still collected: a process that builds one LLM after another keeps no engine
behind. A heap the caller froze is theirs: left as it is."""

from __future__ import annotations

import gc
import weakref

from pagedserve import LLM, SamplingParams


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


def test_the_heap_thaws_when_the_last_llm_goes_not_the_first(tiny_llama_dir: str) -> None:
    """Two LLMs alive: freeing the first leaves the second's heap frozen (its full collections still
    skip the start-up); freeing the second thaws it, and both engines are collected."""
    first = LLM(model=tiny_llama_dir, dtype="float32", block_size=16, max_num_seqs=4)
    second = LLM(model=tiny_llama_dir, dtype="float32", block_size=16, max_num_seqs=4)
    engines = [weakref.ref(first.engine), weakref.ref(second.engine)]
    frozen = gc.get_freeze_count()
    del first
    # the first's objects that reference counting frees leave the frozen set; the rest stays frozen
    assert gc.get_freeze_count() > frozen // 2
    assert not any(obj is second.engine for obj in gc.get_objects())
    del second
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert [engine() for engine in engines] == [None, None]


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
