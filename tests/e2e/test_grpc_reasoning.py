"""`--reasoning-parser` over gRPC, as vLLM's: a chat completion's reasoning (between <think> and
</think>) leaves as `reasoning_content`, its answer as `text`, streamed as written; tool calls are found
in the answer alone; `include_reasoning: false` drops the reasoning.

One in-process server on the default model with a template whose generation prompt opens a think
block when asked (as Qwen3-Thinking's and DeepSeek-R1's do), `--reasoning-parser qwen3` and hermes
tool calls. The model does not think by itself: outputs that begin with <think> are forced with a
`choice`, the model writing every token of them."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from google.protobuf import struct_pb2
from inprocess_server import InProcessServer
from pagedserve.rpc.v1 import generate_pb2 as pb

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if thinking %}<think>\n{% endif %}{% endif %}"
)
QUESTION = pb.ChatMessage(role="user", content="What is the weather like in Paris today?")
THOUGHT = "<think>\nParis is in France.\n</think>\n\nIt is sunny in Paris."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = pb.Tool(
    name="get_weather",
    parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}),
)


@pytest.fixture(scope="module")
def server(default_model_dir: str) -> Iterator[InProcessServer]:
    srv = InProcessServer(
        default_model_dir,
        provider=None,
        enforce_eager=True,
        num_kv_blocks=256,
        chat_template=TEMPLATE,
        reasoning_parser="qwen3",
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    ).start()
    yield srv
    srv.stop()


def thinking(on: bool) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update({"thinking": on})
    return struct


def request(*, forced: str = "", thinks: bool = False, **fields: object) -> pb.GenerateRequest:
    chat = pb.ChatMessages(messages=[QUESTION], chat_template_kwargs=thinking(thinks), **fields)  # type: ignore[arg-type]
    sampling = pb.SamplingParameters(temperature=0.0, max_tokens=96)
    if forced:
        sampling.structured_outputs.choice.choices.append(forced)
    return pb.GenerateRequest(messages=chat, sampling=sampling)


def complete(server: InProcessServer, req: pb.GenerateRequest) -> pb.GenerateResponse:
    [completion] = server.stub.Complete(req, timeout=120).completions
    return completion


def decoded(server: InProcessServer, ids: list[int]) -> str:
    return server.stub.Detokenize(
        pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=True), timeout=30
    ).text


def test_a_think_block_leaves_as_reasoning_content_streamed_before_the_answer(
    server: InProcessServer,
) -> None:
    responses = list(server.stub.Generate(request(forced=THOUGHT), timeout=120))
    assert "".join(r.reasoning_content for r in responses) == "\nParis is in France.\n"
    assert "".join(r.text for r in responses) == "\n\nIt is sunny in Paris."
    reasoning_at = [i for i, r in enumerate(responses) if r.reasoning_content]
    text_at = [i for i, r in enumerate(responses) if r.text]
    assert len(reasoning_at) > 1 and max(reasoning_at) < min(text_at)  # streamed, in the order written
    assert decoded(server, [t for r in responses for t in r.token_ids]) == THOUGHT  # the tokens are whole
    completion = complete(server, request(forced=THOUGHT))
    assert (completion.reasoning_content, completion.text) == (
        "\nParis is in France.\n",
        "\n\nIt is sunny in Paris.",
    )
    assert completion.finish_reason == pb.EOS


def test_a_prompt_that_opened_the_block_makes_the_output_reasoning(server: InProcessServer) -> None:
    """The model never closes the block here: all it wrote is reasoning. Without the open block the
    same model's output is all text."""
    opened = complete(server, request(thinks=True))
    assert opened.text == "" and opened.reasoning_content == decoded(server, list(opened.token_ids))
    assert opened.reasoning_content.strip()
    closed = complete(server, request(thinks=False))
    assert closed.reasoning_content == "" and closed.text == decoded(server, list(closed.token_ids))


def test_a_constrained_output_is_reasoning_only_where_it_thinks_itself(server: InProcessServer) -> None:
    """The grammar rules from the first token: an open block in the prompt does not make a JSON
    answer reasoning."""
    req = request(thinks=True)
    req.sampling.structured_outputs.json_object = True
    req.sampling.structured_outputs.disable_any_whitespace = True
    completion = complete(server, req)
    assert completion.reasoning_content == "" and isinstance(json.loads(completion.text), dict)


def test_tool_calls_are_found_in_the_answer_after_the_reasoning(server: InProcessServer) -> None:
    thought_then_call = "<think>\nI need the weather.\n</think>\n\n" + CALL
    completion = complete(server, request(forced=thought_then_call, tools=[WEATHER]))
    assert completion.reasoning_content == "\nI need the weather.\n" and completion.text == "\n\n"
    assert [(c.name, json.loads(c.arguments)) for c in completion.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert completion.finish_reason == pb.TOOL_CALLS
    # a call written inside the reasoning is thought, not made
    thought_of = complete(server, request(forced=f"<think>{CALL}</think>Fine.", tools=[WEATHER]))
    assert (thought_of.reasoning_content, thought_of.text, list(thought_of.tool_calls)) == (CALL, "Fine.", [])


def test_include_reasoning_false_drops_it(server: InProcessServer) -> None:
    completion = complete(server, request(forced=THOUGHT, include_reasoning=False))
    assert (completion.reasoning_content, completion.text) == ("", "\n\nIt is sunny in Paris.")


def test_text_and_token_prompts_are_not_parsed_and_model_info_names_the_parser(
    server: InProcessServer,
) -> None:
    """As vLLM's completions: the reasoning parser is the chat's."""
    sampling = pb.SamplingParameters(
        temperature=0.0,
        max_tokens=48,
        structured_outputs=pb.StructuredOutputs(choice=pb.Choices(choices=[THOUGHT])),
    )
    [completion] = server.stub.Complete(
        pb.GenerateRequest(text="Hello", sampling=sampling), timeout=120
    ).completions
    assert (completion.text, completion.reasoning_content) == (THOUGHT, "")
    assert server.stub.ModelInfo(pb.ModelInfoRequest(), timeout=30).reasoning_parser == "qwen3"


def test_a_beam_searchs_beams_are_each_split_as_a_completion(server: InProcessServer) -> None:
    """With the block opened by the prompt, every beam's output is its reasoning: what the same search
    writes unparsed from the same prompt's token ids (a token prompt is not parsed), beam by beam. (The
    model never closes the block, so every beam's parser stays in one state: that the beams' parsers
    are apart is not seen here.)"""
    req = request(thinks=True)
    req.sampling.use_beam_search = True
    req.sampling.n = 3
    req.sampling.max_tokens = 12
    beams = server.stub.Complete(req, timeout=120).completions
    prompt = server.stub.Tokenize(pb.TokenizeRequest(messages=req.messages), timeout=30).token_ids
    as_tokens = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=req.sampling)
    unparsed = server.stub.Complete(as_tokens, timeout=120).completions
    assert [b.index for b in beams] == [0, 1, 2] and [b.text for b in beams] == ["", "", ""]
    assert [b.reasoning_content for b in beams] == [u.text for u in unparsed]
    assert len({b.reasoning_content for b in beams}) == 3 and all(u.text.strip() for u in unparsed)


# --- GPT-OSS's harmony messages: --reasoning-parser openai_gptoss ------------------------------------

# gpt-oss's template ends the prompt with `<|start|>assistant`; the model writes the channels
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
HARMONY = (
    "<|channel|>analysis<|message|>Paris is in France.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
)


@pytest.fixture(scope="module")
def harmony_server(tiny_llama_dir: str) -> Iterator[InProcessServer]:
    srv = InProcessServer(
        tiny_llama_dir,
        provider=None,
        enforce_eager=True,
        num_kv_blocks=64,
        chat_template=HARMONY_TEMPLATE,
        reasoning_parser="openai_gptoss",
        enable_auto_tool_choice=True,
        tool_call_parser="openai",
    ).start()
    yield srv
    srv.stop()


def test_harmonys_analysis_channel_leaves_as_reasoning_and_its_final_channel_as_text(
    harmony_server: InProcessServer,
) -> None:
    """The model writes every token of the messages (a forced `choice`; in this tokenizer harmony's
    markers are plain text, in gpt-oss's special tokens, which the server keeps in a chat's text for
    the parser: the test below). The reasoning streams before the answer; a text prompt is not parsed."""
    responses = list(harmony_server.stub.Generate(request(forced=HARMONY), timeout=120))
    assert "".join(r.reasoning_content for r in responses) == "Paris is in France."
    assert "".join(r.text for r in responses) == "It is sunny in Paris."
    answer_starts = next(i for i, r in enumerate(responses) if r.text)
    assert not any(r.reasoning_content for r in responses[answer_starts:])
    sampling = pb.SamplingParameters(temperature=0.0, max_tokens=160)
    sampling.structured_outputs.choice.choices.append(HARMONY)
    [completion] = harmony_server.stub.Complete(
        pb.GenerateRequest(text="Hello", sampling=sampling), timeout=120
    ).completions
    assert (completion.text, completion.reasoning_content) == (HARMONY, "")


def test_a_chat_under_a_parser_of_special_tokens_keeps_them_in_the_text() -> None:
    """gpt-oss's harmony markers, Magistral's [THINK], Kimi K2's </think>, and Mistral's, DeepSeek's
    and Kimi's tool-call tags are special tokens: skipped from the text (the default), the parser would
    see none. A chat's (beam search's too) are kept under openai_gptoss, mistral and kimi_k2, and under
    the mistral, deepseek_v3, deepseek_v31 and kimi_k2 tool-call parsers where the chat's tools are
    parsed by them."""
    from pagedserve.rpc import convert
    from pagedserve.sampling_params import SamplingParams

    chat = pb.GenerateRequest(messages=pb.ChatMessages(messages=[QUESTION]))
    params = SamplingParams(max_tokens=8)
    assert params.skip_special_tokens
    kept = convert.keep_special_tokens(chat, params, "openai_gptoss")
    assert not kept.skip_special_tokens and kept.max_tokens == 8
    assert not convert.keep_special_tokens(chat, params, "mistral").skip_special_tokens  # [THINK]
    assert not convert.keep_special_tokens(chat, params, "kimi_k2").skip_special_tokens  # </think>
    assert convert.keep_special_tokens(chat, params, "qwen3").skip_special_tokens
    assert convert.keep_special_tokens(chat, params, "deepseek_v3").skip_special_tokens
    assert convert.keep_special_tokens(
        pb.GenerateRequest(text="Hi"), params, "openai_gptoss"
    ).skip_special_tokens
    with_tools = pb.GenerateRequest(messages=pb.ChatMessages(messages=[QUESTION], tools=[WEATHER]))
    for parser, keeps in (
        ("mistral", True),
        ("deepseek_v3", True),
        ("deepseek_v31", True),
        ("kimi_k2", True),
        ("hermes", False),
    ):
        tools = convert.request_tool_choice(with_tools, parser)
        assert convert.keep_special_tokens(with_tools, params, None, tools).skip_special_tokens is not keeps
    # tool_choice none, or a forced call (its output constrained to JSON): nothing to keep
    for choice in ("none", "required"):
        with_tools.messages.tool_choice = choice
        tools = convert.request_tool_choice(with_tools, "mistral")
        assert convert.keep_special_tokens(with_tools, params, None, tools).skip_special_tokens


def test_harmonys_calls_to_functions_leave_as_tool_calls(harmony_server: InProcessServer) -> None:
    """--tool-call-parser openai: a message to `functions.get_weather` (its arguments' type
    constrained, as gpt-oss writes it) is a call, the analysis before it reasoning; the completion
    ends TOOL_CALLS."""
    call = (
        "<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    )
    req = request(forced=call, tools=[WEATHER])
    req.sampling.max_tokens = 160
    completion = complete(harmony_server, req)
    assert (completion.reasoning_content, completion.text) == ("I need the weather.", "")
    assert [(c.name, json.loads(c.arguments)) for c in completion.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert completion.finish_reason == pb.TOOL_CALLS
