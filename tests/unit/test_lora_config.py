"""`--lora-modules`: `name=path` items, each a PEFT adapter directory, checked before any model loads and
reported in the operator's terms (the flag or variable, the adapter, what is wrong)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pagedserve.lora_config import parse_lora_modules


def adapter_dir(path: Path, **config: object) -> str:
    """An adapter directory as far as the start-up checks read it (the config; the weights' presence)."""
    path.mkdir()
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, **config})
    )
    (path / "adapter_model.safetensors").write_bytes(b"")
    return str(path)


def test_names_and_paths_in_order(tmp_path: Path) -> None:
    sql, chat = adapter_dir(tmp_path / "sql"), adapter_dir(tmp_path / "chat")
    assert parse_lora_modules(f" sql={sql} , chat={chat},") == (("sql", sql), ("chat", chat))
    assert parse_lora_modules({"chat": chat}) == (("chat", chat),)
    assert parse_lora_modules(None) == () and parse_lora_modules("") == ()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("sql", r"^lora_modules: 'sql' is not name=path$"),
        ("=/x", r"^lora_modules: '=/x' is not name=path$"),
        ("sql=", r"^lora_modules: 'sql=' is not name=path$"),
        ("a=/x,a=/y", r"^lora_modules: adapter names given twice: a$"),
        ("a=/nowhere", r"^lora_modules: adapter 'a' \(/nowhere\): no adapter_config.json there"),
    ],
)
def test_malformed_values_are_refused(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_lora_modules(value)


def test_weights_saved_as_bin_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "bin"
    path.mkdir()
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(
        ValueError, match=r"no adapter_model.safetensors there \(adapters saved as .bin are not read\)"
    ):
        parse_lora_modules(f"a={path}")


def test_an_unreadable_config_is_refused(tmp_path: Path) -> None:
    path = Path(adapter_dir(tmp_path / "a"))
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json does not parse"):
        parse_lora_modules(f"a={path}")


@pytest.mark.parametrize(
    ("name", "served", "message"),
    [
        (
            "tiny",
            "tiny",
            r"^lora_modules: adapter name 'tiny' is the served model's name: a request's `model`",
        ),
        ("a\tb", "tiny", r"^lora_modules: adapter name 'a\\tb' has characters that do not print$"),
    ],
)
def test_a_name_requests_could_not_pick_it_by_is_refused(
    tmp_path: Path, tiny_llama_dir: str, name: str, served: str, message: str
) -> None:
    """A request's `model` picks the served model before any adapter of the same name, which would then
    never run; a name with a tab or a newline cannot be written plainly (request ids refuse them)."""
    from pagedserve.settings import EngineSettings

    settings = EngineSettings(
        model=tiny_llama_dir, served_model_name=served, lora_modules={name: adapter_dir(tmp_path / "a")}
    )
    with pytest.raises(ValueError, match=message):
        settings.to_engine_config()
    fine = EngineSettings(
        model=tiny_llama_dir, served_model_name=served, lora_modules={"sql": str(tmp_path / "a")}
    )
    assert fine.to_engine_config().lora_names == ("sql",)
