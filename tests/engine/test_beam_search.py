"""`LLM.beam_search` (vLLM's API) against greedy `generate` and Hugging Face's beam search.

HF's `generate(num_beams=k, num_return_sequences=k, do_sample=False)` runs vLLM's algorithm where
`early_stopping="never"` (HF stops only when no running beam can beat the finished ones, which with
`length_penalty=0` is exact) and the ranking does not depend on the length: `length_penalty=0`, or
beams all of one length (no EOS). Two places where the two part on purpose are checked apart: vLLM's
length counts the prompt and not a final EOS, HF's only the generated tokens with the EOS (so with
`length_penalty=1` a short finished beam ranks higher here); and vLLM keeps every EOS candidate as a
finished beam where HF keeps only those among the step's best k (no case of it here)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from pagedserve import LLM, BeamSearchParams, SamplingParams
from pagedserve.beam_search import BeamSearchSequence, beam_search_score

PROMPTS = [
    "The capital of France is",
    "Once upon a time in a land far away there lived a very old king who",
    "Hi",
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, block_size=16)


@pytest.fixture(scope="module")
def eos_model_dir(tiny_llama_dir: str, llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with an EOS it emits: the second token of PROMPTS[0]'s greedy output (a
    generation_config.json naming it and the tokenizer's EOS, as both the engine and HF read it)."""
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eos = greedy[0].outputs[0].token_ids[1]
    dest = tmp_path_factory.mktemp("tiny-eos")
    shutil.copytree(tiny_llama_dir, dest, dirs_exist_ok=True)
    tokenizer_eos = llm.get_tokenizer().eos_token_id
    (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, tokenizer_eos]}))
    return str(dest)


@pytest.fixture(scope="module")
def eos_llm(eos_model_dir: str) -> LLM:
    return LLM(model=eos_model_dir, dtype="float32", num_kv_blocks=256, block_size=16)


def hf_beams(
    model_dir: str,
    prompt: list[int],
    k: int,
    *,
    eos: list[int] | None,
    length_penalty: float,
    max_new_tokens: int = MAX_TOKENS,
) -> tuple[list[list[int]], list[float] | None]:
    """HF's k best beams (generated tokens, cut after the first EOS) and their scores (None for k = 1:
    HF then runs greedy search, which scores nothing)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=0,
            length_penalty=length_penalty,
            early_stopping="never",
            output_scores=True,
            return_dict_in_generate=True,
        )
    beams = []
    for row in out.sequences[:, len(prompt) :].tolist():
        ends = [i for i, token in enumerate(row) if token in (eos or [])]
        beams.append(row[: ends[0] + 1] if ends else row)
    return beams, out.sequences_scores.tolist() if k > 1 else None


def test_beam_width_1_is_greedy(llm: LLM) -> None:
    """Prompts as text, token ids and a prompt dict, of different lengths, in one call."""
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer.encode(p) for p in PROMPTS]
    prompts = [PROMPTS[0], ids[1], {"prompt": PROMPTS[2]}]
    greedy = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    )
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt_ids, want, got in zip(ids, greedy, beams, strict=True):
        (beam,) = got.sequences
        assert beam.tokens == prompt_ids + want.outputs[0].token_ids
        assert beam.cum_logprob == pytest.approx(want.outputs[0].cumulative_logprob, abs=1e-4)
        assert len(beam.logprobs) == MAX_TOKENS
        assert beam.text == tokenizer.decode(beam.tokens)  # the prompt's text too, as vLLM's
        assert beam.finish_reason == "length"


@pytest.mark.parametrize("k", [2, 4])
def test_equals_hf_beam_search(llm: LLM, tiny_llama_dir: str, k: int) -> None:
    """No EOS: HF ranks by cumulative logprob as vLLM does (all beams one length). Every round's
    beams rerun their prefix, which the prefix cache holds."""
    before = llm.engine.stats()
    outputs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=k, max_tokens=MAX_TOKENS, ignore_eos=True))
    after = llm.engine.stats()
    assert after.num_prefix_hits - before.num_prefix_hits > 0
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer.encode(prompt)
        want, scores = hf_beams(tiny_llama_dir, ids, k, eos=None, length_penalty=1.0)
        assert [beam.tokens[len(ids) :] for beam in output.sequences] == want
        # HF's score: the cumulative logprob over the generated length
        got = [beam.cum_logprob / MAX_TOKENS for beam in output.sequences]
        assert got == pytest.approx(scores, abs=1e-4)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_eos_equals_hf_beam_search(eos_llm: LLM, eos_model_dir: str, k: int) -> None:
    """PROMPTS[0] reaches the EOS after two tokens: that beam is finished (and ranks first at
    length_penalty 0), the others run to max_tokens."""
    llm = eos_llm
    eos_ids = sorted(llm.engine.eos_token_ids)
    outputs = llm.beam_search(
        PROMPTS, BeamSearchParams(beam_width=k, max_tokens=MAX_TOKENS, length_penalty=0.0)
    )
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer.encode(prompt)
        want, scores = hf_beams(eos_model_dir, ids, k, eos=eos_ids, length_penalty=0.0)
        assert [beam.tokens[len(ids) :] for beam in output.sequences] == want
        if scores is not None:
            assert [beam.cum_logprob for beam in output.sequences] == pytest.approx(scores, abs=1e-4)
    first = outputs[0].sequences[0]
    assert len(first.tokens) == len(tokenizer.encode(PROMPTS[0])) + 2
    assert first.finish_reason == "stop" and first.stop_reason == first.tokens[-1] in eos_ids
    assert all(beam.finish_reason == "length" for beam in outputs[0].sequences[1:])


def test_length_penalty_counts_the_prompt(eos_llm: LLM, eos_model_dir: str) -> None:
    """vLLM's score: cum_logprob / len ** length_penalty, len counting the prompt and not a final EOS.
    At length_penalty 1 the two-token EOS beam of PROMPTS[0] ranks first (HF, counting only generated
    tokens, ranks it last: this is where the two part)."""
    eos_ids = eos_llm.engine.eos_token_ids
    (output,) = eos_llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=MAX_TOKENS))
    scores = [b.cum_logprob / (len(b.tokens) - (b.tokens[-1] in eos_ids)) for b in output.sequences]
    assert scores == sorted(scores, reverse=True)
    assert output.sequences[0].finish_reason == "stop"
    ids = eos_llm.get_tokenizer().encode(PROMPTS[0])
    want, _ = hf_beams(eos_model_dir, ids, 2, eos=sorted(eos_ids), length_penalty=1.0)
    assert want[0] != output.sequences[0].tokens[len(ids) :]


def test_the_score_is_vllms() -> None:
    """vLLM's get_beam_search_score exactly: the length counts the prompt and not a final EOS token
    (the test above ranks beams whose order these details do not change)."""
    eos = frozenset({9})
    ended = BeamSearchSequence([1, 2, 3, 4, 9], [], cum_logprob=-2.0)  # 4 tokens, the EOS not counted
    live = BeamSearchSequence([1, 2, 3, 4, 5], [], cum_logprob=-2.0)
    assert beam_search_score(ended, eos, 1.0) == -2.0 / 4
    assert beam_search_score(live, eos, 1.0) == -2.0 / 5
    assert beam_search_score(live, eos, 2.0) == -2.0 / 25
    assert beam_search_score(live, eos, 0.0) == -2.0


def test_concurrency_limit_gives_the_same_beams(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    together = llm.beam_search(PROMPTS, params)
    one_by_one = llm.beam_search(PROMPTS, params, concurrency_limit=1)
    assert [[b.tokens for b in o.sequences] for o in one_by_one] == [
        [b.tokens for b in o.sequences] for o in together
    ]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("beam_width", 0),
        ("beam_width", 11),  # 2 * beam_width logprobs: at most 20
        ("beam_width", 2.0),
        ("max_tokens", 0),
        ("max_tokens", None),
        ("ignore_eos", "no"),
        ("include_stop_str_in_output", 1),
        ("temperature", -0.5),
        ("temperature", float("inf")),
        ("length_penalty", float("nan")),
        ("length_penalty", "1"),
    ],
)
def test_bad_params_are_refused_by_name(field: str, value: object) -> None:
    params: dict[str, object] = {"beam_width": 2, "max_tokens": 4, field: value}
    with pytest.raises(ValueError, match=f"^{field}: "):
        BeamSearchParams(**params)  # type: ignore[arg-type]


def test_bad_call_is_refused_by_name(llm: LLM) -> None:
    with pytest.raises(ValueError, match="^params: "):
        llm.beam_search(PROMPTS, SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^concurrency_limit: "):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=0)


@pytest.mark.slow
def test_default_model_equals_hf_beam_search() -> None:
    """The default model ends a short chat answer with its EOS (<|im_end|>); at length_penalty 0
    its beams equal HF's, finished and unfinished."""
    from pagedserve.default_model import resolve_model_path

    llm = LLM(dtype="float32")
    ids = llm.engine.encode_chat([{"role": "user", "content": "Hi!"}])
    params = BeamSearchParams(beam_width=2, max_tokens=32, length_penalty=0.0)
    (output,) = llm.beam_search([ids], params)
    eos_ids = sorted(llm.engine.eos_token_ids)
    model_dir = str(resolve_model_path(None))
    want, _ = hf_beams(model_dir, ids, 2, eos=eos_ids, length_penalty=0.0, max_new_tokens=32)
    assert [beam.tokens[len(ids) :] for beam in output.sequences] == want
    assert output.sequences[0].finish_reason == "stop"
