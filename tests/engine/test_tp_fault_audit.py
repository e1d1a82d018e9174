"""A model step that raises an ordinary exception (not a failed collective) on a tensor-parallel engine,
on CPU with gloo: on every rank alike it fails only that batch, and the engine goes on with outputs
equal to a single-rank engine's; on one rank only it fails the engine within seconds with an
`EngineDeadError` naming the step, the rank and its error, and leaves no rank process behind.

What one rank alone failing did before: the ranks fell out of step, each waiting in a different
collective (rank 0 in the next plan's broadcast, or in the all-reduce the failed rank skipped) until
the 120 s step timeout; the engine then died naming neither the rank that failed nor its error.

The fault is real code raising in `Worker.execute` on the ranks a test names, for a plan that starts a
request holding a marker token: in this process (rank 0) by monkeypatch, in the ranks it starts
(fresh interpreters, given this process's sys.path) by a sitecustomize.py first on that path, and
under torchrun in every rank through PYTHONPATH. Rank 0's step timeout here is STEP_TIMEOUT_S, so
that the behaviour before the fix fails these tests in bounded time too."""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pagedserve import LLM
from pagedserve.distributed import get_tp_size
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import EngineDeadError
from pagedserve.worker import multiproc_executor
from pagedserve.worker.worker import Worker
from test_tensor_parallel import assert_all_exited, greedy, running

STEP_TIMEOUT_S = 30.0  # rank 0's: well past the few seconds a fault now takes, well short of 120 s
MAX_TOKENS = 24
PROMPTS = [[1, *range(300, 340)], [1, 2, 3, 4, 5], [1, *range(700, 713)]]
EVERY_RANK, RANK_0, RANK_1 = 4242, 4243, 4244  # marker tokens, none in PROMPTS
FAULTS = {EVERY_RANK: {0, 1}, RANK_0: {0}, RANK_1: {1}}
SITECUSTOMIZE = """from __future__ import annotations

from pagedserve.worker.worker import Worker

{source}
Worker.execute = inject_faults(Worker.execute, {faults!r})
"""


def inject_faults(execute: Callable[..., Any], faults: dict[int, set[int]]) -> Callable[..., Any]:
    """`Worker.execute` raising on the ranks `faults[token]` for a plan that starts a request holding
    `token`. Self-contained: its source is also planted in other processes."""
    from pagedserve.distributed import get_tp_rank

    def faulty_execute(self: Any, plan: Any) -> Any:
        started = {token for req in plan.scheduled if req.is_new for token in req.token_ids}
        for token in sorted(started & faults.keys()):
            if get_tp_rank() in faults[token]:
                raise RuntimeError(f"injected fault on rank {get_tp_rank()} at token {token}")
        return execute(self, plan)

    return faulty_execute


def plant_faults(site: Path, faults: dict[int, set[int]]) -> str:
    """A directory holding a sitecustomize.py that injects `faults` into every Python started with
    it on its path."""
    site.mkdir()
    source = inspect.getsource(inject_faults)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(source=source, faults=faults))
    return str(site)


@pytest.fixture
def faulty_ranks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """FAULTS in this process (rank 0) and in the ranks it starts from now on."""
    monkeypatch.syspath_prepend(plant_faults(tmp_path / "site", FAULTS))
    monkeypatch.setattr(Worker, "execute", inject_faults(Worker.execute, FAULTS))
    monkeypatch.setattr(multiproc_executor, "STEP_TIMEOUT_S", STEP_TIMEOUT_S)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str) -> list[list[int]]:
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=16)
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, greedy(MAX_TOKENS))]


def tensor_parallel_engine(tiny_llama_dir: str) -> LLMEngine:
    return LLM(
        model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=16, tensor_parallel_size=2
    ).engine


def run(engine: LLMEngine, requests: dict[str, list[int]], outputs: dict[str, list[int]]) -> dict[str, str]:
    """Add `requests` and step until the engine is idle; tokens go to `outputs`, errors are returned."""
    for request_id, prompt in requests.items():
        engine.add_request(request_id, prompt, greedy(MAX_TOKENS))
        outputs[request_id] = []
    errors = {}
    while engine.has_unfinished_requests() or engine.has_work():
        for delta in engine.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
            if delta.error:
                errors[delta.request_id] = delta.error
    return errors


def test_a_fault_on_every_rank_fails_its_batch_and_the_engine_goes_on(
    tiny_llama_dir: str, faulty_ranks: None, reference: list[list[int]]
) -> None:
    engine = tensor_parallel_engine(tiny_llama_dir)
    executor = engine.executor
    pids = executor.worker_pids  # type: ignore[attr-defined]
    rank_0_error = f"model step failed: RuntimeError('injected fault on rank 0 at token {EVERY_RANK}')"
    try:
        for attempt in range(2):  # a second fault after the first: the earlier reports confuse nothing
            outputs: dict[str, list[int]] = {}
            engine.add_request(f"early-{attempt}", PROMPTS[0], greedy(MAX_TOKENS))
            outputs[f"early-{attempt}"] = []
            for _ in range(3):
                for delta in engine.step():
                    outputs[delta.request_id].extend(delta.new_token_ids)
            errors = run(engine, {f"faulty-{attempt}": [1, EVERY_RANK, 5, 6]}, outputs)
            # the faulty request's batch fails with rank 0's error, as on one rank
            assert errors == {f"early-{attempt}": rank_0_error, f"faulty-{attempt}": rank_0_error}
            assert outputs[f"early-{attempt}"] == reference[0][:3]
            after = {f"after-{attempt}-{i}": prompt for i, prompt in enumerate(PROMPTS)}
            assert run(engine, after, outputs) == {}
            assert [outputs[request_id] for request_id in after] == reference
            assert running(pids) == pids
            executor.check_health()
        assert engine.stats().num_free_blocks == 64

        # and a later fault on one rank alone is told apart from the shared ones before it
        with pytest.raises(EngineDeadError) as dead:
            run(engine, {"alone": [1, RANK_1, 5, 6]}, {})
        assert re.fullmatch(
            rf"tensor-parallel step \d+ failed on rank 1 but not on rank 0: "
            rf"RuntimeError\('injected fault on rank 1 at token {RANK_1}'\)",
            str(dead.value),
        )
    finally:
        executor.shutdown()
    assert_all_exited(pids)
    assert get_tp_size() == 1


@pytest.mark.parametrize(("rank", "marker"), [(0, RANK_0), (1, RANK_1)])
def test_a_fault_on_one_rank_fails_the_engine_within_seconds(
    tiny_llama_dir: str, faulty_ranks: None, reference: list[list[int]], rank: int, marker: int
) -> None:
    engine = tensor_parallel_engine(tiny_llama_dir)
    executor = engine.executor
    pids = executor.worker_pids  # type: ignore[attr-defined]
    other = 1 - rank
    expected = (
        rf"tensor-parallel step \d+ failed on rank {rank} but not on rank {other}: "
        rf"RuntimeError\('injected fault on rank {rank} at token {marker}'\)"
    )
    outputs: dict[str, list[int]] = {}
    try:
        engine.add_request("early", PROMPTS[0], greedy(MAX_TOKENS))
        outputs["early"] = []
        for _ in range(3):
            for delta in engine.step():
                outputs["early"].extend(delta.new_token_ids)
        start = time.monotonic()
        with pytest.raises(EngineDeadError) as dead:
            run(engine, {"faulty": [1, marker, 5, 6]}, outputs)
            run(engine, {"after": PROMPTS[1]}, outputs)  # as a server would go on
        assert time.monotonic() - start < STEP_TIMEOUT_S  # not by a timeout
        assert re.fullmatch(expected, str(dead.value))
        # no token came out of the ranks once they were out of step
        assert outputs["early"] == reference[0][: len(outputs["early"])]
        assert not outputs.get("after")
        with pytest.raises(EngineDeadError, match=expected):  # and again at once
            engine.step()
        with pytest.raises(EngineDeadError, match=expected):
            executor.check_health()
        assert get_tp_size() == 1
    finally:
        executor.shutdown()
    assert_all_exited(pids)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_torchrun_a_fault_on_one_rank_fails_within_seconds(
    tiny_llama_dir: str, tmp_path: Path, rank: int
) -> None:
    """Every rank runs the same command, with the faults planted through PYTHONPATH: the rank that
    fails names itself, the step and its error, and the launch ends non-zero, without a timeout."""
    prompt = "The quick brown fox"
    single_rank = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    marker = single_rank.engine.encode_prompt(prompt)[-1]
    site = plant_faults(tmp_path / "site", {marker: {rank}})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, *(p for p in sys.path if p)])}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--log-dir", str(tmp_path / "torchrun"),
        "-m", "pagedserve", "generate", "--model", tiny_llama_dir, "--dtype", "float32",
        "--num-kv-blocks", "64", "--tensor-parallel-size", "2", "--no-chat", "--prompt", prompt,
        "--max-tokens", "16", "--temperature", "0",
    ]  # fmt: skip
    launch = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:  # the step timeout is 120 s in these processes: a launch that waited for it times out here
        _, stderr = launch.communicate(timeout=100)
    finally:
        if launch.poll() is None:  # the launcher and every rank
            os.killpg(launch.pid, signal.SIGKILL)
            launch.communicate()
    assert launch.returncode != 0
    assert (
        f"tensor-parallel step 1 failed on rank {rank} but not on rank {1 - rank}: "
        f"RuntimeError('injected fault on rank {rank} at token {marker}')"
    ) in stderr, stderr[-3000:]
    assert "Timed out" not in stderr
    # rank 0's `pagedserve generate` says it in one line
    one_line = r"^pagedserve generate: error: .*tensor-parallel step 1 failed"
    assert re.search(one_line, stderr, re.M), stderr[-3000:]
