"""A GGUF file as `--model`, as vLLM loads one: converted once into the model cache (the embedded default
model goes through the same conversion), served under the file's name, with the GGUF's tokenizer; a
GGUF of each architecture served, written as llama.cpp writes one, gives its checkpoint's tokens. A
changed file converts again; a missing file, a file that is not GGUF, an architecture pagedserve does
not serve, a rope scaled by factor tensors the conversion would drop and a file transformers cannot
convert are each refused naming `model`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from model_files import write_gguf, write_gguf_of
from pagedserve import LLM, SamplingParams
from pagedserve.default_model import default_gguf_path, resolve_model_path
from pagedserve.gguf_model import converted_dir, gguf_model_dir
from pagedserve.settings import EngineSettings

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
ENGINE = {"dtype": "float32", "num_kv_blocks": 64}
GGUF_VOCAB = 1024  # the tiny checkpoints written as GGUF files: the default tokenizer's first ids
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 256}
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 1e4,
    "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.4, 1.5],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0],
}


@pytest.fixture
def gguf_cache(gguf_cache_dir: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The session's cache, which holds the embedded GGUF file converted already."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", gguf_cache_dir)
    return Path(gguf_cache_dir)


def outputs(llm: LLM) -> list[list[tuple[str, list[int]]]]:
    return [
        [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in llm.generate(PROMPTS, GREEDY)],
        [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in llm.chat(QUESTION, GREEDY)],
    ]


def test_the_embedded_gguf_file_serves_as_the_default_model(gguf_cache: Path, default_model_dir: str) -> None:
    """Greedy text and ids of raw prompts and a chat (the GGUF's tokenizer and chat template) equal the
    default model's; the model is served under the file's stem."""
    expected = outputs(LLM(model=default_model_dir, **ENGINE))
    served = LLM(model=str(default_gguf_path()), **ENGINE)
    assert outputs(served) == expected
    assert "Paris" in expected[1][0][0]
    config = served.engine.config.model
    assert config.served_model_name == "SmolLM2-135M-Instruct.Q4_1"
    assert Path(config.path).is_relative_to(gguf_cache) and config.tokenizer_path == config.path


def test_a_gguf_file_converts_once(gguf_cache: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The session's conversion is found again: the same directory, its files not written again, no
    conversion said, nothing left beside it."""
    path = Path(resolve_model_path(str(default_gguf_path())))
    before = {f.name: f.stat().st_mtime_ns for f in path.iterdir()}
    assert path == Path(resolve_model_path(str(default_gguf_path())))
    assert {f.name: f.stat().st_mtime_ns for f in path.iterdir()} == before
    assert "converting" not in capfd.readouterr().err
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(before)
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in path.iterdir())  # a container's user reads them
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, "source.json"]  # nothing temporary


def test_a_changed_gguf_file_converts_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache key follows the file: rewritten (another size) or touched (another modification time),
    it is another directory; as it was, the same one. So does the conversion's version: a file
    converted before the conversion changed (it dropped a GGUF's rope scaling) converts again."""
    path = write_gguf(tmp_path / "tiny.gguf", "llama", [0.0, 1.0])
    first = converted_dir(path, tmp_path, "tiny")
    assert first == converted_dir(path, tmp_path, "tiny") and first.name == "tiny"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    touched = converted_dir(path, tmp_path, "tiny")
    write_gguf(path, "llama", [0.0] * 64)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the first file's time, another size
    assert path.stat().st_size != stat.st_size
    rewritten = converted_dir(path, tmp_path, "tiny")
    assert len({first, touched, rewritten}) == 3
    from pagedserve import gguf_model

    monkeypatch.setattr(gguf_model, "CONVERSION", gguf_model.CONVERSION - 1)
    assert converted_dir(path, tmp_path, "tiny") not in {first, touched, rewritten}


@pytest.mark.slow
def test_a_changed_gguf_file_leaves_no_earlier_conversion(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], default_model_dir: str
) -> None:
    """A conversion records the file it was made of; converting a file again (it was rewritten or
    touched) removes its earlier conversion (28 GB for a 7B model), which nothing would find again.
    Another file's conversion of the same name, one written before conversions recorded their file,
    and anything else in the cache stay; a conversion found without its record gets it."""
    from tiny_models import build_tiny_llama

    gguf = tmp_path / "models" / "m.gguf"
    gguf.parent.mkdir()
    model_dir = build_tiny_llama(tmp_path / "hf", default_model_dir, vocab_size=GGUF_VOCAB)
    write_gguf_of(model_dir, gguf, "llama", default_gguf_path())
    cache = tmp_path / "cache"
    earlier = cache / "m-00000000000000aa"  # this path's file before it changed
    elsewhere = cache / "m-00000000000000bb"  # a file m.gguf in another folder
    unrecorded = cache / "m-00000000000000cc"  # converted before the record
    for folder, source in ((earlier, gguf), (elsewhere, tmp_path / "other" / "m.gguf"), (unrecorded, None)):
        (folder / "m").mkdir(parents=True)
        (folder / "m" / "config.json").write_text("{}")
        if source is not None:
            (folder / "source.json").write_text(json.dumps({"path": str(source.resolve())}))
    other = cache / "m-notes.txt"
    other.write_text("kept")

    converted = Path(gguf_model_dir(str(gguf), cache))
    assert (converted / "config.json").is_file() and converted.parent.name.startswith("m-")
    assert json.loads((converted.parent / "source.json").read_text()) == {"path": str(gguf.resolve())}
    assert not earlier.exists()
    assert f"removed {earlier}" in capfd.readouterr().err
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [converted.parent.name, elsewhere.name, unrecorded.name, other.name]
    )
    assert Path(gguf_model_dir(str(gguf), cache)) == converted  # found again, nothing removed
    assert "removed" not in capfd.readouterr().err
    (converted.parent / "source.json").unlink()  # as a conversion from before the record
    assert Path(gguf_model_dir(str(gguf), cache)) == converted
    assert json.loads((converted.parent / "source.json").read_text()) == {"path": str(gguf.resolve())}


@pytest.mark.parametrize("name", ["missing.gguf", "config.json", "folder.gguf"])
def test_a_model_path_that_is_no_gguf_file_is_refused_naming_model(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "folder.gguf").mkdir()
    says = {
        "missing.gguf": "no such file",
        "config.json": "is not a GGUF file",
        "folder.gguf": "is not a file",
    }
    with pytest.raises(ValueError, match=rf"model\n.*{says[name]}"):
        EngineSettings(model=str(tmp_path / name))
    with pytest.raises(ValueError, match=rf"^model: .*{says[name]}"):
        resolve_model_path(str(tmp_path / name))
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    ("architecture", "tensor_name", "message"),
    [
        ("gpt2", "token_embd.weight", r"holds a 'gpt2' model .* serves llama, qwen2, qwen3, phi3$"),
        # llama.cpp writes Mistral as llama; transformers' gguf package knows no `mistral`
        ("mistral", "token_embd.weight", r"holds a 'mistral' model"),
        # LongRoPE's long factors without the short ones (and the pretraining length)
        (
            "phi3",
            "rope_factors_long.weight",
            r"scales its rope in a way pagedserve does not read \(rope.scaling.type 'longrope', factor "
            r"tensors: rope_factors_long.weight\)",
        ),
    ],
    ids=["gpt2", "mistral", "phi3-long-factors-alone"],
)
def test_a_gguf_file_not_served_is_refused_before_converting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, architecture: str, tensor_name: str, message: str
) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "model.gguf", architecture, [0.0], tensor_name)
    settings = EngineSettings(model=str(path))  # a GGUF file: its architecture is read once it converts
    with pytest.raises(ValueError, match=rf"^model: .*model\.gguf' {message}"):
        settings.to_engine_config()
    assert not (tmp_path / "cache").exists()


def test_a_gguf_file_transformers_cannot_convert_is_refused_naming_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_model_dir: str
) -> None:
    """transformers' GGUF reader takes a Qwen3's head_dim as 128 (every Qwen3 checkpoint's); one of 16
    does not fit its weights: refused naming `model`, nothing converted left behind."""
    from tiny_models import build_tiny_llama

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = build_tiny_llama(
        tmp_path / "hf", default_model_dir, config_class="Qwen3Config", vocab_size=GGUF_VOCAB
    )
    gguf = write_gguf_of(model_dir, tmp_path / "tiny-qwen3.gguf", "qwen3", default_gguf_path())
    with pytest.raises(ValueError, match=r"^model: transformers could not convert '.*tiny-qwen3\.gguf': "):
        LLM(model=str(gguf), **ENGINE)
    assert not any((tmp_path / "cache").glob("tiny-qwen3-*/tiny-qwen3"))


@pytest.mark.parametrize(
    ("architecture", "config_class", "overrides"),
    [
        ("llama", "LlamaConfig", {}),
        (
            "llama",
            "LlamaConfig",
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}},
        ),
        # Llama 3.1's rope, pretrained on 64 positions: llama.cpp's rope_freqs tensor
        ("llama", "LlamaConfig", {"rope_parameters": LLAMA3_ROPE}),
        ("qwen2", "Qwen2Config", {}),
        # Qwen's YaRN for 4x its pretraining length (256): rope.scaling.* keys
        ("qwen2", "Qwen2Config", {"rope_parameters": YARN_ROPE}),
        # the head_dim transformers' GGUF reader assumes (every Qwen3 checkpoint's)
        ("qwen3", "Qwen3Config", {"num_heads": 1, "num_kv_heads": 1, "head_dim": 128}),
        ("phi3", "Phi3Config", {}),
        # LongRoPE's long factors (max_model_len 1,024 past the pretraining length 256)
        ("phi3", "Phi3Config", {"original_max_position_embeddings": 256, "rope_parameters": LONGROPE}),
    ],
    ids=[
        "llama",
        "llama-linear-rope",
        "llama-3.1-rope",
        "qwen2",
        "qwen2-yarn-rope",
        "qwen3",
        "phi3",
        "phi3-longrope",
    ],
)
def test_a_gguf_file_of_each_architecture_served_gives_its_checkpoints_tokens(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    default_model_dir: str,
    architecture: str,
    config_class: str,
    overrides: dict[str, object],
) -> None:
    """A tiny checkpoint written as llama.cpp writes it (float32, so nothing is lost) converts into the
    same model: the same architecture, the same greedy tokens as the checkpoint itself."""
    from tiny_models import build_tiny_llama

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = build_tiny_llama(
        tmp_path / "hf", default_model_dir, config_class=config_class, vocab_size=GGUF_VOCAB, **overrides
    )
    gguf = write_gguf_of(model_dir, tmp_path / f"tiny-{architecture}.gguf", architecture, default_gguf_path())
    from_gguf, checkpoint = LLM(model=str(gguf), **ENGINE), LLM(model=model_dir, **ENGINE)
    converted = json.loads((Path(from_gguf.engine.config.model.path) / "config.json").read_text())
    assert converted["architectures"] == [checkpoint.engine.config.model.architecture]
    # the context its rope reaches (yarn: its pretraining length times its factor)
    assert from_gguf.engine.config.model.max_model_len == checkpoint.engine.config.model.max_model_len
    prompts = [[1, *range(300, 450)], [1, *range(900, 913)]]  # (150 tokens: past 64 positions)
    # the GGUF's tokenizer, cut to the model's vocabulary, reads its ids as the checkpoint's does
    assert from_gguf.engine.tokenizer.decode(prompts[0]) == checkpoint.engine.tokenizer.decode(prompts[0])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    theirs = [o.outputs[0].token_ids for o in checkpoint.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in from_gguf.generate(prompts, params)] == theirs
