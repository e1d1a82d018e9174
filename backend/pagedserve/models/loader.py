"""Stream tensors out of a Hugging Face directory's safetensors files (sharded or not), quantized
weights dequantized (`models.fp8`, `models.int_weights`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagedserve.config import Fp8Layout, IntLayout, quantized_layout
from pagedserve.models import fp8, int_weights

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
    """A checkpoint's tensors (`weight_files`), quantized weights dequantized to float32 as
    config.json's quantization_config stores them (`models.fp8`, `models.int_weights`), the tensors
    read with them left out; a float8 tensor in a checkpoint whose config.json names no FP8 scheme
    refused naming it."""
    layout = quantized_layout(hf)
    with ExitStack() as stack:
        files = [
            stack.enter_context(safe_open(str(file), framework="pt")) for file in weight_files(model_dir)
        ]
        where = {name: f for f in files for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        if isinstance(layout, Fp8Layout):
            yield from fp8.dequantized_tensors(where, layout)
        elif isinstance(layout, IntLayout):
            yield from int_weights.dequantized_tensors(where, layout)
        else:
            for name, f in where.items():
                tensor = f.get_tensor(name)
                if tensor.dtype in fp8.FP8_DTYPES:
                    raise ValueError(
                        f"model: {name!r} is {tensor.dtype} but config.json's quantization_config names no FP8 scheme"
                    )
                yield name, tensor
