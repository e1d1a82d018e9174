"""Incremental detokenization: deltas concatenate to decode(all ids), multi-byte characters are never
split, and stop strings cut the text exactly, even when they span tokens."""

from __future__ import annotations

import pytest
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from spaced_tokenizer import SpacedSpecialTokens
from transformers import AutoTokenizer

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "Emoji: 😀🎉👍🏽 and accents: café, naïve, Ångström.",
    "中文字符测试：你好，世界。日本語もテストします。",
    "  leading spaces and\ttabs\nnew lines  ",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: str) -> object:
    return AutoTokenizer.from_pretrained(default_model_dir)


def stream(
    tokenizer: object, prompt: list[int], ids: list[int], **kwargs: object
) -> tuple[list[str], str | None]:
    detok = IncrementalDetokenizer(
        tokenizer,
        prompt,
        kwargs.get("stop", []),  # type: ignore[arg-type]
        bool(kwargs.get("include", False)),
        bool(kwargs.get("skip", True)),
        spaces_between_special_tokens=bool(kwargs.get("spaces", True)),
    )
    deltas, hit = [], None
    for i, token in enumerate(ids):
        hit = detok.update([token])
        finished = hit is not None or i == len(ids) - 1
        if finished and hit is None:
            detok.flush()
        deltas.append(detok.take_delta(finished))
        if finished:
            break
    return deltas, hit


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(tokenizer: object, text: str) -> None:
    prompt = tokenizer.encode("Say something:")  # type: ignore[attr-defined]
    ids = tokenizer.encode(text)  # type: ignore[attr-defined]
    deltas, _ = stream(tokenizer, prompt, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
    assert not any("\ufffd" in d for d in deltas)  # no half characters were ever emitted


def test_multibyte_character_split_across_tokens_waits(tokenizer: object) -> None:
    ids = tokenizer.encode("👍🏽")  # type: ignore[attr-defined]
    assert len(ids) > 1  # byte-level BPE splits this emoji's bytes across tokens
    deltas, _ = stream(tokenizer, [], ids)
    assert deltas[0] == "" and "".join(deltas) == "👍🏽"


@pytest.mark.parametrize(
    ("stop", "include"), [("Paris", False), ("of Fra", False), ("France is", True), (".", True)]
)
def test_stop_string_cuts_text_exactly(tokenizer: object, stop: str, include: bool) -> None:
    text = TEXTS[0]
    ids = tokenizer.encode(text)  # type: ignore[attr-defined]
    deltas, hit = stream(tokenizer, [], ids, stop=[stop], include=include)
    index = text.index(stop)
    assert hit == stop
    assert "".join(deltas) == text[: index + len(stop) if include else index]


def test_stop_string_prefix_is_held_back_until_resolved(tokenizer: object) -> None:
    ids = tokenizer.encode("The cat sat on the mat.")  # type: ignore[attr-defined]
    deltas, hit = stream(tokenizer, [], ids, stop=["sat on the rug"])
    assert hit is None
    # the last len(stop) - 1 characters could have begun the stop string: they come only at the end
    assert len(deltas[-1]) >= len("sat on the rug") - 1
    assert "".join(deltas) == "The cat sat on the mat."


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_through_transformers() -> None:
    """The default tokenizer is decoded by the `tokenizers` library directly (the tests above check its
    text against transformers' decode); one whose transformers wrapper cleans up spaces after the
    library's decode keeps that clean-up: "hello, world." and not the library's "hello , world ."."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, ".": 2, "world": 3, ",": 4}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=False)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=True, unk_token="[UNK]"
    )
    ids = wrapped.encode("hello, world.")
    assert backend.decode(ids) == "hello , world ."
    deltas, hit = stream(wrapped, [], ids)
    assert hit is None
    assert "".join(deltas) == wrapped.decode(ids) == "hello, world."


def test_the_default_tokenizer_is_decoded_by_the_tokenizers_library(tokenizer: object) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], [], False, True)
    assert detok._rust_decode is not None


def _with_special_tokens(tokenizer: object) -> list[int]:
    """TEXTS' tokens with special tokens between and inside them: runs of them, one at the start, and
    one between the bytes of a character that several tokens spell."""
    ids: list[int] = [1]  # <|im_start|>
    for i, text in enumerate(TEXTS):
        words = tokenizer.encode(text)  # type: ignore[attr-defined]
        ids += words[:3] + [i + 2, 0] + words[3:] + [2]
    return ids + [*tokenizer.encode("👍🏽")[:1], 4, *tokenizer.encode("👍🏽")[1:]]  # type: ignore[attr-defined]


@pytest.mark.parametrize("spaces", [False, True])
def test_spaces_between_special_tokens_text_is_hf_decode_of_the_same_ids(
    tokenizer: object, spaces: bool
) -> None:
    """Token by token, special tokens shown: the text is transformers' decode of all the ids with the
    same flag (the default tokenizer, a fast one, decodes the same either way, as transformers does)."""
    ids = _with_special_tokens(tokenizer)
    prompt = tokenizer.encode("Say something:")  # type: ignore[attr-defined]
    deltas, hit = stream(tokenizer, prompt, ids, skip=False, spaces=spaces)
    expected = tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=spaces)  # type: ignore[attr-defined]
    assert hit is None and len(deltas) == len(ids)
    assert "".join(deltas) == expected
    assert "<|im_start|>" in expected and "<|endoftext|>" in expected


def test_spaces_between_special_tokens_reaches_a_tokenizer_that_reads_it(default_model_dir: str) -> None:
    """A tokenizer whose decode joins special tokens with spaces: the flag goes to its decode at every
    step, so the text is its decode of all the ids with the flag, spaced or not."""
    spaced = SpacedSpecialTokens.from_pretrained(default_model_dir)
    ids = _with_special_tokens(spaced)
    texts = {}
    for spaces in (True, False):
        deltas, _ = stream(spaced, [], ids, skip=False, spaces=spaces)
        texts[spaces] = "".join(deltas)
        assert texts[spaces] == spaced.decode(ids, spaces_between_special_tokens=spaces)
    assert texts[True] != texts[False] and texts[True].replace(" ", "") == texts[False].replace(" ", "")
    # without special tokens shown, nothing to join: the same text either way
    assert stream(spaced, [], ids, spaces=False)[0] == stream(spaced, [], ids, spaces=True)[0]
