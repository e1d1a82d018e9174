"""The offline API as a vLLM user drives it, on the tiny random Llama: a failed request, a bad prompt or a
Ctrl-C leaves none of the call's requests in the engine (the next call used to step them and fail with
a KeyError), nor one a step cut short had ended; a call returns with no request state left in the
worker; edge inputs get vLLM's answers or a ValueError naming the parameter, and the LLM stays usable
after each."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from pagedserve import LLM, SamplingParams
from pagedserve.errors import InvalidRequestError

PROMPTS = [[1, 300, 301, 302], [1, 500, 600, 700, 800, 900], [1, 42]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128, block_size=16, max_num_seqs=8)


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [c.token_ids for out in outputs for c in out.outputs]


def assert_idle(llm: LLM) -> None:
    """No request of any call in the scheduler, the block manager or the worker."""
    stats = llm.engine.stats()
    assert (stats.num_unfinished, stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks
    runner = llm.engine.executor.worker.model_runner  # type: ignore[attr-defined]
    assert runner.requests == {}
    assert sorted(runner.free_rows) == list(range(len(runner.block_tables)))
    assert not llm.engine.has_work()


def test_generate_returns_with_no_request_state_left_in_the_worker(llm: LLM) -> None:
    """The workers drop an ended request's state with the next step: offline that step used to wait for
    the next call, holding the last batch's rows and sampling state (with its token history)."""
    penalized = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, repetition_penalty=1.2)
    outputs = llm.generate(PROMPTS, [GREEDY, penalized, GREEDY])
    assert [len(out.outputs) for out in outputs] == [1, 2, 1]
    assert_idle(llm)
    llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    assert_idle(llm)


def test_a_failed_request_leaves_none_of_its_batch_in_the_engine(tiny_llama_dir: str) -> None:
    # One sequence per step: the first prompt finishes, the second fails its step, the third is still
    # waiting when generate() raises. It used to stay in the engine: the next call stepped it and
    # failed with a KeyError on its id.
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=16, max_num_seqs=1)
    expected = token_ids(llm.generate(PROMPTS, GREEDY))
    # A real fault in the step, no mock: SamplingParams checks its fields when made, so a top_k set
    # afterwards reaches the worker unchecked, and one past int64 fails building its batch's tensors.
    failing = SamplingParams(temperature=1.0, max_tokens=6)
    failing.top_k = 2**63
    with pytest.raises(RuntimeError, match="model step failed"):
        llm.generate(PROMPTS, [GREEDY, failing, GREEDY])
    assert_idle(llm)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    assert_idle(llm)


class InterruptingBar:
    """A tqdm-like progress bar (`use_tqdm` may be its class, as in vLLM) where the user presses Ctrl-C
    as the first request finishes."""

    instances: list[InterruptingBar] = []

    def __init__(self, **kwargs: Any) -> None:
        self.total, self.closed = kwargs["total"], False
        InterruptingBar.instances.append(self)

    def update(self, n: int) -> None:
        raise KeyboardInterrupt

    def close(self) -> None:
        self.closed = True


def test_ctrl_c_in_generate_aborts_the_call_s_requests(llm: LLM) -> None:
    expected = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=True))  # the real tqdm bar
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, [short, long, long], use_tqdm=InterruptingBar)
    (bar,) = InterruptingBar.instances
    assert bar.total == 3 and bar.closed
    stats = llm.engine.stats()
    assert stats.num_unfinished == 0 and stats.num_free_blocks == stats.num_total_blocks
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    assert_idle(llm)


def test_a_ctrl_c_before_the_workers_took_a_step_leaves_no_row_held(llm: LLM) -> None:
    """A step carries the ids of requests ended since the last one, for the workers to drop their rows
    and sampling state; a Ctrl-C landing before the workers took the step lost those ids, and the rows
    stayed held for good (max_num_seqs of them and no request could start)."""
    engine = llm.engine
    engine.add_request("ended", PROMPTS[0], SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    runner = engine.executor.worker.model_runner  # type: ignore[attr-defined]
    assert "ended" in runner.requests  # dropped with the next step
    execute = engine.executor.execute

    def interrupted(*args: object) -> None:  # the user's Ctrl-C, just before the workers run
        raise KeyboardInterrupt

    engine.executor.execute = interrupted  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    finally:
        engine.executor.execute = execute  # type: ignore[method-assign]
    llm.generate(PROMPTS[:1], GREEDY)
    assert_idle(llm)


def test_aborting_a_request_a_cut_short_step_ended_forgets_it(llm: LLM) -> None:
    """A Ctrl-C can land in LLMEngine.step() after the scheduler ended a sequence and before the
    engine took its output: generate() then aborts the request, which the scheduler no longer holds.
    The engine used to keep it for good (counted unfinished, its id refused as still running)."""
    engine = llm.engine
    engine.add_request("cut", PROMPTS[0], SamplingParams(temperature=0, max_tokens=1))
    output = engine.scheduler.schedule()  # step() by hand, up to where the Ctrl-C lands
    engine.scheduler.update(output, engine.executor.execute(output))
    assert not engine.has_unfinished_requests()
    assert engine.abort_request(["cut"]) == []
    assert engine.stats().num_unfinished == 0
    engine.add_request("cut", PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    num_tokens = 0
    for _ in range(10):  # bounded: 3 tokens take 3 steps
        num_tokens += sum(len(delta.new_token_ids) for delta in engine.step())
    assert num_tokens == 3
    llm.generate(PROMPTS[:1], GREEDY)
    assert_idle(llm)


BAD_INPUTS = [
    ([PROMPTS[0], []], GREEDY, "prompt", "prompts[1]"),
    ([PROMPTS[0], ""], GREEDY, "prompt", "prompts[1]"),  # this tokenizer adds no BOS: no tokens
    ([PROMPTS[0], [1, 49152]], GREEDY, "prompt_token_ids[1]", "49152 is not in [0, 49152) (prompts[1])"),
    ([PROMPTS[0], [1, -1]], GREEDY, "prompt_token_ids[1]", "prompts[1]"),
    ([PROMPTS[0], [1, 2.5]], GREEDY, "prompt_token_ids", "prompts[1]"),
    ([PROMPTS[0], [1, True]], GREEDY, "prompt_token_ids", "prompts[1]"),
    ([PROMPTS[0], [1] * 1024], GREEDY, "prompt", "context length 1024"),
    ([PROMPTS[0], [1] * 1020], GREEDY, "max_tokens", "prompts[1]"),
    ([PROMPTS[0], None], GREEDY, "prompts[1]", "a list of token ids"),
    ([PROMPTS[0], {"prompt": "x", "multi_modal_data": {}}], GREEDY, "prompts[1]", "multi_modal_data"),
    ([PROMPTS[0], {"prompt_text": "x"}], GREEDY, "prompts[1]", "prompt_text"),
    (None, GREEDY, "prompts", "NoneType"),
    (PROMPTS, [GREEDY, GREEDY], "sampling_params", "got 2 for 3 prompts"),
    (PROMPTS, {"temperature": 0}, "sampling_params", "SamplingParams"),
    (PROMPTS, [GREEDY, None, GREEDY], "sampling_params", "SamplingParams"),
    (PROMPTS, [GREEDY, SamplingParams(n=9), GREEDY], "n", "max-num-seqs"),
]


@pytest.mark.parametrize(("prompts", "params", "field", "detail"), BAD_INPUTS, ids=range(len(BAD_INPUTS)))
def test_bad_input_is_a_value_error_naming_it_and_runs_nothing(
    llm: LLM, prompts: Any, params: Any, field: str, detail: str
) -> None:
    """Every prompt is checked before any is added: a bad one used to leave those before it in the
    engine (the next call failed with a KeyError), or failed with a TypeError naming nothing."""
    with pytest.raises(ValueError) as info:
        llm.generate(prompts, params)
    assert isinstance(info.value, InvalidRequestError) and info.value.field == field, info.value
    assert_idle(llm)
    assert detail in str(info.value)
    assert [len(ids) for ids in token_ids(llm.generate(PROMPTS[:2], GREEDY))] == [6, 6]


def test_the_prompt_forms_of_vllm_give_the_same_tokens(llm: LLM) -> None:
    import numpy as np

    text = "The capital of France is"
    ids = llm.engine.encode_prompt(text)
    expected = token_ids(llm.generate([text, PROMPTS[0]], GREEDY))
    forms: list[Any] = [
        [{"prompt": text}, {"prompt_token_ids": PROMPTS[0]}],  # vLLM's TextPrompt and TokensPrompt
        (text, PROMPTS[0]),
        [ids, PROMPTS[0]],
        [ids, list(np.array(PROMPTS[0]))],  # NumPy integers
    ]
    for prompts in forms:
        outputs = llm.generate(prompts, GREEDY)
        assert token_ids(outputs) == expected, prompts
        assert outputs[1].prompt is None and outputs[1].prompt_token_ids == PROMPTS[0]
    single = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY)
    assert token_ids(single) == expected[1:]
    mixed = llm.generate([text, PROMPTS[0]], GREEDY)
    assert [out.prompt for out in mixed] == [text, None]
    assert mixed[0].prompt_token_ids == ids
    assert llm.generate([], GREEDY) == [] and llm.chat([], GREEDY) == []  # as vLLM's
    assert_idle(llm)


def test_parallel_sampling_with_a_seed_is_reproducible_with_vllm_s_child_seeds(llm: LLM) -> None:
    """Completion i of an n-way request samples as a request of seed `seed + i` (vLLM's child seeds)."""
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    (first,) = llm.generate([PROMPTS[1]], params)
    (again,) = llm.generate([PROMPTS[1]], params)
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert token_ids([first]) == token_ids([again])
    alone = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=8, ignore_eos=True) for i in range(3)]
    assert token_ids(llm.generate([PROMPTS[1]] * 3, alone)) == token_ids([first])
    assert len({tuple(ids) for ids in token_ids([first])}) == 3


def test_chat_prompt_is_the_templated_text_and_bad_messages_name_the_parameter(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Name a color."}]
    (out,) = llm.chat(messages, GREEDY)
    templated = llm.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt == templated and "<|im_start|>" in templated  # as vLLM's, special tokens kept
    for bad in ("Name a color.", ["Name a color."], [[{"content": "no role"}]]):
        with pytest.raises(InvalidRequestError) as info:
            llm.chat(bad, GREEDY)  # type: ignore[arg-type]
        assert info.value.field == "messages"
    assert_idle(llm)


def test_chat_takes_openai_text_parts_as_vllm_does(llm: LLM) -> None:
    """OpenAI-style content parts failed inside the template (a list where it concatenates strings);
    vLLM joins text parts by newlines for such templates. Other parts are refused by name."""
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a color."}]}
    ]
    joined = [{"role": "user", "content": "Name\na color."}]
    (from_parts,) = llm.chat(parts, GREEDY)
    (from_text,) = llm.chat(joined, GREEDY)
    assert from_parts.prompt == from_text.prompt and "Name\na color." in from_parts.prompt
    assert from_parts.outputs[0].token_ids == from_text.outputs[0].token_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]
    with pytest.raises(InvalidRequestError) as info:
        llm.chat(image, GREEDY)
    assert info.value.field == "messages" and "'image_url'" in info.value.message
    assert_idle(llm)


def test_an_unknown_engine_setting_is_refused_not_ignored(tiny_llama_dir: str) -> None:
    """vLLM's `gpu_memory_utilization` is `memory_utilization` here: it used to be silently ignored."""
    with pytest.raises(InvalidRequestError) as info:
        LLM(model=tiny_llama_dir, gpu_memory_utilization=0.5)
    assert info.value.field == "gpu_memory_utilization" and "'memory_utilization'" in str(info.value)


def test_sampling_params_take_vllm_s_none_and_refuse_a_top_k_past_int64() -> None:
    """stop=None and stop_token_ids=None are vLLM's defaults (list(None) raised a TypeError); a top_k
    past int64 passed the checks and failed the step of every request batched with it."""
    params = SamplingParams(stop=None, stop_token_ids=None)  # type: ignore[arg-type]
    assert params.stop == [] and params.stop_token_ids == []
    for field, value in (("top_k", 2**63), ("stop_token_ids", 5), ("stop", 5)):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**{field: value})
        assert info.value.field == field
    assert SamplingParams(top_k=2**63 - 1).top_k == 2**63 - 1


def test_reset_prefix_cache_makes_the_next_prompt_computed_in_full(llm: LLM) -> None:
    """vLLM's `LLM.reset_prefix_cache`: benchmarks repeating a workload reset between rounds. Refused
    (False) while a request is unfinished."""
    prompt = [1, *range(2000, 2040)]  # two full blocks of 16 and more
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    first = llm.generate([prompt], GREEDY)
    assert first[0].num_cached_tokens == 32
    assert llm.reset_prefix_cache()
    again = llm.generate([prompt], GREEDY)
    assert again[0].num_cached_tokens == 0 and token_ids(again) == token_ids(first)
    llm.engine.add_request("running", prompt, GREEDY)
    assert not llm.reset_prefix_cache()
    llm.engine.abort_request(["running"])
    llm.engine.step()  # the workers drop the aborted request's state
    assert_idle(llm)
    assert llm.reset_prefix_cache()


def test_outputs_carry_vllm_s_fields(llm: LLM) -> None:
    """Code written for vLLM reads `cumulative_logprob`, `stop_reason`, `finished()`, `lora_request`
    and `llm.get_tokenizer()`: each was an AttributeError here."""
    prompt = [1, *range(300, 320)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = llm.generate([prompt], greedy, use_tqdm=False)[0]
    tokens, text = plain.outputs[0].token_ids, plain.outputs[0].text
    assert plain.outputs[0].finished() and plain.outputs[0].finish_reason == "length"
    assert plain.outputs[0].stop_reason is None and plain.outputs[0].cumulative_logprob is None
    assert plain.lora_request is None
    assert llm.get_tokenizer() is llm.engine.tokenizer and llm.get_tokenizer().decode(tokens) == text

    with_logprobs = llm.generate([prompt], replace(greedy, logprobs=0), use_tqdm=False)[0].outputs[0]
    sampled = [entry[t].logprob for t, entry in zip(with_logprobs.token_ids, with_logprobs.logprobs or [])]
    assert len(sampled) == 6 and with_logprobs.cumulative_logprob == pytest.approx(sum(sampled))

    by_token = llm.generate([prompt], replace(greedy, stop_token_ids=[tokens[2]]), use_tqdm=False)[0]
    assert by_token.outputs[0].finish_reason == "stop" and by_token.outputs[0].stop_reason == tokens[2]
    stop_text = llm.get_tokenizer().decode(tokens[3:5]).strip()
    assert stop_text, text
    by_string = llm.generate([prompt], replace(greedy, stop=[stop_text]), use_tqdm=False)[0].outputs[0]
    assert by_string.finish_reason == "stop" and by_string.stop_reason == stop_text
    assert stop_text not in by_string.text
