"""The attention_backend setting: flag, environment variable, validation, and what `auto` resolves to."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from pagedserve.config import resolve_attention_backend
from pagedserve.settings import EngineSettings, add_settings_arguments, settings_from_args
from pydantic import ValidationError


def parse(argv: list[str]) -> EngineSettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, EngineSettings)
    return settings_from_args(EngineSettings, parser.parse_args(argv))


def model_dir(tmp_path: Path) -> str:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("setting", "device", "resolved"),
    [
        ("auto", "cuda", "triton"),
        ("auto", "cuda:1", "triton"),
        ("auto", "cpu", "torch"),
        ("triton", "cpu", "triton"),
        ("torch", "cuda", "torch"),
    ],
)
def test_auto_is_triton_on_cuda_and_torch_on_cpu(setting: str, device: str, resolved: str) -> None:
    assert resolve_attention_backend(setting, device) == resolved


def test_flag_reaches_the_engine_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_ATTENTION_BACKEND", raising=False)
    settings = parse(["--attention-backend", "triton", "--model", model_dir(tmp_path), "--device", "cpu"])
    assert settings.attention_backend == "triton"
    assert settings.to_engine_config().attention_backend == "triton"
    default = parse(["--model", model_dir(tmp_path), "--device", "cpu"]).to_engine_config()
    assert default.attention_backend == "torch"


def test_environment_variable_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_ATTENTION_BACKEND", raising=False)
    assert EngineSettings().attention_backend == "auto"
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "torch")
    assert EngineSettings().attention_backend == "torch"


def test_unknown_backend_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValidationError, match="attention_backend"):
        EngineSettings(attention_backend="flash")
    with pytest.raises(SystemExit):
        parse(["--attention-backend", "flash"])
    assert "invalid choice: 'flash'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "block_size"),
    [
        ([], 8),  # torch reference on CPU: slot-wise gathers, smaller blocks waste less
        (["--attention-backend", "triton"], 16),  # the kernels tile by block
        (["--block-size", "32"], 32),
        (["--attention-backend", "triton", "--block-size", "32"], 32),
    ],
)
def test_block_size_default_follows_the_attention_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], block_size: int
) -> None:
    for name in ("PAGEDSERVE_ATTENTION_BACKEND", "PAGEDSERVE_BLOCK_SIZE"):
        monkeypatch.delenv(name, raising=False)
    settings = parse([*argv, "--model", model_dir(tmp_path), "--device", "cpu"])
    assert settings.to_engine_config().cache.block_size == block_size
