"""Stream tensors out of a Hugging Face directory's safetensors files (sharded or not), FP8 weights
dequantized (`models.fp8`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagedserve.config import fp8_layout
from pagedserve.models.fp8 import FP8_DTYPES, dequantized, left_out

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


def checkpoint_tensors(model_dir: str, hf: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors (`weight_files`) with FP8 weights dequantized to float32 and
    their scales and the activations' left out; a float8 tensor in a checkpoint whose config.json
    names no FP8 scheme, or one without its scale, refused naming it."""
    layout = fp8_layout(hf)
    with ExitStack() as stack:
        files = [
            stack.enter_context(safe_open(str(file), framework="pt")) for file in weight_files(model_dir)
        ]
        where = {name: f for f in files for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        for name, f in where.items():
            if layout is not None and left_out(name, where):
                continue
            tensor = f.get_tensor(name)
            if tensor.dtype in FP8_DTYPES:
                tensor = dequantized(name, tensor, where, layout)
            yield name, tensor
