"""Structured outputs' `structural_tag` (vLLM's): the text is free until it reaches a trigger, then the
structure that trigger opens is forced (a tool call's JSON between its begin and end); both forms vLLM
takes, the classic `structures`/`triggers` one and xgrammar's `format` one. A malformed tag is refused
at admission naming `structured_outputs.structural_tag`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from pagedserve import LLM, SamplingParams
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import StructuredOutputsParams

PROMPTS = [[1, 300, 301, 302], [1, 500, 600, 700, 800, 900], [1, 42], [1, *range(1000, 1030)]]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Berlin"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# The trigger is "<", one token, so that a logit bias can push the random-weight model onto it; a real
# tool-calling setup would trigger on "<function=" (see the README's example).
CLASSIC = json.dumps(
    {
        "type": "structural_tag",
        "structures": [
            {"begin": f"<function={name}>", "schema": schema, "end": "</function>"}
            for name, schema in SCHEMAS.items()
        ],
        "triggers": ["<"],
    }
)
SECTION = re.compile(r"<function=(get_weather|get_time)>(.*?)</function>", re.DOTALL)
LESS_THAN = 44  # "<" in SmolLM2's vocabulary


def tag(**format_: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": format_}))


def tag_classic() -> StructuredOutputsParams:
    return StructuredOutputsParams(structural_tag=CLASSIC)


def greedy(structured: StructuredOutputsParams | None = None, **extra: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 48, "structured_outputs": structured, **extra})


def assert_matches(name: str, arguments: str) -> None:
    value = json.loads(arguments)
    if name == "get_time":
        assert value in ({"zone": "UTC"}, {"zone": "CET"}), arguments
        return
    assert set(value) == {"city", "days"} and value["city"] in ("Paris", "Rome", "Berlin"), arguments
    assert isinstance(value["days"], int) and 1 <= value["days"] <= 7, arguments


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128, block_size=16)


def whitespace_ids(llm: LLM) -> list[int]:
    """Tokens of whitespace alone: JSON allows any amount between its fields, and the random-weight
    model, inside an object, takes little else (a section would never reach its end)."""
    tokenizer = llm.engine.tokenizer
    texts = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    return [i for i, text in texts.items() if text and not text.strip()]


def test_every_triggered_section_matches_the_schema_its_begin_names(llm: LLM) -> None:
    """Pushed onto the trigger, the model opens a section at once and again after each end; inside one,
    the JSON must match the schema of the function its begin names. Unconstrained, the same push
    makes "<<<<...": the sections are the structural tag's doing."""
    bias = {LESS_THAN: 100.0, **{i: -100.0 for i in whitespace_ids(llm)}}
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature, seed=5, max_tokens=96, logit_bias=bias, structured_outputs=tag_classic()
        )
        for out in llm.generate(PROMPTS, params):
            text = out.outputs[0].text
            sections = SECTION.findall(text)
            assert len(sections) >= 2, text
            for name, arguments in sections:
                assert_matches(name, arguments)
            # every opened section is complete but the one max_tokens cut short
            assert text.count("<function=") - len(sections) <= 1 and text.startswith("<function="), text
    free = llm.generate(PROMPTS[:1], greedy(logit_bias=bias, max_tokens=8))[0].outputs[0].text
    assert free == "<" * 8


def test_text_that_reaches_no_trigger_is_the_unconstrained_text(llm: LLM) -> None:
    """Outside its sections a structural tag constrains nothing: a completion that never reaches the
    trigger is token for token the unconstrained one (greedy, beside unconstrained requests)."""
    free = [o.outputs[0] for o in llm.generate(PROMPTS, greedy())]
    assert not any("<" in completion.text for completion in free)
    params = [greedy(tag_classic()), greedy(), greedy(tag_classic()), greedy()]
    tagged = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    assert [c.token_ids for c in tagged] == [c.token_ids for c in free]


def test_xgrammars_format_form_free_text_then_a_forced_tool_call(llm: LLM) -> None:
    """xgrammar's own form: at most 3 tokens of free text (the unconstrained model's), then the call
    is forced; once it ends the format is complete, and only EOS may follow."""
    call = {
        "type": "tag",
        "begin": "<function=get_weather>",
        "content": {"type": "json_schema", "json_schema": WEATHER, "max_whitespace_cnt": 1},
        "end": "</function>",
    }
    structured = tag(type="sequence", elements=[{"type": "any_text", "max_tokens": 3}, call])
    free = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]
    tokenizer = llm.engine.tokenizer
    for out, free_ids in zip(llm.generate(PROMPTS, greedy(structured, max_tokens=80)), free, strict=True):
        completion = out.outputs[0]
        prefix, _, rest = completion.text.partition("<function=get_weather>")
        assert prefix == tokenizer.decode(free_ids[:3]), completion.text
        assert rest.endswith("</function>") and completion.finish_reason == "eos", completion
        assert_matches("get_weather", rest.removesuffix("</function>"))


def test_the_readme_example_compiles(llm: LLM) -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    found = re.search(r'`(\{"type": "structural_tag", "triggers".*?\})`', readme, re.DOTALL)
    assert found, "the README's structural_tag example"
    example = " ".join(line.strip() for line in found.group(1).splitlines())
    assert llm.engine.structured_outputs.compile(StructuredOutputsParams(structural_tag=example))


# -- malformed tags --------------------------------------------------------------------------------------


def classic(**changes: Any) -> str:
    doc: dict[str, Any] = {
        "structures": [{"begin": "<f>", "schema": WEATHER, "end": "</f>"}],
        "triggers": ["<f"],
        **changes,
    }
    return json.dumps(doc)


def structure(**changes: Any) -> str:
    item = {"begin": "<f>", "schema": WEATHER, "end": "</f>", **changes}
    return classic(structures=[{key: value for key, value in item.items() if value is not None}])


MALFORMED = [
    ("{not json", "not JSON: "),
    ("", "not JSON: "),
    ("[1, 2]", "must be a JSON object"),
    ('{"type": "structural_tag"}', 'needs "format"'),
    (classic(structures={"begin": "<f>"}), '"structures" must be a list'),
    (classic(triggers=None), '"triggers" must be a list of strings'),
    (classic(triggers="<f"), '"triggers" must be a list of strings'),
    (structure(begin=None), 'structures[0]: needs "begin"'),
    (structure(end=None), 'structures[0]: needs "end"'),
    (structure(schema=None), 'structures[0]: needs "schema"'),
    (structure(schema=json.dumps(WEATHER)), 'structures[0]: "schema" must be a JSON schema object'),
    (structure(end=5), 'structures[0]: "end" must be a string'),
    # what the compiler refuses, in its words
    (structure(schema={"type": "nope"}), "does not compile: "),
    (classic(triggers=["<g"]), "does not compile: "),
    (json.dumps({"type": "structural_tag", "format": {"type": "nope"}}), "does not compile: "),
    (json.dumps({"type": "other", "format": {"type": "const_string", "value": "x"}}), "does not compile: "),
]


@pytest.mark.parametrize(
    ("spec", "message"), MALFORMED, ids=[f"malformed-{i}" for i in range(len(MALFORMED))]
)
def test_a_malformed_structural_tag_is_refused_at_admission_naming_it(
    llm: LLM, spec: str, message: str
) -> None:
    engine = llm.engine
    params = greedy(StructuredOutputsParams(structural_tag=spec))
    for admit in (
        lambda: engine.validate_request(PROMPTS[0], params),
        lambda: engine.add_request("bad", PROMPTS[0], params),
    ):
        with pytest.raises(InvalidRequestError) as caught:
            admit()
        assert caught.value.field == "structured_outputs.structural_tag"
        assert caught.value.message.startswith(message), caught.value.message
        assert "/project/cpp" not in caught.value.message  # the compiler's message, not its source line
    assert not engine.has_unfinished_requests() and not engine.structured_outputs._matchers


@pytest.mark.parametrize(
    ("kind", "field", "message"),
    [
        ({"structural_tag": 5}, "structured_outputs.structural_tag", "must be a string"),
        ({"structural_tag": {"format": {}}}, "structured_outputs.structural_tag", "must be a string"),
        ({"structural_tag": "x" * 70_000}, "structured_outputs.structural_tag", "at most 65536 characters"),
        ({"structural_tag": CLASSIC, "regex": "a"}, "structured_outputs", "set exactly one of"),
        ({"structural_tag": CLASSIC, "json_object": True}, "structured_outputs", "set exactly one of"),
    ],
)
def test_a_structural_tag_of_the_wrong_type_size_or_company_is_refused(
    kind: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        StructuredOutputsParams(**kind)
    assert caught.value.field == field and caught.value.message.startswith(message), caught.value
    if field == "structured_outputs":  # the kinds given are named
        assert "structural_tag" in caught.value.message
