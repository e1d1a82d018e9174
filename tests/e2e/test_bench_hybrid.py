"""bench/hybrid_model.py: the checkpoints it writes are what transformers' `save_pretrained` writes for
each hybrid (Granite 4.0-H's config.json with its time_step_limit's infinity saved as
{"__float__": "Infinity"}), and pagedserve serves them as transformers runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_bench_moe import assert_serves_transformers_tokens

BENCH = Path(__file__).resolve().parents[2] / "bench" / "hybrid_model.py"


@pytest.mark.slow
def test_a_written_granite4_h_checkpoint_serves_transformers_tokens(tmp_path: Path) -> None:
    dest = tmp_path / "granite4-h"
    run = subprocess.run(
        [sys.executable, str(BENCH), str(dest), "--architecture", "granite4-h"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "granite4-h: 133M parameters" in run.stdout
    config = json.loads((dest / "config.json").read_text())
    assert config["architectures"] == ["GraniteMoeHybridForCausalLM"]
    assert config["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    assert_serves_transformers_tokens(dest)
