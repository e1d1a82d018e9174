"""How the server's processes log (pagedserve/logs.py): levels, text or JSON lines, the per-request
line on or off, and the settings a started process (engine process, rank) takes from its server.
Each case runs in a fresh interpreter: pytest's own log capture holds the root logger here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from pagedserve.rpc.cli import ServeSettings
from pagedserve.settings import SettingsError
from test_settings_errors import parse

SCRIPT_HEAD = """
import logging, warnings
from pagedserve import logs
log, requests = logging.getLogger("pagedserve.test"), logging.getLogger("pagedserve.requests")
"""


def run(script: str, returncode: int = 0, **env: str) -> list[str]:
    """The lines a script (after SCRIPT_HEAD) writes to stderr."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_LOG_")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT_HEAD + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**environment, **env},
    )
    assert done.returncode == returncode, done.stderr
    return done.stderr.splitlines()


def test_json_lines_carry_the_records_fields_the_process_and_the_traceback() -> None:
    lines = run("""
        logs.configure("info", "json", True, "engine")
        requests.info("request finished id=%s", "r1", extra={"request_id": "r1", "num_output_tokens": 7})
        try:
            1 / 0
        except ZeroDivisionError:
            log.exception("failed: %s", "step")
        warnings.warn("old knob")
        """)
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    finished, failed, warned = entries
    assert finished["level"] == "INFO" and finished["logger"] == "pagedserve.requests"
    assert finished["process"] == "engine" and finished["message"] == "request finished id=r1"
    assert (finished["request_id"], finished["num_output_tokens"]) == ("r1", 7)
    assert finished["time"].endswith("+00:00") and "T" in finished["time"]
    assert failed["message"] == "failed: step" and failed["level"] == "ERROR"
    assert failed["exception"].startswith("Traceback") and "ZeroDivisionError" in failed["exception"]
    assert warned["logger"] == "py.warnings" and "old knob" in warned["message"]


def test_uncaught_exceptions_are_one_json_line_each() -> None:
    """A thread's and the main thread's: one record with the traceback, not its lines raw."""
    lines = run(
        """
        import threading
        logs.configure("info", "json")
        worker = threading.Thread(target=lambda: 1 / 0, name="worker")
        worker.start()
        worker.join()
        raise RuntimeError("boom")
        """,
        returncode=1,
    )
    in_thread, in_main = [json.loads(line) for line in lines]
    assert in_thread["message"] == "uncaught exception in thread worker"
    assert in_thread["exception"].endswith("ZeroDivisionError: division by zero")
    assert (in_main["level"], in_main["message"]) == ("CRITICAL", "uncaught exception")
    assert in_main["exception"].endswith("RuntimeError: boom")


def test_the_level_and_the_request_lines() -> None:
    lines = run("""
        logs.configure("warning", "text", True)
        log.info("hidden: below the level")
        log.warning("shown")
        logs.configure("info", "text", False, "rank 1")
        log.info("an info line")
        requests.info("request finished id=r2")
        """)
    assert len(lines) == 2, lines
    assert lines[0].endswith(" WARNING pagedserve.test: shown")
    assert lines[1].endswith(" INFO [rank 1] pagedserve.test: an info line")  # one handler, replaced


def test_a_started_process_logs_as_its_server_says() -> None:
    """`serve` exports its settings; the engine process and ranks read them (values set by hand that
    it does not know fall back to the defaults)."""
    exported = run(
        """
        logs.configure_from_environment("engine")
        log.debug("a debug line")
        requests.info("request finished id=r3")
        """,
        PAGEDSERVE_LOG_LEVEL="debug",
        PAGEDSERVE_LOG_FORMAT="json",
        PAGEDSERVE_LOG_REQUESTS="false",
    )
    (entry,) = [json.loads(line) for line in exported]
    assert (entry["level"], entry["process"], entry["message"]) == ("DEBUG", "engine", "a debug line")
    unknown = run(
        """
        logs.configure_from_environment("engine")
        log.debug("not at the default level")
        requests.info("request finished id=r4")
        """,
        PAGEDSERVE_LOG_LEVEL="chatty",
        PAGEDSERVE_LOG_FORMAT="xml",
    )
    assert len(unknown) == 1 and unknown[0].endswith(
        " INFO [engine] pagedserve.requests: request finished id=r4"
    )


def test_a_bad_setting_is_a_json_record_where_the_run_logs_json() -> None:
    """`serve`'s own error line, before any model loads: JSON where the flag or the environment asks
    for JSON lines (the flag counts though the settings failed before it was applied), plain else."""
    script = """
        import sys
        from pagedserve.__main__ import main
        sys.exit(main(["serve", "--max-num-seqs", "0"] + sys.argv[1:]))
        """
    for extra, env in ((" --log-format json", {}), ("", {"PAGEDSERVE_LOG_FORMAT": "json"})):
        lines = run(script.replace("sys.argv[1:]", repr(extra.split())), returncode=2, **env)
        (entry,) = [json.loads(line) for line in lines]
        assert entry["level"] == "CRITICAL"
        assert entry["message"] == "pagedserve serve: error: --max-num-seqs: must be >= 1"
    assert run(script.replace("sys.argv[1:]", "[]"), returncode=2) == [
        "pagedserve serve: error: --max-num-seqs: must be >= 1"
    ]


def test_export_sets_what_a_started_process_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve import logs

    names = [f"PAGEDSERVE_LOG_{name}" for name in ("LEVEL", "FORMAT", "REQUESTS")]
    for name in names:
        monkeypatch.setenv(name, "before")  # (so that monkeypatch puts back what was there)
    logs.export("error", "json", False)
    assert [os.environ[name] for name in names] == ["error", "json", "false"]


def test_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(name)
    defaults = parse([])
    assert (defaults.log_level, defaults.log_format, defaults.log_requests) == ("info", "text", True)
    flags = parse(["--log-level", "debug", "--log-format", "json", "--no-log-requests"])
    assert (flags.log_level, flags.log_format, flags.log_requests) == ("debug", "json", False)
    monkeypatch.setenv("PAGEDSERVE_LOG_LEVEL", "WARNING")  # as operators often write it
    assert parse([]).log_level == "warning"
    monkeypatch.setenv("PAGEDSERVE_LOG_FORMAT", "xml")
    with pytest.raises(SettingsError) as info:
        parse([])
    assert str(info.value).startswith("PAGEDSERVE_LOG_FORMAT: ") and "'xml'" in str(info.value)
    assert ServeSettings.model_fields["log_requests"].default is True


def test_log_switches_start_from_the_level_and_switch_each_level_apart() -> None:
    """--log-level sets the switches (Triton's LogSettings reads and changes them): each level of
    record on or off by itself, info off beside warning on included, debug at a verbose level above 0."""
    lines = run("""
        logs.configure("warning", "text", True)
        logs.switch(logs.LogSwitches(info=True, warning=False, error=True, verbose=2))
        log.debug("debug shown")
        log.info("info shown")
        log.warning("warning hidden")
        log.error("error shown")
        logs.switch(logs.LogSwitches(info=False, warning=False, error=False, verbose=0))
        log.error("error hidden")
        log.critical("critical shown: an uncaught exception's, whatever the switches")
        """)
    assert [line.split(" ", 2)[2] for line in lines] == [
        "DEBUG pagedserve.test: debug shown",
        "INFO pagedserve.test: info shown",
        "ERROR pagedserve.test: error shown",
        "CRITICAL pagedserve.test: critical shown: an uncaught exception's, whatever the switches",
    ]
    from pagedserve.logs import LogSwitches

    assert [LogSwitches.of_level(level) for level in ("debug", "info", "warning", "error", "critical")] == [
        LogSwitches(True, True, True, 1),
        LogSwitches(True, True, True, 0),
        LogSwitches(False, True, True, 0),
        LogSwitches(False, False, True, 0),
        LogSwitches(False, False, False, 0),
    ]
