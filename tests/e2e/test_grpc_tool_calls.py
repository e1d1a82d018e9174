"""Tool calling over gRPC, as vLLM's chat completions do it: `ChatMessages.tools` reach the chat
template in OpenAI's shape (with the history's calls and results), and the tool choice decides the
output: required or a named function constrain it to calls, auto finds the calls the model wrote
(`--enable-auto-tool-choice --tool-call-parser hermes`), none leaves text. Calls arrive as
`GenerateResponse.tool_calls`, whole, their text kept out of `text`; the completion finishes
TOOL_CALLS. Each misuse is INVALID_ARGUMENT naming the field, the server serving on.

One in-process server (the CLI's assembly, real sockets, a real grpc client) on the default model
with a Qwen-style template that renders tools, calls and results."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import jsonschema
import pytest
from google.protobuf import struct_pb2
from inprocess_server import InProcessServer
from pagedserve.rpc.v1 import generate_pb2 as pb

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{% for tool in tools %}{{ tool.function | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>\n"
    '{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}"
    "{% if m.role == 'tool' %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}
NOTHING = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [
    pb.Tool(name="get_weather", description="The weather in a city", parameters=json.dumps(CITY)),
    pb.Tool(name="get_time", description="The time now", parameters=json.dumps(NOTHING)),
]
SCHEMAS = {"get_weather": CITY, "get_time": NOTHING}
QUESTION = pb.ChatMessage(role="user", content="What is the weather like in Paris today?")
HERMES_REPLY = (
    'Let me look that up.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def server(default_model_dir: str) -> Iterator[InProcessServer]:
    srv = InProcessServer(
        default_model_dir,
        provider=None,
        enforce_eager=True,
        num_kv_blocks=256,
        chat_template=TEMPLATE,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    ).start()
    yield srv
    srv.stop()


def chat(**fields: object) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[QUESTION], tools=TOOLS, **fields)  # type: ignore[arg-type]


def request(messages: pb.ChatMessages, **sampling: object) -> pb.GenerateRequest:
    params = pb.SamplingParameters(**{"temperature": 0.0, "max_tokens": 96, **sampling})  # type: ignore[arg-type]
    return pb.GenerateRequest(messages=messages, sampling=params)


def forced(*outputs: str) -> pb.StructuredOutputs:
    """The model writes one of these (what a model trained to call tools would write)."""
    return pb.StructuredOutputs(choice=pb.Choices(choices=list(outputs)))


def assert_valid(call: pb.ToolCall) -> None:
    assert call.id.startswith("call_") and len(call.id) == 29, call.id
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_the_template_gets_the_tools_calls_and_results_in_openais_shape(server: InProcessServer) -> None:
    history = pb.ChatMessages(
        messages=[
            QUESTION,
            pb.ChatMessage(
                role="assistant",
                tool_calls=[pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')],
            ),
            pb.ChatMessage(role="tool", content="22 C, sunny", tool_call_id="call_1"),
        ],
        tools=TOOLS,
        tool_choice="none",
    )
    ids = server.stub.Tokenize(pb.TokenizeRequest(messages=history), timeout=30).token_ids
    text = server.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=30).text
    weather = {"name": "get_weather", "description": "The weather in a city", "parameters": CITY}
    assert f"You may call these tools:\n{json.dumps(weather)}\n" in text, text
    # the arguments an object to the template (printed by tojson), not a string of JSON
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert text.endswith("<|im_start|>tool\n22 C, sunny [call_1]<|im_end|>\n<|im_start|>assistant\n")


def test_required_constrains_the_output_to_calls_of_the_tools(server: InProcessServer) -> None:
    """Two sampled completions, streamed and unary: calls only, each a tool's with valid arguments, on
    the completion's last response; the tokens still stream."""
    # the grammar allows any number of calls: room for a sampled list of several (seed 7's first
    # completion writes several in 185 tokens; a list cut short by max_tokens stays text, as it must)
    call = request(chat(tool_choice="required"), n=2, temperature=1.0, seed=7, max_tokens=256)
    responses = list(server.stub.Generate(call, timeout=120))
    for index in (0, 1):
        mine = [r for r in responses if r.index == index]
        assert len(mine) > 2 and all(r.text == "" for r in mine)
        assert all(not r.tool_calls for r in mine[:-1]) and mine[-1].finish_reason == pb.TOOL_CALLS
        assert mine[-1].tool_calls and all(r.token_ids for r in mine)
        for c in mine[-1].tool_calls:
            assert_valid(c)
        ids = [t for r in mine for t in r.token_ids]
        text = server.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=True)).text
        written = [(c["name"], c["parameters"]) for c in json.loads(text)]
        assert written == [(c.name, json.loads(c.arguments)) for c in mine[-1].tool_calls]
    [completion] = server.stub.Complete(request(chat(tool_choice="required")), timeout=120).completions
    assert completion.finish_reason == pb.TOOL_CALLS and completion.text == ""
    assert [c.name for c in completion.tool_calls][:1] == ["get_weather"], completion.tool_calls  # Paris
    for c in completion.tool_calls:
        assert_valid(c)


def test_a_named_function_is_called_once(server: InProcessServer) -> None:
    [completion] = server.stub.Complete(
        request(chat(tool_choice_function="get_weather")), timeout=120
    ).completions
    assert completion.finish_reason == pb.TOOL_CALLS and completion.text == ""
    [c] = completion.tool_calls
    assert c.name == "get_weather"
    assert_valid(c)


def test_auto_parses_the_calls_the_model_writes_and_streams_its_text(server: InProcessServer) -> None:
    responses = list(server.stub.Generate(request(chat(), structured_outputs=forced(HERMES_REPLY))))
    with_calls = [i for i, r in enumerate(responses) if r.tool_calls]
    assert len(with_calls) == 1 and responses[-1].finish_reason == pb.TOOL_CALLS
    [c] = responses[with_calls[0]].tool_calls
    assert (c.name, json.loads(c.arguments)) == ("get_weather", {"city": "Paris"})
    assert "".join(r.text for r in responses) == "Let me look that up."
    texts = [i for i, r in enumerate(responses) if r.text]
    assert len(texts) > 1 and max(texts) < with_calls[0]  # the text streamed, before the call was whole
    [completion] = server.stub.Complete(
        request(chat(tool_choice="auto"), structured_outputs=forced(HERMES_REPLY)), timeout=120
    ).completions
    assert completion.text == "Let me look that up." and completion.finish_reason == pb.TOOL_CALLS
    assert [(c.name, c.arguments) for c in completion.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_auto_without_a_call_and_none_leave_the_text_as_written(server: InProcessServer) -> None:
    [plain] = server.stub.Complete(
        request(chat(), structured_outputs=forced("It is sunny in Paris.")), timeout=120
    ).completions
    assert (plain.text, list(plain.tool_calls), plain.finish_reason) == ("It is sunny in Paris.", [], pb.EOS)
    [none] = server.stub.Complete(
        request(chat(tool_choice="none"), structured_outputs=forced(HERMES_REPLY)), timeout=120
    ).completions
    assert (none.text, list(none.tool_calls), none.finish_reason) == (HERMES_REPLY, [], pb.EOS)


def test_a_call_cut_short_by_max_tokens_stays_text(server: InProcessServer) -> None:
    [completion] = server.stub.Complete(
        request(chat(), structured_outputs=forced(HERMES_REPLY), max_tokens=12), timeout=120
    ).completions
    assert completion.finish_reason == pb.LENGTH and not completion.tool_calls
    assert completion.text.startswith("Let me look that up.<tool_call>") and HERMES_REPLY.startswith(
        completion.text
    )


def test_model_info_names_the_parser(server: InProcessServer) -> None:
    assert server.stub.ModelInfo(pb.ModelInfoRequest(), timeout=30).tool_call_parser == "hermes"


def kwargs(**values: object) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(values)
    return struct


def user(**fields: object) -> pb.ChatMessage:
    return pb.ChatMessage(role="user", content="hi", **fields)  # type: ignore[arg-type]


BAD_SCHEMA = json.dumps({"type": "object", "properties": {"city": {"type": "colour"}}})
UNIQUE_TAGS = json.dumps(
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    }
)
DEEP_SCHEMA = '{"type": "object", "properties": {"a": ' * 40 + '{"type": "integer"}' + "}}" * 40
BAD_REQUESTS = [
    (chat(tool_choice="sometimes"), "tool_choice", "must be none, auto or required"),
    (chat(tool_choice_function="get_mail"), "tool_choice_function", "no tool 'get_mail'"),
    (pb.ChatMessages(messages=[QUESTION], tool_choice="required"), "tool_choice", "needs tools"),
    (pb.ChatMessages(messages=[QUESTION], tools=[pb.Tool(name="get weather")]), "tools[0].name", "letters"),
    (pb.ChatMessages(messages=[QUESTION], tools=[TOOLS[1], TOOLS[1]]), "tools[1].name", "tools[0]'s name"),
    (
        pb.ChatMessages(messages=[QUESTION], tools=[pb.Tool(name="f", parameters="{")]),
        "tools[0].parameters",
        "JSON",
    ),
    (
        pb.ChatMessages(messages=[user(tool_calls=[pb.ToolCall(name="f")])], tools=TOOLS),
        "messages[0].tool_calls",
        "only an assistant",
    ),
    (
        pb.ChatMessages(
            messages=[pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(name="f", arguments="[1]")])],
            tools=TOOLS,
        ),
        "messages[0].tool_calls[0].arguments",
        "JSON object",
    ),
    (
        pb.ChatMessages(messages=[user(tool_call_id="call_1")], tools=TOOLS),
        "messages[0].tool_call_id",
        "tool message",
    ),
    (chat(chat_template_kwargs=kwargs(tools=[])), "chat_template_kwargs", "'tools' is given by tools"),
    (  # required joins the tools' parameters into one schema; its refusal is said of the tool's
        pb.ChatMessages(
            messages=[QUESTION],
            tools=[TOOLS[0], pb.Tool(name="f", parameters=BAD_SCHEMA)],
            tool_choice="required",
        ),
        "tools[1].parameters",
        "does not compile",
    ),
    (  # where the keyword sits: in the tool's parameters, not in the joined schema
        pb.ChatMessages(
            messages=[QUESTION],
            tools=[TOOLS[0], TOOLS[1], pb.Tool(name="f", parameters=UNIQUE_TAGS)],
            tool_choice="required",
        ),
        "tools[2].parameters",
        "uniqueItems (at #/properties/tags) is not supported",
    ),
    (
        pb.ChatMessages(
            messages=[QUESTION],
            tools=[TOOLS[0], pb.Tool(name="f", parameters=BAD_SCHEMA)],
            tool_choice_function="f",
        ),
        "tools[1].parameters",
        "does not compile",
    ),
    (  # the limit on a schema's nesting, said of the tools the request wrote (not structured_outputs.json)
        pb.ChatMessages(
            messages=[QUESTION], tools=[pb.Tool(name="f", parameters=DEEP_SCHEMA)], tool_choice="required"
        ),
        "tools[0].parameters",
        "nested at most 64 levels deep",
    ),
]


@pytest.mark.parametrize(("messages", "field", "words"), BAD_REQUESTS)
def test_misuse_is_invalid_argument_naming_the_field(
    server: InProcessServer, messages: pb.ChatMessages, field: str, words: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(server.stub.Generate(request(messages), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}: ") and words in info.value.details(), (
        info.value.details()
    )
    [ok] = server.stub.Complete(request(chat(), max_tokens=2), timeout=60).completions  # serving on
    assert ok.completion_tokens == 2


def test_structured_outputs_cannot_be_set_beside_a_forced_call(server: InProcessServer) -> None:
    for messages in (chat(tool_choice="required"), chat(tool_choice_function="get_time")):
        with pytest.raises(grpc.RpcError) as info:
            server.stub.Complete(request(messages, structured_outputs=forced("x")), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("sampling.structured_outputs: cannot be set with tool_choice")
