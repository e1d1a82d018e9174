"""What `--lora-modules` names, read and checked without torch (settings are checked before torch is
imported): `name=path` items, each a PEFT LoRA adapter directory. `pagedserve.lora` loads them."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

# PEFT's module name -> (our layer, the part of it: a shard id of its weight loader, None if unmerged)
TARGETS: dict[str, tuple[str, str | int | None]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
}
# PEFT's name of a fused module (Phi-3's checkpoints fuse them) -> the parts its lora_B stacks, in order:
# one lora_A for all of them
FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
MODULE_NAMES = (*TARGETS, *FUSED_TARGETS)
WEIGHT_NAME = re.compile(
    r"base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def check_adapter_name(name: str, served_model_name: str) -> None:
    """An adapter's name, refused (a ValueError saying what is wrong) where requests could not name it
    plainly: with characters that do not print (as request ids refuse them), or as the served model's
    own name, which a request's `model` picks first (the adapter would never run by it)."""
    if not name.isprintable():
        raise ValueError(f"adapter name {name[:256]!r} has characters that do not print")
    if name == served_model_name:
        raise ValueError(
            f"adapter name {name[:256]!r} is the served model's name: a request's `model` naming it runs "
            "the base model (choose another name, or --served-model-name)"
        )


def parse_lora_modules(value: str | dict[str, str] | None) -> tuple[tuple[str, str], ...]:
    """`name=path` items separated by commas (or a dict name -> path) -> ((name, path), ...)."""
    if not value:
        return ()
    items = list(value.items()) if isinstance(value, dict) else []
    if isinstance(value, str):
        for item in filter(None, (part.strip() for part in value.split(","))):
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules: {item!r} is not name=path")
            items.append((name.strip(), path.strip()))
    names = [name for name, _ in items]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"lora_modules: adapter names given twice: {', '.join(duplicates)}")
    for name, path in items:
        read_adapter_config(name, path)
    return tuple(items)


@dataclass(frozen=True)
class AdapterConfig:
    name: str
    path: str
    lora_alpha: float
    use_rslora: bool
    alpha_pattern: dict[str, float] = field(default_factory=dict, compare=False, hash=False)

    def scale(self, module: str, rank: int) -> float:
        alpha = self.alpha_pattern.get(module, self.lora_alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def read_adapter_config(name: str, path: str) -> AdapterConfig:
    """`path`'s adapter_config.json, refused (ValueError naming `lora_modules` and the adapter) where it
    is not a LoRA this module applies as PEFT does."""

    def fail(why: str) -> ValueError:
        return ValueError(f"lora_modules: adapter {name!r} ({path}): {why}")

    directory = Path(path)
    if not (directory / "adapter_config.json").is_file():
        raise fail("no adapter_config.json there (a PEFT adapter directory is expected)")
    if not (directory / ADAPTER_WEIGHTS).is_file():
        raise fail(f"no {ADAPTER_WEIGHTS} there (adapters saved as .bin are not read)")
    try:
        cfg = json.loads((directory / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise fail(f"adapter_config.json does not parse: {exc}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type {cfg.get('peft_type') if isinstance(cfg, dict) else cfg!r} (LORA is served)")
    unsupported = {
        "use_dora": "DoRA",
        "fan_in_fan_out": "fan_in_fan_out",
        "modules_to_save": "modules_to_save (fully trained modules)",
        "layers_to_transform": "layers_to_transform",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise fail(f"{what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise fail(f"bias {cfg['bias']!r} is not supported (none is)")
    alpha_pattern = cfg.get("alpha_pattern") or {}
    if any(key not in MODULE_NAMES for key in alpha_pattern):
        raise fail(f"alpha_pattern keys must be module names ({', '.join(MODULE_NAMES)})")
    return AdapterConfig(
        name,
        path,
        float(cfg.get("lora_alpha", 8)),
        bool(cfg.get("use_rslora", False)),
        {key: float(value) for key, value in alpha_pattern.items()},
    )
