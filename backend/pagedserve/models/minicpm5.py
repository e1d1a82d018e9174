"""OpenBMB's MiniCPM5-MoE (`MiniCPM5MoeForCausalLM`; its releases name it `MiniCPM5MoEForCausalLM`:
MiniCPM5-15B-A2.5B) as transformers computes it: GLM-4.5's layers and experts (`Glm4MoeForCausalLM`:
DeepSeek-V3's sigmoid routing with a picking bias, a shared expert, dense MLPs first) with Qwen3.5's
gated attention (`q_gate_proj`: each head's query and output gate side by side, the output times
sigmoid(gate) before o_proj) without its head norms, the rope over the whole head (theta 5e6 by
default); the dense layers by `mlp_layer_types`, else the first `first_k_dense_replace` (1).
MiniCPM5MoeConfig's defaults where config.json leaves a key out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pagedserve.layers.moe import Experts
from pagedserve.models.llama import Biases, LlamaDecoderLayer
from pagedserve.models.moe import Glm4MoeForCausalLM, grouped_sigmoid_experts, sparse_by_kind
from pagedserve.models.qwen3_5 import GatedAttention

# MiniCPM5MoeConfig's experts where config.json leaves a key out
MINICPM5_EXPERTS = {
    "n_routed_experts": 160,
    "num_experts_per_tok": 16,
    "moe_intermediate_size": 512,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 3.66,
    "norm_topk_prob": True,
}


class UnnormedGatedAttention(GatedAttention):
    head_norms = False


class MiniCPM5MoeDecoderLayer(LlamaDecoderLayer):
    attention_class = UnnormedGatedAttention


class MiniCPM5MoeForCausalLM(Glm4MoeForCausalLM):
    decoder_layer_class = MiniCPM5MoeDecoderLayer
    default_partial_rotary = 1.0  # (the whole head turns)
    rotates_part_of_a_head = False

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        """Llama's `attention_bias`, on all four projections (the query-and-gate one too)."""
        bias = bool(cfg.get("attention_bias", False))
        return bias, bias

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        spec = grouped_sigmoid_experts(cfg, MINICPM5_EXPERTS)
        dense = int(cfg.get("first_k_dense_replace", 1))
        sparse = sparse_by_kind(cfg, [i >= dense for i in range(cfg["num_hidden_layers"])])
        return [spec if is_sparse else None for is_sparse in sparse]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(
            (name.replace(".self_attn.q_gate_proj.", ".self_attn.q_proj."), tensor)
            for name, tensor in weights
        )
