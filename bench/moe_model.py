"""A mixture-of-experts checkpoint built from a config (random weights, no model hub), for
bench/throughput.py to measure the experts' path against its peers:

    python bench/moe_model.py /tmp/qwen3-moe
    python bench/throughput.py --model /tmp/qwen3-moe --peers pagedserve,hf-static

The default is Qwen3-30B-A3B's layout at a CPU's scale: 12 layers of 64 experts, 8 a token (its
128 and 8), each expert's intermediate 256 wide against a hidden 768 (its 768 against 2,048), the
default model's tokenizer and vocabulary. `--architecture` picks Mixtral's (8 experts, 2 a token),
Qwen2-MoE's (a shared expert too) or GPT-OSS's (32 experts, 4 a token). Saved by transformers'
`save_pretrained` in bfloat16, so in the hub's layout: a tensor per expert and projection (GPT-OSS's
stacked, as its checkpoints are).
"""

from __future__ import annotations

import argparse

import torch

ARCHITECTURES = {
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {"num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 256},
    ),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 256,
            "shared_expert_intermediate_size": 1024,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 1024},
    ),
    # gpt-oss-20b's: 32 experts, 4 a token, as wide as the hidden size; biases, attention sinks, every
    # other layer sliding by 128
    "gpt-oss": (
        "GptOssConfig",
        {"num_local_experts": 32, "num_experts_per_tok": 4, "intermediate_size": 768},
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dest", help="the directory to write")
    parser.add_argument("--architecture", choices=list(ARCHITECTURES), default="qwen3-moe")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-dir", help="its tokenizer (default: the embedded default model's)")
    args = parser.parse_args()

    import transformers
    from pagedserve.default_model import resolve_model_path

    class_name, experts = ARCHITECTURES[args.architecture]
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer_dir or resolve_model_path(None))
    config = getattr(transformers, class_name)(
        vocab_size=len(tokenizer),
        hidden_size=768,
        intermediate_size=experts.pop("intermediate_size", 2048),
        num_hidden_layers=args.layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **experts,
    )
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.dest)
    tokenizer.save_pretrained(args.dest)
    total = sum(p.numel() for p in model.parameters())
    print(f"{args.architecture}: {total / 1e6:.0f}M parameters, written to {args.dest}")


if __name__ == "__main__":
    main()
