"""Decoders that place tokens by ALiBi (a penalty on each score linear in the query's distance to the
key, a slope a head) rather than by positions, as transformers computes them, on the Llama family's
tensor-parallel layers (their sizes read under Llama's names by `config.alibi_config`):

- BigScience's BLOOM (`BloomForCausalLM`: bloom-560m to BLOOM-176B, BLOOMZ): a LayerNorm on the
  embeddings (`word_embeddings_layernorm`), then GPT-2's sequential layer (LayerNorms with a bias,
  every projection biased, an ungated GELU MLP 4 x hidden wide, tanh approximation), q, k and v in
  one tensor a head at a time (`query_key_value`), the LM head tied; slopes 2^(-8i/n) for n heads a
  power of two (Press et al.'s interleaving for other counts);
- MosaicML's MPT (`MptForCausalLM`: MPT-7B, MPT-30B): the same layer without any bias (its norms'
  too), q, k and v one after the other in `Wqkv`, exact GELU, the LM head tied; slopes 2^(-8i / n)
  (`alibi_bias_max` 8, which transformers' MPT always takes), by MPT's order for other head counts.

The slopes are this rank's heads' (`alibi_slopes`), given to each layer's `Attention`, which the
kernels read (the C++ CPU kernels, the Triton kernels, the torch reference). Refused by name: BLOOM's residual after the norm
(`apply_residual_connection_post_layernorm`), MPT's clipped or normed q and k (`clip_qkv`, `qk_ln`),
another softmax scale or alibi_bias_max, no ALiBi, an MLP of another width, and biases (`no_bias`
false), none of which transformers' MPT runs."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedserve.distributed import get_tp_rank
from pagedserve.layers.attention import AttentionBackend
from pagedserve.layers.norm import LayerNorm, RMSNorm
from pagedserve.models.llama import Biases, LlamaDecoderLayer, rms_norm_eps
from pagedserve.models.ungated import LayerNormDecoderLayer, UngatedForCausalLM


def alibi_slopes(num_heads: int, max_bias: float = 8.0, mpt_order: bool = False) -> torch.Tensor:
    """Each head's slope (float32 [num_heads]): for a power of two, 2^(-max_bias i / n), i = 1..n.
    Otherwise BLOOM's: those of the power of two below, then every other one of the power above;
    MPT's: the power above's, its odd-numbered ones first, cut to n."""
    below = 2 ** math.floor(math.log2(num_heads))
    if mpt_order:
        above = 2 ** math.ceil(math.log2(num_heads))
        slopes = 2.0 ** -(torch.arange(1, above + 1, dtype=torch.float32) * (max_bias / above))
        return torch.cat((slopes[1::2], slopes[::2]))[:num_heads] if above != num_heads else slopes
    slopes = (2.0 ** -(max_bias / below)) ** torch.arange(1, below + 1, dtype=torch.float32)
    if below == num_heads:
        return slopes
    extra = (2.0 ** -(max_bias / (2 * below))) ** torch.arange(
        1, 1 + 2 * (num_heads - below), 2, dtype=torch.float32
    )
    return torch.cat((slopes, extra))


class AlibiForCausalLM(UngatedForCausalLM):
    """GPT-2's sequential LayerNorm layer (ungated MLP), no rotary, every attention layer biased by
    ALiBi's slopes of this rank's heads (`slopes`)."""

    decoder_layer_class: type[LlamaDecoderLayer] = LayerNormDecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        super().__init__(cfg, max_position, backend)
        heads, rank = self.decoder_layers[0].self_attn.num_heads, get_tp_rank()  # (split in rank order)
        rank_slopes = self.slopes(cfg)[rank * heads : (rank + 1) * heads]  # (on the model's device)
        for layer in self.decoder_layers:
            layer.self_attn.attn.alibi_slopes = rank_slopes

    @staticmethod
    def slopes(cfg: dict[str, Any]) -> torch.Tensor:
        return alibi_slopes(cfg["num_attention_heads"])

    @staticmethod
    def rotary_layers(cfg: dict[str, Any]) -> list[bool]:
        return [False] * cfg["num_hidden_layers"]


# BLOOM's checkpoint names -> Llama's (after `transformer.` is taken off; the fused query_key_value is
# cut in `BloomForCausalLM._as_llama`)
_BLOOM_NAMES = [
    (re.compile(r"^word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"^word_embeddings_layernorm\."), "model.embed_norm."),
    (re.compile(r"^ln_f\."), "model.norm."),
    (re.compile(r"^h\."), "model.layers."),
    (re.compile(r"\.self_attention\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.mlp\.dense_h_to_4h\."), ".mlp.up_proj."),
    (re.compile(r"\.mlp\.dense_4h_to_h\."), ".mlp.down_proj."),
]


class BloomForCausalLM(AlibiForCausalLM):
    """BLOOM (see the module docstring); BloomConfig's defaults where config.json leaves a key out."""

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        if cfg.get("apply_residual_connection_post_layernorm"):
            raise ValueError(
                "model: config.json's apply_residual_connection_post_layernorm (the residual taken after "
                "each norm) is not supported"
            )
        super().__init__({**cfg, "mlp_bias": True, "hidden_act": "gelu_new"}, max_position, backend)
        self.embed_norm: RMSNorm = LayerNorm(cfg["hidden_size"], rms_norm_eps(cfg))
        self.hidden_size, self.head_dim = cfg["hidden_size"], cfg["hidden_size"] // cfg["num_attention_heads"]

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        return True, True

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(self.embed_tokens(input_ids))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._as_llama(weights))

    def _as_llama(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under Llama's names (BigScience's own checkpoints store them
        without `transformer.`); `query_key_value` [heads x (q | k | v), ...] cut into q_proj, k_proj
        and v_proj."""
        for name, tensor in weights:
            name = name.removeprefix("transformer.")
            for pattern, replacement in _BLOOM_NAMES:
                name = pattern.sub(replacement, name)
            if ".self_attention.query_key_value." not in name:
                yield name, tensor
                continue
            if tensor.shape[0] != 3 * self.hidden_size:
                raise ValueError(
                    f"checkpoint's {name!r} has {tensor.shape[0]} rows; config.json's hidden_size "
                    f"{self.hidden_size} makes {3 * self.hidden_size}"
                )
            parts = tensor.unflatten(0, (-1, 3, self.head_dim)).unbind(1)  # each [heads, head_dim, ...]
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                yield (
                    name.replace(".self_attention.query_key_value.", f".self_attn.{part}."),
                    rows.flatten(0, 1),
                )


class MptDecoderLayer(LayerNormDecoderLayer):
    """MPT's layer: GPT-2's, its LayerNorms without a bias."""

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return LayerNorm(cfg["hidden_size"], rms_norm_eps(cfg), bias=False)


# MPT's checkpoint names -> Llama's (after `transformer.` is taken off)
_MPT_NAMES = [
    (re.compile(r"^wte\."), "model.embed_tokens."),
    (re.compile(r"^norm_f\."), "model.norm."),
    (re.compile(r"^blocks\."), "model.layers."),
    (re.compile(r"\.norm_1\."), ".input_layernorm."),
    (re.compile(r"\.norm_2\."), ".post_attention_layernorm."),
    (re.compile(r"\.attn\.out_proj\."), ".self_attn.o_proj."),
    (re.compile(r"\.ffn\."), ".mlp."),
]


class MptForCausalLM(AlibiForCausalLM):
    """MPT (see the module docstring); MptConfig's defaults where config.json leaves a key out."""

    decoder_layer_class = MptDecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        attn = cfg.get("attn_config") or {}
        hidden = cfg["hidden_size"]
        unsupported = {
            "attn_config's clip_qkv": attn.get("clip_qkv"),
            "attn_config's qk_ln": attn.get("qk_ln"),
            "attn_config's softmax_scale": attn.get("softmax_scale")
            not in (None, (hidden // cfg["num_attention_heads"]) ** -0.5),
            "attn_config's alibi false": attn.get("alibi", True) is False,
            "attn_config's alibi_bias_max other than 8": attn.get("alibi_bias_max", 8) != 8,
            "expansion_ratio other than 4": cfg.get("expansion_ratio", 4) != 4,
            "no_bias false": cfg.get("no_bias", True) is False,
        }
        for option, present in unsupported.items():
            if present:
                raise ValueError(
                    f"model: config.json's {option} is not supported (transformers' MPT runs none)"
                )
        super().__init__({**cfg, "mlp_bias": False, "hidden_act": "gelu"}, max_position, backend)

    @staticmethod
    def slopes(cfg: dict[str, Any]) -> torch.Tensor:
        return alibi_slopes(cfg["num_attention_heads"], mpt_order=True)

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        return False, False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_mpt_names(weights))


def _mpt_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """MPT's tensors under Llama's names, `Wqkv` [q | k | v, hidden] cut into q_proj, k_proj and v_proj."""
    for name, tensor in weights:
        name = name.removeprefix("transformer.")
        for pattern, replacement in _MPT_NAMES:
            name = pattern.sub(replacement, name)
        if ".attn.Wqkv." not in name:
            yield name, tensor
            continue
        for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3), strict=True):
            yield name.replace(".attn.Wqkv.", f".self_attn.{part}."), rows
