"""Structured outputs: every sampled token keeps the completion inside a JSON schema, regex, choice
or EBNF grammar, through sampling, n > 1, preemption (swap and recompute) and tensor parallelism;
bad constraints are refused at admission naming their field, and unconstrained requests beside
constrained ones are untouched."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from pagedserve import LLM, SamplingParams
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import StructuredOutputsParams
from tiny_models import save_tiny_model

PROMPTS = [[1, 300, 301, 302], [1, 500, 600, 700, 800, 900], [1, 42], [1, *range(1000, 1030)]]
# bounded: a random-weight model ends these within a few dozen tokens (then only EOS is allowed)
REGEX = r"[a-z]{2,6}-[0-9]{2}( [a-z]{1,4}){0,3}"
CHOICES = ["red", "green", 'say "blue"\n', "yellow ☀"]
GRAMMAR = 'root ::= num (" + " num){1,3}\nnum ::= [1-9] [0-9]?'
EXPR = re.compile(r"[1-9][0-9]?( \+ [1-9][0-9]?){1,3}")
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "Berlin", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def so(**kind: object) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kind)  # type: ignore[arg-type]


def greedy(structured: StructuredOutputsParams | None = None, **extra: object) -> SamplingParams:
    settings: dict[str, object] = {"temperature": 0, "max_tokens": 48, **extra}
    return SamplingParams(structured_outputs=structured, **settings)  # type: ignore[arg-type]


def assert_person(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age", "city"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 24
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert value["city"] in ("Paris", "Berlin", "Rome")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128, block_size=16)


# -- the constraints hold ----------------------------------------------------------------------------


def test_special_tokens_never_stand_in_for_text(llm: LLM) -> None:
    """SmolLM2's tokenizer has added special tokens whose strings look like text (`<reponame>`, id 4);
    xgrammar took them for that text, so `"<" [a-z]+ ">"` was complete with one of them, and the
    completion, its special token skipped, read "". Pushed hard towards them, the grammar still keeps
    them out, and the text matches."""
    pattern = re.compile("<[a-z]{2,8}>")
    grammar = 'root ::= "<" [a-z]{2,8} ">"'  # <reponame> (4) and <filename> (6) would match
    params = greedy(so(grammar=grammar), max_tokens=24, logit_bias={4: 100.0, 6: 100.0})
    for out in llm.generate(PROMPTS, params):
        completion = out.outputs[0]
        assert not {4, 6} & set(completion.token_ids)
        assert completion.finish_reason == "eos" and pattern.fullmatch(completion.text), completion


def test_regex_choice_and_grammar_hold_greedy_and_sampled(llm: LLM) -> None:
    cases = [(so(regex=REGEX), re.compile(REGEX)), (so(grammar=GRAMMAR), EXPR)]
    for temperature in (0.0, 1.0):
        for structured, pattern in cases:
            params = SamplingParams(
                temperature=temperature, top_k=50, seed=7, max_tokens=64, structured_outputs=structured
            )
            for out in llm.generate(PROMPTS, params):
                completion = out.outputs[0]
                assert pattern.fullmatch(completion.text), completion.text
                assert completion.finish_reason == "eos"
        params = SamplingParams(temperature=temperature, seed=3, structured_outputs=so(choice=CHOICES))
        for out in llm.generate(PROMPTS, params):
            assert out.outputs[0].text in CHOICES
            assert out.outputs[0].finish_reason == "eos"


def test_a_choice_past_the_basic_multilingual_plane_comes_out_as_written(llm: LLM) -> None:
    """json.dumps spelled U+1F600 as a surrogate pair, which xgrammar took for two characters: the
    completion's bytes were their CESU-8, six replacement characters."""
    choices = ["smile \U0001f600", "\U0001d11e clef"]
    for out in llm.generate(PROMPTS[:2], greedy(so(choice=choices))):
        assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "eos"


def test_unconstrained_output_breaks_the_constraints(llm: LLM) -> None:
    """The constrained tests above could not pass by luck: unconstrained, the same model matches none."""
    for out in llm.generate(PROMPTS, greedy()):
        text = out.outputs[0].text
        assert not re.fullmatch(REGEX, text) and not EXPR.fullmatch(text) and text not in CHOICES


def test_n_siblings_each_follow_the_grammar(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=64, structured_outputs=so(regex=REGEX))
    outs = llm.generate(PROMPTS[:2], params)
    for out in outs:
        texts = [c.text for c in out.outputs]
        assert all(re.fullmatch(REGEX, t) for t in texts), texts
        assert len(set(texts)) > 1  # each sibling samples its own path through the grammar


def test_mixed_batch_leaves_unconstrained_requests_untouched(llm: LLM) -> None:
    alone = [llm.generate([p], greedy())[0].outputs[0].token_ids for p in PROMPTS[:2]]
    constrained = [greedy(so(regex=REGEX)), greedy(so(choice=CHOICES))]
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[2:], [greedy(), greedy(), *constrained])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert re.fullmatch(REGEX, mixed[2].outputs[0].text) and mixed[3].outputs[0].text in CHOICES


def test_a_complete_grammar_ends_the_request_under_ignore_eos_and_min_tokens(llm: LLM) -> None:
    """Past a complete grammar only EOS may follow: the request ends there (finish reason eos, its
    text without EOS), although ignore_eos or min_tokens would have it go on (as vLLM ends it)."""
    for extra in ({"ignore_eos": True}, {"min_tokens": 40}):
        out = llm.generate(PROMPTS, greedy(so(choice=CHOICES), **extra))
        assert all(o.outputs[0].text in CHOICES for o in out)
        assert {o.outputs[0].finish_reason for o in out} == {"eos"}
        assert all(o.outputs[0].token_ids[-1] == 2 for o in out)  # the EOS the grammar ended with


def test_logprobs_are_of_the_masked_distribution(llm: LLM) -> None:
    out = llm.generate([PROMPTS[0]], greedy(so(choice=["red", "green"]), logprobs=5))[0].outputs[0]
    assert out.text in ("red", "green") and out.logprobs is not None
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry[token_id].logprob > float("-inf")
        assert all(lp.logprob > float("-inf") for lp in entry.values())  # disallowed tokens are left out
    assert set(out.logprobs[-1]) == {2}  # the complete grammar allowed EOS alone: probability 1
    assert out.logprobs[-1][2].logprob == pytest.approx(0.0, abs=1e-5)


def test_a_spec_compiles_once_for_many_requests(llm: LLM) -> None:
    structured = llm.engine.structured_outputs
    structured.compile(so(regex=REGEX))
    compiler = structured._get_compiler()
    size = compiler.get_cache_size_bytes()
    outs = llm.generate(PROMPTS, greedy(so(regex=REGEX)))  # validated and added: two compiles each
    assert all(re.fullmatch(REGEX, o.outputs[0].text) for o in outs)
    assert compiler.get_cache_size_bytes() == size
    structured.compile(so(regex=REGEX + "x"))
    assert compiler.get_cache_size_bytes() > size


# -- preemption ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_requests_keep_their_grammar(tiny_llama_dir: str, llm: LLM, mode: str) -> None:
    prompts = [[1, *range(100 + 40 * i, 100 + 40 * i + 20)] for i in range(8)]
    kinds = [so(regex=REGEX), so(grammar=GRAMMAR), so(choice=CHOICES), None]
    params = [greedy(kinds[i % 4], ignore_eos=kinds[i % 4] is None, max_tokens=40) for i in range(8)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # 14 blocks of 8 tokens cannot hold 8 requests of up to 60 tokens: preempt
    small = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=14,
        block_size=8,
        num_cpu_kv_blocks=64,
        preemption_mode=mode,
    )
    outs = small.generate(prompts, params)
    stats = small.engine.stats()
    assert (stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions) > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert re.fullmatch(REGEX, outs[0].outputs[0].text) and EXPR.fullmatch(outs[1].outputs[0].text)
    assert not small.engine.structured_outputs._matchers  # every finished sequence dropped its matcher


# -- invalid constraints ---------------------------------------------------------------------------------

INVALID = [
    ("structured_outputs.json", {"json": "{not json"}),
    ("structured_outputs.json", {"json": {"type": "no-such-type"}}),
    ("structured_outputs.regex", {"regex": "a(b"}),
    ("structured_outputs.grammar", {"grammar": "root ::= undefined_rule"}),
    # they compile, but match no text: refused here, not failed at the first sampled token
    ("structured_outputs.grammar", {"grammar": "root ::= root"}),
    ("structured_outputs.regex", {"regex": r"[^\x00-\U0010FFFF]"}),
]


@pytest.mark.parametrize(("field", "kind"), INVALID)
def test_constraints_that_do_not_compile_are_refused_at_admission(
    llm: LLM, field: str, kind: dict[str, object]
) -> None:
    engine = llm.engine
    params = greedy(so(**kind))
    with pytest.raises(InvalidRequestError) as validated:
        engine.validate_request(PROMPTS[0], params)
    assert validated.value.field == field
    assert "/project/cpp" not in validated.value.message  # the compiler's message, not its source line
    with pytest.raises(InvalidRequestError) as added:
        engine.add_request("bad", PROMPTS[0], params)
    assert added.value.field == field
    assert not engine.has_unfinished_requests() and not engine.structured_outputs._matchers
    assert re.fullmatch(REGEX, llm.generate([PROMPTS[0]], greedy(so(regex=REGEX)))[0].outputs[0].text)


def test_async_engine_refuses_a_bad_grammar_before_the_first_delta(tiny_llama_dir: str) -> None:
    """The server's path: validate_request compiles on the event loop, the step thread never sees it."""
    from pagedserve.engine.async_engine import AsyncEngine, in_torch_thread
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.settings import EngineSettings

    settings = EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)

    async def scenario() -> tuple[str, str]:
        engine = AsyncEngine(await in_torch_thread(LLMEngine.from_settings, settings))
        engine.start()
        try:
            good = engine.generate("good", PROMPTS[1], greedy(so(regex=REGEX)))
            first = await anext(good)
            with pytest.raises(InvalidRequestError) as bad:
                await anext(engine.generate("bad", PROMPTS[0], greedy(so(grammar="root ::= ("))))
            text = first.new_text + "".join([delta.new_text async for delta in good])
            return bad.value.field, text
        finally:
            await engine.stop()

    field, text = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    assert field == "structured_outputs.grammar"
    assert re.fullmatch(REGEX, text)


@pytest.mark.parametrize(
    ("field", "kind"),
    [
        ("structured_outputs", {}),
        ("structured_outputs", {"json": "{}", "regex": "a"}),
        ("structured_outputs", {"choice": ["a"], "json_object": True}),
        ("structured_outputs.choice", {"choice": []}),
        ("structured_outputs.choice", {"choice": "ab"}),
        ("structured_outputs.json", {"json": 3}),
        ("structured_outputs.json_object", {"json_object": "yes"}),
    ],
)
def test_malformed_structured_outputs_name_the_field(field: str, kind: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        so(**kind)
    assert exc.value.field == field
    with pytest.raises(InvalidRequestError) as not_params:
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
    assert not_params.value.field == "structured_outputs"


# -- padded vocabulary -----------------------------------------------------------------------------------


def test_padded_vocabulary_rows_are_never_sampled(tmp_path: Path, default_model_dir: str) -> None:
    """A model with 64 embedding rows past the tokenizer's vocabulary, whose LM head makes two of them
    win every step: unconstrained greedy picks them, constrained never does."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig

    vocab = 49152 + 64
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model_dir = save_tiny_model(tmp_path / "padded", default_model_dir, config)
    weights = load_file(f"{model_dir}/model.safetensors")
    weights["model.norm.weight"][0] = 1000.0  # the final hidden state is all dimension 0
    weights["lm_head.weight"][49152 + 10] = 0.0
    weights["lm_head.weight"][49152 + 10, 0] = 100.0  # wins where dimension 0 is positive
    weights["lm_head.weight"][49152 + 20] = 0.0
    weights["lm_head.weight"][49152 + 20, 0] = -100.0  # and this one where it is negative
    save_file({k: v.contiguous() for k, v in weights.items()}, f"{model_dir}/model.safetensors")
    padded = LLM(model=model_dir, dtype="float32", num_kv_blocks=32)
    free = padded.generate(PROMPTS[:2], greedy(ignore_eos=True, max_tokens=8))
    assert all(set(o.outputs[0].token_ids) <= {49162, 49172} for o in free)
    for out in padded.generate(PROMPTS[:2], greedy(so(regex=REGEX), max_tokens=64)):
        assert re.fullmatch(REGEX, out.outputs[0].text)
        assert max(out.outputs[0].token_ids) < 49152


# -- the real model: JSON ------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_json_schema_and_json_object(default_model_dir: str) -> None:
    """bfloat16 on the CPU: greedy rows take the C++ argmax kernel, on the masked logits."""
    real = LLM(model=default_model_dir, num_kv_blocks=256)
    ask = [{"role": "user", "content": "Describe a person who lives in Europe as JSON."}]
    schema_text = json.dumps(PERSON)
    for schema in (PERSON, schema_text):
        out = real.chat(ask, greedy(so(json=schema), max_tokens=80))[0].outputs[0]
        assert out.finish_reason == "eos"
        assert_person(out.text)
    sampled = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=80, structured_outputs=so(json=PERSON))
    for completion in real.chat(ask, sampled)[0].outputs:
        assert_person(completion.text)
    cat = [{"role": "user", "content": "Describe a cat in JSON with two keys: name and color."}]
    out = real.chat(cat, greedy(so(json_object=True), max_tokens=120))[0].outputs[0]
    assert out.finish_reason == "eos" and isinstance(json.loads(out.text), dict)
    free = real.chat(cat, greedy(max_tokens=120))[0].outputs[0].text
    with pytest.raises(json.JSONDecodeError):  # unconstrained, the model wraps its JSON in prose
        json.loads(free)


# -- tensor parallel -----------------------------------------------------------------------------------


def test_tensor_parallel_ranks_apply_the_bitmask(tiny_llama_dir: str, llm: LLM) -> None:
    """The bitmask travels in the plan rank 0 broadcasts: every rank masks and samples its own copy of
    the logits (rank 0's tokens are returned; a rank that could not apply it would fail the step)."""
    params = [
        greedy(so(regex=REGEX)),
        SamplingParams(temperature=1.0, seed=4, structured_outputs=so(choice=CHOICES)),
    ]
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
    tp2 = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=16, tensor_parallel_size=2)
    try:
        outs = tp2.generate(PROMPTS[:2], params)
    finally:
        tp2.engine.executor.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert re.fullmatch(REGEX, outs[0].outputs[0].text) and outs[1].outputs[0].text in CHOICES


def outside_strings(text: str) -> str:
    """JSON text with each string as S (strings may hold any whitespace), up to an unfinished one."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', "S", text).split('"')[0]


def test_disable_any_whitespace_leaves_no_free_whitespace(llm: LLM) -> None:
    for kind in ({"json_object": True}, {"json": PERSON}):
        # pushed towards "\n", "\n\n", "  " and "\t", which the grammar would allow between the fields
        bias = {198: 50.0, 1116: 50.0, 256: 50.0, 197: 50.0}
        params = greedy(so(**kind, disable_any_whitespace=True), max_tokens=64, logit_bias=bias)
        for out in llm.generate(PROMPTS, params):
            text = out.outputs[0].text
            assert text.startswith("{") and not re.search(r"[\n\t\r]|  ", outside_strings(text)), repr(text)
    with pytest.raises(InvalidRequestError) as caught:
        so(regex="a", disable_any_whitespace="yes")
    assert caught.value.field == "structured_outputs.disable_any_whitespace"


def test_a_spec_over_64_kib_is_refused_before_it_compiles() -> None:
    schema = {"enum": [f"value-{i}" for i in range(8000)]}  # as a dict: its JSON text is measured
    with pytest.raises(InvalidRequestError) as caught:
        so(json=schema)
    assert caught.value.field == "structured_outputs.json" and "at most 65536 characters" in str(caught.value)
    assert so(json={"enum": [f"value-{i}" for i in range(100)]}).kind == "json"


def _optional_properties(num: int, required: int = 0) -> str:
    names = [f"p{i}" for i in range(num)]
    return json.dumps(
        {"type": "object", "properties": dict.fromkeys(names, {}), "required": names[:required]}
    )


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("json", _optional_properties(3000)),  # 32 KiB that compiled for 75 s on the one compile thread
        ("json", json.loads(_optional_properties(182))),  # a dict schema
        ("json", {"type": "array", "items": [json.loads(_optional_properties(130))] * 2}),  # two objects
        (
            "structural_tag",
            json.dumps(
                {
                    "triggers": ["<f"],
                    "structures": [
                        {"begin": "<f>", "schema": json.loads(_optional_properties(200)), "end": "</f>"}
                    ],
                }
            ),
        ),
    ],
    ids=["json-3000", "dict-182", "two-objects-of-130", "structural-tag-200"],
)
def test_a_schema_of_too_many_optional_properties_is_refused_before_it_compiles(
    kind: str, spec: object
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        so(**{kind: spec})
    assert caught.value.field == f"structured_outputs.{kind}"
    assert "too many optional properties" in caught.value.message


def test_optional_properties_within_the_budget_compile(llm: LLM) -> None:
    """181 optional properties, or any number required (they cost nothing: linear to compile)."""
    for schema in (_optional_properties(181), _optional_properties(3000, required=3000)):
        llm.engine.validate_request(PROMPTS[0], greedy(so(json=schema)))


UNENFORCED = [  # each compiled, and the output broke it: these keywords never reached the grammar
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems (at #)"),
    ({"type": "array", "contains": {"const": 7}}, "contains (at #)"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf on a type but integer (at #)"),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "allOf of more than one schema (at #)"),
    (
        {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 0}}}},
        "not (at #/properties/n)",
    ),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "then (at #)"),
    (
        {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2},
        "maxLength beside $ref (at #)",
    ),
    ({"$ref": "https://example.com/schema.json"}, "a $ref outside the schema (at #)"),
    (
        {"type": "string", "pattern": "^a+$", "maxLength": 2},
        "minLength or maxLength beside a pattern or format",
    ),
    ({"anyOf": [{"type": "null"}, {"type": "object", "patternProperties": {"^x": {}}}]}, "(at #/anyOf/1)"),
]


@pytest.mark.parametrize(("schema", "said"), UNENFORCED, ids=[said.split(" (")[0] for _, said in UNENFORCED])
def test_schema_keywords_the_compiler_would_not_enforce_are_refused(
    llm: LLM, schema: dict[str, object], said: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        llm.engine.validate_request(PROMPTS[0], greedy(so(json=json.dumps(schema))))
    assert caught.value.field == "structured_outputs.json"
    assert said in caught.value.message and "would not enforce it" in caught.value.message
    with pytest.raises(InvalidRequestError, match="would not enforce it"):  # the schema as a dict
        llm.engine.validate_request(PROMPTS[0], greedy(so(json=schema)))
    tag = {"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}]}
    with pytest.raises(InvalidRequestError) as in_a_tag:
        llm.engine.validate_request(PROMPTS[0], greedy(so(structural_tag=json.dumps(tag))))
    assert in_a_tag.value.field == "structured_outputs.structural_tag"


def test_keywords_the_compiler_enforces_or_that_constrain_nothing_compile(llm: LLM) -> None:
    """Property names that are keywords elsewhere, integer multipleOf, a single allOf, annotations
    beside $ref, uniqueItems false, if alone."""
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "integer", "multipleOf": 5},
            "contains": {"allOf": [{"$ref": "#/$defs/s"}]},
            "then": {"$ref": "#/$defs/s", "description": "a string"},
            "items": {"type": "array", "items": {"type": "integer"}, "uniqueItems": False, "maxItems": 2},
            "if": {"if": {"type": "string"}},
        },
        "required": ["not", "contains", "then", "items", "if"],
        "$defs": {"s": {"type": "string", "maxLength": 5}},
    }
    llm.engine.validate_request(PROMPTS[0], greedy(so(json=schema)))


def _nested_arrays(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "string"}' + "}" * depth


NESTED_PAST_THE_LIMIT = [  # each compiled for seconds to minutes on the one compile thread
    ("json", _nested_arrays(600)),
    ("json", json.loads(_nested_arrays(100))),  # a dict schema
    ("structural_tag", json.dumps({"type": "structural_tag", "format": json.loads(_nested_arrays(70))})),
    ("structural_tag", '{"format": ' * 3000 + "1" + "}" * 3000),  # past the JSON parser's depth too
    ("grammar", "root ::= " + "(" * 5000 + '"a"' + ")" * 5000),
    ("regex", "(" * 5000 + "a" + ")" * 5000),
]


@pytest.mark.parametrize(("kind", "spec"), NESTED_PAST_THE_LIMIT, ids=[k for k, _ in NESTED_PAST_THE_LIMIT])
def test_a_spec_nested_past_64_levels_is_refused_before_it_compiles(kind: str, spec: object) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        so(**{kind: spec})
    assert caught.value.field == f"structured_outputs.{kind}"
    assert "nested at most 64 levels deep" in caught.value.message


def test_a_spec_nested_64_levels_compiles(llm: LLM) -> None:
    """Brackets and parentheses in quoted text and character classes do not count."""
    quoted = '"((((((((((" [((((((((((] '
    for kind, spec in (
        ("json", _nested_arrays(63)),  # the schema's own object is the 64th level
        ("grammar", "root ::= " + quoted + "(" * 64 + '"a"' + ")" * 64),
        ("regex", r"\(\(\([((((]" + "(" * 64 + "a" + ")" * 64),
    ):
        llm.engine.validate_request(PROMPTS[0], greedy(so(**{kind: spec})))
