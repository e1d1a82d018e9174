"""Stream tensors out of a Hugging Face directory's safetensors files (sharded or not)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def weight_files(model_dir: str) -> list[Path]:
    """The checkpoint's files, picked as transformers picks them: those its index names when it is
    sharded, else model.safetensors, and every *.safetensors only when there is neither. Model
    repositories carry other copies beside (Mistral's consolidated.safetensors, in the model's native
    names), which a download of the whole repository brings along."""
    root = Path(model_dir)
    if (root / INDEX_FILE).is_file():
        weight_map = json.loads((root / INDEX_FILE).read_text())["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ValueError(f"model: {INDEX_FILE} names {file.name}, which is not in {model_dir}")
        return files
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {model_dir}")
    return files


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in weight_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)
