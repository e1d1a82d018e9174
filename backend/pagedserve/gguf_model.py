"""A GGUF checkpoint (`--model x.gguf`, and the embedded default model) converted once into a cached
Hugging Face directory (config, tokenizer, safetensors) that loads like any other."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gguf import GGUFReader

GGUF_MAGIC = b"GGUF"
SOURCE_RECORD = "source.json"  # beside a conversion: the file it was made of
# What a conversion makes, by version: a new one converts every file again once (its conversions made
# before are then removed as stale). 2: the rope scaling transformers drops is kept (`gguf_rope`).
CONVERSION = 2
# GGUF's general.architecture -> the config.json architecture transformers converts it to; each one
# models/registry.py serves. llama.cpp writes a Mistral checkpoint as llama; a `mistral` GGUF (another
# tool's) is refused: the gguf package transformers reads it with knows no such architecture.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# Tensors llama.cpp writes for a scaled rope: each frequency divided by its factor (Llama 3.1's rope
# as `rope_freqs`; Phi-3's LongRoPE as a long and a short set)
ROPE_FREQS, LONG_FACTORS, SHORT_FACTORS = (
    "rope_freqs.weight",
    "rope_factors_long.weight",
    "rope_factors_short.weight",
)


def is_gguf_model(model: str) -> bool:
    """`--model` names a GGUF file rather than a directory: a `.gguf` name (there or not), or a file."""
    return model.endswith(".gguf") or Path(model).is_file()


def check_model_file(model: str | None) -> None:
    """`--model` as far as it can be told without loading anything (ValueError naming it): a GGUF
    file's existence and kind. A directory is read once the engine loads."""
    if model is not None and is_gguf_model(model):
        check_gguf_file(model)


def check_gguf_file(path: str) -> None:
    """A file that starts as GGUF files do (ValueError naming `model`). Cheap, so it is checked with the
    settings, before `serve` binds a port; its architecture is read only where it converts."""
    if not Path(path).exists():
        raise ValueError(f"model: no such file or directory: {path!r}")
    if not Path(path).is_file():
        raise ValueError(f"model: {path!r} is not a file (a GGUF file, or a Hugging Face model directory)")
    with open(path, "rb") as file:
        if file.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise ValueError(
                f"model: {path!r} is not a GGUF file (it does not start with GGUF's magic bytes); --model "
                "takes a GGUF file or a Hugging Face model directory"
            )


def gguf_model_dir(gguf: str, cache: Path, name: str | None = None) -> str:
    """The Hugging Face directory of `gguf` under `cache`, converted first unless it is there. `name`:
    the directory's own name, which is the model's served name by default (the file's stem unless
    given)."""
    check_gguf_file(gguf)
    dest = converted_dir(Path(gguf), cache, name or Path(gguf).stem)
    if not (dest / "config.json").is_file():
        convert_gguf(Path(gguf), dest)
        _record_source(Path(gguf), dest.parent)
        remove_stale_conversions(Path(gguf), dest.parent)
    elif not (dest.parent / SOURCE_RECORD).is_file():  # converted before conversions were recorded
        with contextlib.suppress(OSError):  # a cache mounted read-only: it stays unrecorded
            _record_source(Path(gguf), dest.parent)
    return str(dest)


def converted_dir(gguf: Path, cache: Path, name: str) -> Path:
    """`<cache>/<stem>-<key>/<name>`, the key a hash of the file's resolved path, size and
    modification time. Not of its contents: hashing a whole checkpoint reads gigabytes at every start,
    and its header alone (metadata, tensor names and shapes) stays the same when only the weights
    change (a fine-tune quantized the same way). Anything that writes the file (a download, a copy,
    an edit) changes its size or time, so a changed file converts again; a file moved or merely
    touched converts again too, which costs a conversion, never a stale model. The path keeps two
    files of the same name in different folders apart; `CONVERSION` keeps what an earlier version of
    the conversion made apart from what this one makes."""
    stat = gguf.stat()
    source = f"{gguf.resolve()}\n{stat.st_size}\n{stat.st_mtime_ns}\n{CONVERSION}"
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    return cache / f"{gguf.stem}-{key}" / name


def remove_stale_conversions(gguf: Path, current: Path) -> list[Path]:
    """Remove the conversions of `gguf`'s earlier contents beside `current`, its conversion now, and
    return them: each conversion's folder records the file it came from (`source.json`), and one of
    the same resolved path under another key was made of a file since rewritten or touched, which
    nothing finds again (a dequantized 7B model leaves 28 GB a download). One written before
    conversions were recorded gets its record when next used; one never used since is left alone, as
    are other files' and any folder that is not a conversion. A server still running on one it
    removes keeps what it loaded (the files unlinked, not gone)."""
    path = str(gguf.resolve())
    removed = []
    for folder in sorted(current.parent.glob(f"{glob.escape(gguf.stem)}-*")):
        if folder == current or not folder.is_dir() or _recorded_source(folder) != path:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            print(f"pagedserve: removed {folder}, converted from {gguf} before it changed", file=sys.stderr)
            removed.append(folder)
    return removed


def _record_source(gguf: Path, folder: Path) -> None:
    """`folder/source.json`: the resolved path of the file converted there (see
    remove_stale_conversions), written whole or not at all."""
    record = folder / SOURCE_RECORD
    tmp = record.with_name(f".{SOURCE_RECORD}-{os.getpid()}")
    tmp.write_text(json.dumps({"path": str(gguf.resolve())}))
    tmp.chmod(0o644)
    os.replace(tmp, record)


def _recorded_source(folder: Path) -> str | None:
    try:
        source = json.loads((folder / SOURCE_RECORD).read_text()).get("path")
    except (OSError, ValueError, AttributeError):  # none (an older conversion), unreadable, not an object
        return None
    return source if isinstance(source, str) else None


def convert_gguf(gguf: Path, dest: Path) -> None:
    """GGUF -> safetensors + config.json + tokenizer + generation_config.json in `dest`, written to a
    temporary folder and renamed into place, so concurrent processes (a launcher's ranks each
    converting) never see a half-written model."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf)
    except (ValueError, IndexError, OSError) as exc:  # a truncated file, a GGUF version it does not know
        raise ValueError(f"model: {str(gguf)!r} is not a readable GGUF file: {exc}") from None
    # both read before the conversion, which takes seconds to minutes
    architecture, rope = gguf_architecture(reader, gguf), gguf_rope(reader, gguf)
    # on stderr: stdout is `pagedserve generate`'s answer
    print(f"pagedserve: converting {gguf} into {dest} (once) ...", file=sys.stderr, flush=True)
    _write_into_place(dest, lambda folder: _convert_into(folder, gguf, architecture, rope))
    print(f"pagedserve: {dest.name} ready at {dest}", file=sys.stderr, flush=True)


def gguf_architecture(reader: GGUFReader, gguf: Path) -> str:
    """The config.json architecture of the GGUF's general.architecture (ValueError naming `model` for
    one pagedserve does not serve)."""
    field = reader.fields.get("general.architecture")
    name = field.contents() if field is not None else None
    if name not in ARCHITECTURES:
        raise ValueError(
            f"model: {str(gguf)!r} holds a {name!r} model (GGUF general.architecture); pagedserve "
            f"serves {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[name]


def gguf_rope(reader: GGUFReader, gguf: Path) -> dict[str, Any] | None:
    """config.json's `rope_parameters` for the scaled rope the GGUF describes, or None for none:
    transformers' conversion reads no rope scaling of these architectures, and its model would turn
    by the unscaled rope (other tokens than the checkpoint's). llama.cpp writes linear and YaRN
    scaling as `<arch>.rope.scaling.*` keys, and per-frequency factors as tensors, which divide the
    frequencies as LongRoPE's do (`layers.rotary`): Llama 3.1's one set (`rope_freqs`) as both the
    long and the short one, with no attention factor (llama.cpp applies none); Phi-3's two sets over
    its pretraining length, with the attention factor it names, else the one LongRoPE computes. A
    scaling of another kind is refused (ValueError naming `model`)."""
    arch = reader.fields["general.architecture"].contents()

    def value(key: str) -> Any:
        field = reader.fields.get(f"{arch}.{key}")
        return None if field is None else field.contents()

    factors = {
        t.name: [float(x) for x in t.data.reshape(-1)]
        for t in reader.tensors
        if t.name in (ROPE_FREQS, LONG_FACTORS, SHORT_FACTORS)
    }
    kind = value("rope.scaling.type") or ("longrope" if factors else "none")
    factor, original = value("rope.scaling.factor"), value("rope.scaling.original_context_length")
    params: dict[str, Any] = {"rope_type": kind, "rope_theta": float(value("rope.freq_base") or 10000.0)}
    if kind == "none" and not factors:
        return None
    if kind in ("none", "longrope") and set(factors) == {ROPE_FREQS}:
        freqs, positions = factors[ROPE_FREQS], int(value("context_length"))
        params.update(rope_type="longrope", short_factor=freqs, long_factor=freqs, attention_factor=1.0)
        return {**params, "original_max_position_embeddings": positions}
    if kind == "longrope" and set(factors) == {LONG_FACTORS, SHORT_FACTORS} and original is not None:
        params.update(short_factor=factors[SHORT_FACTORS], long_factor=factors[LONG_FACTORS])
        if (attention := value("rope.scaling.attn_factor")) is not None:
            params["attention_factor"] = float(attention)
        return {**params, "original_max_position_embeddings": int(original)}
    if kind == "linear" and not factors and factor:
        return {**params, "factor": float(factor)}
    if kind == "yarn" and not factors and factor and original is not None:
        for ours in ("beta_fast", "beta_slow"):
            if (beta := value(f"rope.scaling.yarn_{ours}")) is not None:
                params[ours] = float(beta)
        return {**params, "factor": float(factor), "original_max_position_embeddings": int(original)}
    raise ValueError(
        f"model: {str(gguf)!r} scales its rope in a way pagedserve does not read (rope.scaling.type "
        f"{kind!r}, factor tensors: {', '.join(sorted(factors)) or 'none'}): linear and yarn with a factor "
        f"(yarn with its original_context_length), {ROPE_FREQS} alone, or {LONG_FACTORS} and "
        f"{SHORT_FACTORS} with longrope's original_context_length are"
    )


def _convert_into(folder: Path, gguf: Path, architecture: str, rope: dict[str, Any] | None) -> None:
    """The weights dequantized to float32 by transformers (a tied LM head left out, as Hugging Face
    saves it), config.json without quantization_config (its weights are plain now), naming the
    architecture and with the GGUF's `rope` (`gguf_rope`), the GGUF's tokenizer and generation config."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers' own refusal: weights its config does not fit, a tokenizer
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise ValueError(f"model: transformers could not convert {str(gguf)!r}: {lines[0][:500]}") from None
    tied = bool(model.config.tie_word_embeddings)
    state = {
        name: tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [architecture]
    if rope is not None:  # (transformers reads a top-level pretraining length first: Phi-3's place)
        config.pop("rope_scaling", None)
        config["rope_parameters"] = rope
        if "original_max_position_embeddings" in rope:
            config["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)


def _write_into_place(dest: Path, write: Callable[[Path], None]) -> None:
    """`write` into a temporary folder beside `dest`, then rename it to `dest`. Another process that
    won the race has put its own there: the rename fails, and theirs is the same model. Readable by
    all, as a downloaded model is (safetensors writes its file for its owner alone), so that a
    container running as another user can mount it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    tmp.chmod(0o755)
    try:
        write(tmp)
        for file in tmp.iterdir():
            file.chmod(0o644)
        os.replace(tmp, dest)
    except OSError:
        if not (dest / "config.json").is_file():  # not a lost race with another converting process
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
