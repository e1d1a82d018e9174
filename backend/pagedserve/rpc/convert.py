"""Protocol messages <-> engine types. Every rejection is an InvalidRequestError naming the field."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from pagedserve.chat_template import whole_numbers_as_ints
from pagedserve.core.block_manager import BlockStored
from pagedserve.engine.async_engine import KvEventBatch
from pagedserve.engine.llm_engine import LLMEngine, check_token_ids
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import RequestDelta, TokenLogprobs
from pagedserve.pooling_params import PoolingParams
from pagedserve.reasoning import (
    READS_SPECIAL_TOKENS,
    HarmonyParser,
    ReasoningParser,
    new_parser,
    prompt_opens_reasoning,
)
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.sampling_params import (
    BEAM_SEARCH_FIELDS,
    NOT_IN_BEAM_SEARCH,
    BeamSearchParams,
    SamplingParams,
    StructuredOutputsParams,
    check_beam_search_field,
    check_beam_width,
)
from pagedserve.tool_calls import (
    Tool,
    ToolCall,
    ToolCallParser,
    ToolChoice,
    call_arguments,
    check_unique,
    parse_tool,
    tool_choice,
)

# tool: a tool's result, after the assistant message that called it (its tool_calls)
CHAT_ROLES = ("system", "user", "assistant", "tool")
_OPTIONAL_PARAMS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "n",
    "skip_special_tokens",
    "prompt_logprobs",
    "truncate_prompt_tokens",
    "detokenize",
    "spaces_between_special_tokens",
)
# The message's repeated and map fields among NOT_IN_BEAM_SEARCH's, as the plain values it names
_REPEATED_FIELDS: dict[str, Callable[[Any], object]] = {
    "stop": list,
    "stop_token_ids": list,
    "logit_bias": dict,
    "allowed_token_ids": list,
    "bad_words": list,
}
_FINISH_REASONS = {
    "length": pb.LENGTH,
    "stop": pb.STOP,
    "eos": pb.EOS,
    "aborted": pb.ABORTED,
    "error": pb.ERROR,
}
_MAX_REQUEST_ID_LEN = 256


def parse_message(message_type: type[Message], data: bytes) -> Message | InvalidRequestError:
    """Deserialize a request, turning undecodable bytes (e.g. invalid UTF-8 in a string field) into
    an error naming the field instead of the transport's generic failure."""
    try:
        return message_type.FromString(data)
    except DecodeError:
        return InvalidRequestError(
            _find_bad_string(message_type.DESCRIPTOR, data),
            "is not valid UTF-8 or not a valid protobuf encoding",
        )


def _find_bad_string(descriptor: object, data: bytes, prefix: str = "") -> str:
    """Walk the wire format to name the string field whose bytes are not UTF-8 (best effort)."""
    from google.protobuf.internal.decoder import _DecodeVarint

    fields = {f.number: f for f in descriptor.fields}  # type: ignore[attr-defined]
    pos = 0
    try:
        while pos < len(data):
            key, pos = _DecodeVarint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _DecodeVarint(data, pos)
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                size, pos = _DecodeVarint(data, pos)
                chunk, pos = data[pos : pos + size], pos + size
                field = fields.get(number)
                if field is None:
                    continue
                name = prefix + field.name
                if field.type == field.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == field.TYPE_MESSAGE:
                    inner = _find_bad_string(field.message_type, chunk, name + ".")
                    if inner != name + ".request":
                        return inner
            else:
                break
    except (IndexError, ValueError):
        pass
    return prefix + "request"


def sampling_params(
    message: pb.SamplingParameters, engine: LLMEngine, tools: ToolChoice | None = None
) -> SamplingParams:
    """The fields the message sets; the engine's defaults (the model's, then ours) for the rest. A tool
    choice of required or a named function constrains the output to its schema."""
    if message.HasField("length_penalty"):  # else it would change nothing, silently
        raise InvalidRequestError("length_penalty", "ranks beams: it needs use_beam_search true")
    kwargs: dict[str, object] = {
        name: getattr(message, name) for name in _OPTIONAL_PARAMS if message.HasField(name)
    }
    kwargs.update(
        ignore_eos=message.ignore_eos,
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        include_stop_str_in_output=message.include_stop_str_in_output,
    )
    if message.logit_bias:
        kwargs["logit_bias"] = dict(message.logit_bias)
    if message.allowed_token_ids:  # empty: unset (proto3 cannot tell the two apart)
        kwargs["allowed_token_ids"] = list(message.allowed_token_ids)
    if message.bad_words:
        kwargs["bad_words"] = list(message.bad_words)
    if message.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs(message.structured_outputs)
    if tools is not None and tools.schema is not None:
        if "structured_outputs" in kwargs:
            raise InvalidRequestError(
                "sampling.structured_outputs",
                "cannot be set with tool_choice required or tool_choice_function, which constrain the "
                "output to the tools' calls",
            )
        # compact JSON: with whitespace allowed, a small model may spend its tokens on blank lines
        try:
            kwargs["structured_outputs"] = StructuredOutputsParams(
                json=json.dumps(tools.schema), disable_any_whitespace=True
            )
        except InvalidRequestError as exc:  # too large or too deep
            raise tool_schema_error(tools, exc) from None
    return engine.sampling_params(**kwargs)


def beam_search_params(
    request: pb.GenerateRequest, engine: LLMEngine
) -> tuple[SamplingParams, BeamSearchParams]:
    """A beam search's parameters (`sampling.use_beam_search`): the request's as SamplingParams, n the
    beam width (what admission checks, traces and decodes by), and the search's. What the request leaves
    unset takes the model's defaults, as generation's do. A field that beam search would not honour is
    refused naming it."""
    check_beam_search_fields(request)
    message = request.sampling
    check_beam_width(message.n if message.HasField("n") else 1)
    kwargs: dict[str, Any] = {
        name: getattr(message, name)
        for name in _OPTIONAL_PARAMS
        if name in BEAM_SEARCH_FIELDS and message.HasField(name)
    }
    params = engine.sampling_params(
        ignore_eos=message.ignore_eos, include_stop_str_in_output=message.include_stop_str_in_output, **kwargs
    )
    return BeamSearchParams.from_request(
        params, message.length_penalty if message.HasField("length_penalty") else 1.0
    )


def check_beam_search_fields(request: pb.GenerateRequest) -> None:
    """InvalidRequestError naming the first field set that beam search does not honour (see
    NOT_IN_BEAM_SEARCH): the sampling fields, structured outputs, and a chat's tools."""
    message = request.sampling
    for name in NOT_IN_BEAM_SEARCH:
        if name in _REPEATED_FIELDS:  # unset is empty (proto3)
            check_beam_search_field(name, _REPEATED_FIELDS[name](getattr(message, name)))
        elif message.HasField(name):
            check_beam_search_field(name, getattr(message, name))
    if request.WhichOneof("input") == "messages":
        messages = request.messages
        if messages.tools or messages.WhichOneof("tool_selection"):
            why = "beam search (use_beam_search) does not honour it: leave it unset"
            raise InvalidRequestError(messages.WhichOneof("tool_selection") or "tools", why)


def tool_schema_error(
    tools: ToolChoice,
    exc: InvalidRequestError,
    compile_grammar: Callable[[StructuredOutputsParams], object] = lambda params: None,
) -> InvalidRequestError:
    """`exc`, a refusal of the schema a tool choice made, said of what the request wrote: under required,
    the first tool whose parameters are refused alone (checked, then compiled with `compile_grammar`),
    as a named function's are (`tools[i].parameters`); else the tools together (too large only
    joined). The joined schema is no schema the client wrote, and "tools" left it to find which."""
    for field, schema in tools.parameters:
        try:
            compile_grammar(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
        except InvalidRequestError as alone:
            return InvalidRequestError(field, alone.message)
    return InvalidRequestError(tools.schema_field, exc.message)


def pooling_params(request: pb.EmbedRequest) -> SamplingParams:
    """An Embed call's parameters, as the engine runs them."""
    pooling = PoolingParams(
        pooling=request.pooling or "last",
        normalize=request.normalize if request.HasField("normalize") else True,
        truncate_prompt_tokens=(
            request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None
        ),
    )
    return pooling.as_sampling_params()


def embed_response(delta: RequestDelta) -> pb.EmbedResponse:
    assert delta.embedding is not None
    out = pb.EmbedResponse(
        request_id=delta.request_id, embedding=delta.embedding, prompt_tokens=delta.num_prompt_tokens
    )
    if delta.metrics.num_cached_tokens is not None:
        out.cached_tokens = delta.metrics.num_cached_tokens
    if delta.metrics.time_in_queue is not None:
        out.time_in_queue_s = delta.metrics.time_in_queue
    return out


def kv_event_batch(batch: KvEventBatch, block_size: int) -> pb.KvEventBatch:
    message = pb.KvEventBatch(sequence=batch.sequence, timestamp=batch.timestamp, block_size=block_size)
    if batch.snapshot is not None:
        message.snapshot = True
        message.cached_block_hashes.extend(batch.snapshot)
    for event in batch.events:
        if isinstance(event, BlockStored):
            stored = pb.BlockStored(
                block_hashes=event.block_hashes,
                parent_block_hash=event.parent_block_hash or b"",
                token_ids=event.token_ids,
                lora_name=event.lora_name or "",
            )
            message.events.append(pb.KvEvent(stored=stored))
        else:
            message.events.append(pb.KvEvent(removed=pb.BlockRemoved(block_hashes=event.block_hashes)))
    return message


def structured_outputs(message: pb.StructuredOutputs) -> StructuredOutputsParams:
    kind = message.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError(
            "structured_outputs", "set one of json, regex, choice, grammar, structural_tag or json_object"
        )
    whitespace = message.disable_any_whitespace
    if kind == "choice":
        return StructuredOutputsParams(choice=list(message.choice.choices), disable_any_whitespace=whitespace)
    return StructuredOutputsParams(**{kind: getattr(message, kind)}, disable_any_whitespace=whitespace)


def request_id(request: pb.GenerateRequest | pb.EmbedRequest, assign: str) -> str:
    rid = request.request_id or assign
    if len(rid) > _MAX_REQUEST_ID_LEN or not rid.isprintable():
        raise InvalidRequestError(
            "request_id", f"must be printable and at most {_MAX_REQUEST_ID_LEN} characters"
        )
    return rid


def prompt_token_ids(request: pb.GenerateRequest | pb.EmbedRequest, engine: LLMEngine) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "text":
        if not request.text:
            raise InvalidRequestError("text", "must not be empty")
        return engine.encode_prompt(request.text)
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        check_token_ids("token_ids.ids", ids, engine.config.model.vocab_size)
        return ids
    if kind == "messages":
        return chat_token_ids(request.messages, engine)
    inputs = [field.name for field in request.DESCRIPTOR.oneofs_by_name["input"].fields]
    raise InvalidRequestError("input", f"set one of {', '.join(inputs[:-1])} or {inputs[-1]}")


def chat_token_ids(messages: pb.ChatMessages, engine: LLMEngine) -> list[int]:
    if not messages.messages:
        raise InvalidRequestError("messages", "must not be empty")
    kwargs: dict[str, Any] = {}
    if messages.HasField("chat_template_kwargs"):
        try:
            kwargs = whole_numbers_as_ints(json_format.MessageToDict(messages.chat_template_kwargs))
        except ValueError as exc:  # NaN or an infinity, which JSON (and protobuf's mapping) lacks
            raise InvalidRequestError("chat_template_kwargs", f"not JSON: {exc}") from None
    if messages.tools:
        if "tools" in kwargs:
            raise InvalidRequestError("chat_template_kwargs", "'tools' is given by tools, not here")
        kwargs["tools"] = [tool.template_entry() for tool in tools(messages)]
    return engine.encode_chat(
        [_chat_message(i, m) for i, m in enumerate(messages.messages)],
        add_generation_prompt=(
            messages.add_generation_prompt if messages.HasField("add_generation_prompt") else True
        ),
        continue_final_message=messages.continue_final_message,
        chat_template_kwargs=kwargs or None,
    )


def _chat_message(i: int, message: pb.ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: OpenAI's shape, a call's arguments parsed (as vLLM gives
    them: templates print them with tojson)."""
    if message.role not in CHAT_ROLES:
        raise InvalidRequestError(f"messages[{i}].role", "must be system, user, assistant or tool")
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        if message.role != "assistant":
            raise InvalidRequestError(f"messages[{i}].tool_calls", "only an assistant message calls tools")
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": call_arguments(call.arguments, f"messages[{i}].tool_calls[{j}].arguments"),
                },
            }
            for j, call in enumerate(message.tool_calls)
        ]
    if message.tool_call_id:
        if message.role != "tool":
            raise InvalidRequestError(f"messages[{i}].tool_call_id", "only a tool message answers a call")
        out["tool_call_id"] = message.tool_call_id
    return out


def tools(messages: pb.ChatMessages) -> list[Tool]:
    parsed = [parse_tool(i, t.name, t.description, t.parameters) for i, t in enumerate(messages.tools)]
    check_unique(parsed)
    return parsed


def request_tool_choice(request: pb.GenerateRequest, auto_parser: str | None) -> ToolChoice | None:
    """A chat request's tool choice (None: its output is text); InvalidRequestError naming the field."""
    if request.WhichOneof("input") != "messages":
        return None
    messages = request.messages
    return tool_choice(tools(messages), messages.tool_choice, messages.tool_choice_function, auto_parser)


def check_text_free(
    request: pb.GenerateRequest,
    params: SamplingParams,
    tools: ToolChoice | None,
    reasoning_parser: str | None,
) -> None:
    """Under `detokenize` false the output has no text: InvalidRequestError naming the field of a chat
    request whose output the server would parse (`chat_outputs`: tool calls, reasoning). Stop strings
    are refused by SamplingParams itself."""
    if params.detokenize or request.WhichOneof("input") != "messages":
        return
    messages = request.messages
    why = "needs the output's text, which detokenize false leaves undecoded"
    if tools is not None:  # the calls are parsed out of the text, forced ones too
        field = messages.WhichOneof("tool_selection") or "tools"
        raise InvalidRequestError(field, f"the tool calls are parsed out of the text: {why}")
    if reasoning_parser is not None:
        raise InvalidRequestError(
            "messages",
            f"a chat's reasoning is parsed out of the text (--reasoning-parser {reasoning_parser}): {why}",
        )


class ChatOutputs:
    """A chat request's completions' text split by the server's parsers, each completion on its own:
    its reasoning first (`reasoning_content`, with --reasoning-parser), then the tool calls in the
    rest (`tool_calls`, by its tool choice; a completion that called tools finishes TOOL_CALLS), and
    what remains is `text`."""

    def __init__(
        self,
        tools: ToolChoice | None,
        reasoning: Callable[[], ReasoningParser | HarmonyParser] | None,
        include_reasoning: bool = True,
    ) -> None:
        """`reasoning`: a new completion's reasoning parser (None: no reasoning parser)."""
        self.tools, self.new_reasoning, self.include_reasoning = tools, reasoning, include_reasoning
        self._reasoning: dict[int, ReasoningParser | HarmonyParser] = {}
        self._tool_parsers: dict[int, ToolCallParser] = {}
        self._called: set[int] = set()

    def apply(self, out: pb.GenerateResponse, finished: bool) -> None:
        index, content, reasoning = out.index, out.text, ""
        if self.new_reasoning is not None:
            parser = self._reasoning.get(index)
            if parser is None:
                parser = self._reasoning[index] = self.new_reasoning()
            reasoning, content = parser.feed(content)
            if finished:
                more, rest = parser.finish()
                reasoning, content = reasoning + more, content + rest
        calls: list[ToolCall] = []
        if self.tools is not None:
            tool_parser = self._tool_parsers.get(index)
            if tool_parser is None:
                tool_parser = self._tool_parsers[index] = self.tools.new_parser()
            content, calls = tool_parser.feed(content)
            if finished:
                rest, more_calls = tool_parser.finish()
                content, calls = content + rest, calls + more_calls
        out.text = content
        if self.include_reasoning:
            out.reasoning_content = reasoning
        out.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls)
        if calls:
            self._called.add(index)
        if finished and index in self._called and out.finish_reason in (pb.STOP, pb.EOS):
            out.finish_reason = pb.TOOL_CALLS


def chat_outputs(
    request: pb.GenerateRequest,
    tools: ToolChoice | None,
    reasoning_parser: str | None,
    constrained: bool,
    prompt_tail: Callable[[], str],
) -> ChatOutputs | None:
    """How a request's output is split (None: it is all text): a chat request's, by its tool choice and
    the server's reasoning parser. A constrained output starts outside reasoning (its grammar rules
    from the first token); an unconstrained one inside it where `prompt_tail()`, the prompt's last
    text, left a think block open."""
    if request.WhichOneof("input") != "messages" or (tools is None and reasoning_parser is None):
        return None
    messages = request.messages
    reasoning = None
    if reasoning_parser is not None:
        opens = not constrained and prompt_opens_reasoning(prompt_tail(), reasoning_parser)
        reasoning = functools.partial(new_parser, reasoning_parser, opens)
    include = messages.include_reasoning if messages.HasField("include_reasoning") else True
    return ChatOutputs(tools, reasoning, include)


def keep_special_tokens(
    request: pb.GenerateRequest,
    params: SamplingParams,
    reasoning_parser: str | None,
    tools: ToolChoice | None = None,
) -> SamplingParams:
    """A chat request's params with its special tokens kept in the text where a parser reads them (and
    drops them): under `--reasoning-parser openai_gptoss` (harmony's headers and ends) or `mistral`
    (Magistral's [THINK] and [/THINK]), and where its tool choice's parser does (`--tool-call-parser
    mistral`'s `[TOOL_CALLS]`), as vLLM keeps them."""
    if request.WhichOneof("input") != "messages":
        return params
    if reasoning_parser not in READS_SPECIAL_TOKENS and not (tools is not None and tools.special_tokens):
        return params
    return dataclasses.replace(params, skip_special_tokens=False)


def tokenize(request: pb.TokenizeRequest, engine: LLMEngine) -> pb.TokenizeResponse:
    kind = request.WhichOneof("input")
    if kind == "messages":
        ids = chat_token_ids(request.messages, engine)
    elif kind == "text":
        ids = engine.encode_prompt(request.text)
    else:
        raise InvalidRequestError("input", "set text or messages")
    return pb.TokenizeResponse(token_ids=ids, tokens=engine.tokenizer.convert_ids_to_tokens(ids))


def detokenize(request: pb.DetokenizeRequest, engine: LLMEngine) -> pb.DetokenizeResponse:
    ids = list(request.token_ids)
    check_token_ids("token_ids", ids, engine.config.model.vocab_size)
    spaced = not request.HasField("spaces_between_special_tokens") or request.spaces_between_special_tokens
    return pb.DetokenizeResponse(text=engine.decode(ids, request.skip_special_tokens, spaced))


def response(delta: RequestDelta, prompt_token_ids: list[int] | None = None) -> pb.GenerateResponse:
    """`prompt_token_ids`: the request's prompt, to name each prompt token when the delta carries
    prompt logprobs."""
    out = pb.GenerateResponse(
        request_id=delta.request_id,
        index=delta.index,
        text=delta.new_text,
        token_ids=delta.new_token_ids,
        prompt_tokens=delta.num_prompt_tokens,
        completion_tokens=delta.num_output_tokens,
        error=delta.error or "",
    )
    if delta.metrics.num_cached_tokens is not None:
        out.cached_tokens = delta.metrics.num_cached_tokens
    if delta.finished and delta.finish_reason:
        out.finish_reason = _FINISH_REASONS.get(delta.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
    metrics = delta.metrics
    if metrics.time_in_queue is not None:
        out.time_in_queue_s = metrics.time_in_queue
    if metrics.time_to_first_token is not None:
        out.time_to_first_token_s = metrics.time_to_first_token
    for token_id, entry in zip(delta.new_token_ids, delta.new_logprobs or []):
        out.logprobs.append(_logprobs(token_id, entry))
    if delta.prompt_logprobs is not None and prompt_token_ids is not None:
        for token_id, prompt_entry in zip(prompt_token_ids[1:], delta.prompt_logprobs[1:], strict=True):
            assert prompt_entry is not None  # only the first prompt token has none
            out.prompt_logprobs.append(_logprobs(token_id, prompt_entry))
    return out


def _logprobs(token_id: int, entry: TokenLogprobs) -> pb.TokenLogprobs:
    """The sampled token, and every token of the engine's entry (top-k, plus the sampled one) by rank."""

    def one(tid: int) -> pb.TokenLogprob:
        lp = entry[tid]
        return pb.TokenLogprob(token_id=tid, logprob=lp.logprob, rank=lp.rank, text=lp.decoded_token or "")

    return pb.TokenLogprobs(
        sampled=one(token_id), top=[one(t) for t in sorted(entry, key=lambda t: entry[t].rank)]
    )
