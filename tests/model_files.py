"""Model files made for tests of what `--model` and `--tokenizer` accept: a model directory without its
tokenizer, and a GGUF file of one tensor.

Kept out of conftest.py so tests import it by a name no other folder's conftest shares.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tiny_models import TOKENIZER_FILES


def model_without_tokenizer(model_dir: str, dest: Path) -> str:
    """The weights (linked) and the configs of `model_dir`, none of its tokenizer files."""
    dest.mkdir()
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            (dest / name).symlink_to(Path(model_dir) / name)
        elif name in ("config.json", "generation_config.json"):
            shutil.copy(Path(model_dir) / name, dest / name)
    assert not any((dest / name).exists() for name in TOKENIZER_FILES)
    return str(dest)


def write_gguf(path: Path, architecture: str, values: list[float]) -> Path:
    """A GGUF file of one tensor: enough for everything before a conversion."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch=architecture)
    writer.add_tensor("token_embd.weight", np.array(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
