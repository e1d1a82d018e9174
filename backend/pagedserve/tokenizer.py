"""The model's tokenizer: where it is read from (`--tokenizer`, else the model directory), loaded, and
checked against the model it serves. Every process that tokenizes (the front end, the engine process,
each rank a launcher started) loads it from `ModelConfig.tokenizer_path`, so they all read the same one."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.config import ModelConfig

# A directory holding one of these holds a tokenizer transformers can load: the fast tokenizer's own
# file, a SentencePiece model, a BPE vocabulary (with merges.txt beside it) or a WordPiece vocabulary.
# tokenizer_config.json alone is not one (it names a class and its special tokens, not a vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def holds_tokenizer(path: str) -> bool:
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def check_tokenizer_dir(path: str | None) -> None:
    """`--tokenizer`: a directory holding a tokenizer (ValueError naming the setting). Checked with the
    settings, so that a wrong path stops `serve` before it binds a port."""
    if path is None:
        return
    if not Path(path).is_dir():
        raise ValueError(f"tokenizer: {path!r} is not a directory (it must hold a tokenizer's files)")
    if not holds_tokenizer(path):
        raise ValueError(f"tokenizer: {path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")


def check_tokenizer_found(model: ModelConfig) -> None:
    """A tokenizer where `model` reads it: `--tokenizer`'s directory, else the model directory, which
    must then hold one. A model directory without one fails naming the way out, rather than as
    transformers' guess at a slow tokenizer to convert."""
    if model.tokenizer_path != model.path:
        check_tokenizer_dir(model.tokenizer_path)  # checked with the settings: here for one removed since
    elif not holds_tokenizer(model.path):
        raise ValueError(
            f"tokenizer: the model directory {model.path!r} holds no tokenizer (none of "
            f"{', '.join(TOKENIZER_FILES)}): pass --tokenizer PATH, a directory holding the model's tokenizer"
        )


def load_tokenizer(model: ModelConfig) -> Any:
    """The transformers tokenizer of `model.tokenizer_path`, with its chat template. None there, or one
    that does not load, is a ValueError naming the setting. A vocabulary larger than the model's
    `vocab_size` is taken, as vLLM takes it: a request whose ids lie past it is refused as it arrives
    (out-of-vocab token id, naming its field), the others run."""
    from transformers import AutoTokenizer

    check_tokenizer_found(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model.tokenizer_path)
    except Exception as exc:  # transformers and tokenizers raise many kinds for a broken file
        raise ValueError(
            f"tokenizer: the tokenizer in {model.tokenizer_path!r} does not load: {type(exc).__name__}: {exc}"
        ) from None
    return tokenizer
