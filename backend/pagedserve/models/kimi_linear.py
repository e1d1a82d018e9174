"""Moonshot's Kimi Linear (`KimiLinearForCausalLM`, Kimi-Linear-48B-A3B): a hybrid of Kimi Delta
Attention (`layers.kimi_delta`: the gated delta rule with a decay a key channel, a state per request)
and DeepSeek's multi-head latent attention without rotary (`mla_use_nope`: q_pe and k_pe attended as
they are; no layer turns anything, the positions reach the model through KDA's states), by
`layer_types` as `config.kimi_linear_config` reads them (three KDA layers to one MLA in its
checkpoints); Llama's RMSNorms; past the first dense MLP, DeepSeek-V3's experts
(`models.moe.grouped_sigmoid_experts`, KimiLinearConfig's defaults) beside a shared expert.

The Hub's checkpoints keep both mixers under `self_attn`, the convolution as three tensors
(`q_conv1d`, `k_conv1d`, `v_conv1d`: transformers holds them as one `conv1d`), the forget gate's
`f_a_proj`, `f_b_proj`, `dt_bias` and `A_log` beside (transformers: under `forget_gate`), the experts
as Mixtral's (`block_sparse_moe.experts.N.w1`...); both layouts load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedserve.layers.attention import Attention, AttentionBackend
from pagedserve.layers.gated_delta import GatedDeltaDims
from pagedserve.layers.kimi_delta import KDA_CHUNK, KimiDeltaAttention
from pagedserve.layers.moe import Experts
from pagedserve.layers.recurrent import RecurrentLayer
from pagedserve.models.deepseek import DeepseekV3ForCausalLM, MLAAttention
from pagedserve.models.hybrid import HybridDecoderLayer, attention_of
from pagedserve.models.llama import rms_norm_eps
from pagedserve.models.moe import grouped_sigmoid_experts, sparse_by_kind


class NoPELatentAttention(MLAAttention):
    turns_pe = False


def kimi_delta_dims(cfg: dict[str, Any]) -> GatedDeltaDims:
    """KDA's sizes (`config.kimi_linear_config` has read them into `linear_*`)."""
    heads, head_dim = int(cfg["linear_num_heads"]), int(cfg["linear_head_dim"])
    return GatedDeltaDims(
        hidden_size=cfg["hidden_size"],
        num_k_heads=heads,
        num_v_heads=heads,
        head_k_dim=head_dim,
        head_v_dim=head_dim,
        conv_width=int(cfg["linear_conv_kernel_dim"]),
        norm_eps=rms_norm_eps(cfg),
        chunk_size=KDA_CHUNK,
    )


class KimiLinearDecoderLayer(HybridDecoderLayer):
    attention_class = NoPELatentAttention

    def recurrent_mixer(self, cfg: dict[str, Any], layer_index: int) -> RecurrentLayer:
        return KimiDeltaAttention(kimi_delta_dims(cfg))


# KimiLinearConfig's experts where config.json leaves a key out (under DeepSeek-V3's names)
KIMI_LINEAR_EXPERTS = {
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1024,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.446,
    "norm_topk_prob": True,
}
# KDA's projections into its one input matmul (`DeltaRuleLayer.in_proj`)
_IN_PROJ_PARTS = ("q", "k", "v", "b", "f_a", "g_a")


class KimiLinearForCausalLM(DeepseekV3ForCausalLM):
    decoder_layer_class = KimiLinearDecoderLayer
    stacked_params = {
        **DeepseekV3ForCausalLM.stacked_params,
        **{f"in_proj_{part}": ("in_proj", part) for part in _IN_PROJ_PARTS},
    }

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        super().__init__({"rms_norm_eps": 1e-5, **cfg}, max_position, backend)
        self.linear_layers = {i for i, kind in enumerate(cfg["layer_types"]) if kind == "linear_attention"}

    @staticmethod
    def interleaved(cfg: dict[str, Any]) -> bool:
        return False  # (nothing turns)

    @property
    def attention_layers(self) -> list[Attention]:
        return attention_of(self.layers)

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        spec = grouped_sigmoid_experts(cfg, KIMI_LINEAR_EXPERTS)
        return [
            spec if sparse else None for sparse in sparse_by_kind(cfg, [False] * cfg["num_hidden_layers"])
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._kda_names(weights))

    def _kda_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """KDA's tensors under our names (`mixer.*`, its input projections `in_proj_*`), the Hub's
        three convolution tensors of a layer as transformers' one (in order q, k, v), its shared
        experts under `mlp`."""
        convs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            # (the Hub's shared experts under the MLP, where DeepSeek's names are read)
            name = name.replace(".block_sparse_moe.shared_experts.", ".mlp.shared_experts.")
            layer = _LAYER.match(name)
            if layer is None or int(layer[1]) not in self.linear_layers or ".self_attn." not in name:
                yield name, tensor
                continue
            name = name.replace(".self_attn.forget_gate.", ".self_attn.").replace(".self_attn.", ".mixer.")
            conv = _CONV.search(name)
            if conv is not None:
                parts = convs.setdefault(name[: conv.start()], {})
                parts[conv[1]] = tensor
                if len(parts) == 3:
                    yield name[: conv.start()] + ".mixer.conv_weight", torch.cat([parts[p] for p in "qkv"])
                continue
            for part in _IN_PROJ_PARTS:
                name = name.replace(f".mixer.{part}_proj.", f".mixer.in_proj_{part}.")
            prefix, rest = name.rsplit(".mixer.", 1)
            yield f"{prefix}.mixer.{_OURS.get(rest, rest)}", tensor
        for layer_name, parts in convs.items():
            if len(parts) != 3:
                raise ValueError(
                    f"checkpoint's {layer_name} has {sorted(parts)} of q_conv1d, k_conv1d and v_conv1d"
                )


_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
_CONV = re.compile(r"\.mixer\.([qkv])_conv1d\.weight$")
# KDA's checkpoint names (past `mixer.`) -> ours
_OURS = {"conv1d.weight": "conv_weight", "o_norm.weight": "norm_weight", "o_proj.weight": "out_proj.weight"}
