"""bench/decode_roofline.py, the instrument of issue 7's GPU item (decode step time against the
memory-bandwidth limit), run here on CPU with its tiny preset: its byte count is the checkpoint's,
every timed step is a decode step of the whole batch, and the limit is the bytes over the peak given."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "decode_roofline.py"


def roofline() -> ModuleType:
    spec = importlib.util.spec_from_file_location("decode_roofline", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_weights_a_step_reads_are_every_tensor_of_the_checkpoint(
    tmp_path: Path, default_model_dir: str
) -> None:
    """A tied checkpoint's tensors are the embedding (the LM head too), the layers and the norms:
    what `Shape.weight_elements` counts from the config alone; KV elements a token, K and V in every layer."""
    from safetensors import safe_open

    bench = roofline()
    path = Path(bench.build_preset("tiny", tmp_path, default_model_dir))
    shape = bench.Shape.of(json.loads((path / "config.json").read_text()))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = f.keys()  # a safetensors file, not a dict
        stored = sum(math.prod(f.get_slice(name).get_shape()) for name in names)
    assert shape.weight_elements() == stored
    assert shape.kv_elements_per_token() == 2 * 2 * 2 * 16  # K and V, 2 layers, 2 KV heads of 16
    # 2 sequences of 10 and 12 tokens, bf16: weights, 2 embedding rows, 22 tokens read + 2 written
    expected = (stored + 2 * 64 + (22 + 2) * 128) * 2
    assert bench.step_bytes(shape, [10, 12], 2, 1) == expected
    assert bench.build_preset("tiny", tmp_path, default_model_dir) == str(path)  # built once


@pytest.mark.slow
def test_a_cpu_run_times_whole_batch_decode_steps_against_the_given_peak(tmp_path: Path) -> None:
    out = tmp_path / "roofline.json"
    flags = "--device cpu --preset tiny --batch-sizes 1 4 --context 40 --warmup 1 --steps 3 --max-tokens 16"
    flags += f" --peak-gbps 10 --enforce-eager --cache-dir {shlex.quote(str(tmp_path))} --json-out {shlex.quote(str(out))}"
    command = [sys.executable, str(BENCH), *shlex.split(flags)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["peak_gbps"] == 10 and report["device"] == "cpu"
    rows = report["rows"]
    assert [row["batch"] for row in rows] == [1, 4]
    bench = roofline()
    shape = bench.Shape(**report["shape"])
    for row in rows:
        # one prefill step (the first token out), one warm-up step, then steps with 2, 3 and 4 tokens
        # out: their mean is the middle one's bytes (the count is linear in the context)
        assert row["bytes_per_step"] == bench.step_bytes(shape, [40 + 3] * row["batch"], 2, 1), row
        assert row["step_ms"] > 0
        assert row["limit_ms"] == pytest.approx(row["bytes_per_step"] / 10e9 * 1e3)
        assert row["achieved_gbps"] == pytest.approx(row["bytes_per_step"] / row["step_ms"] / 1e6)
        assert f"| {row['batch']} | 40 | {row['step_ms']:.3f} |" in done.stdout


@pytest.mark.slow
def test_a_batch_the_kv_cache_cannot_hold_is_refused_before_the_batches_run(tmp_path: Path) -> None:
    """Eight sequences of a 1,000-token prompt, a token for each of the 4 prefill steps, the warm-up's
    and the 3 timed: 8 x 126 blocks of 8; a 1 MiB cache of the tiny preset (256 bytes a token) holds
    512. Running it anyway preempted sequences, and the timed steps then served part of the batch
    (with a message that asked for --max-tokens, which does not help), after the smaller batches had
    run for minutes on a real model and their rows were lost."""
    flags = "--device cpu --preset tiny --batch-sizes 1 8 --context 1000 --warmup 1 --steps 3 --max-tokens 16"
    flags += (
        f" --peak-gbps 10 --enforce-eager --kv-cache-memory 1MiB --cache-dir {shlex.quote(str(tmp_path))}"
    )
    command = [sys.executable, str(BENCH), *shlex.split(flags)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    # blocks of 8 where the C++ CPU kernels build (the CPU default), of 16 where they do not
    blocks = re.search(
        r"batch 8: 8 sequences of up to 1008 tokens need (\d+) KV blocks of (\d+), the engine has (\d+)",
        done.stderr,
    )
    assert blocks is not None, done.stderr
    needed, block_size, available = map(int, blocks.groups())
    assert needed == 8 * math.ceil(1008 / block_size) and available * block_size * 256 == 2**20
    assert "--kv-cache-memory" in done.stderr and "| batch |" not in done.stdout


def test_a_preset_without_tokenizer_files_is_refused(tmp_path: Path) -> None:
    command = [sys.executable, str(BENCH), "--preset", "tiny", "--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(
        [*command, "--tokenizer-dir", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and f"--tokenizer-dir: no tokenizer.json in {tmp_path}" in done.stderr, (
        done.stderr
    )
    assert not (tmp_path / "cache").exists()


def test_bad_arguments_are_refused_with_the_flag_named() -> None:
    for args, flag in (
        (["--steps", "0"], "--steps"),
        (["--max-tokens", "5", "--steps", "5"], "--max-tokens"),
    ):
        done = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and flag in done.stderr, done.stderr
