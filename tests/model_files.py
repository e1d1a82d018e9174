"""Model files made for tests of what `--model` and `--tokenizer` accept: a model directory without its
tokenizer, a GGUF file of one tensor, and a GGUF file of a whole checkpoint as llama.cpp writes one.

Kept out of conftest.py so tests import it by a name no other folder's conftest shares.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

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
    under GGUF's names (Llama's q and k rows permuted as llama.cpp stores them, for its interleaved
    rotary), its config as `<architecture>.*` keys, and the tokenizer of
    `tokenizer_gguf` (the tiny models share the default model's), cut to the model's vocabulary: its
    first ids, and the merges among them (a whole tokenizer of 49,152 tokens takes transformers ~10 s
    to read and convert)."""
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
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    _add_rope_scaling(writer, config)
    fields = _tokenizer_fields(tokenizer_gguf)
    vocab = fields["tokenizer.ggml.tokens"][0][: config["vocab_size"]]
    kept = set(vocab)
    for name, (value, value_type, sub_type) in fields.items():
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = value[: len(vocab)]
        elif name == "tokenizer.ggml.merges":
            value = [m for m in value if all(p in kept for p in (*m.split(" "), m.replace(" ", "")))]
        writer.add_key_value(name, value, value_type, sub_type)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[architecture.upper()], num_layers)
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    for name, tensor in tensors.items():
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
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


@functools.cache
def _tokenizer_fields(tokenizer_gguf: str) -> dict[str, tuple[Any, Any, Any]]:
    """The `tokenizer.*` fields of a GGUF file, each as (contents, type, sub-type), read once a process:
    gguf's reader takes ~2 s of CPU over the default model's 49,152 tokens and 48,900 merges. (The
    contents are not to be changed: write_gguf_of cuts copies of them.)"""
    import gguf

    return {
        name: (field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
        for name, field in gguf.GGUFReader(tokenizer_gguf).fields.items()
        if name.startswith("tokenizer.")
    }


def _add_rope_scaling(writer: Any, config: dict[str, Any]) -> None:
    """A scaled rope as llama.cpp's convert_hf_to_gguf.py writes it: linear and YaRN as keys, Llama
    3.1's as one factor a frequency (`rope_freqs`, each frequency divided by it), Phi-3's LongRoPE as
    its long and short factors with its pretraining length and attention factor."""
    import math

    import gguf
    import numpy as np

    rope = config["rope_parameters"]
    if rope["rope_type"] in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
        if rope["rope_type"] == "yarn":
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if rope["rope_type"] == "llama3":
        base, factor = rope["rope_theta"], rope["factor"]
        old_len = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / rope["low_freq_factor"], old_len / rope["high_freq_factor"]
        factors = []
        for freq in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
            wavelen = 2 * math.pi / freq
            if wavelen < high_wavelen:
                factors.append(1.0)
            elif wavelen > low_wavelen:
                factors.append(factor)
            else:
                smooth = (old_len / wavelen - rope["low_freq_factor"]) / (
                    rope["high_freq_factor"] - rope["low_freq_factor"]
                )
                factors.append(1 / ((1 - smooth) / factor + smooth))
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    elif rope["rope_type"] == "longrope":
        old_len = config["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / old_len
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
        writer.add_rope_scaling_orig_ctx_len(old_len)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(old_len)))
