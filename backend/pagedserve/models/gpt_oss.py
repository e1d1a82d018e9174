"""OpenAI's GPT-OSS (gpt-oss-20b, gpt-oss-120b): a Llama-family decoder whose attention biases all four
projections and joins each head's softmax with a learned sink logit (`layers.attention`), every
other layer sliding (a window of 128), and whose MLPs are experts (`layers.moe`) with biases and a
clamped SwiGLU, `num_experts_per_tok` (4) a token, weighted by the softmax of their logits alone.

Checkpoints stack each layer's experts, their gate and up projections interleaved (gate at even
positions, up at odd): transformers' layout holds them as matrices to multiply from the right
(`mlp.experts.gate_up_proj` [experts, hidden, 2 x intermediate], `down_proj` [experts, intermediate,
hidden]) beside `gate_up_proj_bias` and `down_proj_bias`; OpenAI's released checkpoints hold the two
projections in MXFP4 (`gate_up_proj_blocks`/`_scales` [experts, out, in / 32, ...], config.json's
`quantization_config.quant_method` "mxfp4"), dequantized here on load (`dequantize_mxfp4`). Each
becomes the hub's per-expert names (`mlp.experts.N.gate_proj`...), the router `mlp.gate`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedserve.layers.moe import Experts
from pagedserve.models.llama import LayerOptions, LlamaForCausalLM
from pagedserve.models.moe import MoeForCausalLM

# an e2m1 code's value (the sign in its top bit): OCP Microscaling's FP4
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_STACKED = re.compile(
    r"^(?P<experts>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<part>_bias|_blocks|_scales)?$"
)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 tensors as bfloat16 (exact: an FP4 value times a power of two): `blocks` [..., G, 16]
    uint8, two FP4 codes a byte (the low nibble first), each group of 32 values scaled by 2^(s - 127)
    for its E8M0 `scales` [..., G] uint8 s -> [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks [..., G, 16] and scales [..., G] do not match: {tuple(blocks.shape)}, {tuple(scales.shape)}"
        )
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.ldexp(lut[codes], scales.int().unsqueeze(-1) - 127)
    return values.flatten(-2).to(torch.bfloat16)


class GptOssForCausalLM(MoeForCausalLM):
    """Biases on q, k, v and o (`attention_bias`, on by default), sinks in every layer's attention,
    every MLP `num_local_experts` experts."""

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> tuple[bool, bool]:
        bias = bool(cfg.get("attention_bias", True))
        return bias, bias

    def read_experts(self, cfg: dict[str, Any]) -> list[Experts | None]:
        """GptOssConfig's defaults where config.json leaves a key out. Its router's softmax over the
        top k logits is the softmax over all of them, renormalized over the top k."""
        spec = Experts(
            num_experts=int(cfg.get("num_local_experts", 128)),
            top_k=int(cfg.get("num_experts_per_tok", 4)),
            intermediate_size=int(cfg.get("intermediate_size", 2880)),
            renormalize=True,
            bias=True,
            activation="swiglu_oai",
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        )
        return [spec] * cfg["num_hidden_layers"]

    def layer_options(self, cfg: dict[str, Any]) -> list[LayerOptions]:
        return [dataclasses.replace(options, sinks=True) for options in super().layer_options(cfg)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # (not MoeForCausalLM's renames: its stacked experts are Granite's layout)
        LlamaForCausalLM.load_weights(self, _per_expert(weights))


def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every expert's tensors under the hub's per-expert names, MXFP4 ones dequantized (their blocks
    and scales held until both have come), the router and the sinks under our names."""
    waiting: dict[str, torch.Tensor] = {}  # an MXFP4 tensor's blocks or scales, by checkpoint name
    for name, tensor in weights:
        name = name.replace(".self_attn.sinks", ".self_attn.attn.sinks").replace(".mlp.router.", ".mlp.gate.")
        stacked = _STACKED.match(name)
        if stacked is None:
            yield name, tensor
            continue
        experts, proj, part = stacked["experts"], stacked["proj"], stacked["part"]
        if part is None:  # transformers' layout: [experts, in, out]
            yield from _split(experts, proj, "weight", tensor.transpose(1, 2))
        elif part == "_bias":
            yield from _split(experts, proj, "bias", tensor)
        else:
            other = f"{experts}.{proj}" + ("_scales" if part == "_blocks" else "_blocks")
            if other not in waiting:
                waiting[name] = tensor
                continue
            blocks, scales = (
                (tensor, waiting.pop(other)) if part == "_blocks" else (waiting.pop(other), tensor)
            )
            yield from _split(experts, proj, "weight", dequantize_mxfp4(blocks, scales))
    if waiting:
        raise ValueError(f"checkpoint's {sorted(waiting)[0]!r} has no MXFP4 blocks or scales beside it")


def _split(experts: str, proj: str, kind: str, stacked: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked [experts, out, ...] tensor's rows for each expert's projections ("weight" or "bias"):
    gate_up_proj's even rows are the gate's, its odd ones the up projection's."""
    if stacked.dim() < 2:
        raise ValueError(f"checkpoint's {experts}.{proj} {kind} is not stacked by expert")
    for number, tensor in enumerate(stacked.unbind(0)):
        if proj == "down_proj":
            yield f"{experts}.{number}.down_proj.{kind}", tensor
        else:
            yield f"{experts}.{number}.gate_proj.{kind}", tensor[0::2]
            yield f"{experts}.{number}.up_proj.{kind}", tensor[1::2]
