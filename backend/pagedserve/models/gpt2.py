"""Decoders that add a learned embedding of each position to the token's, with no rotary, as
transformers computes them, on the Llama family's tensor-parallel layers (their sizes read under
Llama's names by `config.gpt2_config`):

- OpenAI's GPT-2 (`GPT2LMHeadModel`; DistilGPT2, DialoGPT...): LayerNorms with a bias before attention
  and the MLP, every projection biased, an ungated GELU MLP (tanh approximation: `gelu_new`), the LM
  head tied; its checkpoints store each projection as a Conv1D (input by output: turned on load), q, k
  and v in one (`c_attn`);
- BigCode's GPTBigCode (`GPTBigCodeForCausalLM`: StarCoder, SantaCoder, WizardCoder, IBM's Granite
  Code 20B and 34B): GPT-2's layer as nn.Linear tensors, one KV head where `multi_query` (its default;
  else each head's q, k and v side by side in `c_attn`);
- EleutherAI's GPT-Neo (`GPTNeoForCausalLM`): GPT-2's layer as nn.Linear tensors, q, k and v apart and
  unbiased, q.k unscaled, local layers sliding a window (`GPTNeoForCausalLM`);
- Meta's OPT (`OPTForCausalLM`: OPT-125m to 66B): the same layer with a ReLU MLP (`fc1`, `fc2`), q, k, v
  and o apart, its position embeddings offset by 2 (`OPT_POSITION_OFFSET`).
- Microsoft's BioGPT (`BioGptForCausalLM`: BioGPT, BioGPT-Large): OPT's layer with a GELU MLP, its
  LayerNorms at nn.LayerNorm's eps (1e-5, whatever `layer_norm_eps` says: transformers' BioGPT reads
  it nowhere), the token embeddings times sqrt(hidden) (`scale_embedding`), the head tied.

Refused by name: GPT-2's `scale_attn_by_inverse_layer_idx`, OPT's norms after the layers
(`do_layer_norm_before` false: OPT-350m), its projection between the embeddings and the layers
(`word_embed_proj_dim`), LayerNorms without parameters and no final norm."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.attention import AttentionBackend
from pagedserve.models.llama import Biases, LlamaDecoderLayer, Scales, head_dim_of
from pagedserve.models.ungated import LayerNormDecoderLayer, UngatedForCausalLM

OPT_POSITION_OFFSET = 2  # OPT's learned positions start at row 2 (rows 0-1 were padding's)


class LearnedPositionsForCausalLM(UngatedForCausalLM):
    """A LayerNorm decoder (biased projections, ungated MLP) whose embeddings add a learned one of each
    position (`embed_positions` [positions + offset, hidden], whole on every rank) and whose q and k
    turn by no rotary."""

    decoder_layer_class: type[LlamaDecoderLayer] = LayerNormDecoderLayer
    position_offset = 0

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        cfg = {**cfg, "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)), "mlp_bias": self.biased(cfg)}
        super().__init__(cfg, max_position, backend)
        rows = cfg["max_position_embeddings"] + self.position_offset
        self.embed_positions = nn.Parameter(torch.empty(rows, cfg["hidden_size"]), requires_grad=False)

    @staticmethod
    def biased(cfg: dict[str, Any]) -> bool:
        return True

    @classmethod
    def attention_biases(cls, cfg: dict[str, Any]) -> Biases:
        return cls.biased(cfg), cls.biased(cfg)

    @staticmethod
    def rotary_layers(cfg: dict[str, Any]) -> list[bool]:
        return [False] * cfg["num_hidden_layers"]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) + F.embedding(
            positions + self.position_offset, self.embed_positions
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(
            (name.replace("embed_positions.weight", "embed_positions"), tensor)
            for name, tensor in self.renamed(weights)
        )

    def renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError


# GPT-2's and GPTBigCode's names -> ours (after `transformer.` is taken off)
_GPT2_RENAMES = (
    (re.compile(r"^wte\."), "embed_tokens."),
    (re.compile(r"^wpe\."), "embed_positions."),
    (re.compile(r"^ln_f\."), "norm."),
    (re.compile(r"^h\.(\d+)\.ln_1\."), r"layers.\1.input_layernorm."),
    (re.compile(r"^h\.(\d+)\.ln_2\."), r"layers.\1.post_attention_layernorm."),
    (re.compile(r"^h\.(\d+)\.attn\.c_proj\."), r"layers.\1.self_attn.o_proj."),
    (re.compile(r"^h\.(\d+)\.mlp\.c_fc\."), r"layers.\1.mlp.up_proj."),
    (re.compile(r"^h\.(\d+)\.mlp\.c_proj\."), r"layers.\1.mlp.down_proj."),
)
_CONV1D = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$")  # GPT-2's Conv1D tensors: input by output


class GPT2LMHeadModel(LearnedPositionsForCausalLM):
    """GPT-2 (see the module docstring); GPT2Config's defaults where config.json leaves a key out."""

    conv1d = True  # GPT-2's projections are stored input by output; GPTBigCode's as nn.Linear

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        if cfg.get("scale_attn_by_inverse_layer_idx"):
            raise ValueError(
                f"model: config.json's scale_attn_by_inverse_layer_idx is not supported for {type(self).__name__}"
            )
        super().__init__(cfg, max_position, backend)

    @staticmethod
    def read_scales(cfg: dict[str, Any]) -> Scales:
        """q.k by 1 / sqrt(head_dim) unless `scale_attn_weights` is false (then by 1)."""
        return Scales(attention=None if cfg.get("scale_attn_weights", True) else 1.0)

    def renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = name.removeprefix("transformer.")
            if name.endswith((".attn.bias", ".attn.masked_bias")):  # (older checkpoints' causal masks)
                continue
            if self.conv1d and _CONV1D.search(name):
                tensor = tensor.t()
            split = re.match(r"^h\.(\d+)\.attn\.c_attn\.(weight|bias)$", name)
            if split is None:
                for pattern, replacement in _GPT2_RENAMES:
                    name = pattern.sub(replacement, name)
                yield name, tensor
                continue
            layer, kind = split.groups()
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), self.qkv_rows(tensor), strict=True):
                yield f"layers.{layer}.self_attn.{part}.{kind}", rows

    def qkv_rows(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`c_attn`'s rows (output by input, or a bias) as q's, k's and v's."""
        return tuple(tensor.chunk(3))


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    """GPTBigCode (see the module docstring); GPTBigCodeConfig's defaults where config.json leaves a
    key out."""

    conv1d = False

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        super().__init__(cfg, max_position, backend)
        self.multi_query = cfg["num_key_value_heads"] == 1
        self.head_sizes = (cfg["num_attention_heads"], head_dim_of(cfg))

    def qkv_rows(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Multi-query: q's rows, then the one KV head's k and v; else each head's q, k and v side by side."""
        heads, head_dim = self.head_sizes
        if self.multi_query:
            return tuple(tensor.split([heads * head_dim, head_dim, head_dim]))
        per_head = tensor.unflatten(0, (heads, 3, head_dim))
        return tuple(per_head[:, part].flatten(0, 1) for part in range(3))


# GPT-Neo's names -> ours (after `transformer.` is taken off)
_GPT_NEO_RENAMES = (
    (re.compile(r"^h\.(\d+)\.attn\.attention\.out_proj\."), r"layers.\1.self_attn.o_proj."),
    (re.compile(r"^h\.(\d+)\.attn\.attention\."), r"layers.\1.self_attn."),
    *_GPT2_RENAMES,
)


class GPTNeoForCausalLM(LearnedPositionsForCausalLM):
    """EleutherAI's GPT-Neo (125M, 1.3B, 2.7B): GPT-2's layer as nn.Linear tensors, q, k and v apart and
    unbiased (o biased), q.k unscaled, the layers `attention_types` names local sliding a window of
    `window_size` (every other one by default: `config.gpt2_config`); GPTNeoConfig's defaults where
    config.json leaves a key out."""

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        return False, True

    @staticmethod
    def read_scales(cfg: dict[str, Any]) -> Scales:
        return Scales(attention=1.0)

    def renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = name.removeprefix("transformer.")
            if name.endswith((".attn.attention.bias", ".attn.attention.masked_bias")):
                continue  # (older checkpoints' causal masks)
            for pattern, replacement in _GPT_NEO_RENAMES:
                name = pattern.sub(replacement, name)
            yield name, tensor


# OPT's names -> ours (after `model.decoder.` or `decoder.` is taken off)
_OPT_RENAMES = (
    (re.compile(r"^final_layer_norm\."), "norm."),
    (re.compile(r"^layers\.(\d+)\.self_attn_layer_norm\."), r"layers.\1.input_layernorm."),
    (re.compile(r"^layers\.(\d+)\.final_layer_norm\."), r"layers.\1.post_attention_layernorm."),
    (re.compile(r"^layers\.(\d+)\.self_attn\.out_proj\."), r"layers.\1.self_attn.o_proj."),
    (re.compile(r"^layers\.(\d+)\.fc1\."), r"layers.\1.mlp.up_proj."),
    (re.compile(r"^layers\.(\d+)\.fc2\."), r"layers.\1.mlp.down_proj."),
)


class OPTForCausalLM(LearnedPositionsForCausalLM):
    """OPT (see the module docstring); OPTConfig's defaults where config.json leaves a key out."""

    position_offset = OPT_POSITION_OFFSET

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        hidden = cfg["hidden_size"]
        for key, supported, value in (
            ("do_layer_norm_before", True, cfg.get("do_layer_norm_before", True)),
            ("word_embed_proj_dim", hidden, cfg.get("word_embed_proj_dim") or hidden),
            ("layer_norm_elementwise_affine", True, cfg.get("layer_norm_elementwise_affine", True)),
            ("_remove_final_layer_norm", False, cfg.get("_remove_final_layer_norm", False)),
        ):
            if value != supported:
                raise ValueError(
                    f"model: config.json's {key} {value!r} is not supported for OPTForCausalLM ({supported!r} is)"
                )
        super().__init__(cfg, max_position, backend)

    @staticmethod
    def biased(cfg: dict[str, Any]) -> bool:
        return bool(cfg.get("enable_bias", True))

    def renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = name.removeprefix("model.").removeprefix("decoder.")
            for pattern, replacement in _OPT_RENAMES:
                name = pattern.sub(replacement, name)
            yield name, tensor


# BioGPT's names -> OPT's (then `_OPT_RENAMES`'), after `biogpt.` is taken off
_BIOGPT_RENAMES = (
    (re.compile(r"^layer_norm\."), "final_layer_norm."),
    (re.compile(r"^output_projection\."), "lm_head."),
)


class BioGptForCausalLM(OPTForCausalLM):
    """BioGPT (see the module docstring); BioGptConfig's defaults where config.json leaves a key out."""

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        cfg = {
            **cfg,
            "layer_norm_eps": 1e-5,  # (nn.LayerNorm's default: transformers' BioGPT builds its norms so)
            "hidden_act": cfg.get("hidden_act", "gelu"),
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
        }
        super().__init__(cfg, max_position, backend)
        self.embed_scale = math.sqrt(cfg["hidden_size"]) if cfg.get("scale_embedding", True) else 1.0

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale + F.embedding(
            positions + self.position_offset, self.embed_positions
        )

    def renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        def as_opt(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("biogpt.")
                for pattern, replacement in _BIOGPT_RENAMES:
                    name = pattern.sub(replacement, name)
                yield name, tensor

        return super().renamed(as_opt(weights))
