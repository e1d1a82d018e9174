"""How every pagedserve process logs: the level, the format (text lines, or JSON lines for a log
pipeline that indexes fields) and whether each finished request gets its line. `serve` takes them
as --log-level, --log-format and --log-requests (PAGEDSERVE_LOG_*), and hands them to the processes
it starts (the engine process, tensor-parallel ranks) through the same variables.

    text: 2026-12-05 01:10:38,398 INFO [engine] pagedserve.engine: ...
    json: {"time": "2026-12-05T01:10:38.398+00:00", "level": "INFO", "logger": "pagedserve.engine",
           "process": "engine", "message": "...", ...}

A JSON line carries the record's extra fields as well: a finished request's line has `request_id`,
`num_prompt_tokens`, `num_output_tokens`, `ttft_s`, `e2e_s`, ... (telemetry.log_finished)."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Literal, cast, get_args

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LogFormat = Literal["text", "json"]
LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)
FORMATS: tuple[LogFormat, ...] = get_args(LogFormat)
REQUESTS_LOGGER = "pagedserve.requests"  # one info line per finished request
_ENV = {
    "level": "PAGEDSERVE_LOG_LEVEL",
    "format": "PAGEDSERVE_LOG_FORMAT",
    "requests": "PAGEDSERVE_LOG_REQUESTS",
}

# every attribute a LogRecord has of itself; any other was given as `extra`
_RECORD_ATTRIBUTES = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}

_handler: logging.Handler | None = None  # the one configure installed, replaced by the next call


@dataclass(frozen=True)
class LogSwitches:
    """Which records a process writes, by level, switched at run time as Triton's logging extension
    switches its own (the KServe v2 / Triton adapters' LogSettings): info, warning and error records
    each on or off, and debug records at a verbose level above 0; critical records (an uncaught
    exception's) always. --log-level sets them at start: debug is verbose 1, warning turns info off,
    error warning too, critical error too."""

    info: bool = True
    warning: bool = True
    error: bool = True
    verbose: int = 0

    @classmethod
    def of_level(cls, level: LogLevel) -> LogSwitches:
        rank = LEVELS.index(level)
        return cls(info=rank <= 1, warning=rank <= 2, error=rank <= 3, verbose=int(rank == 0))

    def writes(self, levelno: int) -> bool:
        if levelno < logging.INFO:
            return self.verbose > 0
        if levelno < logging.WARNING:
            return self.info
        if levelno < logging.ERROR:
            return self.warning
        return self.error or levelno >= logging.CRITICAL

    @property
    def lowest_level(self) -> int:
        """The root logger's level: no record below it is even made (debug ones cost nothing when off)."""
        return next(
            n
            for n in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
            if self.writes(n)
        )


_switches = LogSwitches()


def _switched(record: logging.LogRecord) -> bool:
    """configure's handler's filter: what the switches turned off (info off beside warning on)."""
    return _switches.writes(record.levelno)


def switches() -> LogSwitches:
    return _switches


def switch(to: LogSwitches) -> None:
    """Write from now on what `to` switches on. Where configure installed no handler (a host
    application's logging), only the root logger's level follows."""
    global _switches
    _switches = to
    logging.getLogger().setLevel(to.lowest_level)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (ISO 8601, UTC, milliseconds), level, logger, the process when it
    is not the server's own (engine, rank 1, ...), message, the record's extra fields, and the
    exception's traceback as one string."""

    def __init__(self, process: str = "") -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        time = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        entry: dict[str, Any] = {"time": time, "level": record.levelname, "logger": record.name}
        if self.process:
            entry["process"] = self.process
        entry["message"] = record.getMessage()
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRIBUTES and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure(
    level: LogLevel = "info", fmt: LogFormat = "text", log_requests: bool = True, process: str = ""
) -> None:
    """Set this process's logging. `process` names it in each line ("engine", "rank 1"; empty for the
    server's own). A process whose logging someone else set up (a host application, pytest's capture)
    keeps it, as logging.basicConfig leaves it: only the request lines follow `log_requests`."""
    global _handler
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
        _handler = None
    if not root.handlers:
        _handler = logging.StreamHandler(sys.stderr)
        if fmt == "json":
            _handler.setFormatter(JsonFormatter(process))
        else:
            tag = f"[{process}] " if process else ""
            _handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s"))
        _handler.addFilter(_switched)
        root.addHandler(_handler)
        switch(LogSwitches.of_level(level))
        # a library's warnings and an uncaught exception's traceback as JSON lines too, not raw text
        # (a traceback's many lines would each be a record of their own to a log pipeline)
        logging.captureWarnings(fmt == "json")
        sys.excepthook = _log_uncaught if fmt == "json" else sys.__excepthook__
        threading.excepthook = _log_uncaught_in_thread if fmt == "json" else threading.__excepthook__
    logging.getLogger(REQUESTS_LOGGER).setLevel(logging.NOTSET if log_requests else logging.WARNING)


def writes_json() -> bool:
    """Whether this process's lines are JSON (configure's handler, in the json format)."""
    return _handler is not None and isinstance(_handler.formatter, JsonFormatter)


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("pagedserve").critical("uncaught exception", exc_info=(kind, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None or issubclass(args.exc_type, SystemExit):
        return  # as threading's own hook: a thread that exits quietly
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("pagedserve").critical(
        "uncaught exception in thread %s", name, exc_info=(args.exc_type, args.exc_value, args.exc_traceback)
    )


def export(level: LogLevel, fmt: LogFormat, log_requests: bool) -> None:
    """Hand the settings to the processes this one starts from now on (they inherit its environment)."""
    os.environ[_ENV["level"]] = level
    os.environ[_ENV["format"]] = fmt
    os.environ[_ENV["requests"]] = "true" if log_requests else "false"


def configure_from_environment(process: str) -> None:
    """A started process's logging, as its server's (`export`). Values it does not know (the variables
    set by hand, not through the server, which checked them) fall back to the defaults."""
    level = os.environ.get(_ENV["level"], "info").lower()
    fmt = os.environ.get(_ENV["format"], "text").lower()
    requests = os.environ.get(_ENV["requests"], "true").lower() not in ("false", "0", "no", "off")
    configure(
        cast(LogLevel, level) if level in LEVELS else "info",
        cast(LogFormat, fmt) if fmt in FORMATS else "text",
        requests,
        process,
    )
