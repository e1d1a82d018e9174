"""Google's Gemma 3n (`Gemma3nForCausalLM`; the text decoder of `Gemma3nForConditionalGeneration`:
Gemma 3n E2B, E4B) as transformers computes it, on Gemma 4's attention (norms by their weights, values
RMS-normed, q.k unscaled), per-layer embeddings and KV-shared layers (`models.gemma4`). What it adds:

- AltUp: the residual stream is `altup_num_inputs` (4) streams a token, the embeddings and their
  projections (`altup_projections`) rescaled to the embeddings' magnitude. A layer predicts every
  stream from all of them (4 x 4 coefficients a token, from a router over the active stream,
  `altup_active_idx`), runs on the active prediction, and corrects each prediction by what the layer
  changed (4 coefficients a token); at the end the other streams are projected back
  (`altup_unembed_projections`), rescaled, and the four averaged;
- LAuReL: a low-rank branch (`laurel_rank`) beside attention, normed and added to its input; its sum
  with the attention's output times 2^-1/2;
- sparse activations: in the layers `activation_sparsity_pattern` names (the first 10, 0.95), the MLP's
  gate less its mean plus `icdf(0.95)` (1.645) of its standard deviations over the row, cut at 0,
  before the GELU;
- per-layer embeddings (Gemma 4 E2B's) gated by the corrected active stream times
  `correct_output_scale`, added to the other streams; tokens past `vocab_size_per_layer_input` take
  the per-layer embedding of token 0.

Every layer's KV heads and head size are one: the KV-shared layers (the last `num_kv_shared_layers`,
15 of E4B's 35) read the cache of the last earlier layer of their type. Logits soft-capped at 30.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed import all_reduce, get_tp_size
from pagedserve.layers.attention import AttentionBackend, AttentionMetadata
from pagedserve.layers.linear import ReplicatedLinear
from pagedserve.layers.norm import Float32RMSNorm
from pagedserve.models.gemma import GemmaMLP
from pagedserve.models.gemma4 import (
    Gemma4Attention,
    Gemma4ForCausalLM,
    Gemma4SharedAttention,
    per_layer_parts,
    per_layer_share,
)
from pagedserve.models.llama import LayerStep, Rotary, rms_norm_eps


class AltUp(nn.Module):
    """AltUp's prediction and correction over a layer's streams ([tokens, streams, hidden])."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, streams = cfg["hidden_size"], int(cfg.get("altup_num_inputs", 4))
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden), requires_grad=False)
        self.correction_coefs = ReplicatedLinear(streams, streams)
        self.prediction_coefs = ReplicatedLinear(streams, streams * streams)
        self.modality_router = ReplicatedLinear(hidden, streams)
        self.router_norm = Float32RMSNorm(hidden, rms_norm_eps(cfg))
        self.streams, self.active, self.hidden = streams, int(cfg.get("altup_active_idx", 0)), hidden

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, streams]: the router's tanh over `x` normed and divided by hidden_size."""
        scale = torch.tensor(1.0 / self.hidden, dtype=x.dtype)
        return torch.tanh(self.modality_router(self.router_norm.normed(x) * scale).float()).to(x.dtype)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """Each stream plus a mix of all of them, by coefficients of the active stream's router."""
        coefs = self.prediction_coefs(self.modalities(streams[:, self.active]))
        return torch.bmm(coefs.view(-1, self.streams, self.streams), streams) + streams

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """Each prediction plus the layer's change to the active one (`activated` less its
        prediction) times 1 + its coefficient of the router over `activated`."""
        change = activated - predictions[:, self.active]
        coefs = self.correction_coefs(self.modalities(activated)) + 1.0
        return change[:, None, :] * coefs[:, :, None] + predictions


class Laurel(nn.Module):
    """LAuReL: x plus its low-rank projection (`laurel_rank`), normed."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, rank = cfg["hidden_size"], int(cfg.get("laurel_rank", 64))
        self.linear_left = ReplicatedLinear(hidden, rank)
        self.linear_right = ReplicatedLinear(rank, hidden)
        self.post_laurel_norm = Float32RMSNorm(hidden, rms_norm_eps(cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm.normed(self.linear_right(self.linear_left(x)))


def std_multiplier(sparsity: float) -> float:
    """The standard normal's quantile at `sparsity` (1.645 at 0.95), in float32 as transformers takes
    it: where a layer's gate is cut, in standard deviations above its mean."""
    quantile = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(sparsity, dtype=torch.float32))
    return float(quantile)


class Gemma3nMLP(GemmaMLP):
    """Gemma's MLP (GELU-tanh of the gate, times up) of this layer's width, its gate cut first where
    the layer is sparse (`sparsity` > 0): less its row's mean plus `std_multiplier(sparsity)` standard
    deviations, at 0. The row's mean and deviation are over the whole gate, all ranks' parts."""

    def __init__(self, cfg: dict[str, Any], width: int, sparsity: float) -> None:
        super().__init__({**cfg, "intermediate_size": width}, legacy_gelu=False)
        if not 0.0 <= sparsity < 1.0:
            raise ValueError(
                f"model: config.json's activation_sparsity_pattern must hold values in [0, 1), got {sparsity}"
            )
        self.multiplier = std_multiplier(sparsity) if sparsity > 0.0 else None
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.multiplier is not None:
            gate = F.relu(gate - self.cutoff(gate))
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)

    def cutoff(self, gate: torch.Tensor) -> torch.Tensor:
        """[tokens, 1]: each row's mean plus `multiplier` of its (biased) standard deviations."""
        multiplier = torch.tensor(cast(float, self.multiplier), dtype=gate.dtype)
        if get_tp_size() == 1:  # (as transformers computes them, in the gate's dtype)
            mean = gate.mean(-1, keepdim=True)
            std = gate.std(-1, keepdim=True, correction=0)
            return mean + std * multiplier
        gate32 = gate.float()  # each rank holds a part of the row: its sums, then the squares about the mean
        mean = all_reduce(gate32.sum(-1, keepdim=True)) / self.width
        variance = all_reduce((gate32 - mean).pow(2).sum(-1, keepdim=True)) / self.width
        return mean.to(gate.dtype) + variance.sqrt().to(gate.dtype) * multiplier


class Gemma3nDecoderLayer(nn.Module):
    """A layer over the AltUp streams (see the module docstring). Llama's layer protocol, the streams
    ([tokens, streams, hidden]) as both its hidden part and its residual: the layer returns them
    corrected, twice, and reads its first argument."""

    def __init__(
        self,
        cfg: dict[str, Any],
        attention: Gemma4Attention | Gemma4SharedAttention,
        index: int,
        width: int,
        sparsity: float,
    ) -> None:
        super().__init__()
        eps, size, per_layer = rms_norm_eps(cfg), cfg["hidden_size"], int(cfg["hidden_size_per_layer_input"])
        self.self_attn = attention
        self.mlp = Gemma3nMLP(cfg, width, sparsity)
        self.altup, self.laurel = AltUp(cfg), Laurel(cfg)
        self.input_layernorm = Float32RMSNorm(size, eps)
        self.post_attention_layernorm = Float32RMSNorm(size, eps)
        self.pre_feedforward_layernorm = Float32RMSNorm(size, eps)
        self.post_feedforward_layernorm = Float32RMSNorm(size, eps)
        self.per_layer_input_gate, self.per_layer_projection, self.post_per_layer_input_norm = (
            per_layer_parts(size, per_layer, eps)
        )
        self.index, self.correct_scale = index, bool(cfg.get("altup_correct_scale", True))

    def forward(
        self,
        rotary: Rotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        predictions = self.altup.predict(hidden)
        active = predictions[:, self.altup.active]
        normed = self.input_layernorm.normed(active)
        laurel = self.laurel(normed)
        attended = self.post_attention_layernorm.normed(self.self_attn(rotary, normed, metadata))
        stream = (active + attended + laurel) / math.sqrt(2)
        stream = stream + self.post_feedforward_layernorm.normed(
            self.mlp(self.pre_feedforward_layernorm.normed(stream))
        )
        corrected = self.altup.correct(predictions, stream)
        first = corrected[:, self.altup.active]
        if self.correct_scale:
            first = first * self.altup.correct_output_scale
        corrected[:, 1:] += per_layer_share(self, first, rotary[4][:, self.index])[:, None]
        return corrected, corrected


def rescaled(x: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """`x` with its rows' root mean square (at least 1e-5^1/2) made `magnitude`'s."""
    return x * magnitude / torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))


class Gemma3nForCausalLM(Gemma4ForCausalLM):
    """Gemma 3n (see the module docstring); Gemma3nTextConfig's defaults where config.json leaves a key
    out (`config.gemma3n_config` reads the per-layer lists)."""

    architecture = "Gemma3nForCausalLM"

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        cfg = {
            **cfg,
            "hidden_size_per_layer_input": int(cfg.get("hidden_size_per_layer_input", 256)),
            "final_logit_softcapping": cfg.get("final_logit_softcapping", 30.0),
        }
        if (
            cfg.get("attention_k_eq_v")
            or cfg.get("enable_moe_block")
            or not cfg["hidden_size_per_layer_input"]
        ):
            raise ValueError(
                "model: config.json's attention_k_eq_v, enable_moe_block or a hidden_size_per_layer_input "
                "of 0 is not Gemma 3n's"
            )
        hidden, streams = cfg["hidden_size"], int(cfg.get("altup_num_inputs", 4))
        if not 0 <= int(cfg.get("altup_active_idx", 0)) < streams:
            raise ValueError(
                f"model: config.json's altup_active_idx must be below altup_num_inputs {streams}, "
                f"got {cfg.get('altup_active_idx')}"
            )
        super().__init__(cfg, max_position, backend)
        self.altup_projections = nn.ModuleList(ReplicatedLinear(hidden, hidden) for _ in range(1, streams))
        self.altup_unembed_projections = nn.ModuleList(
            ReplicatedLinear(hidden, hidden) for _ in range(1, streams)
        )
        self.per_layer_vocab = int(cfg.get("vocab_size_per_layer_input", 262_144))

    @staticmethod
    def layer_shapes(cfg: dict[str, Any]) -> list[tuple[int, int]]:
        heads, head_dim = int(cfg["num_key_value_heads"]), int(cfg.get("head_dim") or 256)
        return [(heads, head_dim)] * cfg["num_hidden_layers"]

    def decoder_layer(
        self, cfg: dict[str, Any], attention: Gemma4Attention | Gemma4SharedAttention, index: int
    ) -> nn.Module:
        width, sparsity = cfg["intermediate_size"][index], cfg["activation_sparsity_pattern"][index]
        return Gemma3nDecoderLayer(cfg, attention, index, int(width), float(sparsity))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        layer_step: LayerStep | None = None,
    ) -> torch.Tensor:
        embedded, rotary = self.embedded_and_rotary(input_ids, positions)
        magnitude = torch.mean(embedded**2, dim=-1, keepdim=True) ** 0.5
        streams = [embedded] + [rescaled(project(embedded), magnitude) for project in self.altup_projections]
        out, _ = self.run_layers(rotary, torch.stack(streams, dim=1), metadata, layer_step)
        magnitude = torch.mean(out[:, 0] ** 2, dim=-1, keepdim=True) ** 0.5
        unembedded = [out[:, 0]] + [
            rescaled(project(out[:, i]), magnitude)
            for i, project in enumerate(self.altup_unembed_projections, start=1)
        ]
        return cast(Float32RMSNorm, self.norm).normed(torch.stack(unembedded, dim=1).mean(dim=1))

    def per_layer_inputs(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """Gemma 4's, tokens past the per-layer vocabulary (`vocab_size_per_layer_input`) taking token
        0's per-layer embedding."""
        in_table = (input_ids >= 0) & (input_ids < self.per_layer_vocab)
        return super().per_layer_inputs(torch.where(in_table, input_ids, 0), embedded)
