"""bench/moe_model.py: the checkpoints it writes are what transformers' `save_pretrained` writes for
each mixture of experts (the hub's layout, a tensor per expert and projection), and pagedserve
serves them as transformers runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from pagedserve import LLM, SamplingParams

BENCH = Path(__file__).resolve().parents[2] / "bench" / "moe_model.py"


def test_a_written_checkpoint_serves_transformers_tokens(tmp_path: Path) -> None:
    """Mixtral's (the other layouts' hub files: test_model_config_audit's hub-layout test)."""
    from safetensors import safe_open

    architecture, class_name = "mixtral", "MixtralForCausalLM"
    expert_key = "model.layers.0.block_sparse_moe.experts.7.w2.weight"
    dest = tmp_path / architecture
    run = subprocess.run(
        [sys.executable, str(BENCH), str(dest), "--architecture", architecture, "--layers", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert f"{architecture}: " in run.stdout
    assert json.loads((dest / "config.json").read_text())["architectures"] == [class_name]
    [weights] = dest.glob("*.safetensors")
    with safe_open(str(weights), "pt") as tensors:
        assert expert_key in tensors.keys()  # noqa: SIM118 (safe_open has no __contains__)
    assert_serves_transformers_tokens(dest)


def assert_serves_transformers_tokens(dest: Path) -> None:
    """pagedserve's float32 greedy tokens of two prompts are transformers' on the checkpoint `dest`."""
    from transformers import AutoModelForCausalLM

    prompts = [[1, *range(300, 340)], [1, *range(900, 913)]]
    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = [
            model.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    llm = LLM(model=str(dest), dtype="float32", num_kv_blocks=64, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [r.outputs[0].token_ids for r in llm.generate(prompts, params)] == theirs
