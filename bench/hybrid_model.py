"""A hybrid checkpoint built from a config (random weights, no model hub), for bench/throughput.py to
measure the layers with a state per request (`layers.recurrent`) against their peers:

    python bench/hybrid_model.py /tmp/lfm2
    python bench/throughput.py --model /tmp/lfm2 --peers pagedserve,hf-static

`lfm2` (the default) is LFM2-350M's shape: hidden 1,024, 16 layers, attention (16 heads, 8 KV heads)
at layers 2, 5, 8, 10, 12 and 14 and short convolutions of 3 taps at the other ten, an MLP 4,608 wide
(block_ff_dim 6,656). `granite4-h` is a Granite 4.0-H layout at a CPU's scale: hidden 768, 12 layers,
every fourth attention (12 heads, 4 KV heads, no rope), the others Mamba2 (24 heads of 64, a state of
128, one group, convolutions of 4 taps), a dense shared MLP 2,048 wide. `qwen3.5` is a Qwen3.5 layout at a CPU's scale: hidden 1,024,
12 layers, every fourth gated full attention (8 heads of 128, 2 KV heads, a quarter of each turned),
the others Gated DeltaNet (4 key heads and 8 value heads of 128, convolutions of 4 taps), an MLP
3,072 wide. `kimi-linear` is a Kimi Linear layout at a CPU's scale: hidden 1,024, 12 layers, every
fourth DeepSeek latent attention without rotary (8 heads, a latent of 256 + 32), the others Kimi Delta
Attention (8 heads of 128, convolutions of 4 taps), layer 0's MLP dense (3,072), the others 2 of 16
experts of 512 beside a shared one (its LM head untied, as Kimi's). `falcon-h1` is a Falcon-H1 layout
at a CPU's scale: hidden 1,024, 12 layers, each attention (8 heads of 128, 2 KV heads) beside Mamba2
(16 heads of 64, a state of 128, one group), an MLP 2,048 wide. `mamba` is mamba-130m's shape (Mamba
1, no attention): hidden 768, 24 layers of 1,536 channels, each a state of 16, convolutions of 4 taps.
`minimax` is a MiniMax-Text-01 layout at a CPU's scale: hidden 1,024, 12 layers, every fourth softmax
attention (8 heads of 128, 2 KV heads), the others lightning attention (8 heads of 128), 2 of 8
experts of 1,024 in every layer.
Each with the default model's
tokenizer and vocabulary, saved by transformers' `save_pretrained` in bfloat16.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "lfm2": (
        "Lfm2Config",
        {
            "hidden_size": 1024,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "block_ff_dim": 6656,
            "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
        },
    ),
    "granite4-h": (
        "GraniteMoeHybridConfig",
        {
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "layer_types": ["attention" if i % 4 == 3 else "mamba" for i in range(12)],
            "num_local_experts": 0,
            "shared_intermediate_size": 2048,
            "mamba_n_heads": 24,
            "mamba_d_head": 64,
            "mamba_d_state": 128,
            "mamba_n_groups": 1,
            "position_embedding_type": "nope",
        },
    ),
    "qwen3.5": (
        "Qwen3_5TextConfig",
        {
            "hidden_size": 1024,
            "num_hidden_layers": 12,
            "intermediate_size": 3072,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
        },
    ),
    "falcon-h1": (
        "FalconH1Config",
        {
            "hidden_size": 1024,
            "num_hidden_layers": 12,
            "intermediate_size": 2048,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "mamba_d_ssm": 1024,
            "mamba_n_heads": 16,
            "mamba_n_groups": 1,
            "mamba_d_state": 128,
        },
    ),
    "mamba": (
        "MambaConfig",
        {"hidden_size": 768, "num_hidden_layers": 24, "state_size": 16, "expand": 2, "conv_kernel": 4},
    ),
    "minimax": (
        "MiniMaxConfig",
        {
            "hidden_size": 1024,
            "num_hidden_layers": 12,
            "intermediate_size": 1024,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(12)],
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        },
    ),
    "kimi-linear": (
        "KimiLinearConfig",
        {
            "hidden_size": 1024,
            "num_hidden_layers": 12,
            "intermediate_size": 3072,
            "num_attention_heads": 8,
            "kv_lora_rank": 256,
            "q_lora_rank": None,
            "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 32,
            "v_head_dim": 64,
            "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(12)],
            "linear_num_heads": 8,
            "linear_head_dim": 128,
            "num_local_experts": 16,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 512,
            "tie_word_embeddings": False,  # (transformers' Kimi Linear ties nothing)
        },
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dest", help="the directory to write")
    parser.add_argument("--architecture", choices=list(ARCHITECTURES), default="lfm2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-dir", help="its tokenizer (default: the embedded default model's)")
    args = parser.parse_args()

    import transformers
    from pagedserve.default_model import resolve_model_path

    class_name, shape = ARCHITECTURES[args.architecture]
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer_dir or resolve_model_path(None))
    config = getattr(transformers, class_name)(
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{"tie_word_embeddings": True, **shape},
    )
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.dest)
    tokenizer.save_pretrained(args.dest)
    total = sum(p.numel() for p in model.parameters())
    print(f"{args.architecture}: {total / 1e6:.0f}M parameters, written to {args.dest}")


if __name__ == "__main__":
    main()
