"""Zyphra's Zamba2 (1.2B, 2.7B, 7B, and their instruct models) as transformers computes it: Mamba2
layers (`layers.mamba2`), some of them "hybrid", where a shared transformer block runs first.

- Every layer: the residual stream plus Mamba2 over it RMS-normed (Mamba2's gated norm in
  `n_groups` groups, eps 1e-5; time steps of at least `time_step_min`).
- A hybrid layer adds to Mamba2's input (not to the stream) a shared block's output through a linear
  layer of its own. The block: the stream beside the embeddings (2 x hidden_size wide) RMS-normed,
  attention over it (heads of 2 x hidden_size / heads, q.k scaled by (head size / 2)^-1/2, the rope
  where `use_mem_rope`), its output RMS-normed, a GELU MLP; no residual inside. `num_mem_blocks`
  blocks are shared by the hybrid layers in turn (the first, second, first...): their projections are
  one, each hybrid layer has its own KV cache and its own low-rank adapters (`adapter_rank`) on the
  MLP's gate and up projections and, where `use_shared_attention_adapter`, on q, k and v.

A checkpoint holds a block's weights (and all of its layers' adapters, in slots by the hybrid layer's
number) under the first hybrid layer that takes it; they load into the one block each layer holds.
transformers' decode steps do not clamp the time step (its prompts do): no output differs where
time steps stay above `time_step_min` (0.001).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.config import zamba2_config
from pagedserve.layers import ops
from pagedserve.layers.attention import Attention, AttentionBackend, AttentionMetadata
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pagedserve.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.models.llama import LayerStep, LlamaForCausalLM, Rotary, Scales, residual_stream, rms_norm_eps


def zamba2_mamba_dims(cfg: dict[str, Any]) -> Mamba2Dims:
    """Zamba2's Mamba2 sizes, Zamba2Config's defaults where config.json leaves a key out."""
    hidden, heads = cfg["hidden_size"], int(cfg.get("n_mamba_heads", 8))
    inner = int(cfg.get("mamba_expand", 2)) * hidden
    if inner % heads:
        raise ValueError(
            f"model: config.json's n_mamba_heads {heads} does not divide mamba_expand x hidden_size {inner}"
        )
    return Mamba2Dims(
        hidden_size=hidden,
        num_heads=heads,
        head_dim=inner // heads,
        num_groups=int(cfg.get("mamba_ngroups", 1)),
        state_size=int(cfg.get("mamba_d_state", 64)),
        conv_width=int(cfg.get("mamba_d_conv", 4)),
        chunk_size=int(cfg.get("chunk_size", 256)),
        conv_bias=bool(cfg.get("use_conv_bias", True)),
        proj_bias=bool(cfg.get("add_bias_linear", False)),
        norm_eps=1e-5,
        time_step_limit=(float(cfg.get("time_step_min", 0.001)), float("inf")),
    )


class Zamba2SharedBlock(nn.Module):
    """A shared transformer block's weights (see the module docstring); `Zamba2HybridLayer` runs it."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        head_dim, width, eps = cfg["head_dim"], cfg["intermediate_size"], rms_norm_eps(cfg)
        bias = bool(cfg.get("add_bias_linear", False))
        self.input_layernorm = RMSNorm(2 * hidden, eps)
        self.qkv_proj = QKVParallelLinear(2 * hidden, head_dim, heads, kv_heads)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [width, width], bias=bias)
        self.down_proj = RowParallelLinear(width, hidden, bias=bias)
        self.q_size = self.qkv_proj.num_heads * head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * head_dim


class Zamba2Adapters(nn.Module):
    """A hybrid layer's low-rank adapters on its block's projections: each the input through `*_down`
    (rank `adapter_rank`, whole on every rank) and an up projection (this rank's rows, as the
    block's): the MLP's gate and up (`gate_up_proj`), and where `attention` q, k and v."""

    def __init__(self, cfg: dict[str, Any], attention: bool) -> None:
        super().__init__()
        hidden, rank, width = cfg["hidden_size"], int(cfg.get("adapter_rank", 128)), cfg["intermediate_size"]
        self.gate_up_down = ReplicatedLinear(hidden, rank)
        self.gate_up_proj = MergedColumnParallelLinear(rank, [width, width])
        self.attention = attention
        if attention:  # (each up projection 2 x hidden_size wide: q's, k's and v's heads alike)
            for name in ("q", "k", "v"):
                setattr(self, f"{name}_down", ReplicatedLinear(2 * hidden, rank))
                setattr(self, f"{name}_up", ColumnParallelLinear(rank, 2 * hidden))

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """q's, k's and v's adapters over `x`, side by side as the block's qkv_proj puts them."""
        ups = [getattr(self, f"{name}_up")(getattr(self, f"{name}_down")(x)) for name in ("q", "k", "v")]
        return torch.cat(ups, dim=-1)


class Zamba2MambaLayer(nn.Module):
    """Every layer's Mamba2: its input RMS-normed, its output added to the residual stream (Llama's
    layer protocol: the stream is `hidden + residual`)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], rms_norm_eps(cfg))
        self.mamba = Mamba2Mixer(zamba2_mamba_dims(cfg))

    def forward(
        self,
        rotary: Rotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = residual_stream(hidden, residual)
        return self.mixed(stream, metadata), stream

    def mixed(self, x: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Mamba2 over `x` RMS-normed."""
        assert metadata.recurrent is not None, "a step of a model with a state per request"
        normed = cast(torch.Tensor, self.input_layernorm(x))
        return cast(torch.Tensor, self.mamba(normed, metadata.recurrent))


class Zamba2HybridLayer(Zamba2MambaLayer):
    """A hybrid layer: its shared block (`block`, registered in every layer that takes it) with this
    layer's adapters and KV cache (`attn`), through `linear`, added to Mamba2's input. The step's
    embeddings come after the rotary tables."""

    def __init__(
        self, cfg: dict[str, Any], block: Zamba2SharedBlock, backend: AttentionBackend, attention_index: int
    ) -> None:
        super().__init__(cfg)
        self.block = block
        self.adapters = Zamba2Adapters(cfg, bool(cfg.get("use_shared_attention_adapter", False)))
        self.linear = ReplicatedLinear(cfg["hidden_size"], cfg["hidden_size"])
        qkv = block.qkv_proj
        head_dim = cfg["head_dim"]
        self.attn = Attention(
            qkv.num_heads, qkv.num_kv_heads, head_dim, backend, attention_index, scale=(head_dim / 2) ** -0.5
        )
        self.rotary, self.head_dim = bool(cfg.get("use_mem_rope", False)), head_dim
        self.exact_gelu = cfg.get("hidden_act", "gelu") == "gelu"

    def forward(
        self,
        rotary: Rotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = residual_stream(hidden, residual)
        shared = self.linear(self.run_block(rotary, stream, metadata))
        return self.mixed(stream + shared, metadata), stream

    def run_block(self, rotary: Rotary, stream: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        block, adapters = self.block, self.adapters
        x = cast(torch.Tensor, block.input_layernorm(torch.cat((stream, rotary[2]), dim=-1)))
        qkv = block.qkv_proj(x)
        if adapters.attention:
            qkv = qkv + adapters.qkv(x)
        q_and_k = qkv[:, : block.q_size + block.kv_size].view(
            -1, self.attn.num_heads + self.attn.num_kv_heads, self.head_dim
        )
        if self.rotary:
            q_and_k = ops.apply_rotary(q_and_k, rotary[0], rotary[1])
        q, k = q_and_k.split([self.attn.num_heads, self.attn.num_kv_heads], dim=1)
        attended = block.o_proj(self.attn(q, k, qkv[:, block.q_size + block.kv_size :], metadata))
        y = cast(torch.Tensor, block.pre_ff_layernorm(attended))
        gate, up = (block.gate_up_proj(y) + adapters.gate_up_proj(adapters.gate_up_down(y))).chunk(2, dim=-1)
        gelu = F.gelu(gate) if self.exact_gelu else F.gelu(gate, approximate="tanh")
        return block.down_proj(gelu * up)


class Zamba2ForCausalLM(LlamaForCausalLM):
    """Zamba2 (see the module docstring); Zamba2Config's defaults where config.json leaves a key out
    (`config.zamba2_config` reads its layers and sizes): theta 10,000, norms at eps 1e-5, the LM head
    tied."""

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        nn.Module.__init__(self)
        cfg = zamba2_config(cfg)
        if cfg.get("hidden_act", "gelu") not in ("gelu", "gelu_pytorch_tanh"):
            raise ValueError(
                f"model: config.json's hidden_act {cfg['hidden_act']!r} is not supported for Zamba2 "
                "(gelu, gelu_pytorch_tanh are)"
            )
        heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        if (
            cfg.get("use_shared_attention_adapter")
            and not heads * head_dim == kv_heads * head_dim == 2 * cfg["hidden_size"]
        ):
            raise ValueError(
                "model: config.json's use_shared_attention_adapter needs q's, k's and v's heads 2 x "
                f"hidden_size ({2 * cfg['hidden_size']}) wide, as the adapters are; got {heads} query and "
                f"{kv_heads} KV heads of {head_dim}"
            )
        num_blocks = int(cfg.get("num_mem_blocks", 1))
        if num_blocks < 1:
            raise ValueError(f"model: config.json's num_mem_blocks must be at least 1, got {num_blocks}")
        hidden, kinds = cfg["hidden_size"], cfg["layers_block_type"]
        self.scales = Scales()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], hidden)
        self.rotary_emb = RotaryEmbedding(cfg["head_dim"], max_position, cfg)
        self.hybrid_layers = [index for index, kind in enumerate(kinds) if kind == "hybrid"]
        # (registered in the layers that take them: a plain list here)
        self.blocks = [Zamba2SharedBlock(cfg) for _ in range(min(num_blocks, len(self.hybrid_layers)))]
        self.num_blocks = num_blocks
        self.layers = nn.ModuleList()
        for index, kind in enumerate(kinds):
            if kind == "hybrid":
                number = self.hybrid_layers.index(index)
                block = self.blocks[number % num_blocks]
                self.layers.append(Zamba2HybridLayer(cfg, block, backend, number))
            else:
                self.layers.append(Zamba2MambaLayer(cfg))
        self.norm = RMSNorm(hidden, rms_norm_eps(cfg))
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(cfg["vocab_size"], hidden)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.attn for layer in self.layers if isinstance(layer, Zamba2HybridLayer)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        layer_step: LayerStep | None = None,
    ) -> torch.Tensor:
        """Llama's, with the step's embeddings after the rotary tables (the hybrid layers' blocks read
        them)."""
        hidden = self.embed_tokens(input_ids)
        rotary = (*self.rotary_emb(positions, hidden.dtype if layer_step is None else torch.float32), hidden)
        hidden, residual = self.run_layers(rotary, hidden, metadata, layer_step)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._as_ours(weights))

    def _as_ours(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Zamba2's names as ours: a shared block's weights (under any hybrid layer that takes it)
        under every hybrid layer that takes it, their fused gate_up_proj as gate and up; each adapter
        (`*_adapter_list.N`: hybrid layer N's) under its layer; the Mamba2 convolution's as
        `Mamba2Mixer` holds it; the final norm as Llama's."""
        num_blocks = self.num_blocks
        for name, tensor in weights:
            name = name.replace("model.final_layernorm.", "model.norm.").replace(".mamba_decoder.", ".")
            name = name.replace(".mamba.conv1d.weight", ".mamba.conv_weight")
            name = name.replace(".mamba.conv1d.bias", ".mamba.conv_bias")
            shared = _SHARED.match(name)
            if shared is None:
                yield name, tensor
                continue
            layer, part = int(shared[1]), shared[2]
            if layer not in self.hybrid_layers:
                raise ValueError(f"checkpoint's {name}: layer {layer} is not a hybrid layer")
            adapter = _ADAPTER.fullmatch(part)
            if adapter is not None:  # (hybrid layer N's adapter, under whichever layer holds the block)
                number = int(adapter[2])
                if number >= len(self.hybrid_layers):
                    raise ValueError(f"checkpoint's {name}: no hybrid layer {number}")
                projection, up = adapter[1] or "gate_up", adapter[3] == "1"
                prefix = f"model.layers.{self.hybrid_layers[number]}.adapters."
                if projection == "gate_up" and up:  # (their fused up projection as gate and up)
                    gate_rows, up_rows = tensor.chunk(2)
                    yield f"{prefix}gate_proj.weight", gate_rows
                    yield f"{prefix}up_proj.weight", up_rows
                else:
                    yield f"{prefix}{projection}_{'up' if up else 'down'}.weight", tensor
                continue
            block = self.hybrid_layers.index(layer) % num_blocks
            part = re.sub(r"^(self_attn|feed_forward)\.", "", part)
            for owner in self.hybrid_layers[block::num_blocks]:  # (every layer holding this block)
                target = f"model.layers.{owner}.block.{part}"
                if part.startswith("gate_up_proj."):
                    gate, up = tensor.chunk(2)
                    yield target.replace(".gate_up_proj.", ".gate_proj."), gate
                    yield target.replace(".gate_up_proj.", ".up_proj."), up
                else:
                    yield target, tensor


_SHARED = re.compile(r"^model\.layers\.(\d+)\.shared_transformer\.(.+)$")
# an adapter: (q, k, v, or None for the MLP's gate and up; the hybrid layer's number; 0 down, 1 up)
_ADAPTER = re.compile(
    r"(?:self_attn\.linear_([qkv])_adapter|feed_forward\.gate_up_proj_adapter)_list\.(\d+)\.([01])\.weight"
)
