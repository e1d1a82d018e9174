"""Chat template options over gRPC (`ChatMessages`): `chat_template_kwargs` over the server's
`--default-chat-template-kwargs`, `add_generation_prompt`, `continue_final_message`, on Generate,
Complete and Tokenize alike; each misuse INVALID_ARGUMENT naming the field, the server serving on.

One in-process server (the CLI's assembly, real sockets, a real grpc client) on the tiny model with
`--chat-template` set to a template that reads Qwen3's `enable_thinking` and prints a number."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import struct_pb2
from inprocess_server import InProcessServer
from pagedserve.rpc.v1 import generate_pb2 as pb

TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.name or t.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% if max_chars is defined %}<|im_start|>system\nAt most {{ max_chars }} characters.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
QUESTION = pb.ChatMessage(role="user", content="What is the capital of France?")
REPLY_BEGUN = pb.ChatMessage(role="assistant", content="The capital of France is")


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> InProcessServer:
    srv = InProcessServer(
        tiny_llama_dir,
        provider=None,
        dtype="float32",
        num_kv_blocks=64,
        chat_template=TEMPLATE,
        default_chat_template_kwargs='{"enable_thinking": false}',
    ).start()
    yield srv
    srv.stop()


def kwargs(**values: object) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(values)
    return struct


def templated(server: InProcessServer, chat: pb.ChatMessages) -> str:
    ids = server.stub.Tokenize(pb.TokenizeRequest(messages=chat), timeout=30).token_ids
    return server.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=30).text


def test_the_servers_defaults_apply_unless_the_request_sets_them(server: InProcessServer) -> None:
    assert templated(server, pb.ChatMessages(messages=[QUESTION])).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    thinking = templated(
        server, pb.ChatMessages(messages=[QUESTION], chat_template_kwargs=kwargs(enable_thinking=True))
    )
    assert thinking.endswith("<|im_start|>assistant\n") and "<think>" not in thinking


def test_whole_numbers_reach_the_template_as_ints(server: InProcessServer) -> None:
    """Struct carries 300 as 300.0; the template prints what the client meant."""
    chat = pb.ChatMessages(messages=[QUESTION], chat_template_kwargs=kwargs(max_chars=300))
    assert templated(server, chat).startswith("<|im_start|>system\nAt most 300 characters.<|im_end|>")


def test_generate_continues_a_reply_begun_for_the_model(server: InProcessServer) -> None:
    chat = pb.ChatMessages(
        messages=[QUESTION, REPLY_BEGUN], add_generation_prompt=False, continue_final_message=True
    )
    assert templated(server, chat).endswith("<|im_start|>assistant\nThe capital of France is")
    closed = pb.ChatMessages(messages=[QUESTION, REPLY_BEGUN], add_generation_prompt=False)
    assert templated(server, closed).endswith("The capital of France is<|im_end|>\n")
    params = pb.SamplingParameters(max_tokens=4, temperature=0.0, ignore_eos=True)
    responses = list(server.stub.Generate(pb.GenerateRequest(messages=chat, sampling=params), timeout=60))
    assert sum(len(r.token_ids) for r in responses) == 4
    [completion] = server.stub.Complete(
        pb.GenerateRequest(messages=chat, sampling=params), timeout=60
    ).completions
    assert list(completion.token_ids) == [t for r in responses for t in r.token_ids]


@pytest.mark.parametrize(
    ("chat", "field", "words"),
    [
        (
            pb.ChatMessages(messages=[QUESTION, REPLY_BEGUN], continue_final_message=True),
            "continue_final_message",
            "cannot be true while add_generation_prompt is",
        ),
        (
            pb.ChatMessages(messages=[QUESTION], chat_template_kwargs=kwargs(messages=[])),
            "chat_template_kwargs",
            "'messages' is set by the chat request itself",
        ),
        (
            pb.ChatMessages(messages=[QUESTION], chat_template_kwargs=kwargs(**{"two words": 1})),
            "chat_template_kwargs",
            "'two words' is not a template variable name",
        ),
    ],
    ids=["continue-with-generation-prompt", "reserved-name", "not-a-name"],
)
def test_misuse_is_invalid_argument_naming_the_field(
    server: InProcessServer, chat: pb.ChatMessages, field: str, words: str
) -> None:
    generate = pb.GenerateRequest(messages=chat, sampling=pb.SamplingParameters(max_tokens=2))
    for call, arg in (
        (lambda r, timeout: list(server.stub.Generate(r, timeout=timeout)), generate),
        (server.stub.Complete, generate),
        (server.stub.Tokenize, pb.TokenizeRequest(messages=chat)),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call(arg, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(f"{field}: ") and words in info.value.details()
    assert templated(server, pb.ChatMessages(messages=[QUESTION]))  # serving on


def test_a_tool_result_and_the_tools_reach_the_template(server: InProcessServer) -> None:
    """A tool-calling turn: the tools through chat_template_kwargs, the assistant's call as the model
    wrote it, the tool's result as role tool. Other roles stay refused, naming the message."""
    chat = pb.ChatMessages(
        messages=[
            pb.ChatMessage(role="user", content="Weather in Paris?"),
            pb.ChatMessage(role="assistant", content='<tool_call>{"name": "get_weather"}</tool_call>'),
            pb.ChatMessage(role="tool", content="22 C, sunny"),
        ],
        chat_template_kwargs=kwargs(tools=[{"name": "get_weather"}, {"name": "get_time"}]),
    )
    text = templated(server, chat)
    assert text.startswith("<|im_start|>system\ntools: get_weather get_time<|im_end|>\n"), text
    assert "<|im_start|>tool\n22 C, sunny<|im_end|>\n<|im_start|>assistant\n" in text
    robot = pb.ChatMessages(messages=[QUESTION, pb.ChatMessage(role="robot", content="beep")])
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Tokenize(pb.TokenizeRequest(messages=robot), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "messages[1].role: must be system, user, assistant or tool"


def test_tools_without_auto_tool_choice_refuse_auto_and_take_none(server: InProcessServer) -> None:
    """This server has no --enable-auto-tool-choice: tool_choice auto (the default with tools) is refused
    as vLLM refuses it, naming the way out; none renders the tools and leaves the output text."""
    tools = [pb.Tool(name="get_weather"), pb.Tool(name="get_time")]
    info = server.stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
    assert (info.tool_call_parser, info.reasoning_parser) == ("", "")
    for choice in ("", "auto"):
        chat = pb.ChatMessages(messages=[QUESTION], tools=tools, tool_choice=choice)
        with pytest.raises(grpc.RpcError) as info:
            list(server.stub.Generate(pb.GenerateRequest(messages=chat), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("tool_choice: auto (the default with tools) needs a server")
    chat = pb.ChatMessages(messages=[QUESTION], tools=tools, tool_choice="none")
    params = pb.SamplingParameters(max_tokens=3, temperature=0.0, ignore_eos=True)
    [completion] = server.stub.Complete(
        pb.GenerateRequest(messages=chat, sampling=params), timeout=60
    ).completions
    assert completion.finish_reason == pb.LENGTH and not completion.tool_calls and completion.text
    assert templated(server, chat).startswith("<|im_start|>system\ntools: get_weather get_time<|im_end|>")
