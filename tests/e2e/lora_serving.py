"""What the LoRA front-end tests share: two PEFT adapters of the tiny model, an in-process server that
serves both, and what offline `LLM` generates through each (the reference every front end must equal).

Kept out of conftest.py so tests import it by a name no other folder's conftest shares."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inprocess_server import InProcessServer

ADAPTERS = ("sql", "chat")  # in the order --lora-modules gives them
MODEL = "tiny"
BLOCK = 8


def build_adapters(dest: Path, base_model_dir: str) -> dict[str, str]:
    """One adapter per name of ADAPTERS, each of its own random weights: name -> directory."""
    from lora_adapters import build_lora_adapter

    return {
        name: build_lora_adapter(dest / name, base_model_dir, seed=seed)
        for seed, name in enumerate(ADAPTERS, start=1)
    }


def lora_modules(adapters: dict[str, str]) -> str:
    """The --lora-modules value serving `adapters`."""
    return ",".join(f"{name}={path}" for name, path in adapters.items())


def start_server(base_model_dir: str, adapters: dict[str, str], **settings: Any) -> InProcessServer:
    return InProcessServer(
        base_model_dir,
        None,
        dtype="float32",
        served_model_name=MODEL,
        block_size=BLOCK,
        lora_modules=lora_modules(adapters),
        **settings,
    ).start()


def offline(
    base_model_dir: str,
    adapters: dict[str, str],
    cases: Sequence[tuple[str | list[int], str | None]],
    max_tokens: int,
    ignore_eos: bool = True,
) -> list[Any]:
    """The offline `LLM`'s completion of each (prompt, adapter name or None for the base model), each
    run alone, greedy, `max_tokens` tokens (fewer at EOS unless `ignore_eos`)."""
    from pagedserve import LLM, LoRARequest, SamplingParams

    llm = LLM(
        model=base_model_dir, dtype="float32", num_kv_blocks=128, block_size=BLOCK, lora_modules=adapters
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return [
        llm.generate([prompt], params, lora_request=LoRARequest(name) if name else None)[0].outputs[0]
        for prompt, name in cases
    ]
