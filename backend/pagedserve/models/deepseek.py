"""DeepSeek's multi-head latent attention (MLA) and the models built on it: DeepSeek-V2 and V2-Lite,
DeepSeek-V3 and its descendants (Kimi K2, Moonlight: `DeepseekV3ForCausalLM`), GLM-4.7-Flash
(`Glm4MoeLiteForCausalLM`), MiniCPM3 (dense, μP's scales: `MiniCPM3ForCausalLM`). Llama's layer protocol with MLA for attention and, past the first dense
layers, DeepSeek's experts (`layers.moe`).

MLA compresses a token's keys and values into one latent vector c (`kv_lora_rank` wide, RMS-normed)
beside one rotated key part k_pe (`qk_rope_head_dim`) shared by every head; each head's unrotated
key and its value are up-projections of c (`kv_b_proj`: W_UK, W_UV). The cache holds c and k_pe
alone: one KV head of kv_lora_rank + qk_rope_head_dim (`config.kv_cache_entry`), 576 numbers a token
and layer for DeepSeek-V3, where its 128 heads' keys and values would be 40,960. Attention runs on
the latent itself, as vLLM's MLA does (the up-projections absorbed): a head's score
q_nope . (W_UK c) + q_pe . k_pe is (W_UK^T q_nope) . c + q_pe . k_pe, so each query becomes
[W_UK^T q_nope | q_pe] and attends over the cached [c | k_pe] as multi-query attention; its output,
a weighted sum of the c's, goes through W_UV to the head's value width. The paged kernels read the
values from the same entries, the k_pe part of their output dropped: one cache is bound as both
(`ModelConfig.values_in_keys`), 576 numbers a token and layer in all (each step's entries written to
it as keys, then again as values).

DeepSeek turns neighbouring dimensions of q_pe and k_pe together (GPT-J's rotary; `rope_interleave`,
on by default, and always in V2): their rows are reordered on load so that NeoX's rotation does the
same, as `LlamaForCausalLM.checkpoint_rows` does for ERNIE's and GLM-4's."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.config import mla_dims, rope_parameters
from pagedserve.distributed import get_tp_rank, get_tp_size
from pagedserve.layers import ops
from pagedserve.layers.attention import Attention, AttentionBackend, AttentionMetadata
from pagedserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedserve.layers.moe import Experts
from pagedserve.layers.norm import RMSNorm
from pagedserve.models.llama import LayerOptions, LlamaAttention, LlamaDecoderLayer, Rotary, Scales
from pagedserve.models.moe import MoeForCausalLM, deepseek_v3_names, grouped_sigmoid_experts, sparse_by_kind

# the latents' norms (q_a_layernorm, kv_a_layernorm) take RMSNorm's default eps in DeepSeek's code and
# transformers', whatever rms_norm_eps says
LATENT_NORM_EPS = 1e-6


class LatentUpProjection(nn.Module):
    """`kv_b_proj`: the latent's up-projection to each head's unrotated key part and its value, weight
    [heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank], this rank's heads (rows split across
    ranks in order, as a column-parallel layer's). Read as two batched matrices by `MLAAttention`,
    never run as a linear layer (nor packed, as `LinearBase`'s weights are)."""

    def __init__(self, kv_lora_rank: int, num_heads: int, head_rows: int) -> None:
        super().__init__()
        self.rows = num_heads * head_rows
        self.weight = nn.Parameter(torch.empty(self.rows, kv_lora_rank), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.rows * get_tp_size(), param.shape[1]):
            raise ValueError(
                f"checkpoint's kv_b_proj is {tuple(loaded.shape)}; config.json's heads and ranks make "
                f"{(self.rows * get_tp_size(), param.shape[1])}"
            )
        param.data.copy_(loaded.narrow(0, get_tp_rank() * self.rows, self.rows))


def softmax_scale(cfg: dict[str, Any]) -> float:
    """1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN's mscale(factor, mscale_all_dim)
    squared where the rope is scaled and names `mscale_all_dim` (DeepSeek's and transformers'
    `yarn_apply_mscale`: the scaling reaches the unrotated dimensions too)."""
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    rope = rope_parameters(cfg)
    all_dim = rope.get("mscale_all_dim")
    if rope["rope_type"] != "default" and all_dim and rope["factor"] > 1:
        mscale = 0.1 * all_dim * math.log(rope["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


class MLAAttention(LlamaAttention):
    """Multi-head latent attention (the module docstring), this rank's `num_heads` query heads: the
    query through a low-rank pair (`q_a_proj`, normed, `q_b_proj`) or one projection (`q_proj`,
    V2-Lite's), the latent and k_pe from `kv_a_proj_with_mqa` (whole on every rank, as is the cache),
    `attention_bias` on q_a_proj, kv_a_proj_with_mqa and o_proj. Llama's attention protocol (forward)
    and none of its projections."""

    turns_pe = True  # the rope turns q_pe and k_pe (Kimi Linear's turns nothing: `models.kimi_linear`)

    def __init__(
        self, cfg: dict[str, Any], backend: AttentionBackend, options: LayerOptions, layer_index: int
    ) -> None:
        nn.Module.__init__(self)  # (not Llama's projections)
        hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        if num_heads % get_tp_size():
            raise ValueError(
                f"tensor_parallel_size: {get_tp_size()} does not divide the {num_heads} attention heads"
            )
        self.num_heads = num_heads // get_tp_size()
        self.latent_dim, self.rope_dim = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        self.nope_dim, self.v_dim = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
        q_head_dim, bias = self.nope_dim + self.rope_dim, bool(cfg.get("attention_bias", False))
        self.q_lora_rank = cfg.get("q_lora_rank")
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, num_heads * q_head_dim)
        else:
            self.q_proj = ColumnParallelLinear(hidden, num_heads * q_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.latent_dim + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, LATENT_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(self.latent_dim, self.num_heads, self.nope_dim + self.v_dim)
        self.o_proj = RowParallelLinear(num_heads * self.v_dim, hidden, bias=bias)
        self.head_dim = self.latent_dim + self.rope_dim  # the cache entry's width
        self.attn = Attention(
            self.num_heads, 1, self.head_dim, backend, layer_index, scale=softmax_scale(cfg)
        )

    def forward(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1
        )
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.latent_dim, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        if self.turns_pe:  # q_pe's heads and the one k_pe turned together
            q_pe, k_pe = ops.apply_rotary(torch.cat((q_pe, k_pe[:, None]), dim=1), *rotary[:2]).split(
                [self.num_heads, 1], dim=1
            )
        else:
            k_pe = k_pe[:, None]
        up = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.latent_dim)
        w_uk, w_uv = up.split([self.nope_dim, self.v_dim], dim=1)  # [heads, nope | v, latent]
        # each head's query in the latent's space: [heads, tokens, nope] @ [heads, nope, latent]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat((q_latent, q_pe), dim=-1)
        entry = torch.cat((latent, k_pe[:, 0]), dim=-1)  # [tokens, latent + rope]: the cache's key and value
        out = self.attn(query, entry, entry, metadata).view(-1, self.num_heads, self.head_dim)
        # the weighted latents to each head's value: [heads, tokens, latent] @ [heads, latent, v]
        values = torch.bmm(out[..., : self.latent_dim].transpose(0, 1), w_uv.transpose(1, 2))
        return self.o_proj(values.transpose(0, 1).reshape(-1, self.num_heads * self.v_dim))


class MLADecoderLayer(LlamaDecoderLayer):
    attention_class = MLAAttention


def _rope_rows_reordered(tensor: torch.Tensor, width: int, rope_dim: int) -> torch.Tensor:
    """`tensor`'s rows in blocks of `width` (a head's, or kv_a_proj_with_mqa's one block), the last
    `rope_dim` of each reordered, evens then odds: GPT-J's pairs become NeoX's halves."""
    if tensor.shape[0] % width:
        raise ValueError(f"has {tensor.shape[0]} rows, no whole number of blocks of {width}")
    start = width - rope_dim
    order = torch.cat(
        (torch.arange(start), start + torch.arange(0, rope_dim, 2), start + torch.arange(1, rope_dim, 2))
    )
    return tensor.unflatten(0, (-1, width))[:, order].flatten(0, 1)


_ROTATED = re.compile(r"\.self_attn\.(q_proj|q_b_proj|kv_a_proj_with_mqa)\.(weight|bias)$")


class DeepseekV2ForCausalLM(MoeForCausalLM):
    """DeepSeek-V2 and V2-Lite: MLA; the first `first_k_dense_replace` MLPs dense (0 by default), then
    every `moe_layer_freq`-th (1) `n_routed_experts` experts (64) of `moe_intermediate_size` (1,407),
    `num_experts_per_tok` a token, weighted by their softmax (in float32) and scaled by
    `routed_scaling_factor` (1), picked among all (`topk_method` greedy) or among the `topk_group` best
    of `n_group` groups, a group worth its best expert (group_limited_greedy); beside an ungated shared
    expert of `n_shared_experts` experts' width (2). Weights renormalized where `norm_topk_prob`, as
    DeepSeek's code and vLLM read it (transformers' DeepseekV2 reads no norm_topk_prob; V2's
    checkpoints set it false). GPT-J's rotary, in float32 as transformers' complex rotation runs it.
    The defaults are DeepseekV2Config's."""

    decoder_layer_class: type[LlamaDecoderLayer] = MLADecoderLayer
    # (q, k and v are no Llama projections here: only the MLP's gate and up are stacked)
    stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        dims = mla_dims(cfg)
        # the rope turns qk_rope_head_dim dimensions of a head (DeepseekV2Config's head_dim)
        super().__init__({**cfg, "head_dim": dims["qk_rope_head_dim"]}, max_position, backend)
        self.rope_dim = dims["qk_rope_head_dim"]
        self.q_head_dim = dims["qk_nope_head_dim"] + self.rope_dim
        self.latent_width = dims["kv_lora_rank"] + self.rope_dim
        self.interleaved_rope = self.interleaved(cfg)

    @staticmethod
    def interleaved(cfg: dict[str, Any]) -> bool:
        """Whether the checkpoint turns neighbouring dimensions together: always, in V2."""
        return True

    def step_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        return self.rotary_emb(positions, torch.float32)

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        top_k, method = cfg.get("num_experts_per_tok"), cfg.get("topk_method") or "greedy"
        if not isinstance(top_k, int):
            raise ValueError(f"model: config.json's num_experts_per_tok must be an integer, got {top_k!r}")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"model: config.json's topk_method {method!r} is not supported for DeepseekV2ForCausalLM "
                "(greedy and group_limited_greedy are)"
            )
        grouped = method == "group_limited_greedy"
        width = int(cfg.get("moe_intermediate_size", 1407))
        spec = Experts(
            num_experts=int(cfg.get("n_routed_experts", 64)),
            top_k=top_k,
            intermediate_size=width,
            renormalize=bool(cfg.get("norm_topk_prob", False)),
            shared_intermediate_size=width * int(cfg.get("n_shared_experts", 2) or 0),
            shared_gate=False,
            num_groups=int(cfg.get("n_group") or 1) if grouped else 1,
            topk_groups=int(cfg.get("topk_group") or 1) if grouped else 1,
            group_worth_experts=1,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            router_float32=True,
        )
        return [spec if sparse else None for sparse in self.sparse_layers(cfg, first_dense=0)]

    @staticmethod
    def sparse_layers(cfg: dict[str, Any], first_dense: int) -> list[bool]:
        """DeepSeek's layers with experts: from `first_k_dense_replace` on, every `moe_layer_freq`-th
        (DeepSeek's code and vLLM; transformers reads no moe_layer_freq, 1 in every checkpoint)."""
        dense, freq = cfg.get("first_k_dense_replace", first_dense), cfg.get("moe_layer_freq", 1)
        if not (isinstance(freq, int) and freq > 0):
            raise ValueError(f"model: config.json's moe_layer_freq must be a positive integer, got {freq!r}")
        return [i >= dense and i % freq == 0 for i in range(cfg["num_hidden_layers"])]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._as_served(weights))

    def _as_served(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as this model reads them: the next-token prediction layers (past
        `num_hidden_layers`, V3's) left out, the shared experts under our name, the rows GPT-J's
        rotary turns reordered."""
        for name, tensor in deepseek_v3_names(weights, len(self.layers)):
            rotated = _ROTATED.search(name)
            if rotated is not None:
                try:
                    tensor = self.checkpoint_rows(rotated[1], tensor)
                except ValueError as exc:
                    raise ValueError(f"checkpoint's {name!r} {exc}") from None
            yield name, tensor

    def checkpoint_rows(self, projection: str, tensor: torch.Tensor) -> torch.Tensor:
        """Under GPT-J's rotary, the rows q_pe and k_pe come from reordered, as NeoX's rotation turns the
        same pairs: each head's last qk_rope_head_dim rows of q_proj / q_b_proj (a LoRA's lora_B of
        q_proj too), kv_a_proj_with_mqa's last ones."""
        if not self.interleaved_rope or projection not in ("q_proj", "q_b_proj", "kv_a_proj_with_mqa"):
            return tensor
        width = self.latent_width if projection == "kv_a_proj_with_mqa" else self.q_head_dim
        return _rope_rows_reordered(tensor, width, self.rope_dim)


DEEPSEEK_V3_EXPERTS = {
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}
GLM4_MOE_LITE_EXPERTS = {
    "n_routed_experts": 64,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1536,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.8,
    "norm_topk_prob": True,
}


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3, R1, V3.1 and the checkpoints on its architecture (Kimi K2, Moonlight): MLA, GPT-J's
    rotary where `rope_interleave` (the default) and NeoX's otherwise, its tables in the model's dtype
    (Llama's); the first `first_k_dense_replace` MLPs dense (3 by default), then DeepSeek-V3's experts
    (`models.moe.grouped_sigmoid_experts`, DeepseekV3Config's defaults). The checkpoint's next-token
    prediction layer (past `num_hidden_layers`) is not loaded."""

    @staticmethod
    def interleaved(cfg: dict[str, Any]) -> bool:
        return bool(cfg.get("rope_interleave", True))

    def step_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        return self.rotary_emb(positions, dtype)

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        spec = grouped_sigmoid_experts(cfg, DEEPSEEK_V3_EXPERTS)
        return [spec if sparse else None for sparse in self.sparse_layers(cfg, first_dense=3)]


class YoutuForCausalLM(DeepseekV3ForCausalLM):
    """Tencent's Youtu-LLM (2B): DeepSeek-V3's latent attention (GPT-J's rotary where `rope_interleave`,
    the default) with a dense SwiGLU in every layer, the LM head tied by default (YoutuConfig's)."""

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        cfg = {**cfg, "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
        super().__init__(cfg, max_position, backend)

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        return [None] * cfg["num_hidden_layers"]


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """Zhipu's GLM-4.7-Flash: DeepSeek-V3's layer (MLA, its experts with Glm4MoeLiteConfig's defaults),
    the MLPs dense or experts as `mlp_layer_types` says ("dense", "sparse"), else the first
    `first_k_dense_replace` (1) dense, as transformers' default and vLLM read it."""

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        spec = grouped_sigmoid_experts(cfg, GLM4_MOE_LITE_EXPERTS)
        sparse = sparse_by_kind(cfg, self.sparse_layers(cfg, first_dense=1))
        return [spec if is_sparse else None for is_sparse in sparse]


class MiniCPM3ForCausalLM(DeepseekV2ForCausalLM):
    """OpenBMB's MiniCPM3-4B: DeepSeek-V2's latent attention with NeoX's rotary in the model's dtype
    (Llama's tables, no reordering), a dense SwiGLU in every layer, and μP's scales (Granite's
    `Scales`): the embeddings times `scale_emb` (12), each layer's attention and MLP output times
    `scale_depth` / sqrt(layers) (1.4; where null, 1), the logits divided by hidden_size /
    `dim_model_base` (256; where null, 1). v_head_dim hidden_size / heads and the LM head tied by
    default (MiniCPM3Config's)."""

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        cfg = {
            **cfg,
            "v_head_dim": cfg.get("v_head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
        }
        super().__init__(cfg, max_position, backend)

    @staticmethod
    def interleaved(cfg: dict[str, Any]) -> bool:
        return False

    def step_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        return self.rotary_emb(positions, dtype)

    @staticmethod
    def read_scales(cfg: dict[str, Any]) -> Scales:
        depth, base = cfg.get("scale_depth", 1.4), cfg.get("dim_model_base", 256)
        num_layers = cfg["num_hidden_layers"]
        scales = Scales(
            embedding=float(cfg.get("scale_emb", 12)),
            residual=1.0 if depth is None else float(depth) / math.sqrt(num_layers),
            logits=1.0 if base is None else cfg["hidden_size"] / float(base),
        )
        if not scales.logits > 0:  # (a greedy step takes the argmax of the logits before dividing)
            raise ValueError(f"model: config.json's dim_model_base must be positive, got {base}")
        return scales

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        return [None] * cfg["num_hidden_layers"]
