"""Audit of incremental detokenization and stop strings: a request's streamed text deltas concatenate
to its final text, which is `tokenizer.decode(output ids)` cut where vLLM cuts at a stop string.

A seeded fuzz drives the detokenizer the way the engine does, with random token ids (byte tokens,
split emoji and CJK, special tokens, words with and without a leading space), random stop strings
drawn from the decoded text, and checks it against the tokenizer's own `decode`. Then the real engine
on a tiny model that mostly says such tokens: a stop string taken from a first run's text cuts the
same run repeated, and every stream (n > 1, a stream interval, an abort) adds up to decode(ids).

What "where vLLM cuts" means (vLLM's v1 detokenizer where it defines it, our choice where not):
- the text ends before the stop string, or after it with `include_stop_str_in_output`, and nothing
  after it is ever streamed;
- several stop strings completing in the same step: the one that ends first wins, ties to the first
  listed, i.e. where generation stops had each character been its own token (vLLM takes the first
  listed that occurs anywhere in the step's text, so its cut depends on how the text was tokenized);
- a stop string completed within the first `min_tokens` tokens does not count (vLLM #22014);
- a sequence ended by EOS or a stop token id leaves that token's text out unless
  `include_stop_str_in_output`, also with `skip_special_tokens=False` (vLLM #14624);
- bytes of a character still incomplete when the output ends are kept as U+FFFD, as decode() does;
- the text is decode(output ids) whatever the prompt: a prompt ending inside a character lends the
  output's first character none of its bytes (vLLM decodes them together; a prompt made of text
  never ends inside a character, only raw prompt ids can).
"""

from __future__ import annotations

import asyncio
import random
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pagedserve import LLM, SamplingParams
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.outputs import RequestDelta
from transformers import AutoTokenizer

VOCAB_SIZE = 49152
NUM_SPECIAL = 17  # ids 0..16 are special tokens; 2 (<|im_end|>) is EOS
EOS = 2
MULTIBYTE_TEXTS = [
    "😀🎉👍🏽",
    "中文字符测试，你好",
    "café naïve Ångström",
    "日本語のテキスト",
    "🇫🇷🇯🇵",
    "€5 — “ok”",
    "\ufffd",
]
WORDS = [" hello", "hello", " world", "world", " the", "the", " is", ".", ",", "\n", " ", "  ", "ab", " cd"]
ABSENT_STOPS = ["xyzzy", "\n\n\n", "<|im_end|>"]
REPLACEMENT = "\ufffd"


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte -> character map: a byte-level BPE vocabulary spells byte b as this character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = dict(zip(printable, printable, strict=True)), 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {b: chr(c) for b, c in chars.items()}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: str) -> Any:
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def byte_ids(tokenizer: Any) -> dict[int, int]:
    """Token id of each byte 0x80..0xFF that has one (C0, C1, F5.. never occur in UTF-8)."""
    vocab, chars = tokenizer.get_vocab(), _byte_level_chars()
    return {b: vocab[chars[b]] for b in range(0x80, 0x100) if chars[b] in vocab}


@pytest.fixture(scope="module")
def pools(tokenizer: Any, byte_ids: dict[int, int]) -> dict[str, list[list[int]]]:
    return {
        "bytes": [[i] for i in byte_ids.values()],
        "multibyte": [tokenizer.encode(t) for t in MULTIBYTE_TEXTS],
        "special": [[i] for i in range(NUM_SPECIAL)],
        "words": [tokenizer.encode(w) for w in WORDS],
    }


# -- the oracle: what the text must be, from decode() alone ---------------------------------------------


def stable_lengths(tokenizer: Any, ids: list[int], skip: bool) -> list[int]:
    """Characters of text the first k tokens settle, for each k: decode(ids[:k]) unless it ends in an
    incomplete character (U+FFFD), which waits for the next token."""
    lengths = [0]
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=skip)
        lengths.append(lengths[-1] if text.endswith(REPLACEMENT) else len(text))
    return lengths


def expected_text(
    tokenizer: Any,
    ids: list[int],
    stop: list[str],
    include: bool,
    skip: bool,
    min_tokens: int = 0,
    stop_terminated: bool = False,
) -> tuple[str, str | None]:
    """decode(ids) cut at the stop string that ends first after the first min_tokens tokens' text."""
    if stop_terminated and not include:
        ids = ids[:-1]  # the EOS or stop token's own text is left out
    text = tokenizer.decode(ids, skip_special_tokens=skip)
    if min_tokens >= len(ids):
        return text, None
    boundary = stable_lengths(tokenizer, ids[:min_tokens], skip)[-1]
    first: tuple[int, int, str] | None = None  # (end, list position, stop string)
    for position, s in enumerate(stop):
        index = text.find(s, max(0, boundary - len(s) + 1))
        if index != -1 and (first is None or (index + len(s), position) < first[:2]):
            first = (index + len(s), position, s)
    if first is None:
        return text, None
    end, _, s = first
    return text[: end if include else end - len(s)], s


def stream(
    tokenizer: Any,
    prompt: list[int],
    ids: list[int],
    stop: list[str],
    include: bool = False,
    skip: bool = True,
    min_tokens: int = 0,
    stop_terminated: bool = False,
) -> tuple[list[str], str | None]:
    """Feed tokens one a step as LLMEngine._process_outputs does; the deltas and the stop string hit."""
    detok = IncrementalDetokenizer(tokenizer, prompt, stop, include, skip, min_tokens)
    deltas: list[str] = []
    hit = None
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        hit = detok.update([token], stop_terminated and last)
        if hit is None and last:
            hit = detok.flush()
        deltas.append(detok.take_delta(finished=hit is not None or last))
        if hit is not None:
            break
    return deltas, hit


def assert_stream_is_prefix_of(deltas: list[str], text: str) -> None:
    """Each step's text so far begins the final text: no U+FFFD for a character completed later,
    nothing after a stop string."""
    so_far = ""
    for step, delta in enumerate(deltas):
        so_far += delta
        assert text.startswith(so_far), f"step {step}: streamed {so_far!r}, final {text!r}"
    assert so_far == text


# -- the fuzz ------------------------------------------------------------------------------------------


def random_ids(rng: random.Random, pools: dict[str, list[list[int]]], length: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < length:
        r = rng.random()
        if r < 0.2:
            ids += rng.choice(pools["bytes"])
        elif r < 0.35:
            ids += rng.choice(pools["multibyte"])
        elif r < 0.45:
            ids += rng.choice(pools["special"])
        elif r < 0.7:
            ids += rng.choice(pools["words"])
        else:
            ids.append(rng.randrange(NUM_SPECIAL, VOCAB_SIZE))
    return ids[:length]


def random_stops(rng: random.Random, text: str) -> list[str]:
    """0 to 3 stop strings, mostly pieces of the text itself (across tokens, inside one, the start)."""
    stops = []
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        if text and rng.random() < 0.85:
            start = rng.choice([0, rng.randrange(len(text))])
            stops.append(text[start : start + rng.randrange(1, 8)])
        else:
            stops.append(rng.choice(ABSENT_STOPS))
    return stops


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_deltas_add_up_to_decode_cut_at_the_first_stop(
    tokenizer: Any, pools: dict[str, list[list[int]]], seed: int
) -> None:
    rng = random.Random(seed)
    for case in range(1500):
        ids = random_ids(rng, pools, rng.randrange(1, 40))
        prompt = random_ids(rng, pools, rng.randrange(1, 8))  # may end inside a character or a word
        skip, include = rng.random() < 0.5, rng.random() < 0.5
        stop = random_stops(rng, tokenizer.decode(ids, skip_special_tokens=skip))
        min_tokens = rng.choice([0, 0, rng.randrange(len(ids) + 1)])
        stop_terminated = rng.random() < 0.25  # the last token is EOS or a stop token id
        context = f"case {case}: prompt={prompt} ids={ids} stop={stop} include={include} skip={skip} " + (
            f"min_tokens={min_tokens} stop_terminated={stop_terminated}"
        )

        deltas, hit = stream(tokenizer, prompt, ids, stop, include, skip, min_tokens, stop_terminated)
        text, stop_hit = expected_text(tokenizer, ids, stop, include, skip, min_tokens, stop_terminated)
        assert (hit, "".join(deltas)) == (stop_hit, text), context
        assert_stream_is_prefix_of(deltas, text)
        # ... and holds back no more than a stop string's start: with the stop string kept, nothing
        hold_back = max(len(s) for s in stop) - 1 if stop and not include else 0
        settled = stable_lengths(tokenizer, ids, skip)
        sent = 0
        for k, delta in enumerate(deltas[:-1], start=1):
            sent += len(delta)
            assert sent >= settled[k] - hold_back, f"{context}: step {k} sent {sent} of {settled[k]}"


# -- one defect each -----------------------------------------------------------------------------------


def test_a_prompt_ending_inside_a_character_lends_no_bytes_to_the_output(
    tokenizer: Any, byte_ids: dict[int, int]
) -> None:
    """A prompt whose ids end with the first two bytes of 中 (E4 B8 AD): decoding the prompt context
    with the output made the output's lone AD complete 中, text that decode(output ids) never has."""
    prompt = tokenizer.encode("x") + [byte_ids[0xE4], byte_ids[0xB8]]
    ids = [byte_ids[0xAD], *tokenizer.encode(" ok")]
    deltas, _ = stream(tokenizer, prompt, ids, [])
    assert "".join(deltas) == tokenizer.decode(ids) == "\ufffd ok"


def test_of_two_stop_strings_in_one_token_the_one_ending_first_wins(tokenizer: Any) -> None:
    """ " hello" is one token: "el" ends before "llo" does, though listed after it."""
    ids = tokenizer.encode(" hello world")
    assert tokenizer.decode(ids[:1]) == " hello"
    assert stream(tokenizer, [], ids, ["llo", "el"]) == ([" h"], "el")
    assert stream(tokenizer, [], ids, ["llo", "el"], include=True) == ([" hel"], "el")
    # ending together: the first listed, like vLLM
    assert stream(tokenizer, [], ids, ["lo", "llo"]) == ([" hel"], "lo")


def test_text_completed_only_at_the_end_is_searched_for_stop_strings(tokenizer: Any) -> None:
    """Token 40303 is " " and the first 3 bytes of an emoji: its text waits for the 4th byte; when
    max_tokens ends the output there, the flushed " \ufffd" completes the stop string " "."""
    ids = [*tokenizer.encode("x"), 40303]
    assert tokenizer.decode(ids) == "x \ufffd"
    assert stream(tokenizer, [], ids, [" "]) == (["x", ""], " ")
    assert stream(tokenizer, [], ids, []) == (["x", " \ufffd"], None)  # kept, as decode() does


@pytest.mark.parametrize(("min_tokens", "text"), [(0, " is L"), (5, " is Lee, and I'm a stud")])
def test_stop_strings_within_min_tokens_do_not_count(tokenizer: Any, min_tokens: int, text: str) -> None:
    """vLLM's test_min_tokens_with_stop: "e" in " Lee" is the 2nd token, within min_tokens=5."""
    ids = tokenizer.encode(" is Lee, and I'm a student in the college of engineering")
    deltas, hit = stream(tokenizer, [], ids, ["e"], min_tokens=min_tokens)
    assert ("".join(deltas), hit) == (text, "e")


@pytest.mark.parametrize("include", [False, True])
def test_the_text_of_the_token_that_stopped_generation_is_left_out(tokenizer: Any, include: bool) -> None:
    """EOS with skip_special_tokens=False, and a stop token id that is an ordinary word: vLLM leaves
    its text out unless include_stop_str_in_output."""
    words = tokenizer.encode(" hello world")
    eos_deltas, _ = stream(tokenizer, [], [*words, EOS], [], include, skip=False, stop_terminated=True)
    word_deltas, _ = stream(tokenizer, [], words, [], include, stop_terminated=True)
    assert "".join(eos_deltas) == (" hello world<|im_end|>" if include else " hello world")
    assert "".join(word_deltas) == (" hello world" if include else " hello")


def test_with_the_stop_string_kept_nothing_is_held_back(tokenizer: Any) -> None:
    """A stop string kept in the output can never cut text already decoded (as vLLM reasons): each
    token's text is sent at once, not len(stop) - 1 characters late."""
    ids = tokenizer.encode(" hello world.\n")
    deltas, hit = stream(tokenizer, [], ids, ["never in this text"], include=True)
    assert hit is None and deltas == [" hello", " world", ".", "\n"]


# -- the engine ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory, tokenizer: Any, byte_ids: dict[int, int]
) -> LLM:
    """The tiny Llama with its LM-head rows for byte tokens, split emoji and CJK, special tokens and
    a few words scaled up: random weights then mostly say those, so the engine's streams meet
    incomplete characters, EOS and special tokens, not only whole words."""
    import torch
    from safetensors.torch import load_file, save_file

    dest = tmp_path_factory.mktemp("byte-heavy-llama")
    for path in Path(tiny_llama_dir).iterdir():
        shutil.copy(path, dest / path.name)
    weights = load_file(dest / "model.safetensors")
    rows = {*byte_ids.values(), *range(NUM_SPECIAL)}
    rows |= {i for t in MULTIBYTE_TEXTS + WORDS for i in tokenizer.encode(t)}
    scale = torch.ones(VOCAB_SIZE, 1)
    scale[sorted(rows)] = 8.0
    weights["lm_head.weight"] = weights["lm_head.weight"] * scale
    save_file(weights, dest / "model.safetensors")
    return LLM(model=str(dest), dtype="float32", num_kv_blocks=256, block_size=16)


PROMPTS = {
    "words": "The capital of France is",
    "mid-word": "The capi",  # the first output token's leading space is its own
    "cjk": "中文字符测试：",
}


def run_deltas(
    llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[tuple[str, int], list[RequestDelta]]:
    """All requests in one batch, stepped by hand: each completion's deltas, in order."""
    for request_id, (prompt, params) in requests.items():
        llm.engine.add_request(request_id, prompt, params)
    deltas: dict[tuple[str, int], list[RequestDelta]] = {}
    while llm.engine.has_unfinished_requests():
        for delta in llm.engine.step():
            deltas.setdefault((delta.request_id, delta.index), []).append(delta)
    return deltas


def test_engine_streams_add_up_to_decode_of_their_tokens(
    llm: LLM, tokenizer: Any, byte_ids: dict[int, int]
) -> None:
    """n = 2 seeded completions per prompt, skip_special_tokens on and off, EOS allowed, and a prompt
    of raw ids ending inside a character: every completion's deltas add up to decode(its ids), less
    the text of an EOS or stop token that ended it, and never stream what the end does not have."""
    prompts = [tokenizer.encode(p) for p in PROMPTS.values()]
    prompts.append([*tokenizer.encode("x"), byte_ids[0xE4], byte_ids[0xB8]])
    requests = {}
    for i, prompt in enumerate(prompts):
        for skip in (True, False):
            params = SamplingParams(
                n=2,
                temperature=1.0,
                seed=10 * i,  # the same tokens shown with and without special tokens
                max_tokens=20,
                skip_special_tokens=skip,
                stop_token_ids=[12],  # <jupyter_text>, which this model often says
            )
            requests[f"{i}-{skip}"] = (prompt, params)
    deltas = run_deltas(llm, requests)

    assert len(deltas) == 2 * len(requests)
    seen: set[str] = set()
    for (request_id, _), completion in deltas.items():
        skip = requests[request_id][1].skip_special_tokens
        ids = [t for d in completion for t in d.new_token_ids]
        finish = completion[-1].finish_reason
        assert completion[-1].finished and finish in ("length", "eos", "stop")
        text = tokenizer.decode(ids[:-1] if finish in ("eos", "stop") else ids, skip_special_tokens=skip)
        assert_stream_is_prefix_of([d.new_text for d in completion], text)
        seen |= {finish, f"{finish}, skip={skip}", *(["bytes"] if REPLACEMENT in text else [])}
    # the model did say what this test is about, and a stop token shown as text was left out
    assert {"length", "bytes", "stop, skip=False"} <= seen, seen


def test_stop_strings_from_a_first_run_cut_the_same_run_repeated(llm: LLM, tokenizer: Any) -> None:
    """Seeded runs, then the same runs with stop strings taken from their text: across tokens, inside
    one token with characters after it, at the very first token, a later-listed one that ends first,
    kept or not, and with min_tokens. Same tokens up to the stop, text cut as decode() says."""
    prompts = [tokenizer.encode(p) for p in PROMPTS.values()]
    base = {
        f"r{i}": (prompt, SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True))
        for i, prompt in enumerate(prompts * 2)
    }
    first = run_deltas(llm, base)
    rng = random.Random(7)
    repeats, expected = {}, {}
    for request_id, (prompt, params) in base.items():
        ids = [t for d in first[(request_id, 0)] for t in d.new_token_ids]
        text = tokenizer.decode(ids)
        stops = [
            [text[:1]],  # completed by the very first token
            [text[2:9], text[4:6]],  # the later listed ends first
            random_stops(rng, text) or [text[:2]],  # across tokens, inside one, absent
            random_stops(rng, text) or [text[:2]],
        ]
        for variant, stop in enumerate(stops):
            include, min_tokens = rng.random() < 0.5, rng.choice([0, 0, 3])
            repeated = SamplingParams(
                temperature=1.0, seed=params.seed, max_tokens=24, ignore_eos=True,
                stop=stop, include_stop_str_in_output=include, min_tokens=min_tokens,
            )  # fmt: skip
            repeats[f"{request_id}-{variant}"] = (prompt, repeated)
            expected[f"{request_id}-{variant}"] = (
                ids,
                expected_text(tokenizer, ids, stop, include, True, min_tokens),
            )
    again = run_deltas(llm, repeats)

    num_stopped = 0
    for request_id, (ids, (text, stop_hit)) in expected.items():
        completion = again[(request_id, 0)]
        got_ids = [t for d in completion for t in d.new_token_ids]
        assert got_ids == ids[: len(got_ids)], request_id
        assert_stream_is_prefix_of([d.new_text for d in completion], text)
        assert completion[-1].finish_reason == ("stop" if stop_hit is not None else "length"), request_id
        if stop_hit is not None:  # at the token whose text completed the stop string, not later
            num_stopped += 1
            kept = repeats[request_id][1].include_stop_str_in_output
            stop_end = len(text) if kept else len(text) + len(stop_hit)
            assert stable_lengths(tokenizer, got_ids, True)[-2] < stop_end, request_id
    assert num_stopped >= len(expected) // 2


def test_stop_token_ids_leave_their_text_out_unless_kept(llm: LLM, tokenizer: Any) -> None:
    prompt = tokenizer.encode(PROMPTS["words"])
    ids = (
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    stop_id = ids[4]
    first = ids.index(stop_id)
    for include in (False, True):
        params = SamplingParams(
            temperature=0, max_tokens=12, stop_token_ids=[stop_id], include_stop_str_in_output=include
        )
        out = llm.generate([prompt], params)[0].outputs[0]
        assert out.token_ids == ids[: first + 1] and out.finish_reason == "stop"
        assert out.text == tokenizer.decode(ids[: first + 1 if include else first])


def test_an_abort_sends_the_text_held_back_for_a_stop_string(llm: LLM, tokenizer: Any) -> None:
    """A stop string 20 characters long holds back 19: an abort ends the stream with them."""
    prompt = tokenizer.encode(PROMPTS["words"])
    llm.engine.add_request(
        "held", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=["x" * 20])
    )
    deltas = [d for _ in range(6) for d in llm.engine.step()]
    deltas += llm.engine.abort_request(["held"])
    ids = [t for d in deltas for t in d.new_token_ids]
    assert deltas[-1].finish_reason == "aborted" and len(ids) == 6
    assert "".join(d.new_text for d in deltas) == tokenizer.decode(ids)


def test_a_stream_interval_joins_deltas_into_the_same_text(llm: LLM, tokenizer: Any) -> None:
    """--stream-interval 3, n = 2 and a stop string: per completion, the joined deltas' text is the
    offline result's text."""
    prompt = tokenizer.encode(PROMPTS["mid-word"])
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    offline = llm.generate([prompt], params)[0].outputs
    params = replace(params, stop=[offline[1].text[5:8]])
    offline = llm.generate([prompt], params)[0].outputs

    async def scenario() -> list[RequestDelta]:
        engine = AsyncEngine(llm.engine, stream_interval=3)
        engine.start()
        deltas = [d async for d in engine.generate("interval", prompt, params)]
        await engine.halt()  # not stop(): that shuts down the executor the module's LLM goes on using
        return deltas

    deltas = asyncio.run(scenario())
    for completion in offline:
        mine = [d for d in deltas if d.index == completion.index]
        assert "".join(d.new_text for d in mine) == completion.text
        assert [t for d in mine for t in d.new_token_ids] == completion.token_ids
    assert offline[1].finish_reason == "stop"
