"""The engine core in a process of its own (`serve --engine-process`), as vLLM serves: the front end
(gRPC, HTTP, tokenizing, validation, metrics) stays in the server's process and the engine steps in
another, so that neither waits for the other's interpreter. On one interpreter a GPU's short steps
wait for the writers of the last step's tokens (bench/README.md, "Serving over gRPC").

    front end (AsyncEngine, EngineFace)           engine process (`python -m` this module)
    sender thread: (INBOX, n, inbox)  ──────────▶ takes every inbox waiting, applies them as one
                                                  (run_pass), steps
    reader thread: AsyncEngine._on_core_pass ◀─── CorePass: the inboxes it applied, the pass, the
                                                  engine's stats, its metric calls
    shutdown: (STOP,)                 ──────────▶ exits (stopping its tensor-parallel ranks)

Start-up: the front end sends the settings; the engine process resolves the engine's configuration
from them, loads the tokenizer, hands both back, then builds the engine. The front end thus starts
without torch (resolving the device and loading a tokenizer import it: ~1 s and hundreds of MB; the
first structured-output request's grammar, xgrammar, imports it later).

The front end keeps an LLMEngine without a model (`EngineFace`): the tokenizer, the config, the
checks of a request (a scheduler of the same size that never runs), the Prometheus metrics (the
engine process's calls to its own replayed on them) and the LoRA adapters' names; its stats are the
engine's after its last pass. The engine process takes the bad words' token ids the front end made,
and compiles a request's grammar again on a thread of its own before the request enters its engine
(`_Admission`): a new grammar never stalls the steps of the requests running, nor the other requests'
adds and aborts.

Faults: a pass that faults goes out with its fault, and the engine process then only waits for STOP.
The process exiting (killed, crashed) ends the reader's stream: the front end fails every request
with EngineDeadError naming the exit, and `check_health` reports it (health turns NOT_SERVING). A
pass the reader cannot read fails the engine the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any, cast

from pagedserve import logs
from pagedserve.config import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.engine.core import Add, Inbox, Pass, run_pass
from pagedserve.engine.llm_engine import EngineStats, LLMEngine
from pagedserve.errors import EngineDeadError
from pagedserve.outputs import RequestDelta, RequestMetrics
from pagedserve.settings import EngineSettings
from pagedserve.telemetry import EngineMetrics
from pagedserve.threads import name_os_thread
from pagedserve.tokenizer import load_tokenizer
from pagedserve.worker.executor import Executor
from pagedserve.worker.processes import StartupError, describe_exit, stop_processes, stop_spawned_ranks

logger = logging.getLogger(__name__)

_INBOX, _STOP = "inbox", "stop"
_IDLE_POLL_S = 0.2  # an idle engine process checks its ranks' health this often
_COMPILE_POLL_S = 0.002  # an engine process with nothing to step but a grammar compiling looks this often
# How long a pass waits for the grammars its own inboxes brought: one compiled before comes back from
# xgrammar's cache in well under a millisecond and enters with its inbox, where it waited a whole pass
# (a step); a new one costs its first pass this much, then waits apart.
_CACHED_COMPILE_WAIT_S = 0.002
_STOP_GRACE_S = 10.0  # for the engine process to stop its ranks and exit, before it is killed

# Every engine process this process started, for stop_engine_processes() (an exit while one loads).
_started: list[subprocess.Popen[bytes]] = []
_started_lock = threading.Lock()


@dataclass
class _Ready:
    """The engine process has built its engine."""

    num_kv_blocks: int
    num_cpu_blocks: int
    stats: EngineStats
    worker_pids: list[int]  # the tensor-parallel ranks it started (1..N-1)


@dataclass
class _Failed:
    """The engine process could not build its engine: what LLMEngine raised (ValueError: a setting)."""

    error: BaseException


@dataclass
class CorePass:
    """One pass of the engine process, for the front end."""

    numbers: list[int]  # the inboxes it applied, in the order sent
    done: Pass  # its inbox left empty: the front end holds the inboxes it sent
    stats: EngineStats | None  # after the pass (None: the process is gone)
    metric_calls: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    lora_paths: dict[str, str] | None = None  # the adapters loaded, after a pass that changed them


def _recorded(name: str) -> Callable[..., None]:
    """A method of _MetricCalls: keeps the call `name(*args)`."""

    def record(self: _MetricCalls, *args: Any) -> None:
        self.calls.append((name, args))

    return record


class _MetricCalls:
    """The engine process's EngineMetrics: the calls LLMEngine makes, kept to be replayed on the front
    end's (the same objects: a pass's deltas and its record_step's are pickled together)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def take(self, stats: EngineStats) -> list[tuple[str, tuple[Any, ...]]]:
        """The calls kept since the last take, record_step's and record_aborted's with `stats` (the
        pass's, which count the requests waiting for their grammars) for the engine's own: the front
        end's gauges (`num_requests_waiting`, which autoscalers read) count those requests as its
        queue bound does."""
        calls, self.calls = self.calls, []
        return [(name, (stats, *args[1:])) if name in _STATS_CALLS else (name, args) for name, args in calls]

    set_cache_config_info = _recorded("set_cache_config_info")
    set_num_lora_adapters = _recorded("set_num_lora_adapters")
    set_lora_in_use = _recorded("set_lora_in_use")
    record_step = _recorded("record_step")
    record_aborted = _recorded("record_aborted")


_STATS_CALLS = ("record_step", "record_aborted")  # _MetricCalls whose first argument is the engine's stats


# -- the front end's side ----------------------------------------------------------------------------


class EngineProcess(Executor):
    """The front end's handle on the engine process, and its EngineFace's executor (whose health and
    shutdown are the process's). Starting it starts the process, which resolves the engine's
    configuration from the settings, loads the model's tokenizer, hands both over (`receive_handover`)
    and then builds the engine; `wait_ready` waits until it is built."""

    def __init__(self, settings: EngineSettings) -> None:
        self.tensor_parallel_size = settings.tensor_parallel_size
        ours, theirs = socket.socketpair()
        # the same import path as this process, as multiprocessing's spawn does
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        with _started_lock:
            _started[:] = [proc for proc in _started if proc.poll() is None]
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())],
                stdin=subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
                env=env,
            )
            _started.append(self._proc)
        theirs.close()
        assert self._proc.stdin is not None
        self._proc.stdin.write(pickle.dumps(settings))
        self._proc.stdin.close()  # (its imports start on it)
        self._conn = Connection(ours.detach())
        self._outbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._sent: dict[int, Inbox] = {}  # by number, until a pass applies it
        self._next_number = 0
        self._dead_reason: str | None = None
        self._shut_down = False

    def receive_handover(self) -> tuple[EngineConfig, Any]:
        """The engine's configuration and tokenizer, as the engine process resolved and loaded them: the
        front end takes both as its own rather than make them again. Resolving the device (`auto`)
        imports torch, and loading a tokenizer imports transformers' model configurations, torch among
        them, and parses the tokenizer's files: ~3 s of a 2-core host's CPU and torch's hundreds of MB
        in a process that otherwise starts without it, where unpickling takes ~0.1 s. The tokenizer
        is None where none came (one that does not pickle) or it does not unpickle here: the front end
        then loads its own. Raises what stopped the engine process (ValueError: a setting)."""
        config = cast(EngineConfig, self._starting_message())
        try:
            tokenizer = self._starting_message()
        except StartupError:
            raise
        except Exception as exc:  # unpickling raises what the tokenizer's classes raise
            logger.warning(
                "the engine process's tokenizer does not unpickle (%s: %s): the front end loads its own",
                type(exc).__name__,
                exc,
            )
            tokenizer = None
        return config, tokenizer

    def wait_ready(self) -> None:
        """Wait until the engine process has built its engine; raise what stopped it building."""
        ready = self._starting_message()
        self.ready: _Ready = ready
        self.num_kv_blocks, self.num_cpu_blocks = ready.num_kv_blocks, ready.num_cpu_blocks
        # the loop never waits on the socket: an inbox sent while the engine process is itself
        # waiting to send a pass (the reader held back, _MAX_PASSES_AHEAD) would deadlock them
        threading.Thread(target=self._send_all, name="pagedserve-core-sender", daemon=True).start()
        atexit.register(self.shutdown)

    def _starting_message(self) -> Any:
        """The engine process's next message while it starts. Raises what stopped it: its error (a
        setting's ValueError), or StartupError where it exited."""
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self._proc.wait()
            raise StartupError(f"the engine process {self._exit()} while starting") from None
        if isinstance(message, _Failed):
            self._proc.wait()
            raise message.error
        return message

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def worker_pids(self) -> list[int]:
        """The tensor-parallel ranks the engine process started."""
        return self.ready.worker_pids

    def send(self, inbox: Inbox) -> None:
        """Queue an inbox for the engine process (kept here, with its callers' futures, until a pass
        applies it)."""
        number, self._next_number = self._next_number, self._next_number + 1
        self._sent[number] = inbox
        self._outbox.put((_INBOX, number, inbox.for_sending()))

    def take_inboxes(self, numbers: list[int] | None) -> Inbox:
        """The inboxes a pass applied, as one; None: every inbox sent and not applied (a fault: the
        engine process applies no more)."""
        merged = Inbox()
        for number in list(self._sent) if numbers is None else numbers:
            merged.take_in(self._sent.pop(number))
        return merged

    def receive(self) -> CorePass:
        """The next pass (on the reader thread). Raises EngineDeadError once the process has gone."""
        try:
            return cast(CorePass, self._conn.recv())
        except (EOFError, OSError):
            pass
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(_STOP_GRACE_S)
        self._dead_reason = self._dead_reason or f"the engine process {self._exit()}"
        raise EngineDeadError(self._dead_reason)

    def _send_all(self) -> None:
        name_os_thread()
        while True:
            message = self._outbox.get()
            try:
                self._conn.send(message)
            except OSError:  # the process has gone: the reader reports it
                return
            if message[0] == _STOP:
                return

    def _exit(self) -> str:
        code = self._proc.poll()
        return "closed its connection" if code is None else describe_exit(code)

    # -- Executor: what the EngineFace asks of its executor ----------------------------------------

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        raise RuntimeError("the engine process runs the steps")

    def load_lora(self, name: str, path: str) -> None:
        raise RuntimeError("the engine process loads LoRA adapters (AsyncEngine.load_lora_adapter)")

    def unload_lora(self, name: str) -> None:
        raise RuntimeError("the engine process unloads LoRA adapters (AsyncEngine.unload_lora_adapter)")

    def switch_logs(self, switches: logs.LogSwitches) -> None:
        raise RuntimeError("the engine process takes log switches in its inbox (AsyncEngine.switch_logs)")

    def check_health(self) -> None:
        if self._dead_reason is None and self._proc.poll() is not None:
            self._dead_reason = f"the engine process {self._exit()}"
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    def shutdown(self) -> None:
        """Stop the engine process (it stops its ranks), killing it after a grace. Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        self._outbox.put((_STOP,))
        stop_processes([self._proc], _STOP_GRACE_S)
        # (the connection is left to close with this object: the reader thread may still be in it)


class EngineFace(LLMEngine):
    """The front end's LLMEngine while the engine runs in a process of its own (see the module's
    docstring): everything of an LLMEngine but the steps; `stats` are the engine process's."""

    executor: EngineProcess

    def __init__(self, settings: EngineSettings) -> None:
        process = EngineProcess(settings)
        try:
            config, tokenizer = process.receive_handover()  # (no tokenizer: LLMEngine loads it)
            process.wait_ready()
            super().__init__(config, executor=process, tokenizer=tokenizer)
        except BaseException:
            process.shutdown()
            raise
        self._stats = process.ready.stats
        self.metrics.watch_engine_process(process.pid)

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> EngineFace:
        return cls(settings)

    def stats(self) -> EngineStats:
        return self._stats

    def has_unfinished_requests(self) -> bool:
        return self._stats.num_unfinished > 0  # the engine process's, after its last pass

    def has_work(self) -> bool:
        return self.has_unfinished_requests()

    def follow(self, core_pass: CorePass) -> None:
        """Take in a pass's stats, LoRA adapters and metrics (before its deltas are handed out)."""
        if core_pass.stats is not None:
            self._stats = core_pass.stats
        if core_pass.lora_paths is not None:
            self._lora_paths = core_pass.lora_paths
            self._serves_lora = True
        for name, args in core_pass.metric_calls:
            getattr(self.metrics, name)(*args)

    def step(self) -> list[Any]:
        raise RuntimeError("the engine process runs the steps")


def stop_engine_processes() -> None:
    """Stop every engine process this process started, for a front end that exits while one may still
    be loading: each stops the tensor-parallel ranks it started, then exits (killed after a grace)."""
    with _started_lock:
        procs = list(_started)
    stop_processes(procs, 0.0)


# -- the engine process's side -----------------------------------------------------------------------


def serve(conn: Connection, config: EngineConfig, tokenizer: Any) -> int:
    """Build the engine on `tokenizer` (the one handed to the front end), then run passes for the front
    end until it sends STOP or goes away."""
    try:
        llm = LLMEngine(config, tokenizer=tokenizer)
    except Exception as exc:
        # a setting's error (exit 2) or a failed tensor-parallel start-up (exit 1): the front end
        # reports it as it would its own; anything else is logged here with its traceback
        if not isinstance(exc, (ValueError, StartupError)):
            logger.exception("the engine could not be built")
        conn.send(_Failed(_sendable(exc)))
        return 1
    # built: from now on the front end stops this process (STOP, or its connection closing), also
    # when a SIGTERM reaches every process of the group (systemd's stop, `kill -TERM -PGID`), which
    # must not cut its drain short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    recorder = _MetricCalls()
    llm.metrics = cast(EngineMetrics, recorder)
    try:
        conn.send(
            _Ready(llm.num_kv_blocks, llm.executor.num_cpu_blocks, llm.stats(), llm.executor.worker_pids)
        )
        gc.collect()
        gc.freeze()  # the model and the tokenizer out of the collector's scans (freeze_startup_heap)
        _run_passes(conn, llm, recorder)
    except (EOFError, OSError):  # the front end has gone
        pass
    finally:
        llm.executor.shutdown()
    return 0


class _Admission:
    """The inboxes received, until a pass applies them. A request's grammar is compiled on the grammar
    thread (into xgrammar's cache, where add_request finds it); one the cache holds comes back within
    the pass's short wait (_CACHED_COMPILE_WAIT_S) and its request enters with its inbox. A request
    whose grammar takes longer waits apart, and its inbox goes on without it: a compile takes
    milliseconds for most schemas but grows with a schema's size (400 patterned fields: ~0.1 s on the
    2-core host), and no other request's add or abort, and no step, waits for it. The front end has
    checked that it compiles. A waiting request enters the engine in a later pass, after the requests
    of the inboxes applied meanwhile (as vLLM's requests waiting for their grammar are passed over);
    an abort ends it where it waits."""

    def __init__(self, llm: LLMEngine) -> None:
        self._llm = llm
        self._inboxes: list[tuple[int, Inbox]] = []
        self._compiling: list[tuple[Add, Future[Any]]] = []  # in the order received
        self._grammar_thread = ThreadPoolExecutor(1, "pagedserve-grammar", name_os_thread)

    def receive(self, number: int, inbox: Inbox) -> None:
        self._inboxes.append((number, inbox))

    @property
    def num_waiting(self) -> int:
        """Requests waiting for their grammars."""
        return len(self._compiling)

    @property
    def ready(self) -> bool:
        """Something to apply: an inbox, or a request whose grammar has compiled."""
        return bool(self._inboxes) or any(future.done() for _, future in self._compiling)

    def take(self) -> tuple[list[int], Inbox, list[Add]]:
        """The inboxes received (their numbers) as one inbox, whose adds are first the waiting requests
        whose grammars have compiled, then the inboxes' own but those whose grammar is still compiling
        after _CACHED_COMPILE_WAIT_S (they wait); and the waiting requests the inboxes' aborts ended."""
        numbers, merged = [], Inbox()
        for number, inbox in self._inboxes:
            numbers.append(number)
            merged.take_in(inbox)
        self._inboxes.clear()
        ended, compiled, still = [], [], []
        for add, future in self._compiling:  # (each future looked at once: it may finish meanwhile)
            if add.request_id in merged.aborts:
                ended.append(add)
            elif future.done():
                compiled.append(add)
            else:
                still.append((add, future))
        self._compiling = still
        arriving: list[tuple[Add, Future[Any] | None]] = []
        for add in merged.adds:
            grammar = add.params.structured_outputs
            if grammar is None or add.request_id in merged.aborts:  # (an abort skips it in run_pass)
                arriving.append((add, None))
            else:
                arriving.append(
                    (add, self._grammar_thread.submit(self._llm.structured_outputs.compile, grammar))
                )
        compiles = [future for _, future in arriving if future is not None]
        if compiles:
            wait(compiles, timeout=_CACHED_COMPILE_WAIT_S)
        adds = []
        for add, pending in arriving:  # (each future looked at once, as above)
            if pending is None or pending.done():
                adds.append(add)
            else:
                self._compiling.append((add, pending))
        merged.adds = compiled + adds
        return numbers, merged, ended

    def drop(self) -> None:
        self._inboxes.clear()
        self._compiling.clear()


def _ended_waiting(llm: LLMEngine, adds: list[Add]) -> list[RequestDelta]:
    """The final deltas of requests an abort ended while they waited for their grammars, made and
    logged as the front end makes those of requests aborted before they reached the engine."""
    now = time.monotonic()
    deltas = [
        RequestDelta.aborted_before_output(
            add.request_id, len(add.prompt_token_ids), RequestMetrics(add.arrival_time, finished_time=now)
        )
        for add in adds
    ]
    if deltas:
        llm.metrics.record_aborted(llm.stats(), deltas, now)
    return deltas


def _stats(llm: LLMEngine, num_waiting_apart: int) -> EngineStats:
    """The engine's stats, with the requests waiting for their grammars among the waiting."""
    stats = llm.stats()
    if not num_waiting_apart:
        return stats
    return replace(
        stats,
        num_waiting=stats.num_waiting + num_waiting_apart,
        num_unfinished=stats.num_unfinished + num_waiting_apart,
    )


def _run_passes(conn: Connection, llm: LLMEngine, recorder: _MetricCalls) -> None:
    admission, faulted = _Admission(llm), False
    while True:
        busy = not faulted and (admission.ready or llm.has_work())
        timeout = 0.0 if busy else _COMPILE_POLL_S if admission.num_waiting else _IDLE_POLL_S
        while conn.poll(timeout):
            message = conn.recv()
            if message[0] == _STOP:
                return
            _, number, sent = message
            admission.receive(number, sent)
            timeout = 0.0
        if faulted:
            admission.drop()  # nothing applies now; the front end fails them
            continue
        numbers, inbox, ended = admission.take()
        if not numbers and not inbox and not llm.has_work():
            try:
                llm.executor.check_health()
            except EngineDeadError as exc:
                conn.send(CorePass([], Pass(Inbox(), fault=exc), llm.stats()))
                faulted = True
            continue
        for add in inbox.adds:
            llm.remember_bad_words(add.params)  # tokenized by the front end already
        ended_deltas = _ended_waiting(llm, ended)
        done = run_pass(llm, inbox, lambda num_adds: None)
        done.aborted += ended_deltas
        changed_loras = bool(inbox.lora_changes)
        done.inbox = Inbox()
        done.lora_errors = [None if exc is None else _sendable(exc) for exc in done.lora_errors]
        done.fault = None if done.fault is None else _sendable(done.fault)
        lora_paths = {name: llm.lora_path(name) or "" for name in llm.lora_names} if changed_loras else None
        stats = _stats(llm, admission.num_waiting)
        conn.send(CorePass(numbers, done, stats, recorder.take(stats), lora_paths))
        faulted = done.fault is not None


def _sendable(exc: BaseException) -> BaseException:
    """`exc` if it pickles, else a RuntimeError with its repr."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(repr(exc))
    return exc


def _stop_while_starting(signum: int, frame: Any) -> None:
    """SIGTERM while the engine is being built (the front end exiting, `stop_engine_processes`): stop
    the ranks started so far, which would otherwise outlive this process, and exit at once."""
    stop_spawned_ranks()
    logging.shutdown()
    os._exit(1)


def _main() -> int:
    # Ctrl-C in a terminal signals the whole foreground process group: the front end drains and then
    # stops this process, which must not die of a KeyboardInterrupt first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_while_starting)
    settings: EngineSettings = pickle.load(sys.stdin.buffer)
    logs.configure_from_environment("engine")
    conn = Connection(int(sys.argv[1]))
    try:
        config = settings.to_engine_config()
        tokenizer = load_tokenizer(config.model)
    except ValueError as exc:  # a setting (the model's path, the tokenizer's): the front end reports it
        with contextlib.suppress(OSError):  # (unless it has gone)
            conn.send(_Failed(_sendable(exc)))
        return 1
    try:
        conn.send(config)
        send_tokenizer(conn, tokenizer)
    except OSError:  # the front end has gone
        return 1
    return serve(conn, config, tokenizer)


def send_tokenizer(conn: Connection, tokenizer: Any) -> None:
    """Hand the front end this process's tokenizer (EngineProcess.receive_handover). One that does not
    pickle (an attribute set on it that pickle cannot take) goes as None: the front end loads its
    own."""
    try:
        sent = pickle.dumps(tokenizer)
    except Exception as exc:  # pickle raises what the object's own __reduce__ raises
        logger.warning(
            "the tokenizer does not pickle (%s: %s): the front end loads its own", type(exc).__name__, exc
        )
        sent = pickle.dumps(None)
    conn.send_bytes(sent)


if __name__ == "__main__":
    # run the imported module's copy, the one that unpickling uses, not __main__'s
    from pagedserve.engine.core_process import _main as main

    code = main()
    # nothing left to release (the ranks are stopped): the interpreter's teardown would only walk the
    # frozen heap, and nanobind (triton) lists its objects still alive there as leaks
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)
