"""Model files made for tests of what `--model` and `--tokenizer` accept: a model directory without its
tokenizer, a GGUF file of one tensor, and a GGUF file of a whole checkpoint as llama.cpp writes one.

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


def write_gguf(
    path: Path, architecture: str, values: list[float], tensor_name: str = "token_embd.weight"
) -> Path:
    """A GGUF file of one tensor: enough for everything before a conversion."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch=architecture)
    writer.add_tensor(tensor_name, np.array(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf_of(model_dir: str, path: Path, architecture: str, tokenizer_gguf: str) -> Path:
    """`model_dir`'s checkpoint as llama.cpp's convert_hf_to_gguf.py writes it, in float32: its tensors
    under GGUF's names (Llama's and Mistral's q and k rows permuted as llama.cpp stores them, for its
    interleaved rotary), its config as `<architecture>.*` keys, and the tokenizer of
    `tokenizer_gguf` (a GGUF file of the same vocabulary: the tiny models share the default model's)."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    num_heads, num_layers = config["num_attention_heads"], config["num_hidden_layers"]
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    writer = gguf.GGUFWriter(str(path), arch=architecture)
    writer.add_block_count(num_layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    writer.add_vocab_size(config["vocab_size"])
    for name, field in gguf.GGUFReader(tokenizer_gguf).fields.items():
        if name.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type)

    tensor_names_of = "llama" if architecture == "mistral" else architecture  # llama.cpp names them alike
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[tensor_names_of.upper()], num_layers)
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    for name, tensor in tensors.items():
        if architecture in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if name.endswith("q_proj.weight") else num_kv_heads
            tensor = tensor.reshape(heads, 2, -1, tensor.shape[1]).swapaxes(1, 2).reshape(tensor.shape)
        writer.add_tensor(
            names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(tensor)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
