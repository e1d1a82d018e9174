"""Triton's logging extension: the server's log switches (pagedserve.logs.LogSwitches) read and
changed while it serves, under Triton's names, by `LogSettings` over gRPC and GET / POST /v2/logging
over REST (tritonclient's get_log_settings / update_log_settings).

    log_info, log_warning, log_error   booleans: info, warning and error records written or not
    log_verbose_level                  an integer >= 0: above 0, debug records too
    log_file                           "": the log goes to stderr, and stays there
    log_format                         text or json, as --log-format set it at start

An update names only what it changes; every value is checked before anything changes, and the answer
is every setting as it now is. Triton takes a name it does not know without a word; here it is refused
naming it, so that a typo (Triton's own documentation writes "log_warnings") does not read as done.
The switches reach the engine process and the tensor-parallel ranks too, at the engine's next pass."""

from __future__ import annotations

from pagedserve import logs
from pagedserve.logs import LogSwitches

from pagedserve_adapters.llm_model import AdapterError, LLMModel

Value = bool | int | str
_SWITCHES = {"log_info": "info", "log_warning": "warning", "log_error": "error"}
NAMES = ("log_file", *_SWITCHES, "log_verbose_level", "log_format")
_MAX_UINT32 = 2**32 - 1


def current() -> dict[str, Value]:
    switches = logs.switches()
    return {
        "log_file": "",
        "log_info": switches.info,
        "log_warning": switches.warning,
        "log_error": switches.error,
        "log_verbose_level": switches.verbose,
        "log_format": "json" if logs.writes_json() else "text",
    }


def update(model: LLMModel, changes: dict[str, Value]) -> dict[str, Value]:
    """Apply `changes` (AdapterError naming the setting, nothing changed, for a bad one) and return
    every setting as it now is. Refused while the model loads: the engine process it would reach is
    still starting, with the switches it was given at start."""
    switches = updated(logs.switches(), changes)
    if changes:
        if not model.bound:
            raise AdapterError("unavailable", "log settings can be changed once the model has loaded")
        model.server.engine.switch_logs(switches)
    return current()


def updated(switches: LogSwitches, changes: dict[str, Value]) -> LogSwitches:
    now = current()
    values: dict[str, bool | int] = {}
    for name, value in changes.items():
        if name in _SWITCHES:
            if not isinstance(value, bool):
                raise AdapterError("invalid", f"{name}: must be a boolean (true or false), got {value!r}")
            values[_SWITCHES[name]] = value
        elif name == "log_verbose_level":
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_UINT32:
                raise AdapterError("invalid", f"{name}: must be an integer >= 0, got {value!r}")
            values["verbose"] = value
        elif name in ("log_file", "log_format"):
            if not isinstance(value, str):
                raise AdapterError("invalid", f"{name}: must be a string, got {value!r}")
            if value != now[name]:
                where = "stderr" if name == "log_file" else f"{now[name]} (--log-format)"
                raise AdapterError(
                    "invalid", f"{name}: the log is written to {where}; it cannot be changed while serving"
                )
        else:
            raise AdapterError(
                "invalid", f"unknown log setting {name[:64]!r}; the settings are {', '.join(NAMES)}"
            )
    return LogSwitches(**{**switches.__dict__, **values})
