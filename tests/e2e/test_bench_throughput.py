"""bench/throughput.py, the instrument of the offline throughput and KV-memory targets, run as its README
runs it, on the tiny model so that a run takes seconds: every peer generates the same forced tokens,
and the KV figures are the paged layout's against the contiguous ones at the same step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "throughput.py"

pytestmark = pytest.mark.slow


def test_every_peer_generates_the_same_tokens_and_paging_holds_more_real_tokens(
    tiny_llama_dir: str, tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    command = [sys.executable, str(BENCH), "--model", tiny_llama_dir, "--num-requests", "4"]
    done = subprocess.run(
        [*command, "--json-out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    peers = {row["peer"]: row for row in report["results"]}
    assert set(peers) == {"pagedserve", "hf-sequential", "hf-static", "hf-continuous"}
    for row in peers.values():
        assert row["available"], row
        assert row["num_output_tokens"] == 16 + 32 + 64 + 128  # the chat workload's forced lengths
        assert row["tokens_per_s"] == pytest.approx(row["num_output_tokens"] / row["seconds"])
    for name in ("hf-sequential", "hf-static", "hf-continuous"):  # the table's ratio column
        ratio = peers["pagedserve"]["tokens_per_s"] / peers[name]["tokens_per_s"]
        assert f"| {name} | 240 |" in done.stdout and f"| {ratio:.2f}x |" in done.stdout
    peak = report["kv_peak"]
    # paged: the blocks in use hold the live tokens (a shared prefix once), less than a block's slack
    # a sequence; contiguous reservations of prompt + max_tokens a request hold more empty slots
    assert peak["num_filled_slots"] <= peak["num_used_blocks"] * peak["block_size"]
    assert peak["num_filled_slots"] / (peak["num_used_blocks"] * peak["block_size"]) > (
        peak["num_sequence_tokens"] / peak["num_reserved_exact"]
    )
    assert peak["num_reserved_exact"] <= peak["num_reserved_batch_max"] <= peak["num_reserved_model_len"]
