"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from pagedserve.models.llama import LlamaForCausalLM, Qwen2ForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODELS:
        raise ValueError(f"model: architecture {architecture!r} is not supported ({', '.join(MODELS)} are)")
    return MODELS[architecture]
