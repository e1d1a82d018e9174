"""`LLM` freezes the heap once its engine is built (full collections then skip the start-up's objects,
as in `pagedserve serve`), and thaws it when freed, so that the engine's reference cycles are still
collected: a process that builds one LLM after another keeps no engine behind."""

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
