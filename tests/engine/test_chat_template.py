"""Chat templates as vLLM applies them, offline: `--chat-template` replacing the model's (or a model
without one), the template variables of `--default-chat-template-kwargs` and of a request
(`chat_template_kwargs`, `tools`), `add_generation_prompt` and `continue_final_message`, and each
misuse refused naming its field. The prompts are read back as the templated text (`RequestOutput.prompt`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pagedserve import LLM, SamplingParams
from pagedserve.errors import InvalidRequestError

# Qwen3's switch, as its template reads it: an empty thinking block opens the reply when it is off
THINKING_TEMPLATE = (
    "{% if tools is defined and tools %}<|im_start|>system\ntools:"
    "{% for tool in tools %} {{ tool.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
EMPTY_THINKING = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STARTED_REPLY = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]


def one_token() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    """The model's own template (SmolLM2's ChatML)."""
    return LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def thinking_llm(tiny_llama_dir: str) -> LLM:
    return LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=64,
        chat_template=THINKING_TEMPLATE,
        default_chat_template_kwargs='{"enable_thinking": false}',
    )


def prompt_of(llm: LLM, messages: list[dict[str, str]], **options: object) -> str:
    [out] = llm.chat(messages, one_token(), **options)  # type: ignore[arg-type]
    assert out.prompt is not None
    return out.prompt


def test_the_generation_prompt_opens_the_assistants_turn_unless_turned_off(llm: LLM) -> None:
    assert prompt_of(llm, QUESTION).endswith("capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert prompt_of(llm, QUESTION, add_generation_prompt=False).endswith("capital of France?<|im_end|>\n")


def test_continue_final_message_leaves_the_reply_open(llm: LLM) -> None:
    """The model goes on with the reply begun for it: the prompt stops at its last word (no end of
    turn, no new turn), and the completion continues from there."""
    prompt = prompt_of(llm, STARTED_REPLY, add_generation_prompt=False, continue_final_message=True)
    assert prompt.endswith("<|im_start|>assistant\nThe capital of France is"), prompt
    closed = prompt_of(llm, STARTED_REPLY, add_generation_prompt=False)
    assert closed.endswith("The capital of France is<|im_end|>\n")


def test_the_servers_default_variables_apply_unless_the_request_sets_them(thinking_llm: LLM) -> None:
    assert prompt_of(thinking_llm, QUESTION).endswith(EMPTY_THINKING)
    thinking = prompt_of(thinking_llm, QUESTION, chat_template_kwargs={"enable_thinking": True})
    assert thinking.endswith("<|im_start|>assistant\n") and "<think>" not in thinking


def test_tools_reach_the_template(thinking_llm: LLM) -> None:
    tools = [{"name": "get_weather"}, {"name": "get_time"}]
    prompt = prompt_of(thinking_llm, QUESTION, tools=tools)
    assert prompt.startswith("<|im_start|>system\ntools: get_weather get_time<|im_end|>\n"), prompt


CALLS_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}"
    "{% endfor %}"
)


def called(arguments: object) -> list[dict[str, object]]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]}]


def test_calls_in_the_history_reach_the_template_with_their_arguments_parsed(llm: LLM) -> None:
    """OpenAI's history gives a call's arguments as JSON text; vLLM's LLM.chat (and the gRPC
    ChatMessage.tool_calls) give the template an object, which `tojson` prints once, not as a string."""
    for arguments, printed in [
        ('{"city": "Paris"}', '<get_weather {"city": "Paris"}>'),
        ({"city": "Paris"}, '<get_weather {"city": "Paris"}>'),
        ("", "<get_weather {}>"),
    ]:
        prompt = prompt_of(llm, called(arguments), chat_template=CALLS_TEMPLATE, add_generation_prompt=False)
        assert prompt.endswith(f"[assistant]{printed}"), prompt
    with pytest.raises(
        InvalidRequestError,
        match=r"^messages: conversation 0, message 1, tool call 0: function.arguments not JSON",
    ):
        prompt_of(llm, called("{city"), chat_template=CALLS_TEMPLATE)


def test_a_null_or_absent_content_reaches_the_template_as_empty_text(llm: LLM) -> None:
    """OpenAI's assistant turn that only calls tools has content null. The model's template adds
    message['content'] to strings: transformers drops the None, and the template failed on the missing
    key ("'dict object' has no attribute 'content'"). vLLM gives such a template "" (and so for an
    absent content)."""
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]
    turn = "<|im_start|>assistant\n<|im_end|>\n"
    for message in [{"role": "assistant", "content": None, "tool_calls": calls}, {"role": "assistant"}]:
        prompt = prompt_of(llm, [*QUESTION, message], add_generation_prompt=False)
        assert prompt.endswith(f"capital of France?<|im_end|>\n{turn}"), prompt


def test_a_calls_template_replaces_the_engines(thinking_llm: LLM) -> None:
    prompt = prompt_of(thinking_llm, QUESTION, chat_template="{{ messages[0]['content'] }} -> ")
    assert prompt == "What is the capital of France? -> "


def test_a_model_without_a_template_takes_one_from_the_setting(tiny_llama_dir: str, tmp_path: Path) -> None:
    for file in Path(tiny_llama_dir).iterdir():
        if file.name != "chat_template.jinja":
            (tmp_path / file.name).symlink_to(file)
    bare = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=16)
    with pytest.raises(
        InvalidRequestError, match=r"^messages: this model has no chat template \(--chat-template"
    ):
        bare.chat(QUESTION, one_token())
    template_file = tmp_path / "template.jinja"
    template_file.write_text(THINKING_TEMPLATE)
    templated = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=16, chat_template=str(template_file))
    assert prompt_of(templated, QUESTION, chat_template_kwargs={"enable_thinking": False}).endswith(
        EMPTY_THINKING
    )


def test_misuse_is_refused_naming_the_field(llm: LLM) -> None:
    encode = llm.engine.encode_chat
    with pytest.raises(InvalidRequestError, match=r"^continue_final_message: cannot be true while add_gen"):
        encode(STARTED_REPLY, continue_final_message=True)
    for kwargs, error in [
        (
            {"add_generation_prompt": False},
            r"^chat_template_kwargs: 'add_generation_prompt' is set by the chat",
        ),
        ({"messages": []}, r"^chat_template_kwargs: 'messages' is set by the chat request itself"),
        ({"a-b": 1}, r"^chat_template_kwargs: 'a-b' is not a template variable name"),
    ]:
        with pytest.raises(InvalidRequestError, match=error):
            encode(QUESTION, chat_template_kwargs=kwargs)
    # a template that drops the last message cannot continue it
    with pytest.raises(InvalidRequestError, match=r"^continue_final_message: .*final message"):
        encode(
            STARTED_REPLY,
            add_generation_prompt=False,
            continue_final_message=True,
            chat_template="{% for m in messages[:-1] %}{{ m['content'] }}{% endfor %}",
        )
    with pytest.raises(InvalidRequestError, match=r"^chat_template: not a Jinja template"):
        encode(QUESTION, chat_template="{% for m in messages %}")
    # a template whose code fails on this request (transformers passes tools=None when none are given)
    with pytest.raises(
        InvalidRequestError, match=r"^messages: the chat template failed on them: TypeError: 'NoneType'"
    ):
        encode(QUESTION, chat_template="{% for t in tools %}{{ t.name }}{% endfor %}")
    assert prompt_of(llm, QUESTION)  # still serving
