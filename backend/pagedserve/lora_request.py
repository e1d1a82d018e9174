"""`LoRARequest`, vLLM's name for "run this request through that adapter" in the offline API."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Names a LoRA adapter of the `LLM`: one it was built with (`LLM(lora_modules={name: path})`) or
    loaded since, or, given `lora_path`, one to load on first use (as vLLM's). vLLM's `lora_int_id` is
    accepted and not needed: adapters go by name.
    """

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
