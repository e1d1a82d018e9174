"""Triton's trace extension: which requests the server traces (pagedserve.telemetry.RequestTracer's
switches), read and changed while it serves, under Triton's names, by `TraceSetting` over gRPC and GET
/ POST /v2/trace/setting (and /v2/models/{m}/trace/setting) over REST (tritonclient's
get_trace_settings / update_trace_settings). Traces are OpenTelemetry spans (trace_mode
opentelemetry), sent to the exporter the server was started with (--otlp-traces-endpoint,
--traces-exporter); without one, tracing cannot be turned on.

    trace_level     ["TIMESTAMPS"] (a request's spans) or ["OFF"]; TENSORS are not traced
    trace_rate      "N": one request of every N traced (1 at start: every one)
    trace_count     "N": traces left to take, then tracing stops; "-1": no limit (at start)
    trace_file, log_frequency, trace_mode   read-only: "" (no file), "0", "opentelemetry"

A setting given no value goes back to its value at start. Every value is checked before anything
changes; a bad one, or a name Triton does not have, is refused naming it. The one served model's
settings are the server's: a request naming it reads and changes those, another name is not found."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from pagedserve.telemetry import RequestTracer

from pagedserve_adapters.llm_model import AdapterError, LLMModel

NAMES = ("trace_file", "trace_level", "trace_rate", "trace_count", "log_frequency", "trace_mode")
_LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
_FIXED = {"trace_file": "", "log_frequency": "0", "trace_mode": "opentelemetry"}


def current(tracer: RequestTracer) -> dict[str, list[str]]:
    return {
        "trace_file": [],
        "trace_level": ["TIMESTAMPS" if tracer.on else "OFF"],
        "trace_rate": [str(tracer.rate)],
        "trace_count": [str(tracer.count)],
        "log_frequency": [_FIXED["log_frequency"]],
        "trace_mode": [_FIXED["trace_mode"]],
    }


def update(model: LLMModel, model_name: str, changes: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Apply `changes` (a setting's values; none: back to its start) and return every setting as it
    now is; AdapterError naming the setting, nothing changed, for a bad one."""
    if model_name:  # the served model's settings are the server's (LLMModel.resolve: it, and serving)
        model.resolve(model_name, "")
    tracer: RequestTracer = model.server.servicer.tracer
    values: dict[str, bool | int] = {}
    for name, given in changes.items():
        if name in _FIXED:
            if list(given) not in ([], [_FIXED[name]]):
                raise AdapterError(
                    "invalid",
                    f"{name}: {_FIXED[name]!r} here, and it cannot be changed (spans go to the "
                    "trace exporter, --otlp-traces-endpoint or --traces-exporter)",
                )
        elif name == "trace_level":
            values["on"] = _level(given, tracer) if given else tracer.can_trace
        elif name == "trace_rate":
            values["rate"] = _integer(name, given, minimum=1) if given else 1
        elif name == "trace_count":
            values["count"] = _integer(name, given, minimum=-1) if given else -1
        else:
            raise AdapterError(
                "invalid", f"unknown trace setting {name[:64]!r}; the settings are {', '.join(NAMES)}"
            )
    for key, value in values.items():
        setattr(tracer, key, value)
    return current(tracer)


def _level(given: Sequence[str], tracer: RequestTracer) -> bool:
    for level in given:
        if level not in _LEVELS:
            raise AdapterError("invalid", f"trace_level: {level[:64]!r} is not one of {', '.join(_LEVELS)}")
    if "TENSORS" in given:
        raise AdapterError("invalid", "trace_level: TENSORS are not traced here (TIMESTAMPS or OFF)")
    on = "TIMESTAMPS" in given
    if on and "OFF" in given:
        raise AdapterError("invalid", "trace_level: OFF with TIMESTAMPS")
    if on and not tracer.can_trace:
        raise AdapterError(
            "failed_precondition",
            "trace_level: no trace exporter: start the server with --otlp-traces-endpoint or "
            "--traces-exporter to trace requests",
        )
    return on


def _integer(name: str, given: Sequence[str], minimum: int) -> int:
    if len(given) != 1:
        raise AdapterError("invalid", f"{name}: one value, got {len(given)}")
    if not re.fullmatch(r"-?[0-9]{1,18}", given[0]):
        raise AdapterError("invalid", f"{name}: must be an integer, got {given[0][:64]!r}")
    value = int(given[0])
    if value < minimum:
        raise AdapterError("invalid", f"{name}: must be >= {minimum}, got {value}")
    return value
