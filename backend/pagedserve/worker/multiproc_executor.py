"""Tensor-parallel ranks in separate processes; this process is rank 0 and also runs the scheduler.

Each step rank 0 broadcasts the plan (a plain-data `SchedulerOutput`) on the control group, then
every rank runs the same forward pass on its shard. All ranks gather the same logits and sample the
same tokens (the sampler is seeded by `config.seed`); rank 0's are returned, the others' dropped.

    rank 0 (engine process)                  rank k > 0 (`run_worker` loop)
    broadcast (STEP, plan)   ──────────────▶ receive
    worker.execute(plan)     ◀─ all-reduce ─▶ worker.execute(plan)
    idle: (PING) every few seconds ────────▶ receive; rank 0 silent past the timeout: exit
    shutdown: (STOP)         ──────────────▶ exit 0

Ranks come from a launcher (torchrun: one process per rank, rendezvous through `env://`), or this
process starts ranks 1..N-1 on this machine (`python -m pagedserve.worker.multiproc_executor`,
configured through stdin, rendezvous through a store this process hosts on a free loopback port).

Faults: a rank that dies closes its sockets, so the next collective fails at once; a rank that hangs
fails it after the step timeout. Either way `execute` raises `EngineDeadError` and rank 0 stops the
ranks it started. A watchdog thread also notices a local rank's death between steps. During start-up
rank 0 watches the ranks it started itself: one that exits fails start-up at once (`StartupError`),
even in the rendezvous, where the others would wait for it in the store until the start-up timeout.

A step that raises an ordinary exception (a bad plan, an out-of-memory, a bug in one shard) is
reported in the rendezvous store by every rank it raised on, each then waiting a few seconds for the
other ranks' reports of the same step (`_agree_on_fault`). All there, after the same number of
collectives: the ranks are still in step, so rank 0 fails that batch's requests and every rank goes
on. Not: the ranks that did not fail wait in a collective the failed ones skipped, which only the
step timeout would end. Rank k > 0 then exits, which fails rank 0's collective at once, and rank 0
reports the rank's stored error; rank 0 failing alone marks the engine dead itself (stopping the
ranks it started). Either way `execute` raises `EngineDeadError` within seconds, naming the step, the
rank and its error. A step that raises nowhere pays for none of this: no collective is added.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NoReturn, TypeVar

import torch

from pagedserve import distributed, logs
from pagedserve.config import EngineConfig, default_num_threads
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed import CollectiveError, StepFault
from pagedserve.errors import EngineDeadError
from pagedserve.launch import LaunchEnv
from pagedserve.worker.executor import Executor, build_worker, log_capacity
from pagedserve.worker.processes import StartupError, describe_exit, spawning, stop_processes
from pagedserve.worker.worker import Worker

if TYPE_CHECKING:
    from torch.distributed import Store, TCPStore

logger = logging.getLogger(__name__)

STEP_TIMEOUT_S = 120.0  # longest wait in one collective of a step: a rank this late is hung
STARTUP_TIMEOUT_S = 1800.0  # rendezvous and weight loading: other nodes' ranks may start late
_PING_INTERVAL_S = 5.0  # idle rank 0 pings the workers, whose wait for a plan has STEP_TIMEOUT_S
_WATCH_INTERVAL_S = 0.2
_STOP_GRACE_S = 10.0
# A rank whose step raised waits this long for the other ranks' reports of the same step: those that
# fail it too do so at the same point of the same plan, within milliseconds of each other.
_FAULT_WAIT_S = 5.0
_LAUNCHED_FAULT_GRACE_S = 3.0  # a launcher's rank k > 0 that stopped on a fault, before it exits

_STEP, _PING, _STOP, _LORA, _LOGS = "step", "ping", "stop", "lora", "logs"

T = TypeVar("T")


class OutOfStepError(EngineDeadError):
    """A step raised on some ranks but not on others (or after different collectives): the ranks no
    longer enter the same collectives, so none can go on."""


@dataclass(frozen=True)
class _SpawnArgs:
    """What a rank started by rank 0 reads from its stdin."""

    config: EngineConfig
    eos_token_ids: frozenset[int]
    launch: LaunchEnv
    store_port: int


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int], launch: LaunchEnv | None) -> None:
        self.tensor_parallel_size = config.parallel.tensor_parallel_size
        self._procs: list[subprocess.Popen[bytes]] = []  # ranks 1..N-1 when this process started them
        self._lock = threading.Lock()  # one sequence of collectives at a time: a step or a ping
        self._stopping = threading.Event()
        self._dead_reason: str | None = None
        self._dead_lock = threading.Lock()  # the watchdog and a failing step may both report a death
        self._released = False
        self._num_threads = torch.get_num_threads()
        self._last_sent = time.monotonic()
        self._num_steps = 0  # STEP plans broadcast: each rank counts them alike (step faults)
        self._last_fault_step = 0  # the last step that raised here, on every rank alike
        try:
            self._start(config, eos_token_ids, launch)
        except BaseException as exc:
            self._stopping.set()
            self._release()
            stop_processes(self._procs, 0.0)
            if isinstance(exc, CollectiveError):
                raise StartupError(f"tensor-parallel start-up failed: {self._reason(exc)}") from exc
            raise
        log_capacity(config, self.worker, self.num_kv_blocks)
        # stop the ranks at interpreter exit even if nobody called shutdown(): a launcher's ranks
        # would otherwise see rank 0 vanish and fail
        atexit.register(self.shutdown)
        self._watchdog = threading.Thread(target=self._watch, name="pagedserve-tp-watchdog", daemon=True)
        self._watchdog.start()

    def _start(self, config: EngineConfig, eos_token_ids: frozenset[int], launch: LaunchEnv | None) -> None:
        tp = self.tensor_parallel_size
        store = None
        if launch is None:
            _check_local_devices(config.device, tp)
            store = distributed.create_store(tp, STARTUP_TIMEOUT_S)
            self._store = store  # rank 0 hosts the rendezvous: keep it alive with the process group
            self._procs.extend(_spawn_ranks(config, eos_token_ids, store.port))
            _wait_started(store, self._procs)
            launch = _local_launch(0, tp)
        self.worker, self.num_kv_blocks, self.num_cpu_blocks = init_rank(
            config, eos_token_ids, launch, store, self._procs
        )
        if exited := _exited_ranks(self._procs):  # e.g. during the compile warm-up, which falls back to eager
            raise StartupError(f"tensor-parallel start-up failed: {exited}")

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 when this process started them (empty under a launcher)."""
        return [proc.pid for proc in self._procs]

    # -- the step -------------------------------------------------------------------------------------

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        with self._lock:
            self._raise_if_dead()
            try:
                distributed.broadcast_object((_STEP, output))
                self._num_steps += 1
                result = _run_step(self.worker, output, self._num_steps)
            except EngineDeadError as exc:
                self._mark_dead(self._reason(exc))
                self._release()
                raise EngineDeadError(self._dead_reason) from exc
            except Exception:  # raised on every rank alike: LLMEngine fails the batch, and the
                self._last_fault_step = self._num_steps  # others' reports of it are no news
                raise
            self._last_sent = time.monotonic()
            return result

    def load_lora(self, name: str, path: str) -> None:
        self._change_lora(("load", name, path))

    def unload_lora(self, name: str) -> None:
        self._change_lora(("unload", name))

    def _change_lora(self, change: tuple[str, ...]) -> None:
        """Every rank applies `change` (`_apply_lora`) from the same files; rank 0's error is raised (a
        rank that fails where rank 0 did not would fail the first step through the adapter)."""
        with self._lock:
            self._send_between_steps((_LORA, change))
            _apply_lora(self.worker, change)

    def switch_logs(self, switches: logs.LogSwitches) -> None:
        with self._lock:
            self._send_between_steps((_LOGS, switches))

    def _send_between_steps(self, message: tuple[str, object]) -> None:
        """(Under the lock.) A message every rank takes between plans; a rank found gone marks the
        executor dead, as a step would."""
        self._raise_if_dead()
        try:
            distributed.broadcast_object(message)
        except EngineDeadError as exc:
            self._mark_dead(self._reason(exc))
            self._release()
            raise EngineDeadError(self._dead_reason) from exc
        self._last_sent = time.monotonic()

    def check_health(self) -> None:
        if self._dead_reason is None and (exited := _exited_ranks(self._procs)):
            self._mark_dead(self._peer_fault() or exited)
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if self._stopping.is_set():
            raise EngineDeadError("the tensor-parallel executor is shut down")

    def shutdown(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        atexit.unregister(self.shutdown)
        with self._lock:
            if self._dead_reason is None:
                with contextlib.suppress(EngineDeadError):
                    distributed.broadcast_object((_STOP, None))
            self._release()
        stop_processes(self._procs, _STOP_GRACE_S)

    # -- faults ---------------------------------------------------------------------------------------

    def _raise_if_dead(self) -> None:
        """Called with the lock held, so no collective is in flight when the groups are released."""
        if self._dead_reason is not None:
            self._release()
            raise EngineDeadError(self._dead_reason)
        if self._stopping.is_set():  # the groups are gone: the layers would silently run as one rank
            raise EngineDeadError("the tensor-parallel executor is shut down")

    def _mark_dead(self, reason: str) -> None:
        with self._dead_lock:
            if self._dead_reason is not None:
                return
            self._dead_reason = reason
        logger.error("tensor-parallel engine is dead: %s", reason)
        # the surviving ranks cannot go on without the dead one: stop them now
        stop_processes(self._procs, 0.0)

    def _reason(self, exc: EngineDeadError) -> str:
        """Why the engine is dead: this rank's own step fault as it stands; after a failed collective,
        the step fault a peer reported before it exited, else the rank that died when it is one of
        ours (its exit shows up just after its sockets close)."""
        if not isinstance(exc, CollectiveError):
            return str(exc)
        if fault := self._peer_fault():
            return fault
        deadline = time.monotonic() + 1.0
        while self._procs and time.monotonic() < deadline:
            if exited := _exited_ranks(self._procs):
                return exited
            time.sleep(0.02)
        return str(exc)

    def _peer_fault(self) -> str:
        """'' unless another rank reported a step fault that this rank did not share: such a rank
        exits after `_FAULT_WAIT_S`, which is how this rank's collective (or the watchdog) finds out."""
        if self._released:  # the store went with the process groups
            return ""
        try:
            faults = [f for f in distributed.step_faults() if f.step > self._last_fault_step]
        except CollectiveError:  # the store's host (a launcher's agent, or rank 0's) is gone too
            return ""
        if not faults:
            return ""
        step = max(f.step for f in faults)
        return _out_of_step(step, [f for f in faults if f.step == step], self.tensor_parallel_size)

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        distributed.destroy_tensor_parallel()
        torch.set_num_threads(self._num_threads)

    def _watch(self) -> None:
        """Between steps: notice a local rank's death, and keep idle workers from timing out."""
        while not self._stopping.wait(_WATCH_INTERVAL_S):
            if exited := _exited_ranks(self._procs):
                self._mark_dead(self._peer_fault() or exited)
                return
            if time.monotonic() - self._last_sent >= _PING_INTERVAL_S:
                self._ping()

    def _ping(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # a step is running, which keeps the workers busy
        try:
            if self._dead_reason is None and not self._stopping.is_set():
                distributed.broadcast_object((_PING, None))
                self._last_sent = time.monotonic()
        except CollectiveError as exc:
            self._mark_dead(self._reason(exc))
        finally:
            self._lock.release()


# -- every rank ----------------------------------------------------------------------------------------


def init_rank(
    config: EngineConfig,
    eos_token_ids: frozenset[int],
    launch: LaunchEnv,
    store: Store | None = None,
    procs: list[subprocess.Popen[bytes]] | None = None,
) -> tuple[Worker, int, int]:
    """Join the process groups and build this rank's worker: (worker, KV blocks, CPU blocks). `procs`,
    the ranks this process started, fail the rendezvous as soon as one exits."""
    config = _rank_config(config, launch)
    join = functools.partial(
        distributed.init_tensor_parallel,
        launch,
        distributed.backend_for(config.device),
        STEP_TIMEOUT_S,
        STARTUP_TIMEOUT_S,
        store,
    )
    if procs:
        _unless_a_rank_exits(procs, join)
    else:
        join()
    # Past the rendezvous a dead rank's closed sockets fail the start-up agreement at once.
    return build_worker(config, eos_token_ids)


def _unless_a_rank_exits(procs: list[subprocess.Popen[bytes]], fn: Callable[[], T]) -> T:
    """fn() on a helper thread while this one watches `procs`. A rank that dies in the rendezvous after
    its started key leaves the others waiting for its address in the store up to STARTUP_TIMEOUT_S,
    and no wait in torch.distributed can be interrupted: raise StartupError as soon as a rank exits,
    leaving the helper to its wait (a daemon thread, which does not keep the process alive)."""
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:  # handed to the waiting thread
            done.set_exception(exc)

    threading.Thread(target=run, name="pagedserve-tp-rendezvous", daemon=True).start()
    while not wait_futures([done], timeout=_WATCH_INTERVAL_S).done:
        if exited := _exited_ranks(procs):
            # a rendezvous that completed just now ends at once, and the caller releases its groups
            wait_futures([done], timeout=1.0)
            raise StartupError(f"tensor-parallel start-up failed: {exited}")
    return done.result()


def _rank_config(config: EngineConfig, launch: LaunchEnv) -> EngineConfig:
    """One GPU per local rank; on CPU, the cores shared among the local ranks."""
    if config.device.startswith("cuda"):
        torch.cuda.set_device(launch.local_rank)
        return replace(config, device=f"cuda:{launch.local_rank}")
    # oversubscribed cores make every rank wait on the slowest at each all-reduce
    torch.set_num_threads(max(1, default_num_threads() // launch.local_world_size))
    return config


def run_worker(
    config: EngineConfig, eos_token_ids: frozenset[int], launch: LaunchEnv, store: Store | None = None
) -> int:
    """Rank k > 0: run rank 0's plans until it says stop (exit code 0) or is gone (1)."""
    try:
        worker, _, _ = init_rank(config, eos_token_ids, launch, store)
        logger.info("tensor-parallel rank %d of %d ready", launch.rank, launch.world_size)
        _serve_plans(worker)
        return 0
    except EngineDeadError as exc:
        logger.error("tensor-parallel rank %d stops: %s", launch.rank, exc)
        return 1
    finally:
        distributed.destroy_tensor_parallel()


def _serve_plans(worker: Worker) -> None:
    num_steps = 0  # as rank 0 counts them
    while True:
        kind, plan = distributed.broadcast_object()
        if kind == _STOP:
            return
        if kind == _STEP:
            num_steps += 1
            _execute(worker, plan, num_steps)
        if kind == _LOGS:
            logs.switch(plan)
            logger.debug("log switches now %s", plan)
        if kind == _LORA:
            try:
                _apply_lora(worker, plan)
            except ValueError as exc:  # rank 0 has the same files, and reports the same error
                logger.warning("LoRA change %s failed: %s", plan[:2], exc)


def _apply_lora(worker: Worker, change: tuple[str, ...]) -> None:
    """("load", name, path) or ("unload", name)."""
    if change[0] == "load":
        worker.load_lora(change[1], change[2])
    else:
        worker.unload_lora(change[1])


def _execute(worker: Worker, plan: SchedulerOutput, step: int) -> None:
    try:
        _run_step(worker, plan, step)
    except EngineDeadError:
        raise
    except Exception:  # raised on every rank alike: rank 0 fails the same batch and goes on, so does this one
        logger.exception("model step failed")


def _run_step(worker: Worker, plan: SchedulerOutput, step: int) -> ModelRunnerOutput:
    """worker.execute(plan), the `step`-th plan. An ordinary exception from it is raised again when
    every rank's step raised after the same collectives (the ranks are still in step), else
    `OutOfStepError`."""
    entered = distributed.num_collectives()
    try:
        return worker.execute(plan)
    except EngineDeadError:
        raise
    except Exception as exc:
        if reason := _agree_on_fault(step, distributed.num_collectives() - entered, exc):
            logger.error("model step %d failed, and the ranks are out of step", step, exc_info=exc)
            raise OutOfStepError(reason) from exc
        raise


def _agree_on_fault(step: int, num_collectives: int, exc: Exception) -> str:
    """Report this rank's fault in step `step` and wait up to `_FAULT_WAIT_S` for every other rank's
    report of it: '' when every rank's step raised after the same number of collectives, else why
    the ranks are out of step. A rank whose step did not raise is in a collective that this one
    will never enter (or waits for the next plan, rank 0 being in one), so its report never comes."""
    distributed.report_step_fault(step, num_collectives, repr(exc))
    world_size = distributed.get_tp_size()
    deadline = time.monotonic() + _FAULT_WAIT_S
    while len(faults := [f for f in distributed.step_faults() if f.step == step]) < world_size:
        if time.monotonic() > deadline:
            return _out_of_step(step, faults, world_size)
        time.sleep(0.05)
    if len({f.num_collectives for f in faults}) > 1:
        return _out_of_step(step, faults, world_size)
    return ""


def _out_of_step(step: int, faults: list[StepFault], world_size: int) -> str:
    """e.g. "tensor-parallel step 7 failed on rank 1 but not on rank 0: RuntimeError('...')"."""
    failed = [f.rank for f in faults]
    if len(failed) < world_size:
        where = f"on {_ranks(failed)} but not on {_ranks([r for r in range(world_size) if r not in failed])}"
    else:
        counts = ", ".join(f"rank {f.rank} after {f.num_collectives}" for f in faults)
        where = f"on every rank, but after different numbers of collectives ({counts})"
    errors = faults[0].error if len(faults) == 1 else "; ".join(f"rank {f.rank}: {f.error}" for f in faults)
    return f"tensor-parallel step {step} failed {where}: {errors}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def run_launched_worker(config: EngineConfig, eos_token_ids: frozenset[int], launch: LaunchEnv) -> NoReturn:
    """A launcher's rank k > 0 serves plans, then ends the process: whatever called the engine (a
    server, a script) must not go on as if it were rank 0. os._exit, because a SystemExit raised in
    an engine thread would end only that thread."""
    code = run_worker(config, eos_token_ids, launch)
    if code != 0:
        # A launcher's agent stops every rank once one has failed: rank 0, whose output the operator
        # reads (`pagedserve generate`'s one-line error, a server's log), gets this long to say what
        # failed first; it exits at once itself, and its agent then stops this one.
        time.sleep(_LAUNCHED_FAULT_GRACE_S)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# -- ranks this process starts ---------------------------------------------------------------------


def _local_launch(rank: int, world_size: int) -> LaunchEnv:
    return LaunchEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)


def _spawn_ranks(
    config: EngineConfig, eos_token_ids: frozenset[int], store_port: int
) -> list[subprocess.Popen[bytes]]:
    """Ranks 1..N-1 as fresh interpreters (not fork: this process already runs torch threads). They
    rendezvous through rank 0's store, given explicitly: `env://` would prefix its keys."""
    tp = config.parallel.tensor_parallel_size
    # the same import path as this process, as multiprocessing's spawn does
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs: list[subprocess.Popen[bytes]] = []
    with spawning() as spawned:
        for rank in range(1, tp):
            args = _SpawnArgs(config, eos_token_ids, _local_launch(rank, tp), store_port)
            proc = subprocess.Popen(
                [sys.executable, "-m", "pagedserve.worker.spawned_rank", str(os.getpid())],
                stdin=subprocess.PIPE,
                env=env,
            )
            spawned.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(args))
            proc.stdin.close()
            procs.append(proc)
    return procs


def _check_local_devices(device: str, tp: int) -> None:
    if device.startswith("cuda") and torch.cuda.device_count() < tp:
        raise ValueError(
            f"tensor_parallel_size: {tp} ranks on this machine need {tp} GPUs, "
            f"{torch.cuda.device_count()} are visible (use torchrun to span several machines)"
        )


def _started_key(rank: int) -> str:
    return f"pagedserve/started/{rank}"


def _wait_started(store: TCPStore, procs: list[subprocess.Popen[bytes]]) -> None:
    """Until every rank has reached its rendezvous: a rank that fails to start (a bad environment,
    an import error) fails start-up at once instead of after the rendezvous timeout."""
    keys = [_started_key(rank) for rank in range(1, len(procs) + 1)]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not store.check(keys):
        if exited := _exited_ranks(procs):
            raise StartupError(f"tensor-parallel start-up failed: {exited} (its error is in the log above)")
        if time.monotonic() > deadline:
            raise StartupError(f"tensor-parallel ranks did not start within {STARTUP_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _exited_ranks(procs: list[subprocess.Popen[bytes]]) -> str:
    """'' while every rank runs, else which ranks exited and how."""
    return "; ".join(
        f"tensor-parallel rank {rank} (pid {proc.pid}) {describe_exit(proc.returncode)}"
        for rank, proc in enumerate(procs, start=1)
        if proc.poll() is not None
    )


def spawned_rank_main() -> int:
    """A rank started by `_spawn_ranks` (pagedserve/worker/spawned_rank.py runs it)."""
    # Ctrl-C in a terminal signals the whole foreground process group, this rank too: rank 0 drains
    # (or stops starting) and then stops this rank, which must not die of a KeyboardInterrupt first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args: _SpawnArgs = pickle.load(sys.stdin.buffer)
    logs.configure_from_environment(f"rank {args.launch.rank}")
    store = distributed.connect_store("127.0.0.1", args.store_port, STARTUP_TIMEOUT_S)
    store.set(_started_key(args.launch.rank), "1")
    return run_worker(args.config, args.eos_token_ids, args.launch, store)
