"""Which safetensors files a model directory's weights come from: as transformers picks them (the
index's shards, else model.safetensors), so the other copies a whole-repository download brings
along (Mistral's consolidated.safetensors, in the model's native tensor names) are left alone
instead of failing the load with a KeyError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pagedserve import LLM, SamplingParams
from safetensors.torch import load_file, save_file

PROMPT = [1, 500, 600, 700, 800, 900]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def greedy_tokens(model_dir: Path) -> list[int]:
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=16, block_size=16)
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def copy_without_weights(src: str, dest: Path) -> dict:
    """`dest` with the config and tokenizer of `src`; returns `src`'s tensors."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    return load_file(str(Path(src) / "model.safetensors"))


def native_copy(tensors: dict) -> dict:
    """The same tensors under names the model does not know, as a consolidated.safetensors has them."""
    return {name.replace("model.", "native.", 1): tensor.clone() for name, tensor in tensors.items()}


def shard(tensors: dict, dest: Path) -> None:
    """Two shards and the index that names them."""
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(dest / file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in halves.items() for n in part}
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: str) -> list[int]:
    return greedy_tokens(Path(tiny_llama_dir))


def test_a_consolidated_copy_beside_model_safetensors_is_left_alone(
    tiny_llama_dir: str, tmp_path: Path, expected: list[int]
) -> None:
    tensors = copy_without_weights(tiny_llama_dir, tmp_path / "m")
    shutil.copy(Path(tiny_llama_dir) / "model.safetensors", tmp_path / "m")
    save_file(native_copy(tensors), str(tmp_path / "m" / "consolidated.safetensors"))
    assert greedy_tokens(tmp_path / "m") == expected


def test_a_sharded_checkpoint_loads_the_shards_its_index_names(
    tiny_llama_dir: str, tmp_path: Path, expected: list[int]
) -> None:
    tensors = copy_without_weights(tiny_llama_dir, tmp_path / "m")
    shard(tensors, tmp_path / "m")
    save_file(native_copy(tensors), str(tmp_path / "m" / "consolidated.safetensors"))
    assert greedy_tokens(tmp_path / "m") == expected


def test_a_shard_the_index_names_but_is_missing_is_named(tiny_llama_dir: str, tmp_path: Path) -> None:
    tensors = copy_without_weights(tiny_llama_dir, tmp_path / "m")
    shard(tensors, tmp_path / "m")
    (tmp_path / "m" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="names model-00002-of-00002.safetensors, which is not in"):
        greedy_tokens(tmp_path / "m")


@pytest.mark.parametrize(
    "stranger", ["native.embed_tokens.weight", "model.layers.9.self_attn.q_proj.weight"]
)  # the second is one of the stacked projections, loaded by another path
def test_a_weight_the_model_does_not_have_is_named(
    tiny_llama_dir: str, tmp_path: Path, stranger: str
) -> None:
    """Without an index or model.safetensors every *.safetensors is read: a stranger in them is an
    error that says which tensor, not a KeyError."""
    tensors = copy_without_weights(tiny_llama_dir, tmp_path / "m")
    save_file(tensors, str(tmp_path / "m" / "weights.safetensors"))
    save_file({stranger: tensors["lm_head.weight"]}, str(tmp_path / "m" / "extra.safetensors"))
    with pytest.raises(ValueError, match=f"checkpoint has a weight this model does not: '{stranger}'"):
        greedy_tokens(tmp_path / "m")
