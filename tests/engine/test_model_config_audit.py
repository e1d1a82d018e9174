"""The config.json options of the Llama family that change outputs (Qwen2's biases, Qwen3's query and
key norms, linear, llama3 and yarn rope scaling in the 4.x and 5.x formats, an explicit head_dim,
attention and MLP biases, tied embeddings, sliding windows, Granite's multipliers, Phi-3's fused
checkpoint tensors and partial rotary, Gemma's layers, the mixtures of experts of Mixtral, Qwen2-MoE
and Qwen3-MoE), each held to transformers on a tiny random-weight checkpoint; and the options
pagedserve does not implement, refused at load naming the option.

Greedy float32 outputs equal transformers' `generate` (a divergence passes only at a near-tie, as in
test_hf_parity.py), their logprobs its logprobs. bfloat16 rounds differently from transformers' float32 reference, so its greedy
tokens part from it within a few steps (as transformers' own bfloat16 tokens do); each token it picks
is instead held to within BF16_GAP of transformers' float32 best choice on the same context."""

from __future__ import annotations

import inspect
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pagedserve import LLM, SamplingParams
from pagedserve.layers.rotary import RotaryEmbedding
from test_compile import decode_layers_available
from test_hf_parity import (
    assert_greedy_equal,
    assert_hf_greedy_choices,
    hf_greedy,
    hf_model,
    hf_next_token_logprobs,
)
from tiny_models import DEEPSEEK_V3, save_mxfp4_gpt_oss, save_tiny_model
from transformers import (
    AfmoeConfig,
    ApertusConfig,
    ArceeConfig,
    BambaConfig,
    BioGptConfig,
    BloomConfig,
    Cohere2Config,
    Cohere2MoeConfig,
    CohereConfig,
    CwmConfig,
    DbrxConfig,
    DeepseekV2Config,
    DeepseekV3Config,
    Dots1Config,
    Ernie4_5_MoeConfig,
    Ernie4_5Config,
    Exaone4Config,
    ExaoneMoeConfig,
    FalconConfig,
    FalconH1Config,
    FalconMambaConfig,
    FlexOlmoConfig,
    Gemma2Config,
    Gemma3nTextConfig,
    Gemma3TextConfig,
    Gemma4TextConfig,
    GemmaConfig,
    Glm4Config,
    Glm4MoeConfig,
    Glm4MoeLiteConfig,
    GlmConfig,
    GPT2Config,
    GPTBigCodeConfig,
    GPTJConfig,
    GPTNeoConfig,
    GPTNeoXConfig,
    GptOssConfig,
    GraniteConfig,
    GraniteMoeConfig,
    GraniteMoeHybridConfig,
    GraniteMoeSharedConfig,
    GraniteMoeSWAConfig,
    GraniteSWAConfig,
    HeliumConfig,
    HunYuanDenseV1Config,
    HunYuanMoEV1Config,
    HyperCLOVAXConfig,
    HYV3Config,
    InternLM3Config,
    Jais2Config,
    JambaConfig,
    KimiLinearConfig,
    Lfm2Config,
    Lfm2MoeConfig,
    Lfm3Config,
    Llama4TextConfig,
    Mamba2Config,
    MambaConfig,
    MellumConfig,
    MiniCPM3Config,
    MiniCPM5MoeConfig,
    MiniMaxConfig,
    MiniMaxM2Config,
    Ministral3Config,
    MinistralConfig,
    MistralConfig,
    MixtralConfig,
    MptConfig,
    NanoChatConfig,
    NemotronConfig,
    NemotronHConfig,
    Olmo2Config,
    Olmo3Config,
    OlmoConfig,
    OlmoeConfig,
    OlmoHybridConfig,
    OPTConfig,
    PersimmonConfig,
    Phi3Config,
    PhiConfig,
    PhimoeConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    SeedOssConfig,
    SmolLM3Config,
    SolarOpenConfig,
    StableLmConfig,
    Starcoder2Config,
    VaultGemmaConfig,
    YoutuConfig,
    Zamba2Config,
)

TINY = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "initializer_range": 0.2,  # peaked next-token distributions: few near-ties
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
# Qwen3.5's linear attention at a tiny scale, its attention's heads of 32 (8 dimensions turned)
QWEN3_5_LINEAR = {
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
# Llama 3.1's rope with a pretraining length of 64: prompts of 300+ tokens run far past it, and with
# head_dim 16 and theta 5e5 six of the eight frequencies are scaled or smoothed.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# Qwen's YaRN for 4x its pretraining length: prompts of 300+ tokens run past 256, and the attention
# factor (0.1 ln 4 + 1) scales every cos and sin.
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
# Phi-4-mini's rope on a tiny scale: LongRoPE over 3/4 of each 16-dimension head (6 pairs), pretrained
# on 256 positions and stretched to 1,024 (an attention factor of sqrt(1 + ln 4 / ln 256))
PHI3_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 1e4,
    "partial_rotary_factor": 0.75,
    "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.3],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
}
MAX_TOKENS = 16
# Measured on these checkpoints: transformers' own bfloat16 tokens sit at most 0.21 below its float32
# best (ours at most 0.21 too); a model that drops its rope scaling or a bias sits ~10 below.
BF16_GAP = 0.5
# ... but for experts that flip in bfloat16 on these checkpoints (Phi-3.5-MoE's sparsemixer margins,
# Hunyuan-A13B's near-tied picks): there transformers' own bfloat16 tokens sit 1.8-3.0 below, and ours
# are held to within 0.05 of its
BF16_AS_TRANSFORMERS = {
    "phimoe-sparsemixer-longrope-mscale-biases",
    "phimoe-defaults",
    "hunyuan-a13b-experts-per-layer-shared-mlp",
}
# Granite's multipliers, each away from 1 and from the others (its attention scale in place of 16^-0.5)
GRANITE_SCALES = {
    "embedding_multiplier": 12.0,
    "attention_multiplier": 0.1,
    "residual_multiplier": 0.22,
    "logits_scaling": 8.0,
}
# `decode_layers` takes a qkv bias alone (Granite's multipliers, Phi-3's partial rotary and SmolLM3's
# NoPE layers it runs) and no Gemma layer (worker/fused_decode.py): these run without it
NOT_DECODE_LAYERS = {
    "biogpt-scaled-embeddings-offset-positions",
    "persimmon-head-layernorms-half-rotary-relu2",
    "hunyuan-a13b-experts-per-layer-shared-mlp",
    "phimoe-sparsemixer-longrope-mscale-biases",
    "phimoe-defaults",
    "dbrx-clamped-wqkv-stacked-expert-rows",
    "dbrx-defaults-one-kv-head",
    "bloom-alibi-embedding-norm-fused-heads",
    "bloom-6-heads-interleaved-slopes",
    "mpt-alibi-no-biases-wqkv",
    "mpt-6-heads-mpt-order-slopes",
    "qwen3.5-moe-shared-expert",
    "qwen3.5-delta-attention-delta-biases",
    "qwen3.5-by-interval-tied",
    "qwen3-next-sparse-step-dense-layer-unnormalized",
    "qwen3-next-as-qwen-leaves-it",
    "kimi-linear-kda-mla-kda-kda-experts",
    "kimi-linear-as-moonshot-names-it",
    "mamba2-no-attention",
    "bamba-mamba-attention-mamba-biases",
    "bamba-as-ibm-names-it",
    "lfm2-moe-dense-layer-0-sigmoid-biased-experts",
    "nemotron-h-mamba-mlp-attention-mlp-mamba-mlp",
    "nemotron-h-as-nvidia-names-it",
    "nemotron3-mamba-experts-attention-experts",
    "falcon-h1-multipliers-biases-norm-before-gate",
    "falcon-h1-as-tii-leaves-it",
    "llama4-experts-every-other-layer-nope-temperature",
    "granite4-h-mamba-attention-mamba",
    "granite4-h-experts-hub-names",
    "lfm2-conv-attention-conv-conv",
    "lfm2-as-the-hub-names-it",
    "llama-attention-and-mlp-bias",
    "qwen3-tied-head-dim-32-attention-bias",
    "granite-tied-biases",
    "gemma",
    "gemma-legacy-gelu",
    "gemma2-softcaps",
    "gemma2-default-softcaps",
    "gemma3",
    "gemma3-linear-rope-4.x-config-softcap",
    "mixtral-4-experts",
    "qwen2-moe-shared-expert-dense-layer-0",
    "qwen3-moe-norm-topk",
    "granitemoe-tied-biases",
    "gpt-oss-sinks-clamped-experts",
    "ministral3-yarn-query-scaling-window-40",
    "seed-oss-biases",
    "glm4-moe-grouped-biased-routing",
    "ernie4.5-moe-biased-picking",
    "hunyuan-alpha-rope-norms-after-rotary",
    "cohere2-parallel-sliding-rope-global-nope",
    "cohere-head-layernorms-default-theta",
    "cohere2-moe-dense-prefix-averaged-shared-expert",
    "cohere2-moe-rmsnorm-sigmoid-summed",
    "minimax-m2-whole-qk-norms-partial-rope-sigmoid-biased-experts",
    "minimax-m2-as-minimax-names-it",
    "exaone4-sliding-rope-global-nope",
    "exaone4-no-window",
    "ernie4.5-biases-default-tie",
    "glm4-partial-interleaved-rotary",
    "olmo2",
    "olmo2-attention-bias-tied",
    "olmo3-yarn-global-layers-4.x-config",
    "olmo3-sliding-theta-default-layer-types",
    "olmoe-clip-qkv",
    "youtu-mla-dense-tied",
    "flex-olmo-post-norms-experts",
    "deepseek-v3-mla-yarn-grouped-experts-4.x-config",
    "deepseek-v2-lite-q-proj-greedy-experts",
    "deepseek-v2-group-limited-biases",
    "glm4-moe-lite-neox-rope-layer-types",
    "arcee-relu2-yarn",
    "nemotron-layernorm1p-half-rotary-biases",
    "starcoder2-gelu-biases-window-tied",
    "apertus-xielu-head-norms-default-rope",
    "dots1-grouped-experts-window-from-layer-1",
    "internlm3-biases-default-head-dim",
    "granitemoeshared-shared-expert",
    "minicpm3-mla-mup-scales-longrope",
    "stablelm-layernorms-quarter-rotary-qkv-bias",
    "stablelm-parallel-residual-head-norms",
    "stablelm-head-norms",
    "gpt-neox-parallel-its-own-rope-names",
    "gpt-neox-sequential",
    "phi2-parallel-biased-head",
    "jais2-layernorms-relu2-default-biases",
    "solar-open-every-layer-experts-default-theta",
    "exaone-moe-sliding-nope-global-experts-from-layer-1",
    "olmo1-non-affine-layernorms-clip-qkv",
    "helium-float32-norms-interleaved-rotary-default-theta",
    "hy-v3-sigmoid-biased-experts-shared-default-theta",
    "hyperclovax-post-norms-multiplied-logits",
    "hyperclovax-no-post-norms-default-multipliers",
    "granite-swa-sinks-windows-layer-thetas",
    "granitemoe-swa-experts-sinks-windows",
    "afmoe-gated-attention-sandwich-norms-experts-mup",
    "vaultgemma-no-norms-after",
    "gemma4-k-eq-v-proportional-rope-repeated-kv-heads",
    "gemma4-default-layer-types-as-google-names-it",
    "gemma4-experts-beside-the-mlp",
    "gemma4-per-layer-embeddings-shared-kv-layers",
    "gemma3n-altup-laurel-sparse-gates-shared-kv",
    "zamba2-shared-blocks-adapters-rope",
    "minimax-lightning-attention-post-norm-factors",
    "lfm3-sliding-layer-proportional-rope",
    "olmo-hybrid-delta-attention-delta",
    "minicpm5-moe-gated-attention-grouped-experts",
    "mellum-sliding-layers-own-rope-dense-first",
    "mellum-defaults",
    "minicpm5-moe-as-openbmb-names-it",
    "olmo-hybrid-defaults",
    "olmo-hybrid-nope",
    "lfm3-defaults",
    "minimax-defaults",
    "zamba2-defaults",
    "gemma3n-defaults",
    "mamba-selective-scan-tied",
    "jamba-mamba-attention-experts",
    "falcon-mamba-normed-b-c-dt",
    "falcon-7b-multi-query-one-norm",
    "falcon-40b-grouped-kv-two-norms-biases",
    "falcon-sequential-heads-side-by-side",
    "gpt2-learned-positions-conv1d-fused-qkv",
    "gptj-parallel-interleaved-partial-rotary-biased-head",
    "nanochat-weightless-norms-reversed-rotary-softcap",
    "gpt-neo-unscaled-local-layer-1",
    "gpt-bigcode-multi-query",
    "gpt-bigcode-heads-side-by-side-unscaled",
    "opt-relu-offset-positions",
}

ConfigPatch = Callable[[dict[str, Any]], None]
# a tiny Gemma 3: 16-dimension heads, q.k scaled by 1/sqrt(10) (not the head's 1/4), a window of 24
GEMMA3 = {"head_dim": 16, "query_pre_attn_scalar": 10, "sliding_window": 24, "sliding_window_pattern": 2}
GEMMA2 = {"head_dim": 16, "query_pre_attn_scalar": 10, "sliding_window": 24}
# Ministral 3's rope on a tiny scale: YaRN 16x over a pretraining length of 64
MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1e6,
    "factor": 16.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.5,
    "llama_4_scaling_beta": 0.1,
}
# a tiny dense Granite 4.0: both layers attention, no experts, an MLP of 48 (not TINY's 96)
GRANITE4 = {
    **GRANITE_SCALES,
    "layer_types": ["attention", "attention"],
    "num_local_experts": 0,
    "shared_intermediate_size": 48,
}
# Mamba2 on a tiny scale (`layers.mamba2`): 8 heads of 16 (128 = 2 x hidden) in 2 groups, a state of
# 16, chunks of 32
GRANITE4_MAMBA = {"mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 32}
# Falcon-H1's Mamba2 on a tiny scale
FALCON_H1_MAMBA = {
    "head_dim": 16,
    "mamba_d_ssm": 64,
    "mamba_n_heads": 8,
    "mamba_n_groups": 2,
    "mamba_d_state": 16,
    "mamba_chunk_size": 32,
    "rms_norm_eps": 1e-2,
}
# Command A Plus on a tiny scale: 4 layers, 4 experts of TINY's width, a shared one, the dense
# prefix's MLP of 48, a window of 24 past the prefix every other layer
COHERE2_MOE = {
    **{**TINY, "num_hidden_layers": 4},
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_shared_experts": 1,
    "prefix_dense_intermediate_size": 48,
    "sliding_window": 24,
    "sliding_window_pattern": 2,
}
# a tiny Llama's config.json as a Gemma 4's (the refusals): heads of 16, no per-layer embeddings
GEMMA4_REFUSED = {"architectures": ["Gemma4ForCausalLM"], "hidden_size_per_layer_input": 0, "head_dim": 16}
# Gemma 4 on a tiny scale: heads of 16 in the sliding layers (a window of 24), of 32 in the full
# ones, no per-layer embeddings
GEMMA4 = {"head_dim": 16, "global_head_dim": 32, "sliding_window": 24, "hidden_size_per_layer_input": 0}
# Gemma 3n on a tiny scale: heads of 16 (a window of 24), per-layer embeddings of 8 from a vocabulary
# of 1,000, LAuReL of rank 8, the last two layers KV-shared
GEMMA3N = {
    "head_dim": 16,
    "sliding_window": 24,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 1000,
    "laurel_rank": 8,
    "num_kv_shared_layers": 2,
}
# a tiny Llama's config.json as a Gemma 3n's (the refusals)
GEMMA3N_REFUSED = {
    "architectures": ["Gemma3nForCausalLM"],
    "hidden_activation": "gelu_pytorch_tanh",
    "head_dim": 16,
    "hidden_size_per_layer_input": 8,
    "num_kv_shared_layers": 0,
}
# MiniMax-Text-01's residual factors, each away from 1 and from the others (MiniMaxConfig's names)
MINIMAX_FACTORS = {
    "full_attn_alpha_factor": 1.7,
    "full_attn_beta_factor": 0.6,
    "linear_attn_alpha_factor": 1.3,
    "linear_attn_beta_factor": 0.8,
    "mlp_alpha_factor": 1.5,
    "mlp_beta_factor": 0.7,
}
# MiniCPM5-MoE's experts on a tiny scale
MINICPM5_EXPERTS = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "n_group": 2,
    "topk_group": 1,
}
# a tiny Llama's config.json as a Zamba2's (the refusals)
ZAMBA2_REFUSED = {
    "architectures": ["Zamba2ForCausalLM"],
    "hidden_act": "gelu",
    "layers_block_type": ["mamba", "hybrid"],
    "n_mamba_heads": 8,
    "mamba_d_state": 16,
}
# Zamba2's Mamba2 on a tiny scale: 8 heads of 16 (128 = 2 x hidden) in 2 groups, a state of 16,
# chunks of 32
ZAMBA2_MAMBA = {"n_mamba_heads": 8, "mamba_ngroups": 2, "mamba_d_state": 16, "chunk_size": 32}
# Mamba (1) on a tiny scale: two layers of 144 channels (expand 2), states of 16, a time step of
# rank 5 by default (ceil(72 / 16): MambaConfig's "auto")
MAMBA_TINY = {
    "vocab_size": TINY["vocab_size"],
    "hidden_size": 72,
    "num_hidden_layers": 2,
    "state_size": 16,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
# Falcon's on a tiny scale (TINY's, as FalconConfig names them)
FALCON_TINY = {
    **{k: v for k, v in TINY.items() if k not in ("intermediate_size", "num_key_value_heads")},
    "ffn_hidden_size": 96,
}
# BLOOM's and MPT's sizes as their configs name them, TINY's (4 heads of 16; every MLP 4 x hidden)
BLOOM_TINY = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "n_layer": 2,
    "n_head": 4,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
MPT_TINY = {
    **{k: v for k, v in BLOOM_TINY.items() if k not in ("hidden_size", "n_layer", "n_head")},
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "max_seq_len": 1024,
}
# a DBRX config.json of TINY's sizes, for the refusals
DBRX_REFUSED = {"architectures": ["DbrxForCausalLM"], "d_model": 64, "n_heads": 4, "n_layers": 2}
# GPT-2's sizes as its config names them, TINY's
GPT2_TINY = {
    "vocab_size": 49152,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_inner": 96,
    "n_positions": 1024,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
# MiniMax-M2's on a tiny scale: 8 of each 16-dimension head turned, 2 of 8 experts a token
MINIMAX_M2 = {"head_dim": 16, "rotary_dim": 8, "num_local_experts": 8, "num_experts_per_tok": 2}
# Nemotron 3's experts on a tiny scale
NEMOTRON3_EXPERTS = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "moe_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 32,
    "routed_scaling_factor": 2.5,
}
# Nemotron-H on a tiny scale: Mamba2 as GRANITE4_MAMBA's, norm eps 1e-2
NEMOTRON_H = {
    **{key: value for key, value in TINY.items() if key != "num_hidden_layers"},
    "head_dim": 16,
    "layers_block_type": ["mamba", "mlp", "attention", "mlp", "mamba", "mlp"],
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "n_groups": 2,
    "ssm_state_size": 16,
    "chunk_size": 32,
    "layer_norm_epsilon": 1e-2,
}
# DeepSeek's latent attention on a tiny scale: 4 heads, each key 16 unrotated + 8 rotated dimensions,
# each value 24; a latent of 56 (a cache entry of 56 + 8 = 64, the bfloat16 prefill kernel's); 2 of 8
# experts a token beside a shared one, layer 0 dense
MLA = {
    **{
        key: value
        for key, value in DEEPSEEK_V3.items()
        if key not in ("num_kv_heads", "n_group", "topk_group")
    },
    "num_key_value_heads": 4,  # (transformers' MLA expands its keys to every head)
}
MLA_SIZES = (
    "num_key_value_heads",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
# Kimi Linear's latent attention (MLA's sizes), KDA's heads and its experts, on a tiny scale
KIMI_LINEAR = {
    **{key: value for key, value in MLA.items() if key in ("kv_lora_rank", "q_lora_rank")},
    **{key: value for key, value in MLA.items() if key.startswith(("qk_", "v_head"))},
    "linear_num_heads": 2,
    "linear_head_dim": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "moe_intermediate_size": 16,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "rms_norm_eps": 0.1,  # (at 1e-2 transformers' own bfloat16 tokens sit nats below its float32 ones)
}
# a tiny Llama's config.json as DeepSeek-V2's (its refusals come before any weight loads)
DEEPSEEK_V2 = {"architectures": ["DeepseekV2ForCausalLM"], **MLA}
# TINY for GPTNeoXConfig, which has all heads for keys and values (no num_key_value_heads)
NEOX = {key: value for key, value in TINY.items() if key != "num_key_value_heads"}
# a few small experts, for tests of what a Qwen MoE config says of other things
SMALL_MOE = {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16}
# a tiny GPT-OSS: 2 of 4 experts a token, YaRN as its checkpoints carry it (truncate false; 4x a
# pretraining length of 256 here)
GPT_OSS = {
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "rope_theta": 150000.0,
    },
}


def as_transformers_4(config: dict[str, Any]) -> None:
    """The 4.x layout: rope_theta beside rope_scaling, whose kind older configs name `type`."""
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}


def drop(*keys: str) -> ConfigPatch:
    def patch(config: dict[str, Any]) -> None:
        for key in keys:
            del config[key]

    return patch


def gemma3_as_transformers_4(config: dict[str, Any]) -> None:
    """Gemma 3's 4.x layout, as its checkpoints on the Hub carry it: no layer_types (the pattern)."""
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope["full_attention"]["rope_theta"]
    config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    scaling = {k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}
    config["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    config["sliding_window_pattern"] = 2
    del config["layer_types"]


def olmo3_as_transformers_4(config: dict[str, Any]) -> None:
    """OLMo 3's 4.x layout, as its checkpoints on the Hub carry it: one rope_theta, rope_scaling (the
    global layers')."""
    rope = config.pop("rope_parameters")["full_attention"]
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope


def dbrx_defaults_left_out(config: dict[str, Any]) -> None:
    """DBRX's config.json without the keys DbrxConfig has defaults for (the KV heads, the experts'
    count, norm and activation; no rope_parameters, its theta in attn_config; no tie_word_embeddings)."""
    del config["rope_parameters"], config["tie_word_embeddings"]
    for sub, keys in (
        ("attn_config", ("kv_n_heads",)),
        ("ffn_config", ("moe_num_experts", "moe_normalize_expert_weights", "ffn_act_fn")),
    ):
        for key in keys:
            del config[sub][key]


def drop_partial_rotary_factor(config: dict[str, Any]) -> None:
    """A config.json naming no partial_rotary_factor (where it is, at the top or in the rope's)."""
    config.pop("partial_rotary_factor", None)
    (config.get("rope_parameters") or {}).pop("partial_rotary_factor", None)


def LlamaConfig(**kwargs: Any) -> Any:  # noqa: N802 (stands in for the class)
    """transformers' LlamaConfig, imported on first use: its module imports torch._dynamo, which
    imports triton.language, and tests/kernels/conftest.py must set TRITON_INTERPRET=1 before that."""
    from transformers import LlamaConfig as config_class

    return config_class(**kwargs)


def internlm3_as_the_hub_names_it(config: dict[str, Any]) -> None:
    """InternLM3's config.json: its own architecture, `qkv_bias` and `bias` (which transformers maps to
    attention_bias and mlp_bias), no head_dim."""
    config["architectures"] = ["InternLM3ForCausalLM"]
    config["qkv_bias"], config["bias"] = config.pop("attention_bias"), config.pop("mlp_bias")
    del config["head_dim"]


def gpt_neox_as_the_hub_names_it(config: dict[str, Any]) -> None:
    """GPT-NeoX's config.json names its rope `rotary_pct` and `rotary_emb_base`."""
    rope = config.pop("rope_parameters")
    config["rotary_pct"], config["rotary_emb_base"] = rope["partial_rotary_factor"], rope["rope_theta"]


def with_unused_window(config: dict[str, Any]) -> None:
    """As Qwen2 checkpoints ship: a window that `use_sliding_window: false` turns off."""
    config.update(sliding_window=32, use_sliding_window=False)


def without_nope_layers(config: dict[str, Any]) -> None:
    """A config.json without `no_rope_layers`: SmolLM3Config's default, every fourth layer NoPE."""
    del config["no_rope_layers"]


def granite4_as_ibm_names_it(config: dict[str, Any]) -> None:
    config["layers_block_type"] = config.pop("layer_types")
    config["mamba_d_head"] = "auto"
    for key in ("mamba_d_conv", "mamba_expand", "mamba_conv_bias", "mamba_proj_bias"):
        del config[key]
    # its default, as transformers 5's save_pretrained writes an infinity JSON cannot hold
    config["time_step_limit"] = [0.0, {"__float__": "Infinity"}]


def bamba_as_ibm_names_it(config: dict[str, Any]) -> None:
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    del config["rms_norm_eps"]


def nemotron_h_as_nvidia_names_it(config: dict[str, Any]) -> None:
    kinds = {"linear_attention": "M", "full_attention": "*", "mlp": "-"}
    config["hybrid_override_pattern"] = "".join(kinds[kind] for kind in config.pop("layers_block_type"))
    config["mamba_n_groups"] = config.pop("n_groups")
    del config["layer_norm_epsilon"], config["mamba_ssm_cache_dtype"]


def lfm2_as_the_hub_names_it(config: dict[str, Any]) -> None:
    layer_types = config.pop("layer_types")
    config["full_attn_idxs"] = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    config["block_ff_dim"] = config.pop("intermediate_size")
    config["tie_embedding"] = config.pop("tie_word_embeddings")
    del config["rope_parameters"], config["norm_eps"]


def qwen3_5_as_qwen_leaves_it(config: dict[str, Any]) -> None:
    assert config.pop("layer_types")[3] == "full_attention"
    config.pop("rms_norm_eps")
    config["rope_parameters"].pop("partial_rotary_factor")
    config.pop("partial_rotary_factor", None)


def qwen3_next_as_qwen_leaves_it(config: dict[str, Any]) -> None:
    assert config.pop("layer_types")[3] == "full_attention"
    config["rope_parameters"].pop("partial_rotary_factor")
    config.pop("partial_rotary_factor", None)
    assert config.pop("norm_topk_prob") is True


def without_norm_topk_prob(config: dict[str, Any]) -> None:
    """Qwen2-MoE's config.json as Qwen wrote them, without it: not renormalized."""
    assert config.pop("norm_topk_prob") is False


def kimi_linear_as_moonshot_names_it(config: dict[str, Any]) -> None:
    """The Hub's config.json: the layers by `linear_attn_config` (counted from 1), with the linear
    attention's heads and convolution; the first dense MLPs by `first_k_dense_replace`; no rope."""
    layer_types = config.pop("layer_types")
    config["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, kind in enumerate(layer_types) if kind == "full_attention"],
        "kda_layers": [i + 1 for i, kind in enumerate(layer_types) if kind == "linear_attention"],
        "head_dim": config.pop("linear_head_dim"),
        "num_heads": config.pop("linear_num_heads"),
        "short_conv_kernel_size": config.pop("linear_conv_kernel_dim"),
    }
    assert config.pop("mlp_layer_types") == ["dense", "sparse", "sparse", "sparse"]
    config.update(first_k_dense_replace=1, mla_use_nope=True, moe_router_activation_func="sigmoid")


def without_falcon_h1_defaults(config: dict[str, Any]) -> None:
    """FalconH1Config's defaults left out: no gated norm, the multipliers 1, no biases."""
    for key in (
        "mamba_rms_norm",
        "mamba_norm_before_gate",
        "mlp_multipliers",
        "ssm_multipliers",
        "key_multiplier",
    ):
        config.pop(key)


def gemma4_last_layer_sliding(config: dict[str, Any]) -> None:
    config["layer_types"][-1] = "sliding_attention"


def gemma4_as_google_names_it(config: dict[str, Any]) -> None:
    for key in ("layer_types", "per_layer_config", "tie_word_embeddings"):
        del config[key]
    config["global_head_dim"] = 32


def gemma3n_as_google_leaves_it(config: dict[str, Any]) -> None:
    for key in (
        "layer_types",
        "activation_sparsity_pattern",
        "altup_active_idx",
        "altup_correct_scale",
        "altup_num_inputs",
        "final_logit_softcapping",
        "tie_word_embeddings",
        "hidden_activation",
        "rope_parameters",
    ):
        del config[key]
    config["intermediate_size"] = 96


def mellum_as_jetbrains_leaves_it(config: dict[str, Any]) -> None:
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "norm_topk_prob"):
        del config[key]


def minicpm5_as_openbmb_names_it(config: dict[str, Any]) -> None:
    for key in ("mlp_layer_types", "rope_parameters", "routed_scaling_factor"):
        del config[key]
    config["architectures"] = ["MiniCPM5MoEForCausalLM"]


def olmo_hybrid_as_ai2_leaves_it(config: dict[str, Any]) -> None:
    for key in (
        "layer_types",
        "rope_parameters",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_allow_neg_eigval",
    ):
        del config[key]


def lfm3_as_liquid_leaves_it(config: dict[str, Any]) -> None:
    for key in (
        "layer_types",
        "rope_parameters",
        "sliding_window",
        "use_attention_gate",
        "use_sandwich_norm",
        "conv_L_cache",
        "tie_word_embeddings",
    ):
        del config[key]


def minimax_as_transformers_leaves_it(config: dict[str, Any]) -> None:
    for key in ("layer_types", "rope_parameters", *MINIMAX_FACTORS):
        del config[key]


def zamba2_as_zyphra_leaves_it(config: dict[str, Any]) -> None:
    for key in (
        "num_mem_blocks",
        "use_shared_attention_adapter",
        "use_mem_rope",
        "mamba_ngroups",
        "intermediate_size",
        "num_key_value_heads",
        "hidden_act",
        "adapter_rank",
    ):
        config.pop(key, None)


def cohere2_moe_as_cohere_leaves_it(config: dict[str, Any]) -> None:
    for key in ("layer_types", "mlp_layer_types"):
        del config[key]
    config["first_k_dense_replace"] = 1


def minimax_m2_as_minimax_names_it(config: dict[str, Any]) -> None:
    del config["rope_parameters"]
    config.update(qk_norm_type="per_layer", use_qk_norm=True, scoring_func="sigmoid", use_routing_bias=True)


def without_rms_norm_eps(config: dict[str, Any]) -> None:
    """A hand-written config.json may leave it out: transformers then takes its default."""
    del config["rms_norm_eps"]


VARIANTS: dict[str, tuple[Callable[[], Any], ConfigPatch | None]] = {
    "llama-linear-rope": (
        lambda: LlamaConfig(**TINY, rope_scaling={"rope_type": "linear", "factor": 4.0}),
        None,
    ),
    "llama-llama3-rope-4.x-config": (
        lambda: LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
        as_transformers_4,
    ),
    "llama-head-dim-32": (lambda: LlamaConfig(**TINY, head_dim=32), None),
    "llama-attention-and-mlp-bias": (lambda: LlamaConfig(**TINY, attention_bias=True, mlp_bias=True), None),
    "llama-tied": (lambda: LlamaConfig(**TINY, tie_word_embeddings=True), None),
    "llama-rms-norm-eps-unset": (lambda: LlamaConfig(**TINY), without_rms_norm_eps),
    "qwen2": (lambda: Qwen2Config(**TINY), with_unused_window),
    "qwen2-tied-head-dim-32": (lambda: Qwen2Config(**TINY, tie_word_embeddings=True, head_dim=32), None),
    # the window is on but slides no layer: max_window_layers covers both
    "qwen2-window-on-no-sliding-layer": (
        lambda: Qwen2Config(**TINY, use_sliding_window=True, sliding_window=32, max_window_layers=2),
        None,
    ),
    "mistral-head-dim-32": (lambda: MistralConfig(**TINY, head_dim=32, sliding_window=None), None),
    "qwen3": (lambda: Qwen3Config(**TINY, head_dim=16), with_unused_window),
    "qwen3-yarn-rope-4.x-config": (
        lambda: Qwen3Config(**TINY, head_dim=16, rope_theta=1e6, rope_scaling=YARN_ROPE),
        as_transformers_4,
    ),
    # Qwen3 checkpoints name a head_dim wider than hidden / heads (Qwen3-0.6B: 128 against 64)
    "qwen3-tied-head-dim-32-attention-bias": (
        lambda: Qwen3Config(**TINY, tie_word_embeddings=True, head_dim=32, attention_bias=True),
        None,
    ),
    "granite": (lambda: GraniteConfig(**TINY, **GRANITE_SCALES), None),
    # Granite 3's checkpoints tie the LM head to the multiplied embeddings
    "granite-tied-biases": (
        lambda: GraniteConfig(
            **TINY, **GRANITE_SCALES, tie_word_embeddings=True, attention_bias=True, mlp_bias=True
        ),
        None,
    ),
    # q, k and v in one checkpoint tensor, gate and up in another
    "phi3": (lambda: Phi3Config(**TINY), None),
    # Phi-4-mini's: a tied LM head, and rotary over the first 3/4 of each head
    "phi3-tied-partial-rotary": (
        lambda: Phi3Config(
            **TINY,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75},
        ),
        None,
    ),
    # the long factors: max_model_len (1,024) reaches past the pretraining length, and so do the prompts
    "phi3-longrope": (
        lambda: Phi3Config(**TINY, original_max_position_embeddings=256, rope_parameters=PHI3_LONGROPE),
        None,
    ),
    # sliding windows far inside the prompts (300+ tokens): Mistral's and Phi-3's slide every layer,
    # Qwen2's the layers from max_window_layers on, SmolLM3's its NoPE layers
    "mistral-window-32": (lambda: MistralConfig(**TINY, sliding_window=32), None),
    "phi3-window-40": (lambda: Phi3Config(**TINY, sliding_window=40), None),
    "qwen2-window-48-layer-1": (
        lambda: Qwen2Config(**TINY, use_sliding_window=True, sliding_window=48, max_window_layers=1),
        None,
    ),
    "smollm3-window-20-nope-layer": (
        lambda: SmolLM3Config(**TINY, use_sliding_window=True, sliding_window=20, no_rope_layers=[1, 0]),
        None,
    ),
    # Gemma 1: Llama's layer with Gemma's norms (by 1 + weight), GELU and embeddings times sqrt(hidden);
    # its configs' legacy "gelu" names the tanh approximation
    "gemma": (lambda: GemmaConfig(**TINY, head_dim=16), None),
    "gemma-legacy-gelu": (
        lambda: GemmaConfig(**TINY, head_dim=16, tie_word_embeddings=False),
        lambda c: c.update(hidden_act="gelu", hidden_activation=None),
    ),
    # Gemma 2: a local layer (window 24) then a global one, norms after attention and the MLP, q.k
    # by query_pre_attn_scalar, attention scores soft-capped (at 2: every score bent) and logits (at 3)
    "gemma2-softcaps": (
        lambda: Gemma2Config(**TINY, **GEMMA2, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
        None,
    ),
    # Gemma2Config's own caps (50, 30) where config.json leaves them out
    "gemma2-default-softcaps": (
        lambda: Gemma2Config(**TINY, **GEMMA2),
        drop("attn_logit_softcapping", "final_logit_softcapping"),
    ),
    # Gemma 3: a local layer (window 24, rope base 1e4) then a global one (rope base 1e6), norms after
    # attention and the MLP, GELU, the embeddings times sqrt(hidden), q.k by query_pre_attn_scalar
    "gemma3": (lambda: Gemma3TextConfig(**TINY, **GEMMA3), None),
    # Gemma 3 4B's: its global layers' linear rope (the context stays max_position_embeddings), a
    # config in the 4.x layout (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern),
    # and Gemma 2's final logit soft-capping
    "gemma3-linear-rope-4.x-config-softcap": (
        lambda: Gemma3TextConfig(
            **TINY, **GEMMA3, rope_scaling={"rope_type": "linear", "factor": 8.0}, final_logit_softcapping=3.0
        ),
        gemma3_as_transformers_4,
    ),
    # mixtures of experts: Mixtral's 2 of 4 experts a token, weights renormalized; Qwen2-MoE's 2 of 6
    # without renormalizing, beside a shared expert under its sigmoid gate, layer 0 dense
    # (mlp_only_layers) and q, k, v biased; Qwen3-MoE's 3 of 8 renormalized (norm_topk_prob)
    "mixtral-4-experts": (lambda: MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2), None),
    "qwen2-moe-shared-expert-dense-layer-0": (
        lambda: Qwen2MoeConfig(
            **TINY,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[0],
        ),
        without_norm_topk_prob,
    ),
    # IBM's Granite MoE: Granite's multipliers, biases on all four attention projections, a tied LM
    # head, 2 of 4 experts a token
    "granitemoe-tied-biases": (
        lambda: GraniteMoeConfig(
            **TINY,
            **GRANITE_SCALES,
            num_local_experts=4,
            num_experts_per_tok=2,
            attention_bias=True,
            tie_word_embeddings=True,
        ),
        None,
    ),
    "qwen3-moe-norm-topk": (
        lambda: Qwen3MoeConfig(
            **TINY,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
        None,
    ),
    # OpenAI's GPT-OSS: biases on all four attention projections, a sink logit a head (drawn large
    # by save_tiny_model), layer 0 sliding by 24; experts with biases, their SwiGLU clamped at 2 (the
    # clamps bind here) and its alpha away from 1.702; the config as OpenAI's (rope_scaling, rope_theta)
    "gpt-oss-sinks-clamped-experts": (
        lambda: GptOssConfig(**TINY, **GPT_OSS, sliding_window=24, swiglu_limit=2.0, swiglu_alpha=1.2),
        as_transformers_4,
    ),
    # IBM Granite 4.0's attention-only checkpoints: Granite's multipliers, the MLP as `shared_mlp`
    # (gate and up in one tensor) of shared_intermediate_size, and the rope or none (NoPE)
    "granite4-rope": (
        lambda: GraniteMoeHybridConfig(**TINY, **GRANITE4, position_embedding_type="rope", rope_theta=1e6),
        None,
    ),
    # (and GraniteMoeHybridConfig's shared_intermediate_size, 1,024, where config.json leaves it out)
    "granite4-nope-tied-default-mlp-size": (
        lambda: GraniteMoeHybridConfig(
            **TINY, **{**GRANITE4, "shared_intermediate_size": 1024}, tie_word_embeddings=True
        ),
        drop("shared_intermediate_size"),
    ),
    # Mistral AI's Ministral 3 (text-only): YaRN 16x over 64 positions (DeepSeek's attention factor of
    # mscale and mscale_all_dim), each query scaled past them by Llama 4's scaling (beta 0.4: ~1.8 at
    # the prompts' ends), a window of 40 in every layer
    "ministral3-yarn-query-scaling-window-40": (
        lambda: Ministral3Config(
            **TINY,
            head_dim=16,
            sliding_window=40,
            rope_parameters={**MINISTRAL3_ROPE, "llama_4_scaling_beta": 0.4},
        ),
        None,
    ),
    # ByteDance's Seed-OSS: q, k and v biased (its default), o and the MLP by their own flags
    "seed-oss-biases": (
        lambda: SeedOssConfig(**TINY, head_dim=16, attention_out_bias=True, mlp_bias=True, rope_theta=1e7),
        None,
    ),
    # (o unbiased by default, a config.json without the keys)
    "seed-oss-default-biases": (
        lambda: SeedOssConfig(**TINY, head_dim=16),
        drop("attention_bias", "attention_out_bias"),
    ),
    # Baidu's ERNIE 4.5 (dense): GPT-J's rotary (neighbouring dimensions turned together) in float32,
    # every projection biased by use_bias, the LM head tied by default (here left out of config.json)
    "ernie4.5-biases-default-tie": (
        lambda: Ernie4_5Config(**TINY, head_dim=16, use_bias=True, tie_word_embeddings=True),
        drop("tie_word_embeddings"),
    ),
    # Zhipu's GLM-4-0414: GPT-J's rotary over the first half of each head (Glm4Config's default,
    # config.json naming none), q, k and v biased, norms after attention and the MLP too, gate and up
    # in one tensor
    "glm4-partial-interleaved-rotary": (
        lambda: Glm4Config(**TINY, head_dim=16),
        drop_partial_rotary_factor,
    ),
    # LG's EXAONE 4.0 32B: norms after attention and the MLP, each query and key head normed, layers
    # 0-2 sliding (by 24) with the rope, layer 3 global without (NoPE); its 1.2B: no window, the rope in
    # every layer
    "exaone4-sliding-rope-global-nope": (
        lambda: Exaone4Config(**{**TINY, "num_hidden_layers": 4}, head_dim=16, sliding_window=24),
        drop("layer_types"),
    ),
    "exaone4-no-window": (
        lambda: Exaone4Config(
            **TINY, head_dim=16, sliding_window=None, layer_types=["full_attention", "full_attention"]
        ),
        None,
    ),
    # Baidu's ERNIE 4.5 MoE: layer 0 dense, layer 1 2 of 8 experts picked by their softmax plus the
    # router's bias, beside an ungated shared expert; GPT-J's rotary in float32; the head tied by
    # default (config.json naming nothing)
    "ernie4.5-moe-biased-picking": (
        lambda: Ernie4_5_MoeConfig(
            **TINY,
            head_dim=16,
            moe_num_experts=8,
            moe_k=2,
            moe_intermediate_size=16,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            tie_word_embeddings=True,
        ),
        drop("tie_word_embeddings"),
    ),
    # Cohere's Command R7B: attention and the MLP side by side on one LayerNorm, GPT-J's rotary in the
    # sliding layers (0-2, by 24) alone, layer 3 global without rope, the logits scaled by 1/16
    # (Cohere2Config's default), the LM head tied (its default too: config.json naming neither)
    "cohere2-parallel-sliding-rope-global-nope": (
        lambda: Cohere2Config(
            **{**TINY, "num_hidden_layers": 4}, head_dim=16, sliding_window=24, tie_word_embeddings=True
        ),
        drop("logit_scale", "tie_word_embeddings", "layer_types"),
    ),
    # Cohere's Command R+: attention and the MLP side by side on one LayerNorm, GPT-J's rotary in
    # every layer at CohereConfig's theta (5e5, config.json naming none), each query and key head
    # LayerNormed by a weight of its own (`use_qk_norm`), the logits scaled by 1/16, the head tied
    "cohere-head-layernorms-default-theta": (
        lambda: CohereConfig(**TINY, use_qk_norm=True),
        drop("rope_parameters", "logit_scale", "tie_word_embeddings"),
    ),
    # MiniMax-M2: q and k each RMS-normed over the whole projection (in float32), NeoX's rotary over the
    # first 8 of each head's 16 dimensions, every MLP 2 of 8 experts a token, each scored by a sigmoid
    # and picked by its score plus a bias, the picked scores renormalized
    "minimax-m2-whole-qk-norms-partial-rope-sigmoid-biased-experts": (
        lambda: MiniMaxM2Config(**TINY, **MINIMAX_M2),
        None,
    ),
    # the same as MiniMax's config.json lays it out: the turned part of a head by rotary_dim alone, no
    # rope parameters (MiniMaxM2Config's theta, 5e6), its keys transformers does not read
    "minimax-m2-as-minimax-names-it": (
        lambda: MiniMaxM2Config(**TINY, **MINIMAX_M2),
        minimax_m2_as_minimax_names_it,
    ),
    # Cohere's Command A Plus: Command R7B's parallel layer on a LayerNorm; layer 0 a dense SwiGLU of 48
    # turned by the rope (its prefix's window pattern 1), layers 1-3 experts (2 of 4 a token by the
    # softmax of the picked logits) beside a shared expert, averaged (Cohere2MoeConfig's default);
    # layer 2 global (every second past the prefix), the others sliding by 24; the layer kinds derived
    # from first_k_dense_replace as config.json leaves them
    "cohere2-moe-dense-prefix-averaged-shared-expert": (
        lambda: Cohere2MoeConfig(**COHERE2_MOE, first_k_dense_replace=1),
        cohere2_moe_as_cohere_leaves_it,
    ),
    # ... with RMSNorms (`rms_norm_eps`), sigmoid-scored experts renormalized, the shared expert added
    "cohere2-moe-rmsnorm-sigmoid-summed": (
        lambda: Cohere2MoeConfig(
            **COHERE2_MOE,
            rms_norm_eps=1e-5,
            expert_selection_fn="sigmoid",
            shared_expert_combination_strategy="sum",
        ),
        None,
    ),
    # Tencent's Hunyuan dense: each query and key head normed after the rotation; the rope its
    # checkpoints call dynamic, with a fixed alpha (the base stretched 1000^(16/14)), as they ship it
    "hunyuan-alpha-rope-norms-after-rotary": (
        lambda: HunYuanDenseV1Config(
            **TINY,
            head_dim=16,
            rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0},
        ),
        as_transformers_4,
    ),
    # Tencent's Hunyuan-A13B: Hunyuan's layer, every MLP 8 experts (the top 3 in layer 0, 2 in layer 1,
    # by a float32 router's softmax, renormalized) beside a shared MLP, all 48 wide; the rope's alpha
    # as Hunyuan's dense checkpoints ship it
    "hunyuan-a13b-experts-per-layer-shared-mlp": (
        lambda: HunYuanMoEV1Config(
            **{**TINY, "intermediate_size": 48},
            head_dim=16,
            num_experts=8,
            moe_topk=[3, 2],
            rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0},
        ),
        as_transformers_4,
    ),
    # Zhipu's GLM-4.5: layer 0 dense, layer 1 2 of 8 experts routed as DeepSeek-V3's (sigmoid scores,
    # picked by the scores plus a bias among the best 2 of 4 groups, renormalized and scaled by 2.5)
    # beside an ungated shared expert; q, k and v biased, each query and key head normed, the rope
    # over half of each head (Glm4MoeConfig's default, config.json naming none)
    "glm4-moe-grouped-biased-routing": (
        lambda: Glm4MoeConfig(
            **TINY,
            head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            moe_intermediate_size=16,
            n_shared_experts=1,
            first_k_dense_replace=1,
            use_qk_norm=True,
            attention_bias=True,
        ),
        drop_partial_rotary_factor,
    ),
    # Ai2's OLMo 2: q and k each RMS-normed over the whole projection (not head by head), norms after
    # attention and the MLP instead of before, in float32; with Llama's biases and a tied LM head too
    "olmo2": (lambda: Olmo2Config(**TINY, rope_theta=500000.0), None),
    "olmo2-attention-bias-tied": (
        lambda: Olmo2Config(**TINY, attention_bias=True, tie_word_embeddings=True),
        None,
    ),
    # OLMo 3 as its long-context checkpoints ship: layers 0-2 sliding (here by 24), layer 3 global;
    # YaRN (4x over 256 positions) in the global layer alone; one theta in the 4.x layout
    "olmo3-yarn-global-layers-4.x-config": (
        lambda: Olmo3Config(
            **{**TINY, "num_hidden_layers": 4},
            sliding_window=24,
            rope_theta=500000.0,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        ),
        olmo3_as_transformers_4,
    ),
    # transformers 5's layout: a rope a layer type (here each its own theta), every fourth layer
    # global where config.json names no layer_types
    "olmo3-sliding-theta-default-layer-types": (
        lambda: Olmo3Config(
            **{**TINY, "num_hidden_layers": 4},
            sliding_window=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
        ),
        drop("layer_types"),
    ),
    # OLMoE: Llama's layer with OLMo's whole-projection q and k norms, q, k and v clamped at 1.5 (the
    # clamp binds here), 2 of 4 experts a token, their weights not renormalized
    "olmoe-clip-qkv": (lambda: OlmoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, clip_qkv=1.5), None),
    # Ai2's FlexOlmo: OLMo 2's post-norm layer with every MLP 2 of 4 experts a token, weighted by their
    # softmax over all four, not renormalized (FlexOlmoConfig's default, config.json naming none)
    "flex-olmo-post-norms-experts": (
        lambda: FlexOlmoConfig(**TINY, num_experts=4, num_experts_per_tok=2),
        drop("norm_topk_prob"),
    ),
    # DeepSeek-V3 as its checkpoints ship: the 4.x layout, YaRN (4x over 256 positions) with
    # mscale 1 and mscale_all_dim 0.7 (cos and sin scaled by their ratio, q.k by the latter's square);
    # experts routed in 2 of 4 groups by sigmoid scores plus a bias, scaled by 2.5; GPT-J's rotary
    "deepseek-v3-mla-yarn-grouped-experts-4.x-config": (
        lambda: DeepseekV3Config(
            **{**TINY, **MLA},
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "mscale": 1.0,
                "mscale_all_dim": 0.7,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "rope_theta": 10000.0,
            },
        ),
        as_transformers_4,
    ),
    # DeepSeek-V2-Lite's shape: the query in one projection (no q_lora_rank), the top 2 of all experts
    # by their softmax (greedy), not renormalized, two shared experts' width; a latent of 24 (a cache
    # entry of 32, beside the bfloat16 prefill kernel's sizes); GPT-J's rotary in float32
    "deepseek-v2-lite-q-proj-greedy-experts": (
        lambda: DeepseekV2Config(
            **{**TINY, **MLA, "q_lora_rank": None, "kv_lora_rank": 24}, n_shared_experts=2
        ),
        None,
    ),
    # Tencent's Youtu-LLM: DeepSeek-V3's latent attention (GPT-J's rotary: `rope_interleave`, its
    # default) with a dense MLP in every layer, the LM head tied (YoutuConfig's default)
    "youtu-mla-dense-tied": (
        lambda: YoutuConfig(
            **{**TINY, **{k: v for k, v in MLA.items() if k in MLA_SIZES}}, embedding_initializer_range=0.2
        ),
        drop("tie_word_embeddings"),
    ),
    # DeepSeek-V2's routing: the top 2 among the best 2 of 4 groups (a group worth its best expert),
    # scaled by 16 (V2's); q_a_proj, kv_a_proj_with_mqa and o_proj biased
    "deepseek-v2-group-limited-biases": (
        lambda: DeepseekV2Config(
            **{**TINY, **MLA},
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=16.0,
            attention_bias=True,
        ),
        None,
    ),
    # GLM-4.7-Flash: DeepSeek-V3's layer, its rotary NeoX's (rope_interleave false), layer 0 experts
    # and layer 1 dense by mlp_layer_types, Glm4MoeLiteConfig's routing (no groups, scaled by 1.8)
    "glm4-moe-lite-neox-rope-layer-types": (
        lambda: Glm4MoeLiteConfig(
            **{**TINY, **MLA}, rope_interleave=False, mlp_layer_types=["sparse", "dense"]
        ),
        None,
    ),
    # Arcee's AFM: Llama's layer with an ungated ReLU² MLP (ArceeConfig's default: config.json naming no
    # hidden_act), YaRN 4x over 256 positions
    "arcee-relu2-yarn": (
        lambda: ArceeConfig(**TINY, rope_parameters={**YARN_ROPE, "rope_theta": 10000.0}),
        drop("hidden_act"),
    ),
    # NVIDIA's Nemotron: LayerNorm1P (1 + weight, a bias), an ungated ReLU² MLP, the rope over half of
    # each head (NemotronConfig's default, config.json naming none), every projection biased
    "nemotron-layernorm1p-half-rotary-biases": (
        lambda: NemotronConfig(**TINY, head_dim=16, attention_bias=True, mlp_bias=True),
        drop_partial_rotary_factor,
    ),
    # BigCode's StarCoder2: LayerNorms, every projection biased and the LM head tied (Starcoder2Config's
    # defaults: config.json naming neither), an ungated GELU MLP (c_fc, c_proj), a window of 48
    "starcoder2-gelu-biases-window-tied": (
        lambda: Starcoder2Config(**TINY, sliding_window=48, use_bias=True, tie_word_embeddings=True),
        drop("use_bias", "tie_word_embeddings"),
    ),
    # Swiss AI's Apertus: xIELU (each layer its own parameters), each query and key head normed, its
    # norms under names of its own, ApertusConfig's rope (Llama 3.1's over 8,192, theta 1.2e7) where
    # config.json names none
    "apertus-xielu-head-norms-default-rope": (
        lambda: ApertusConfig(**TINY),
        drop("rope_parameters"),
    ),
    # rednote's dots.llm1: Qwen3's attention (head norms, all four projections biased), layer 1 sliding
    # by 48 (from max_window_layers on, config.json naming no layer_types), layer 0 dense, layer 1 2 of 8
    # experts routed as DeepSeek-V3's (groups, a picking bias, scaled by 2, not renormalized: Dots1Config's
    # default) beside a shared expert
    "dots1-grouped-experts-window-from-layer-1": (
        lambda: Dots1Config(
            **TINY,
            head_dim=16,
            attention_bias=True,
            sliding_window=48,
            max_window_layers=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.0,
        ),
        drop("layer_types", "norm_topk_prob"),
    ),
    # InternLM3 as its checkpoints name things: `qkv_bias` and `bias` (transformers' attention_bias and
    # mlp_bias), no head_dim (InternLM3Config's 128, not 64 / 4)
    "internlm3-biases-default-head-dim": (
        lambda: InternLM3Config(**TINY, qkv_bias=True, bias=True),
        internlm3_as_the_hub_names_it,
    ),
    # Granite MoE with a shared expert: Granite's multipliers, 2 of 4 experts a token beside an ungated
    # SwiGLU of 48 every token goes through (`shared_mlp`)
    "granitemoeshared-shared-expert": (
        lambda: GraniteMoeSharedConfig(
            **TINY, **GRANITE_SCALES, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48
        ),
        None,
    ),
    # OpenBMB's MiniCPM3 as its checkpoint ships: DeepSeek-V2's latent attention with NeoX's rotary
    # (LongRoPE over its 8 rotated dimensions, long factors past 256 positions), μP's scales
    # (MiniCPM3Config's defaults: embeddings times 12, branches times 1.4 / sqrt(2), logits over
    # 64 / 256), v_head_dim hidden / heads and a tied head by default (config.json naming none)
    "minicpm3-mla-mup-scales-longrope": (
        lambda: MiniCPM3Config(
            **{**TINY, **MLA, "v_head_dim": None},
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.1, 1.3, 1.6],
                "long_factor": [1.0, 2.0, 4.0, 8.0],
                "original_max_position_embeddings": 256,
            },
        ),
        drop("v_head_dim", "scale_emb", "scale_depth", "dim_model_base", "tie_word_embeddings"),
    ),
    # Stability AI's StableLM 2: LayerNorms with biases, q, k and v biased, the rope over a quarter of
    # each head (StableLmConfig's default, config.json naming none)
    "stablelm-layernorms-quarter-rotary-qkv-bias": (
        lambda: StableLmConfig(**TINY, use_qkv_bias=True),
        drop_partial_rotary_factor,
    ),
    # StableLM 2 12B's layer: attention and the MLP side by side on one LayerNorm, each query and key
    # head LayerNormed by a weight of its own before the rotation (a tensor a head in the checkpoint)
    "stablelm-parallel-residual-head-norms": (
        lambda: StableLmConfig(**TINY, use_parallel_residual=True, qk_layernorm=True),
        None,
    ),
    # ... the head norms in StableLM's sequential layer
    "stablelm-head-norms": (lambda: StableLmConfig(**TINY, qk_layernorm=True), None),
    # GPT-NeoX (Pythia) as its checkpoints ship: attention and the GELU MLP side by side on two
    # LayerNorms, q, k and v in one tensor a head at a time, the rope named rotary_pct (here 0.5) and
    # rotary_emb_base (here 1,000)
    "gpt-neox-parallel-its-own-rope-names": (
        lambda: GPTNeoXConfig(
            **NEOX,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
        ),
        gpt_neox_as_the_hub_names_it,
    ),
    # GPT-NeoX's other layer: attention, then the MLP (`use_parallel_residual` false); the rope's defaults
    "gpt-neox-sequential": (
        lambda: GPTNeoXConfig(**NEOX, use_parallel_residual=False),
        drop("rope_parameters"),
    ),
    # Microsoft's Phi-2: attention and the ungated GELU MLP side by side on one LayerNorm, every
    # projection biased, the rope over 0.4 of each head, an LM head with a bias
    "phi2-parallel-biased-head": (
        lambda: PhiConfig(
            **NEOX, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.4}
        ),
        None,
    ),
    # Inception's Jais 2: LayerNorms, an ungated ReLU² MLP, every projection biased (Jais2Config's
    # defaults, config.json naming neither bias)
    "jais2-layernorms-relu2-default-biases": (
        lambda: Jais2Config(**TINY, head_dim=16),
        drop("attention_bias", "mlp_bias"),
    ),
    # Upstage's Solar Open: every layer 2 of 8 experts routed as DeepSeek-V3's in 2 of 4 groups beside a
    # shared one, q, k and v biased (o not), theta 1e6 (SolarOpenConfig's, config.json naming none)
    "solar-open-every-layer-experts-default-theta": (
        lambda: SolarOpenConfig(
            **TINY,
            head_dim=16,
            attention_bias=True,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            moe_intermediate_size=16,
        ),
        drop("rope_parameters"),
    ),
    # LG's K-EXAONE: EXAONE 4.0's attention (head norms, layers 0-2 sliding by 24 with the rope, layer 3
    # global without it) in Llama's pre-norm layer, layer 0 dense and the rest 2 of 8 experts in 2 of 4
    # groups beside a shared one (config.json naming no layer_types, mlp_layer_types or
    # first_k_dense_replace). Routed
    # weights unscaled: at ExaoneMoeConfig's 2.5 a bfloat16 step meets a near-tie (0.06) on one prompt,
    # and past it a context where transformers' bfloat16 forward picks, as ours does, a token 2.5 below
    # its float32 best
    "exaone-moe-sliding-nope-global-experts-from-layer-1": (
        lambda: ExaoneMoeConfig(
            **{**TINY, "num_hidden_layers": 4},
            head_dim=16,
            sliding_window=24,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.0,
        ),
        drop("layer_types", "mlp_layer_types", "first_k_dense_replace"),
    ),
    # Ai2's OLMo 1: LayerNorms of no weight or bias, q, k and v clamped at 1.5 (the clamp binds here)
    "olmo1-non-affine-layernorms-clip-qkv": (lambda: OlmoConfig(**TINY, clip_qkv=1.5), None),
    # Tencent's HY 3: each query and key head normed; layer 0 dense, layer 1 2 of 8 experts a token,
    # each scored by a sigmoid and picked by its score plus a bias, renormalized and scaled by 2.826
    # (HYV3Config's), beside an ungated shared expert; theta and layer kinds HYV3Config's (config.json
    # naming neither)
    "hy-v3-sigmoid-biased-experts-shared-default-theta": (
        lambda: HYV3Config(
            **TINY,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
        ),
        drop("rope_parameters", "router_scaling_factor", "mlp_layer_types"),
    ),
    # IBM's Granite SWA: Granite's multipliers, a learned sink a head in every layer, layers 1-3
    # sliding by 24 (every fourth full from the first: GraniteSWAConfig's default), layer 2 without
    # rope and layer 3 at a theta of its own (`layer_rope_theta`)
    "granite-swa-sinks-windows-layer-thetas": (
        lambda: GraniteSWAConfig(
            **{**TINY, "num_hidden_layers": 4},
            **GRANITE_SCALES,
            sliding_window=24,
            layer_rope_theta=[10000.0, 10000.0, 0, 500.0],
        ),
        drop("layer_types"),
    ),
    # IBM's Granite MoE SWA: Granite MoE's experts (2 of 4 a token, no shared expert by default) in
    # Granite SWA's layers, their window (128) and every layer at the model's theta
    # GraniteMoeSWAConfig's defaults (config.json naming neither)
    "granitemoe-swa-experts-sinks-windows": (
        lambda: GraniteMoeSWAConfig(
            **{**TINY, "num_hidden_layers": 4},
            **GRANITE_SCALES,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        drop("layer_rope_theta", "shared_intermediate_size", "sliding_window"),
    ),
    # Arcee's AFMoE (Trinity): norms around attention and the MLP, head norms, the attention's output
    # gated, layers 1 and 3 global without rope, 0 and 2 sliding by 24 (`global_attn_every_n_layers`
    # 2, config.json naming no layer types); layer 0 dense, then 2 of 8 sigmoid-scored experts picked
    # with a bias, renormalized and scaled by 2.5, beside a shared expert; muP's embedding scale
    "afmoe-gated-attention-sandwich-norms-experts-mup": (
        lambda: AfmoeConfig(
            **{**TINY, "num_hidden_layers": 4},
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            num_shared_experts=1,
            route_scale=2.5,
            sliding_window=24,
            global_attn_every_n_layers=2,
            mup_enabled=True,
        ),
        drop("layer_types"),
    ),
    # NAVER's HyperCLOVA X: Granite's multipliers (the logits multiplied, not divided), each branch's
    # output normed before the residual multiplier; q.k by head_dim^-1/2 (config.json naming no
    # attention_multiplier)
    "hyperclovax-post-norms-multiplied-logits": (
        lambda: HyperCLOVAXConfig(
            **TINY, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=0.25
        ),
        drop("attention_multiplier"),
    ),
    # ... without its norms after each branch (`use_post_norm` false) and every multiplier 1
    # (HyperCLOVAXConfig's defaults, config.json naming none)
    "hyperclovax-no-post-norms-default-multipliers": (
        lambda: HyperCLOVAXConfig(**TINY, use_post_norm=False),
        drop("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_multiplier"),
    ),
    # Zhipu's GLM-4-9B: GLM-4-0414's attention (q, k and v biased, GPT-J's rotary over half of each
    # head) and fused gate/up in Llama's layer; GlmConfig's norm eps (config.json naming none)
    "glm-partial-interleaved-rotary-default-eps": (
        lambda: GlmConfig(**TINY, head_dim=16),
        without_rms_norm_eps,
    ),
    # Kyutai's Helium: norms multiplied in float32, q, k and v biased, GPT-J's rotary at HeliumConfig's
    # theta (1e5, config.json naming none)
    "helium-float32-norms-interleaved-rotary-default-theta": (
        lambda: HeliumConfig(**TINY, head_dim=16, attention_bias=True),
        drop("rope_parameters"),
    ),
    # Meta's Code World Model: Llama 3's layer, every fourth layer full from the first (the others
    # sliding by 24), CwmConfig's rope (Llama 3.1's 16x over 8,192 at theta 1e6) where config.json
    # names neither
    "cwm-every-fourth-layer-full-default-rope": (
        lambda: CwmConfig(**{**TINY, "num_hidden_layers": 4}, head_dim=16, sliding_window=24),
        drop("layer_types", "rope_parameters"),
    ),
    # Mistral's Ministral-8B: Mistral's layer, its window (24) in the layers `layer_types` names
    "ministral-window-in-layer-1": (
        lambda: MinistralConfig(
            **TINY, head_dim=16, sliding_window=24, layer_types=["full_attention", "sliding_attention"]
        ),
        None,
    ),
    # Google's VaultGemma: Gemma 2's layer without its norms after attention and the MLP
    "vaultgemma-no-norms-after": (lambda: VaultGemmaConfig(**TINY, **GEMMA2), None),
    # Google's Gemma 4: norms by their weights, values RMS-normed, q.k unscaled; sliding layers (by 24)
    # of 4 KV heads of 16 and full ones of one KV head of 32, their values their keys' projection
    # (`attention_k_eq_v`), turned by the proportional rope (4 of 16 pairs), each KV head held twice to
    # fill the 64-wide KV entry; each layer's output times its scalar; logits soft-capped. config.json's
    # last layer sliding: transformers makes it full.
    "gemma4-k-eq-v-proportional-rope-repeated-kv-heads": (
        lambda: Gemma4TextConfig(
            **{**TINY, "num_hidden_layers": 4, "num_key_value_heads": 4},
            **GEMMA4,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            final_logit_softcapping=30.0,
        ),
        gemma4_last_layer_sliding,
    ),
    # ... as its config.json leaves things: five sliding layers to a full one (of 2 KV heads of 32, the
    # sliding layers' 2 of 16 each held twice), `global_head_dim` rather than transformers' per-layer
    # config, the head tied by default
    "gemma4-default-layer-types-as-google-names-it": (
        lambda: Gemma4TextConfig(**{**TINY, "num_hidden_layers": 6}, **GEMMA4),
        gemma4_as_google_names_it,
    ),
    # Gemma 4 E2B's and E4B's layers: per-layer embeddings (8 a layer: the token's own and the
    # embeddings projected and normed, each layer's share gated by its stream); the last two layers
    # reading the KV caches of the last earlier layer of their type (`num_kv_shared_layers`), their
    # MLPs twice as wide (`use_double_wide_mlp`)
    "gemma4-per-layer-embeddings-shared-kv-layers": (
        lambda: Gemma4TextConfig(
            **{**TINY, "num_hidden_layers": 5},
            **{**GEMMA4, "hidden_size_per_layer_input": 8},
            vocab_size_per_layer_input=49152,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]
            + ["sliding_attention", "full_attention"],
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
        ),
        None,
    ),
    # Gemma 4 26B-A4B's layers: beside the dense MLP 2 of 4 experts (GELU) a token, picked by a router
    # of their own over the layer's input stream, scaled by their per-expert scales; each output
    # normed before they are added
    "gemma4-experts-beside-the-mlp": (
        lambda: Gemma4TextConfig(
            **{**TINY, "num_hidden_layers": 2},
            **GEMMA4,
            layer_types=["sliding_attention", "full_attention"],
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
        ),
        None,
    ),
    # Google's Gemma 3n (E2B's and E4B's layers): four AltUp streams, each layer predicting them all
    # from a mix by the active one's router, correcting them by its change; LAuReL's low-rank branch
    # beside attention; the first two MLPs' gates cut at their mean plus 1.645 standard deviations; MLPs
    # of two widths; per-layer embeddings (8 a layer; tokens past the 1,000th take token 0's); the last
    # two layers reading the KV caches of the last earlier layer of their type; logits soft-capped
    "gemma3n-altup-laurel-sparse-gates-shared-kv": (
        lambda: Gemma3nTextConfig(
            **{**TINY, "num_hidden_layers": 5, "intermediate_size": [96, 64, 96, 64, 96]},
            **GEMMA3N,
            activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0],
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]
            + ["sliding_attention", "full_attention"],
        ),
        None,
    ),
    # ... as its config.json leaves things: four sliding layers to a full one, one MLP width, no sparse
    # layers (10 of more than 10 are), AltUp's active stream the first, its output scaled, thetas of 1e6
    # and 1e4 (full and sliding layers)
    "gemma3n-defaults": (
        lambda: Gemma3nTextConfig(**{**TINY, "num_hidden_layers": 10}, **GEMMA3N),
        gemma3n_as_google_leaves_it,
    ),
    # JetBrains' Mellum 2: Qwen3-MoE's layers, two sliding (a window of 24, a rope of theta 1e4 against
    # the full layers' 5e5), the first MLP dense, the others 2 of 4 experts
    "mellum-sliding-layers-own-rope-dense-first": (
        lambda: MellumConfig(
            **{**TINY, "num_hidden_layers": 4},
            head_dim=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            sliding_window=24,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
        None,
    ),
    # ... as its config.json leaves things: every layer full attention and experts, thetas by default
    "mellum-defaults": (
        lambda: MellumConfig(
            **{**TINY, "num_hidden_layers": 2},
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
        mellum_as_jetbrains_leaves_it,
    ),
    # OpenBMB's MiniCPM5-MoE: GLM-4.5's experts (2 of 8 in 2 groups, one picked, a shared expert,
    # scaled by 2.5) past a dense layer, Qwen3.5's gated attention (q and its gate from one projection)
    # without head norms, all four projections biased. (Weights of 0.1: at 0.2 transformers' own
    # bfloat16 tokens sat 1.1-2.8 below its float32 best, near-tied experts flipping.)
    "minicpm5-moe-gated-attention-grouped-experts": (
        lambda: MiniCPM5MoeConfig(
            **{**TINY, "num_hidden_layers": 3, "initializer_range": 0.1},
            **MINICPM5_EXPERTS,
            mlp_layer_types=["dense", "sparse", "sparse"],
            attention_bias=True,
            routed_scaling_factor=2.5,
        ),
        None,
    ),
    # ... as its release names it (`MiniCPM5MoEForCausalLM`), the dense layers by `first_k_dense_replace`
    # (1 by default), theta 5e6 and experts scaled by 3.66 by default
    "minicpm5-moe-as-openbmb-names-it": (
        lambda: MiniCPM5MoeConfig(
            **{**TINY, "num_hidden_layers": 3, "initializer_range": 0.1}, **MINICPM5_EXPERTS
        ),
        minicpm5_as_openbmb_names_it,
    ),
    # Ai2's OLMo Hybrid: Gated DeltaNet (its six projections, 4 value heads over 2 key heads of 16)
    # around an OLMo 3 attention layer (norms after attention and the MLP, q and k normed whole), beta
    # in [0, 1] (`linear_allow_neg_eigval` off)
    "olmo-hybrid-delta-attention-delta": (
        lambda: OlmoHybridConfig(
            **{**TINY, "num_hidden_layers": 3},
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_allow_neg_eigval=False,
        ),
        None,
    ),
    # ... its attention without positions (NoPE: a rope of no theta), its long-context form
    "olmo-hybrid-nope": (
        lambda: OlmoHybridConfig(
            **{**TINY, "num_hidden_layers": 2},
            layer_types=["linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": None},
        ),
        None,
    ),
    # ... as its config.json leaves things: three Gated DeltaNet layers to one attention layer, key heads
    # as many as the query heads of 0.75 x hidden / heads, value heads twice as wide, beta in [0, 2]
    "olmo-hybrid-defaults": (
        lambda: OlmoHybridConfig(**{**TINY, "num_hidden_layers": 4}),
        olmo_hybrid_as_ai2_leaves_it,
    ),
    # Liquid AI's LFM3: LFM2's convolutions and attention, a sliding layer (a window of 24, its own rope
    # of theta 1e4) and a full one (the proportional rope: 4 of 8 pairs turning), no head gates, no
    # sandwich norms
    "lfm3-sliding-layer-proportional-rope": (
        lambda: Lfm3Config(
            **{**TINY, "num_hidden_layers": 5},
            head_dim=16,
            layer_types=["conv", "sliding_attention", "full_attention", "conv", "sliding_attention"],
            sliding_window=24,
            use_attention_gate=False,
            use_sandwich_norm=False,
        ),
        None,
    ),
    # ... as its config.json leaves things: full attention at layer 2, sliding at 4 (a window of 256,
    # which the prompts cross), convolutions of 7 taps elsewhere, every head's output gated, sandwich
    # norms, the ropes' defaults, the head tied
    "lfm3-defaults": (
        lambda: Lfm3Config(**{**TINY, "num_hidden_layers": 6}, head_dim=16),
        lfm3_as_liquid_leaves_it,
    ),
    # MiniMax-Text-01's layers: lightning attention (4 heads of 16, each its own decay rate, falling
    # layer by layer; prompts cross chunks of 64) in the middle two, softmax attention (GQA, the rope)
    # in the first and last, within a window of 40; Mixtral's experts (2 of 4) in every layer; each
    # layer post-norm with its residual factors (the mixer's by its kind, the MLP's) away from 1
    "minimax-lightning-attention-post-norm-factors": (
        lambda: MiniMaxConfig(
            **{**TINY, "num_hidden_layers": 4, "initializer_range": 0.1},
            layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=40,
            **MINIMAX_FACTORS,
        ),
        None,
    ),
    # ... as MiniMaxConfig leaves things: every other layer lightning from the second, factors of 1,
    # theta 1e6
    "minimax-defaults": (
        lambda: MiniMaxConfig(
            **{**TINY, "num_hidden_layers": 4, "initializer_range": 0.1}, num_local_experts=4
        ),
        minimax_as_transformers_leaves_it,
    ),
    # Zyphra's Zamba2: Mamba2 in every layer (8 heads of 16 in 2 groups, chunks of 32), three of them
    # hybrid, taking two shared blocks in turn (attention over the stream beside the embeddings, heads
    # of 32 turned by the rope, then a GELU MLP), each with adapters of its own on q, k, v and the MLP.
    # (Weights of 0.1: at TINY's 0.2 both its and our float32 logprobs sit ~1e-3 from float64's.)
    "zamba2-shared-blocks-adapters-rope": (
        lambda: Zamba2Config(
            **{**TINY, "num_hidden_layers": 6, "num_key_value_heads": 4, "initializer_range": 0.1},
            **ZAMBA2_MAMBA,
            layers_block_type=["mamba", "hybrid"] * 3,
            num_mem_blocks=2,
            use_shared_attention_adapter=True,
            adapter_rank=8,
            use_mem_rope=True,
        ),
        None,
    ),
    # ... as its config.json leaves things: one block, adapters on the MLP alone, no rope, Mamba2 of one
    # group, the MLP 4 x hidden_size, as many KV heads as query heads, exact GELU
    "zamba2-defaults": (
        lambda: Zamba2Config(
            **{**TINY, "num_hidden_layers": 4, "initializer_range": 0.1, "intermediate_size": None}
            | {"num_key_value_heads": None},
            **{**ZAMBA2_MAMBA, "mamba_ngroups": 1},
            layers_block_type=["hybrid", "mamba"] * 2,
        ),
        zamba2_as_zyphra_leaves_it,
    ),
    # TII's Falcon-7B: attention (every query head, then one key and one value in query_key_value) and
    # the ungated GELU MLP side by side on one LayerNorm, no biases, NeoX's rotary, the head tied
    "falcon-7b-multi-query-one-norm": (lambda: FalconConfig(**FALCON_TINY), None),
    # Falcon-40B's new decoder architecture: each KV group's queries, key and value together, the two
    # branches on norms of their own (ln_attn, ln_mlp); biased projections
    "falcon-40b-grouped-kv-two-norms-biases": (
        lambda: FalconConfig(**FALCON_TINY, new_decoder_architecture=True, num_kv_heads=2, bias=True),
        None,
    ),
    # ... and one layer after the other (`parallel_attn` false), every head's q, k and v side by side
    "falcon-sequential-heads-side-by-side": (
        lambda: FalconConfig(**FALCON_TINY, multi_query=False, parallel_attn=False, bias=True),
        None,
    ),
    # OpenAI's GPT-2: a learned embedding of each position added to the token's, no rotary, LayerNorms,
    # every projection biased and stored input by output (Conv1D), q, k and v in one, an ungated
    # GELU MLP (tanh), the head tied
    "gpt2-learned-positions-conv1d-fused-qkv": (lambda: GPT2Config(**GPT2_TINY), None),
    # Microsoft's BioGPT: OPT's layer (learned positions offset by 2, LayerNorms with a bias at 1e-5
    # whatever layer_norm_eps says, every projection biased), a GELU MLP, the token embeddings times
    # sqrt(hidden); the activation, the scaling and the tied head by BioGptConfig's defaults
    "biogpt-scaled-embeddings-offset-positions": (
        lambda: BioGptConfig(**{k: v for k, v in TINY.items() if k != "num_key_value_heads"}),
        drop("hidden_act", "scale_embedding", "tie_word_embeddings"),
    ),
    # BigScience's BLOOM: ALiBi in place of positions (4 heads' slopes 2^-2, 2^-4, 2^-6, 2^-8), a
    # LayerNorm on the embeddings, GPT-2's sequential layer with every projection biased, q, k and v a
    # head at a time in `query_key_value`, the head tied
    "bloom-alibi-embedding-norm-fused-heads": (lambda: BloomConfig(**BLOOM_TINY), None),
    # ... 6 heads of 16: BLOOM's slopes for a head count that is no power of two (the 4 heads', then
    # every other one of 8 heads'); the norms' eps and the tied head by BloomConfig's defaults
    "bloom-6-heads-interleaved-slopes": (
        lambda: BloomConfig(**{**BLOOM_TINY, "hidden_size": 96, "n_head": 6}),
        drop("layer_norm_epsilon", "tie_word_embeddings"),
    ),
    # MosaicML's MPT: ALiBi, no bias anywhere (its LayerNorms' neither), q, k and v one after the other
    # in `Wqkv`, an exact GELU MLP, the head tied
    "mpt-alibi-no-biases-wqkv": (lambda: MptConfig(**MPT_TINY), None),
    # Databricks' DBRX: LayerNorms of no bias, q, k and v in one `Wqkv` clamped to +-2 (at this scale
    # a clamp that bites), 2 KV heads; every MLP 8 experts of 32 whose rows share one tensor a
    # projection (w1, v1, w2), 2 a token by the router's softmax, their weights divided by their sum
    # Adept's Persimmon: GPT-NeoX's sequential layer (q, k and v a head at a time in query_key_value,
    # every projection biased), each query and key head LayerNormed (one weight and bias for all)
    # before the rope over half of each head, a ReLU² MLP: each by PersimmonConfig's defaults
    "persimmon-head-layernorms-half-rotary-relu2": (
        lambda: PersimmonConfig(**{k: v for k, v in TINY.items() if k != "num_key_value_heads"}),
        drop("rope_parameters", "hidden_act", "qk_layernorm"),
    ),
    # Microsoft's Phi-3.5-MoE: Mixtral's layout with LayerNorms, every projection and the LM head
    # biased; 8 experts of 96, the 2 sparsemixer picks, each weighted by its softmax over the experts
    # within a relative 0.6 of it (a margin wide enough to take others in); LongRoPE's long factors
    # with Phi-3.5-MoE's own attention factor (`long_mscale`)
    "phimoe-sparsemixer-longrope-mscale-biases": (
        lambda: PhimoeConfig(
            **TINY,
            num_local_experts=8,
            attention_bias=True,
            lm_head_bias=True,
            router_jitter_noise=0.3,
            original_max_position_embeddings=256,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.4, 1.5],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0],
                "short_mscale": 1.1,
                "long_mscale": 1.3,
            },
        ),
        None,
    ),
    # ... PhimoeConfig's defaults where config.json leaves them out: 16 experts, the 0.01 margin, theta
    # 1e6, LayerNorms at 1e-5, no biases
    "phimoe-defaults": (
        lambda: PhimoeConfig(**TINY),
        drop("num_local_experts", "router_jitter_noise", "rope_parameters", "rms_norm_eps", "attention_bias"),
    ),
    "dbrx-clamped-wqkv-stacked-expert-rows": (
        lambda: DbrxConfig(
            **MPT_TINY,
            attn_config={"clip_qkv": 2.0, "kv_n_heads": 2, "rope_theta": 10000.0},
            ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2},
        ),
        None,
    ),
    # ... DbrxConfig's defaults where it has them: one KV head, 4 experts, their weights normalized, SiLU;
    # the rope's theta where DBRX's releases keep it, in attn_config (transformers' DBRX needs it there,
    # and a clip_qkv, but turns by rope_parameters': the same 10,000 here). (Its default top expert
    # alone flips experts in bfloat16 here, transformers' too: 2 a token.)
    "dbrx-defaults-one-kv-head": (
        lambda: DbrxConfig(
            **MPT_TINY,
            attn_config={"rope_theta": 10000.0, "clip_qkv": 2.0},
            ffn_config={"ffn_hidden_size": 32, "moe_top_k": 2},
        ),
        dbrx_defaults_left_out,
    ),
    # ... 6 heads of 16 (MPT's order of slopes for a head count that is no power of two), the tied
    # head and the norms' eps by MptConfig's defaults
    "mpt-6-heads-mpt-order-slopes": (
        lambda: MptConfig(**{**MPT_TINY, "d_model": 96, "n_heads": 6}),
        drop("layer_norm_epsilon", "tie_word_embeddings"),
    ),
    # BigCode's StarCoder: GPT-2's layer as nn.Linear tensors, one KV head (multi_query, the default)
    "gpt-bigcode-multi-query": (lambda: GPTBigCodeConfig(**GPT2_TINY), None),
    # ... or each head's q, k and v side by side in c_attn, q.k unscaled (`scale_attn_weights` false)
    "gpt-bigcode-heads-side-by-side-unscaled": (
        lambda: GPTBigCodeConfig(**GPT2_TINY, multi_query=False, scale_attn_weights=False),
        None,
    ),
    # Andrej Karpathy's nanochat: RMSNorms of no weight (the embeddings normed too), the rotation the
    # other way, each query and key head normed after it, an ungated ReLU² MLP, the logits
    # soft-capped at 15 (NanoChatConfig's default, config.json naming none)
    "nanochat-weightless-norms-reversed-rotary-softcap": (
        lambda: NanoChatConfig(**TINY),
        drop("final_logit_softcapping"),
    ),
    # EleutherAI's GPT-J: attention and a biased ungated GELU MLP side by side on one LayerNorm, no
    # attention biases, GPT-J's rotary over the first 8 of each 16-dimension head, an LM head with a
    # bias, untied (GPTJConfig's default, config.json naming none)
    "gptj-parallel-interleaved-partial-rotary-biased-head": (
        lambda: GPTJConfig(**{**GPT2_TINY, "n_positions": 1024}, rotary_dim=8),
        drop("tie_word_embeddings"),
    ),
    # EleutherAI's GPT-Neo: learned positions, q, k and v unbiased (o biased), q.k unscaled, layer 1
    # local (a window of 24: `attention_types`), layer 0 global
    "gpt-neo-unscaled-local-layer-1": (
        lambda: GPTNeoConfig(
            vocab_size=49152,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            intermediate_size=96,
            max_position_embeddings=1024,
            window_size=24,
            attention_types=[[["global", "local"], 1]],
            initializer_range=0.2,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
        ),
        None,
    ),
    # Meta's OPT: GPT-2's layer with a ReLU MLP (fc1, fc2), its position embeddings offset by 2
    "opt-relu-offset-positions": (
        lambda: OPTConfig(
            **{k: v for k, v in TINY.items() if k not in ("intermediate_size", "num_key_value_heads")},
            ffn_dim=96,
            word_embed_proj_dim=64,
        ),
        None,
    ),
    # SmolLM3's layers without rotary (NoPE): here layer 1 of 2; by default layer 3 of 4
    "smollm3-nope-layer-1": (lambda: SmolLM3Config(**TINY, no_rope_layers=[1, 0]), None),
    "smollm3-nope-by-default": (
        lambda: SmolLM3Config(**{**TINY, "num_hidden_layers": 4}, tie_word_embeddings=True),
        without_nope_layers,
    ),
    # Liquid AI's LFM2: short convolutions (biased, 4 taps) at layers 0, 2 and 3, attention with head
    # norms at layer 1, the MLP's width derived (144 * 2/3 * 1.5, rounded up to 32: 160), norm eps 1e-2
    "lfm2-conv-attention-conv-conv": (
        lambda: Lfm2Config(
            **{**TINY, "num_hidden_layers": 4},
            layer_types=["conv", "full_attention", "conv", "conv"],
            norm_eps=1e-2,
            conv_bias=True,
            conv_L_cache=4,
            block_ff_dim=144,
            block_multiple_of=32,
            block_ffn_dim_multiplier=1.5,
        ),
        None,
    ),
    # IBM Granite 4.0's hybrids: Mamba2 layers (8 heads of 16 in 2 groups, a state of 16, 4 taps) at
    # layers 0 and 2, attention without rope at layer 1, Granite's multipliers; the prompts (300+ tokens)
    # cross ten of Mamba2's chunks of 32
    "granite4-h-mamba-attention-mamba": (
        lambda: GraniteMoeHybridConfig(
            **{**TINY, "num_hidden_layers": 3},
            **{**GRANITE4, "layer_types": ["mamba", "attention", "mamba"]},
            **GRANITE4_MAMBA,
        ),
        None,
    ),
    # with experts beside the shared MLP (granite-4.0-h-tiny's, -small's), as IBM's config.json names
    # the layers (layers_block_type), mamba_d_head "auto" (inner / heads) and Mamba2's other defaults
    "granite4-h-experts-hub-names": (
        lambda: GraniteMoeHybridConfig(
            **{**TINY, "num_hidden_layers": 3},
            **{**GRANITE4, "layer_types": ["attention", "mamba", "mamba"], "num_local_experts": 4},
            **GRANITE4_MAMBA,
            num_experts_per_tok=2,
        ),
        granite4_as_ibm_names_it,
    ),
    # NVIDIA's Nemotron-H: a layer a block, Mamba2 (8 heads of 16 in 2 groups, a state of 16, chunks
    # of 32, the states in float32), attention without rope, or an ungated ReLU² MLP, as transformers 5
    # saves it
    "nemotron-h-mamba-mlp-attention-mlp-mamba-mlp": (lambda: NemotronHConfig(**NEMOTRON_H), None),
    # as NVIDIA's config.json names it: hybrid_override_pattern, mamba_n_groups; NemotronHConfig's
    # norm eps (1e-5) and state dtype (float32) by default
    "nemotron-h-as-nvidia-names-it": (lambda: NemotronHConfig(**NEMOTRON_H), nemotron_h_as_nvidia_names_it),
    # Nemotron 3 on a tiny scale: Nemotron-H's blocks with experts at layers 1 and 3, 2 of 8 ungated
    # ReLU² experts a token in 2 of 4 groups (DeepSeek-V3's routing, scaled by 2.5) beside an ungated
    # shared expert
    "nemotron3-mamba-experts-attention-experts": (
        lambda: NemotronHConfig(
            **{**NEMOTRON_H, "layers_block_type": ["mamba", "moe", "attention", "moe", "mamba", "mlp"]},
            **NEMOTRON3_EXPERTS,
        ),
        None,
    ),
    # Liquid AI's LFM2-8B-A1B at a tiny scale: LFM2's layers, layer 0's MLP dense, the others 2 of 8
    # experts, each scored by a sigmoid and picked by it plus the router's expert_bias, scaled by 1.5
    "lfm2-moe-dense-layer-0-sigmoid-biased-experts": (
        lambda: Lfm2MoeConfig(
            **{**TINY, "num_hidden_layers": 4},
            layer_types=["conv", "full_attention", "conv", "conv"],
            num_dense_layers=1,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            routed_scaling_factor=1.5,
        ),
        None,
    ),
    # IBM's Bamba: Mamba2 layers (as GRANITE4_MAMBA's) but at layer 1, where attention turns half of
    # each head (BambaConfig's fixed partial_rotary_factor), every projection biased
    "bamba-mamba-attention-mamba-biases": (
        lambda: BambaConfig(
            **{**TINY, "num_hidden_layers": 3},
            attn_layer_indices=[1],
            attention_bias=True,
            **GRANITE4_MAMBA,
        ),
        None,
    ),
    # as IBM's config.json names it: a top-level rope_theta, no partial_rotary_factor (0.5 whatever
    # it says), no rms_norm_eps (1e-5)
    "bamba-as-ibm-names-it": (
        lambda: BambaConfig(**{**TINY, "num_hidden_layers": 3}, attn_layer_indices=[2], **GRANITE4_MAMBA),
        bamba_as_ibm_names_it,
    ),
    # Mamba2 alone: two layers of it (8 heads of 16 in 2 groups, states of 16, chunks of 32), no
    # attention, its residual stream kept in float32 by transformers (`residual_in_fp32`)
    "mamba2-no-attention": (
        lambda: Mamba2Config(
            vocab_size=TINY["vocab_size"],
            hidden_size=64,
            num_hidden_layers=2,
            num_heads=8,
            head_dim=16,
            n_groups=2,
            state_size=16,
            chunk_size=32,
            initializer_range=0.2,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
        ),
        None,
    ),
    # Mamba (1) alone: two layers of its selective state space (MAMBA_TINY's), the time step's rank
    # and the tied LM head MambaConfig's defaults (config.json naming neither)
    "mamba-selective-scan-tied": (
        lambda: MambaConfig(**MAMBA_TINY),
        drop("tie_word_embeddings", "time_step_rank"),
    ),
    # AI21's Jamba: attention without positions at layers 1 and 3 (`attn_layer_period` 2, offset 1),
    # Mamba's state space (its time step, B and C RMS-normed by weights of their own) at 0 and 2; 2 of 4
    # experts a token at layers 1 and 3, weighted by their softmax over all four (not renormalized)
    "jamba-mamba-attention-experts": (
        lambda: JambaConfig(
            **{**TINY, "num_hidden_layers": 4},
            attn_layer_period=2,
            attn_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            use_mamba_kernels=False,
        ),
        None,
    ),
    # TII's FalconMamba: Mamba's layers with B, C and the time step RMS-normed (no weight)
    "falcon-mamba-normed-b-c-dt": (lambda: FalconMambaConfig(**MAMBA_TINY), None),
    # Qwen3.5: Gated DeltaNet (4 value heads over 2 key heads of 16, states 16 x 16) in layers 0 and 2,
    # gated attention (head_dim 32, a quarter turned) with every projection biased in layer 1
    "qwen3.5-delta-attention-delta-biases": (
        lambda: Qwen3_5TextConfig(
            **{**TINY, "num_hidden_layers": 3},
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            attention_bias=True,
            rms_norm_eps=1e-2,
            **QWEN3_5_LINEAR,
        ),
        None,
    ),
    # Qwen3.5's experts: 4 of 16, 2 a token (softmax renormalized over the top 2) beside a shared
    # expert of 32 under its sigmoid gate, in every layer
    "qwen3.5-moe-shared-expert": (
        lambda: Qwen3_5MoeTextConfig(
            **{**TINY, "num_hidden_layers": 3},
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            **QWEN3_5_LINEAR,
        ),
        None,
    ),
    # as Qwen's configs leave things out: no layer_types (every 4th layer full attention), no
    # partial_rotary_factor (0.25), no rms_norm_eps (1e-6); the LM head tied
    "qwen3.5-by-interval-tied": (
        lambda: Qwen3_5TextConfig(
            **{**TINY, "num_hidden_layers": 5}, tie_word_embeddings=True, **QWEN3_5_LINEAR
        ),
        qwen3_5_as_qwen_leaves_it,
    ),
    # Qwen3-Next: Qwen3.5's layers, its linear attention's projections fused by key head (in_proj_qkvz,
    # in_proj_ba: 2 value heads a key head); experts (4 of 16, 2 a token, their softmax not
    # renormalized, beside a gated shared expert) in every second MLP but mlp_only_layers' 3, the
    # others dense; every attention projection biased, norm eps 1e-2
    "qwen3-next-sparse-step-dense-layer-unnormalized": (
        lambda: Qwen3NextConfig(
            **{**TINY, "num_hidden_layers": 4},
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            attention_bias=True,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            rms_norm_eps=1e-2,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            **QWEN3_5_LINEAR,
        ),
        None,
    ),
    # as Qwen's config.json leaves things out: no layer_types (every 4th layer full attention), no
    # partial_rotary_factor or norm_topk_prob (0.25, renormalized); the LM head tied, norm eps 1e-2
    # (tiny Qwen3-Next models at 1e-6 sit several nats apart in transformers' own bf16 and float32)
    "qwen3-next-as-qwen-leaves-it": (
        lambda: Qwen3NextConfig(
            **{**TINY, "num_hidden_layers": 5},
            tie_word_embeddings=True,
            rms_norm_eps=1e-2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            **QWEN3_5_LINEAR,
        ),
        qwen3_next_as_qwen_leaves_it,
    ),
    # Kimi Linear: KDA (2 heads of 16, a decay a key channel) in layers 0, 2 and 3, latent attention
    # without rotary (4 heads over a latent of 56 + 8) in layer 1; 2 of 8 experts a token in 2 of 4
    # groups (DeepSeek-V3's routing) beside a shared expert in layers 1 and 2, layers 0 and 3 dense
    "kimi-linear-kda-mla-kda-kda-experts": (
        lambda: KimiLinearConfig(
            **{**TINY, "num_hidden_layers": 4},
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "dense"],
            **KIMI_LINEAR,
        ),
        None,
    ),
    # as the Hub's config.json names it (`kimi_linear_as_moonshot_names_it`)
    "kimi-linear-as-moonshot-names-it": (
        lambda: KimiLinearConfig(
            **{**TINY, "num_hidden_layers": 4},
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            **KIMI_LINEAR,
        ),
        kimi_linear_as_moonshot_names_it,
    ),
    # Llama 4: GPT-J's rotary by Llama 3's scaling in layers 0-2, q and k RMS-normed after it; layer 3
    # NoPE, its queries scaled from position 3 on (floor_scale 4); 4 experts of 24 (the top one by its
    # logit, its input scaled by the logit's sigmoid) beside a shared expert in layers 1 and 3, the
    # others' MLPs dense (96); layers 0-2 attend within chunks of 32 positions (two blocks of 16): the
    # prompts' prefills cross 10 and 11 chunks, the second prompt's decodes one more (at 352)
    "llama4-experts-every-other-layer-nope-temperature": (
        lambda: Llama4TextConfig(
            **{**TINY, "num_hidden_layers": 4, "intermediate_size": 24},
            head_dim=16,
            intermediate_size_mlp=96,
            num_local_experts=4,
            interleave_moe_layer_step=2,
            floor_scale=4,
            attn_scale=0.5,
            attention_chunk_size=32,
            rope_parameters={**LLAMA3_ROPE, "rope_theta": 500_000.0},
        ),
        None,
    ),
    # Falcon-H1: attention and Mamba2 (8 heads of 8 over d_ssm 64, 2 groups, states of 16) side by
    # side in every layer; every μP multiplier away from 1 and from the others, every projection
    # biased, Mamba2's gated norm after its norm
    "falcon-h1-multipliers-biases-norm-before-gate": (
        lambda: FalconH1Config(
            **{**TINY, "num_hidden_layers": 3},
            **FALCON_H1_MAMBA,
            mamba_rms_norm=True,
            mamba_norm_before_gate=True,
            attention_bias=True,
            mlp_bias=True,
            mamba_proj_bias=True,
            projectors_bias=True,
            embedding_multiplier=1.7,
            lm_head_multiplier=0.6,
            mlp_multipliers=[1.3, 0.8],
            key_multiplier=0.7,
            attention_in_multiplier=1.2,
            attention_out_multiplier=0.9,
            ssm_multipliers=[1.1, 0.9, 1.4, 0.75, 1.25],
            ssm_in_multiplier=1.15,
            ssm_out_multiplier=0.85,
        ),
        None,
    ),
    # as TII's config.json leaves things out: Mamba2's norm off (y gated alone), no multipliers
    "falcon-h1-as-tii-leaves-it": (
        lambda: FalconH1Config(**{**TINY, "num_hidden_layers": 2}, **FALCON_H1_MAMBA),
        without_falcon_h1_defaults,
    ),
    # as LiquidAI's config.json names it: attention by full_attn_idxs, block_ff_dim, tie_embedding;
    # without rope keys or norm_eps (theta 1e6, eps 1e-5 by default)
    "lfm2-as-the-hub-names-it": (
        lambda: Lfm2Config(
            **{**TINY, "num_hidden_layers": 3}, layer_types=["conv", "conv", "full_attention"]
        ),
        lfm2_as_the_hub_names_it,
    ),
}


def long_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[1] + [rng.randrange(3, 49152) for _ in range(300 + 41 * i)] for i in range(2)]


def build(root: Path, name: str, config: Any, patch: ConfigPatch | None, tokenizer_dir: str) -> str:
    model_dir = save_tiny_model(root / name, tokenizer_dir, config)
    if patch is not None:
        config_file = Path(model_dir) / "config.json"
        config_dict = json.loads(config_file.read_text())
        patch(config_dict)
        config_file.write_text(json.dumps(config_dict, indent=2))
    return model_dir


def with_config(root: Path, model_dir: str, patch: ConfigPatch) -> str:
    """`model_dir`'s files, with config.json patched."""
    root.mkdir(parents=True, exist_ok=True)
    for file in Path(model_dir).iterdir():
        if file.name != "config.json":
            (root / file.name).symlink_to(file)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    patch(config)
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


def hf_logprobs(model: Any, prompt: list[int], output: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' float32 logprob of each token of `output` after the tokens before it, and of its
    best choice there."""
    logprobs = hf_next_token_logprobs(model, prompt, output)
    return logprobs.gather(1, torch.tensor(output)[:, None])[:, 0], logprobs.max(dim=-1).values


def hf_bf16_gap(model_dir: str, model: Any, prompts: list[list[int]]) -> float:
    """`worst_gap` of transformers' own bfloat16 greedy tokens."""
    from transformers import AutoModelForCausalLM

    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    outputs = [
        bf16.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
        )[0, len(prompt) :].tolist()
        for prompt in prompts
    ]
    return worst_gap(model, prompts, outputs)


def worst_gap(model: Any, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """How far below transformers' best float32 logprob the worst of our chosen tokens sits."""
    gaps = [best - chosen for chosen, best in map(hf_logprobs, [model] * len(prompts), prompts, outputs)]
    return max(float(gap.max()) for gap in gaps)


def assert_float32_matches(model_dir: str, model: Any, prompts: list[list[int]], **settings: Any) -> LLM:
    """Each of our float32 greedy tokens is transformers' (`model`'s) greedy choice after the tokens
    before it, but for near-ties (assert_hf_greedy_choices: by induction, its greedy `generate`), and
    their logprobs its logprobs (the logits as transformers scales them: Granite's logits_scaling), all
    from one transformers forward pass a prompt. `settings`: more of LLM's. Returns our engine."""
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=128, block_size=16, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    for i, (prompt, output) in enumerate(zip(prompts, llm.generate(prompts, params), strict=True)):
        ours = output.outputs[0]
        assert len(ours.token_ids) == MAX_TOKENS
        theirs = hf_next_token_logprobs(model, prompt, ours.token_ids)
        assert_hf_greedy_choices(i, ours.token_ids, theirs)
        expected = float(theirs.gather(1, torch.tensor(ours.token_ids)[:, None]).sum())
        assert ours.cumulative_logprob == pytest.approx(expected, abs=1e-3)
    return llm


@pytest.fixture(scope="module")
def variant_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> Callable[[str], str]:
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            make_config, patch = VARIANTS[name]
            built[name] = build(tmp_path_factory.mktemp(name), name, make_config(), patch, default_model_dir)
        return built[name]

    return get


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_transformers(
    variant_dir: Callable[[str], str], default_model_dir: str, name: str
) -> None:
    model_dir, prompts = variant_dir(name), long_prompts()
    model = hf_model(model_dir)
    # (every variant holds the default model's tokenizer: read from one directory, each engine's a copy
    # of the first's, not a load of its own: tokenizer.load_tokenizer)
    llm = assert_float32_matches(model_dir, model, prompts, tokenizer=default_model_dir)
    # no window caps these; linear scaling reaches its factor times the positions (vLLM's rule)
    # (and Mamba2 alone, without positions, takes vLLM's 2,048 where a config names no length)
    assert llm.engine.config.model.max_model_len == {
        "llama-linear-rope": 4096,
        "mamba2-no-attention": 2048,
        "bloom-alibi-embedding-norm-fused-heads": 2048,  # (ALiBi: no positions to run past, vLLM's default)
        "bloom-6-heads-interleaved-slopes": 2048,
        "mamba-selective-scan-tied": 2048,
        "falcon-mamba-normed-b-c-dt": 2048,
    }.get(name, 1024)
    bf16 = LLM(
        model=model_dir, dtype="bfloat16", num_kv_blocks=128, block_size=16, tokenizer=default_model_dir
    )
    gap = worst_gap(model, prompts, greedy(bf16, prompts, MAX_TOKENS))
    limit = BF16_GAP
    if name in BF16_AS_TRANSFORMERS:  # (no further below than transformers' own bfloat16 tokens)
        limit = max(BF16_GAP, hf_bf16_gap(model_dir, model, prompts) + 0.05)
    assert gap < limit, f"a bfloat16 token sits {gap:.2f} below transformers' float32 best"
    # eager too, its decode steps in one C++ call where the CPU has it, but for biases beyond qkv
    fused = bf16.engine.executor.worker.model_runner.fused_decode
    assert (fused is not None) == (decode_layers_available() and name not in NOT_DECODE_LAYERS)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    # (rope scalings change the cos/sin table alone, a buffer the graph reads: the eager runs cover
    # them; so do scalars, biases, NoPE layers and windows, which one of these holds in the graph each:
    # Gemma 3's local and global layers, StarCoder2's biases and window, Llama 4's NoPE layers and
    # its queries scaled by position)
    [
        "qwen3",
        "phi3-tied-partial-rotary",
        "phi3-longrope",
        "gemma3",
        "qwen2-moe-shared-expert-dense-layer-0",
        "gpt-oss-sinks-clamped-experts",
        "deepseek-v3-mla-yarn-grouped-experts-4.x-config",
        "starcoder2-gelu-biases-window-tied",
        "apertus-xielu-head-norms-default-rope",
        "llama4-experts-every-other-layer-nope-temperature",  # (chunked attention inside the graph's op)
    ],
)
def test_variant_matches_transformers_compiled(
    variant_dir: Callable[[str], str], default_model_dir: str, name: str
) -> None:
    """The CPU default: the torch.compile'd forward pass (and, for bfloat16 on CPUs with AVX512-BF16,
    decode steps in one C++ call, which takes a qkv bias and Qwen3's head norms and refuses other
    biases). ~30 s a compile."""
    model_dir, prompts = variant_dir(name), long_prompts()
    model = hf_model(model_dir)
    compiled = {"tokenizer": default_model_dir, "enforce_eager": False}  # (tokenizer: as the eager test's)
    llm = assert_float32_matches(model_dir, model, prompts, **compiled)
    assert llm.engine.config.compile
    bf16 = LLM(model=model_dir, dtype="bfloat16", num_kv_blocks=128, block_size=16, **compiled)
    assert bf16.engine.config.compile
    assert worst_gap(model, prompts, greedy(bf16, prompts, MAX_TOKENS)) < BF16_GAP
    fused = bf16.engine.executor.worker.model_runner.fused_decode
    assert (fused is not None) == (decode_layers_available() and name not in NOT_DECODE_LAYERS)


def test_longrope_within_its_pretraining_length_takes_the_short_factors(
    variant_dir: Callable[[str], str],
) -> None:
    """A max_model_len within LongRoPE's pretraining length (256) turns every position by the short
    factors, as transformers does for a sequence that fits in it."""
    model_dir = variant_dir("phi3-longrope")
    rng = random.Random(1)
    prompts = [[1] + [rng.randrange(3, 49152) for _ in range(120 + 100 * i)] for i in range(2)]
    model, theirs = hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=16, max_model_len=256)
    assert_greedy_equal(model, prompts, greedy(llm, prompts, MAX_TOKENS), theirs)
    # (the long factors, served past the pretraining length, turn these prompts otherwise)
    long = LLM(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=16)
    assert greedy(long, prompts, MAX_TOKENS) != theirs


def test_dropping_the_rope_scaling_changes_transformers_outputs(
    variant_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """The prompts run far enough past the pretraining length that the scaling decides tokens, so
    parity above could fail. (The biases are random, not transformers' zeros: `save_tiny_model`.)"""
    prompts = long_prompts()[:1]
    for name, without in [
        (
            "llama-linear-rope",
            lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        ),
        ("llama-llama3-rope-4.x-config", lambda c: c.pop("rope_scaling")),
        ("qwen3-yarn-rope-4.x-config", lambda c: c.pop("rope_scaling")),
    ]:
        model_dir = variant_dir(name)
        plain = with_config(tmp_path / name, model_dir, without)
        assert hf_greedy(plain, prompts, 4)[1] != hf_greedy(model_dir, prompts, 4)[1], name


# --- GPT-OSS's experts in MXFP4, as OpenAI released its checkpoints -------------------------------


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them(
    variant_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """The experts' projections in MXFP4 (`*_blocks`, `*_scales`): our float32 tokens and logprobs on
    them are transformers' on the same files, dequantized on load (its CPU path, Mxfp4Config)."""
    from transformers import Mxfp4Config

    model_dir = save_mxfp4_gpt_oss(tmp_path / "mxfp4", variant_dir("gpt-oss-sinks-clamped-experts"))
    prompts = long_prompts()
    model = hf_model(model_dir, quantization_config=Mxfp4Config(dequantize=True))
    assert_float32_matches(model_dir, model, prompts)


def test_mxfp4_blocks_without_their_scales_are_refused_naming_them(
    variant_dir: Callable[[str], str], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = Path(save_mxfp4_gpt_oss(tmp_path / "mxfp4", variant_dir("gpt-oss-sinks-clamped-experts")))
    weights = load_file(str(model_dir / "model.safetensors"))
    del weights["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(weights, str(model_dir / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"'model.layers.1.mlp.experts.down_proj_blocks' has no MXFP4 blocks or scales"
    ):
        LLM(model=str(model_dir), dtype="float32", num_kv_blocks=8)


def test_mxfp4_dequantizes_as_transformers_does() -> None:
    """Every code, under scales from tiny to huge: the same bfloat16 values as transformers'
    conversion (which then transposes to its layout)."""
    from pagedserve.models.gpt_oss import dequantize_mxfp4
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(100, 155, (3, 5, 4), dtype=torch.uint8, generator=generator)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.dtype == torch.bfloat16 and ours.shape == (3, 5, 128)
    torch.testing.assert_close(
        ours, convert_moe_packed_tensors(blocks, scales).transpose(1, 2), rtol=0, atol=0
    )
    with pytest.raises(ValueError, match="MXFP4 blocks and scales are uint8"):
        dequantize_mxfp4(blocks.int(), scales)
    with pytest.raises(ValueError, match=r"do not match: \(3, 5, 4, 16\), \(3, 5, 3\)"):
        dequantize_mxfp4(blocks, scales[..., :3])


# --- a multimodal checkpoint's text decoder --------------------------------------------------------


def gemma3_multimodal(root: Path, tokenizer_dir: str) -> str:
    """A tiny Gemma3ForConditionalGeneration (Gemma 3 4B's layout): GEMMA3's text decoder beside a
    one-layer vision tower, saved as transformers 5 saves it (`model.language_model.*`)."""
    from transformers import Gemma3Config, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    text = Gemma3TextConfig(**TINY, **GEMMA3, rope_scaling={"rope_type": "linear", "factor": 8.0})
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    return save_tiny_model(root, tokenizer_dir, config)


def as_the_hub_lays_it_out(
    model_dir: str, text_config_4x: ConfigPatch | None = gemma3_as_transformers_4
) -> None:
    """The Hub's multimodal files (Gemma 3 4B's, Mistral Small 3.1's): the language model under
    `language_model.model.*`, the vision tower and projector at the top; the text config patched
    (Gemma 3's in 4.x's layout without layer_types)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    renamed = {
        name.replace("model.language_model.", "language_model.model.").removeprefix("model."): tensor
        for name, tensor in weights.items()
    }
    assert any(name.startswith("vision_tower.") for name in renamed)
    save_file(renamed, str(Path(model_dir) / "model.safetensors"), metadata={"format": "pt"})
    config_file = Path(model_dir) / "config.json"
    config = json.loads(config_file.read_text())
    if text_config_4x is not None:
        text_config_4x(config["text_config"])
    config_file.write_text(json.dumps(config))


@pytest.mark.parametrize("layout", ["transformers-5", "hub"])
def test_a_gemma3_multimodal_checkpoint_serves_its_text_decoder(
    tmp_path: Path, default_model_dir: str, layout: str
) -> None:
    """Gemma 3 4B, 12B and 27B ship as Gemma3ForConditionalGeneration: their text decoder is served,
    its tokens transformers' own multimodal model's on text prompts."""
    model_dir = gemma3_multimodal(tmp_path / "gemma3-mm", default_model_dir)
    prompts = long_prompts()
    model, theirs = hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    if layout == "hub":
        as_the_hub_lays_it_out(model_dir)
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=128, block_size=16)
    assert llm.engine.config.model.architecture == "Gemma3ForCausalLM"
    assert llm.engine.config.model.max_model_len == 1024  # Gemma's linear rope scales no context
    assert_greedy_equal(model, prompts, greedy(llm, prompts, MAX_TOKENS), theirs)


def mistral3_multimodal(root: Path, tokenizer_dir: str, text: Any) -> str:
    """A tiny Mistral3ForConditionalGeneration: the `text` config's decoder beside a one-layer Pixtral
    vision tower, saved as transformers 5 saves it (`model.language_model.*`)."""
    from transformers import Mistral3Config, PixtralVisionConfig

    vision = PixtralVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=8,
        image_size=28,
        patch_size=14,
    )
    # (its own LM head, as the text config says and Mistral's checkpoints have: transformers 5 ties the
    # head by the outer config's tie_word_embeddings, true by default, transformers 4 and vLLM by the
    # text config's, which pagedserve reads)
    config = Mistral3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=False
    )
    return save_tiny_model(root, tokenizer_dir, config)


@pytest.mark.parametrize(
    ("text", "architecture", "layout"),
    [
        ("ministral3", "Ministral3ForCausalLM", "transformers-5"),
        ("mistral", "MistralForCausalLM", "hub"),
    ],
    ids=["ministral3", "mistral-small-3.1-hub-layout"],
)
def test_a_mistral3_multimodal_checkpoint_serves_its_text_decoder(
    tmp_path: Path, default_model_dir: str, text: str, architecture: str, layout: str
) -> None:
    """Ministral 3 and Mistral Small 3.1 / 3.2 (Magistral, Devstral Small) ship as
    Mistral3ForConditionalGeneration: their text decoder is served (Ministral 3's or Mistral's), its
    tokens transformers' own multimodal model's on text prompts; a text config that leaves keys out
    takes its class's defaults (Ministral 3's rope, here all but its pretraining length)."""
    if text == "ministral3":
        rope = {"rope_type": "yarn", "original_max_position_embeddings": 64, "llama_4_scaling_beta": 0.4}
        decoder = Ministral3Config(**TINY, head_dim=16, rope_parameters={**MINISTRAL3_ROPE, **rope})
    else:
        decoder = MistralConfig(**TINY, head_dim=16, sliding_window=None)
    model_dir = mistral3_multimodal(tmp_path / "mistral3-mm", default_model_dir, decoder)
    prompts = long_prompts()
    model, theirs = hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert type(model).__name__ == "Mistral3ForConditionalGeneration"
    if layout == "hub":
        as_the_hub_lays_it_out(model_dir, text_config_4x=None)
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=128, block_size=16)
    assert llm.engine.config.model.architecture == architecture
    assert_greedy_equal(model, prompts, greedy(llm, prompts, MAX_TOKENS), theirs)


def qwen_vl_multimodal(root: Path, tokenizer_dir: str, family: str, tie: bool) -> str:
    """A tiny Qwen2.5-VL, Qwen3-VL (-MoE) or Qwen3.5 (-MoE): TINY's decoder (Qwen2's biases; Qwen3's
    head norms; Qwen3.5's linear attention at layers 0 and 2) beside a one-layer vision tower, saved as transformers 5 saves it (`model.language_model.*`, `model.visual.*`),
    its LM head tied where `tie` (the outer config's, as Qwen3-VL-2B and 4B ship)."""
    import transformers

    text = {**TINY, "head_dim": 16}
    vision: dict[str, Any] = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": 64,
    }
    if family in ("qwen3.5", "qwen3.5-moe"):
        rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
        text.update(
            QWEN3_5_LINEAR,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            rope_parameters={**rope, "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        )
        if family == "qwen3.5-moe":
            text.update(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=32,
            )
            config = transformers.Qwen3_5MoeConfig(
                text_config=text, vision_config=vision, tie_word_embeddings=tie
            )
        else:
            config = transformers.Qwen3_5Config(
                text_config=text, vision_config=vision, tie_word_embeddings=tie
            )
    elif family == "qwen3-vl-moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [2, 3, 3]}
        vision["deepstack_visual_indexes"] = [0]
        config = transformers.Qwen3VLMoeConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=tie
        )
    elif family == "qwen3-vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [2, 3, 3]}
        vision["deepstack_visual_indexes"] = [0]
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie)
    else:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
        config = transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=tie
        )
    return save_tiny_model(root, tokenizer_dir, config)


def qwen_vl_as_the_hub_lays_it_out(model_dir: str) -> None:
    """Qwen2.5-VL's files on the Hub (transformers 4's layout): the language model under `model.*`, the
    vision tower under `visual.*`; the text config's keys at the top of config.json, its M-RoPE as
    `rope_scaling` {"type": "mrope", "mrope_section": ...} beside `rope_theta`."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    renamed = {
        name.replace("model.language_model.", "model.").replace("model.visual.", "visual."): tensor
        for name, tensor in weights.items()
    }
    assert any(name.startswith("visual.") for name in renamed)
    save_file(renamed, str(Path(model_dir) / "model.safetensors"), metadata={"format": "pt"})
    config_file = Path(model_dir) / "config.json"
    config = json.loads(config_file.read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    text.update(
        rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]}
    )
    config.update({key: value for key, value in text.items() if key not in ("model_type", "architectures")})
    config_file.write_text(json.dumps(config))


def qwen3_vl_moe_experts_as_the_hub_stores_them(model_dir: str) -> None:
    """Qwen3-VL-MoE's checkpoints store the stacked experts input by output (gate_up [experts, hidden,
    2 x intermediate], down [experts, intermediate, hidden]), transformers holds them output by input."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    turned = {
        name: tensor.transpose(1, 2).contiguous()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        else tensor
        for name, tensor in weights.items()
    }
    assert turned["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 32)
    save_file(turned, str(Path(model_dir) / "model.safetensors"), metadata={"format": "pt"})


def with_mtp_layer(model_dir: str) -> None:
    """Qwen3.5's checkpoints carry a multi-token-prediction layer (`mtp.*`) beside the model."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    weights["mtp.fc.weight"] = torch.randn(64, 128)
    weights["mtp.layers.0.mlp.gate_proj.weight"] = torch.randn(96, 64)
    save_file(weights, str(Path(model_dir) / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("family", "architecture", "tie", "layout"),
    [
        ("qwen3-vl", "Qwen3ForCausalLM", True, "transformers-5"),
        ("qwen2.5-vl", "Qwen2ForCausalLM", False, "transformers-5"),
        ("qwen2.5-vl", "Qwen2ForCausalLM", False, "hub"),
        ("qwen3-vl-moe", "Qwen3MoeForCausalLM", False, "transformers-5"),
        ("qwen3-vl-moe", "Qwen3MoeForCausalLM", False, "hub"),
        ("qwen3.5", "Qwen3_5ForCausalLM", True, "hub"),
        ("qwen3.5-moe", "Qwen3_5MoeForCausalLM", False, "transformers-5"),
    ],
    ids=[
        "qwen3-vl-tied",
        "qwen2.5-vl",
        "qwen2.5-vl-hub-layout",
        "qwen3-vl-moe",
        "qwen3-vl-moe-hub-experts",
        "qwen3.5-tied-mtp",
        "qwen3.5-moe",
    ],
)
def test_a_qwen_vl_checkpoint_serves_its_text_decoder(
    tmp_path: Path, default_model_dir: str, family: str, architecture: str, tie: bool, layout: str
) -> None:
    """Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE and Qwen3.5: their text decoder is served (Qwen2's, Qwen3's,
    Qwen3-MoE's with its router's renormalized weights, Qwen3.5's with its multi-token-prediction layer
    left out), its tokens and logprobs transformers' own multimodal
    model's on text prompts, whose M-RoPE turns every section of a head by the token's one position;
    the vision tower left out; Qwen2.5-VL in the Hub's 4.x layout too, Qwen3-VL-MoE's experts as its
    checkpoints store them (input by output) too."""
    model_dir = qwen_vl_multimodal(tmp_path / family, default_model_dir, family, tie)
    prompts = long_prompts()
    model = hf_model(model_dir)
    assert type(model).__name__.endswith("ForConditionalGeneration")
    if layout == "hub" and family == "qwen3.5":
        with_mtp_layer(model_dir)
    elif layout == "hub" and family == "qwen3-vl-moe":
        qwen3_vl_moe_experts_as_the_hub_stores_them(model_dir)
    elif layout == "hub":
        qwen_vl_as_the_hub_lays_it_out(model_dir)
    llm = assert_float32_matches(model_dir, model, prompts)
    assert llm.engine.config.model.architecture == architecture


def test_an_lfm2_vl_checkpoint_serves_its_text_decoder(tmp_path: Path, default_model_dir: str) -> None:
    """LFM2-VL: its LFM2 text decoder served (short convolutions, attention, the LM head untied by the
    outer config, where LFM2's own default ties it), its tokens and logprobs transformers' own multimodal model's on text prompts; the
    vision tower and projector (`model.vision_tower.*`, `model.multi_modal_projector.*`) left out."""
    import transformers

    text = {
        **TINY,
        "num_hidden_layers": 3,
        "layer_types": ["conv", "full_attention", "conv"],
        "conv_bias": True,
    }
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = transformers.Lfm2VlConfig(
        text_config=text, vision_config=vision, projector_hidden_size=32, tie_word_embeddings=False
    )
    model_dir = save_tiny_model(tmp_path / "lfm2-vl", default_model_dir, config)
    assert_serves_its_text_decoder(model_dir, "Lfm2VlForConditionalGeneration", "Lfm2ForCausalLM")


def assert_serves_its_text_decoder(model_dir: str, multimodal: str, served: str) -> None:
    """The multimodal checkpoint `model_dir` (transformers' `multimodal` class) serves as its text
    decoder (`served`), its float32 tokens and logprobs transformers' own on text prompts."""
    prompts = long_prompts()
    model = hf_model(model_dir)
    assert type(model).__name__ == multimodal
    llm = assert_float32_matches(model_dir, model, prompts)
    assert llm.engine.config.model.architecture == served


def test_a_kimi_linear_convolution_missing_a_part_is_refused_naming_them(
    variant_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """The Hub's KDA convolution comes as q_conv1d, k_conv1d and v_conv1d: a layer short of one is
    refused naming what it has."""
    import transformers
    from safetensors.torch import load_file, save_file

    make_config, _ = VARIANTS["kimi-linear-kda-mla-kda-kda-experts"]
    model = transformers.AutoModelForCausalLM.from_config(make_config())
    stacked = variant_dir("kimi-linear-kda-mla-kda-kda-experts")
    model.load_state_dict(load_file(f"{stacked}/model.safetensors"), strict=False)
    hub = tmp_path / "hub"
    model.save_pretrained(hub)
    for file in Path(stacked).iterdir():
        if not (hub / file.name).exists():
            shutil.copy(file, hub / file.name)
    weights = load_file(str(hub / "model.safetensors"))
    del weights["model.layers.2.self_attn.k_conv1d.weight"]
    save_file(weights, str(hub / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"model.layers.2 has \['q', 'v'\] of q_conv1d, k_conv1d and v_conv1d"
    ):
        LLM(model=str(hub), dtype="float32", num_kv_blocks=16)


def test_a_fuyu_checkpoint_serves_its_text_decoder(tmp_path: Path, default_model_dir: str) -> None:
    """Adept's Fuyu: its Persimmon text decoder served (the Persimmon variant's layers), its tokens and
    logprobs transformers' own FuyuForCausalLM's on text prompts; the patch embedding
    (`vision_embed_tokens`) left out."""
    import transformers

    make_config, _ = VARIANTS["persimmon-head-layernorms-half-rotary-relu2"]
    config = transformers.FuyuConfig(text_config=make_config().to_dict(), patch_size=4)
    model_dir = save_tiny_model(tmp_path / "fuyu", default_model_dir, config)
    assert_serves_its_text_decoder(model_dir, "FuyuForCausalLM", "PersimmonForCausalLM")


def test_a_llama4_checkpoint_serves_its_text_decoder(tmp_path: Path, default_model_dir: str) -> None:
    """Llama 4's checkpoints are all Llama4ForConditionalGeneration: its text decoder served (the
    variant above's layers), its tokens and logprobs transformers' own multimodal model's on text
    prompts; the vision model and projector (`vision_model.*`, `multi_modal_projector.*`) left out."""
    import transformers

    make_config, _ = VARIANTS["llama4-experts-every-other-layer-nope-temperature"]
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vision_output_dim": 32,
        "projector_input_dim": 32,
        "projector_output_dim": 32,
        "image_size": 28,
        "patch_size": 14,
    }
    config = transformers.Llama4Config(text_config=make_config().to_dict(), vision_config=vision)
    model_dir = save_tiny_model(tmp_path / "llama4", default_model_dir, config)
    assert_serves_its_text_decoder(model_dir, "Llama4ForConditionalGeneration", "Llama4ForCausalLM")


def test_a_gemma4_checkpoint_serves_its_text_decoder(tmp_path: Path, default_model_dir: str) -> None:
    """Gemma 4's checkpoints are Gemma4ForConditionalGeneration: its text decoder served (the variant
    above's layers, their KV heads repeated), its tokens and logprobs transformers' own multimodal
    model's on text prompts; the vision tower and its embedder (`model.vision_tower.*`,
    `model.embed_vision.*`) left out."""
    import transformers

    make_config, patch = VARIANTS["gemma4-k-eq-v-proportional-rope-repeated-kv-heads"]
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "patch_size": 14,
    }
    config = transformers.Gemma4Config(text_config=make_config().to_dict(), vision_config=vision)
    model_dir = save_tiny_model(tmp_path / "gemma4", default_model_dir, config)
    assert_serves_its_text_decoder(model_dir, "Gemma4ForConditionalGeneration", "Gemma4ForCausalLM")


def test_a_gemma3n_checkpoint_serves_its_text_decoder(
    variant_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """Gemma 3n's checkpoints are Gemma3nForConditionalGeneration, whose vision tower transformers
    builds through timm (not installed here): the text variant's weights under its names
    (`model.language_model.*`) beside tower and embedder tensors (`model.vision_tower.*`,
    `model.audio_tower.*`, `model.embed_vision.*`, `model.embed_audio.*`), config.json's
    `text_config` with Gemma3nTextConfig's defaults, serve as the text checkpoint does (which the
    variant test holds to transformers): the same tokens and logprobs."""
    from safetensors.torch import load_file, save_file

    text_dir = Path(variant_dir("gemma3n-altup-laurel-sparse-gates-shared-kv"))
    weights = {
        f"model.language_model.{name.removeprefix('model.')}": tensor
        for name, tensor in load_file(str(text_dir / "model.safetensors")).items()
    }
    for name in (
        "model.vision_tower.timm_model.conv_stem.conv.weight",
        "model.audio_tower.subsample_conv_projection.conv_0.conv.weight",
        "model.embed_vision.embedding.weight",
        "model.embed_audio.embedding_projection.weight",
    ):
        weights[name] = torch.ones(4, 4)
    multimodal = tmp_path / "gemma3n"
    shutil.copytree(text_dir, multimodal)
    save_file(weights, str(multimodal / "model.safetensors"), metadata={"format": "pt"})
    text_config = json.loads((text_dir / "config.json").read_text())
    for key in ("architectures", "final_logit_softcapping"):  # (Gemma3nTextConfig's default: 30)
        del text_config[key]
    config = {"architectures": ["Gemma3nForConditionalGeneration"], "model_type": "gemma3n"}
    (multimodal / "config.json").write_text(json.dumps({**config, "text_config": text_config}))
    prompts = long_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    served = []
    for model_dir in (text_dir, multimodal):
        llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128, block_size=16)
        assert llm.engine.config.model.architecture == "Gemma3nForCausalLM"
        served.append(
            [(r.outputs[0].token_ids, r.outputs[0].cumulative_logprob) for r in llm.generate(prompts, params)]
        )
    assert served[1] == served[0]


def test_minimax_text_01s_own_config_names_serve_as_transformers_names(
    variant_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """MiniMax-Text-01's and MiniMax-M1's own config.json names its layers by `attn_type_list` (1
    softmax attention, 0 lightning) and its residual factors `layernorm_*_alpha`/`_beta`, beside
    `postnorm`: such a config serves as the transformers-named variant does (which the variant test
    holds to transformers), the same tokens and logprobs."""
    named = Path(variant_dir("minimax-lightning-attention-post-norm-factors"))
    own = tmp_path / "minimax"
    shutil.copytree(named, own)
    config = json.loads((named / "config.json").read_text())
    config["attn_type_list"] = [1 if kind == "full_attention" else 0 for kind in config.pop("layer_types")]
    for part in ("full_attention", "linear_attention", "mlp"):
        for factor in ("alpha", "beta"):
            ours = f"{part.replace('attention', 'attn')}_{factor}_factor"
            config[f"layernorm_{part}_{factor}"] = config.pop(ours)
    config["postnorm"] = True
    (own / "config.json").write_text(json.dumps(config))
    prompts = long_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    served = []
    for model_dir in (named, own):
        llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128, block_size=16)
        outputs = [r.outputs[0] for r in llm.generate(prompts, params)]
        served.append([(o.token_ids, o.cumulative_logprob) for o in outputs])
    assert served[1] == served[0]


def test_llama4s_chunked_attention_reaches_past_one_chunk(variant_dir: Callable[[str], str]) -> None:
    """Its rope layers attend within chunks of 32 positions, its NoPE layer over all of them, to the
    model's whole 1,024 positions: prompts arriving 40 tokens a step (parts that start and end inside
    chunks, beside other requests' decodes), and a prompt whose first 192 tokens (6 chunks) come from
    the prefix cache, give transformers' greedy tokens and logprobs."""
    model_dir = variant_dir("llama4-experts-every-other-layer-nope-temperature")
    first, second = long_prompts()
    rng = random.Random(1)
    sharing = first[:192] + [rng.randrange(3, 49152) for _ in range(77)]
    model, theirs = hf_greedy(model_dir, [first, second, sharing], MAX_TOKENS)
    llm = LLM(
        model=model_dir,
        dtype="float32",
        num_kv_blocks=128,
        block_size=16,
        max_num_batched_tokens=40,
        max_num_seqs=4,
    )
    assert llm.engine.config.model.max_model_len == 1024
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([first, second], params) + llm.generate([sharing], params)
    assert outputs[2].num_cached_tokens == 192
    ours = [out.outputs[0] for out in outputs]
    assert_greedy_equal(model, [first, second, sharing], [o.token_ids for o in ours], theirs)
    for prompt, completion in zip([first, second, sharing], ours, strict=True):
        expected = float(hf_logprobs(model, prompt, completion.token_ids)[0].sum())
        assert completion.cumulative_logprob == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attention_chunk_size": 48}, "block_size: 32 does not divide the model's attention_chunk_size 48"),
        ({"attention_chunk_size": 0}, "attention_chunk_size must be a positive integer, got 0"),
        (
            {"layer_types": ["chunked_attention", "sliding_attention", "full_attention", "full_attention"]},
            "layer_types must name 4 layers, each chunked_attention or full_attention",
        ),
    ],
    ids=["chunk-not-in-blocks", "chunk-zero", "unknown-layer-type"],
)
def test_llama4_chunks_it_cannot_serve_are_refused_naming_the_setting(
    variant_dir: Callable[[str], str], tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    model_dir = with_config(
        tmp_path / "m",
        variant_dir("llama4-experts-every-other-layer-nope-temperature"),
        lambda c: c.update(change),
    )
    with pytest.raises(ValueError, match=message):
        LLM(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=32)


# --- mixtures of experts -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("glm4-moe-grouped-biased-routing", "model.layers.2.eh_proj.weight"),
        ("deepseek-v3-mla-yarn-grouped-experts-4.x-config", "model.layers.2.enorm.weight"),
        ("minimax-m2-as-minimax-names-it", "model.layers.2.eh_proj.weight"),
    ],
)
def test_a_next_token_prediction_layer_is_left_out(
    variant_dir: Callable[[str], str], tmp_path: Path, name: str, extra: str
) -> None:
    """GLM-4.5's, DeepSeek-V3's and MiniMax-M2's checkpoints hold next-token prediction layers past
    `num_hidden_layers` (GLM-4.5's `model.layers.46.*` beside 46 layers, DeepSeek-V3's
    `model.layers.61.*`, MiniMax-M2's `model.layers.62.*` on), which transformers' model and vLLM's
    serving leave out."""
    from safetensors.torch import load_file, save_file

    model_dir = variant_dir(name)
    with_mtp = tmp_path / "with-mtp"
    shutil.copytree(model_dir, with_mtp)
    weights = load_file(str(with_mtp / "model.safetensors"))
    layer = {
        key.replace("model.layers.1.", "model.layers.2."): tensor.clone()
        for key, tensor in weights.items()
        if key.startswith("model.layers.1.")
    }
    layer[extra] = torch.zeros(64, 128)
    save_file({**weights, **layer}, str(with_mtp / "model.safetensors"), metadata={"format": "pt"})
    prompts = long_prompts()
    ours = greedy(LLM(model=str(with_mtp), dtype="float32", num_kv_blocks=128, block_size=16), prompts, 4)
    plain = greedy(LLM(model=model_dir, dtype="float32", num_kv_blocks=128, block_size=16), prompts, 4)
    assert ours == plain


def gpt2_as_openai_released_it(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """openai-community/gpt2's names: no `transformer.` prefix, each layer's causal mask beside it."""
    released = {name.removeprefix("transformer."): tensor for name, tensor in weights.items()}
    released["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 1024, 1024, dtype=torch.bool))
    return released


def opt_as_meta_released_it(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """facebook/opt-125m's names: `decoder.` without `model.`."""
    return {name.removeprefix("model."): tensor for name, tensor in weights.items()}


@pytest.mark.parametrize(
    ("name", "as_released"),
    [
        ("gpt2-learned-positions-conv1d-fused-qkv", gpt2_as_openai_released_it),
        ("opt-relu-offset-positions", opt_as_meta_released_it),
    ],
    ids=["gpt2", "opt"],
)
def test_gpt2_and_opt_checkpoints_as_first_released_serve_the_same_tokens(
    variant_dir: Callable[[str], str],
    tmp_path: Path,
    name: str,
    as_released: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = variant_dir(name)
    released = tmp_path / "released"
    shutil.copytree(model_dir, released)
    weights = as_released(load_file(str(released / "model.safetensors")))
    assert not any(key.startswith(("transformer.", "model.")) for key in weights)
    save_file(weights, str(released / "model.safetensors"), metadata={"format": "pt"})
    prompts = long_prompts()
    ours = greedy(LLM(model=str(released), dtype="float32", num_kv_blocks=128, block_size=16), prompts, 4)
    plain = greedy(LLM(model=model_dir, dtype="float32", num_kv_blocks=128, block_size=16), prompts, 4)
    assert ours == plain


def test_nemotron_h_under_nvidias_backbone_names_serves_the_same_tokens(
    variant_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """NVIDIA's checkpoints name the model `backbone` (`backbone.embeddings`, `backbone.layers.N.norm`,
    `backbone.norm_f`), where transformers 5 saves it as `model`; Nemotron 3's carry multi-token
    prediction layers (`mtp.*`), which transformers and this engine leave out."""
    from safetensors.torch import load_file, save_file

    model_dir = variant_dir("nemotron-h-as-nvidia-names-it")
    nvidia = tmp_path / "backbone"
    shutil.copytree(model_dir, nvidia)
    weights = load_file(str(nvidia / "model.safetensors"))
    renamed = {key.replace("model.", "backbone.", 1): tensor for key, tensor in weights.items()}
    assert "backbone.norm_f.weight" in renamed and "backbone.layers.0.mixer.A_log" in renamed
    renamed["mtp.layers.0.mixer.gate.weight"] = torch.ones(8, 64)
    save_file(renamed, str(nvidia / "model.safetensors"), metadata={"format": "pt"})
    prompts = long_prompts()
    ours = greedy(LLM(model=str(nvidia), dtype="float32", num_kv_blocks=128, block_size=16), prompts, 4)
    plain = greedy(LLM(model=model_dir, dtype="float32", num_kv_blocks=128, block_size=16), prompts, 4)
    assert ours == plain


def test_deepseeks_cache_holds_one_latent_head_a_token(variant_dir: Callable[[str], str]) -> None:
    """MLA's cache entry: the latent and the rotated key part (56 + 8), one head whatever the query
    heads (4), in place of 4 heads' keys (24) and values (24); the values read from the same cache,
    bound as both."""
    llm = LLM(
        model=variant_dir("deepseek-v3-mla-yarn-grouped-experts-4.x-config"),
        dtype="float32",
        num_kv_blocks=16,
        block_size=16,
    )
    model = llm.engine.config.model
    assert (model.num_kv_heads, model.head_dim) == (1, 64)
    assert model.values_in_keys and model.kv_bytes_per_token == 2 * 64 * 4  # 2 layers, float32
    cache_engine = llm.engine.executor.worker.cache_engine  # type: ignore[attr-defined]
    assert cache_engine.kv_cache.shape == (2, 1, 16, 16, 1, 64)
    k_cache, v_cache = cache_engine.kv_caches[0]
    assert k_cache.shape == (16, 16, 1, 64) and v_cache.data_ptr() == k_cache.data_ptr()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_phi2s_lm_head_bias_moves_the_greedy_tokens(
    variant_dir: Callable[[str], str], tmp_path: Path, dtype: str
) -> None:
    """Phi-2's LM head adds a bias to each logit: one of +100 on token 5 makes every greedy token 5,
    also where a bfloat16 step would take its argmax in the LM head's kernel (which has no bias:
    `ParallelLMHead.greedy_token_ids` leaves a biased head to the logits)."""
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "biased"
    shutil.copytree(variant_dir("phi2-parallel-biased-head"), model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    weights["lm_head.bias"][5] = 100.0
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(model=str(model_dir), dtype=dtype, num_kv_blocks=128, block_size=16)
    assert greedy(llm, long_prompts(), 4) == [[5] * 4] * 2


@pytest.mark.parametrize(
    ("name", "hub_key"),
    [
        ("mixtral-4-experts", "model.layers.1.block_sparse_moe.experts.3.w3.weight"),
        ("qwen2-moe-shared-expert-dense-layer-0", "model.layers.1.mlp.experts.5.up_proj.weight"),
        ("granitemoe-tied-biases", "model.layers.1.block_sparse_moe.input_linear.weight"),
        ("glm4-moe-grouped-biased-routing", "model.layers.1.mlp.shared_experts.up_proj.weight"),
        ("ernie4.5-moe-biased-picking", "model.layers.1.mlp.moe_statics.e_score_correction_bias"),
        ("deepseek-v3-mla-yarn-grouped-experts-4.x-config", "model.layers.1.mlp.experts.7.down_proj.weight"),
        ("dots1-grouped-experts-window-from-layer-1", "model.layers.1.mlp.shared_experts.gate_proj.weight"),
        ("granitemoeshared-shared-expert", "model.layers.1.shared_mlp.input_linear.weight"),
        ("lfm2-moe-dense-layer-0-sigmoid-biased-experts", "model.layers.1.feed_forward.experts.3.w3.weight"),
        ("qwen3-next-as-qwen-leaves-it", "model.layers.1.mlp.experts.3.up_proj.weight"),
        # (and KDA's convolution as three tensors, its forget gate's beside it)
        ("kimi-linear-kda-mla-kda-kda-experts", "model.layers.0.self_attn.q_conv1d.weight"),
        ("kimi-linear-kda-mla-kda-kda-experts", "model.layers.2.self_attn.f_a_proj.weight"),
        ("kimi-linear-kda-mla-kda-kda-experts", "model.layers.1.block_sparse_moe.experts.5.w3.weight"),
        ("nemotron3-mamba-experts-attention-experts", "backbone.layers.3.mixer.experts.5.up_proj.weight"),
        ("hy-v3-sigmoid-biased-experts-shared-default-theta", "model.layers.1.mlp.shared_mlp.up_proj.weight"),
        ("hy-v3-sigmoid-biased-experts-shared-default-theta", "model.layers.1.mlp.router.gate.weight"),
        ("jamba-mamba-attention-experts", "model.layers.1.feed_forward.experts.3.up_proj.weight"),
        (
            "cohere2-moe-dense-prefix-averaged-shared-expert",
            "model.layers.1.mlp.shared_experts.up_proj.weight",
        ),
        ("afmoe-gated-attention-sandwich-norms-experts-mup", "model.layers.1.mlp.experts.3.up_proj.weight"),
        (
            "minimax-m2-whole-qk-norms-partial-rope-sigmoid-biased-experts",
            "model.layers.1.block_sparse_moe.e_score_correction_bias",
        ),
    ],
)
def test_experts_as_the_hub_lays_them_out_load_as_stacked(
    tmp_path: Path, default_model_dir: str, name: str, hub_key: str
) -> None:
    """transformers 5 stacks the experts in memory (as tiny_models saves them) and writes the hub's
    layout back with `save_pretrained`: a tensor per expert and projection (Mixtral's names, Qwen's),
    or Granite's stacked `input_linear` and `output_linear`. Both load to the same model."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    make_config, _ = VARIANTS[name]
    stacked = build(tmp_path / "stacked", name, make_config(), None, default_model_dir)
    hub = tmp_path / "hub"
    # (a model made from its config writes the hub's layout; one loaded stacked writes it stacked)
    model = AutoModelForCausalLM.from_config(make_config())
    missing, unexpected = model.load_state_dict(load_file(f"{stacked}/model.safetensors"), strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # (a tied head is saved once)
    model.save_pretrained(hub)
    for file in Path(stacked).iterdir():
        if not (hub / file.name).exists():
            shutil.copy(file, hub / file.name)
    with safe_open(str(hub / "model.safetensors"), "pt") as weights:
        assert hub_key in weights.keys()  # noqa: SIM118 (safe_open has no __contains__)
    prompts = long_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = [
        [
            (o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
            for o in LLM(model=path, dtype="float32", num_kv_blocks=128, block_size=16).generate(
                prompts, params
            )
        ]
        for path in (stacked, str(hub))
    ]
    assert outputs[0] == outputs[1]


def test_a_head_norm_missing_from_the_checkpoint_is_named(
    variant_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """StableLM's head norms come a tensor a head: a layer's missing one is refused naming the layer's
    norm and the heads that came, not loaded short."""
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "m"
    shutil.copytree(variant_dir("stablelm-head-norms"), model_dir)
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.0.self_attn.k_layernorm.norms.1.weight"]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match="head norms for 'model.layers.0.self_attn.k_norm.weight' stop at 1 heads"
    ):
        LLM(model=str(model_dir), dtype="float32", num_kv_blocks=8)


def test_dbrx_releases_rope_theta_in_attn_config() -> None:
    """DBRX's own config.json (no rope_parameters) keeps its theta, 500,000, in attn_config: the model
    turns by it (transformers 5 reads only rope_parameters, whose default then stands)."""
    from pagedserve.config import _CONFIG_READERS, rope_parameters

    released = {**DBRX_REFUSED, "attn_config": {"clip_qkv": 8, "kv_n_heads": 8, "rope_theta": 500000}}
    assert rope_parameters(_CONFIG_READERS["DbrxForCausalLM"](released))["rope_theta"] == 500000
    saved = {**released, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert rope_parameters(_CONFIG_READERS["DbrxForCausalLM"](saved))["rope_theta"] == 10000.0


def test_olmo_hybrid_is_nope_only_where_its_rope_names_a_null_theta() -> None:
    """OlmoHybridConfig fills a rope_parameters without rope_theta with its default theta (the rope
    turns); only a theta named null turns the attention layers' rope off (NoPE)."""
    from pagedserve.config import olmo_hybrid_config

    base = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4}
    no_theta = olmo_hybrid_config({**base, "rope_parameters": {"rope_type": "default"}})
    assert no_theta["rope_parameters"]["rope_theta"] == 10_000.0
    null_theta = olmo_hybrid_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": None}})
    assert null_theta["rope_parameters"]["rope_theta"] is None


@pytest.mark.parametrize(
    ("name", "key", "head_rows", "message"),
    [
        (
            "falcon-7b-multi-query-one-norm",
            "transformer.h.0.self_attention.query_key_value.weight",
            16,
            r"checkpoint's query_key_value has 80 rows; config.json's 4 heads and 1 KV heads of 16 make 96",
        ),
        (
            "cohere-head-layernorms-default-theta",
            "model.layers.0.self_attn.q_norm.weight",
            1,
            r"checkpoint's q or k norm has shape \(3, 16\); config.json's heads make \(4, 16\)",
        ),
        (
            "dbrx-clamped-wqkv-stacked-expert-rows",
            "transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight",
            16,
            r"checkpoint's 'model.layers.0.self_attn.Wqkv.weight' has 112 rows; config.json's heads make 128",
        ),
    ],
    ids=["falcon-fused-qkv", "cohere-head-norms", "dbrx-wqkv"],
)
def test_a_per_head_weight_cut_short_is_refused_naming_it(
    tmp_path: Path, default_model_dir: str, name: str, key: str, head_rows: int, message: str
) -> None:
    """A checkpoint one head short of config.json's heads (here the first layer's, a head's rows cut
    off) is refused with both counts, not cut by the config's sizes into the wrong heads."""
    from safetensors.torch import load_file, save_file

    make_config, patch = VARIANTS[name]
    model_dir = Path(build(tmp_path, name, make_config(), patch, default_model_dir))
    weights = load_file(model_dir / "model.safetensors")
    weights[key] = weights[key][:-head_rows].clone()
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        LLM(model=str(model_dir), dtype="float32", num_kv_blocks=8)


# --- sliding windows --------------------------------------------------------------------------------


def test_past_the_window_chunks_and_cached_prefixes_slide_as_transformers_does(
    variant_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """A prompt's chunks that start inside and past the window, a prompt whose cached prefix is
    longer than the window, and decode steps past it: each query sees the last 32 positions alone."""
    model_dir, prompts = variant_dir("mistral-window-32"), long_prompts()
    # the window changes transformers' tokens here: full attention would not pass this test
    full_attention = with_config(tmp_path / "no-window", model_dir, lambda c: c.update(sliding_window=None))
    assert hf_greedy(model_dir, prompts, MAX_TOKENS)[1] != hf_greedy(full_attention, prompts, MAX_TOKENS)[1]
    # the second prompt shares the first's 200 tokens (a cached prefix, six windows long)
    prompts = [prompts[0], prompts[0][:200] + prompts[1][200:]]
    model, theirs = hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm = LLM(
        model=model_dir,
        dtype="float32",
        num_kv_blocks=128,
        block_size=16,
        max_num_batched_tokens=40,
        max_num_seqs=8,
    )
    assert llm.engine.config.model.max_model_len == 1024  # no cap at the window
    ours = [greedy(llm, [prompt], MAX_TOKENS)[0] for prompt in prompts]  # the second after the first
    assert llm.engine.stats().num_prefix_hits >= 192, llm.engine.stats()
    assert_greedy_equal(model, prompts, ours, theirs)


def test_a_max_model_len_past_the_positions_is_refused_naming_it(tmp_path: Path) -> None:
    """A window bounds what a layer sees, not the context: a Mistral with a window of 32 takes a
    max_model_len up to its positions (1,024), and refuses one past them or below 1, naming it."""
    from pagedserve.config import ModelConfig

    config = {**MistralConfig(**TINY, sliding_window=32).to_dict(), "architectures": ["MistralForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_path(str(tmp_path), "float32", max_model_len=1024).max_model_len == 1024
    for bad in (1025, 0):
        with pytest.raises(
            ValueError, match=rf"^max_model_len: must be in \[1, 1024\] for this model, got {bad}$"
        ):
            ModelConfig.from_path(str(tmp_path), "float32", max_model_len=bad)


@pytest.mark.parametrize(
    ("config", "patch", "windows"),
    [
        # Qwen2 slides the layers from max_window_layers on: here layer 1 of 2
        (Qwen2Config(**TINY, use_sliding_window=True, sliding_window=32, max_window_layers=1), None, [0, 32]),
        (Qwen2Config(**TINY, use_sliding_window=True, sliding_window=32, max_window_layers=2), None, [0, 0]),
        # configs from before layer_types: Qwen2's use_sliding_window is off unless set, and
        # max_window_layers defaults to 28 (both of these layers full)
        (
            Qwen2Config(**TINY, use_sliding_window=True, sliding_window=32),
            drop("use_sliding_window", "layer_types"),
            [0, 0],
        ),
        (
            Qwen2Config(**TINY, use_sliding_window=True, sliding_window=32),
            drop("max_window_layers", "layer_types"),
            [0, 0],
        ),
        (
            Qwen2Config(**TINY, use_sliding_window=True, sliding_window=32, max_window_layers=0),
            drop("layer_types"),
            [32, 32],
        ),
        (Qwen2Config(**TINY), with_unused_window, [0, 0]),
        # Qwen3 reads its window as Qwen2 does
        (Qwen3Config(**TINY, use_sliding_window=True, sliding_window=32, max_window_layers=1), None, [0, 32]),
        (
            Qwen3Config(**TINY, use_sliding_window=True, sliding_window=32),
            drop("use_sliding_window", "layer_types"),
            [0, 0],
        ),
        # Mistral and Phi-3 slide every layer
        (MistralConfig(**TINY, sliding_window=None), None, [0, 0]),
        (MistralConfig(**TINY, sliding_window=32), None, [32, 32]),
        (Phi3Config(**TINY, sliding_window=32), None, [32, 32]),
        # Llama and Granite read no window (a config.json carrying one slides nothing in transformers)
        (LlamaConfig(**TINY), lambda c: c.update(sliding_window=32), [0, 0]),
        (GraniteConfig(**TINY), lambda c: c.update(sliding_window=32), [0, 0]),
        # Gemma 2 every other layer (its first), Gemma 1 none
        (Gemma2Config(**TINY, sliding_window=32), None, [32, 0]),
        (Gemma2Config(**TINY), drop("layer_types", "sliding_window"), [4096, 0]),
        (GemmaConfig(**TINY), lambda c: c.update(sliding_window=32), [0, 0]),
        # Gemma 3 slides the layers layer_types names (by default five of six), its window on always
        (Gemma3TextConfig(**TINY, sliding_window=32, sliding_window_pattern=2), None, [32, 0]),
        (
            Gemma3TextConfig(**{**TINY, "num_hidden_layers": 6}),
            drop("layer_types", "sliding_window"),
            [4096, 4096, 4096, 4096, 4096, 0],
        ),
        # SmolLM3 slides its NoPE layers, where the window is on
        (
            SmolLM3Config(**TINY, use_sliding_window=True, sliding_window=32, no_rope_layers=[1, 0]),
            None,
            [0, 32],
        ),
        (
            SmolLM3Config(**TINY, use_sliding_window=True, sliding_window=32, no_rope_layers=[1, 1]),
            None,
            [0, 0],
        ),
        (
            SmolLM3Config(**{**TINY, "num_hidden_layers": 4}, use_sliding_window=True, sliding_window=32),
            drop("layer_types", "no_rope_layers"),
            [0, 0, 0, 32],
        ),
        (
            SmolLM3Config(**TINY, use_sliding_window=True, sliding_window=32, no_rope_layers=[1, 0]),
            drop("use_sliding_window"),
            [0, 0],
        ),
        # Mixtral slides every layer as Mistral does, by default none; Qwen3-MoE every layer where
        # the window is on; Qwen2-MoE by default every other layer below max_window_layers
        (MixtralConfig(**TINY, num_local_experts=2, sliding_window=32), None, [32, 32]),
        (MixtralConfig(**TINY, num_local_experts=2), drop("sliding_window"), [0, 0]),
        (Qwen3MoeConfig(**TINY, **SMALL_MOE, use_sliding_window=True, sliding_window=32), None, [32, 32]),
        (Qwen3MoeConfig(**TINY, **SMALL_MOE, sliding_window=32), None, [0, 0]),
        (
            Qwen2MoeConfig(
                **{**TINY, "num_hidden_layers": 4},
                **SMALL_MOE,
                use_sliding_window=True,
                sliding_window=32,
                max_window_layers=3,
            ),
            drop("layer_types"),
            [32, 0, 32, 0],
        ),
        (
            Qwen2MoeConfig(**{**TINY, "num_hidden_layers": 4}, **SMALL_MOE, sliding_window=32),
            drop("layer_types"),
            [0, 0, 0, 0],
        ),
        # GPT-OSS: every other layer from the first, by layer_types or by default, 128 by default
        (GptOssConfig(**TINY, **GPT_OSS, sliding_window=32), None, [32, 0]),
        (GptOssConfig(**{**TINY, "num_hidden_layers": 4}, **GPT_OSS), drop("layer_types"), [128, 0, 128, 0]),
        (GptOssConfig(**TINY, **GPT_OSS), drop("sliding_window"), [128, 0]),
        # OLMo 3: every fourth layer global, by layer_types or by default, 4,096 by default
        (
            Olmo3Config(**{**TINY, "num_hidden_layers": 4}, sliding_window=32),
            drop("layer_types"),
            [32, 32, 32, 0],
        ),
        (
            Olmo3Config(**TINY, layer_types=["full_attention", "sliding_attention"]),
            drop("sliding_window"),
            [0, 4096],
        ),
    ],
    ids=[
        "qwen2-layer-1-slides",
        "qwen2-no-layer-slides",
        "qwen2-use-unset",
        "qwen2-28-window-layers-default",
        "qwen2-every-layer-slides",
        "qwen2-use-false",
        "qwen3-layer-1-slides",
        "qwen3-use-unset",
        "mistral-no-window",
        "mistral-window",
        "phi3-window",
        "llama-window-unread",
        "granite-window-unread",
        "gemma2",
        "gemma2-default-window",
        "gemma-window-unread",
        "gemma3-pattern-2",
        "gemma3-default-pattern-and-window",
        "smollm3-nope-layer-slides",
        "smollm3-no-nope-layer",
        "smollm3-default-nope-layer-slides",
        "smollm3-use-unset",
        "mixtral-window",
        "mixtral-no-window-by-default",
        "qwen3-moe-every-layer-slides",
        "qwen3-moe-use-unset",
        "qwen2-moe-every-other-layer-below-max-window-layers",
        "qwen2-moe-use-unset",
        "gpt-oss",
        "gpt-oss-default-layer-types",
        "gpt-oss-default-window",
        "olmo3-default-layer-types",
        "olmo3-default-window",
    ],
)
def test_the_window_applies_where_transformers_slides_a_layer(
    tmp_path: Path, config: Any, patch: ConfigPatch | None, windows: list[int]
) -> None:
    from pagedserve.config import ModelConfig, layer_windows
    from transformers import AutoModelForCausalLM

    config_dict = {
        **config.to_dict(),
        "architectures": [
            type(config).__name__.replace("TextConfig", "Config").replace("Config", "ForCausalLM")
        ],
    }
    if patch is not None:
        patch(config_dict)
    (tmp_path / "config.json").write_text(json.dumps(config_dict))
    # transformers' own reading of the same file: the window each layer's attention passes on
    theirs = type(config).from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(theirs)
    # Qwen2-MoE's attention takes its window from the mask its model picks by layer_types alone
    masks_by_type = "causal_mask_mapping[self.config.layer_types[i]]" in inspect.getsource(
        type(model.model).forward
    )
    for number, (layer, window) in enumerate(zip(model.model.layers, windows, strict=True)):
        attention = layer.self_attn
        # Qwen's and SmolLM3's attention holds its window, Mistral's and Phi-3's pass the config's,
        # Llama's and Granite's pass none
        passes_one = "sliding_window" in inspect.getsource(type(attention).forward)
        kept = getattr(attention, "sliding_window", theirs.sliding_window) if passes_one else None
        if not passes_one and masks_by_type and theirs.layer_types[number] == "sliding_attention":
            kept = theirs.sliding_window
        assert (kept or 0) == window
    assert layer_windows(config_dict, config_dict["architectures"][0]) == windows
    assert ModelConfig.from_path(str(tmp_path), "float32").max_model_len == 1024  # a window caps nothing


# --- rope tables, read from config.json as transformers reads it ---------------------------------------


def llama3_without_pretraining_length(config: dict[str, Any]) -> None:
    del config["rope_parameters"]["original_max_position_embeddings"]  # transformers: max_position_embeddings


def llama3_with_top_level_pretraining_length(config: dict[str, Any]) -> None:
    config["original_max_position_embeddings"] = 128  # Phi-3's place, which transformers reads first


def yarn_with_top_level_pretraining_length(config: dict[str, Any]) -> None:
    config["original_max_position_embeddings"] = 128  # read before the dict's 256, as transformers does


def rope_in_both_layouts(config: dict[str, Any]) -> None:
    config["rope_scaling"] = {"type": "linear", "factor": 4.0}  # the same rope, as a 4.x config adds it
    config["rope_parameters"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}


@pytest.mark.parametrize(
    "config",
    [
        MixtralConfig(**TINY),
        SmolLM3Config(**TINY),
        GptOssConfig(**TINY, head_dim=16),
        Ministral3Config(**TINY, head_dim=16),
    ],
    ids=["mixtral-theta-1e6", "smollm3-theta-2e6", "gpt-oss-yarn-theta-150000", "ministral3-yarn-theta-1e6"],
)
def test_a_config_without_rope_keys_takes_its_classs_defaults(tmp_path: Path, config: Any) -> None:
    """A hand-written config.json may name no rope at all: transformers then takes its config class's
    (Mixtral's theta 1e6, SmolLM3's 2e6, GPT-OSS's YaRN over 4,096 positions with theta 150,000,
    Ministral 3's over 16,384 with theta 1e6)."""
    from transformers import AutoModelForCausalLM

    name = type(config).__name__.replace("Config", "ForCausalLM")
    config_dict = {**config.to_dict(), "architectures": [name]}
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        config_dict.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config_dict))
    theirs = type(config).from_pretrained(tmp_path)
    positions = torch.tensor([0, 1, 63, 64, 300, 1023])
    rotary = AutoModelForCausalLM.from_config(theirs).model.rotary_emb
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    half = head_dim // 2  # (GPT-OSS's tables hold half a head, the others' a whole one)
    ours = RotaryEmbedding(head_dim, 1024, config_dict).cos_sin_cache[positions]
    torch.testing.assert_close(ours, torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1))


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_an_olmo3_config_without_rope_keys_turns_both_layer_types_by_theta_5e5(
    tmp_path: Path, layer_type: str
) -> None:
    """Olmo3Config's default theta (500,000, not the 10,000 of most) for each layer type's table."""
    from pagedserve.config import olmo3_rope_config
    from transformers import AutoModelForCausalLM

    config = Olmo3Config(**{**TINY, "num_hidden_layers": 4})  # (layer 3 global)
    config_dict = {**config.to_dict(), "architectures": ["Olmo3ForCausalLM"]}
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        config_dict.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config_dict))
    rotary = AutoModelForCausalLM.from_config(Olmo3Config.from_pretrained(tmp_path)).model.rotary_emb
    positions = torch.tensor([0, 1, 63, 64, 300, 1023])
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None], layer_type)
    ours = RotaryEmbedding(16, 1024, olmo3_rope_config(config_dict, layer_type)).cos_sin_cache[positions]
    torch.testing.assert_close(ours, torch.cat((cos[0, :, :8], sin[0, :, :8]), dim=-1))


@pytest.mark.parametrize("factor", [1.0, 8.0])
def test_gemma4s_proportional_rope_equals_transformers(factor: float) -> None:
    """Gemma 4's full layers: NeoX's pairs over the whole 64-dimension head, the first quarter of them
    turning by theta^(-2i / 64) (divided by `factor`), the others by no angle."""
    from pagedserve.models.gemma import gemma3_rope_config
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    rope = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6, "factor": factor}
    config = Gemma4TextConfig(
        **TINY,
        head_dim=16,
        global_head_dim=64,
        hidden_size_per_layer_input=0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": rope,
        },
    )
    positions = torch.arange(0, 1024, 37)
    cos, sin = Gemma4TextRotaryEmbedding(config)(torch.zeros(1), positions[None], "full_attention")
    table = RotaryEmbedding(64, 1024, gemma3_rope_config(config.to_dict(), "full_attention")).cos_sin_cache
    assert torch.equal(table[positions, 8:32], torch.ones(len(positions), 24))  # (the still pairs' cos)
    torch.testing.assert_close(table[positions], torch.cat((cos[0, :, :32], sin[0, :, :32]), dim=-1))


@pytest.mark.parametrize(
    ("overrides", "patch"),
    [
        ({"rope_theta": 500000.0}, None),
        ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, None),
        ({"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}, None),
        ({"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}, as_transformers_4),
        ({"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}, llama3_without_pretraining_length),
        ({"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}, llama3_with_top_level_pretraining_length),
        ({}, rope_in_both_layouts),
        ({"head_dim": 32, "rope_scaling": LLAMA3_ROPE}, None),
        ({"rope_theta": 1e6, "rope_scaling": YARN_ROPE}, None),
        ({"rope_theta": 1e6, "rope_scaling": YARN_ROPE}, as_transformers_4),
        ({"rope_scaling": {**YARN_ROPE, "beta_fast": 16, "beta_slow": 2, "truncate": False}}, None),
        # DeepSeek's attention factor, a ratio of two; then one given outright
        ({"rope_scaling": {**YARN_ROPE, "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 1.0}}, None),
        ({"rope_scaling": {**YARN_ROPE, "attention_factor": 1.25}}, None),
        ({"rope_scaling": {**YARN_ROPE}}, yarn_with_top_level_pretraining_length),
    ],
    ids=[
        "default-theta-5e5",
        "linear",
        "llama3",
        "llama3-4.x-config",
        "llama3-no-pretraining-length",
        "llama3-top-level-pretraining-length",
        "both-layouts-agreeing",
        "llama3-head-dim-32",
        "yarn",
        "yarn-4.x-config",
        "yarn-betas-untruncated",
        "yarn-mscale-ratio",
        "yarn-attention-factor",
        "yarn-top-level-pretraining-length",
    ],
)
def test_rotary_tables_equal_transformers(
    tmp_path: Path, overrides: dict[str, Any], patch: ConfigPatch | None
) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config_dict = {**LlamaConfig(**TINY, **overrides).to_dict(), "architectures": ["LlamaForCausalLM"]}
    if patch is not None:
        patch(config_dict)
    (tmp_path / "config.json").write_text(json.dumps(config_dict))
    theirs = type(LlamaConfig()).from_pretrained(tmp_path)
    positions = torch.tensor([0, 1, 63, 64, 300, 1023])
    cos, sin = LlamaRotaryEmbedding(theirs)(torch.zeros(1, dtype=torch.float32), positions[None])
    head_dim = theirs.head_dim
    ours = RotaryEmbedding(head_dim, 1024, config_dict).cos_sin_cache[positions]
    half = head_dim // 2
    torch.testing.assert_close(ours, torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1))


# --- what pagedserve does not implement is refused at load, naming the option ---------------------------


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        # transformers' Llama rotates the whole head by default and fails under scaled rope
        (lambda c: c.update(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported"),
        (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
        (lambda c: c.update(rope_scaling={"type": "linear", "factor": 4.0}), "both rope_scaling .* differ"),
        (
            lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}),
            "rope_type 'dynamic' .* is not supported",
        ),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (
            lambda c: c.update(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}),
            r"quantization_config \(bitsandbytes\) is not supported",
        ),
        # (GPT-OSS's experts alone are read from MXFP4)
        (
            lambda c: c.update(quantization_config={"quant_method": "mxfp4"}),
            r"quantization_config \(mxfp4\) is not supported \(fp8, fbgemm_fp8, gptq, awq, compressed-tensors and GPT-OSS.s mxfp4 are",
        ),
        (
            lambda c: c.update(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}),
            r"rope scaling \(linear\) needs a numeric factor, got None",
        ),
        (
            lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": "4", "rope_theta": 1e4}),
            r"rope scaling \(yarn\) needs a numeric factor, got '4'",
        ),
        # one factor a rotated pair of dimensions (head_dim 16: 8); the long ones, as max_model_len
        # (1024) reaches past the pretraining length
        (
            lambda c: c.update(
                architectures=["Phi3ForCausalLM"],
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 7,
                    "original_max_position_embeddings": 256,
                },
            ),
            r"longrope long_factor must list 8 numbers .*, got \[2.0, ",
        ),
        # (a greedy step takes the argmax before the logits are divided)
        (
            lambda c: c.update(architectures=["GraniteForCausalLM"], logits_scaling=0.0),
            "logits_scaling must be positive, got 0.0",
        ),
        (
            lambda c: c.update(
                architectures=["MixtralForCausalLM"], num_local_experts=2, num_experts_per_tok=3
            ),
            "num_experts_per_tok 3 must be 1 to the 2 experts",
        ),
        # (transformers divides by it)
        (
            lambda c: c.update(
                architectures=["Qwen3MoeForCausalLM"],
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                decoder_sparse_step=0,
            ),
            "decoder_sparse_step must be a positive integer, got 0",
        ),
        # Granite 4.0's layers: attention or Mamba2, Mamba2's heads filling mamba_expand x hidden_size
        (
            lambda c: c.update(
                architectures=["GraniteMoeHybridForCausalLM"],
                layer_types=["attention", "moe"],
                num_local_experts=0,
                shared_intermediate_size=96,
            ),
            "layer_types must name 2 layers, each attention or mamba, got",
        ),
        (
            lambda c: c.update(
                architectures=["GraniteMoeHybridForCausalLM"],
                layer_types=["attention", "mamba"],
                num_local_experts=0,
                shared_intermediate_size=96,
                mamba_n_heads=8,
                mamba_d_head=32,
            ),
            r"mamba_d_head \(32\) times mamba_n_heads \(8\) must be its Mamba2 width \(128: mamba_d_ssm, else "
            r"mamba_expand x hidden_size\)",
        ),
        (
            lambda c: c.update(
                architectures=["GraniteMoeHybridForCausalLM"],
                layer_types=["attention", "mamba"],
                num_local_experts=0,
                shared_intermediate_size=96,
                mamba_n_heads=8,
                mamba_n_groups=3,
            ),
            "3 Mamba2 groups do not divide its 8 heads",
        ),
        (
            lambda c: c.update(
                architectures=["OlmoeForCausalLM"], num_experts=2, num_experts_per_tok=1, clip_qkv="8"
            ),
            "clip_qkv must be a positive number, got '8'",
        ),
        (
            lambda c: c.update(architectures=["Ernie4_5_MoeForCausalLM"], use_bias=True),
            "use_bias is not supported for Ernie4_5_MoeForCausalLM",
        ),
        (
            lambda c: c.update(architectures=["Cohere2ForCausalLM"], logit_scale=-1.0),
            "logit_scale must be positive, got -1.0",
        ),
        (
            lambda c: c.update(architectures=["MiniMaxM2ForCausalLM"], qk_norm_type="per_head"),
            "qk_norm_type 'per_head' is not supported for MiniMaxM2ForCausalLM",
        ),
        (
            lambda c: c.update(GEMMA4_REFUSED, layer_types=["sliding_attention"]),
            "layer_types has 1 entries for 2 layers",
        ),
        (
            lambda c: c.update(
                GEMMA4_REFUSED, layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=1
            ),
            "num_kv_shared_layers 1 leaves layer 1 \\(full_attention\\) no earlier full_attention layer",
        ),
        (  # (a sliding layer's entry of 2 x 16, a full one's of 1 x 24)
            lambda c: c.update(
                GEMMA4_REFUSED, global_head_dim=24, attention_k_eq_v=True, num_global_key_value_heads=1
            ),
            "head sizes and KV heads give Gemma 4's layers KV entries .* of no one size",
        ),
        (  # (the full layers' entry of 2 x 48 needs the sliding ones' 2 heads of 16 held 6 times: 4 query heads)
            lambda c: c.update(GEMMA4_REFUSED, global_head_dim=48),
            "cannot fill a KV entry of 96 a rank \\(1 ranks, 4 query heads\\)",
        ),
        (
            lambda c: c.update(GEMMA3N_REFUSED, intermediate_size=[96]),
            "intermediate_size has 1 entries for 2 layers",
        ),
        (
            lambda c: c.update(GEMMA3N_REFUSED, activation_sparsity_pattern=[0.95]),
            "activation_sparsity_pattern has 1 entries for 2 layers",
        ),
        (
            lambda c: c.update(GEMMA3N_REFUSED, activation_sparsity_pattern=[1.0, 0.0]),
            "activation_sparsity_pattern must hold values in \\[0, 1\\), got 1.0",
        ),
        (
            lambda c: c.update(GEMMA3N_REFUSED, altup_active_idx=4),
            "altup_active_idx must be below altup_num_inputs 4, got 4",
        ),
        (
            lambda c: c.update(GEMMA3N_REFUSED, attention_k_eq_v=True),
            "attention_k_eq_v, enable_moe_block or a hidden_size_per_layer_input of 0 is not Gemma 3n's",
        ),
        (  # (Gemma3nTextConfig's default: 15 of E4B's 35 layers)
            lambda c: c.update({k: v for k, v in GEMMA3N_REFUSED.items() if k != "num_kv_shared_layers"}),
            "num_kv_shared_layers must be 0 to 1, got 15",
        ),
        (
            lambda c: c.update(architectures=["Lfm3ForCausalLM"], layer_types=["conv", "linear_attention"]),
            "layer_types must name 2 layers, each conv, sliding_attention or full_attention, got",
        ),
        (
            lambda c: c.update(architectures=["OlmoHybridForCausalLM"], layer_types=["full_attention"] * 3),
            "layer_types must name 2 layers, each full_attention or linear_attention, got",
        ),
        (
            lambda c: c.update(architectures=["MellumForCausalLM"], layer_types=["full_attention", "conv"]),
            "layer_types must name 2 layers, each full_attention or sliding_attention, got",
        ),
        (
            lambda c: c.update(architectures=["MiniMaxForCausalLM"], postnorm=False),
            "postnorm false is not supported for MiniMax",
        ),
        (
            lambda c: c.update(architectures=["MiniMaxForCausalLM"], layer_types=["full_attention", "mamba"]),
            "layer_types must name 2 layers, each full_attention or linear_attention, got",
        ),
        (
            lambda c: c.update(ZAMBA2_REFUSED, layers_block_type=["mamba", "attention"]),
            "layers_block_type must name 2 layers, each mamba or hybrid, got \\['mamba', 'attention'\\]",
        ),
        (
            lambda c: c.update(ZAMBA2_REFUSED, hidden_act="silu"),
            "hidden_act 'silu' is not supported for Zamba2",
        ),
        (  # (TINY's 2 KV heads of 32)
            lambda c: c.update(ZAMBA2_REFUSED, use_shared_attention_adapter=True),
            "use_shared_attention_adapter needs q's, k's and v's heads 2 x hidden_size \\(128\\) wide",
        ),
        (
            lambda c: c.update(ZAMBA2_REFUSED, num_mem_blocks=0),
            "num_mem_blocks must be at least 1, got 0",
        ),
        (
            lambda c: c.update(ZAMBA2_REFUSED, n_mamba_heads=6),
            "n_mamba_heads 6 does not divide mamba_expand x hidden_size 128",
        ),
        (
            lambda c: c.update(architectures=["JambaForCausalLM"], attn_layer_period=2, attn_layer_offset=2),
            "attn_layer_offset 2 must be 0 to attn_layer_period 2 - 1",
        ),
        (
            lambda c: c.update(architectures=["GraniteSWAForCausalLM"], layer_rope_theta=[1e4]),
            "layer_rope_theta has 1 entries for 2 layers",
        ),
        (
            lambda c: c.update(
                architectures=["Gemma4ForCausalLM"], hidden_size_per_layer_input=0, num_kv_shared_layers=2
            ),
            "num_kv_shared_layers must be 0 to 1, got 2",
        ),
        (
            lambda c: c.update(
                architectures=["Cohere2MoeForCausalLM"], shared_expert_combination_strategy="max"
            ),
            "shared_expert_combination_strategy 'max' \\(sum or average\\)",
        ),
        (
            lambda c: c.update(architectures=["FalconForCausalLM"], alibi=True),
            "alibi \\(ALiBi positions, Falcon-RW's\\) is not supported",
        ),
        (
            lambda c: c.update(
                architectures=["BloomForCausalLM"], apply_residual_connection_post_layernorm=True
            ),
            "apply_residual_connection_post_layernorm \\(the residual taken after each norm\\)",
        ),
        (
            lambda c: c.update(architectures=["MptForCausalLM"], attn_config={"clip_qkv": 6.0}),
            "attn_config's clip_qkv is not supported",
        ),
        (
            lambda c: c.update(architectures=["MptForCausalLM"], attn_config={"qk_ln": True}),
            "attn_config's qk_ln is not supported",
        ),
        (
            lambda c: c.update(architectures=["MptForCausalLM"], attn_config={"softmax_scale": 0.5}),
            "attn_config's softmax_scale is not supported",
        ),
        (
            lambda c: c.update(architectures=["MptForCausalLM"], attn_config={"alibi_bias_max": 4}),
            "attn_config's alibi_bias_max other than 8 is not supported",
        ),
        (
            lambda c: c.update(architectures=["MptForCausalLM"], expansion_ratio=8),
            "expansion_ratio other than 4 is not supported",
        ),
        (
            lambda c: c.update(architectures=["MptForCausalLM"], no_bias=False),
            "no_bias false is not supported",
        ),
        (
            lambda c: c.update(
                architectures=["PhimoeForCausalLM"], num_local_experts=4, num_experts_per_tok=3
            ),
            "num_experts_per_tok 3: sparsemixer picks 2",
        ),
        (
            lambda c: c.update(DBRX_REFUSED, ffn_config={"moe_normalize_expert_weights": 2.0}),
            "moe_normalize_expert_weights 2.0 is not supported \\(1 or null\\)",
        ),
        (
            lambda c: c.update(DBRX_REFUSED, ffn_config={"ffn_act_fn": {"name": "gelu"}}),
            "hidden_act 'gelu' is not supported \\(silu is\\)",
        ),
        (
            lambda c: c.update(
                architectures=["FalconForCausalLM"], new_decoder_architecture=True, parallel_attn=False
            ),
            "new_decoder_architecture needs parallel_attn",
        ),
        (
            lambda c: c.update(
                architectures=["GPTNeoForCausalLM"], num_layers=2, attention_types=[[["global", "local"], 2]]
            ),
            "attention_types name 4 layers for its 2",
        ),
        (
            lambda c: c.update(architectures=["GPT2LMHeadModel"], scale_attn_by_inverse_layer_idx=True),
            "scale_attn_by_inverse_layer_idx is not supported for GPT2LMHeadModel",
        ),
        (
            lambda c: c.update(architectures=["OPTForCausalLM"], do_layer_norm_before=False),
            "do_layer_norm_before False is not supported for OPTForCausalLM",
        ),
        (
            lambda c: c.update(architectures=["OPTForCausalLM"], word_embed_proj_dim=32),
            "word_embed_proj_dim 32 is not supported for OPTForCausalLM",
        ),
        # (transformers divides by them)
        (
            lambda c: c.update(architectures=["Ernie4_5_MoeForCausalLM"], moe_layer_interval=0),
            "moe_layer_interval must be a positive integer, got 0",
        ),
        (
            lambda c: c.update(
                architectures=["Exaone4ForCausalLM"], sliding_window=32, sliding_window_pattern=0
            ),
            "sliding_window_pattern must be a positive integer, got 0",
        ),
        # DeepSeek's routing beyond what its code reads, and what its layers cannot be
        (
            lambda c: c.update(DEEPSEEK_V2, topk_method="noaux_tc"),
            "topk_method 'noaux_tc' is not supported for DeepseekV2ForCausalLM",
        ),
        (
            lambda c: c.update(DEEPSEEK_V2, num_experts_per_tok=None),
            "num_experts_per_tok must be an integer, got None",
        ),
        (
            lambda c: c.update(DEEPSEEK_V2, moe_layer_freq=0),
            "moe_layer_freq must be a positive integer, got 0",
        ),
        (
            lambda c: c.update(DEEPSEEK_V2, qk_rope_head_dim=None),
            "qk_rope_head_dim must be a positive integer, got None",
        ),
        (
            lambda c: c.update(
                DEEPSEEK_V2,
                architectures=["DeepseekV3ForCausalLM"],
                n_group=4,
                topk_group=1,
                num_experts_per_tok=4,
            ),
            "topk_group 1 keeps 2 experts, fewer than num_experts_per_tok 4",
        ),
        (
            lambda c: c.update(
                DEEPSEEK_V2, architectures=["Glm4MoeLiteForCausalLM"], mlp_layer_types=["dense", "moe"]
            ),
            "mlp_layer_types: layer 1 is 'moe' \\(dense or sparse\\)",
        ),
        (
            lambda c: c.update(architectures=["PhiForCausalLM"], qk_layernorm=True),
            "qk_layernorm \\(LayerNorms of q and k\\) is not supported",
        ),
        # Nemotron-H's layers: M, *, - and E (Nemotron 3's experts, but in a latent space or biased)
        (
            lambda c: c.update(
                architectures=["NemotronHForCausalLM"], hybrid_override_pattern="*E", moe_latent_size=8
            ),
            "moe_latent_size \\(experts in a latent space\\) is not served",
        ),
        (
            lambda c: c.update(
                architectures=["NemotronHForCausalLM"], hybrid_override_pattern="*E", mlp_bias=True
            ),
            "mlp_bias is not served for Nemotron-H's experts",
        ),
        (
            lambda c: c.update(
                architectures=["NemotronHForCausalLM"],
                hybrid_override_pattern="M*",
                mamba_ssm_cache_dtype="fp32",
            ),
            "mamba_ssm_cache_dtype must be auto, float32, bfloat16 or float16, got 'fp32'",
        ),
        (
            lambda c: c.update(architectures=["NemotronHForCausalLM"], hybrid_override_pattern="M*X"),
            "hybrid_override_pattern must be a string of M, \\*, - and E, got 'M\\*X'",
        ),
        # Kimi Linear's latent attention turns nothing, its router is a sigmoid's
        (
            lambda c: c.update(architectures=["KimiLinearForCausalLM"], mla_use_nope=False),
            "mla_use_nope false \\(a rotary latent attention\\) is not served for Kimi Linear",
        ),
        (
            lambda c: c.update(architectures=["KimiLinearForCausalLM"], moe_router_activation_func="softmax"),
            "moe_router_activation_func must be sigmoid, got 'softmax'",
        ),
    ],
    ids=[
        "partial-rotary",
        "partial-rotary-in-rope",
        "two-ropes",
        "dynamic-ntk",
        "gelu",
        "quantized",
        "mxfp4-beyond-gpt-oss",
        "linear-without-factor",
        "yarn-factor-not-a-number",
        "phi3-longrope-factors",
        "granite-logits-scaling-0",
        "mixtral-more-experts-a-token-than-experts",
        "qwen3-moe-sparse-step-0",
        "granite4-layer-type",
        "granite4-mamba-head-dim",
        "granite4-mamba-groups",
        "olmoe-clip-qkv-not-a-number",
        "ernie4.5-moe-biases",
        "cohere2-negative-logit-scale",
        "minimax-m2-per-head-qk-norm",
        "gemma4-layer-types-not-its-layers",
        "gemma4-kv-shared-layer-without-source",
        "gemma4-kv-entries-of-no-one-size",
        "gemma4-kv-heads-cannot-fill-the-entry",
        "lfm3-layer-type",
        "olmo-hybrid-layer-types-not-its-layers",
        "mellum-layer-type",
        "minimax-pre-norm",
        "minimax-layer-type",
        "zamba2-layer-type",
        "zamba2-silu",
        "zamba2-adapters-on-narrower-heads",
        "zamba2-no-blocks",
        "zamba2-mamba-heads",
        "gemma3n-widths-not-its-layers",
        "gemma3n-sparsity-not-its-layers",
        "gemma3n-sparsity-1",
        "gemma3n-active-stream-past-its-streams",
        "gemma3n-k-eq-v",
        "gemma3n-default-kv-shared-layers",
        "jamba-attention-offset-past-its-period",
        "granite-swa-thetas-not-its-layers",
        "gemma4-every-layer-kv-shared",
        "cohere2-moe-shared-expert-strategy",
        "falcon-alibi",
        "bloom-residual-after-norm",
        "mpt-clip-qkv",
        "mpt-qk-ln",
        "mpt-softmax-scale",
        "mpt-alibi-bias-max",
        "mpt-expansion-ratio",
        "mpt-biases",
        "phimoe-top-3",
        "dbrx-expert-weights-2-norm",
        "dbrx-gelu-experts",
        "falcon-new-architecture-sequential",
        "gpt-neo-attention-types-not-its-layers",
        "gpt2-inverse-layer-scaling",
        "opt-norms-after-layers",
        "opt-embedding-projection",
        "ernie4.5-moe-layer-interval-0",
        "exaone4-sliding-window-pattern-0",
        "deepseek-v2-noaux-tc",
        "deepseek-v2-no-experts-a-token",
        "deepseek-moe-layer-freq-0",
        "deepseek-no-rope-head-dim",
        "deepseek-v3-groups-short-of-top-k",
        "glm4-moe-lite-layer-type",
        "phi-qk-layernorm",
        "nemotron3-latent-experts",
        "nemotron3-biased-experts",
        "nemotron-h-state-dtype",
        "nemotron-h-pattern",
        "kimi-linear-rotary-latent",
        "kimi-linear-softmax-router",
    ],
)
def test_an_unsupported_option_is_refused_naming_it(
    tmp_path: Path, tiny_llama_dir: str, patch: ConfigPatch, message: str
) -> None:
    from pagedserve.settings import config_error

    model_dir = with_config(tmp_path / "model", tiny_llama_dir, patch)
    with pytest.raises(ValueError, match=f"^model: config.json('s)? .*{message}") as info:
        LLM(model=model_dir, dtype="float32", num_kv_blocks=8)
    # `serve` says it of --model, the setting that chose this config.json
    assert str(config_error(info.value, {"model"})).startswith("--model: config.json")


# --- the context the rope reaches, and --hf-overrides ----------------------------------------------------


@pytest.mark.parametrize(
    ("rope", "length"),
    [
        (None, 1024),
        ({"rope_type": "linear", "factor": 4.0}, 4096),
        (LLAMA3_ROPE, 1024),  # llama3's max_position_embeddings is the extended length already
        (YARN_ROPE, 1024),
        ({**YARN_ROPE, "original_max_position_embeddings": 4096}, 16384),  # Qwen's 32K -> 128K, scaled down
        ({"rope_type": "yarn", "factor": 2.0}, 2048),  # pretraining length: max_position_embeddings
    ],
    ids=["default", "linear", "llama3", "yarn", "yarn-past-max-positions", "yarn-no-pretraining-length"],
)
def test_the_context_reaches_as_far_as_vllm_derives_it(
    tmp_path: Path, rope: dict[str, Any] | None, length: int
) -> None:
    from pagedserve.config import ModelConfig

    config_dict = {**LlamaConfig(**TINY, rope_scaling=rope).to_dict(), "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config_dict))
    assert ModelConfig.from_path(str(tmp_path), "float32").max_model_len == length


def in_transformers_5_layout_without_scaling(config: dict[str, Any]) -> None:
    config.pop("rope_scaling")
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}


def test_hf_overrides_turn_on_yarn_as_the_checkpoint_would(
    variant_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """vLLM's way to serve Qwen past its pretraining length: `--hf-overrides '{"rope_scaling": {yarn}}'`.
    The same tokens as a config.json that says so, from a checkpoint in either layout (transformers
    5's rope_parameters, whose rope_theta stays, gives way to the override)."""
    yarn_dir, prompts = variant_dir("qwen3-yarn-rope-4.x-config"), long_prompts()
    expected = greedy(LLM(model=yarn_dir, dtype="float32", num_kv_blocks=128, block_size=16), prompts, 8)
    plain_4 = with_config(tmp_path / "plain-4.x", yarn_dir, lambda c: c.pop("rope_scaling"))
    plain_5 = with_config(tmp_path / "plain-5.x", yarn_dir, in_transformers_5_layout_without_scaling)
    unscaled = LLM(model=plain_4, dtype="float32", num_kv_blocks=128, block_size=16)
    assert greedy(unscaled, prompts, 8) != expected  # the override has something to do
    for plain in (plain_4, plain_5):
        llm = LLM(
            model=plain,
            dtype="float32",
            num_kv_blocks=128,
            block_size=16,
            hf_overrides={"rope_scaling": YARN_ROPE},
        )
        assert llm.engine.config.model.max_model_len == 1024
        assert greedy(llm, prompts, 8) == expected, plain


def test_an_override_replaces_keys_and_the_rope_in_either_layout() -> None:
    from pagedserve.config import apply_hf_overrides

    base = {"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert apply_hf_overrides(base, {}) == base
    assert (
        apply_hf_overrides(base, {"max_position_embeddings": 8192})["rope_parameters"]
        == base["rope_parameters"]
    )
    scaled = apply_hf_overrides(base, {"rope_scaling": YARN_ROPE})
    assert scaled == {"max_position_embeddings": 4096, "rope_scaling": YARN_ROPE, "rope_theta": 1e6}
    old_layout = {"rope_theta": 5e5, "rope_scaling": LLAMA3_ROPE}
    assert apply_hf_overrides(
        old_layout, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    ) == {
        "rope_theta": 5e5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
    }
    assert base == {
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }
