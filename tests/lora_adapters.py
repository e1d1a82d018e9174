"""LoRA adapters for tests, made by PEFT itself (the library that writes the adapters users serve):
random A and B (PEFT's default leaves B zero, which would hide an adapter never applied), saved with
`save_pretrained` as `adapter_config.json` and `adapter_model.safetensors`.

Kept out of conftest.py so tests import it by a name no other folder's conftest shares.
"""

from __future__ import annotations

from pathlib import Path

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_lora_adapter(
    dest: Path,
    base_model_dir: str,
    *,
    rank: int = 8,
    alpha: int = 16,
    targets: tuple[str, ...] | str = ALL_TARGETS,
    seed: int = 0,
    std: float = 0.1,
    **lora_config: object,
) -> str:
    """A PEFT LoRA adapter of `base_model_dir` with normal(0, `std`) A and B, saved in `dest`.
    `targets`: module names, or a regular expression PEFT matches whole module paths with."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_model_dir, torch_dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets if isinstance(targets, str) else list(targets),
        init_lora_weights=False,
        **lora_config,
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(str(dest))
    return str(dest)


def peft_greedy_tokens(
    base_model_dir: str, adapter_dir: str | None, prompt_token_ids: list[int], max_new_tokens: int
) -> list[int]:
    """What PEFT's own model generates greedily in float32, with the adapter (or the base model alone)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_model_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = torch.tensor([prompt_token_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt_token_ids) :]]
