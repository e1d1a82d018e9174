"""Tiny random-weight checkpoints built from a transformers config (a Llama by default), for tests
that need a fast model.

Kept out of conftest.py so tests import it by a name no other folder's conftest shares.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def build_tiny_llama(
    dest: Path,
    tokenizer_dir: str,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    num_layers: int = 2,
    seed: int = 0,
    config_class: str = "LlamaConfig",
    vocab_size: int = 49152,
    **overrides: object,
) -> str:
    """A random-weight Llama (or another Llama-family model: `config_class="Qwen3Config"`) with the
    default model's tokenizer (vocab 49152; a smaller `vocab_size` keeps its first ids). A large init
    range makes its next-token distributions peaked, so greedy decoding has few near-ties."""
    import transformers

    config = getattr(transformers, config_class)(
        vocab_size=vocab_size,
        hidden_size=num_heads * head_dim,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **overrides,
    )
    return save_tiny_model(dest, tokenizer_dir, config, seed=seed)


# `build_tiny_llama`'s overrides for a tiny DeepSeek-V3 (config_class "DeepseekV3Config"): 4 query heads
# over one latent head of 56 + 8, 2 of 8 experts a token in 2 of 4 groups, layer 0 dense
DEEPSEEK_V3 = {
    "num_kv_heads": 4,  # (transformers' MLA expands its keys to every head)
    "kv_lora_rank": 56,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 24,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "moe_intermediate_size": 16,
    "first_k_dense_replace": 1,
}


def build_tiny_qwen2_moe(dest: Path, tokenizer_dir: str, num_experts: int = 6) -> str:
    """A tiny Qwen2-MoE with every part of a block of experts: `num_experts` experts, 2 a token, a
    shared expert under its gate, and layer 1 dense (`mlp_only_layers`)."""
    return build_tiny_llama(
        dest,
        tokenizer_dir,
        config_class="Qwen2MoeConfig",
        num_experts=num_experts,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[1],
    )


def tiny_hybrid_config(name: str) -> object:
    """A tiny hybrid's transformers config (`save_tiny_model` writes its checkpoint): "lfm2" (short
    convolutions at layers 0 and 2), "granite4-h" (Mamba2 at layers 0 and 2), "nemotron-h" (a layer a
    block: Mamba2, MLP, attention, MLP, Mamba2, MLP; its states in float32), "mamba2" (two Mamba2
    layers, no attention), "mamba" (two of Mamba 1's, states of 16), "jamba" (Mamba 1 at layers 0 and 2,
    attention and experts at layer 1), "qwen3.5" (Gated DeltaNet at layers 0 and 2, 4 value heads over 2 key heads), "qwen3-next" (its layers
    as Qwen3-Next stores them, experts at layer 1) or "kimi-linear" (KDA's 2 heads at layers 0 and 2,
    latent attention with q_proj, experts at layer 1), "falcon-h1" (attention and Mamba2 side by side in
    both layers, its gated norm on), "olmo-hybrid" (Gated DeltaNet at layers 0 and 2 as Qwen3.5's),
    "minimax" (lightning attention at layers 0 and 2) or "zamba2"
    (Mamba2 in three layers, a shared attention block before it in two); Mamba2's 8 heads of 16 in 2
    groups with states of 16, in chunks of 8, so prompts cross several and chunked prefill splits
    them anywhere."""
    import transformers

    small = {
        "vocab_size": 49152,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "initializer_range": 0.2,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    if name == "lfm2":
        layers = ["conv", "full_attention", "conv"]
        return transformers.Lfm2Config(
            **small, intermediate_size=96, num_hidden_layers=3, layer_types=layers, conv_bias=True
        )
    if name == "granite4-h":
        return transformers.GraniteMoeHybridConfig(
            **small,
            num_hidden_layers=3,
            layer_types=["mamba", "attention", "mamba"],
            num_local_experts=0,
            shared_intermediate_size=96,
            mamba_n_heads=8,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_chunk_size=8,
        )
    if name == "mamba2":
        mamba2 = {
            key: value
            for key, value in small.items()
            if "attention" not in key and key != "max_position_embeddings"
        }
        return transformers.Mamba2Config(
            **mamba2, num_hidden_layers=2, num_heads=8, head_dim=16, n_groups=2, state_size=16, chunk_size=8
        )
    if name == "jamba":  # attention at layer 1, Mamba at 0 and 2, 2 of 4 experts at layer 1
        return transformers.JambaConfig(
            **small,
            intermediate_size=96,
            num_hidden_layers=3,
            attn_layer_period=2,
            attn_layer_offset=1,
            num_experts=4,
            use_mamba_kernels=False,
        )
    if name == "mamba":
        mamba = {
            key: value
            for key, value in small.items()
            if "attention" not in key and key != "max_position_embeddings"
        }
        return transformers.MambaConfig(**mamba, num_hidden_layers=2, state_size=16)
    qwen3_5 = {
        "head_dim": 32,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "tie_word_embeddings": False,
    }
    if name == "qwen3.5":
        return transformers.Qwen3_5TextConfig(**small, **qwen3_5)
    if name == "qwen3-next":
        return transformers.Qwen3NextConfig(
            **small,
            **qwen3_5,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            decoder_sparse_step=2,
        )
    if name == "falcon-h1":
        return transformers.FalconH1Config(
            **small,
            head_dim=16,
            intermediate_size=96,
            num_hidden_layers=2,
            mamba_d_ssm=64,
            mamba_n_heads=8,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_chunk_size=8,
            mamba_rms_norm=True,
            key_multiplier=0.7,
            ssm_multipliers=[1.1, 0.9, 1.4, 0.75, 1.25],
        )
    if name == "olmo-hybrid":  # Gated DeltaNet at layers 0 and 2 (Qwen3.5's heads), OLMo 3's attention at 1
        return transformers.OlmoHybridConfig(
            **small,
            intermediate_size=96,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        )
    if name == "minimax":  # lightning attention at layers 0 and 2, 2 of 4 experts in every layer
        return transformers.MiniMaxConfig(
            **small,
            intermediate_size=96,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            num_local_experts=4,
        )
    if name == "zamba2":  # Mamba2 in every layer, the shared block before it at layers 1 and 2
        return transformers.Zamba2Config(
            **small,
            intermediate_size=96,
            num_hidden_layers=3,
            layers_block_type=["mamba", "hybrid", "hybrid"],
            use_mem_rope=True,
            adapter_rank=8,
            n_mamba_heads=8,
            mamba_ngroups=2,
            mamba_d_state=16,
            chunk_size=8,
        )
    if name == "kimi-linear":
        return transformers.KimiLinearConfig(
            **small,
            intermediate_size=96,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "dense"],
            linear_num_heads=2,
            linear_head_dim=16,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            tie_word_embeddings=False,
        )
    assert name == "nemotron-h", name
    return transformers.NemotronHConfig(
        **small,
        head_dim=16,
        intermediate_size=96,
        layers_block_type=["mamba", "mlp", "attention", "mlp", "mamba", "mlp"],
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=16,
        chunk_size=8,
    )


def save_tiny_model(dest: Path, tokenizer_dir: str, config: object, *, seed: int = 0) -> str:
    """A random-weight checkpoint of any transformers causal-LM `config` (its class picks the
    architecture), saved as a Hugging Face directory with the default model's tokenizer. Biases are
    random too (transformers initializes them to zero, which would hide a bias never applied), so are
    Qwen3's query and key norms and DeepSeek's latents' (ones would hide a weight never applied), Gemma's norms (zeros,
    its 1 + weight), OLMo's norms, GPT-OSS's attention sinks and GLM-4.5's expert-picking bias, and a tied LM head is left
    out of the weights, as transformers saves it."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    if hasattr(config, "vision_config"):  # (Qwen3.5's config also maps to a text-only causal LM)
        model = AutoModelForImageTextToText.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".bias", "_bias")):  # (GPT-OSS's experts' `gate_up_proj_bias`...)
                param.normal_(0.0, 0.2)
            elif name.endswith(".sinks"):  # GPT-OSS's: large enough to move the outputs
                param.normal_(3.0, 2.0)
            elif name.endswith(
                (
                    ".q_norm.weight",
                    ".k_norm.weight",
                    ".query_layernorm.weight",
                    ".key_layernorm.weight",
                    ".q_a_layernorm.weight",  # DeepSeek's latents' norms
                    ".kv_a_layernorm.weight",
                )
            ) or re.search(r"_layernorm\.norms\.\d+\.weight$", name):  # (StableLM's head norms)
                param.normal_(1.0, 0.5)
            if (
                name.endswith("norm.weight")
                and type(model).__name__.startswith(("Gemma", "VaultGemma", "Qwen3_5", "Qwen3Next"))
                and not type(model).__name__.startswith(("Gemma4", "Gemma3n"))  # (their norms: by the weight)
            ):
                param.normal_(
                    0.0, 0.5
                )  # Gemma, Qwen3.5 and Qwen3-Next scale by 1 + weight: zeros would hide the weight
            elif re.search(r"\.[qk]_norm\.weight$", name) and type(model).__name__.startswith(
                ("Gemma4", "Gemma3n")
            ):
                param.normal_(0.5, 0.2)  # (Gemma 4 and 3n leave q.k unscaled: their head norms scale it)
            elif name.endswith(".altup.correct_output_scale"):  # Gemma 3n's (zeros would hide it)
                param.normal_(1.0, 0.3)
            elif re.search(r"(layernorm_[12]\.weight|\.router\.scale|\.per_expert_scale)$", name):
                param.normal_(1.0, 0.3)  # Gemma 4's experts' norms and router scales
            elif (
                name.endswith("norm.weight")
                and type(model).__name__.startswith(
                    (
                        "Olmo",
                        "FlexOlmo",
                        "Starcoder2",
                        "StableLm",
                        "GPTNeoX",
                        "PhiForCausalLM",
                        "Jais2",
                        "Lfm2",
                        "Lfm3",
                        "NemotronH",
                        "Bamba",
                        "FalconH1",
                        "Cohere",
                        "OPT",
                        "Gemma4",
                        "Gemma3n",
                        "Zamba2",
                        "Helium",
                        "Falcon",
                        "Jamba",
                        "HyperCLOVAX",
                        "Afmoe",
                        "Bloom",
                        "Persimmon",
                        "BioGpt",
                    )
                )
                or re.search(r"\.(ln|norm)_([12f]|attn|mlp)\.weight$", name)
            ):
                param.normal_(
                    1.0, 0.5
                )  # OLMo's norms placed otherwise than Llama's, LayerNorms, LFM2's names: each one's weight
            elif name.endswith("norm.weight") and type(model).__name__.startswith("Nemotron"):
                param.normal_(0.0, 0.5)  # (LayerNorm1P: scaled by 1 + weight)
            elif name.endswith((".act_fn.alpha_p", ".act_fn.alpha_n")) or re.search(
                r"\.(mamba|mixer|linear_attn)\.(A_log|dt_bias)$", name
            ):
                param.normal_(0.0, 0.5)  # Apertus's xIELU, each layer its own; Mamba2's, each head its own
            elif re.search(
                r"\.(mamba|mixer|linear_attn)\.(D|norm\.weight)$", name
            ):  # (ones would hide one never applied)
                param.normal_(1.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith(
                ("e_score_correction_bias", ".expert_bias")
            ):  # GLM-4.5's, LFM2-MoE's: zeros would hide the bias never added
                buffer.normal_(0.0, 0.3)
            elif name.endswith(".layer_scalar"):  # Gemma 4's: ones would hide a scalar never applied
                buffer.uniform_(0.5, 1.5)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):  # (BioGPT's head is `output_projection`)
        del state["output_projection.weight" if "output_projection.weight" in state else "lm_head.weight"]
    weights, kept = {}, set()
    for name, tensor in state.items():  # a tensor tied to an earlier one left out (Zamba2's shared blocks)
        if tensor.data_ptr() not in kept:
            kept.add(tensor.data_ptr())
            weights[name] = tensor.contiguous()
    dest.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config_dict = config.to_dict()  # type: ignore[attr-defined]
    config_dict["architectures"] = [type(model).__name__]
    (dest / "config.json").write_text(json.dumps(config_dict, indent=2))
    copy_tokenizer(tokenizer_dir, dest)
    return str(dest)


def copy_tokenizer(source: str | Path, dest: Path) -> None:
    """The tokenizer's files of `source` (those of TOKENIZER_FILES it holds) into the directory `dest`."""
    for name in TOKENIZER_FILES:
        if (Path(source) / name).exists():
            shutil.copy(Path(source) / name, dest / name)


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def quantize_mxfp4(weight: object) -> tuple[object, object]:
    """[..., in] -> MXFP4 blocks [..., in / 32, 16] and scales [..., in / 32] (uint8), as OpenAI's
    checkpoints store them: each group of 32 scaled by a power of two so that its largest value is
    at most 6, each value rounded to the nearest FP4 code, two codes a byte (the low nibble first)."""
    import torch

    assert isinstance(weight, torch.Tensor)
    groups = weight.float().unflatten(-1, (-1, 32))  # [..., G, 32]
    largest = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(largest / 6.0)).clamp(-127, 127)
    lut = torch.tensor(FP4_VALUES)
    codes = ((groups / torch.exp2(exponent)[..., None])[..., None] - lut).abs().argmin(dim=-1)
    codes = codes.to(torch.uint8).unflatten(-1, (16, 2))
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def save_mxfp4_gpt_oss(dest: Path, model_dir: str) -> str:
    """`model_dir`'s GPT-OSS checkpoint (transformers' layout) with its experts' projections in MXFP4,
    as OpenAI released gpt-oss-20b and -120b: `mlp.experts.gate_up_proj_blocks`/`_scales` [experts,
    out, in / 32, ...] in place of `gate_up_proj` [experts, in, out] (and the down projection's
    likewise), config.json's quantization_config saying mxfp4."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(weights.pop(name).transpose(1, 2))
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
    shutil.copytree(model_dir, dest)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return str(dest)


# the linear layers' weights an FP8 checkpoint quantizes, a multimodal one's text decoder's (embeddings, norms, routers and the LM head
# stay in the model's dtype, as DeepSeek's and Qwen's FP8 releases keep them)
FP8_WEIGHTS = re.compile(r"^model\.(language_model\.)?layers\..*_proj(_with_mqa)?\.weight$")
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_fp8(
    weight: object, block: tuple[int, int] | None, per_row: bool = False
) -> tuple[object, object]:
    """[rows, cols] -> float8_e4m3fn values and float32 scales (the weight is their product): one a
    block of `block` (the last ones partial; [ceil(rows / b0), ceil(cols / b1)]), one a row
    ([rows, 1]) or one for the tensor ([]), each the amax over its values / 448."""
    import torch

    assert isinstance(weight, torch.Tensor)
    w = weight.float()
    rows, cols = w.shape
    if block is not None:
        b0, b1 = block
        padded = torch.zeros(-(-rows // b0) * b0, -(-cols // b1) * b1)
        padded[:rows, :cols] = w.abs()
        amax = padded.unflatten(0, (-1, b0)).unflatten(2, (-1, b1)).amax(dim=(1, 3))
        scale = amax.clamp(min=1e-12) / FP8_MAX
        expanded = scale.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    elif per_row:
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        expanded = scale
    else:
        scale = w.abs().amax().clamp(min=1e-12) / FP8_MAX
        expanded = scale
    return (w / expanded).to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def compressed_tensors(
    checkpoint_format: str,
    weights: dict[str, object],
    activations: dict[str, object] | None = None,
    **extra: object,
) -> dict[str, object]:
    """A compressed-tensors quantization_config (llm-compressor's) of one group: every Linear layer
    but the LM head, its `weights` (and input `activations`) quantized as given."""
    group: dict[str, object] = {"targets": ["Linear"], "weights": weights}
    if activations is not None:
        group["input_activations"] = activations
    return {
        "quant_method": "compressed-tensors",
        "format": checkpoint_format,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        **extra,
    }


FP8_LAYOUTS = {
    # DeepSeek-V3's, Qwen3-*-FP8's (transformers' FineGrainedFP8): a scale a block, weight_scale_inv
    "fp8-block": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [8, 8],
    },
    # vLLM's own FP8 serialization: a scale a tensor, static activation scales beside
    "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
    # Meta's Llama 3.1 405B FP8: a scale a row, activation bounds beside
    "fbgemm": {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": 1200.0,
        "modules_to_not_convert": ["lm_head"],
    },
    # Red Hat's FP8-dynamic (llm-compressor): a scale a row, KV-cache scales beside
    "compressed-tensors": compressed_tensors(
        "float-quantized",
        {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True},
        {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True},
        kv_cache_scheme={"type": "float", "num_bits": 8, "strategy": "tensor"},
    ),
}


def save_quantized_pair(
    dest: Path,
    model_dir: str,
    quant: dict[str, object],
    quantized: dict[str, object],
    products: dict[str, object],
) -> tuple[str, str]:
    """`model_dir` copied twice: to `dest` with the `quantized` tensors and config.json's
    quantization_config `quant`, and beside it (`dest`-products) with the weights those make."""
    from safetensors.torch import save_file

    product_dir = dest.with_name(f"{dest.name}-products")
    for directory, tensors in ((dest, quantized), (product_dir, products)):
        shutil.copytree(model_dir, directory)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = quant
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return str(dest), str(product_dir)


def save_fp8(dest: Path, model_dir: str, layout: str) -> tuple[str, str]:
    """`model_dir`'s checkpoint with its layers' linear weights (FP8_WEIGHTS) in FP8 as `layout`
    (FP8_LAYOUTS) stores them, beside the scales a loader drops (activations', the KV cache's):
    returns that directory and a copy of the checkpoint holding each weight as the product its FP8
    values and scales make (float32), to hold a loader to."""
    import torch
    from safetensors.torch import load_file

    quant = FP8_LAYOUTS[layout]
    block = quant.get("weight_block_size")
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    quantized, products = dict(weights), dict(weights)
    for name in [n for n in weights if FP8_WEIGHTS.match(n)]:
        values, scale = quantize_fp8(
            weights[name], None if block is None else tuple(block), layout in ("fbgemm", "compressed-tensors")
        )
        quantized[name] = values
        quantized[name + ("_scale_inv" if layout == "fp8-block" else "_scale")] = scale
        if layout in ("fp8-tensor", "compressed-tensors"):
            quantized[name.replace(".weight", ".input_scale")] = torch.tensor(0.05)
        if layout == "fbgemm":
            quantized[name.replace(".weight", ".input_scale_ub")] = torch.tensor([1200.0])
        if layout == "compressed-tensors" and name.endswith(".k_proj.weight"):
            attention = name.removesuffix(".k_proj.weight")
            quantized[attention + ".k_scale"], quantized[attention + ".v_scale"] = (
                torch.tensor(0.1),
                torch.tensor(0.1),
            )
        if block is None:
            products[name] = values.float() * scale
        else:
            rows, cols = values.shape
            expanded = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
            products[name] = values.float() * expanded
    return save_quantized_pair(dest / layout, model_dir, quant, quantized, products)


def pack_int32(values: object, bits: int, order: tuple[int, ...] | None = None) -> object:
    """[rows, cols] ints of `bits` -> [rows, cols * bits / 32] int32: int c holds columns c * pack + i
    from its low bits up, or column c * pack + order[i] as its i-th value (AWQ's)."""
    import torch

    assert isinstance(values, torch.Tensor)
    pack = 32 // bits
    order = order or tuple(range(pack))
    packed = torch.zeros(values.shape[0], values.shape[1] // pack, dtype=torch.int64)
    for c in range(packed.shape[1]):
        for i in range(pack):
            packed[:, c] |= values[:, c * pack + order[i]].long() << (bits * i)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # (the top bit is the sign)


def quantize_int(weight: object, bits: int, groups: object, symmetric: bool) -> tuple[object, object, object]:
    """[out, in] -> ints [out, in], scales and zero points [out, num groups], each input in the group
    `groups` [in] names: unsigned ints of `bits` with a zero point where not `symmetric`, else signed
    ones (zero points 0). The weight is (ints - zero point) x scale."""
    import torch

    assert isinstance(weight, torch.Tensor) and isinstance(groups, torch.Tensor)
    w = weight.float()
    num_groups = int(groups.max()) + 1
    scales, zeros = torch.empty(w.shape[0], num_groups), torch.zeros(w.shape[0], num_groups)
    ints = torch.empty(w.shape, dtype=torch.long)
    for g in range(num_groups):
        cols = w[:, groups == g]
        if symmetric:
            scales[:, g] = cols.abs().amax(dim=1).clamp(min=1e-8) / (2 ** (bits - 1) - 1)
            q = torch.round(cols / scales[:, g : g + 1]).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        else:
            low, high = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            scales[:, g] = ((high - low) / (2**bits - 1)).clamp(min=1e-8)
            zeros[:, g] = torch.round(-low / scales[:, g]).clamp(0, 2**bits - 1)
            q = (torch.round(cols / scales[:, g : g + 1]) + zeros[:, g : g + 1]).clamp(0, 2**bits - 1)
        ints[:, groups == g] = q.long()
    return ints, scales, zeros.long()


INT_LAYOUTS = {
    # AutoGPTQ's v1 files, 4 bits, symmetric (zero points of 8, stored as 7)
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
    # GPTQModel's v2 files, 8 bits, act order: each input's group by g_idx
    "gptq-act-order": {
        "quant_method": "gptq",
        "bits": 8,
        "group_size": 32,
        "desc_act": True,
        "sym": False,
        "checkpoint_format": "gptq_v2",
    },
    # AutoAWQ's GEMM files
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    # Red Hat's W4A16 (llm-compressor)
    "w4a16": compressed_tensors(
        "pack-quantized",
        {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": True},
    ),
    # llm-compressor's asymmetric W4A16: zero points packed along the outputs
    "w4a16-asymmetric": compressed_tensors(
        "pack-quantized",
        {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": False},
    ),
    # Red Hat's W8A16, act order (GPTQ's, in llm-compressor): each input's group by weight_g_idx
    "w8a16-act-order": compressed_tensors(
        "pack-quantized",
        {"type": "int", "num_bits": 8, "strategy": "group", "group_size": 32, "actorder": "group"},
    ),
    # asymmetric int8 weights a channel, their zero points int8 as they are
    "w8a8-asymmetric": compressed_tensors(
        "int-quantized",
        {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": False},
        {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": False},
    ),
    # Red Hat's W8A8 int8 (llm-compressor)
    "w8a8": compressed_tensors(
        "int-quantized",
        {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True},
        {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True},
        kv_cache_scheme={"type": "float", "num_bits": 8, "strategy": "tensor"},
    ),
}


def save_int_quantized(dest: Path, model_dir: str, layout: str) -> tuple[str, str]:
    """`model_dir`'s checkpoint with its layers' linear weights (FP8_WEIGHTS' names) in ints as
    `layout` (INT_LAYOUTS) stores them: returns that directory and a copy holding each weight as the
    product its ints, zero points and scales make (float32), to hold a loader to."""
    import torch
    from safetensors.torch import load_file

    quant = INT_LAYOUTS[layout]
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    quantized, products = dict(weights), dict(weights)
    generator = torch.Generator().manual_seed(0)
    scheme = quant["config_groups"]["group_0"]["weights"] if "config_groups" in quant else quant
    bits = scheme.get("bits") or scheme["num_bits"]
    symmetric = scheme.get("sym", scheme.get("symmetric", True)) and layout != "awq"
    for name in [n for n in weights if FP8_WEIGHTS.match(n)]:
        weight = quantized.pop(name)
        layer = name.removesuffix(".weight")
        num_inputs = weight.shape[1]
        groups = torch.arange(num_inputs) // 32
        if scheme.get("strategy") == "channel":
            groups = torch.zeros(num_inputs, dtype=torch.long)
        if layout.endswith("act-order"):  # (each group's inputs scattered, as act order leaves them)
            groups = groups[torch.randperm(num_inputs, generator=generator)]
        ints, scales, zeros = quantize_int(weight, bits, groups, symmetric=symmetric)
        if layout == "gptq":  # (GPTQ's symmetric ints: unsigned about a zero point of 2^(bits - 1))
            ints, zeros = ints + 2 ** (bits - 1), torch.full_like(zeros, 2 ** (bits - 1))
        if layout.startswith("gptq") or layout == "awq":
            scales = scales.half()
            stored_zeros = zeros - 1 if layout == "gptq" else zeros
            order = (0, 2, 4, 6, 1, 3, 5, 7) if layout == "awq" else None
            if layout == "awq":
                quantized[layer + ".qweight"] = pack_int32(ints.T, bits, order)
            else:
                quantized[layer + ".qweight"] = pack_int32(ints, bits).T.contiguous()
            quantized[layer + ".qzeros"] = pack_int32(stored_zeros.T & (2**bits - 1), bits, order)
            quantized[layer + ".scales"] = scales.T.contiguous()
            if layout == "gptq-act-order":
                quantized[layer + ".g_idx"] = groups.int()
            if layout.startswith("gptq"):  # (AutoGPTQ saves a bias for every layer, zeros where none)
                quantized[layer + ".bias"] = torch.zeros(weight.shape[0], dtype=torch.float16)
        elif quant["format"] == "pack-quantized":
            # (stored signed, offset by 2^(bits - 1) when packed: asymmetric ints and zero points are
            # unsigned here, so they pack as they are)
            offset = 2 ** (bits - 1) if symmetric else 0
            scales = scales.bfloat16()
            quantized[layer + ".weight_packed"] = pack_int32(ints + offset, bits)
            quantized[layer + ".weight_scale"] = scales
            quantized[layer + ".weight_shape"] = torch.tensor(list(weight.shape))
            if not symmetric:
                quantized[layer + ".weight_zero_point"] = pack_int32(zeros.T, bits).T.contiguous()
            if layout.endswith("act-order"):
                quantized[layer + ".weight_g_idx"] = groups.int()
        else:
            scales = scales.bfloat16()
            signed = ints if symmetric else ints - 128
            quantized[name], quantized[layer + ".weight_scale"] = signed.to(torch.int8), scales
            if not symmetric:
                quantized[layer + ".weight_zero_point"] = (zeros - 128).to(torch.int8)
            if name.endswith(".k_proj.weight"):  # (its kv_cache_scheme's scales, read by nothing)
                attention = layer.removesuffix(".k_proj")
                quantized[attention + ".k_scale"], quantized[attention + ".v_scale"] = (
                    torch.tensor(0.1),
                    torch.tensor(0.1),
                )
        products[name] = (ints - zeros[:, groups]).float() * scales.float()[:, groups]
    return save_quantized_pair(dest / layout, model_dir, quant, quantized, products)
