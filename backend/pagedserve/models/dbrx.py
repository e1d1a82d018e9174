"""Databricks' DBRX (`DbrxForCausalLM`: DBRX Base and Instruct, 132B) on the Llama family's layers, as
transformers computes it: Llama's layer with LayerNorms of no bias, q, k and v in one tensor (`Wqkv`)
clamped to +-`clip_qkv`, grouped KV heads (`kv_n_heads`), and every MLP experts whose tensors hold
all experts' rows (`w1` gates, `v1` ups, `w2` downs, each [experts x intermediate, hidden]), routed by
a softmax over all experts, the top k's weights divided by their L1 norm. Its nested config
(`attn_config`, `ffn_config`) is read under Llama's names by `config.dbrx_config`."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedserve.layers.attention import AttentionBackend
from pagedserve.layers.moe import Experts
from pagedserve.layers.norm import LayerNorm, RMSNorm
from pagedserve.models.llama import LlamaDecoderLayer, rms_norm_eps
from pagedserve.models.moe import MoeForCausalLM
from pagedserve.models.olmo import Olmo1Attention


class DbrxDecoderLayer(LlamaDecoderLayer):
    """DBRX's layer: Llama's, its norms LayerNorms of no bias, q, k and v clamped to +-`clip_qkv`."""

    attention_class = Olmo1Attention

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        return LayerNorm(cfg["hidden_size"], rms_norm_eps(cfg), bias=False)


# DBRX's checkpoint names -> Llama's (its fused Wqkv and the experts' stacked rows cut in `_dbrx_names`)
_DBRX_NAMES = [
    (re.compile(r"^transformer\.wte\."), "model.embed_tokens."),
    (re.compile(r"^transformer\.norm_f\."), "model.norm."),
    (re.compile(r"^transformer\.blocks\."), "model.layers."),
    (re.compile(r"\.norm_attn_norm\.norm_1\."), ".input_layernorm."),
    (re.compile(r"\.norm_attn_norm\.norm_2\."), ".post_attention_layernorm."),
    (re.compile(r"\.norm_attn_norm\.attn\.out_proj\."), ".self_attn.o_proj."),
    (re.compile(r"\.norm_attn_norm\.attn\.Wqkv\."), ".self_attn.Wqkv."),
    (re.compile(r"\.ffn\.router\.layer\."), ".mlp.gate."),
    (re.compile(r"\.ffn\.experts\.mlp\."), ".mlp.experts."),
]
_DBRX_EXPERTS = re.compile(r"\.mlp\.experts\.(w1|v1|w2)$")


class DbrxForCausalLM(MoeForCausalLM):
    """DBRX (see the module docstring); DbrxConfig's defaults where config.json leaves a key out (its
    names read by `config.dbrx_config`): every MLP `moe_num_experts` SwiGLU experts, the top
    `moe_top_k` by the router's softmax, their weights divided by their L1 norm
    (`moe_normalize_expert_weights` 1) or left as they are (null); another norm, or another
    activation, is refused by name."""

    decoder_layer_class = DbrxDecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        super().__init__(cfg, max_position, backend)
        self.num_local_experts = cfg["num_local_experts"]
        heads = cfg["num_attention_heads"]
        self.heads = heads, cfg["num_key_value_heads"], cfg["hidden_size"] // heads

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        norm = cfg.get("moe_normalize_expert_weights", 1.0)
        if norm not in (1, 1.0, None):
            raise ValueError(
                f"model: config.json's moe_normalize_expert_weights {norm!r} is not supported (1 or null)"
            )
        spec = Experts(
            num_experts=cfg["num_local_experts"],
            top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["intermediate_size"],
            renormalize=norm is not None,
        )
        return [spec] * cfg["num_hidden_layers"]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._dbrx_names(weights))

    def _dbrx_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """DBRX's tensors under the hub's Qwen names: `Wqkv` [q | k | v, hidden] cut into q_proj, k_proj
        and v_proj; each of `w1` (gates), `v1` (ups) and `w2` (downs, intermediate by hidden) cut into
        its experts' [intermediate, hidden] rows."""
        heads, kv_heads, head_dim = self.heads
        for name, tensor in weights:
            for pattern, replacement in _DBRX_NAMES:
                name = pattern.sub(replacement, name)
            if ".self_attn.Wqkv." in name:
                sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
                if tensor.shape[0] != sum(sizes):
                    raise ValueError(
                        f"checkpoint's {name!r} has {tensor.shape[0]} rows; config.json's heads make {sum(sizes)}"
                    )
                for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split(sizes), strict=True):
                    yield name.replace(".self_attn.Wqkv.", f".self_attn.{part}."), rows
                continue
            experts = _DBRX_EXPERTS.search(name)
            if experts is None:
                yield name, tensor
                continue
            prefix, kind = name[: experts.start()] + ".mlp.experts", experts[1]
            per_expert = tensor.unflatten(0, (self.num_local_experts, -1))  # [experts, intermediate, hidden]
            for number, rows in enumerate(per_expert.unbind(0)):
                if kind == "w2":
                    yield f"{prefix}.{number}.down_proj.weight", rows.t()
                else:
                    yield f"{prefix}.{number}.{'gate_proj' if kind == 'w1' else 'up_proj'}.weight", rows
