"""The texts that name logprob tokens (`Logprob.decoded_token`): each is `tokenizer.decode([id])`, and
the engine decodes a token id once, however many steps, requests and prompt positions name it."""

from __future__ import annotations

from typing import Any

import pytest
from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", block_size=16, max_num_seqs=8)


def count_single_token_decodes(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token ids the engine's tokenizer decodes one at a time from here on (a logprob's text)."""
    decoded: list[int] = []
    decode = llm.engine.tokenizer.decode

    def counting(token_ids: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(token_ids, list) and len(token_ids) == 1:
            decoded.append(token_ids[0])
        return decode(token_ids, *args, **kwargs)

    monkeypatch.setattr(llm.engine.tokenizer, "decode", counting)
    return decoded


def namings(outputs: list[Any]) -> list[tuple[int, str | None]]:
    """(token id, text) of every token the outputs' logprobs and prompt logprobs name."""
    found = []
    for out in outputs:
        entries = [*(out.prompt_logprobs or []), *(lp for c in out.outputs for lp in c.logprobs or [])]
        for entry in entries:
            found += [(token_id, logprob.decoded_token) for token_id, logprob in (entry or {}).items()]
    return found


def test_each_token_id_is_decoded_once(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded = count_single_token_decodes(llm, monkeypatch)
    prompts = [[1, 306, 4658, 278, 6593, 310, 2834, 338], [1, 450, 4996, 17354, 1701, 432]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=4, prompt_logprobs=2)

    first = namings(llm.generate(prompts, params, use_tqdm=False))
    named = dict(first)
    assert len(first) > len(named) > 10  # many tokens named, some of them more than once
    assert sorted(decoded) == sorted(named)  # each once
    tokenizer = llm.engine.tokenizer
    assert all(text == tokenizer.decode([token_id]) for token_id, text in named.items())

    decoded.clear()
    again = namings(llm.generate(prompts, params, use_tqdm=False))
    assert decoded == []  # the same tokens: all named from what was decoded before
    assert again == first
