"""The served model as KServe v2 and Triton clients see it: the tensors of Triton's vLLM backend, their
meaning, and the bridge to the AsyncEngine. Protocol-neutral: the gRPC servicer and the REST routes
decode their wire formats into `Tensor`s, call `parse_request` and `LLMModel.generate`, and encode the
`Tensor`s that `Completion` builds.

Semantics follow the vLLM backend: `text_input` (one string) is the prompt; `sampling_parameters` is
a JSON object of sampling parameters whose values may be strings (`{"max_tokens": "32"}`), or, when that
tensor is absent, the request's parameters are, and its extra key `lora_name` picks one of the server's
LoRA adapters (`--lora-modules`); `stream` makes a stream send the new text of each step (otherwise one
response carries the whole completion); the prompt is prepended to the output unless streaming or
`exclude_input_in_output` is true; the `return_*` switches add outputs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.async_engine import QueueFullError, in_tokenizer_thread
from pagedserve.errors import EngineDeadError, InvalidRequestError
from pagedserve.outputs import RequestDelta
from pagedserve.sampling_params import (
    BeamSearchParams,
    SamplingParams,
    StructuredOutputsParams,
    check_beam_search_field,
    check_beam_width,
)

from pagedserve_adapters import tensors

logger = logging.getLogger(__name__)

MODEL_VERSION = "1"


class AdapterError(Exception):
    """A failed call, with a protocol-neutral kind each protocol maps to its own status."""

    def __init__(self, kind: str, message: str, request_id: str = "") -> None:
        super().__init__(message)
        # invalid, not_found, unavailable, exhausted, internal, timeout, aborted (cut short by the server),
        # failed_precondition (not in this server's state: repository.py's unload)
        self.kind = kind
        self.request_id = request_id  # the engine's id of a request refused once it had one


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    dims: tuple[int, ...]
    optional: bool = True


INPUTS = (
    TensorSpec("text_input", "BYTES", (1,), optional=False),
    TensorSpec("stream", "BOOL", (1,)),
    TensorSpec("sampling_parameters", "BYTES", (1,)),
    TensorSpec("exclude_input_in_output", "BOOL", (1,)),
    TensorSpec("return_finish_reason", "BOOL", (1,)),
    TensorSpec("return_cumulative_logprob", "BOOL", (1,)),
    TensorSpec("return_logprobs", "BOOL", (1,)),
    TensorSpec("return_num_input_tokens", "BOOL", (1,)),
    TensorSpec("return_num_output_tokens", "BOOL", (1,)),
)
OUTPUTS = (
    TensorSpec("text_output", "BYTES", (-1,)),
    TensorSpec("finish_reason", "BYTES", (-1,)),
    TensorSpec("cumulative_logprob", "FP32", (-1,)),
    TensorSpec("logprobs", "BYTES", (-1,)),
    TensorSpec("num_input_tokens", "UINT32", (1,)),
    TensorSpec("num_output_tokens", "UINT32", (-1,)),
)
_INPUT_SPECS = {spec.name: spec for spec in INPUTS}
_OUTPUT_NAMES = tuple(spec.name for spec in OUTPUTS)
_SWITCHES = ("stream", "exclude_input_in_output") + tuple(
    spec.name for spec in INPUTS if spec.name.startswith("return_")
)

# Request parameters Triton reserves for itself; never sampling parameters.
_RESERVED_PARAMETERS = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers", "binary_data_output"}
)
# The `triton_` parameters a client sends (tritonclient's streams set this one); Triton refuses any other
# name with the prefix, which it keeps for itself.
_TRITON_PARAMETERS = frozenset({"triton_enable_empty_final_response"})
# Sampling parameter -> the type a JSON value (or its string form) is cast to.
_PARAMETER_TYPES: dict[str, str] = {
    "n": "int",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "min_p": "float",
    "repetition_penalty": "float",
    "presence_penalty": "float",
    "frequency_penalty": "float",
    "seed": "int",
    "max_tokens": "int",
    "min_tokens": "int",
    "ignore_eos": "bool",
    "stop": "str_list",
    "stop_token_ids": "int_list",
    "include_stop_str_in_output": "bool",
    "logprobs": "int",
    "truncate_prompt_tokens": "int",
    "skip_special_tokens": "bool",
    "structured_outputs": "structured",
    "guided_decoding": "structured",  # vLLM's name before 0.11, as the vLLM backend's clients send it
    "logit_bias": "object",
    "allowed_token_ids": "int_list",
    "bad_words": "str_list",
    # vLLM's beam search (taken apart in parse_request: n is then the beam width)
    "use_beam_search": "bool",
    "length_penalty": "float",
}
# An AdapterError's kind -> pagedserve:request_rejections' reason, for the kinds that refuse a request
# before it runs (a timeout, a failure or an abort ends one that ran: counted as such elsewhere).
_REJECTION_REASONS = {
    "invalid": "invalid",
    "exhausted": "queue_full",
    "unavailable": "unavailable",
    "not_found": "not_found",
}
# The vLLM backend reports vLLM's reasons: the end-of-sequence token is a "stop".
_FINISH_REASONS = {"eos": "stop"}


@dataclass
class Tensor:
    name: str
    datatype: str
    shape: list[int]
    values: list[Any]


@dataclass
class LLMRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    exclude_input: bool
    outputs: tuple[str, ...]  # output tensors to return, in this order
    empty_final: bool = False  # streams: end with a data-less response flagged final
    priority: int = 0  # Triton's request priority: 0 the default level, 1 the most urgent
    timeout_us: int = 0  # Triton's request timeout in microseconds (0: none): aborted when it passes
    lora_name: str | None = None  # the LoRA adapter to run through (None: the base model)
    client_id: str = ""  # the request's own `id`, echoed in its responses and put on its span
    # use_beam_search: the search, run instead of sampling (`params` then holds n, the beam width)
    beam_search: BeamSearchParams | None = None


def parse_request(
    inputs: Sequence[Tensor],
    parameters: Mapping[str, Any],
    requested_outputs: Sequence[str] = (),
    empty_final: bool = False,
    make_params: Callable[..., SamplingParams] = SamplingParams,
    client_id: str = "",
) -> LLMRequest:
    """Validate the decoded inputs against the model's tensors; every error names its field.
    `make_params` builds the sampling parameters from those given (`LLMModel.sampling_params`: the
    model's defaults for the rest); `client_id` is the request's `id`."""
    values: dict[str, Any] = {}
    for tensor in inputs:
        spec = _INPUT_SPECS.get(tensor.name)
        where = f"inputs.{tensor.name}"
        if spec is None:
            raise InvalidRequestError(where, f"unknown input; the model takes {', '.join(_INPUT_SPECS)}")
        if tensor.name in values:
            raise InvalidRequestError(where, "given twice")
        if tensor.datatype != spec.datatype:
            raise InvalidRequestError(f"{where}.datatype", f"must be {spec.datatype}, got {tensor.datatype}")
        if len(tensor.values) != 1:
            raise InvalidRequestError(
                f"{where}.shape", f"must hold exactly one element, got shape {list(tensor.shape)}"
            )
        values[tensor.name] = tensor.values[0]
    if "text_input" not in values:
        raise InvalidRequestError("inputs.text_input", "is required")
    prompt = _text(values.pop("text_input"), "inputs.text_input")
    if not prompt:
        raise InvalidRequestError("inputs.text_input", "must not be empty")

    _check_reserved(parameters)
    if "sampling_parameters" in values:
        raw = _text(values.pop("sampling_parameters"), "inputs.sampling_parameters")
        sampling = _json_object(raw, "sampling_parameters")
    else:
        sampling = {}
        for name, value in parameters.items():
            if name in _RESERVED_PARAMETERS or name.startswith("triton_"):
                continue
            if name in _SWITCHES:
                values.setdefault(name, value)
            else:
                sampling[name] = value
    switches = {name: _flag(values.get(name), f"inputs.{name}") for name in _SWITCHES}
    stream = bool(switches["stream"])
    if switches["exclude_input_in_output"] is None:
        exclude_input = stream
    elif stream and not switches["exclude_input_in_output"]:
        raise InvalidRequestError(
            "inputs.exclude_input_in_output", "must be true when streaming (the prompt is not streamed)"
        )
    else:
        exclude_input = bool(switches["exclude_input_in_output"])

    lora_name = _lora_name(sampling.pop("lora_name", None), "sampling_parameters.lora_name")
    beam_search = None
    if _use_beam_search(sampling):
        params, beam_search = _beam_search_params(sampling, "sampling_parameters", make_params)
        _check_no_logprobs(switches, requested_outputs)
    else:
        params = _sampling_params(sampling, "sampling_parameters", make_params)
    priority = _unsigned(parameters.get("priority", 0), "parameters.priority")
    timeout_us = _unsigned(parameters.get("timeout", 0), "parameters.timeout")
    # an output asked for by name is wanted as its switch would want it: real logprobs, not 0.0 and null
    wants_logprobs = switches["return_logprobs"] or switches["return_cumulative_logprob"]
    if (
        (wants_logprobs or {"logprobs", "cumulative_logprob"} & set(requested_outputs))
        and params.logprobs is None
        and beam_search is None  # its beams carry their cumulative logprob
    ):
        params = dataclasses.replace(params, logprobs=0)  # only the sampled tokens' logprobs
    return LLMRequest(
        prompt=prompt,
        params=params,
        stream=stream,
        exclude_input=exclude_input,
        outputs=_selected_outputs(switches, requested_outputs),
        empty_final=empty_final,
        priority=priority,
        timeout_us=timeout_us,
        lora_name=lora_name,
        client_id=client_id,
        beam_search=beam_search,
    )


def _use_beam_search(sampling: dict[str, Any]) -> bool:
    """Whether the sampling parameters ask for beam search (`use_beam_search`, taken out of them): a
    JSON boolean, or null for unset. Its string forms are refused, unlike other flags': Triton's vLLM
    backend reads "false" as true (Python's bool of the string), which would run a search the client
    did not mean. `length_penalty` without it is refused, as it would change nothing."""
    value = sampling.pop("use_beam_search", None)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(
            "sampling_parameters.use_beam_search", f"must be a JSON boolean, got {value!r}"
        )
    if not value and sampling.get("length_penalty") is not None:
        raise InvalidRequestError(
            "sampling_parameters.length_penalty", "ranks beams: it needs use_beam_search true"
        )
    return bool(value)


def _beam_search_params(
    given: dict[str, Any], where: str, make_params: Callable[..., SamplingParams]
) -> tuple[SamplingParams, BeamSearchParams]:
    """A beam search's parameters, as our gRPC API builds them (rpc/convert.py beam_search_params): n the
    beam width (what admission checks and `Completion` sizes by); the fields beam search honours, the
    model's defaults (`make_params`) for those unset; a field it would not honour, set to a value that
    changes anything, refused naming it (sampling_params.NOT_IN_BEAM_SEARCH)."""
    length_penalty = given.pop("length_penalty", None)
    penalty = 1.0 if length_penalty is None else _cast(length_penalty, "float", f"{where}.length_penalty")
    names = {
        "structured_outputs" if _PARAMETER_TYPES.get(name) == "structured" else name: name for name in given
    }
    kwargs = _sampling_kwargs(given, where)
    for name, value in kwargs.items():
        check_beam_search_field(name, value, f"{where}.{names[name]}")
    check_beam_width(kwargs.get("n", 1), f"{where}.n")
    try:
        return BeamSearchParams.from_request(make_params(**kwargs), penalty)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{where}.{exc.field}", exc.message) from None


def _check_no_logprobs(switches: Mapping[str, bool | None], requested_outputs: Sequence[str]) -> None:
    """A beam search returns no per-token logprobs (its beams' cumulative logprob it does): asking for
    them is refused by name, not answered with nulls."""
    why = "beam search (use_beam_search) returns no per-token logprobs"
    if switches["return_logprobs"]:
        raise InvalidRequestError("inputs.return_logprobs", f"{why}: leave it false")
    if "logprobs" in requested_outputs:
        raise InvalidRequestError("outputs.logprobs", f"{why}: do not request it")


def _check_reserved(parameters: Mapping[str, Any]) -> None:
    """Triton's reserved request parameters of the wrong type, and `triton_` names it does not take, are
    refused by name as Triton refuses them (a sequence model's parameters are accepted and ignored:
    every request here stands alone)."""
    for name, value in parameters.items():
        where = f"parameters.{name}"
        if name.startswith("triton_") and name not in _TRITON_PARAMETERS:
            raise InvalidRequestError(
                where, "parameter names starting with triton_ are reserved for the server"
            )
        if name in ("binary_data_output", "sequence_start", "sequence_end", *_TRITON_PARAMETERS):
            if not isinstance(value, bool):
                raise InvalidRequestError(where, f"must be a boolean, got {value!r}")
        elif name == "sequence_id" and not (
            isinstance(value, str)
            or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64)
        ):
            raise InvalidRequestError(where, f"must be an unsigned integer or a string, got {value!r}")


def _unsigned(value: Any, where: str) -> int:
    """Triton's schedule-policy parameters (`priority`, `timeout`): a uint64, as Triton takes them."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
        raise InvalidRequestError(where, f"must be an unsigned integer, got {value!r}")
    return value


def _lora_name(value: Any, where: str) -> str | None:
    """The vLLM backend's extra sampling parameter: an adapter's name; absent, null or "" is the base
    model. Whether the server has that adapter is the engine's check (an immediate error too)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InvalidRequestError(where, f"must be a string (a LoRA adapter's name), got {value!r}")
    tensors.utf8(where, value)
    return value


def _selected_outputs(switches: Mapping[str, bool | None], requested: Sequence[str]) -> tuple[str, ...]:
    for i, name in enumerate(requested):
        if name not in _OUTPUT_NAMES:
            raise InvalidRequestError(
                f"outputs.{name}", f"unknown output; the model has {', '.join(_OUTPUT_NAMES)}"
            )
        if name in requested[:i]:  # as Triton refuses it (gRPC returned it twice, REST once)
            raise InvalidRequestError(f"outputs.{name}", "requested twice")
    if requested:
        return tuple(requested)
    return tuple(name for name in _OUTPUT_NAMES if name == "text_output" or switches.get(f"return_{name}"))


def _text(value: Any, where: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequestError(where, "is not valid UTF-8") from None
    if isinstance(value, str):  # JSON text may hold a lone surrogate ("\ud800"), which is not UTF-8
        tensors.utf8(where, value)
        return value
    raise InvalidRequestError(where, f"must be a string, got {type(value).__name__}")


def _json_object(raw: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also integers past 4300 digits and deep nesting
        raise InvalidRequestError(where, f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(where, "must be a JSON object")
    return value


def _flag(value: Any, where: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InvalidRequestError(where, f"must be a boolean, got {value!r}")


def _sampling_params(
    given: Mapping[str, Any], where: str, make_params: Callable[..., SamplingParams]
) -> SamplingParams:
    kwargs = _sampling_kwargs(given, where)
    try:
        return make_params(**kwargs)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{where}.{exc.field}", exc.message) from None


def _sampling_kwargs(given: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The given sampling parameters, cast, by SamplingParams' names (null values left out)."""
    kwargs: dict[str, Any] = {}
    for name, value in given.items():
        kind = _PARAMETER_TYPES.get(name)
        if kind is None:
            raise InvalidRequestError(
                f"{where}.{name}", f"unknown sampling parameter; known: {', '.join(_PARAMETER_TYPES)}"
            )
        if value is None:
            continue
        _check_utf8(value, f"{where}.{name}")
        if kind == "structured":  # structured outputs, under either name
            if "structured_outputs" in kwargs:
                raise InvalidRequestError(
                    f"{where}.{name}", "give structured_outputs or guided_decoding, not both"
                )
            kwargs["structured_outputs"] = _structured_outputs(value, f"{where}.{name}")
        else:
            kwargs[name] = _cast(value, kind, f"{where}.{name}")
    return kwargs


def _check_utf8(value: Any, where: str) -> None:
    """Every string in a parameter's JSON value encodes as UTF-8: JSON's "\\ud800" escapes spell lone
    surrogates, which the tokenizer and the grammar compiler would otherwise meet. Iterative: a value
    nested as deep as the JSON parser allows is no recursion error here."""
    pending = [(value, where)]
    while pending:
        item, at = pending.pop()
        if isinstance(item, str):
            tensors.utf8(at, item)
        elif isinstance(item, list):
            pending.extend((x, f"{at}[{i}]") for i, x in enumerate(item))
        elif isinstance(item, dict):
            for key, x in item.items():
                tensors.utf8(f"{at} (a key)", key)
                pending.append((x, f"{at}.{key}"))


def _structured_outputs(value: Any, where: str) -> StructuredOutputsParams:
    """vLLM's StructuredOutputsParams as a JSON object (or its text, as a request parameter's string):
    one of json (a schema, object or text), regex, choice, grammar, structural_tag, json_object."""
    doc = _json_object(value, where) if isinstance(value, str) else value
    if not isinstance(doc, dict):
        raise InvalidRequestError(where, 'must be a JSON object such as {"regex": "[0-9]+"}')
    if isinstance(value, str):  # its text's own escapes (a JSON value was checked as a parameter)
        _check_utf8(doc, where)
    known = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
    for key in doc:
        if key not in known:
            raise InvalidRequestError(f"{where}.{key}", f"unknown; known: {', '.join(sorted(known))}")
    try:
        return StructuredOutputsParams(**doc)
    except InvalidRequestError as exc:
        raise InvalidRequestError(
            f"{where}{exc.field.removeprefix('structured_outputs')}", exc.message
        ) from None


def _cast(value: Any, kind: str, where: str) -> Any:
    """JSON values, or their string forms as vLLM-backend clients send them."""
    try:
        if kind == "bool":
            flag = _flag(value, where)
            return flag
        if kind in ("int", "float"):
            if isinstance(value, bool):
                raise ValueError
            number = float(value) if isinstance(value, str) else value
            if not isinstance(number, int | float):
                raise ValueError
            if kind == "int" and isinstance(number, float) and math.isfinite(number) and number.is_integer():
                return int(number)
            return number  # a fractional "int" is left for SamplingParams to reject by name
        if kind == "str_list":
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
                raise ValueError
            return items
        if kind == "object":  # a JSON object, or its text as a request parameter's string
            return _json_object(value, where) if isinstance(value, str) else value
        if kind == "int_list":
            items = json.loads(value) if isinstance(value, str) else value
            if not isinstance(items, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in items
            ):
                raise ValueError
            return items
    except (ValueError, TypeError, RecursionError):
        pass
    raise InvalidRequestError(where, f"{value!r} is not a valid {kind.replace('_', ' of ')}")


class Completion:
    """Accumulates one request's deltas (one per completion index) and builds its output tensors.
    Nothing is sized by the request's `n` before the engine has taken the request (which refuses an
    `n` above --max-num-seqs): a huge one would otherwise be allocated first, on the event loop."""

    def __init__(self, request: LLMRequest) -> None:
        self.request = request
        self.texts: defaultdict[int, str] = defaultdict(str)  # by completion index
        self.num_tokens: defaultdict[int, int] = defaultdict(int)
        self.cumulative_logprob: defaultdict[int, float] = defaultdict(float)
        self.logprobs: defaultdict[int, list[dict[str, Any]]] = defaultdict(list)
        self.finish_reasons: dict[int, str | None] = {}
        self.num_prompt_tokens = 0
        self.aborted: str | None = None  # why the server aborted the request before its end, if it did

    def add(self, delta: RequestDelta) -> None:
        i = delta.index
        self.texts[i] += delta.new_text
        self.num_tokens[i] += len(delta.new_token_ids)
        self.logprobs[i].extend(_logprob_entries(delta))
        for token_id, entry in zip(delta.new_token_ids, delta.new_logprobs or ()):
            self.cumulative_logprob[i] += entry[token_id].logprob
        if delta.cumulative_logprob is not None:  # a beam's, which has no per-token logprobs
            self.cumulative_logprob[i] += delta.cumulative_logprob
        if delta.finished:
            self.finish_reasons[i] = _FINISH_REASONS.get(delta.finish_reason or "", delta.finish_reason)
        if delta.finished and delta.finish_reason == "aborted":
            self.aborted = delta.error or "aborted"
        self.num_prompt_tokens = delta.num_prompt_tokens

    def step_outputs(self, delta: RequestDelta) -> list[Tensor]:
        """A streamed response: the new text and tokens of `delta`'s completion, nothing for the others."""
        n, i = self.request.params.n, delta.index
        texts, counts = [""] * n, [0] * n
        logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        texts[i], counts[i], logprobs[i] = delta.new_text, len(delta.new_token_ids), _logprob_entries(delta)
        return self._tensors(texts, counts, logprobs)

    def final_outputs(self) -> list[Tensor]:
        """The one response of a non-streamed request: whole completions. A request the server aborted
        (a drain past --shutdown-timeout, an Abort call) is an error here, UNAVAILABLE / 503 for a client
        to retry elsewhere: its text cut short would read as a whole completion to a client that did not
        ask for finish_reason. A stream's responses say `aborted` in their finish_reason instead."""
        if self.aborted is not None:
            tokens = sum(self.num_tokens.values())
            raise AdapterError(
                "aborted", f"the request was aborted after {tokens} output tokens: {self.aborted}"
            )
        prefix = "" if self.request.exclude_input else self.request.prompt
        indices = range(self.request.params.n)
        return self._tensors(
            [prefix + self.texts[i] for i in indices],
            [self.num_tokens[i] for i in indices],
            [self.logprobs[i] for i in indices],
        )

    def _tensors(
        self, texts: list[str], counts: list[int], logprobs: list[list[dict[str, Any]]]
    ) -> list[Tensor]:
        n = len(texts)
        with_logprobs = self.request.params.logprobs is not None
        values: dict[str, list[Any]] = {
            "text_output": [t.encode() for t in texts],
            "finish_reason": [str(self.finish_reasons.get(i)).encode() for i in range(n)],
            "cumulative_logprob": [self.cumulative_logprob[i] for i in range(n)],
            "logprobs": [json.dumps(lp if with_logprobs else None).encode() for lp in logprobs],
            "num_input_tokens": [self.num_prompt_tokens],
            "num_output_tokens": counts,
        }
        specs = {spec.name: spec for spec in OUTPUTS}
        return [
            Tensor(name, specs[name].datatype, [1 if name == "num_input_tokens" else n], values[name])
            for name in self.request.outputs
        ]


def _logprob_entries(delta: RequestDelta) -> list[dict[str, Any]]:
    """vLLM's shape: per new token, {token_id: {logprob, rank, decoded_token}} for the sampled and top tokens."""
    return [
        {
            str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in entry.items()
        }
        for entry in delta.new_logprobs or ()
    ]


@dataclass(frozen=True)
class PriorityLevels:
    """Triton's priority levels (the model config's `dynamic_batching`): 1 is the most urgent, then 2,
    ... up to `levels`. A request's 0 (Triton's "not given") or a level above `levels` runs at `default`,
    as Triton runs it. Under the priority scheduling policy a level becomes the engine's priority (lower
    first) counted from the default level, so that the default level runs as the engine's default 0,
    beside our gRPC API's requests that set none; under fcfs every request runs at 0, as Triton ignores
    priorities for a model without levels."""

    levels: int = 3  # at least 1 (`pagedserve serve` checks its flags)
    default: int = 2  # in [1, levels]

    def engine_priority(self, requested: int) -> int:
        level = requested if 1 <= requested <= self.levels else self.default
        return level - self.default


@dataclass
class ModelStats:
    """Counters for Triton's ModelStatistics (durations in nanoseconds)."""

    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    queue_ns: int = 0
    # of the successful requests: tokenizing the prompt (Triton's compute_input) and the engine's
    # time from first scheduling the request to finishing it (compute_infer)
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    last_inference_ms: int = 0
    executions: int = 0
    started: dict[str, int] = field(default_factory=dict)


class LLMModel:
    """The one served model: its identity and readiness (from the server's state) and generation."""

    version = MODEL_VERSION

    def __init__(self, server: Any, priority_levels: PriorityLevels = PriorityLevels()) -> None:
        self.server = server  # pagedserve.rpc.server.Server
        self.priority_levels = priority_levels
        self.stats = ModelStats()

    @property
    def schedules_by_priority(self) -> bool:
        return self.bound and self.server.engine.engine.config.scheduler.scheduling_policy == "priority"

    @property
    def bound(self) -> bool:
        return self.server.state.status != "starting"

    @property
    def name(self) -> str:
        return str(self.server.engine.engine.config.model.served_model_name) if self.bound else ""

    @property
    def live(self) -> bool:
        return self.server.state.status != "dead"

    @property
    def ready(self) -> bool:
        return bool(self.server.state.ready)

    def sampling_params(self, **given: Any) -> SamplingParams:
        """Those `given`, the model's defaults (generation_config.json) for the rest, as our gRPC API's."""
        if not self.bound:  # no engine yet; requests are refused as unavailable anyway
            return SamplingParams(**given)
        return self.server.engine.engine.sampling_params(**given)

    def refuse(
        self,
        exc: AdapterError | InvalidRequestError,
        carrier: Mapping[str, Any] | Iterable[tuple[str, Any]] | None,
        started: float,
        request: LLMRequest | None = None,
        model: str = "",
        client_id: str = "",
    ) -> None:
        """A call's error: a request refused before it ran (a bad field, an unknown model, the queue
        full, the server not serving) is counted in pagedserve:request_rejections by its reason once
        the engine is bound, and traced from `started` (time.monotonic(), when the call came in) under
        the caller's trace in `carrier` (the call's metadata or headers), with the `model` and `id`
        (`client_id`) it gave and its parameters once parsed (`request`). Any other error ends a
        request that ran: `generate` counts and traces that one."""
        reason = _REJECTION_REASONS.get(exc.kind if isinstance(exc, AdapterError) else "invalid")
        if reason is None:
            return
        if self.bound:
            self.server.engine.engine.metrics.record_rejection(reason)
        tracer = self.server.servicer.tracer
        if tracer.enabled:
            request_id = exc.request_id if isinstance(exc, AdapterError) else ""
            params = request.params if request is not None else None
            tracer.refuse(
                carrier, reason, str(exc), started, request_id, params, model[:256], client_id[:256]
            )

    def is_ready(self, name: str, version: str) -> bool:
        return self.ready and name == self.name and version in ("", self.version)

    def resolve(self, name: str, version: str) -> None:
        """Raise unless `name`/`version` is this model and the server is serving. The client's name is
        echoed cut to 256 characters: a status past a client's 8 KiB of metadata reaches it as
        RESOURCE_EXHAUSTED, not as the refusal."""
        if not self.bound:
            raise AdapterError("unavailable", "server is starting: the model is still loading")
        if name != self.name:
            raise AdapterError(
                "not_found", f"model_name: unknown model {name[:256]!r}; this server serves {self.name!r}"
            )
        if version not in ("", self.version):
            raise AdapterError("not_found", f"model_version: {name!r} has only version {self.version!r}")
        if not self.ready:
            raise AdapterError(
                "unavailable", f"model {name!r} is not ready: server is {self.server.state.status}"
            )

    async def generate(
        self,
        request: LLMRequest,
        carrier: Mapping[str, str],
        cancel_cause: Callable[[], str] = lambda: "client_cancel",
    ) -> AsyncGenerator[RequestDelta, None]:
        """The request's deltas; closing the iterator early aborts the request and frees its blocks.
        `cancel_cause` says why, when it is closed early (an abort cause, e.g. deadline)."""
        engine = self.server.engine
        llm = engine.engine
        tracer = self.server.servicer.tracer
        started = time.monotonic()
        rid = engine.new_request_id("v2")
        priority = self.priority_levels.engine_priority(request.priority) if self.schedules_by_priority else 0
        try:
            prompt = await in_tokenizer_thread(llm.encode_prompt, request.prompt)
            prompt = await engine.prepare(rid, prompt, request.params, priority, lora_name=request.lora_name)
        except Exception as exc:
            raise _adapter_error(exc, rid) from exc
        tokenized = (started, time.monotonic())
        last: RequestDelta | None = None
        refused = False
        loop = asyncio.get_running_loop()
        deadline = None  # on the loop's clock, which asyncio.timeout_at reads; counted from `started`
        if request.timeout_us:
            deadline = loop.time() + request.timeout_us / 1e6 - (time.monotonic() - started)

        def cause() -> str:  # asked as the engine's generator closes early
            return "deadline" if deadline is not None and loop.time() >= deadline else cancel_cause()

        deltas = engine.request_deltas(
            rid, prompt, request.params, cause, priority, request.lora_name, request.beam_search
        )
        try:
            while True:
                # Waiting for the next delta, not while the caller handles one. In this task, not in one
                # of wait_for's: a deadline already past still starts the request in the engine's
                # generator, which the expiry then aborts (counted as a deadline abort), where
                # wait_for(..., 0) cancelled the generator before it ran and nothing counted it.
                try:
                    async with asyncio.timeout_at(deadline):
                        delta = await anext(deltas)
                except StopAsyncIteration:
                    break
                except TimeoutError:  # the cancelled wait aborted the request (cause: deadline)
                    raise AdapterError(
                        "timeout", f"Request timeout expired ({request.timeout_us} us)"
                    ) from None
                last = delta
                if delta.finish_reason == "error":
                    raise AdapterError("internal", delta.error or "generation failed")
                yield delta
        except (InvalidRequestError, QueueFullError, EngineDeadError) as exc:  # refused at its start
            refused = True
            raise _adapter_error(exc, rid) from exc
        finally:
            # A caller that went away aborts the request here (the engine counts it), not whenever
            # the engine's generator is collected; a request the engine ended first is traced and
            # counted as it ended, as the engine's metrics count it. A refused one's caller traces
            # it (`refuse`).
            await deltas.aclose()
            last = engine.unread_final_delta(rid) or last
            self._count(started, tokenized, last)
            if not refused:
                tracer.finish_request(
                    carrier, rid, request.params, last, tokenized, len(prompt), request.client_id[:256]
                )

    def _count(self, started: float, tokenized: tuple[float, float], last: RequestDelta | None) -> None:
        elapsed_ns = int((time.monotonic() - started) * 1e9)
        stats = self.stats
        stats.executions += 1
        stats.last_inference_ms = int(time.time() * 1000)
        if last is not None and last.request_finished and last.finish_reason not in ("error", "aborted"):
            stats.success_count += 1
            stats.success_ns += elapsed_ns
            stats.compute_input_ns += int((tokenized[1] - tokenized[0]) * 1e9)
            scheduled, finished = last.metrics.first_scheduled_time, last.metrics.finished_time
            if scheduled is not None and finished is not None:
                stats.compute_infer_ns += int((finished - scheduled) * 1e9)
        else:
            stats.fail_count += 1
            stats.fail_ns += elapsed_ns
        if last is not None and last.metrics.time_in_queue is not None:
            stats.queue_ns += int(last.metrics.time_in_queue * 1e9)


def _adapter_error(exc: BaseException, request_id: str) -> AdapterError:
    if isinstance(exc, AdapterError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return AdapterError("invalid", str(exc), request_id)
    if isinstance(exc, QueueFullError):
        return AdapterError("exhausted", str(exc), request_id)
    if isinstance(exc, EngineDeadError):
        return AdapterError("unavailable", f"engine failed: {exc}", request_id)
    return AdapterError("internal", f"{type(exc).__name__}: {exc}", request_id)
