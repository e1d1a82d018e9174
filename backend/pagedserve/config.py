"""Engine configuration: frozen dataclasses, validated once, each component gets only its part.

This module imports no torch, so `pagedserve.core` can depend on it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pagedserve.json_setting import parse_json_object
from pagedserve.lora_config import check_adapter_name
from pagedserve.spec_decode import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ATTENTION_BACKENDS = ("torch", "triton")
SCHEDULING_POLICIES = ("fcfs", "priority")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelConfig:
    """A local Hugging Face model directory and the shape facts the engine needs from its config.json;
    `tokenizer_path`: the directory its tokenizer is read from (--tokenizer, else `path`)."""

    path: str
    tokenizer_path: str
    dtype: str
    max_model_len: int
    served_model_name: str
    architecture: str
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hf_config: dict[str, Any] = field(repr=False, compare=False, hash=False)
    # SamplingParams fields a request leaves unset take these (the model's generation_config.json)
    sampling_defaults: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    # the values are the keys' cache entries (DeepSeek's latent: `kv_cache_entry`): one cache, not two
    values_in_keys: bool = False
    # a state a sequence carries from step to step beside its KV cache (LFM2's convolutions, Mamba2's
    # states: `layers.recurrent`): `num_layers` counts the layers with a KV cache alone (0: none)
    recurrent: bool = False

    @property
    def kv_bytes_per_token(self) -> int:
        """Key and value bytes of one token over all layers and KV heads (all ranks together)."""
        caches = 1 if self.values_in_keys else 2
        return caches * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @classmethod
    def from_path(
        cls,
        path: str,
        dtype: str,
        max_model_len: int | None = None,
        served_model_name: str | None = None,
        generation_config: str = "auto",
        hf_overrides: dict[str, Any] | None = None,
        override_generation_config: dict[str, Any] | None = None,
        tokenizer_path: str | None = None,
    ) -> ModelConfig:
        """`hf_overrides`: config.json keys replaced (vLLM's --hf-overrides), e.g. a YaRN rope_scaling;
        `override_generation_config`: generation_config.json values over the file's (or alone, under
        `generation_config` vllm), vLLM's --override-generation-config; `tokenizer_path`: where the
        tokenizer is, when not in the model directory (generation_config.json is still the model's)."""
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model: {path!r} is not a Hugging Face model directory (no config.json)")
        hf = json.loads(config_file.read_text(), object_hook=special_floats)
        hf = apply_hf_overrides(hf, hf_overrides or {})
        check_quantization(hf)
        hf = text_decoder_config(hf)
        reader = _CONFIG_READERS.get(architecture_of(hf))
        if reader is not None:
            hf = reader(hf)
        num_layers = num_kv_cache_layers(hf)
        if num_layers:
            num_heads = hf["num_attention_heads"]
            num_kv_heads, head_dim = kv_cache_entry(hf)
        else:  # (no attention: its KV blocks hold nothing and only count the tokens for the scheduler)
            num_heads = num_kv_heads = head_dim = 1
        architecture = architecture_of(hf, "LlamaForCausalLM")
        if dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {DTYPES}, got {dtype!r}")
        return cls(
            path=str(path),
            tokenizer_path=str(tokenizer_path or path),
            dtype=dtype,
            max_model_len=_max_model_len(hf, max_model_len),
            served_model_name=served_model_name or Path(path).resolve().name,
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hf_config=hf,
            sampling_defaults=sampling_defaults(path, generation_config, override_generation_config or {}),
            values_in_keys="kv_lora_rank" in hf,
            recurrent=is_recurrent(hf),
        )


def special_floats(obj: dict[str, Any]) -> Any:
    """A config.json object as transformers 5 reads it: the floats JSON cannot hold (Granite 4.0's
    time_step_limit of infinity...) saved as {"__float__": "Infinity"} (or "-Infinity", "NaN") are
    floats again."""
    if obj.keys() == {"__float__"} and obj["__float__"] in ("Infinity", "-Infinity", "NaN"):
        return float(obj["__float__"])
    return obj


def hybrid_layer_types(hf: dict[str, Any]) -> list[str] | None:
    """Each layer's token mixer in a hybrid model (`models.hybrid`): "full_attention", LFM2's "conv",
    "mamba" (Granite 4.0's, Bamba's, Nemotron-H's, Mamba2's), "mamba1" (Mamba's, FalconMamba's, Jamba's), "gated_delta" (Qwen3.5's and Qwen3-Next's Gated DeltaNet),
    "kimi_delta" (Kimi Linear's KDA, as `kimi_linear_config` reads its layers), "lightning" (MiniMax's
    lightning attention), "parallel" (Falcon-H1's
    attention and Mamba2 side by side; Zamba2's hybrid layers, a shared attention block before Mamba2),
    Nemotron-H's "mlp" (a layer of an MLP alone) or "moe"; None for a model of attention layers alone."""
    architecture = architecture_of(hf)
    if architecture in ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM"):
        layer_types = lfm2_layer_types(hf)
    elif architecture == "Lfm3ForCausalLM":  # (its sliding layers attention too, of a window)
        layer_types = [
            "conv" if kind == "conv" else "full_attention" for kind in lfm3_config(hf)["layer_types"]
        ]
    elif architecture == "GraniteMoeHybridForCausalLM":
        layer_types = granite_layer_types(hf)
    elif architecture == "NemotronHForCausalLM":
        layer_types = nemotron_h_layer_types(hf)
    elif architecture == "Mamba2ForCausalLM":
        layer_types = ["mamba"] * hf["num_hidden_layers"]
    elif architecture in ("MambaForCausalLM", "FalconMambaForCausalLM"):
        layer_types = ["mamba1"] * hf["num_hidden_layers"]
    elif architecture == "JambaForCausalLM":
        layer_types = jamba_layer_types(hf)
    elif architecture in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"):
        layer_types = qwen3_5_layer_types(hf)
    elif architecture == "FalconH1ForCausalLM":  # (attention and Mamba2 side by side in every layer)
        layer_types = ["parallel"] * hf["num_hidden_layers"]
    elif architecture == "KimiLinearForCausalLM":
        names = {"full_attention": "full_attention", "linear_attention": "kimi_delta"}
        layer_types = [names[kind] for kind in kimi_linear_config(hf)["layer_types"]]
    elif architecture == "OlmoHybridForCausalLM":
        names = {"full_attention": "full_attention", "linear_attention": "gated_delta"}
        layer_types = [names[kind] for kind in olmo_hybrid_config(hf)["layer_types"]]
    elif architecture == "MiniMaxForCausalLM":
        names = {"full_attention": "full_attention", "linear_attention": "lightning"}
        layer_types = [names[kind] for kind in minimax_config(hf)["layer_types"]]
    elif architecture == "Zamba2ForCausalLM":  # (a hybrid layer: a shared attention block, then Mamba2)
        kinds = zamba2_config(hf)["layers_block_type"]
        layer_types = ["parallel" if kind == "hybrid" else "mamba" for kind in kinds]
    elif architecture == "BambaForCausalLM":
        attention = hf.get("attn_layer_indices") or ()
        layer_types = [
            "full_attention" if i in attention else "mamba" for i in range(hf["num_hidden_layers"])
        ]
    else:
        layer_types = None
    return layer_types


def jamba_layer_types(hf: dict[str, Any]) -> list[str]:
    """Jamba's layers: attention every `attn_layer_period`-th (8) from `attn_layer_offset` (4), Mamba's
    state space ("mamba1") the others (JambaConfig's `layers_block_type`)."""
    period, offset = int(hf.get("attn_layer_period", 8)), int(hf.get("attn_layer_offset", 4))
    if not 0 <= offset < period:
        raise ValueError(
            f"model: config.json's attn_layer_offset {offset} must be 0 to attn_layer_period {period} - 1"
        )
    return ["full_attention" if i % period == offset else "mamba1" for i in range(hf["num_hidden_layers"])]


def is_recurrent(hf: dict[str, Any]) -> bool:
    """Whether some layer carries a state per request in place of a KV cache (`ModelConfig.recurrent`):
    any of `hybrid_layer_types` but attention's and Nemotron-H's MLP layers."""
    return bool(set(hybrid_layer_types(hf) or ()) - {"full_attention", "mlp", "moe"})


def num_kv_cache_layers(hf: dict[str, Any]) -> int:
    """The layers that keep a KV cache: every one, but a hybrid's attention layers alone and Gemma 4's
    and Gemma 3n's layers before their KV-shared ones (`num_kv_shared_layers`, which read earlier
    layers' caches; Gemma3nTextConfig's default 15)."""
    if architecture_of(hf) in ("Gemma4ForCausalLM", "Gemma3nForCausalLM"):
        shared = int(
            hf.get("num_kv_shared_layers", 15 if architecture_of(hf) == "Gemma3nForCausalLM" else 0) or 0
        )
        if not 0 <= shared < hf["num_hidden_layers"]:
            raise ValueError(
                f"model: config.json's num_kv_shared_layers must be 0 to {hf['num_hidden_layers'] - 1}, got {shared}"
            )
        return int(hf["num_hidden_layers"]) - shared
    layer_types = hybrid_layer_types(hf)
    if layer_types is None:
        return int(hf["num_hidden_layers"])
    return layer_types.count("full_attention") + layer_types.count("parallel")


NEMOTRON_H_PATTERN = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}


def nemotron_h_layer_types(hf: dict[str, Any]) -> list[str]:
    """Nemotron-H's layers, each one block, "mamba", "full_attention", "mlp" or "moe": config.json's
    `layers_block_type` (or `layer_types`; "mamba" also "linear_attention", "full_attention" also
    "attention"), else its `hybrid_override_pattern`, a character a layer (M, *, - and E), as
    NemotronHConfig reads them."""
    names = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full_attention"}
    names |= {kind: kind for kind in ("full_attention", "mlp", "moe")}
    layer_types = hf.get("layers_block_type") or hf.get("layer_types")
    if layer_types is None:
        pattern = hf.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not set(pattern) <= set(NEMOTRON_H_PATTERN):
            raise ValueError(
                "model: config.json's hybrid_override_pattern must be a string of M, *, - and E, "
                f"got {pattern!r}"
            )
        layer_types = [NEMOTRON_H_PATTERN[char] for char in pattern]
    if not set(layer_types) <= set(names):
        raise ValueError(
            f"model: config.json's layers_block_type must name each layer mamba, attention, mlp or moe, "
            f"got {layer_types!r}"
        )
    return [names[kind] for kind in layer_types]


def granite_layer_types(hf: dict[str, Any]) -> list[str]:
    """Granite 4.0's layers, "full_attention" or "mamba": config.json's `layer_types` (or
    `layers_block_type`), "attention" / "full_attention" or "mamba" / "linear_attention" (every layer
    Mamba2 where it names none, as GraniteMoeHybridConfig reads it)."""
    num_layers = hf["num_hidden_layers"]
    names = {"attention": "full_attention", "full_attention": "full_attention"}
    names |= {"mamba": "mamba", "linear_attention": "mamba"}
    layer_types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * num_layers
    if len(layer_types) != num_layers or not set(layer_types) <= set(names):
        raise ValueError(
            f"model: config.json's layer_types must name {num_layers} layers, each attention or mamba, "
            f"got {layer_types!r}"
        )
    return [names[kind] for kind in layer_types]


def qwen3_5_layer_types(hf: dict[str, Any]) -> list[str]:
    """Qwen3.5's layers, "full_attention" or "gated_delta" (its linear attention, Gated DeltaNet):
    config.json's `layer_types` ("linear_attention" for the latter), else every
    `full_attention_interval`-th layer (4) full attention, the others linear, as Qwen3_5TextConfig
    reads them."""
    num_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:
        interval = hf.get("full_attention_interval", 4)
        if not (isinstance(interval, int) and interval > 0):
            raise ValueError(
                f"model: config.json's full_attention_interval must be positive, got {interval!r}"
            )
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
        ]
    names = {"full_attention": "full_attention", "linear_attention": "gated_delta"}
    if len(layer_types) != num_layers or not set(layer_types) <= set(names):
        raise ValueError(
            f"model: config.json's layer_types must name {num_layers} layers, each full_attention or "
            f"linear_attention, got {layer_types!r}"
        )
    return [names[kind] for kind in layer_types]


def kimi_linear_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Kimi Linear's config.json under the names the models read, as KimiLinearConfig reads it (its
    attribute_map): the experts' `num_experts`, `num_experts_per_token`, `moe_renormalize`,
    `num_expert_group`, `num_shared_experts` as DeepSeek-V3's `n_routed_experts`...; `model_max_length`
    as `max_position_embeddings`; `layer_types` ("full_attention" or "linear_attention") from
    config.json's, else the Hub's `linear_attn_config` (`full_attn_layers` and `kda_layers`, counted
    from 1), else every 4th layer from layer 4 on full attention; `mlp_layer_types` ("dense" or
    "sparse") from config.json's, else the first `first_k_dense_replace` (1) dense; the linear
    attention's heads and convolution from `linear_attn_config` too. Its latent attention turns
    nothing (`mla_use_nope`, which transformers' model assumes): a config that turns it is refused."""
    if hf.get("mla_use_nope", True) is not True:
        raise ValueError(
            "model: config.json's mla_use_nope false (a rotary latent attention) is not served for Kimi Linear"
        )
    if hf.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ValueError(
            f"model: config.json's moe_router_activation_func must be sigmoid, got {hf['moe_router_activation_func']!r}"
        )
    num_layers, linear = hf["num_hidden_layers"], hf.get("linear_attn_config") or {}
    layer_types = hf.get("layer_types")
    if layer_types is None and "full_attn_layers" in linear and "kda_layers" in linear:
        full = {int(n) - 1 for n in linear["full_attn_layers"]}
        layer_types = ["full_attention" if i in full else "linear_attention" for i in range(num_layers)]
    elif layer_types is None:
        layer_types = [
            "full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)
        ]
    if len(layer_types) != num_layers or not set(layer_types) <= {"full_attention", "linear_attention"}:
        raise ValueError(
            f"model: config.json's layer_types must name {num_layers} layers, each full_attention or "
            f"linear_attention, got {layer_types!r}"
        )
    first_dense = hf.get("first_k_dense_replace", 1)
    mlp_layer_types = hf.get("mlp_layer_types") or [
        "dense" if i < first_dense else "sparse" for i in range(num_layers)
    ]
    renamed = {
        "n_routed_experts": "num_experts",
        "num_experts_per_tok": "num_experts_per_token",
        "norm_topk_prob": "moe_renormalize",
        "n_group": "num_expert_group",
        "n_shared_experts": "num_shared_experts",
        "max_position_embeddings": "model_max_length",
    }
    return {
        **hf,
        **{ours: hf[theirs] for ours, theirs in renamed.items() if theirs in hf},
        "layer_types": layer_types,
        "mlp_layer_types": mlp_layer_types,
        "linear_head_dim": linear.get("head_dim", hf.get("linear_head_dim", 128)),
        "linear_num_heads": linear.get("num_heads", hf.get("linear_num_heads", 32)),
        "linear_conv_kernel_dim": linear.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4)),
    }


# the architectures whose config.json names its sizes as GPT-2's does (n_embd...; OPT's by Llama's
# names but for ffn_dim)
GPT2_NAMED = (
    "GPT2LMHeadModel",
    "GPTBigCodeForCausalLM",
    "OPTForCausalLM",
    "GPTJForCausalLM",
    "GPTNeoForCausalLM",
)


_GPT2_NAMED_VOCAB = {"OPTForCausalLM": 50272, "GPTJForCausalLM": 50400}


def gpt2_config(hf: dict[str, Any]) -> dict[str, Any]:
    """GPT-2's, GPTBigCode's, GPT-J's, GPT-Neo's and OPT's config.json under Llama's names
    (transformers' attribute_map), with each config class's defaults for the keys it leaves out: GPT-2's,
    GPTBigCode's and GPT-J's n_embd, n_layer, n_head, n_inner (4 n_embd), n_positions,
    layer_norm_epsilon and activation_function; GPTBigCode's one KV head where `multi_query` (its
    default); GPT-Neo's num_layers, num_heads, its local layers (`attention_types`) as sliding ones of
    `window_size`; OPT's ffn_dim and activation_function. Each ties its LM head by default but GPT-J."""
    if architecture_of(hf) == "GPTNeoForCausalLM":
        hidden = hf.get("hidden_size", 2048)
        kinds = [
            kind
            for kinds, repeat in hf.get("attention_types") or [[["global", "local"], 12]]
            for kind in kinds * repeat
        ]
        if len(kinds) != hf.get("num_layers", 24):
            raise ValueError(
                f"model: config.json's attention_types name {len(kinds)} layers for its {hf.get('num_layers', 24)}"
            )
        named = {
            "hidden_size": hidden,
            "num_hidden_layers": hf.get("num_layers", 24),
            "num_attention_heads": hf.get("num_heads", 16),
            "intermediate_size": hf.get("intermediate_size") or 4 * hidden,
            "max_position_embeddings": hf.get("max_position_embeddings", 2048),
            "layer_norm_eps": hf.get("layer_norm_epsilon", 1e-5),
            "hidden_act": hf.get("activation_function", "gelu_new"),
            "layer_types": ["sliding_attention" if kind == "local" else "full_attention" for kind in kinds],
            "sliding_window": hf.get("window_size", 256),
        }
    elif architecture_of(hf) == "OPTForCausalLM":
        hidden = hf.get("hidden_size", 768)
        named = {
            "hidden_size": hidden,
            "num_hidden_layers": hf.get("num_hidden_layers", 12),
            "num_attention_heads": hf.get("num_attention_heads", 12),
            "intermediate_size": hf.get("ffn_dim", 3072),
            "max_position_embeddings": hf.get("max_position_embeddings", 2048),
            "hidden_act": hf.get("activation_function", "relu"),
        }
    else:
        hidden, heads = hf.get("n_embd", 768), hf.get("n_head", 12)
        gptj = architecture_of(hf) == "GPTJForCausalLM"
        bigcode = architecture_of(hf) == "GPTBigCodeForCausalLM"
        named = {
            "hidden_size": hidden,
            "num_hidden_layers": hf.get("n_layer", 12),
            "num_attention_heads": heads,
            "num_key_value_heads": 1 if bigcode and hf.get("multi_query", True) else heads,
            "intermediate_size": hf.get("n_inner") or 4 * hidden,
            "max_position_embeddings": hf.get("n_positions", 2048 if gptj else 1024),
            "layer_norm_eps": hf.get("layer_norm_epsilon", 1e-5),
            "hidden_act": hf.get("activation_function", "gelu_pytorch_tanh" if bigcode else "gelu_new"),
        }
    named["num_key_value_heads"] = named.get("num_key_value_heads", named["num_attention_heads"])
    return {
        **hf,
        **named,
        "vocab_size": hf.get("vocab_size", _GPT2_NAMED_VOCAB.get(architecture_of(hf), 50257)),
        # (GPT-J's untied by default, the others' tied)
        "tie_word_embeddings": hf.get("tie_word_embeddings", architecture_of(hf) != "GPTJForCausalLM"),
    }


def alibi_config(hf: dict[str, Any]) -> dict[str, Any]:
    """BLOOM's and MPT's config.json under Llama's names, with BloomConfig's and MptConfig's defaults
    for the keys it leaves out: BLOOM's n_layer, n_head, hidden_size (or n_embed), its context
    `seq_length` (2,048 where it names none: ALiBi has no positions to run past, vLLM's default);
    MPT's d_model, n_heads, n_layers and max_seq_len; both MLPs 4 x hidden wide, both LM heads tied."""
    if architecture_of(hf) == "MptForCausalLM":
        hidden, named = (
            hf.get("d_model", 2048),
            {
                "num_hidden_layers": hf.get("n_layers", 24),
                "num_attention_heads": hf.get("n_heads", 16),
                "max_position_embeddings": hf.get("max_seq_len", 2048),
                "vocab_size": hf.get("vocab_size", 50368),
            },
        )
    else:
        hidden, named = (
            hf.get("hidden_size") or hf.get("n_embed", 64),
            {
                "num_hidden_layers": hf.get("n_layer", 2),
                "num_attention_heads": hf.get("n_head", 8),
                "max_position_embeddings": hf.get("seq_length", 2048),
                "vocab_size": hf.get("vocab_size", 250880),
            },
        )
    return {
        **hf,
        **named,
        "hidden_size": hidden,
        "num_key_value_heads": named["num_attention_heads"],
        "intermediate_size": 4 * hidden,
        "rms_norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        "tie_word_embeddings": hf.get("tie_word_embeddings", True),
    }


def dbrx_config(hf: dict[str, Any]) -> dict[str, Any]:
    """DBRX's config.json under Llama's names, DbrxConfig's defaults where it leaves a key out: d_model,
    n_heads, n_layers, max_seq_len; `attn_config`'s kv_n_heads (1), clip_qkv and rope_theta (where
    config.json names no rope_parameters: DBRX's own releases keep theta there); `ffn_config`'s
    ffn_hidden_size, moe_num_experts (4), moe_top_k (1), moe_normalize_expert_weights (1) and
    ffn_act_fn (SiLU's)."""
    attn, ffn = hf.get("attn_config") or {}, hf.get("ffn_config") or {}
    named = {
        "hidden_size": hf.get("d_model", 2048),
        "num_hidden_layers": hf.get("n_layers", 24),
        "num_attention_heads": hf.get("n_heads", 16),
        "num_key_value_heads": attn.get("kv_n_heads", 1),
        "max_position_embeddings": hf.get("max_seq_len", 2048),
        "vocab_size": hf.get("vocab_size", 32000),
        "clip_qkv": attn.get("clip_qkv"),
        "intermediate_size": ffn.get("ffn_hidden_size", 3584),
        "num_local_experts": ffn.get("moe_num_experts", 4),
        "num_experts_per_tok": ffn.get("moe_top_k", 1),
        "moe_normalize_expert_weights": ffn.get("moe_normalize_expert_weights", 1.0),
        "hidden_act": (ffn.get("ffn_act_fn") or {"name": "silu"}).get("name", "silu"),
        "rms_norm_eps": 1e-5,  # (nn.LayerNorm's default)
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
    }
    if not hf.get("rope_parameters") and "rope_theta" in attn:
        named["rope_theta"] = attn["rope_theta"]
    return {**hf, **named}


def falcon_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Falcon's config.json as FalconConfig reads it: its KV heads (`num_kv_heads`, every head's by
    default) under the new decoder architecture or without `multi_query`, else one; its MLP
    `ffn_hidden_size` wide (4 x hidden by default)."""
    heads = hf["num_attention_heads"]
    grouped = hf.get("new_decoder_architecture", False) or not hf.get("multi_query", True)
    return {
        **hf,
        "num_key_value_heads": (hf.get("num_kv_heads") or heads) if grouped else 1,
        "intermediate_size": hf.get("ffn_hidden_size") or 4 * hf["hidden_size"],
        "head_dim": hf["hidden_size"] // heads,
    }


def gemma4_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's config.json as Gemma4TextConfig reads it: `layer_types` by default five sliding layers
    to a full one, the last layer full whatever config.json says (transformers forces it)."""
    num_layers = hf["num_hidden_layers"]
    layer_types = list(
        hf.get("layer_types")
        or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)]
    )
    if len(layer_types) != num_layers:
        raise ValueError(
            f"model: config.json's layer_types has {len(layer_types)} entries for {num_layers} layers"
        )
    layer_types[-1] = "full_attention"
    return {**hf, "layer_types": layer_types}


def lfm3_config(hf: dict[str, Any]) -> dict[str, Any]:
    """LFM3's config.json as Lfm3Config reads it: `layer_types` ("conv", "sliding_attention",
    "full_attention") by default attention at every fourth layer from the third, sliding attention
    at every fourth from the fifth, convolutions elsewhere; `rope_parameters` by layer type, by default
    the full layers' proportional (theta 1e6, half the head's pairs turning) and the sliding layers'
    default (theta 1e4); convolutions of 7 taps."""
    num_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or [
        "full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
        for i in range(num_layers)
    ]
    if len(layer_types) != num_layers or not set(layer_types) <= {
        "conv",
        "sliding_attention",
        "full_attention",
    }:
        raise ValueError(
            f"model: config.json's layer_types must name {num_layers} layers, each conv, sliding_attention "
            f"or full_attention, got {layer_types!r}"
        )
    rope = hf.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {
            "rope_type": "proportional",
            "rope_theta": 1_000_000.0,
            "partial_rotary_factor": 0.5,
        },
    }
    return {
        **hf,
        "layer_types": list(layer_types),
        "rope_parameters": rope,
        "conv_L_cache": hf.get("conv_L_cache", 7),
    }


def mellum_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Mellum's config.json as MellumConfig reads it: `layer_types` every layer full attention by
    default; `rope_parameters` by layer type, by default theta 5e5 for the full layers and 1e4 for the
    sliding ones."""
    num_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or ["full_attention"] * num_layers
    if len(layer_types) != num_layers or not set(layer_types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"model: config.json's layer_types must name {num_layers} layers, each full_attention or "
            f"sliding_attention, got {layer_types!r}"
        )
    rope = hf.get("rope_parameters") or {
        "full_attention": {"rope_type": "default", "rope_theta": 500_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    return {**hf, "layer_types": list(layer_types), "rope_parameters": rope}


def olmo_hybrid_config(hf: dict[str, Any]) -> dict[str, Any]:
    """OLMo Hybrid's config.json as OlmoHybridConfig reads it: `layer_types` by default Gated DeltaNet
    ("linear_attention") but every fourth layer, full attention (the last where that leaves none);
    the rope theta 10,000 unless named (a `rope_parameters` whose rope_theta is null: NoPE)."""
    num_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:
        layer_types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
        if "full_attention" not in layer_types:
            layer_types[-1] = "full_attention"
    if len(layer_types) != num_layers or not set(layer_types) <= {"full_attention", "linear_attention"}:
        raise ValueError(
            f"model: config.json's layer_types must name {num_layers} layers, each full_attention or "
            f"linear_attention, got {layer_types!r}"
        )
    rope = dict(hf.get("rope_parameters") or {"rope_type": "default"})
    rope.setdefault("rope_theta", hf.get("rope_theta", 10_000.0))  # (a theta named null stays: NoPE)
    return {**hf, "layer_types": list(layer_types), "rope_parameters": rope}


# MiniMax's own config.json names (MiniMax-Text-01's, MiniMax-M1's) -> MiniMaxConfig's
_MINIMAX_NAMES = {
    "layernorm_full_attention_alpha": "full_attn_alpha_factor",
    "layernorm_full_attention_beta": "full_attn_beta_factor",
    "layernorm_linear_attention_alpha": "linear_attn_alpha_factor",
    "layernorm_linear_attention_beta": "linear_attn_beta_factor",
    "layernorm_mlp_alpha": "mlp_alpha_factor",
    "layernorm_mlp_beta": "mlp_beta_factor",
}


def minimax_config(hf: dict[str, Any]) -> dict[str, Any]:
    """MiniMax's config.json as MiniMaxConfig reads it, or as MiniMax's own release names it
    (`attn_type_list`: 1 a softmax attention layer, 0 a lightning one; `layernorm_*_alpha` and
    `_beta` for the residual factors): `layer_types` by default full attention in every other layer
    from the first. A `postnorm` of false (the residual before the norm) is refused: transformers'
    layer always adds the normed input."""
    num_layers = hf["num_hidden_layers"]
    if hf.get("postnorm") is False:
        raise ValueError("model: config.json's postnorm false is not supported for MiniMax (postnorm is)")
    layer_types = hf.get("layer_types")
    if layer_types is None and hf.get("attn_type_list") is not None:
        layer_types = ["full_attention" if kind == 1 else "linear_attention" for kind in hf["attn_type_list"]]
    if layer_types is None:
        layer_types = ["full_attention" if i % 2 == 0 else "linear_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or not set(layer_types) <= {"full_attention", "linear_attention"}:
        raise ValueError(
            f"model: config.json's layer_types must name {num_layers} layers, each full_attention or "
            f"linear_attention, got {layer_types!r}"
        )
    factors = {ours: hf[theirs] for theirs, ours in _MINIMAX_NAMES.items() if theirs in hf}
    return {**factors, **hf, "layer_types": list(layer_types)}


# Zamba2Config's layers where config.json names none (Zamba2-2.7B's 54)
_ZAMBA2_LAYERS = (
    ["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"] + ["mamba"] * 3 + ["hybrid"]
) + ["mamba"] * 2


def zamba2_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Zamba2's config.json as Zamba2Config reads it: `layers_block_type`, each "mamba" (or
    "linear_attention": Mamba2) or "hybrid" (a shared attention block, then Mamba2), by default
    Zamba2-2.7B's 54 layers; attention heads of `attention_head_dim` (or `head_dim`), by default
    2 x hidden_size / heads (their input is the layer's beside the embeddings, 2 x hidden_size wide), as
    many KV heads as query heads unless named; the MLP 4 x hidden_size wide unless named; 4,096
    positions, 16,384 where `use_long_context`."""
    num_layers, hidden, heads = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    names = {"mamba": "mamba", "linear_attention": "mamba", "hybrid": "hybrid"}
    kinds = hf.get("layers_block_type") or _ZAMBA2_LAYERS
    if len(kinds) != num_layers or not set(kinds) <= set(names):
        raise ValueError(
            f"model: config.json's layers_block_type must name {num_layers} layers, each mamba or hybrid, "
            f"got {kinds!r}"
        )
    return {
        **hf,
        "layers_block_type": [names[kind] for kind in kinds],
        "head_dim": hf.get("attention_head_dim") or hf.get("head_dim") or 2 * hidden // heads,
        "num_key_value_heads": hf.get("num_key_value_heads") or heads,
        "intermediate_size": hf.get("intermediate_size") or 4 * hidden,
        "max_position_embeddings": 16_384
        if hf.get("use_long_context")
        else hf.get("max_position_embeddings", 4096),
    }


def gemma3n_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3n's config.json as Gemma3nTextConfig reads it: `layer_types` by default four sliding
    layers to a full one; `intermediate_size` one for all layers or one a layer (a list of them here);
    `activation_sparsity_pattern` one a layer, by default 0.95 in the first 10 where there are more than
    10 (0 elsewhere)."""
    num_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(num_layers)
    ]
    widths = hf.get("intermediate_size", 16_384)
    widths = list(widths) if isinstance(widths, list | tuple) else [widths] * num_layers
    sparse = 10 if num_layers > 10 else 0
    sparsity = hf.get("activation_sparsity_pattern")
    sparsity = [0.95] * sparse + [0.0] * (num_layers - sparse) if sparsity is None else sparsity
    sparsity = list(sparsity) if isinstance(sparsity, list | tuple) else [sparsity] * num_layers
    for key, values in (("layer_types", layer_types), ("intermediate_size", widths)):
        if len(values) != num_layers:
            raise ValueError(f"model: config.json's {key} has {len(values)} entries for {num_layers} layers")
    if len(sparsity) != num_layers:
        raise ValueError(
            f"model: config.json's activation_sparsity_pattern has {len(sparsity)} entries for {num_layers} layers"
        )
    return {
        **hf,
        "layer_types": list(layer_types),
        "intermediate_size": widths,
        "activation_sparsity_pattern": sparsity,
    }


def gemma4_layer_shapes(hf: dict[str, Any]) -> list[tuple[int, int]]:
    """Each Gemma 4 layer's (KV heads, head size) as Gemma4TextConfig resolves them: the sliding
    layers' `num_key_value_heads` (4) of `head_dim` (256); the full ones' `global_head_dim` (512), with
    `num_global_key_value_heads` KV heads where `attention_k_eq_v`; or as transformers saves them,
    `per_layer_config` by layer index."""
    heads, head_dim = int(hf.get("num_key_value_heads") or 4), int(hf.get("head_dim") or 256)
    overrides = hf.get("per_layer_config")
    if overrides is None:
        full: dict[str, Any] = {"head_dim": hf.get("global_head_dim", 512)}
        if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = hf["num_global_key_value_heads"]
        overrides = {str(i): full for i, kind in enumerate(hf["layer_types"]) if kind == "full_attention"}
    layers = [overrides.get(str(i)) or overrides.get(i) or {} for i in range(hf["num_hidden_layers"])]
    return [
        (int(layer.get("num_key_value_heads") or heads), int(layer.get("head_dim") or head_dim))
        for layer in layers
    ]


def _nemotron_h_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H's layer count: its layer types' (a layer a block)."""
    return {**hf, "num_hidden_layers": len(nemotron_h_layer_types(hf))}


# the architectures whose config.json the model and the engine read through a reader of their own
# (their names, defaults or layer counts under Llama's), after `text_decoder_config`
_CONFIG_READERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "KimiLinearForCausalLM": kimi_linear_config,
    **dict.fromkeys(GPT2_NAMED, gpt2_config),
    "Gemma4ForCausalLM": gemma4_config,
    "Gemma3nForCausalLM": gemma3n_config,
    "Zamba2ForCausalLM": zamba2_config,
    "MiniMaxForCausalLM": minimax_config,
    "Lfm3ForCausalLM": lfm3_config,
    "OlmoHybridForCausalLM": olmo_hybrid_config,
    "MellumForCausalLM": mellum_config,
    "FalconForCausalLM": falcon_config,
    "BloomForCausalLM": alibi_config,
    "DbrxForCausalLM": dbrx_config,
    "MptForCausalLM": alibi_config,
    "NemotronHForCausalLM": _nemotron_h_config,
}


def lfm2_layer_types(hf: dict[str, Any]) -> list[str]:
    """Each of LFM2's layers, "full_attention" or "conv": config.json's `layer_types`, else attention
    at `full_attn_idxs` (every layer where it names neither), as Lfm2Config reads them."""
    num_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:
        attention = hf.get("full_attn_idxs")
        attention = range(num_layers) if attention is None else attention
        layer_types = ["full_attention" if i in attention else "conv" for i in range(num_layers)]
    if len(layer_types) != num_layers or not set(layer_types) <= {"full_attention", "conv"}:
        raise ValueError(
            f"model: config.json's layer_types must name {num_layers} layers, each full_attention or conv, "
            f"got {layer_types!r}"
        )
    return list(layer_types)


def kv_cache_entry(hf: dict[str, Any]) -> tuple[int, int]:
    """(KV heads, head size) of what a token leaves in each layer's KV cache: config.json's KV heads of
    `head_dim` (else hidden_size / heads); under DeepSeek's multi-head latent attention (`kv_lora_rank`
    in config.json) one head of its compressed latent and rotated key part (kv_lora_rank +
    qk_rope_head_dim), which every query head reads, as its key and as its value (`values_in_keys`).
    Gemma 4's layers differ (`gemma4_layer_shapes`): every layer's entry is the largest one, heads of
    the smallest head size; a layer of smaller entries holds each of its KV heads more than once."""
    num_heads = hf["num_attention_heads"]
    if architecture_of(hf) == "Gemma4ForCausalLM":
        shapes = gemma4_layer_shapes(hf)[: num_kv_cache_layers(hf)]
        entry, head_dim = max(heads * dim for heads, dim in shapes), min(dim for _, dim in shapes)
        if any(entry % dim for _, dim in shapes):
            raise ValueError(
                f"model: config.json's head sizes and KV heads give Gemma 4's layers KV entries "
                f"{sorted(set(shapes))} (heads, head size) of no one size"
            )
        return entry // head_dim, head_dim
    if "kv_lora_rank" in hf:
        dims = mla_dims(hf, ("kv_lora_rank", "qk_rope_head_dim"))
        return 1, dims["kv_lora_rank"] + dims["qk_rope_head_dim"]
    head_dim = default_head_dim(hf).get("head_dim") or hf["hidden_size"] // num_heads
    return hf.get("num_key_value_heads") or num_heads, head_dim


# where config.json names no head_dim, the config class's (else hidden_size / heads)
_DEFAULT_HEAD_DIM = {"InternLM3ForCausalLM": 128, "NemotronHForCausalLM": 128}


def default_head_dim(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json with its config class's head_dim where it names none and the class has one."""
    default = _DEFAULT_HEAD_DIM.get(architecture_of(hf))
    return hf if hf.get("head_dim") or default is None else {**hf, "head_dim": default}


MLA_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_dims(hf: dict[str, Any], keys: tuple[str, ...] = MLA_DIMS) -> dict[str, int]:
    """Multi-head latent attention's sizes (`models.deepseek`), each a positive integer."""
    for key in keys:
        if not (isinstance(hf.get(key), int) and hf[key] > 0):
            raise ValueError(f"model: config.json's {key} must be a positive integer, got {hf.get(key)!r}")
    return {key: int(hf[key]) for key in keys}


def parse_hf_overrides(value: str | dict[str, Any] | None) -> dict[str, Any]:
    return parse_json_object(value, "hf_overrides", "config.json keys")


def parse_generation_overrides(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """`--override-generation-config`: generation_config.json keys over the model's."""
    overrides = parse_json_object(value, "override_generation_config", "generation_config.json keys")
    for key in overrides:
        if key not in _GENERATION_DEFAULTS:
            raise ValueError(
                f"override_generation_config: {key!r} is not one of {', '.join(_GENERATION_DEFAULTS)}"
            )
    for key, value in overrides.items():
        if value is not None:
            _check_sampling_defaults({_GENERATION_DEFAULTS[key]: value}, f"override_generation_config: {key}")
    return overrides


def _check_sampling_defaults(defaults: dict[str, Any], field: str) -> None:
    """ValueError naming `field` where SamplingParams refuses these defaults."""
    from pagedserve.errors import InvalidRequestError
    from pagedserve.sampling_params import SamplingParams

    try:
        SamplingParams(**defaults)
    except InvalidRequestError as exc:
        raise ValueError(f"{field}: {exc.message}") from None


_ROPE_KEYS = ("rope_scaling", "rope_parameters")


def apply_hf_overrides(hf: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json with `overrides`' keys replaced. The rope is one setting held under either of two
    keys (transformers 4's rope_scaling, 5's rope_parameters): overriding one drops the other, so the
    checkpoint's own cannot contradict the override (its rope_theta stays, top level)."""
    merged = {**hf, **overrides}
    if any(key in overrides for key in _ROPE_KEYS):
        theta = (hf.get("rope_parameters") or {}).get("rope_theta")
        for key in _ROPE_KEYS:
            if key not in overrides:
                merged.pop(key, None)
        if theta is not None:
            merged.setdefault("rope_theta", theta)
    return merged


GENERATION_CONFIG_MODES = ("auto", "vllm")
# generation_config.json key -> SamplingParams field: the ones vLLM takes as defaults
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(model_path: str, mode: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the model's generation_config.json recommends for the sampling parameters a request leaves
    unset, as vLLM's `--generation-config auto` reads it (`do_sample` is not read, as vLLM does not);
    `vllm`: nothing, SamplingParams' own defaults. `overrides` (--override-generation-config, the file's
    keys) go over either. A value SamplingParams would refuse fails here, naming where it came from,
    rather than failing every request that leaves it unset."""
    from pagedserve.errors import InvalidRequestError
    from pagedserve.sampling_params import SamplingParams

    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"generation_config: must be auto or vllm, got {mode!r}")
    overrides = parse_generation_overrides(overrides)
    config_file = Path(model_path) / "generation_config.json"
    generation: dict[str, Any] = {}
    if mode == "auto" and config_file.is_file():
        generation = json.loads(config_file.read_text())
    defaults = {  # the file's, but those overridden (a bad value the override replaces is no error)
        ours: generation[theirs]
        for theirs, ours in _GENERATION_DEFAULTS.items()
        if generation.get(theirs) is not None and theirs not in overrides
    }
    try:
        SamplingParams(**defaults)
    except InvalidRequestError as exc:
        raise ValueError(
            f"model: generation_config.json's {exc.field}: {exc.message} (--generation-config vllm ignores the file)"
        ) from None
    defaults.update(
        {_GENERATION_DEFAULTS[key]: value for key, value in overrides.items() if value is not None}
    )
    return defaults


def architecture_of(hf: dict[str, Any], default: str = "") -> str:
    """config.json's architecture: the first of its `architectures`, `default` where it names none."""
    return str((hf.get("architectures") or [default])[0])


def text_decoder_config(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json as the model served reads it: a multimodal checkpoint's as its text decoder's
    (images are not served): its `text_config` with the text config class's defaults for what it
    leaves out (the Hub's Gemma 3 configs leave out the 4B's heads, for one), as transformers fills
    them in. Gemma 3 4B, 12B, 27B (`Gemma3ForConditionalGeneration`) as a `Gemma3ForCausalLM`;
    Mistral Small 3.1 and 3.2, Magistral Small, Devstral Small (`Mistral3ForConditionalGeneration`
    with a Mistral text config) as a `MistralForCausalLM`, Ministral 3 (the same with a `ministral3`
    one) as a `Ministral3ForCausalLM`; Qwen2-VL and Qwen2.5-VL as a `Qwen2ForCausalLM`, Qwen3-VL (dense) as
    a `Qwen3ForCausalLM`, Qwen3-VL-MoE as a `Qwen3MoeForCausalLM`, their M-RoPE as one rope; LFM2-VL as
    an `Lfm2ForCausalLM`; Llama 4 (`Llama4ForConditionalGeneration`) as a `Llama4ForCausalLM`; Fuyu
    (`FuyuForCausalLM`) as a `PersimmonForCausalLM`; Gemma 4 and Gemma 3n (`Gemma4ForConditionalGeneration`,
    `Gemma3nForConditionalGeneration`) as a `Gemma4ForCausalLM` and a `Gemma3nForCausalLM`. An
    architecture its release names otherwise than transformers (MiniCPM5-MoE's `MiniCPM5MoEForCausalLM`)
    under transformers' name. Any other config as it is."""
    architecture = architecture_of(hf)
    if architecture in _ARCHITECTURE_ALIASES:  # (as transformers' config class renames it)
        return {**hf, "architectures": [_ARCHITECTURE_ALIASES[architecture]]}
    if architecture == "Gemma3ForConditionalGeneration":
        from transformers import Gemma3TextConfig

        text = Gemma3TextConfig(**(hf.get("text_config") or {})).to_dict()
        text["architectures"] = ["Gemma3ForCausalLM"]
    elif architecture in ("Gemma4ForConditionalGeneration", "Gemma3nForConditionalGeneration"):
        import transformers

        config_class, served = _GEMMA_TEXT_CONFIGS[architecture]
        text = getattr(transformers, config_class)(**(hf.get("text_config") or {})).to_dict()
        text["architectures"] = [served]
        text["tie_word_embeddings"] = hf.get("tie_word_embeddings", text["tie_word_embeddings"])
    elif architecture == "Mistral3ForConditionalGeneration":
        from transformers import Mistral3Config, PretrainedConfig

        text_config = Mistral3Config(text_config=hf.get("text_config")).text_config
        assert isinstance(text_config, PretrainedConfig)  # (Mistral3Config builds one from a dict or None)
        text = text_config.to_dict()
        text["architectures"] = [
            "Ministral3ForCausalLM" if text_config.model_type == "ministral3" else "MistralForCausalLM"
        ]
    elif architecture in _OUTER_CONFIGS:
        import transformers

        config_class, served = _OUTER_CONFIGS[architecture]
        outer = getattr(transformers, config_class)(**hf)
        text = outer.text_config.to_dict()
        text["architectures"] = [served]
        if served == "Qwen3MoeForCausalLM":  # (Qwen3-VL-MoE's router renormalizes, whatever the config says)
            text["norm_topk_prob"] = True
        # transformers ties the LM head by the outer config's tie_word_embeddings (Qwen3-VL-2B's, 4B's;
        # LFM2-VL's, tied by default)
        text["tie_word_embeddings"] = bool(outer.tie_word_embeddings)
        # (Qwen's M-RoPE turns a text token's time, height and width sections by its one position, as
        # one rope does: transformers' config class gives it rope_type default, its sections beside,
        # unread here)
    else:
        return hf
    if hf.get("quantization_config"):  # (the checkpoint's, text decoder and all: an FP8 one's scales)
        text["quantization_config"] = hf["quantization_config"]
    logger.info("%s: its text decoder is served (%s), not images", architecture, text["architectures"][0])
    return text


# the names a release gives its architecture -> transformers' (its config class renames them so)
_ARCHITECTURE_ALIASES = {"MiniCPM5MoEForCausalLM": "MiniCPM5MoeForCausalLM"}
# Gemma 4's and Gemma 3n's multimodal checkpoints -> (the config class of their `text_config`, the
# text model served)
_GEMMA_TEXT_CONFIGS = {
    "Gemma4ForConditionalGeneration": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    "Gemma3nForConditionalGeneration": ("Gemma3nTextConfig", "Gemma3nForCausalLM"),
}
# multimodal checkpoints whose config class holds the text decoder's config (`text_config`) -> (that
# class, the text model served): Qwen's vision-language ones, Llama 4, LFM2-VL, Fuyu
_OUTER_CONFIGS = {
    "Qwen2VLForConditionalGeneration": ("Qwen2VLConfig", "Qwen2ForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ("Qwen2_5_VLConfig", "Qwen2ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5Config", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeConfig", "Qwen3_5MoeForCausalLM"),
    "Qwen3VLForConditionalGeneration": ("Qwen3VLConfig", "Qwen3ForCausalLM"),
    "Qwen3VLMoeForConditionalGeneration": ("Qwen3VLMoeConfig", "Qwen3MoeForCausalLM"),
    "Llama4ForConditionalGeneration": ("Llama4Config", "Llama4ForCausalLM"),
    "Lfm2VlForConditionalGeneration": ("Lfm2VlConfig", "Lfm2ForCausalLM"),
    "FuyuForCausalLM": ("FuyuConfig", "PersimmonForCausalLM"),
}
# the multimodal architectures whose text decoder is served (`text_decoder_config`)
MULTIMODAL_TEXT_DECODERS = (
    "Gemma3ForConditionalGeneration",
    *_GEMMA_TEXT_CONFIGS,
    "Mistral3ForConditionalGeneration",
    *_OUTER_CONFIGS,
)


def _max_model_len(hf: dict[str, Any], requested: int | None) -> int:
    """The requested context length, else the model's (a sliding window bounds what a layer attends
    to, not the positions). A model without attention (Mamba2's) has no positions to run past: any
    length, 2,048 unless requested (vLLM's where a config names none)."""
    if num_kv_cache_layers(hf) == 0:
        if requested is not None and requested < 1:
            raise ValueError(f"max_model_len: must be at least 1, got {requested}")
        return requested or 2048
    limit = rope_context_length(hf)
    if requested is not None and not 1 <= requested <= limit:
        raise ValueError(f"max_model_len: must be in [1, {limit}] for this model, got {requested}")
    return requested or limit


def rope_context_length(hf: dict[str, Any]) -> int:
    """The context the model's positions reach, as vLLM derives it: `max_position_embeddings`, times
    `factor` under linear rope scaling; under yarn, the pretraining length times `factor` (Qwen's
    128K from 32K with factor 4). llama3's tables already reach max_position_embeddings, and so do
    Gemma 3's (its global layers' linear scaling, vLLM's exception)."""
    positions = int(hf.get("max_position_embeddings", 2048))
    if architecture_of(hf) in (
        "Gemma3ForCausalLM",
        "Gemma4ForCausalLM",
        "Gemma3nForCausalLM",
        "Lfm3ForCausalLM",
        "MellumForCausalLM",
    ):  # (their ropes by layer type)
        return positions
    rope = rope_parameters(
        olmo3_rope_config(hf, "full_attention") if architecture_of(hf) == "Olmo3ForCausalLM" else hf
    )
    if rope["rope_type"] in ("linear", "yarn", "llama3", "longrope") and not isinstance(
        rope.get("factor"), int | float
    ):
        raise ValueError(
            f"model: config.json's rope scaling ({rope['rope_type']}) needs a numeric factor, got {rope.get('factor')!r}"
        )
    if rope["rope_type"] == "linear":
        return int(positions * rope["factor"])
    if rope["rope_type"] == "yarn":
        return int(rope["original_max_position_embeddings"] * rope["factor"])
    return positions


_WINDOW_ON_UNLESS_OFF = (
    "Cohere2MoeForCausalLM",
    "AfmoeForCausalLM",
    "GraniteMoeSWAForCausalLM",
    "GraniteSWAForCausalLM",
    "GPTNeoForCausalLM",
    "MinistralForCausalLM",
    "CwmForCausalLM",
    "VaultGemmaForCausalLM",
    "Gemma4ForCausalLM",
    "Gemma3nForCausalLM",
    "MiniMaxForCausalLM",
    "Lfm3ForCausalLM",
    "MellumForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GptOssForCausalLM",
    "Olmo3ForCausalLM",
    "Ministral3ForCausalLM",
    "Exaone4ForCausalLM",
    "ExaoneMoeForCausalLM",
    "Cohere2ForCausalLM",
    "Starcoder2ForCausalLM",
    "Dots1ForCausalLM",
)
_WINDOW_OFF_UNLESS_ON = (
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
_WINDOW_IN_SOME_LAYERS = (
    "Cohere2MoeForCausalLM",
    "AfmoeForCausalLM",
    "GraniteMoeSWAForCausalLM",
    "GraniteSWAForCausalLM",
    "GPTNeoForCausalLM",
    "MinistralForCausalLM",
    "CwmForCausalLM",
    "VaultGemmaForCausalLM",
    "Gemma4ForCausalLM",
    "Gemma3nForCausalLM",
    "Lfm3ForCausalLM",
    "MellumForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GptOssForCausalLM",
    "Olmo3ForCausalLM",
    "Exaone4ForCausalLM",
    "ExaoneMoeForCausalLM",
    "Cohere2ForCausalLM",
    "Dots1ForCausalLM",
)
# where config.json has no `sliding_window` key, transformers' config class default
_DEFAULT_WINDOW = {
    "Cohere2MoeForCausalLM": 4096,
    "AfmoeForCausalLM": 1024,
    "GraniteSWAForCausalLM": 128,
    "GraniteMoeSWAForCausalLM": 128,
    "GPTNeoForCausalLM": 256,
    "MinistralForCausalLM": 4096,
    "CwmForCausalLM": 8192,
    "VaultGemmaForCausalLM": 4096,
    "Gemma4ForCausalLM": 512,
    "Gemma3nForCausalLM": 512,
    "Lfm3ForCausalLM": 256,
    "MellumForCausalLM": 1024,
    "MistralForCausalLM": 4096,
    "Gemma2ForCausalLM": 4096,
    "Gemma3ForCausalLM": 4096,
    "GptOssForCausalLM": 128,
    "Olmo3ForCausalLM": 4096,
    "Exaone4ForCausalLM": 4096,
    "ExaoneMoeForCausalLM": 4096,
    "Cohere2ForCausalLM": 4096,
    "Dots1ForCausalLM": 4096,
}


@dataclass(frozen=True)
class Fp8Layout:
    """An FP8 checkpoint's (`models.fp8`)."""

    method: str  # config.json's quant_method
    block: tuple[int, int] | None  # rows x columns a scale, when scales come a block


@dataclass(frozen=True)
class IntLayout:
    """An integer-quantized checkpoint's (`models.int_weights`): GPTQ's, AWQ's, compressed-tensors'."""

    method: str  # config.json's quant_method
    bits: int  # a value's
    group_size: int  # input columns a scale (and zero point); -1: a row's inputs one group
    zeros_less_one: bool = False  # GPTQ's v1 checkpoints store each zero point less one
    packed: bool = True  # compressed-tensors' int-quantized int8 weights are stored as they are
    zero_points: bool = False  # compressed-tensors' asymmetric ints (GPTQ's and AWQ's always have them)


QuantizedLayout = Fp8Layout | IntLayout


def quantized_layout(hf: dict[str, Any]) -> QuantizedLayout | None:
    """How config.json's quantization_config stores the weights, where they are dequantized on load,
    or None where it names no quantization or another one (refused by `check_quantization`). A
    scheme of a served method that cannot be read is refused naming its key."""
    quant = hf.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method == "fp8":
        if quant.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"model: quantization_config.fmt must be e4m3, got {quant['fmt']!r}")
        block = quant.get("weight_block_size")
        return Fp8Layout(method, None if block is None else _block("weight_block_size", block))
    if method == "fbgemm_fp8":
        return Fp8Layout(method, None)
    if method == "gptq":
        return _gptq_layout(quant)
    if method == "awq":
        return _awq_layout(quant)
    if method == "compressed-tensors":
        return _compressed_tensors_layout(quant)
    return None


def _block(key: str, block: Any) -> tuple[int, int]:
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ValueError(f"model: quantization_config.{key} must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def _bits_and_group(key: str, bits: Any, group_size: Any) -> tuple[int, int]:
    """Values of 2, 4 or 8 bits (packed whole into int32s), groups of a positive size or -1."""
    if bits not in (2, 4, 8):
        raise ValueError(f"model: quantization_config.{key}bits must be 2, 4 or 8, got {bits!r}")
    if not (isinstance(group_size, int) and (group_size > 0 or group_size == -1)):
        raise ValueError(
            f"model: quantization_config.{key}group_size must be positive or -1, got {group_size!r}"
        )
    return bits, group_size


def _gptq_layout(quant: dict[str, Any]) -> IntLayout:
    """AutoGPTQ's and GPTQModel's layout (not Marlin's repacking); v1 checkpoints (`gptq`, the
    default) store each zero point less one, v2 ones as it is."""
    checkpoint_format = quant.get("checkpoint_format", quant.get("format", "gptq"))
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"model: GPTQ quantization_config.checkpoint_format must be gptq or gptq_v2, got {checkpoint_format!r}"
        )
    bits, group_size = _bits_and_group("", quant.get("bits"), quant.get("group_size", 128))
    return IntLayout("gptq", bits, group_size, zeros_less_one=checkpoint_format == "gptq")


def _awq_layout(quant: dict[str, Any]) -> IntLayout:
    """AutoAWQ's GEMM layout with zero points (its default)."""
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"model: AWQ quantization_config.version must be gemm, got {quant.get('version')!r}")
    if not quant.get("zero_point", True):
        raise ValueError("model: AWQ quantization_config.zero_point false is not supported")
    bits, group_size = _bits_and_group(
        "", quant.get("bits", quant.get("w_bit")), quant.get("group_size", quant.get("q_group_size", 128))
    )
    if bits != 4:  # (AutoAWQ's GEMM layout orders the eight 4-bit values of an int32; no other width)
        raise ValueError(f"model: AWQ quantization_config.bits must be 4, got {bits!r}")
    return IntLayout("awq", bits, group_size)


def _compressed_tensors_layout(quant: dict[str, Any]) -> QuantizedLayout:
    """Red Hat's and Neural Magic's checkpoints (llm-compressor): FP8 weights (format float-quantized
    or naive-quantized) a tensor's, a row's or a block's scale; int weights (pack-quantized: 4 or
    8 bits packed into int32s, W4A16 and W8A16; int-quantized: int8 as they are, W8A8) a row's or
    a group's scale, and zero point where not symmetric. Every config group the same scheme; any other refused naming its group."""
    checkpoint_format = quant.get("format")
    if checkpoint_format not in ("float-quantized", "naive-quantized", "pack-quantized", "int-quantized"):
        raise ValueError(
            "model: compressed-tensors quantization_config.format must be float-quantized, naive-quantized, "
            f"pack-quantized or int-quantized, got {checkpoint_format!r}"
        )
    layouts: set[QuantizedLayout] = set()
    for name, group in (quant.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
        key = f"config_groups.{name}.weights"
        if kind == "float" and bits == 8 and strategy in ("tensor", "channel", "block"):
            block = weights.get("block_structure") if strategy == "block" else None
            layouts.add(
                Fp8Layout(
                    "compressed-tensors", None if block is None else _block(f"{key}.block_structure", block)
                )
            )
        elif kind == "int" and strategy in ("channel", "group"):
            if checkpoint_format == "int-quantized" and bits != 8:
                raise ValueError(
                    f"model: compressed-tensors int-quantized {key}.num_bits must be 8, got {bits!r}"
                )
            group_size = weights.get("group_size") if strategy == "group" else -1
            bits, group_size = _bits_and_group(f"{key}.", bits, group_size)
            layouts.add(
                IntLayout(
                    "compressed-tensors",
                    bits,
                    group_size,
                    packed=checkpoint_format == "pack-quantized",
                    zero_points=not weights.get("symmetric", True),
                )
            )
        else:
            raise ValueError(
                f"model: compressed-tensors {key} must be 8-bit floats a tensor, a channel or a block, "
                f"or ints a channel or a group, got type {kind!r}, num_bits {bits!r}, strategy {strategy!r}"
            )
    if len(layouts) != 1:
        raise ValueError(f"model: compressed-tensors config_groups must name one scheme, got {len(layouts)}")
    layout = layouts.pop()
    if isinstance(layout, Fp8Layout) != (checkpoint_format in ("float-quantized", "naive-quantized")):
        raise ValueError(
            f"model: compressed-tensors format {checkpoint_format!r} does not hold its config_groups' weights"
        )
    return layout


def check_quantization(hf: dict[str, Any]) -> None:
    """Quantized weights would load as garbage or not at all, but those dequantized on load: FP8
    (`models.fp8`), GPTQ's, AWQ's and compressed-tensors' ints (`models.int_weights`) and GPT-OSS's
    MXFP4 experts (`models.gpt_oss`)."""
    if not hf.get("quantization_config") or quantized_layout(hf) is not None:
        return
    method = hf["quantization_config"].get("quant_method", "?")
    if not (method == "mxfp4" and architecture_of(hf) == "GptOssForCausalLM"):
        raise ValueError(
            f"model: config.json's quantization_config ({method}) is not supported (fp8, fbgemm_fp8, gptq, "
            "awq, compressed-tensors and GPT-OSS's mxfp4 are, dequantized on load)"
        )


def layer_windows(hf: dict[str, Any], architecture: str) -> list[int]:
    """Each layer's sliding window (0: none), as transformers' attention of the architecture reads
    config.json: Mistral, Mixtral, Ministral 3, Phi-3 and StarCoder2 slide every layer by
    `sliding_window`; Gemma 2 and 3, GPT-OSS, OLMo 3, EXAONE 4.0, K-EXAONE, Command R7B and dots.llm1
    the layers `layer_types` names (by default every other one, five of every six in Gemma 3, three
    of every four in OLMo 3, EXAONE's and Cohere's, dots.llm1's from `max_window_layers` on; GPT-OSS's
    window 128, the others' 4,096 unless config.json names one); Qwen2, Qwen2-MoE, Qwen3 and SmolLM3
    the layers `layer_types` names (by default Qwen2's from `max_window_layers` on, Qwen2-MoE's every
    other one below it, SmolLM3's layers without rotary) and Qwen3-MoE every layer, only under
    `use_sliding_window` (their checkpoints carry a window they do not use).
    `use_sliding_window: false` turns any window off (vLLM reads it so for every model); Llama,
    Granite and Gemma 1 have none (transformers reads no `sliding_window` for them)."""
    num_layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window", _DEFAULT_WINDOW.get(architecture))
    on_by_default = architecture in _WINDOW_ON_UNLESS_OFF
    if (
        not (on_by_default or architecture in _WINDOW_OFF_UNLESS_ON)
        or not (isinstance(window, int) and window > 0)
        or not hf.get("use_sliding_window", on_by_default)
    ):
        return [0] * num_layers
    if architecture not in _WINDOW_IN_SOME_LAYERS:
        return [window] * num_layers
    layer_types = hf.get("layer_types") or default_layer_types(hf, architecture)
    return [window if kind == "sliding_attention" else 0 for kind in layer_types]


def default_layer_types(hf: dict[str, Any], architecture: str) -> list[str]:
    """transformers' `layer_types` where config.json has none (Qwen2Config, Qwen3Config, SmolLM3Config;
    Gemma2Config and GptOssConfig: every other layer full; Gemma3TextConfig: every
    `sliding_window_pattern`-th (6) full; Olmo3Config: every fourth full, Exaone4Config and
    Cohere2Config every `sliding_window_pattern`-th (4); the others sliding)."""
    patterns = {
        "Gemma2ForCausalLM": 2,
        "VaultGemmaForCausalLM": 2,
        "GptOssForCausalLM": 2,
        "Olmo3ForCausalLM": 4,
    }
    if architecture == "Cohere2ForCausalLM":
        patterns[architecture] = hf.get("sliding_window_pattern", 4)
    if architecture == "Gemma3ForCausalLM":
        patterns[architecture] = hf.get("sliding_window_pattern", 6)
    if architecture == "AfmoeForCausalLM":
        patterns[architecture] = hf.get("global_attn_every_n_layers", 4)
    if architecture in (
        "Exaone4ForCausalLM",
        "ExaoneMoeForCausalLM",
    ):  # (the docs' "LLLG": three local, a global)
        pattern = hf.get("sliding_window_pattern", 4)
        patterns[architecture] = len(pattern) if isinstance(pattern, str) else pattern
    if architecture in patterns:
        pattern = patterns[architecture]
        if not (isinstance(pattern, int) and pattern > 0):
            raise ValueError(
                f"model: config.json's sliding_window_pattern must be a positive integer, got {pattern!r}"
            )
        sliding = [bool((i + 1) % pattern) for i in range(hf["num_hidden_layers"])]
    elif architecture == "SmolLM3ForCausalLM":
        sliding = [not turns for turns in smollm3_rotary_layers(hf)]
    elif architecture in (
        "CwmForCausalLM",
        "GraniteSWAForCausalLM",
        "GraniteMoeSWAForCausalLM",
    ):  # every fourth full, the first
        sliding = [bool(i % 4) for i in range(hf["num_hidden_layers"])]
    elif architecture == "Qwen2MoeForCausalLM":  # every other layer below max_window_layers
        first_full = hf.get("max_window_layers", 28)
        sliding = [bool((i + 1) % 2) and i < first_full for i in range(hf["num_hidden_layers"])]
    else:  # (transformers' Qwen2Config and Qwen3Config default 28; Dots1Config's all 62 of its layers)
        first_sliding = hf.get("max_window_layers", 62 if architecture == "Dots1ForCausalLM" else 28)
        sliding = [i >= first_sliding for i in range(hf["num_hidden_layers"])]
    return ["sliding_attention" if slides else "full_attention" for slides in sliding]


def llama4_layer_types(hf: dict[str, Any]) -> list[str]:
    """Each of Llama 4's layers' attention, chunked_attention or full_attention: `layer_types`, by
    default as Llama4TextConfig fills it in, chunked in the rope layers (`no_rope_layers`) unless
    attention_chunk_size is null."""
    chunk = hf.get("attention_chunk_size", 8192)
    types = hf.get("layer_types") or [
        "chunked_attention" if turns and chunk is not None else "full_attention"
        for turns in smollm3_rotary_layers(hf)
    ]
    if len(types) != hf["num_hidden_layers"] or not set(types) <= {"chunked_attention", "full_attention"}:
        raise ValueError(
            f"model: config.json's layer_types must name {hf['num_hidden_layers']} layers, each "
            f"chunked_attention or full_attention, got {types}"
        )
    if "chunked_attention" in types and not (isinstance(chunk, int) and chunk > 0):
        raise ValueError(
            f"model: config.json's attention_chunk_size must be a positive integer, got {chunk!r}"
        )
    return list(types)


def attention_chunk(hf: dict[str, Any]) -> int:
    """The chunk size of a model's chunked attention (Llama 4's: `layers.chunked`); 0, none."""
    if architecture_of(hf) != "Llama4ForCausalLM" or "chunked_attention" not in llama4_layer_types(hf):
        return 0
    return int(hf.get("attention_chunk_size", 8192))


def smollm3_rotary_layers(hf: dict[str, Any]) -> list[bool]:
    """Which of SmolLM3's layers turn q and k by their positions: `no_rope_layers` (1 turns, 0 does
    not; NoPE), by default all but every `no_rope_layer_interval`-th, as SmolLM3Config fills it in."""
    num_layers, interval = hf["num_hidden_layers"], hf.get("no_rope_layer_interval", 4)
    flags = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ValueError(
            f"model: config.json's no_rope_layers has {len(flags)} entries for {num_layers} layers"
        )
    return [bool(flag) for flag in flags]


# where config.json names no rope_theta, the config class's default (transformers' `default_theta`;
# 10,000 for the others)
_DEFAULT_THETA = {
    "MiniCPM5MoeForCausalLM": 5e6,
    "MixtralForCausalLM": 1e6,
    "MiniMaxForCausalLM": 1e6,
    "PhimoeForCausalLM": 1e6,
    "SmolLM3ForCausalLM": 2e6,
    "GptOssForCausalLM": 150_000.0,
    "Olmo3ForCausalLM": 500_000.0,
    "Ministral3ForCausalLM": 1e6,
    "Ernie4_5ForCausalLM": 500_000.0,
    "Ernie4_5_MoeForCausalLM": 500_000.0,
    "ApertusForCausalLM": 12_000_000.0,
    "SolarOpenForCausalLM": 1_000_000.0,
    "Lfm2ForCausalLM": 1_000_000.0,
    "Lfm2MoeForCausalLM": 1_000_000.0,
    "Llama4ForCausalLM": 500_000.0,
    "HeliumForCausalLM": 100_000.0,
    "CwmForCausalLM": 1_000_000.0,
    "HYV3ForCausalLM": 11_158_840.0,
    "CohereForCausalLM": 500_000.0,
    "MiniMaxM2ForCausalLM": 5_000_000.0,
}
# where it names no rope parameters at all, the config class's (GptOssConfig's YaRN)
_DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    "GptOssForCausalLM": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    # Ministral3Config's: YaRN 16x over 16,384 positions, queries scaled past them (Llama 4's scaling)
    "Ministral3ForCausalLM": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 16384,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.1,
    },
    # CwmConfig's: Llama 3.1's rope 16x over 8,192 positions, theta 1e6
    "CwmForCausalLM": {
        "rope_type": "llama3",
        "rope_theta": 1_000_000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
    # ApertusConfig's: Llama 3.1's rope 8x over 8,192 positions
    "ApertusForCausalLM": {
        "rope_type": "llama3",
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
}


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters transformers 5 reads from a 4.x (`rope_theta` + `rope_scaling`) or 5.x
    (`rope_parameters`) config: `rope_scaling` wins where both are set, so a config both carry is
    refused when they differ (transformers would also drop the other's `rope_theta`). Without
    either, the config class's defaults."""
    scaling, params = hf_config.get("rope_scaling"), hf_config.get("rope_parameters")
    chosen = _standardized(scaling or params or _DEFAULT_ROPE.get(architecture_of(hf_config), {}), hf_config)
    if scaling and params and _standardized(params, hf_config) != chosen:
        raise ValueError(
            f"model: config.json sets both rope_scaling {scaling} and rope_parameters {params}, which "
            "differ; keep the one the model was trained with"
        )
    return chosen


def olmo3_rope_config(hf: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """An OLMo 3 layer type's rope (as a config `RotaryEmbedding` reads): transformers 5's
    `rope_parameters` keyed by layer type as they are; from a 4.x config (`rope_theta`, 500,000 by
    default, and `rope_scaling`: YaRN in the long-context checkpoints) the global layers' rope with
    the scaling and the sliding layers' without it, at the same theta, as vLLM reads them.
    (transformers 5 reads such a config's `rope_theta` for the global layers alone and gives the
    sliding ones 500,000: the same for OLMo 3's checkpoints, all at 500,000.)"""
    params = hf.get("rope_parameters")
    theta = hf.get("rope_theta") or _DEFAULT_THETA["Olmo3ForCausalLM"]
    if isinstance(params, dict) and layer_type in params:
        chosen = dict(params[layer_type] or {"rope_type": "default"})
    else:  # one rope for the model (`rope_scaling`, or `rope_parameters` not keyed by layer type)
        whole = hf.get("rope_scaling") or params or {}
        theta = whole.get("rope_theta") or theta
        chosen = dict(whole) if layer_type == "full_attention" else {"rope_type": "default"}
    chosen.setdefault("rope_theta", theta)
    keys = ("max_position_embeddings", "original_max_position_embeddings")
    return {"rope_parameters": chosen, **{key: hf[key] for key in keys if key in hf}}


def _standardized(raw: dict[str, Any], hf_config: dict[str, Any]) -> dict[str, Any]:
    """Top-level `rope_theta` and `partial_rotary_factor` fill in what the dict lacks, as in
    transformers' `standardize_rope_params`; so does llama3's pretraining length (a top-level
    `original_max_position_embeddings` first, else the dict's, else `max_position_embeddings`),
    yarn's and longrope's."""
    params = {k: v for k, v in raw.items() if k != "type"}
    params["rope_type"] = raw.get("rope_type") or raw.get("type") or "default"
    theta = hf_config.get("rope_theta") or _DEFAULT_THETA.get(architecture_of(hf_config), 10000.0)
    params.setdefault("rope_theta", theta)
    if hf_config.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", hf_config["partial_rotary_factor"])
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params["original_max_position_embeddings"] = (
            hf_config.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or hf_config.get("max_position_embeddings", 2048)
        )
    # DeepSeek-V3's way to say it for yarn, Phi-3's for longrope
    if params["rope_type"] in ("yarn", "longrope") and params.get("factor") is None:
        params["factor"] = (
            hf_config.get("max_position_embeddings", 2048) / params["original_max_position_embeddings"]
        )
    return params


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `block_size` tokens per block; capacity from `num_blocks` or a memory budget."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None = a share of free device memory
    memory_utilization: float = 0.9  # GPU: share of its total memory for what is in use + KV, no budget given
    num_blocks: int | None = None  # exact block count, overrides the memory budget (tests)
    watermark: float = 0.01  # share of blocks kept free when admitting new requests
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out KV blocks (per rank)
    num_cpu_blocks: int | None = None  # exact CPU block count, overrides swap_space (tests)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not (1 <= self.block_size <= 256 and self.block_size & (self.block_size - 1) == 0):
            raise ValueError(f"block_size: must be a power of two in [1, 256], got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory: must be > 0 bytes")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError("memory_utilization: must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks: must be >= 1")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError("watermark: must be in [0, 1)")
        if self.swap_space < 0:
            raise ValueError("swap_space: must be >= 0 GiB")
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            raise ValueError("num_cpu_blocks: must be >= 0")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step and tokens per step (the token budget)."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # swap: move a preempted request's KV blocks to the CPU pool when it has room, else recompute;
    # recompute: free them and run the tokens again (multi-sequence requests still swap when they can)
    preemption_mode: str = "swap"
    # fcfs: queues in arrival order; priority: by each request's priority (lower first), then arrival,
    # and a waiting request preempts less urgent running ones when it cannot be admitted (as vLLM's)
    scheduling_policy: str = "fcfs"
    # n-gram drafts for decoding sequences (--speculative-config); None: none
    speculative: SpeculativeConfig | None = None
    # the model carries a state per sequence that only the steps computing its tokens build
    # (`ModelConfig.recurrent`): a preempted sequence is recomputed, never swapped, and parallel
    # samples share no blocks (each computes its prompt); `for_recurrent_state` sets it
    recurrent_state: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs: must be >= 1")
        if self.preemption_mode not in ("swap", "recompute"):
            raise ValueError(f"preemption_mode: must be swap or recompute, got {self.preemption_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                "max_num_batched_tokens: must be >= max_num_seqs (every running sequence "
                "needs a token each step)"
            )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size: must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str = "cpu"
    seed: int = 0
    attention_backend: str = "torch"  # resolved: torch (reference) or triton (kernels)
    compile: bool = False  # resolved: the forward pass runs through torch.compile (`resolve_compile`)
    cuda_graphs: bool = False  # resolved: decode steps replay CUDA graphs (`resolve_cuda_graphs`)
    lora_modules: tuple[tuple[str, str], ...] = ()  # LoRA adapters (name, PEFT directory), all loaded
    chat_template: str | None = None  # replaces the model's (--chat-template, resolved to its text)
    # template variables every chat request gets unless it sets them (--default-chat-template-kwargs)
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def lora_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.lora_modules)

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend: must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        for name in self.lora_names:
            try:
                check_adapter_name(name, self.model.served_model_name)
            except ValueError as exc:
                raise ValueError(f"lora_modules: {exc}") from None
        if self.model.recurrent:
            self._check_recurrent_state()
        chunk = attention_chunk(self.model.hf_config)
        if chunk % self.cache.block_size:
            raise ValueError(
                f"block_size: {self.cache.block_size} does not divide the model's attention_chunk_size "
                f"{chunk} (each chunk of its attention must start a block)"
            )

    def _check_recurrent_state(self) -> None:
        """What a model with a state per sequence (`ModelConfig.recurrent`) cannot run with."""
        name = self.model.architecture
        if self.scheduler.speculative is not None:
            raise ValueError(
                f"speculative_config: {name} is not served with speculative decoding (a rejected draft "
                "would stay in its convolutions' state)"
            )
        if self.lora_modules:
            raise ValueError(f"lora_modules: {name}'s LoRA adapters are not served")
        if self.cache.enable_prefix_caching or not self.scheduler.recurrent_state:
            raise ValueError(
                f"model: {name} carries a state per sequence: configure it through for_recurrent_state "
                "(no prefix caching, sequences recomputed from their first token)"
            )


def for_recurrent_state(
    model: ModelConfig, cache: CacheConfig, scheduler: SchedulerConfig
) -> tuple[CacheConfig, SchedulerConfig]:
    """The cache and scheduler settings a model with a state per sequence runs under (as vLLM ran
    hybrid models before it cached their states): no prefix caching and no swap space, since a
    sequence can resume only from its first token, which only those steps rebuild."""
    if not model.recurrent:
        return cache, scheduler
    if cache.enable_prefix_caching:
        logger.info("%s carries a state per sequence: prefix caching is off", model.architecture)
    cache = replace(cache, enable_prefix_caching=False, swap_space=0.0, num_cpu_blocks=0)
    return cache, replace(scheduler, recurrent_state=True)


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_attention_backend(backend: str, device: str) -> str:
    """`auto`: the Triton kernels on GPUs, the torch reference on CPU (where Triton runs only under
    its interpreter, which is for tests)."""
    if backend != "auto":
        return backend
    return "triton" if device.startswith("cuda") else "torch"


def resolve_block_size(block_size: int | None, attention_backend: str) -> int:
    """Unset: 16 tokens for the Triton kernels, which tile attention by block; 8 for the torch
    reference (CPU), which gathers K/V by slot, so smaller blocks cost nothing per step and leave less
    of each sequence's last block empty: on the 64-request chat benchmark 93.6% of the KV slots hold
    real tokens at peak against 82.5% with 16, at the same throughput (bench/README.md)."""
    if block_size is not None:
        return block_size
    return 16 if attention_backend == "triton" else 8


def resolve_compile(
    enforce_eager: bool, device: str, attention_backend: str, tensor_parallel_size: int
) -> bool:
    """torch.compile the forward pass where it is verified to pay: on CPU with the torch attention
    backend and one rank. Inductor fuses the norms, rotary, SiLU and residual adds that run as
    separate bf16 ops in eager mode and packs the linear weights with their residual adds fused. On
    CPUs with AVX512-BF16 decode-only steps skip the forward pass either way (`fused_decode`), so it
    buys the steps with prompts: on the 64-request chat benchmark 720.6 against 680.1 tok/s eager,
    on 64 random requests 237.4 against 230.6, for ~10 s more at start with AMX tiles (~40 s on a
    first start), ~12 s for float32 in oneDNN's layout (~55 s on a first start) and 55-65 s at every
    start where the weights are frozen (bench/README.md, "Start-up"). GPUs run the eager pass, its
    decode steps replayed from CUDA graphs (`resolve_cuda_graphs`): on an H200 the compiled pass took a
    64-sequence decode step of a 1B Llama in 10.9 ms against 8.5 eager, its graph broken at every
    layer's attention, both bound by the host's launches ("Decode step"). Tensor-parallel runs stay
    eager until measured."""
    return (
        not enforce_eager and device == "cpu" and attention_backend == "torch" and tensor_parallel_size == 1
    )


def resolve_cuda_graphs(
    enforce_eager: bool, device: str, attention_backend: str, tensor_parallel_size: int
) -> bool:
    """Replay decode-only steps from CUDA graphs (`worker.cuda_graphs`) on GPUs with the Triton kernels
    and one rank: eager, a decode step there is bound by the host's kernel launches. Tensor-parallel
    runs stay eager until their all-reduce is verified inside a captured graph."""
    return (
        not enforce_eager
        and device.startswith("cuda")
        and attention_backend == "triton"
        and tensor_parallel_size == 1
    )


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: str | None = None) -> str:
    """`auto`: on GPUs a float16 checkpoint runs in float16 (as vLLM runs it: bfloat16 would drop
    mantissa bits it was trained with), any other in bfloat16; on CPUs bfloat16 where the CPU has
    native bf16 matrix support, float32 otherwise (float16 matrix products are slow on CPUs)."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "float16" if checkpoint_dtype == "float16" else "bfloat16"
    return "bfloat16" if _cpu_has_bf16() else "float32"


def checkpoint_dtype(model_path: str) -> str | None:
    """The dtype config.json says the weights were saved in (`torch_dtype` in transformers 4, `dtype`
    in 5), or None when it says nothing or the directory has no config.json."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    hf = json.loads(config_file.read_text())
    value = hf.get("dtype") or hf.get("torch_dtype")
    return value if isinstance(value, str) else None


def cpuinfo(key: str) -> str:
    """The value of `key` ("flags", "vendor_id", ...) on /proc/cpuinfo's first line naming it; "" where
    no such line can be read."""
    try:
        with open("/proc/cpuinfo") as lines:
            for line in lines:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return ""


def _cpu_has_bf16() -> bool:
    flags = cpuinfo("flags").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_num_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
