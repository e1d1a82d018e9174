"""EleutherAI's GPT-NeoX lineage on the Llama family's layers, as transformers computes them:

- GPT-NeoX (Pythia, GPT-NeoX-20B, and the checkpoints on its architecture): LayerNorms with a bias,
  attention and the ungated GELU MLP side by side, each on a norm of its own (`use_parallel_residual`,
  on by default; else one after the other), q, k and v in one checkpoint tensor a head at a time
  (`query_key_value`), every projection biased, the rope over the first `rotary_pct` of each head
  (0.25) at `rotary_emb_base`;
- TII's Falcon (Falcon-7B, 40B, 180B, Falcon 2 11B): GPT-NeoX's layers (side by side on one norm
  where `parallel_attn`, on two under `new_decoder_architecture`, else one after the other),
  projections biased by `bias` (off by default), q, k and v in one tensor laid out three ways (each
  KV group's queries, key and value under the new architecture; every query then the one key and value
  under `multi_query`; else a head at a time), NeoX's rotary over the whole head, exact GELU;
- Stability AI's StableLM (StableLM 2, StableLM-3B-4E1T, Stable Code): LayerNorms with a bias where
  Llama has RMSNorms, the rope over the first `partial_rotary_factor` of each head (0.25 by default),
  q, k and v biased by `use_qkv_bias`, Llama's SwiGLU; attention and the MLP side by side on one norm
  where `use_parallel_residual`, and each query and key head LayerNormed by a weight of its own before
  the rotation where `qk_layernorm` (StableLM 2 12B's both: Command R+'s head norms)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.config import rope_parameters
from pagedserve.layers.attention import AttentionBackend
from pagedserve.layers.norm import LayerNorm, RMSNorm
from pagedserve.models.cohere import CohereAttention, ParallelDecoderLayer
from pagedserve.models.llama import (
    Biases,
    LayerOptions,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    rms_norm_eps,
)
from pagedserve.models.ungated import LayerNormDecoderLayer, UngatedForCausalLM, UngatedMLP


def layer_norm(cfg: dict[str, Any]) -> LayerNorm:
    return LayerNorm(cfg["hidden_size"], float(cfg.get("layer_norm_eps", 1e-5)))


class StableLmDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with LayerNorms (a bias each)."""

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return layer_norm(cfg)


class StableLmParallelDecoderLayer(ParallelDecoderLayer):
    """StableLM 2 12B's: attention and the MLP side by side on one LayerNorm (with its bias)."""

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return layer_norm(cfg)


class StableLmHeadNormDecoderLayer(StableLmDecoderLayer):
    """StableLM's layer with its q and k head norms (`qk_layernorm`)."""

    attention_class = CohereAttention


class StableLmParallelHeadNormDecoderLayer(StableLmParallelDecoderLayer):
    """StableLM 2 12B's: attention (its q and k head norms) and the MLP side by side on one LayerNorm."""

    attention_class = CohereAttention


class StableLmForCausalLM(LlamaForCausalLM):
    """StableLM (see the module docstring); StableLmConfig's defaults where config.json leaves a key
    out. Its head norms load from a tensor a head (`q_layernorm.norms.N`: `_stacked_head_norms`)."""

    rotates_part_of_a_head = True
    default_partial_rotary = 0.25  # StableLmConfig's
    decoder_layer_class: type[LlamaDecoderLayer] = StableLmDecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        # (this model's layers, before they are built)
        parallel, head_norms = bool(cfg.get("use_parallel_residual")), bool(cfg.get("qk_layernorm"))
        self.decoder_layer_class = {
            (False, False): StableLmDecoderLayer,
            (True, False): StableLmParallelDecoderLayer,
            (False, True): StableLmHeadNormDecoderLayer,
            (True, True): StableLmParallelHeadNormDecoderLayer,
        }[parallel, head_norms]
        super().__init__({**cfg, "use_qk_norm": head_norms}, max_position, backend)
        heads = cfg["num_attention_heads"]
        self.num_heads = {"q_layernorm": heads, "k_layernorm": cfg.get("num_key_value_heads") or heads}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._stacked_head_norms(weights))

    def _stacked_head_norms(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's head norms, a LayerNorm a head (`self_attn.q_layernorm.norms.N.weight`),
        as one [heads, head_dim] weight a layer (`self_attn.q_norm.weight`), once all its heads came."""
        pending: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in weights:
            match = _HEAD_NORM.search(name)
            if match is None:
                yield name, tensor
                continue
            target = f"{name[: match.start()]}.self_attn.{match[1][0]}_norm.weight"
            heads = pending.setdefault(target, {})
            heads[int(match[2])] = tensor
            if len(heads) == self.num_heads[match[1]]:
                yield target, torch.stack([heads[h] for h in range(len(heads))])
                del pending[target]
        if pending:
            target, heads = next(iter(pending.items()))
            raise ValueError(f"checkpoint's head norms for {target!r} stop at {len(heads)} heads")

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        return bool(cfg.get("use_qkv_bias", False)), False


# StableLM's head norm of head N (`StableLmLayerNormPerHead`)
_HEAD_NORM = re.compile(r"\.self_attn\.(q_layernorm|k_layernorm)\.norms\.(\d+)\.weight$")


class GPTNeoXParallelDecoderLayer(ParallelDecoderLayer):
    """GPT-NeoX's layer: attention on `input_layernorm`'s output and the ungated MLP on
    `mlp_layernorm`'s (the checkpoint's post_attention_layernorm), both of the same input, both
    outputs added to it at once."""

    mlp_norm_of_its_own = True

    def dense_mlp(self, cfg: dict[str, Any]) -> nn.Module:
        return UngatedMLP(cfg)

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return layer_norm(cfg)


# GPT-NeoX's checkpoint names -> Llama's (the fused query_key_value is cut in `_gpt_neox_names`)
_GPT_NEOX_NAMES = [
    (re.compile(r"^gpt_neox\.embed_in\."), "model.embed_tokens."),
    (re.compile(r"^gpt_neox\.final_layer_norm\."), "model.norm."),
    (re.compile(r"^embed_out\."), "lm_head."),
    (re.compile(r"^gpt_neox\.layers\."), "model.layers."),
    (re.compile(r"\.attention\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.mlp\.dense_h_to_4h\."), ".mlp.up_proj."),
    (re.compile(r"\.mlp\.dense_4h_to_h\."), ".mlp.down_proj."),
]
# the parallel layer's second norm, before the MLP (`ParallelDecoderLayer.mlp_layernorm`)
_MLP_NORM = (re.compile(r"\.post_attention_layernorm\."), ".mlp_layernorm.")


class GPTNeoXForCausalLM(UngatedForCausalLM):
    """GPT-NeoX (see the module docstring); GPTNeoXConfig's defaults where config.json leaves a key
    out."""

    rotates_part_of_a_head = True

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        eps = float(cfg.get("layer_norm_eps", 1e-5))
        if cfg.get("use_parallel_residual", True):  # (this model's layers, before they are built)
            self.decoder_layer_class = GPTNeoXParallelDecoderLayer
        else:
            self.decoder_layer_class = LayerNormDecoderLayer
        cfg = {
            **cfg,
            "rms_norm_eps": eps,
            "mlp_bias": True,
            "hidden_act": cfg.get("hidden_act", "gelu"),
            "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
        }
        super().__init__(cfg, max_position, backend)
        self.head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        bias = bool(cfg.get("attention_bias", True))
        return bias, bias

    @staticmethod
    def rope_config(cfg: dict[str, Any]) -> dict[str, Any]:
        """GPT-NeoX's own names for the rope: `rotary_pct` (0.25) of each head turned, at
        `rotary_emb_base` (10,000), where config.json gives neither in Llama's names."""
        rope = rope_parameters(cfg)
        cfg = {**cfg, "partial_rotary_factor": rope.get("partial_rotary_factor", cfg.get("rotary_pct", 0.25))}
        if "rope_theta" not in cfg and not (cfg.get("rope_parameters") or {}).get("rope_theta"):
            cfg["rope_theta"] = cfg.get("rotary_emb_base", 10000.0)
        return cfg

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._as_llama(weights))

    def _as_llama(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under Llama's names; `query_key_value` [heads x (q | k | v), ...]
        cut into q_proj, k_proj and v_proj; the attention's mask buffers (older checkpoints') left out."""
        for name, tensor in weights:
            if name.endswith((".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")):
                continue
            for pattern, replacement in _GPT_NEOX_NAMES:
                name = pattern.sub(replacement, name)
            if self.decoder_layer_class is GPTNeoXParallelDecoderLayer:
                name = _MLP_NORM[0].sub(_MLP_NORM[1], name)
            if ".attention.query_key_value." not in name:
                yield name, tensor
                continue
            yield from per_head_qkv(name, ".attention.query_key_value.", tensor, self.head_dim)


def per_head_qkv(
    name: str, fused: str, tensor: torch.Tensor, head_dim: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """A fused q/k/v tensor (or bias) laid out a head at a time, [heads x (q | k | v), ...] (GPT-NeoX's,
    Persimmon's `query_key_value`, named `fused` in `name`), as q_proj, k_proj and v_proj."""
    if tensor.shape[0] % (3 * head_dim):
        raise ValueError(f"checkpoint's {name!r} has {tensor.shape[0]} rows, no whole number of heads")
    parts = tensor.unflatten(0, (-1, 3, head_dim)).unbind(1)  # each [heads, head_dim, ...]
    for part, rows in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
        yield name.replace(fused, f".self_attn.{part}."), rows.flatten(0, 1)


class FalconParallelDecoderLayer(GPTNeoXParallelDecoderLayer):
    """Falcon-7B's layer: attention and the ungated MLP side by side on one LayerNorm."""

    mlp_norm_of_its_own = False


# Falcon's checkpoint names -> Llama's (the fused query_key_value is cut in `_as_llama`)
_FALCON_NAMES = [
    (re.compile(r"^transformer\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"^transformer\.ln_f\."), "model.norm."),
    (re.compile(r"^transformer\.h\."), "model.layers."),
    (re.compile(r"\.self_attention\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.mlp\.dense_h_to_4h\."), ".mlp.up_proj."),
    (re.compile(r"\.mlp\.dense_4h_to_h\."), ".mlp.down_proj."),
    (re.compile(r"\.ln_attn\."), ".input_layernorm."),
    (re.compile(r"\.ln_mlp\."), ".mlp_layernorm."),
]


class FalconForCausalLM(UngatedForCausalLM):
    """Falcon (see the module docstring); FalconConfig's defaults where config.json leaves a key out
    (its sizes read by `config.falcon_config`). ALiBi (Falcon-RW's) is refused."""

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        if cfg.get("alibi"):
            raise ValueError("model: config.json's alibi (ALiBi positions, Falcon-RW's) is not supported")
        self.new_architecture = bool(cfg.get("new_decoder_architecture", False))
        self.multi_query = bool(cfg.get("multi_query", True))
        parallel = cfg.get("parallel_attn", True)
        norms = cfg.get("num_ln_in_parallel_attn") or (2 if self.new_architecture else 1)
        if self.new_architecture and not parallel:
            raise ValueError(
                "model: config.json's new_decoder_architecture needs parallel_attn (transformers builds none without)"
            )
        # (this model's layers, before they are built)
        if not parallel:
            self.decoder_layer_class = LayerNormDecoderLayer
        elif norms == 2:
            self.decoder_layer_class = GPTNeoXParallelDecoderLayer
        else:
            self.decoder_layer_class = FalconParallelDecoderLayer
        cfg = {
            **cfg,
            "rms_norm_eps": float(cfg.get("layer_norm_epsilon", 1e-5)),
            "mlp_bias": bool(cfg.get("bias", False)),
            "hidden_act": cfg.get("activation", "gelu"),
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
        }
        super().__init__(cfg, max_position, backend)
        self.head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        self.heads = (cfg["num_attention_heads"], cfg["num_key_value_heads"])

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        bias = bool(cfg.get("bias", False))
        return bias, bias

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._as_llama(weights))

    def _as_llama(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under Llama's names, `query_key_value` cut into q_proj, k_proj and
        v_proj by its layout (`_qkv_rows`)."""
        for name, tensor in weights:
            for pattern, replacement in _FALCON_NAMES:
                name = pattern.sub(replacement, name)
            if ".self_attention.query_key_value." not in name:
                yield name, tensor
                continue
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), self._qkv_rows(tensor), strict=True):
                yield name.replace(".self_attention.query_key_value.", f".self_attn.{part}."), rows

    def _qkv_rows(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q's, k's and v's rows of `query_key_value` (a weight's or a bias's): under the new architecture
        each KV group's queries, then its key and value; under multi_query every query, then the one
        key and value; else each head's q, k and v side by side."""
        heads, kv_heads = self.heads
        if tensor.shape[0] != (heads + 2 * kv_heads) * self.head_dim:
            raise ValueError(
                f"checkpoint's query_key_value has {tensor.shape[0]} rows; config.json's {heads} heads "
                f"and {kv_heads} KV heads of {self.head_dim} make {(heads + 2 * kv_heads) * self.head_dim}"
            )
        if self.new_architecture:
            groups = tensor.unflatten(0, (kv_heads, -1, self.head_dim))
            return groups[:, :-2].flatten(0, 2), groups[:, -2].flatten(0, 1), groups[:, -1].flatten(0, 1)
        if self.multi_query:
            return tuple(tensor.split([heads * self.head_dim, self.head_dim, self.head_dim]))
        per_head = tensor.unflatten(0, (heads, 3, self.head_dim))
        return tuple(per_head[:, part].flatten(0, 1) for part in range(3))


class PersimmonAttention(CohereAttention):
    """Command R+'s attention (its head norms before the rotation) with Persimmon's head norms: a
    LayerNorm of one weight and bias for all heads (`q_layernorm`, `k_layernorm`, where
    `qk_layernorm`: Persimmon's default)."""

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__(cfg, backend, options, layer_index)
        if cfg.get("qk_layernorm", True):
            self.q_norm = LayerNorm(self.head_dim, rms_norm_eps(cfg))
            self.k_norm = LayerNorm(self.head_dim, rms_norm_eps(cfg))


class PersimmonDecoderLayer(LayerNormDecoderLayer):
    attention_class = PersimmonAttention


class PersimmonForCausalLM(UngatedForCausalLM):
    """Adept's Persimmon-8B (and Fuyu-8B's text decoder): GPT-NeoX's sequential layer (LayerNorms with
    a bias, every projection biased, q, k and v a head at a time in `query_key_value`), each query and
    key head LayerNormed before the rotation (`PersimmonAttention`), the rope over the first
    `partial_rotary_factor` (0.5) of each head, an ungated ReLU² MLP, an untied LM head.
    PersimmonConfig's defaults where config.json leaves a key out."""

    decoder_layer_class = PersimmonDecoderLayer
    rotates_part_of_a_head = True
    default_partial_rotary = 0.5  # PersimmonConfig's

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        cfg = {
            **cfg,
            "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
            "mlp_bias": True,
            "hidden_act": cfg.get("hidden_act", "relu2"),
        }
        super().__init__(cfg, max_position, backend)
        self.head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        return True, True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._as_llama(weights))

    def _as_llama(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            for theirs, ours in _PERSIMMON_NAMES:
                name = name.replace(theirs, ours)
            if ".self_attn.query_key_value." in name:
                yield from per_head_qkv(name, ".self_attn.query_key_value.", tensor, self.head_dim)
            else:
                yield name, tensor


# Persimmon's checkpoint names -> Llama's (the fused query_key_value cut by `per_head_qkv`)
_PERSIMMON_NAMES = [
    (".self_attn.dense.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
    (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
    (".final_layernorm.", ".norm."),
]
