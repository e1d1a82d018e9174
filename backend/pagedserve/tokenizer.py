"""The model's tokenizer: where it is read from (`--tokenizer`, else the model directory), loaded, and
checked against the model it serves. Every process that tokenizes (the engine, each rank a launcher
started) loads it from `ModelConfig.tokenizer_path`, so they all read the same one; the front end of an
engine process takes that process's (`EngineProcess.receive_handover`). An engine built again in one
process copies the tokenizer it loaded before, from its directory or from another holding the same
tokenizer (`_Loaded`, `_files_key`)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import stat
import threading
from collections import OrderedDict
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
    key = _files_key(model.tokenizer_path)
    with _loaded_lock:
        loaded = _loaded.get(key)
        if loaded is not None:
            _loaded.move_to_end(key)
    if loaded is not None and (loaded.path == model.tokenizer_path or not loaded.path_bound):
        return loaded.copy(model.tokenizer_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model.tokenizer_path)
    except Exception as exc:  # transformers and tokenizers raise many kinds for a broken file
        raise ValueError(
            f"tokenizer: the tokenizer in {model.tokenizer_path!r} does not load: {type(exc).__name__}: {exc}"
        ) from None
    loaded = _Loaded.of(tokenizer, model.tokenizer_path)
    if loaded is not None:
        with _loaded_lock:
            _loaded[key] = loaded
            while len(_loaded) > _LOADED_MAX:
                _loaded.popitem(last=False)
    return tokenizer


class _Loaded:
    """A fast tokenizer as it loaded, kept to copy: its Python side without its Rust tokenizer, and a
    Rust tokenizer of its own to copy from. A copy is a tokenizer of its own, as a load gives: the
    Python side deep-copied (a chat template set on one engine's stays there) and a Rust tokenizer of
    its own (one is not to be shared between threads: tokenize_bad_words), built around the loaded
    one's model (`_rebuilt`): the vocabulary and merges, which nothing changes, are shared by the
    copies; the parts a caller changes (added tokens, truncation, padding) and the small ones
    (normalizer, pre-tokenizer, post-processor, decoder) are each copy's own. SmolLM2's tokenizer
    (49,152 tokens, 48,900 merges), on the 2-core host: 0.25-0.37 s a load; a copy ~1 ms, where parsing
    the Rust tokenizer's JSON again took 0.1 s. A Rust tokenizer that `_rebuilt` does not give back as
    it is (its JSON differs: a part it does not copy) is copied through its JSON.

    A copy for another directory holding the same files (`_files_key`) names that directory
    (`name_or_path`, as a load from it does), unless the loaded tokenizer names its own directory
    anywhere else (`path_bound`): that one is loaded again."""

    def __init__(self, python_side: Any, rust: Any, path: str) -> None:
        # (`rust`: a Rust tokenizer to rebuild, or the JSON of one to parse)
        self.python_side, self.rust, self.path = python_side, rust, path
        others = [value for name, value in vars(python_side).items() if name != "name_or_path"]
        others += [value for name, value in python_side.init_kwargs.items() if name != "name_or_path"]
        self.path_bound = any(isinstance(value, str) and path in value for value in others)

    @classmethod
    def of(cls, tokenizer: Any, path: str) -> _Loaded | None:
        """None for a tokenizer without a Rust tokenizer (a slow one): loaded afresh every time."""
        from tokenizers import Tokenizer

        rust = getattr(tokenizer, "_tokenizer", None)
        if not isinstance(rust, Tokenizer):
            return None
        python_side = copy.deepcopy(tokenizer, {id(rust): None})
        rust_json = rust.to_str()
        try:
            own = _rebuilt(rust)  # (the loaded tokenizer's added tokens are its engine's to change)
        except Exception:  # a part the bindings cannot copy
            return cls(python_side, rust_json, path)
        return cls(python_side, own if own.to_str() == rust_json else rust_json, path)

    def copy(self, path: str) -> Any:
        """A copy for the directory `path` (this one's, or one holding the same files)."""
        from tokenizers import Tokenizer

        tokenizer = copy.deepcopy(self.python_side)
        if path != self.path:
            tokenizer.name_or_path = tokenizer.init_kwargs["name_or_path"] = path
        rust = self.rust
        tokenizer._tokenizer = Tokenizer.from_str(rust) if isinstance(rust, str) else _rebuilt(rust)
        return tokenizer


def _rebuilt(rust: Any) -> Any:
    """A Rust tokenizer around `rust`'s model (shared, not copied), with copies of its normalizer,
    pre-tokenizer, post-processor and decoder, its added tokens (added again in the order of their ids,
    which gives them the same ids) and its truncation and padding."""
    from tokenizers import Tokenizer

    own = Tokenizer(rust.model)
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        if (value := getattr(rust, part)) is not None:
            setattr(own, part, copy.deepcopy(value))
    for _, token in sorted(rust.get_added_tokens_decoder().items()):
        (own.add_special_tokens if token.special else own.add_tokens)([token])
    if rust.truncation is not None:
        own.enable_truncation(**rust.truncation)
    if rust.padding is not None:
        own.enable_padding(**rust.padding)
    own.encode_special_tokens = rust.encode_special_tokens
    return own


# The tokenizers this process loaded, by what their directory held when they loaded (`_files_key`): an
# engine built again in the same process (LLM objects one after another, a sweep of settings) copies
# its tokenizer rather than loading it again. The last few directories only.
_LOADED_MAX = 4
_loaded: OrderedDict[tuple[object, ...], _Loaded] = OrderedDict()
_loaded_lock = threading.Lock()


# A file up to this size is keyed by its contents: a tokenizer's files, the configs, chat templates
# (Gemma 3's tokenizer.json is 33 MB). A larger one by its size and modification time.
_HASHED_MAX_BYTES = 64 << 20
# Weights, which no tokenizer is read from: left out of the key (each fine-tune's checkpoint differs).
_WEIGHTS_SUFFIXES = (".safetensors", ".gguf", ".pt", ".pth", ".bin", ".ckpt", ".h5", ".msgpack")


def _files_key(path: str) -> tuple[object, ...]:
    """What a tokenizer loaded from the directory `path` can depend on, so that a file written since (a
    tokenizer's, a chat template, a config) changes the key and the tokenizer loads again: every file
    under it but the weights, by name and contents (`_file_key`); and a relative path itself.
    transformers matches some hub ids (`org/name-*`) to a tokenizer class by the name it loads from,
    which an absolute path cannot match: two directories named absolutely that hold the same tokenizer
    (a fine-tune's checkpoints, models of one family) share one load. ~3 ms for the default model's
    directory."""
    folder = os.path.realpath(path)
    files = []
    for root, folders, names in os.walk(folder):
        folders[:] = [name for name in folders if not name.startswith(".")]  # (.git, .cache: no tokenizer)
        for name in names:
            if name.startswith(".") or name.endswith(_WEIGHTS_SUFFIXES) and not name.startswith("tokenizer"):
                continue
            with contextlib.suppress(OSError):
                if (key := _file_key(os.path.join(root, name), folder)) is not None:
                    files.append(key)
    return (None if os.path.isabs(path) else path, *sorted(files))


def _file_key(file: str, folder: str) -> tuple[str, object] | None:
    """A file, named by its path under `folder`, by its contents; config.json by what AutoTokenizer
    reads of it (its model type and those of the configs it holds, a tokenizer class, a model name,
    remote code), the rest of it being the model's; a file larger than _HASHED_MAX_BYTES by its size
    and modification time; None for what is not a file."""
    name = os.path.relpath(file, folder)
    info = os.stat(file)  # (follows links: a hub snapshot's files are links to blobs)
    if not stat.S_ISREG(info.st_mode):
        return None
    if info.st_size > _HASHED_MAX_BYTES:
        return (name, (info.st_size, info.st_mtime_ns))
    with open(file, "rb") as f:
        data = f.read()
    if name == "config.json":
        with contextlib.suppress(ValueError):
            config = json.loads(data)
            if isinstance(config, dict):
                read = {
                    key: config.get(key)
                    for key in ("model_type", "tokenizer_class", "model_name", "auto_map")
                }
                read |= {
                    key: value["model_type"]
                    for key, value in config.items()
                    if isinstance(value, dict) and "model_type" in value
                }
                return (name, json.dumps(read, sort_keys=True, default=str))
    return (name, hashlib.sha256(data).hexdigest())
