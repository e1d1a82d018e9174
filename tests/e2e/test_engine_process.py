"""`serve --engine-process`: the engine steps in a process of its own and the front end stays in the
server's (engine/core_process.py). Over real gRPC, HTTP and processes: the greedy tokens are the
offline engine's; the front end refuses bad requests itself; /metrics counts what the engine process
did; a client's cancel frees its blocks there; the engine process killed fails every stream with
INTERNAL naming it and turns health NOT_SERVING (exit 1 to be restarted); a signal while it loads
leaves no engine process behind; and a launcher's rank refuses the flag. LoRA changes and the KV
event feed through an engine process are in test_grpc_lora_runtime.py and test_grpc_kv_events.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2
from grpc_helpers import ServerProcess, wait_until
from inprocess_server import InProcessServer, is_idle, parse_metrics, wait_for
from pagedserve.rpc.v1 import generate_pb2 as pb

pytestmark = pytest.mark.slow

PROMPTS = [[1, *range(300 + 7 * i, 330 + 7 * i)] for i in range(4)]
MAX_TOKENS = 16
NO_HANG_S = 30.0


@pytest.fixture(scope="module")
def srv(tiny_llama_dir: str) -> Iterator[InProcessServer]:
    server = InProcessServer(
        tiny_llama_dir,
        None,
        dtype="float32",
        served_model_name="tiny",
        num_kv_blocks=128,
        engine_process=True,
    ).start()
    yield server
    server.stop()


def request(request_id: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    params = pb.SamplingParameters(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt), sampling=params)


def test_the_engine_process_streams_the_offline_engines_tokens(
    srv: InProcessServer, tiny_llama_dir: str
) -> None:
    from pagedserve import LLM, SamplingParams

    process = psutil.Process(srv.llm.executor.pid)
    assert process.pid != os.getpid() and "pagedserve.engine.core_process" in process.cmdline()
    calls = [srv.stub.Generate(request(f"same-{i}", p), timeout=60) for i, p in enumerate(PROMPTS)]
    served = [[t for r in call for t in r.token_ids] for call in calls]  # all four ran at once
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128)
    offline = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert served == [list(out.outputs[0].token_ids) for out in offline]
    wait_for(lambda: is_idle(srv), what="the engine process idle")  # its stats, after its last pass


PAIR = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
}


def test_grammars_and_bad_words_reach_the_engine_process_while_it_steps(
    srv: InProcessServer, tiny_llama_dir: str
) -> None:
    """A JSON schema (compiled again on the engine process's grammar thread) and bad words (tokenized
    by the front end) sent while another stream runs: the offline engine's tokens for each."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.sampling_params import StructuredOutputsParams

    running = srv.stub.Generate(request("running", PROMPTS[0], max_tokens=200), timeout=60)
    first = list(next(running).token_ids)  # running (a writer behind the engine may merge its first tokens)
    assert first
    json_params = pb.SamplingParameters(
        temperature=0, max_tokens=40, structured_outputs=pb.StructuredOutputs(json=json.dumps(PAIR))
    )
    words_params = pb.SamplingParameters(
        temperature=0, max_tokens=12, ignore_eos=True, bad_words=["the", " a"]
    )
    calls = [
        srv.stub.Generate(
            pb.GenerateRequest(request_id=f"r{i}", token_ids=pb.TokenIds(ids=PROMPTS[i]), sampling=p)
        )
        for i, p in ((1, json_params), (2, words_params))
    ]
    served = [[t for r in call for t in r.token_ids] for call in calls]
    assert len(first) + len([t for r in running for t in r.token_ids]) == 200
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128)
    offline = [
        llm.generate(
            [PROMPTS[1]],
            SamplingParams(
                temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=PAIR)
            ),
        ),
        llm.generate(
            [PROMPTS[2]],
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=["the", " a"]),
        ),
    ]
    assert served == [list(out[0].outputs[0].token_ids) for out in offline]
    assert llm.engine.decode(served[0]).lstrip().startswith("{")  # (40 tokens of a random model's JSON)


def test_a_bad_request_is_refused_by_the_front_end_and_the_engine_serves_on(srv: InProcessServer) -> None:
    max_len = srv.llm.config.model.max_model_len
    with pytest.raises(grpc.RpcError) as info:
        list(srv.stub.Generate(request("too-long", PROMPTS[0], max_tokens=max_len), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("max_tokens: prompt (31 tokens) + max_tokens"), (
        info.value.details()
    )
    assert (
        len([t for r in srv.stub.Generate(request("after", PROMPTS[1]), timeout=60) for t in r.token_ids])
        == 16
    )


def test_metrics_count_what_the_engine_process_did(srv: InProcessServer) -> None:
    def samples() -> dict[str, float]:
        scraped = parse_metrics(urlopen_text(srv.http_url("/metrics")))
        labels = (("model_name", "tiny"),)
        return {
            name: scraped.get((name, labels), 0.0)
            for name in (
                "vllm:generation_tokens_total",
                "vllm:prompt_tokens_total",
                "vllm:num_requests_running",
            )
        }

    before = samples()
    assert (
        len(
            [t for r in srv.stub.Generate(request("counted", PROMPTS[2], 9), timeout=60) for t in r.token_ids]
        )
        == 9
    )
    after = samples()  # a pass's metric calls are replayed before its deltas are handed out
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 9
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == len(PROMPTS[2])
    assert after["vllm:num_requests_running"] == 0


def test_metrics_report_both_processes(srv: InProcessServer) -> None:
    """process_* are the front end's (here the test's own process), pagedserve_engine_process_* the
    engine process's: each start time is its process's, read by psutil."""
    scraped = parse_metrics(urlopen_text(srv.http_url("/metrics")))
    engine = psutil.Process(srv.llm.executor.pid)
    for prefix, process in (("process_", psutil.Process()), ("pagedserve_engine_process_", engine)):
        assert scraped[(prefix + "start_time_seconds", ())] == pytest.approx(process.create_time(), abs=1)
        assert scraped[(prefix + "resident_memory_bytes", ())] > 0
        assert scraped[(prefix + "cpu_seconds_total", ())] > 0


def urlopen_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as reply:
        return str(reply.read().decode())


def test_a_client_cancel_frees_the_request_in_the_engine_process(srv: InProcessServer) -> None:
    llm = srv.llm
    labels = {"model_name": "tiny", "cause": "client_cancel"}
    cancels = llm.metrics.registry.get_sample_value("pagedserve:request_aborts_total", labels) or 0.0
    call = srv.stub.Generate(request("cancelled", PROMPTS[3], max_tokens=400), timeout=60)
    assert next(call).token_ids  # running (a writer behind the engine may merge its first tokens)
    wait_for(lambda: llm.stats().num_running == 1, what="the request running in the engine process")
    assert llm.has_unfinished_requests()  # the engine process's answer, not the face's idle scheduler
    call.cancel()
    wait_for(lambda: is_idle(srv), what="its blocks freed in the engine process")
    assert not llm.has_unfinished_requests()
    assert llm.metrics.registry.get_sample_value("pagedserve:request_aborts_total", labels) == cancels + 1


def test_a_killed_engine_process_fails_every_stream_and_turns_health_not_serving(
    tiny_llama_dir: str, tmp_path: Path
) -> None:
    """As a worker rank's death: every call ends INTERNAL within seconds naming the engine process's
    end, health leaves SERVING, and serve exits 1 to be restarted."""

    flags = ["--model", tiny_llama_dir, "--dtype", "float32", "--num-kv-blocks", "128", "--max-num-seqs", "2"]
    proc = ServerProcess(*flags, "--engine-process", log=tmp_path / "server.log").wait_ready()
    try:
        engine = engine_process_of(proc)
        assert engine is not None
        running = [
            proc.stub.Generate(request(f"r{i}", PROMPTS[i], max_tokens=900), timeout=60) for i in range(2)
        ]
        for call in running:
            assert next(call).token_ids  # running
        queued = proc.stub.Generate(request("queued", PROMPTS[2], max_tokens=900), timeout=60)
        assert wait_until(
            lambda: proc.stub.Health(pb.HealthRequest(), timeout=10).num_waiting == 1, NO_HANG_S
        )
        engine.kill()
        for call in [*running, queued]:
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "the engine process was killed by SIGKILL" in (info.value.details() or "")
        assert wait_until(lambda: proc.readiness() != health_pb2.HealthCheckResponse.SERVING, NO_HANG_S)
        assert proc.proc.wait(timeout=NO_HANG_S) == 1  # for the orchestrator to restart it
    finally:
        proc.stop()


def test_a_signal_while_the_engine_process_loads_leaves_no_engine_process_behind(
    default_model_dir: str, tmp_path: Path
) -> None:
    proc = ServerProcess(
        "--model", default_model_dir, "--dtype", "float32", "--engine-process", log=tmp_path / "server.log"
    )
    try:
        assert wait_until(lambda: engine_process_of(proc) is not None or proc.proc.poll() is not None, 120)
        engine = engine_process_of(proc)
        assert engine is not None, proc.log.read_text()[-3000:]
        assert proc.readiness() != health_pb2.HealthCheckResponse.SERVING
        proc.proc.send_signal(signal.SIGTERM)
        code = proc.proc.wait(timeout=60)
        # stopped on the way out (it stops its ranks and exits): left alone it would go on loading
        # for seconds before finding its front end gone
        assert wait_until(lambda: not alive(engine), 2), f"engine process {engine.pid} still runs"
    finally:
        proc.stop()
    log = proc.log.read_text()
    assert code == 0, log[-3000:]
    assert "signalled while starting (loading the model)" in log and "Traceback" not in log, log[-3000:]


def engine_process_of(proc: ServerProcess) -> psutil.Process | None:
    return next(iter(proc.processes_running("pagedserve.engine.core_process")), None)


def alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_launchers_rank_refuses_the_flag(tiny_llama_dir: str) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    }
    stderr = refused_at_start(tiny_llama_dir, env={**env, "WORLD_SIZE": "2", "RANK": "0"})
    assert "pagedserve serve: error: --engine-process: not under a launcher (torchrun)" in stderr


def refused_at_start(tiny_llama_dir: str, *flags: str, env: dict[str, str] | None = None) -> str:
    """`serve --engine-process` with `flags` exits 2 without a traceback: its stderr."""
    command = [sys.executable, "-m", "pagedserve", "serve", "--model", tiny_llama_dir, "--port", "0"]
    done = subprocess.run(
        [*command, "--http-port", "-1", "--engine-process", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stderr


def serve_with_engine_process(tiny_llama_dir: str, log: Path) -> ServerProcess:
    flags = ["--model", tiny_llama_dir, "--dtype", "float32", "--num-kv-blocks", "128", "--engine-process"]
    return ServerProcess(*flags, log=log).wait_ready()


@pytest.mark.parametrize("group", [False, True], ids=["server", "group"])
def test_sigterm_drains_the_streams_then_stops_the_engine_process(
    tiny_llama_dir: str, tmp_path: Path, group: bool
) -> None:
    """`pagedserve serve --engine-process` as an orchestrator stops it: the stream in flight ends whole,
    serve exits 0, and its engine process is gone with it. Also when the engine process gets the
    SIGTERM too (systemd's stop signals every process of the service): it used to die of it at once,
    failing the stream the front end was draining."""
    proc = serve_with_engine_process(tiny_llama_dir, tmp_path / "server.log")
    try:
        engine = engine_process_of(proc)
        assert engine is not None
        call = proc.stub.Generate(request("drained", PROMPTS[0], max_tokens=300), timeout=60)
        first = next(call)
        if group:
            engine.terminate()
        proc.proc.terminate()
        rest = list(call)
        assert rest[-1].finish_reason == pb.LENGTH
        assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 300
        assert proc.proc.wait(timeout=60) == 0
        assert wait_until(lambda: not alive(engine), 10), f"engine process {engine.pid} still runs"
    finally:
        proc.stop()
    assert "Traceback" not in proc.log.read_text()


def test_an_engine_process_whose_server_was_killed_exits(tiny_llama_dir: str, tmp_path: Path) -> None:
    """SIGKILL leaves the server no time to stop it: the engine process finds its connection closed
    (idle, within its 0.2 s poll; stepping, at its next send) and exits rather than hold the memory."""
    proc = serve_with_engine_process(tiny_llama_dir, tmp_path / "server.log")
    try:
        engine = engine_process_of(proc)
        assert engine is not None
        call = proc.stub.Generate(request("orphaned", PROMPTS[1], max_tokens=900), timeout=60)
        next(call)  # stepping
        proc.proc.kill()
        assert wait_until(lambda: not alive(engine), 20), f"engine process {engine.pid} still runs"
    finally:
        proc.stop()


def test_a_setting_only_the_engine_can_check_exits_2_naming_it(tiny_llama_dir: str) -> None:
    """The engine process raises it while it builds the engine; the front end reports it as the engine
    on the server's thread would have."""
    stderr = refused_at_start(tiny_llama_dir, "--kv-cache-memory", "1KiB")
    assert "pagedserve serve: error: --kv-cache-memory: 1024 bytes is less than one KV block" in stderr


def test_tensor_parallel_ranks_under_the_engine_process(tiny_llama_dir: str, tmp_path: Path) -> None:
    """--tensor-parallel-size 2: the engine process is rank 0 and starts rank 1 itself; the tokens are
    the offline engine's (one rank), and SIGTERM leaves neither process behind."""
    from pagedserve import LLM, SamplingParams

    flags = ["--model", tiny_llama_dir, "--dtype", "float32", "--num-kv-blocks", "128", "--engine-process"]
    proc = ServerProcess(*flags, "--tensor-parallel-size", "2", log=tmp_path / "server.log").wait_ready()
    try:
        engine = engine_process_of(proc)
        assert engine is not None
        ranks = proc.rank_processes()
        assert len(ranks) == 1 and ranks[0].ppid() == engine.pid  # started by the engine process
        assert proc.stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).tensor_parallel_size == 2
        served = [t for r in proc.stub.Generate(request("tp", PROMPTS[0]), timeout=60) for t in r.token_ids]
        proc.proc.terminate()
        assert proc.proc.wait(timeout=60) == 0
        assert wait_until(lambda: not alive(engine) and not alive(ranks[0]), 20)
    finally:
        proc.stop()
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128)
    offline = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    assert served == list(offline[0].outputs[0].token_ids)


def test_the_front_end_starts_and_serves_without_torch(tiny_llama_dir: str, tmp_path: Path) -> None:
    """The engine process resolves the engine's configuration (the device: torch) and loads the
    tokenizer (transformers' model configurations: torch), then hands both to the front end, which
    imports no torch: a second less of start-up and torch's hundreds of MB less in it. It still
    tokenizes, detokenizes and applies the chat template."""
    proc = serve_with_engine_process(tiny_llama_dir, tmp_path / "server.log")
    try:
        engine = engine_process_of(proc)
        assert engine is not None
        front_end = psutil.Process(proc.proc.pid)

        def maps_torch(process: psutil.Process) -> bool:
            return any("libtorch" in m.path for m in process.memory_maps())

        assert maps_torch(engine) and not maps_torch(front_end)
        params = pb.SamplingParameters(temperature=0, max_tokens=8, ignore_eos=True)
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Name a colour.")])
        for prompt in ({"text": "The capital of France is"}, {"messages": chat}):
            responses = list(proc.stub.Generate(pb.GenerateRequest(sampling=params, **prompt), timeout=60))
            assert sum(len(r.token_ids) for r in responses) == 8 and "".join(r.text for r in responses)
        assert not maps_torch(front_end)
    finally:
        proc.stop()


def test_a_tokenizer_the_front_end_cannot_unpickle_is_loaded_there(
    tiny_llama_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine process hands its tokenizer to the front end (EngineProcess.receive_handover) rather
    than have it load one again; one that does not unpickle there (its class's state refused) is said
    not to, and the front end loads its own: it detokenizes, and stops at a stop string, as the offline
    engine does. (One the engine process cannot pickle: test_core_process.py.)"""
    from pagedserve import LLM, SamplingParams
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    def refuse_once(self: object, state: object) -> None:
        del TokenizersBackend.__setstate__  # (the front end's own load, a copy, then goes through)
        raise RuntimeError("this state is not taken here")

    TokenizersBackend.__setstate__ = refuse_once  # type: ignore[attr-defined]
    try:
        server = InProcessServer(
            tiny_llama_dir, None, dtype="float32", num_kv_blocks=128, engine_process=True
        ).start()
    finally:
        if "__setstate__" in vars(TokenizersBackend):  # (the server failed before unpickling it)
            del TokenizersBackend.__setstate__
    try:
        assert any(
            "tokenizer does not unpickle (RuntimeError: this state is not taken here)" in r.getMessage()
            for r in caplog.records
        )
        assert isinstance(server.llm.tokenizer, TokenizersBackend)
        prompt, max_tokens = "The capital of France is", 24
        llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128)
        offline = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0]
        stop = offline.text[len(offline.text) // 2 :][:4]
        cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, stop=[stop]))[0]
        for stops, expected in (([], offline.text), ([stop], cut.outputs[0].text)):
            params = pb.SamplingParameters(temperature=0, max_tokens=max_tokens, stop=stops)
            call = server.stub.Generate(pb.GenerateRequest(text=prompt, sampling=params), timeout=60)
            assert "".join(r.text for r in call) == expected
        assert cut.outputs[0].finish_reason == "stop"
    finally:
        server.stop()
