"""Tool calling as vLLM's chat completions do it. A chat request offers tools, which reach the chat
template as `tools`; its tool choice decides what the output is:

- none: text, as without tools;
- auto: text, and the calls the model chose to write, found by the parser of its family's format
  (`--tool-call-parser`: hermes for Qwen2.5/Qwen3/Hermes, llama3_json for Llama 3.1/3.2, pythonic for
  Llama 3.2/4's pythonic template, granite for IBM Granite 3.x);
- required, or one named function: calls only, the output constrained by structured outputs to their
  JSON (a list of {"name", "parameters"}, or the named function's arguments).

Parsers read a completion's text as it streams: the text of a call is held back until the call is
whole, then leaves as a ToolCall instead of text. Torch-free."""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from pagedserve.errors import InvalidRequestError

TOOL_PARSERS = (
    "hermes",
    "llama3_json",
    "pythonic",
    "granite",
    "phi4_mini_json",
    "openai",
    "olmo3",
    "mistral",
    "qwen3_coder",
    "glm45",
    "seed_oss",
    "deepseek_v3",
    "deepseek_v31",
    "kimi_k2",
)
# GPT-OSS's harmony format (OpenAI's): a message's header ends at <|message|>, its body at one of the ends
HARMONY_CHANNEL, HARMONY_MESSAGE = "<|channel|>", "<|message|>"
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
TOOL_CHOICES = ("none", "auto", "required")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def new_mistral_call_id() -> str:
    """Nine letters and digits: the ids Mistral's chat templates take back (they refuse others)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as JSON text
    id: str = field(default_factory=new_call_id)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema

    def template_entry(self) -> dict[str, Any]:
        """The tool as chat templates read it (OpenAI's shape)."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


def parse_tool(index: int, name: str, description: str, parameters: str) -> Tool:
    """A request's `tools[index]`; InvalidRequestError naming the field."""
    if not _TOOL_NAME.fullmatch(name):
        raise InvalidRequestError(
            f"tools[{index}].name", f"must be 1 to 64 letters, digits, _ or -, got {name[:80]!r}"
        )
    schema: Any = {"type": "object", "properties": {}}
    if parameters:
        try:
            schema = json.loads(parameters)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"tools[{index}].parameters", f"not JSON: {exc}") from None
        except RecursionError:
            raise InvalidRequestError(f"tools[{index}].parameters", "not JSON: nested too deeply") from None
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"tools[{index}].parameters", "must be a JSON schema (an object)")
    return Tool(name, description, schema)


def check_unique(tools: list[Tool]) -> None:
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise InvalidRequestError(
                f"tools[{i}].name", f"{tool.name!r} is tools[{seen[tool.name]}]'s name too"
            )
        seen[tool.name] = i


def call_arguments(arguments: str, field_name: str) -> dict[str, Any]:
    """A call's arguments in the history, parsed for the template (which prints them as an object)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(field_name, f"not JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequestError(field_name, "not JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(field_name, "must be a JSON object")
    return value


@dataclass(frozen=True)
class ToolChoice:
    """What a request's tool choice makes of its output: a JSON schema constraining it (required, or a
    named function), and a parser per completion."""

    schema: dict[str, Any] | None
    new_parser: Callable[[], ToolCallParser]
    schema_field: str = "tools"  # what a schema that does not compile is said of
    # required: each tool's parameters by field (tools[i].parameters), the parts of the schema, so a
    # refused schema is said of the tool whose parameters are refused alone
    parameters: tuple[tuple[str, dict[str, Any]], ...] = ()
    special_tokens: bool = False  # the parser reads special tokens, to be kept in the text (Mistral's)


def tool_choice(tools: list[Tool], choice: str, function: str, auto_parser: str | None) -> ToolChoice | None:
    """`choice` (none, auto, required; empty: auto with tools) or `function` (a tool's name) over the
    request's tools; `auto_parser`: the server's --tool-call-parser when --enable-auto-tool-choice is
    on. None: the output is text. InvalidRequestError naming the field for a choice that cannot be
    made."""
    if function:
        index = {tool.name: i for i, tool in enumerate(tools)}
        if function not in index:
            names = ", ".join(index) or "none"
            raise InvalidRequestError("tool_choice_function", f"no tool {function[:80]!r} (tools: {names})")
        i = index[function]
        return ToolChoice(tools[i].parameters, lambda: NamedCallParser(function), f"tools[{i}].parameters")
    if choice and choice not in TOOL_CHOICES:
        raise InvalidRequestError("tool_choice", f"must be none, auto or required, got {choice[:80]!r}")
    if not tools:
        if choice in ("auto", "required"):
            raise InvalidRequestError("tool_choice", f"{choice} needs tools")
        return None
    choice = choice or "auto"
    if choice == "none":
        return None
    if choice == "required":
        parameters = tuple((f"tools[{i}].parameters", tool.parameters) for i, tool in enumerate(tools))
        return ToolChoice(required_schema(tools), RequiredCallsParser, parameters=parameters)
    if auto_parser is None:
        raise InvalidRequestError(
            "tool_choice",
            "auto (the default with tools) needs a server started with --enable-auto-tool-choice and "
            "--tool-call-parser; set none, required or tool_choice_function instead",
        )
    parser = PARSERS[auto_parser]
    return ToolChoice(None, parser.for_tools(tools), special_tokens=parser.SPECIAL_TOKENS)


def required_schema(tools: list[Tool]) -> dict[str, Any]:
    """One or more calls, each of one of the tools with arguments its schema takes."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.name]}, "parameters": tool.parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


# -- parsers ----------------------------------------------------------------------------------------


class ToolCallParser:
    """One completion's text in, as it streams; what of it is text (content) and which calls, out."""

    SPECIAL_TOKENS = False  # its format is special tokens, which the text must keep (Mistral's)

    @classmethod
    def for_tools(cls, tools: Sequence[Tool]) -> Callable[[], ToolCallParser]:
        """A maker of this parser for a request with `tools` (Qwen3-Coder's reads their schemas)."""
        return cls

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the completion's end: what was held back."""
        raise NotImplementedError


def _call_of(value: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """{"name": ..., "<an arguments key>": {...}} as a call; None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments: Any = next((value[key] for key in arguments_keys if key in value), {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _json_or_none(text: str) -> Any:
    """The JSON value `text` holds; None where it holds none."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # a model's output nested past the parser's depth too
        return None


def _json_call(text: str) -> ToolCall | None:
    return _call_of(_json_or_none(text), ("arguments",))


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: the tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesParser(ToolCallParser):
    """Calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` between text (Qwen2.5, Qwen3,
    Hermes); the last call may lack its closing tag. Once a call is seen, whitespace between calls is
    dropped; a call that does not parse stays text."""

    START, END = "<tool_call>", "</tool_call>"
    MARKERS: tuple[str, ...] = ()  # tags around the calls, dropped from the text (DeepSeek's section)

    def __init__(self) -> None:
        self._pending = ""
        self._in_call = False
        self._called = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                end = self._pending.find(self.END)
                if end < 0:
                    break
                body, self._pending = self._pending[:end], self._pending[end + len(self.END) :]
                self._in_call = False
                self._take_call(body, self.START + body + self.END, content, calls)
                continue
            start = self._pending.find(self.START)
            if start < 0:
                keep = max(partial_suffix(self._pending, tag) for tag in (self.START, *self.MARKERS))
                self._add_text(self._pending[: len(self._pending) - keep], content)
                self._pending = self._pending[len(self._pending) - keep :]
                break
            self._add_text(self._pending[:start], content)
            self._pending = self._pending[start + len(self.START) :]
            self._in_call = True
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        if self._in_call:
            self._take_call(self._pending, self.START + self._pending, content, calls)
        else:
            self._add_text(self._pending, content)
        self._pending = ""
        return "".join(content), calls

    def _take_call(self, body: str, raw: str, content: list[str], calls: list[ToolCall]) -> None:
        call = self._parse_call(body)
        if call is None:
            content.append(raw)
        else:
            calls.append(call)
            self._called = True

    def _add_text(self, text: str, content: list[str]) -> None:
        for marker in self.MARKERS:
            text = text.replace(marker, "")
        if text and not (self._called and text.isspace()):
            content.append(text)

    def _parse_call(self, body: str) -> ToolCall | None:
        return _json_call(body)


class _SchemaTypedParser(HermesParser):
    """Calls in <tool_call> tags whose arguments are text, typed by the request's tool schemas: each
    tool's `properties` by name."""

    def __init__(self, tools: Sequence[Tool] = ()) -> None:
        super().__init__()
        self._properties = {tool.name: _properties(tool) for tool in tools}

    @classmethod
    def for_tools(cls, tools: Sequence[Tool]) -> Callable[[], ToolCallParser]:
        return lambda: cls(tools)


def _properties(tool: Tool) -> dict[str, Any]:
    """A tool's parameters by name (its schema's `properties`; none where the schema names none, or
    names them otherwise than as an object)."""
    properties = tool.parameters.get("properties")
    return properties if isinstance(properties, dict) else {}


class Qwen3CoderParser(_SchemaTypedParser):
    """Qwen3-Coder's calls, as vLLM's qwen3_coder parser reads them: in each `<tool_call>`, a
    `<function=NAME>` and its `<parameter=KEY>` values as the model writes them, one newline trimmed
    at each end, then typed by the tool's JSON schema: strings as written; integers and numbers parsed
    (a whole number as an integer); booleans true where "true"; objects and arrays as JSON (else a
    Python literal); null as null whatever the type; a value that does not parse as its type, or a
    parameter the schema does not name, a string. What is not such a call stays text."""

    def _parse_call(self, body: str) -> ToolCall | None:
        function = _XML_FUNCTION.fullmatch(body)
        if function is None:
            return None
        name, parameters = function[1], _matches_alone(_XML_PARAMETER, function[2])
        if parameters is None:  # text between the parameters: no call
            return None
        properties = self._properties.get(name, {})
        arguments = {
            p[1]: _typed(p[2].removeprefix("\n").removesuffix("\n"), properties.get(p[1])) for p in parameters
        }
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


class SeedOssParser(Qwen3CoderParser):
    """Seed-OSS's calls (vLLM's seed_oss parser): Qwen3-Coder's XML, typed the same way, between
    `<seed:tool_call>` and `</seed:tool_call>`."""

    START, END = "<seed:tool_call>", "</seed:tool_call>"


class Glm45Parser(_SchemaTypedParser):
    """GLM-4.5's and GLM-4.6's calls, as vLLM's glm45 parser reads them: in each `<tool_call>`, the
    function's name on the first line, then `<arg_key>KEY</arg_key>` and `<arg_value>VALUE</arg_value>`
    pairs, the values stripped; a value the tool's schema types as a string as written, any other
    read as JSON (or JSON once unescaped, or a Python literal), else as written. What is not such a
    call stays text."""

    def _parse_call(self, body: str) -> ToolCall | None:
        first_line, _, rest = body.strip().partition("\n")
        name, pairs = first_line.strip(), _matches_alone(_GLM_ARGUMENT, rest)
        if not _TOOL_NAME.fullmatch(name) or pairs is None:  # (text between the pairs: no call)
            return None
        properties = self._properties.get(name, {})
        arguments: dict[str, Any] = {}
        for pair in pairs:
            key, value = pair[1].strip(), pair[2].strip()
            schema = properties.get(key)
            is_string = isinstance(schema, dict) and schema.get("type") == "string"
            arguments[key] = value if is_string else _glm_value(value)
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _deepseek_tag(name: str) -> str:
    """DeepSeek's special token `name`: `<｜tool▁calls▁begin｜>`, its bars full-width (U+FF5C) and
    its spaces U+2581."""
    return "<\uff5c" + name.replace(" ", "\u2581") + "\uff5c>"


class DeepSeekV3Parser(HermesParser):
    """DeepSeek-V3's and R1's calls, as vLLM's deepseek_v3 parser reads them: in a section between
    `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>` (dropped), each call between
    `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>` as its type (`function`), `<｜tool▁sep｜>`, its
    name on that line, then its arguments as a JSON object in a json code fence. Special tokens, kept
    in the text of a request this parser reads. What is not such a call stays text."""

    START, END = _deepseek_tag("tool call begin"), _deepseek_tag("tool call end")
    MARKERS = (_deepseek_tag("tool calls begin"), _deepseek_tag("tool calls end"))
    SEP = _deepseek_tag("tool sep")
    SPECIAL_TOKENS = True

    def _parse_call(self, body: str) -> ToolCall | None:
        _, found, rest = body.partition(self.SEP)
        fenced = _FENCED_JSON.fullmatch(rest) if found else None
        if fenced is None:
            return None
        return _named_call(fenced[1].strip(), _json_or_none(fenced[2]))


_FENCED_JSON = re.compile(r"([^\n]*)\n```json\n(.*)\n```\s*", re.DOTALL)


def _named_call(name: str, arguments: Any, call_id: str | None = None) -> ToolCall | None:
    """A call of a tool name and its arguments (a JSON object); None for anything else."""
    if not _TOOL_NAME.fullmatch(name) or not isinstance(arguments, dict):
        return None
    call = ToolCall(name, json.dumps(arguments, ensure_ascii=False))
    return call if call_id is None else replace(call, id=call_id)


class DeepSeekV31Parser(DeepSeekV3Parser):
    """DeepSeek-V3.1's calls (vLLM's deepseek_v31): DeepSeek-V3's tags, each call its name,
    `<｜tool▁sep｜>`, then its arguments as a JSON object."""

    def _parse_call(self, body: str) -> ToolCall | None:
        name, found, arguments = body.partition(self.SEP)
        return _named_call(name.strip(), _json_or_none(arguments)) if found else None


class KimiK2Parser(HermesParser):
    """Kimi K2's calls (vLLM's kimi_k2): in a section between `<|tool_calls_section_begin|>` and
    `<|tool_calls_section_end|>` (dropped), each call between `<|tool_call_begin|>` and
    `<|tool_call_end|>` as its id `functions.NAME:INDEX`, `<|tool_call_argument_begin|>`, then its
    arguments as a JSON object. The call keeps the model's id, which Kimi's chat template takes back.
    Special tokens, kept in the text of a request this parser reads."""

    START, END = "<|tool_call_begin|>", "<|tool_call_end|>"
    MARKERS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    SPECIAL_TOKENS = True

    def _parse_call(self, body: str) -> ToolCall | None:
        call_id, found, arguments = body.partition("<|tool_call_argument_begin|>")
        match = _KIMI_ID.fullmatch(call_id.strip()) if found else None
        if match is None:
            return None
        return _named_call(match[1], _json_or_none(arguments), call_id.strip())


_KIMI_ID = re.compile(r"(?:functions\.)?([A-Za-z0-9_-]+):\d+")


_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_value(value: str) -> Any:
    """A GLM-4.5 argument that is not a string by its schema: JSON, JSON escaped inside a string, a
    Python literal, or the text as written (vLLM's order)."""
    parsed = _json_or_none(value)
    if parsed is not None or value == "null":
        return parsed
    unescaped = _json_or_none(f'"{value}"')
    if isinstance(unescaped, str):
        parsed = _json_or_none(unescaped)
        if parsed is not None:
            return parsed
    return _literal_or_text(value)


def _literal_or_text(value: str) -> Any:
    """The Python literal `value` writes, else `value` itself."""
    try:
        return ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value


def _matches_alone(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """`pattern`'s matches in `text` where only whitespace lies between and around them, else None."""
    matches, end = [], 0
    for match in pattern.finditer(text):
        if text[end : match.start()].strip():
            return None
        matches.append(match)
        end = match.end()
    return matches if not text[end:].strip() else None


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _typed(value: str, schema: Any) -> Any:
    """A Qwen3-Coder parameter's text as its schema's type (`Qwen3CoderParser`)."""
    if value.lower() == "null":
        return None
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    if isinstance(kind, list):  # ["integer", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind).strip().lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        parsed = _json_or_none(value)
        if parsed is not None:
            return parsed
    return _literal_or_text(value)


class _WholeOutputParser(ToolCallParser):
    """Calls that take the whole output, told apart from text by how it begins: held back to the end,
    then parsed; text that does not parse as calls is text after all."""

    BEGINS: tuple[str, ...] = ()  # what an output of calls begins with (after whitespace)

    def __init__(self) -> None:
        self._pending = ""
        self._calls_begun = False
        self._text = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._text:
            return text, []
        self._pending += text
        head = self._pending.lstrip()
        if not head or self._calls_begun:
            return "", []
        if any(head.startswith(begin) for begin in self.BEGINS):
            self._calls_begun = True
            return "", []
        if any(begin.startswith(head) for begin in self.BEGINS):  # it may yet begin so
            return "", []
        self._text = True
        text, self._pending = self._pending, ""
        return text, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self._pending = self._pending, ""
        calls = self._parse(text) if self._calls_begun else None
        return ("", calls) if calls else (text, [])

    def _parse(self, text: str) -> list[ToolCall] | None:
        raise NotImplementedError


class Llama3JsonParser(_WholeOutputParser):
    """Llama 3.1/3.2's JSON calls: `{"name": ..., "parameters": {...}}` (or "arguments"), several
    separated by `;`, after an optional <|python_tag|>."""

    TAG = "<|python_tag|>"
    BEGINS = ("{", TAG)

    def _parse(self, text: str) -> list[ToolCall] | None:
        text = text.strip().removeprefix(self.TAG)
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        pos = 0
        while True:
            while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
                pos += 1
            if pos == len(text):
                return calls or None
            try:
                value, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                return None
            call = _call_of(value, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)


class PythonicParser(_WholeOutputParser):
    """Calls as a Python list: `[get_weather(city="Paris"), get_time()]` (Llama 3.2/4's pythonic
    templates, optionally between <|python_start|> and <|python_end|>); keyword arguments of literal
    values only."""

    BEGINS: tuple[str, ...] = ("[", "<|python_start|>")

    def _parse(self, text: str) -> list[ToolCall] | None:
        return self._calls(
            text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        )

    def _calls(self, text: str) -> list[ToolCall] | None:
        """`text`'s Python list of calls, each with keyword arguments of literal values alone."""
        try:
            tree = self._literals(ast.parse(text, mode="eval").body)
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls: list[ToolCall] = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
                return None
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
                text_arguments = json.dumps(arguments, ensure_ascii=False)
            except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal, or not JSON's
                return None
            if len(arguments) != len(node.keywords):  # a **kwargs
                return None
            calls.append(ToolCall(node.func.id, text_arguments))
        return calls

    def _literals(self, tree: ast.expr) -> ast.expr:
        return tree


class Olmo3Parser(PythonicParser):
    """OLMo 3's calls: one pythonic call a line between `<function_calls>` and `</function_calls>`, as
    its template asks and vLLM's olmo3 parser reads them; JSON's null, true and false taken for
    Python's None, True and False (the model writes its arguments as the tools' JSON schemas do)."""

    TAG, END = "<function_calls>", "</function_calls>"
    BEGINS = (TAG,)

    def _parse(self, text: str) -> list[ToolCall] | None:
        body = text.strip().removeprefix(self.TAG).removesuffix(self.END)
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        return self._calls(f"[{', '.join(lines)}]") if lines else None

    def _literals(self, tree: ast.expr) -> ast.expr:
        return cast(ast.expr, _JsonNames().visit(tree))


class MistralParser(_WholeOutputParser):
    """Mistral's calls after its `[TOOL_CALLS]` token (a special token: kept in the text of a request
    this parser reads, `ToolChoice.special_tokens`), as vLLM's mistral parser reads them: a JSON list
    `[{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3's, Mistral Nemo's, Mistral Small 3.1's),
    or one call a tag as `name{...}`, `name[ARGS]{...}` or `name[CALL_ID]id[ARGS]{...}` (Mistral's
    tokenizers from v11 on: Mistral Small 3.2, Magistral, Devstral). Text before the first tag
    streams as text; from it on the output is held to its end, and what is not all calls is text.
    Calls get the nine-character ids Mistral's templates take back (or the model's own `[CALL_ID]`)."""

    TAG = "[TOOL_CALLS]"
    SPECIAL_TOKENS = True

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(Calls begin at the tag wherever it comes, the text before it streamed.)"""
        self._pending += text
        if self._calls_begun:
            return "", []
        at = self._pending.find(self.TAG)
        if at >= 0:
            self._calls_begun = True
            content, self._pending = self._pending[:at], self._pending[at:]
            return content, []
        content = self._pending[: len(self._pending) - partial_suffix(self._pending, self.TAG)]
        self._pending = self._pending[len(content) :]
        return content, []

    def _parse(self, text: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        for piece in text.split(self.TAG)[1:]:
            found = _mistral_list(piece) if piece.lstrip().startswith("[{") else _mistral_call(piece)
            if found is None:
                return None
            calls += found
        return calls or None


_MISTRAL_NAME = re.compile(r"\s*([A-Za-z0-9_-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?(?:\[ARGS\])?")


def _mistral_list(text: str) -> list[ToolCall] | None:
    value = _json_or_none(text)
    if not (isinstance(value, list) and value):
        return None
    calls = [_call_of(item, ("arguments",)) for item in value]
    if any(call is None for call in calls):
        return None
    return [replace(call, id=new_mistral_call_id()) for call in calls if call is not None]


def _mistral_call(text: str) -> list[ToolCall] | None:
    """`name{...}` (with `[CALL_ID]id` and `[ARGS]` between where the tokenizer writes them) as a call."""
    name = _MISTRAL_NAME.match(text)
    if name is None:
        return None
    try:
        arguments, end = json.JSONDecoder().raw_decode(text, name.end())
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(arguments, dict) or text[end:].strip():
        return None
    return [ToolCall(name[1], json.dumps(arguments, ensure_ascii=False), name[2] or new_mistral_call_id())]


class _JsonNames(ast.NodeTransformer):
    """JSON's null, true and false, written as Python names, as the constants they stand for."""

    VALUES = {"null": None, "true": True, "false": False}

    def visit_Name(self, node: ast.Name) -> ast.expr:  # noqa: N802 (NodeTransformer's name)
        return ast.Constant(self.VALUES[node.id]) if node.id in self.VALUES else node


class _JsonListParser(_WholeOutputParser):
    """Calls as a JSON list `[{"name": ..., "<an ARGUMENTS key>": {...}}, ...]` after one of `TAGS`
    (or alone where `BEGINS` has "["); every item a call, or none is."""

    TAGS: tuple[str, ...] = ()
    ARGUMENTS: tuple[str, ...] = ("arguments",)

    def _parse(self, text: str) -> list[ToolCall] | None:
        text = text.strip()
        for tag in self.TAGS:
            text = text.removeprefix(tag)
        value = _json_or_none(text)
        if not (isinstance(value, list) and value):
            return None
        calls = []
        for item in value:
            call = _call_of(item, self.ARGUMENTS)
            if call is None:
                return None
            calls.append(call)
        return calls


class GraniteParser(_JsonListParser):
    """IBM Granite 3.x's calls: a JSON list `[{"name": ..., "arguments": {...}}, ...]`, after
    `<|tool_call|>` (3.0) or `<tool_call>` (3.1 and later) or alone, as vLLM's granite parser reads
    them."""

    TAGS = ("<|tool_call|>", "<tool_call>")
    BEGINS = (*TAGS, "[")


class Phi4MiniParser(_JsonListParser):
    """Phi-4-mini's calls: `functools[{"name": ..., "arguments": {...}}, ...]` ("parameters" too), as
    vLLM's phi4_mini_json parser reads them (a list whose arguments hold lists as well: vLLM's stops
    at the first "]")."""

    TAGS = ("functools",)
    BEGINS = TAGS
    ARGUMENTS = ("arguments", "parameters")


class RequiredCallsParser(_WholeOutputParser):
    """tool_choice required: the output is a JSON list of {"name", "parameters"} (its schema holds it)."""

    BEGINS = ("[",)

    def _parse(self, text: str) -> list[ToolCall] | None:
        value = _json_or_none(text)
        if not isinstance(value, list):
            return None
        calls = [_call_of(item, ("parameters",)) for item in value]
        if not calls or any(call is None for call in calls):
            return None
        return [call for call in calls if call is not None]


class NamedCallParser(_WholeOutputParser):
    """A named function: the output is that function's arguments, a JSON object."""

    BEGINS = ("{",)

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _parse(self, text: str) -> list[ToolCall] | None:
        arguments = _json_or_none(text)
        if not isinstance(arguments, dict):
            return None
        return [ToolCall(self.name, json.dumps(arguments, ensure_ascii=False))]


class HarmonyCallParser(ToolCallParser):
    """GPT-OSS's calls (`--tool-call-parser openai`, vLLM's name): harmony messages to a function,
    `<|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>`, as `--reasoning-parser
    openai_gptoss` passes them on whole (every other message it strips to its body). The last call
    may lack its `<|call|>` (an EOS, left out of the text). A message that is no call to a function
    with a JSON object of arguments stays text, markers and all."""

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._pending:
            start = self._pending.find(HARMONY_CHANNEL)
            if start < 0:
                keep = partial_suffix(self._pending, HARMONY_CHANNEL)
                content.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
            content.append(self._pending[:start])
            self._pending = self._pending[start:]
            ends = [(i, tag) for tag in HARMONY_ENDS if (i := self._pending.find(tag)) >= 0]
            if not ends:
                break  # a message begun: held to its end
            end, tag = min(ends)
            message, self._pending = self._pending[:end], self._pending[end + len(tag) :]
            call = _harmony_call(message)
            if call is None:
                content.append(message + tag)
            else:
                calls.append(call)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._pending = self._pending, ""
        call = _harmony_call(rest)
        return ("", [call]) if call is not None else (rest, [])


_HARMONY_CALL = re.compile(r"^<\|channel\|>\w+ to=functions\.([^\s<]+)")


def _harmony_call(message: str) -> ToolCall | None:
    """A call of a message `<|channel|>CHANNEL to=functions.NAME ...<|message|>ARGUMENTS`, its end cut."""
    header, found, body = message.partition(HARMONY_MESSAGE)
    recipient = _HARMONY_CALL.match(header)
    arguments = _json_or_none(body) if found else None
    if recipient is None or not isinstance(arguments, dict):
        return None
    return ToolCall(recipient[1], json.dumps(arguments, ensure_ascii=False))


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
    "granite": GraniteParser,
    "phi4_mini_json": Phi4MiniParser,
    "openai": HarmonyCallParser,
    "olmo3": Olmo3Parser,
    "mistral": MistralParser,
    "qwen3_coder": Qwen3CoderParser,
    "glm45": Glm45Parser,
    "seed_oss": SeedOssParser,
    "deepseek_v3": DeepSeekV3Parser,
    "deepseek_v31": DeepSeekV31Parser,
    "kimi_k2": KimiK2Parser,
}
assert tuple(PARSERS) == TOOL_PARSERS


def parse_tool_calls(text: str, parser: str, tools: Sequence[Tool] = ()) -> tuple[str, list[ToolCall]]:
    """A whole output's content and calls, by the named parser (for offline use: `LLM.chat` output;
    `tools`: the request's, whose schemas qwen3_coder types the arguments by)."""
    if parser not in PARSERS:
        raise ValueError(f"tool_call_parser: must be one of {', '.join(TOOL_PARSERS)}, got {parser!r}")
    each = PARSERS[parser].for_tools(tools)()
    content, calls = each.feed(text)
    rest, more = each.finish()
    return content + rest, calls + more
