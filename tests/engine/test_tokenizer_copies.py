"""An engine built again in the same process copies the tokenizer it loaded before (`load_tokenizer`'s
`_Loaded`) rather than loading it again: each copy a tokenizer of its own, that tokenizes, detokenizes
and applies the chat template as a load does; a file of the directory written since loads it afresh."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from pagedserve import LLM, SamplingParams
from pagedserve.tokenizer import load_tokenizer
from tiny_models import copy_tokenizer

TEXTS = ["The capital of France is", "  two  spaces, naïve café 世界 🙂", "<|im_start|>user\nhi<|im_end|>"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class _Model:
    """What load_tokenizer reads of a ModelConfig."""

    def __init__(self, path: Path) -> None:
        self.path = self.tokenizer_path = str(path)


@pytest.fixture
def tokenizer_dir(tiny_llama_dir: str, tmp_path: Path) -> Path:
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    copy_tokenizer(tiny_llama_dir, folder)
    return folder


def loads_counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths transformers loads a tokenizer from from now on (its own loader still runs)."""
    loads: list[str] = []
    load = transformers.AutoTokenizer.from_pretrained

    def counted(path: str, *args: object, **kwargs: object) -> object:
        loads.append(path)
        return load(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    return loads


def test_a_second_load_is_a_copy_of_its_own_that_tokenizes_as_the_first(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads = loads_counted(monkeypatch)
    first = load_tokenizer(_Model(tokenizer_dir))
    first.chat_template = "{{ messages[0]['content'] }}"  # what an engine's --chat-template does
    second = load_tokenizer(_Model(tokenizer_dir))
    assert loads == [str(tokenizer_dir)]  # loaded once
    assert second is not first and second._tokenizer is not first._tokenizer  # not shared between threads
    assert type(second) is type(first)
    for text in TEXTS:
        ids = first.encode(text)
        assert second.encode(text) == ids
        assert second.decode(ids) == first.decode(ids)
        assert second.decode(ids, skip_special_tokens=True) == first.decode(ids, skip_special_tokens=True)
    assert second.convert_ids_to_tokens(list(range(10))) == first.convert_ids_to_tokens(list(range(10)))
    assert (second.eos_token_id, second.all_special_ids) == (first.eos_token_id, first.all_special_ids)
    # the chat template one engine set stays its own: the copy has the directory's
    assert second.apply_chat_template(QUESTION, tokenize=False).startswith("<|im_start|>")
    assert first.apply_chat_template(QUESTION, tokenize=False) == QUESTION[0]["content"]
    # and what is set on a copy reaches no later copy
    second.chat_template = "{{ 'set on a copy' }}"
    second.add_special_tokens({"additional_special_tokens": ["<extra_token_of_one_copy>"]})
    third = load_tokenizer(_Model(tokenizer_dir))
    assert third.apply_chat_template(QUESTION, tokenize=False).startswith("<|im_start|>")
    assert "<extra_token_of_one_copy>" not in third.get_vocab()
    assert "<extra_token_of_one_copy>" not in third.all_special_tokens
    assert len(third) == len(first)


@pytest.mark.parametrize("written", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_file_written_since_loads_the_tokenizer_again(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch, written: str
) -> None:
    loads = loads_counted(monkeypatch)
    before = load_tokenizer(_Model(tokenizer_dir))
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    if written == "chat_template.jinja":
        (tokenizer_dir / written).write_text(template)
    else:
        (tokenizer_dir / "chat_template.jinja").unlink()
        config = json.loads((tokenizer_dir / written).read_text())
        (tokenizer_dir / written).write_text(json.dumps({**config, "chat_template": template}))
    after = load_tokenizer(_Model(tokenizer_dir))
    assert loads == [str(tokenizer_dir)] * 2
    assert before.apply_chat_template(QUESTION, tokenize=False).startswith("<|im_start|>")
    assert after.apply_chat_template(QUESTION, tokenize=False) == "[user] What is the capital of France?"


def test_engines_built_one_after_another_each_chat_with_their_own_template(tiny_llama_dir: str) -> None:
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    engine = {"dtype": "float32", "num_kv_blocks": 64}
    plain = LLM(model=tiny_llama_dir, chat_template="[{{ messages[0]['content'] }}]", **engine)
    own = LLM(model=tiny_llama_dir, **engine)
    assert plain.chat(QUESTION, one_token)[0].prompt == "[What is the capital of France?]"
    prompt = own.chat(QUESTION, one_token)[0].prompt
    assert prompt is not None and prompt.startswith("<|im_start|>")
    assert own.generate(TEXTS[:1], one_token)[0].prompt_token_ids == plain.get_tokenizer().encode(TEXTS[0])
