"""Tool-call parsing (pagedserve.tool_calls): each family's format found in a completion's text however
the text is cut into streamed pieces, what is not a call left as text (nothing lost), and the request
checks that name their field. The gRPC end of it, on a real model: tests/e2e/test_grpc_tool_calls.py."""

from __future__ import annotations

import json
import re
import typing

import jsonschema
import pytest
from pagedserve.errors import InvalidRequestError
from pagedserve.rpc.convert import tool_schema_error
from pagedserve.tool_calls import (
    PARSERS,
    TOOL_PARSERS,
    HermesParser,
    NamedCallParser,
    RequiredCallsParser,
    Tool,
    ToolCallParser,
    check_unique,
    new_call_id,
    parse_tool,
    parse_tool_calls,
    required_schema,
    tool_choice,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}'
HERMES = f"Let me check.<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n" + (
    '{"name": "get_time", "arguments": {}}\n</tool_call>'
)
EXPECTED_CALLS = [("get_weather", '{"city": "Paris", "unit": "°C"}'), ("get_time", "{}")]


def run(parser: ToolCallParser, pieces: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Each piece's content (then the finish's), and every call as (name, arguments)."""
    contents, calls = [], []
    for piece in pieces:
        content, found = parser.feed(piece)
        contents.append(content)
        calls += found
    content, found = parser.finish()
    contents.append(content)
    calls += found
    return contents, [(c.name, c.arguments) for c in calls]


def test_hermes_finds_the_calls_wherever_the_stream_is_cut() -> None:
    for cut in range(len(HERMES) + 1):
        for cut2 in (cut, min(cut + 5, len(HERMES))):
            contents, calls = run(HermesParser(), [HERMES[:cut], HERMES[cut:cut2], HERMES[cut2:]])
            assert "".join(contents) == "Let me check." and calls == EXPECTED_CALLS, (cut, cut2)
    contents, calls = run(HermesParser(), list(HERMES))  # a token a character
    assert "".join(contents) == "Let me check." and calls == EXPECTED_CALLS


def test_hermes_streams_text_at_once_and_holds_back_only_what_may_begin_a_call() -> None:
    parser = HermesParser()
    assert parser.feed("Hello") == ("Hello", [])
    assert parser.feed(" <tool") == (" ", [])  # "<tool" may begin <tool_call>
    assert parser.feed("s are") == ("<tools are", [])  # it did not
    assert parser.feed(" here <") == (" here ", [])
    assert parser.finish() == ("<", [])  # the end: nothing held back is lost


def test_hermes_leaves_a_call_that_does_not_parse_as_text() -> None:
    for body in ("{not json}", '{"arguments": {}}', '{"name": "f", "arguments": [1]}', '"f"'):
        text = f"A<tool_call>{body}</tool_call>B"
        contents, calls = run(HermesParser(), [text])
        assert ("".join(contents), calls) == (text, []), body


def test_hermes_takes_a_last_call_left_open_and_drops_whitespace_between_calls() -> None:
    """Models often end at EOS instead of </tool_call>, as vLLM's parser allows."""
    contents, calls = run(HermesParser(), [f"<tool_call>{WEATHER}"])
    assert ("".join(contents), calls) == ("", EXPECTED_CALLS[:1])
    cut_short = '<tool_call>{"name": "get_weather", "argu'  # max_tokens reached inside the call
    assert run(HermesParser(), [cut_short]) == (["", cut_short], [])
    spaced = f"<tool_call>{WEATHER}</tool_call>\n\n<tool_call>{WEATHER}</tool_call>\nDone."
    contents, calls = run(HermesParser(), [spaced])
    assert "".join(contents) == "\nDone." and len(calls) == 2


def test_llama3_json_calls_after_the_python_tag_separated_by_semicolons() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}; ' + (
        '{"name": "get_time", "arguments": {}}'
    )
    for cut in range(len(text) + 1):
        contents, calls = run(parse_tool_calls_parser("llama3_json"), [text[:cut], text[cut:]])
        assert ("".join(contents), calls) == ("", EXPECTED_CALLS), cut
    assert parse_tool_calls(' {"name": "f", "parameters": {"x": [1, 2]}}', "llama3_json")[1][0].arguments == (
        '{"x": [1, 2]}'
    )


def test_llama3_json_streams_text_at_once_and_gives_back_json_that_is_no_call() -> None:
    parser = parse_tool_calls_parser("llama3_json")
    assert parser.feed("  <|py") == ("", [])  # may be the tag
    assert parser.feed("thon is a language") == ("  <|python is a language", [])
    assert parser.feed(" {") == (" {", [])  # text already: no call follows
    for text in ('{"x": 1}', '{"name": "f", "parameters": {}} trailing', "{unclosed"):
        assert parse_tool_calls(text, "llama3_json") == (text, []), text


def test_pythonic_calls_take_literal_keyword_arguments() -> None:
    text = '[get_weather(city="Paris", unit="°C"), get_time()]'
    for cut in range(len(text) + 1):
        contents, calls = run(parse_tool_calls_parser("pythonic"), [text[:cut], text[cut:]])
        assert ("".join(contents), calls) == ("", EXPECTED_CALLS), cut
    nested = parse_tool_calls("<|python_start|>[f(a={'b': [1, None, True]})]<|python_end|>", "pythonic")
    assert [json.loads(c.arguments) for c in nested[1]] == [{"a": {"b": [1, None, True]}}]
    for text in ("[f(x)]", "[f(x=y)]", "[f(**k)]", "[obj.f()]", "[1, 2] are numbers", "[]", "[f(x=1)"):
        assert parse_tool_calls(text, "pythonic") == (text, []), text


QWEN3_CODER = (
    "I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=unit>\n°C\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
    "</function>\n</tool_call>"
)


def test_qwen3_coder_calls_are_xml_in_its_tool_call_tags() -> None:
    """vLLM's qwen3_coder: `<function=NAME>` and `<parameter=KEY>` values between <tool_call> tags,
    a call taken as its closing tag comes (the last may lack it), text before them streamed."""
    for cut in range(len(QWEN3_CODER) + 1):
        contents, calls = run(parse_tool_calls_parser("qwen3_coder"), [QWEN3_CODER[:cut], QWEN3_CODER[cut:]])
        assert ("".join(contents), calls) == ("I will look.\n", EXPECTED_CALLS), cut
    unclosed = "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC"
    assert [(c.name, c.arguments) for c in parse_tool_calls(unclosed, "qwen3_coder")[1]] == [
        ("get_time", '{"tz": "UTC"}')
    ]
    # what is not a function with parameters stays text
    for text in (
        '<tool_call>\n{"name": "get_time"}\n</tool_call>',
        "<tool_call>\n<function=get_time>\nnow please\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_time>\n</function>\ntrailing</tool_call>",
        "<tool_call></tool_call>",
    ):
        assert parse_tool_calls(text, "qwen3_coder") == (text, []), text


def test_seed_oss_calls_are_qwen3_coders_xml_in_its_own_tags() -> None:
    """vLLM's seed_oss: Qwen3-Coder's calls between <seed:tool_call> tags; Qwen's <tool_call> is text."""
    text = QWEN3_CODER.replace("<tool_call>", "<seed:tool_call>").replace("</tool_call>", "</seed:tool_call>")
    for cut in range(len(text) + 1):
        contents, calls = run(parse_tool_calls_parser("seed_oss"), [text[:cut], text[cut:]])
        assert ("".join(contents), calls) == ("I will look.\n", EXPECTED_CALLS), cut
    assert parse_tool_calls(QWEN3_CODER, "seed_oss") == (QWEN3_CODER, [])


def test_glm45_calls_are_a_name_and_key_value_pairs_in_tool_call_tags() -> None:
    """vLLM's glm45: the name on the first line of a <tool_call>, then <arg_key>/<arg_value> pairs;
    a value its schema types as a string as written, others read as JSON, else as written."""
    text = (
        "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>unit</arg_key>\n<arg_value>°C</arg_value>\n</tool_call><tool_call>get_time\n</tool_call>"
    )
    for cut in range(len(text) + 1):
        contents, calls = run(parse_tool_calls_parser("glm45"), [text[:cut], text[cut:]])
        assert ("".join(contents), calls) == ("Checking.", EXPECTED_CALLS), cut
    schema = {"type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "integer"}}}
    tool = parse_tool(0, "f", "", json.dumps(schema))
    pairs = {
        "code": "007",
        "n": "7",
        "tags": '["a", 1]',
        "opts": "{'k': None}",
        "word": "hello",
        "none": "null",
    }
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs.items())
    _, [call] = parse_tool_calls(f"<tool_call>f\n{body}</tool_call>", "glm45", [tool])
    assert json.loads(call.arguments) == {
        "code": "007",
        "n": 7,
        "tags": ["a", 1],
        "opts": {"k": None},
        "word": "hello",
        "none": None,
    }
    for text in (
        "<tool_call>not a name\n</tool_call>",
        "<tool_call>f\nstray text<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
        "<tool_call>f\n<arg_key>a</arg_key></tool_call>",
    ):
        assert parse_tool_calls(text, "glm45") == (text, []), text


def test_qwen3_coder_types_the_values_by_the_tools_schema() -> None:
    """The values are text as written; the tool's JSON schema types them as vLLM does, a value that
    is not its type (or a parameter it does not name) left a string."""
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "x": {"type": "number"},
            "whole": {"type": "number"},
            "ok": {"type": "boolean"},
            "tags": {"type": "array"},
            "opts": {"type": "object"},
            "maybe": {"type": ["integer", "null"]},
            "nothing": {"type": "string"},
            "word": {"type": "string"},
            "bad": {"type": "integer"},
        },
    }
    tool = parse_tool(0, "f", "", json.dumps(schema))
    values = {
        "n": "42",
        "x": "2.5",
        "whole": "3.0",
        "ok": "True",
        "tags": '["a", 1]',
        "opts": "{'k': None}",
        "maybe": "7",
        "nothing": "null",
        "word": "007",
        "bad": "seven",
        "extra": "12",
    }
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    _, [call] = parse_tool_calls(
        f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>", "qwen3_coder", [tool]
    )
    assert json.loads(call.arguments) == {
        "n": 42,
        "x": 2.5,
        "whole": 3,
        "ok": True,
        "tags": ["a", 1],
        "opts": {"k": None},
        "maybe": 7,
        "nothing": None,
        "word": "007",
        "bad": "seven",
        "extra": "12",
    }
    # a schema whose properties are no object types nothing (and breaks nothing)
    odd = parse_tool(0, "f", "", json.dumps({"type": "object", "properties": ["n"]}))
    _, [untyped] = parse_tool_calls("<tool_call><function=f><parameter=n>5</tool_call>", "qwen3_coder", [odd])
    assert json.loads(untyped.arguments) == {"n": "5"}
    # a request's tool choice hands its parser the request's tools
    parser = tool_choice([tool], "", "", "qwen3_coder")
    assert parser is not None
    contents, [(name, arguments)] = run(parser.new_parser(), ["<tool_call><function=f><parameter=n>5"])
    assert (name, json.loads(arguments)) == ("f", {"n": 5})


@pytest.mark.parametrize(
    "calls",
    [
        f"[TOOL_CALLS][{WEATHER}, " + '{"name": "get_time", "arguments": {}}]',
        '[TOOL_CALLS]get_weather{"city": "Paris", "unit": "°C"}[TOOL_CALLS]get_time{}',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "°C"}[TOOL_CALLS]get_time[ARGS]{}',
    ],
    ids=["json-list", "v11", "v13-args"],
)
def test_mistral_calls_follow_its_tool_calls_token(calls: str) -> None:
    """vLLM's mistral: after [TOOL_CALLS] a JSON list of calls (tokenizers before v11), or a call a
    token as name{...} or name[ARGS]{...}; text before it streams; ids of nine letters and digits."""
    text = "Let me check." + calls
    for cut in range(len(text) + 1):
        contents, found = run(parse_tool_calls_parser("mistral"), [text[:cut], text[cut:]])
        assert ("".join(contents), found) == ("Let me check.", EXPECTED_CALLS), cut
    parser = parse_tool_calls_parser("mistral")
    assert parser.feed("Sure. [TOOL") == ("Sure. ", [])  # may be the token
    assert parser.feed("S] and more") == ("[TOOLS] and more", [])
    _, [call, _] = parse_tool_calls(text, "mistral")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    _, [given] = parse_tool_calls('[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "UTC"}', "mistral")
    assert (given.name, given.id, json.loads(given.arguments)) == ("get_time", "a1b2c3d4e", {"tz": "UTC"})
    # what is not all calls after the token stays text, whole
    for text in (
        "[TOOL_CALLS]",
        "[TOOL_CALLS][]",
        "[TOOL_CALLS]get_time",
        '[TOOL_CALLS]get_time{"tz": "UTC"} and then',
        '[TOOL_CALLS]get_time{"tz": "UTC"}[TOOL_CALLS]not a call',
        f"[TOOL_CALLS][{WEATHER}, 1]",
        '[TOOL_CALLS]get_time["UTC"]',
    ):
        assert parse_tool_calls(text, "mistral") == (text, []), text


def deepseek(name: str) -> str:
    """DeepSeek's special token `name` (full-width bars, U+2581 for spaces)."""
    return "<\uff5c" + name.replace(" ", "\u2581") + "\uff5c>"


CALLS_BEGIN, CALLS_END = deepseek("tool calls begin"), deepseek("tool calls end")
CALL_BEGIN, CALL_END, SEP = deepseek("tool call begin"), deepseek("tool call end"), deepseek("tool sep")
DEEPSEEK_V3 = (
    f"Let me check.{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n"
    f'{{"city": "Paris", "unit": "°C"}}\n```{CALL_END}\n'
    f"{CALL_BEGIN}function{SEP}get_time\n```json\n{{}}\n```{CALL_END}{CALLS_END}"
)
DEEPSEEK_V31 = (
    f"Let me check.{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}"
    f'{{"city": "Paris", "unit": "°C"}}{CALL_END}{CALL_BEGIN}get_time{SEP}{{}}{CALL_END}{CALLS_END}'
)
KIMI_K2 = (
    "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris", "unit": "°C"}<|tool_call_end|>'
    "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
    "<|tool_calls_section_end|>"
)


@pytest.mark.parametrize(
    ("parser", "text"),
    [("deepseek_v3", DEEPSEEK_V3), ("deepseek_v31", DEEPSEEK_V31), ("kimi_k2", KIMI_K2)],
)
def test_deepseek_and_kimi_calls_are_found_wherever_the_stream_is_cut(parser: str, text: str) -> None:
    """vLLM's deepseek_v3 (DeepSeek-V3, R1: a call's type, its name, its arguments in a json fence),
    deepseek_v31 (a call's name then its arguments) and kimi_k2 (`functions.NAME:INDEX` then its
    arguments): the calls in their special tokens, the section's tags dropped, the text before them
    streamed; a token may arrive a character at a time."""
    for cut in range(len(text) + 1):
        contents, found = run(parse_tool_calls_parser(parser), [text[:cut], text[cut:]])
        assert ("".join(contents), found) == ("Let me check.", EXPECTED_CALLS), cut
    contents, found = run(parse_tool_calls_parser(parser), list(text))
    assert ("".join(contents), found) == ("Let me check.", EXPECTED_CALLS)
    assert PARSERS[parser].SPECIAL_TOKENS  # (their tags are special tokens: kept in the text for them)


def test_kimi_k2_calls_keep_the_models_ids_and_deepseeks_get_ours() -> None:
    """Kimi's chat template takes its calls back by the ids it wrote (`functions.get_time:1`)."""
    _, calls = parse_tool_calls(KIMI_K2, "kimi_k2")
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]
    _, calls = parse_tool_calls(
        "<|tool_call_begin|>get_time:7<|tool_call_argument_begin|>{}<|tool_call_end|>", "kimi_k2"
    )
    assert [(c.name, c.id) for c in calls] == [("get_time", "get_time:7")]
    _, calls = parse_tool_calls(DEEPSEEK_V31, "deepseek_v31")
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("deepseek_v3", f"{CALL_BEGIN}get_time{SEP}{{}}{CALL_END}"),  # V3.1's call, no fence
        ("deepseek_v3", f"{CALL_BEGIN}function{SEP}get_time\n```json\n[1]\n```{CALL_END}"),
        ("deepseek_v3", f"{CALL_BEGIN}function{SEP}get time\n```json\n{{}}\n```{CALL_END}"),
        ("deepseek_v31", f"{CALL_BEGIN}get_time{{}}{CALL_END}"),  # no separator
        ("deepseek_v31", f"{CALL_BEGIN}get_time{SEP}{{not json}}{CALL_END}"),
        ("kimi_k2", "<|tool_call_begin|>functions.get_time<|tool_call_argument_begin|>{}<|tool_call_end|>"),
        ("kimi_k2", '<|tool_call_begin|>functions.get_time:0{"tz": "UTC"}<|tool_call_end|>'),
    ],
)
def test_deepseek_and_kimi_output_that_is_no_call_stays_text(parser: str, text: str) -> None:
    assert parse_tool_calls(text, parser) == (text, [])


def test_olmo3_calls_are_a_pythonic_call_a_line_between_its_tags() -> None:
    """vLLM's olmo3: OLMo 3's template asks for `<function_calls>` and one call a line; argument values
    as JSON writes them (null, true, false) or as Python does."""
    text = '<function_calls>\nget_weather(city="Paris", unit="°C")\nget_time()\n</function_calls>'
    for cut in range(len(text) + 1):
        contents, calls = run(parse_tool_calls_parser("olmo3"), [text[:cut], text[cut:]])
        assert ("".join(contents), calls) == ("", EXPECTED_CALLS), cut
    json_names = parse_tool_calls(
        "<function_calls>f(a=null, b=[true, false], c={'d': None})</function_calls>", "olmo3"
    )
    assert [json.loads(c.arguments) for c in json_names[1]] == [
        {"a": None, "b": [True, False], "c": {"d": None}}
    ]
    parser = parse_tool_calls_parser("olmo3")
    assert parser.feed(" <function") == ("", [])  # may be the tag
    assert parser.feed("s>") == (" <functions>", [])
    # what is not calls, one a line, stays text, whole
    for text in (
        "<function_calls></function_calls>",
        "<function_calls>\nf(x)\n</function_calls>",
        "<function_calls>\nf(x=y)\n</function_calls>",
        "<function_calls>\n[f(), g()]\n</function_calls>",
        "<function_calls>\nf(x=1\n</function_calls>",
        "get_time()",
        "Let me look.<function_calls>\nget_time()\n</function_calls>",
    ):
        assert parse_tool_calls(text, "olmo3") == (text, []), text


@pytest.mark.parametrize(
    "tag", ["<|tool_call|>", "<tool_call>", ""], ids=["granite-3.0", "granite-3.1", "bare"]
)
def test_granite_calls_are_a_json_list_after_its_tag(tag: str) -> None:
    text = f"{tag}[{WEATHER}, " + '{"name": "get_time", "arguments": {}}]'
    for cut in range(len(text) + 1):
        contents, calls = run(parse_tool_calls_parser("granite"), [text[:cut], text[cut:]])
        assert ("".join(contents), calls) == ("", EXPECTED_CALLS), cut
    parser = parse_tool_calls_parser("granite")
    assert parser.feed(" <|tool") == ("", [])  # may be the tag
    assert parser.feed("s are here") == (" <|tools are here", [])
    # what is not a list of calls, every item a call, stays text, whole
    for text in (
        f"{tag}[]",
        f"{tag}[1, 2]",
        f'{tag}[{WEATHER}, {{"x": 1}}]',
        f"{tag}{WEATHER}",
        f"{tag}[{WEATHER}",
    ):
        assert parse_tool_calls(text, "granite") == (text, []), text


def test_phi4_mini_calls_are_a_json_list_after_functools() -> None:
    """vLLM's phi4_mini_json: `functools[...]`, each call's arguments under "arguments" or
    "parameters"; arguments holding lists too (vLLM's regex stops at their first "]")."""
    text = f"functools[{WEATHER}, " + '{"name": "get_time", "parameters": {}}]'
    for cut in range(len(text) + 1):
        contents, calls = run(parse_tool_calls_parser("phi4_mini_json"), [text[:cut], text[cut:]])
        assert ("".join(contents), calls) == ("", EXPECTED_CALLS), cut
    nested = parse_tool_calls('functools[{"name": "f", "parameters": {"xs": [1, [2]]}}]', "phi4_mini_json")
    assert [(c.name, json.loads(c.arguments)) for c in nested[1]] == [("f", {"xs": [1, [2]]})]
    parser = parse_tool_calls_parser("phi4_mini_json")
    assert parser.feed(" functo") == ("", [])  # may be the tag
    assert parser.feed("rs of production") == (" functors of production", [])
    # what is not a list of calls after the tag stays text, whole
    for text in (
        "functools[]",
        "functools[1]",
        f"functools{WEATHER}",
        f"functools[{WEATHER}",
        f"[{WEATHER}]",
    ):
        assert parse_tool_calls(text, "phi4_mini_json") == (text, []), text


def test_required_and_named_outputs_become_calls() -> None:
    output = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}, ' + (
        '{"name": "get_time", "parameters": {}}]'
    )
    assert run(RequiredCallsParser(), [output[:7], output[7:]])[1] == EXPECTED_CALLS
    no_call = '[{"name": "f", "parameters": 3}]'
    assert run(RequiredCallsParser(), [no_call]) == (["", no_call], [])
    assert run(NamedCallParser("get_time"), ["{ }"]) == (["", ""], [("get_time", "{}")])
    assert run(NamedCallParser("f"), ['{"a": ']) == (["", '{"a": '], [])  # cut short: text


def test_required_schema_takes_calls_of_the_tools_alone() -> None:
    tools = [
        parse_tool(
            0,
            "get_weather",
            "",
            '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}',
        ),
        parse_tool(1, "get_time", "", ""),
    ]
    schema = required_schema(tools)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}], schema)
    jsonschema.validate(
        [{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}], schema
    )
    for wrong in (
        [],
        [{"name": "get_weather", "parameters": {}}],
        [{"name": "send_mail", "parameters": {}}],
        [{"name": "get_time"}],
        {"name": "get_time", "parameters": {}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_tool_definitions_are_checked_naming_the_field() -> None:
    assert parse_tool(0, "a-b_9", "d", "").parameters == {"type": "object", "properties": {}}
    cases = [
        ((1, "", "", ""), "tools[1].name"),
        ((0, "get weather", "", ""), "tools[0].name"),
        ((0, "x" * 65, "", ""), "tools[0].name"),
        ((2, "f", "", "{"), "tools[2].parameters"),
        ((0, "f", "", "[1]"), "tools[0].parameters"),
    ]
    for args, field in cases:
        with pytest.raises(InvalidRequestError) as info:
            parse_tool(*args)
        assert info.value.field == field, args
    with pytest.raises(InvalidRequestError, match=r"^tools\[2\]\.name: 'f' is tools\[0\]'s name too$"):
        check_unique([Tool("f", "", {}), Tool("g", "", {}), Tool("f", "", {})])


def test_tool_choice_as_vllm_takes_it() -> None:
    tools = [Tool("f", "", {"type": "object"}), Tool("g", "", {"type": "object", "properties": {}})]
    assert tool_choice([], "", "", None) is None and tool_choice([], "none", "", "hermes") is None
    assert tool_choice(tools, "none", "", "hermes") is None
    auto = tool_choice(tools, "", "", "hermes")
    assert auto is not None and auto.schema is None and isinstance(auto.new_parser(), HermesParser)
    required = tool_choice(tools, "required", "", None)
    assert required is not None and required.schema == required_schema(tools)
    named = tool_choice(tools, "", "g", None)
    assert named is not None and named.schema == tools[1].parameters
    assert named.schema_field == "tools[1].parameters"
    errors = [
        (([], "auto", "", "hermes"), "tool_choice: auto needs tools"),
        (([], "required", "", None), "tool_choice: required needs tools"),
        ((tools, "any", "", None), "tool_choice: must be none, auto or required, got 'any'"),
        ((tools, "", "h", None), "tool_choice_function: no tool 'h' (tools: f, g)"),
        (([], "", "h", None), "tool_choice_function: no tool 'h' (tools: none)"),
    ]
    for args, message in errors:
        with pytest.raises(InvalidRequestError) as info:
            tool_choice(*args)
        assert str(info.value) == message
    for choice in ("", "auto"):  # no --enable-auto-tool-choice
        with pytest.raises(InvalidRequestError, match=r"^tool_choice: auto .*--enable-auto-tool-choice"):
            tool_choice(tools, choice, "", None)


def test_call_ids_are_unguessable_and_unique() -> None:
    ids = {new_call_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_the_flag_offers_every_parser() -> None:
    from pagedserve.rpc.cli import ServeSettings

    annotation = ServeSettings.model_fields["tool_call_parser"].annotation
    literal = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    assert typing.get_args(literal) == TOOL_PARSERS
    with pytest.raises(
        ValueError,
        match="tool_call_parser: must be one of hermes, llama3_json, pythonic, granite, phi4_mini_json, openai, "
        "olmo3, mistral, qwen3_coder, glm45, seed_oss, deepseek_v3, deepseek_v31, kimi_k2",
    ):
        parse_tool_calls("", "xlam")


def parse_tool_calls_parser(name: str) -> ToolCallParser:
    from pagedserve.tool_calls import PARSERS

    return PARSERS[name]()


def test_a_required_schema_refused_is_said_of_the_tool_refused_alone_else_of_the_tools() -> None:
    """tool_choice required joins the tools' parameters into one schema. Each of two 40,000-character
    parameters fits the 64 KiB limit alone, not joined: no one tool is to blame, the refusal names
    `tools`. A tool too large alone is named by its index, as a named function's would be."""
    half = json.dumps({"type": "object", "description": "x" * 40_000})
    big = json.dumps({"type": "object", "description": "x" * 70_000})
    joined_refusal = InvalidRequestError("structured_outputs.json", "at most 65536 characters, got 80300")
    for parameters, field in (([half, half], "tools"), ([half, big], "tools[1].parameters")):
        tools = [parse_tool(i, f"f{i}", "", p) for i, p in enumerate(parameters)]
        choice = tool_choice(tools, "required", "", None)
        assert choice is not None
        refused = tool_schema_error(choice, joined_refusal)
        assert refused.field == field and refused.message.startswith("at most 65536 characters, got ")


# --- GPT-OSS's calls: harmony messages to a function (--tool-call-parser openai) --------------------

# what --reasoning-parser openai_gptoss passes on of a completion that thinks, says a word, then calls
# two functions: the commentary's body, then each call whole (the last without its <|call|>, the EOS)
HARMONY_CALLS = (
    "Checking.<|channel|>commentary to=functions.get_weather<|message|>"
    '{"city": "Paris", "unit": "°C"}<|call|><|channel|>commentary to=functions.get_time<|message|>{}'
)


def test_harmony_calls_are_found_wherever_the_stream_is_cut() -> None:
    for cut in range(len(HARMONY_CALLS) + 1):
        contents, calls = run(parse_tool_calls_parser("openai"), [HARMONY_CALLS[:cut], HARMONY_CALLS[cut:]])
        assert ("".join(contents), calls) == ("Checking.", EXPECTED_CALLS), cut


@pytest.mark.parametrize(
    "text",
    [
        "<|channel|>commentary to=functions.f<|message|>not json<|call|>",  # arguments not JSON
        "<|channel|>commentary to=browser.open<|message|>{}<|call|>",  # not a function
        '<|channel|>commentary to=functions.f<|message|>["a list"]',  # not an object
    ],
)
def test_a_harmony_message_that_is_no_call_stays_text(text: str) -> None:
    assert parse_tool_calls(text, "openai") == (text, [])


def test_the_harmony_reasoning_parser_passes_calls_on_whole_for_the_tool_parser() -> None:
    """As gpt-oss writes it, the recipient in the channel's part or the role's, the arguments' type
    constrained: the reasoning apart, the calls found, the rest text."""
    from pagedserve.reasoning import HarmonyParser

    completion = (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris", "unit": "°C"}<|call|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}"
    )
    for cut in range(0, len(completion) + 1, 7):
        harmony, tools = HarmonyParser(), parse_tool_calls_parser("openai")
        reasoning, contents, calls = [], [], []
        for piece in (completion[:cut], completion[cut:]):
            thought, text = harmony.feed(piece)
            reasoning.append(thought)
            content, found = tools.feed(text)
            contents.append(content)
            calls += found
        thought, text = harmony.finish()
        content, found = tools.feed(text)
        rest, more = tools.finish()
        reasoning.append(thought)
        contents += [content, rest]
        calls += found + more
        assert "".join(reasoning) == "Need the weather.", cut
        assert "".join(contents) == "Checking.", cut
        assert [(c.name, c.arguments) for c in calls] == EXPECTED_CALLS, cut
