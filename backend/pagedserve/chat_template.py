"""Chat templates as vLLM applies them: the model's own or `--chat-template`'s, rendered with the
variables a request (`chat_template_kwargs`) or the server (`--default-chat-template-kwargs`) adds
beside the messages, e.g. Qwen3's `enable_thinking`. Torch-free: settings check these before any
model loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedserve.json_setting import parse_json_object

# apply_chat_template's own parameters and the variables it sets itself: a kwarg of one of these names
# would collide with them (a TypeError inside transformers) or quietly replace the messages
RESERVED_KWARGS = frozenset(
    {
        "add_generation_prompt",
        "chat_template",
        "continue_final_message",
        "conversation",
        "max_length",
        "messages",
        "padding",
        "return_assistant_tokens_mask",
        "return_dict",
        "return_tensors",
        "tokenize",
        "tokenizer_kwargs",
        "truncation",
    }
)


def resolve_chat_template(value: str | None) -> str | None:
    """`--chat-template`: the path of a file holding the template, or the template's text (vLLM's rule:
    a value naming no file is the template itself if it holds Jinja syntax or a newline). ValueError
    naming `chat_template` for a missing file or a template Jinja does not parse."""
    if value is None:
        return None
    if _is_file(value):
        try:
            text = Path(value).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"chat_template: {value} does not read: {exc}") from None
    elif any(mark in value for mark in ("{{", "{%", "\n")):
        text = value
    else:
        raise ValueError(
            f"chat_template: no file {value!r} (nor a Jinja template: no {{{{, {{% or newline in it)"
        )
    _check_syntax(text)
    return text


def _is_file(value: str) -> bool:
    try:
        return Path(value).is_file()
    except (OSError, ValueError):  # a template's text: longer than a file name may be, or a NUL in it
        return False


def _check_syntax(text: str) -> None:
    """Parse the template as transformers compiles it (a sandboxed environment with loop controls)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"chat_template: not a Jinja template: {exc.message} (line {exc.lineno})") from None


def parse_chat_template_kwargs(value: str | dict[str, Any] | None, field: str) -> dict[str, Any]:
    """Template variables from a JSON object (its text, or a dict already parsed). ValueError naming
    `field` (and the key) for anything else or a reserved name."""
    value = parse_json_object(value, field, "template variables")
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"{field}: {key!r} is not a template variable name")
        if key in RESERVED_KWARGS:
            raise ValueError(f"{field}: {key!r} is set by the chat request itself, not a template variable")
    return value


def whole_numbers_as_ints(value: Any) -> Any:
    """protobuf's Struct carries every number as a double: 3 arrives as 3.0. A template printing it or
    slicing with it expects what JSON gave, so whole numbers become ints."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: whole_numbers_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [whole_numbers_as_ints(v) for v in value]
    return value
