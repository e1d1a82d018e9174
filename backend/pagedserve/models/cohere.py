"""Cohere's Command R and R+ (`CohereForCausalLM`), Command R7B and Command A (`Cohere2ForCausalLM`),
Command A Plus (`Cohere2MoeForCausalLM`: experts, see its docstring) as transformers computes them, on the Llama family's tensor-parallel layers. What they add to Llama's
layer:

- attention and the MLP side by side: both read the same normed input, and both outputs join the
  residual stream at once (`ParallelDecoderLayer`);
- LayerNorm without a bias (the mean taken out, then scaled by the variance), in float32, where Llama
  takes RMSNorm (`LayerNorm`);
- GPT-J's rotary (neighbouring dimensions turned together: `interleaved_rotary`, q and k rows
  reordered on load), computed in float32, and only in the sliding layers (three of every four by
  default, a window of 4,096): the global layers turn by no position (NoPE);
- the logits multiplied by `logit_scale` (1/16 by default); the LM head tied by default.

Command R and R+ turn q and k in every layer and have no window; where `use_qk_norm` (R+), each query
and key head is LayerNormed over its head_dim by a weight of its own, in float32 (`HeadLayerNorm`),
before the rotation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.config import default_layer_types
from pagedserve.distributed import get_tp_rank, get_tp_size
from pagedserve.layers import ops
from pagedserve.layers.attention import AttentionBackend, AttentionMetadata
from pagedserve.layers.moe import Experts, SparseMoeBlock
from pagedserve.layers.norm import LayerNorm, RMSNorm
from pagedserve.models.llama import (
    LayerOptions,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    Rotary,
    check_silu,
    residual_stream,
)
from pagedserve.models.moe import per_expert_weights


def layer_norm_eps(cfg: dict[str, Any]) -> float:
    return float(cfg.get("layer_norm_eps", 1e-5))


class ParallelDecoderLayer(LlamaDecoderLayer):
    """Llama's layer protocol (it takes the residual stream as `hidden + residual` and returns its own
    pair) with attention and the MLP reading the same input, normed, their outputs added together:
    normed once for both (Cohere's, StableLM's, Phi-2's), or each by a norm of its own where
    `mlp_norm_of_its_own` (`mlp_layernorm`: GPT-NeoX's checkpoints call it post_attention_layernorm)."""

    mlp_norm_of_its_own = False

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        nn.Module.__init__(self)  # (not Llama's norms)
        self.self_attn = self.attention_class(cfg, backend, options, layer_index)
        self.mlp = (
            self.dense_mlp(cfg) if options.experts is None else self.experts_block(cfg, options.experts)
        )
        self.input_layernorm = self.norm(cfg)
        self.mlp_layernorm = self.norm(cfg) if self.mlp_norm_of_its_own else None

    def experts_block(self, cfg: dict[str, Any], spec: Experts) -> nn.Module:
        """The MLP of a layer with experts (Command A Plus's)."""
        return SparseMoeBlock(cfg["hidden_size"], spec)

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        """Cohere's LayerNorm: no bias (StableLM's parallel layers have one)."""
        return LayerNorm(cfg["hidden_size"], layer_norm_eps(cfg), bias=False)

    def forward(
        self,
        rotary: Rotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = residual_stream(hidden, residual)
        normed = cast(torch.Tensor, self.input_layernorm(stream))
        mlp_normed = normed if self.mlp_layernorm is None else self.mlp_layernorm(stream)
        return self.self_attn(rotary, normed, metadata) + self.mlp(mlp_normed), stream


class HeadLayerNorm(RMSNorm):
    """Command R+'s q or k norm: each head LayerNormed over its head_dim (no bias), in float32, times a
    weight of its own (the checkpoint's [heads, head_dim]), rounded to x's dtype once. This rank holds
    its heads' rows (a KV head replicated on `replicas` ranks: its row on each)."""

    def __init__(self, num_heads: int, head_dim: int, replicas: int, eps: float) -> None:
        super().__init__(head_dim, eps)
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim), requires_grad=False)
        self.replicas = replicas
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        heads, shards = param.shape[0], get_tp_size() // self.replicas
        if loaded.shape != (heads * shards, param.shape[1]):
            raise ValueError(
                f"checkpoint's q or k norm has shape {tuple(loaded.shape)}; config.json's heads make "
                f"{(heads * shards, param.shape[1])}"
            )
        param.data.copy_(loaded.narrow(0, get_tp_rank() // self.replicas * heads, heads))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, heads, head_dim] (no residual: a head norm joins no stream)."""
        assert residual is None
        normed = F.layer_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class CohereAttention(LlamaAttention):
    """Llama's attention with Command R+'s head norms (`use_qk_norm`) before the rotation."""

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        super().__init__(cfg, backend, options, layer_index)
        if cfg.get("use_qk_norm"):
            eps, replicas = layer_norm_eps(cfg), self.qkv_proj.num_kv_head_replicas
            self.q_norm = HeadLayerNorm(self.num_heads, self.head_dim, 1, eps)
            self.k_norm = HeadLayerNorm(self.num_kv_heads, self.head_dim, replicas, eps)

    def rotated_qkv(
        self, rotary: Rotary, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.qkv_proj(hidden)
        q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = cast(torch.Tensor, self.q_norm(q)), cast(torch.Tensor, self.k_norm(k))
        qk = torch.cat((q, k), dim=1)
        if self.rotary:
            qk = ops.apply_rotary(qk, *rotary)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, qkv[:, self.q_size + self.kv_size :]


class CohereDecoderLayer(ParallelDecoderLayer):
    attention_class = CohereAttention


class CohereForCausalLM(LlamaForCausalLM):
    """Command R and R+ (see the module docstring): q and k turned in every layer, no window;
    CohereConfig's defaults where config.json leaves a key out."""

    decoder_layer_class: type[LlamaDecoderLayer] = CohereDecoderLayer
    interleaved_rotary = True

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        super().__init__(
            {**cfg, "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}, max_position, backend
        )
        self.logit_scale = float(cfg.get("logit_scale", 0.0625))
        if not self.logit_scale > 0:  # (a greedy step takes the argmax before the logits are scaled)
            raise ValueError(f"model: config.json's logit_scale must be positive, got {self.logit_scale}")

    def step_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        """The tables rounded to the model's dtype, then applied in float32, as transformers' Cohere
        and Cohere2 turn q and k."""
        return tuple(table.float() for table in self.rotary_emb(positions, dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden) * self.logit_scale

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The head norms' weights reordered in each head as q's and k's rows are (`checkpoint_rows`)."""
        super().load_weights(
            (name, self.checkpoint_rows("q_proj", tensor.flatten()).view_as(tensor))
            if name.endswith((".self_attn.q_norm.weight", ".self_attn.k_norm.weight"))
            else (name, tensor)
            for name, tensor in weights
        )


class Cohere2ForCausalLM(CohereForCausalLM):
    """Command R7B and Command A (see the module docstring): Command R's layer without head norms, the
    global layers NoPE; Cohere2Config's defaults where config.json leaves a key out."""

    decoder_layer_class = ParallelDecoderLayer

    @staticmethod
    def rotary_layers(cfg: dict[str, Any]) -> list[bool]:
        """The sliding layers turn q and k; the global ones do not (where the model has a window)."""
        if not cfg.get("sliding_window"):
            return [True] * cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types") or default_layer_types(cfg, "Cohere2ForCausalLM")
        return [kind == "sliding_attention" for kind in layer_types]


class AveragedSharedMoeBlock(SparseMoeBlock):
    """Command A Plus's experts where `shared_expert_combination_strategy` is "average": the routed
    experts' sum and the shared expert's output averaged (halved) rather than added."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5


class Cohere2MoeDecoderLayer(ParallelDecoderLayer):
    """Command R7B's parallel layer (one norm before attention and the MLP side by side: RMSNorm where
    config.json names `rms_norm_eps`, else Cohere's LayerNorm) whose MLP is the dense prefix's SwiGLU of
    `prefix_dense_intermediate_size` or experts."""

    def experts_block(self, cfg: dict[str, Any], spec: Experts) -> nn.Module:
        average = cfg.get("shared_expert_combination_strategy", "average") == "average"
        block = AveragedSharedMoeBlock if average and spec.shared_intermediate_size else SparseMoeBlock
        return block(cfg["hidden_size"], spec)

    def dense_mlp(self, cfg: dict[str, Any]) -> nn.Module:
        width = cfg.get("prefix_dense_intermediate_size") or cfg["intermediate_size"]
        return LlamaMLP({**cfg, "intermediate_size": width})

    @staticmethod
    def norm(cfg: dict[str, Any]) -> RMSNorm:
        if cfg.get("rms_norm_eps") is not None:
            return RMSNorm(cfg["hidden_size"], float(cfg["rms_norm_eps"]))
        return LayerNorm(cfg["hidden_size"], layer_norm_eps(cfg), bias=False)


class Cohere2MoeForCausalLM(Cohere2ForCausalLM):
    """Cohere's Command A Plus (`Cohere2MoeForCausalLM`): Command R7B's layers (GPT-J's rotary in the
    sliding layers, and in the dense prefix's where `prefix_dense_sliding_window_pattern` is 1) whose
    MLPs are, after the dense prefix (`mlp_layer_types`, or `first_k_dense_replace`), `num_experts`
    experts of `intermediate_size`, `num_experts_per_tok` a token, by the softmax of the picked logits
    (or their sigmoids, renormalized where `norm_topk_prob`), beside a shared expert of
    `num_shared_experts` experts' width added or averaged (`shared_expert_combination_strategy`);
    Cohere2MoeConfig's defaults where config.json leaves a key out."""

    decoder_layer_class = Cohere2MoeDecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        strategy = cfg.get("shared_expert_combination_strategy", "average")
        selection = cfg.get("expert_selection_fn", "softmax")
        if strategy not in ("sum", "average") or selection not in ("softmax", "sigmoid"):
            raise ValueError(
                f"model: config.json's shared_expert_combination_strategy {strategy!r} (sum or average) or "
                f"expert_selection_fn {selection!r} (softmax or sigmoid) is not supported"
            )
        super().__init__(cohere2_moe_config(cfg), max_position, backend)

    @staticmethod
    def rotary_layers(cfg: dict[str, Any]) -> list[bool]:
        """The sliding layers turn q and k, and the dense prefix's where its window pattern is 1."""
        force = cfg.get("prefix_dense_sliding_window_pattern", 1) == 1
        return [
            kind == "sliding_attention" or (force and mlp == "dense")
            for kind, mlp in zip(cfg["layer_types"], cfg["mlp_layer_types"], strict=True)
        ]

    def layer_options(self, cfg: dict[str, Any]) -> list[LayerOptions]:
        check_silu(cfg)
        selection = cfg.get("expert_selection_fn", "softmax")
        width = int(cfg["intermediate_size"])
        spec = Experts(
            num_experts=int(cfg.get("num_experts", 8)),
            top_k=int(cfg.get("num_experts_per_tok", 2)),
            intermediate_size=width,
            renormalize=selection == "softmax" or bool(cfg.get("norm_topk_prob", True)),
            shared_intermediate_size=width * int(cfg.get("num_shared_experts", 0)),
            shared_gate=False,
            scoring=selection,
        )
        return [
            dataclasses.replace(options, experts=spec if mlp == "sparse" else None)
            for options, mlp in zip(super().layer_options(cfg), cfg["mlp_layer_types"], strict=True)
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        renamed = (
            (name.replace(".mlp.shared_experts.", ".mlp.shared_expert."), tensor) for name, tensor in weights
        )
        super().load_weights(per_expert_weights(renamed, hidden_size=self.embed_tokens.weight.shape[1]))


def cohere2_moe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Command A Plus's layer kinds as Cohere2MoeConfig derives them where config.json names none: the
    first `first_k_dense_replace` layers dense, sliding but each `prefix_dense_sliding_window_pattern`-th
    (1: none sliding), the others experts, sliding but each `sliding_window_pattern`-th (4)."""
    num_layers, dense = cfg["num_hidden_layers"], int(cfg.get("first_k_dense_replace", 0))
    prefix, pattern = (
        int(cfg.get("prefix_dense_sliding_window_pattern", 1)),
        int(cfg.get("sliding_window_pattern", 4)),
    )
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % prefix else "full_attention" for i in range(dense)
    ] + ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers - dense)]
    mlp_types = cfg.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(num_layers)]
    return {**cfg, "layer_types": layer_types, "mlp_layer_types": mlp_types}
