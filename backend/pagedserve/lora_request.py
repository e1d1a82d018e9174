"""`LoRARequest`, vLLM's name for "run this request through that adapter" in the offline API."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Names one of the adapters the `LLM` was built with (`LLM(lora_modules={name: path})`). vLLM's
    `lora_int_id` and `lora_path` are accepted and not needed: every adapter is loaded at start-up,
    by name, so a name the `LLM` was not given is refused, whatever its path."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
