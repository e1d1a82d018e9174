"""Google's Gemma 4 (`Gemma4ForCausalLM`; the text decoder of `Gemma4ForConditionalGeneration`: Gemma
4 31B, 26B-A4B, E4B, E2B) as transformers computes it, on the Llama family's tensor-parallel layers.
What it adds to Gemma 3's layer:

- norms by their weight alone (not 1 + weight), in float32; each value head RMS-normed too (without
  a weight); q.k unscaled (the query norms set its scale);
- sliding layers of `head_dim` (256) and `num_key_value_heads` turned by the local rope, and full
  layers of their own size (`global_head_dim`, 512; `num_global_key_value_heads` where
  `attention_k_eq_v`), turned by a "proportional" rope: NeoX's pairs over the whole head, the first
  `partial_rotary_factor` of them turning (by theta^(-2i / head_dim)), the rest not;
- where `attention_k_eq_v`, the full layers' values are their keys' projection (no v_proj), before
  the key norm and the rotation;
- each layer's output (the whole residual stream) times its `layer_scalar`.

The KV cache holds one entry size for every layer (`config.kv_cache_entry`): a layer whose KV heads
make a smaller entry holds each of them more than once (its k_proj and v_proj rows repeated on
load), as a KV head replicated across tensor-parallel ranks is.

Gemma 4 26B-A4B's experts (`enable_moe_block`) run beside each layer's dense MLP (`Gemma4Experts`).

E2B and E4B add per-layer embeddings (`hidden_size_per_layer_input`): each token's own a layer
(`embed_tokens_per_layer`) and the embeddings projected (`per_layer_model_projection`), each layer's
share gated by its stream and added after its MLP; and KV-shared layers (the last
`num_kv_shared_layers`), whose queries read the KV cache of the last earlier layer of their type
(`Gemma4SharedAttention`: they keep no cache of their own), their MLPs twice as wide where
`use_double_wide_mlp`.

Refused by name: bidirectional attention over text (`use_bidirectional_attention` "all").
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.config import gemma4_layer_shapes, layer_windows, num_kv_cache_layers
from pagedserve.distributed import all_reduce, get_tp_size
from pagedserve.layers import ops
from pagedserve.layers.attention import Attention, AttentionBackend, AttentionMetadata
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pagedserve.layers.moe import Experts, SparseMoeBlock, route
from pagedserve.layers.norm import Float32RMSNorm, weightless_rms_norm
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.models.gemma import GemmaForCausalLM, GemmaMLP, gemma3_rope_config
from pagedserve.models.llama import LayerStep, LlamaForCausalLM, Rotary, residual_stream, rms_norm_eps


class Gemma4Attention(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        backend: AttentionBackend,
        layer_index: int,
        *,
        head_dim: int,
        cache_kv_heads: int,
        local: bool,
        window: int,
    ) -> None:
        super().__init__()
        hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        bias = bool(cfg.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, cache_kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.head_dim, self.local, self.eps = head_dim, local, rms_norm_eps(cfg)
        self.q_norm = Float32RMSNorm(head_dim, self.eps)
        self.k_norm = Float32RMSNorm(head_dim, self.eps)
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, head_dim, backend, layer_index, scale=1.0, window=window
        )

    def forward(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm.normed(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm.normed(k.view(-1, self.num_kv_heads, self.head_dim))
        v = weightless_rms_norm(v.view(-1, self.num_kv_heads, self.head_dim), self.eps)
        cos, sin = rotary[2:4] if self.local else rotary[:2]
        q, k = ops.apply_rotary(q, cos, sin), ops.apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v.flatten(1), metadata))


class Gemma4SharedAttention(nn.Module):
    """A KV-shared layer's attention (from `num_hidden_layers - num_kv_shared_layers` on): its own
    queries over the keys and values an earlier layer of its type wrote (`source`, that layer's
    `Attention`, called with no keys or values of its own: it writes nothing); no key or value
    projections."""

    def __init__(self, cfg: dict[str, Any], source: Attention, *, local: bool) -> None:
        super().__init__()
        hidden, num_heads, head_dim = cfg["hidden_size"], cfg["num_attention_heads"], source.head_dim
        bias = bool(cfg.get("attention_bias", False))
        self.query = ColumnParallelLinear(hidden, num_heads * head_dim, bias=bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=bias)
        self.q_norm = Float32RMSNorm(head_dim, rms_norm_eps(cfg))
        self.head_dim, self.local = head_dim, local
        self.__dict__["source"] = source  # (not a submodule: the source layer owns it)

    def forward(self, rotary: Rotary, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        source: Attention = self.__dict__["source"]
        q = self.q_norm.normed(self.query(hidden).view(-1, source.num_heads, self.head_dim))
        cos, sin = rotary[2:4] if self.local else rotary[:2]
        none = q.new_empty(0, source.num_kv_heads * self.head_dim)
        return self.o_proj(source(ops.apply_rotary(q, cos, sin), none, none, metadata))


class Gemma4Experts(SparseMoeBlock):
    """26B-A4B's experts, beside each layer's dense MLP (`enable_moe_block`): `num_experts` gated MLPs of
    GELU (tanh) and up, `top_k_experts` a token, picked by a router of its own: the layer's input stream
    RMS-normed (no weight), times `scale` and hidden_size^-1/2, through `gate` (the checkpoint's
    `router.proj`), its softmax's top k renormalized, each then times its expert's
    `per_expert_scale`."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        hidden, num_experts = cfg["hidden_size"], int(cfg["num_experts"])
        spec = Experts(
            num_experts=num_experts,
            top_k=int(cfg["top_k_experts"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            renormalize=True,
            activation="gelu_tanh",
        )
        super().__init__(hidden, spec)
        self.scale = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts), requires_grad=False)
        self.eps, self.root = rms_norm_eps(cfg), hidden**-0.5

    def mix(self, x: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        """The experts' sum over `x` (the stream normed for them), routed by `stream`."""
        logits = self.gate(weightless_rms_norm(stream, self.eps) * self.scale * self.root)
        weights, expert_ids = route(logits, self.spec)
        weights = weights * self.per_expert_scale[expert_ids]
        if torch.compiler.is_compiling():
            out = torch.ops.pagedserve.moe_experts(x, weights, expert_ids, self.moe_index)
        else:
            out = self.run_experts(x, weights, expert_ids)
        return all_reduce(out)


class Gemma4DecoderLayer(nn.Module):
    """Gemma 3's four norms (by their weights alone) around attention and the MLP, the layer's output
    times `layer_scalar`; under `enable_moe_block` experts beside the MLP, each output normed before
    they are added. Llama's layer protocol: the stream is `hidden + residual`, so both parts are
    scaled."""

    def __init__(
        self,
        cfg: dict[str, Any],
        attention: Gemma4Attention | Gemma4SharedAttention,
        index: int,
        mlp_width: int,
    ) -> None:
        super().__init__()
        eps, size = rms_norm_eps(cfg), cfg["hidden_size"]
        self.self_attn = attention
        self.mlp = GemmaMLP({**cfg, "intermediate_size": mlp_width}, legacy_gelu=False)
        self.index = index
        per_layer = int(cfg.get("hidden_size_per_layer_input", 256) or 0)
        self.per_layer_input_gate = self.per_layer_projection = self.post_per_layer_input_norm = None
        if per_layer:  # per-layer embeddings (E2B, E4B): this layer's share, gated by the stream
            parts = per_layer_parts(size, per_layer, eps)
            self.per_layer_input_gate, self.per_layer_projection, self.post_per_layer_input_norm = parts
        self.input_layernorm = Float32RMSNorm(size, eps)
        self.post_attention_layernorm = Float32RMSNorm(size, eps)
        self.pre_feedforward_layernorm = Float32RMSNorm(size, eps)
        self.post_feedforward_layernorm = Float32RMSNorm(size, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.experts = Gemma4Experts(cfg) if cfg.get("enable_moe_block") else None
        if self.experts is not None:
            self.post_feedforward_layernorm_1 = Float32RMSNorm(size, eps)
            self.pre_feedforward_layernorm_2 = Float32RMSNorm(size, eps)
            self.post_feedforward_layernorm_2 = Float32RMSNorm(size, eps)

    def forward(
        self,
        rotary: Rotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = residual_stream(hidden, residual)
        attended = self.self_attn(rotary, self.input_layernorm.normed(stream), metadata)
        stream = stream + self.post_attention_layernorm.normed(attended)
        out = self.mlp(self.pre_feedforward_layernorm.normed(stream))
        if self.experts is not None:
            mixed = self.experts.mix(self.pre_feedforward_layernorm_2.normed(stream), stream)
            out = self.post_feedforward_layernorm_1.normed(out) + self.post_feedforward_layernorm_2.normed(
                mixed
            )
        out = self.post_feedforward_layernorm.normed(out)
        if self.per_layer_input_gate is not None:
            stream = stream + out
            out = per_layer_share(self, stream, rotary[4][:, self.index])
        return out * self.layer_scalar, stream * self.layer_scalar


def per_layer_parts(
    size: int, per_layer: int, eps: float
) -> tuple[ReplicatedLinear, ReplicatedLinear, Float32RMSNorm]:
    """A layer's parts for its share of the per-layer inputs (E2B's, E4B's, Gemma 3n's): the gate
    (`per_layer_input_gate`), the projection back (`per_layer_projection`), the norm after it
    (`post_per_layer_input_norm`)."""
    return ReplicatedLinear(size, per_layer), ReplicatedLinear(per_layer, size), Float32RMSNorm(size, eps)


def per_layer_share(layer: nn.Module, x: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """`layer`'s share of the per-layer inputs (`inputs`, [tokens, per-layer size]), gated by `x`:
    GELU-tanh of the gate over x, times the inputs, projected back and normed (`per_layer_parts`)."""
    gate, projection = (
        cast(ReplicatedLinear, layer.per_layer_input_gate),
        cast(ReplicatedLinear, layer.per_layer_projection),
    )
    gated = F.gelu(gate(x), approximate="tanh") * inputs
    return cast(Float32RMSNorm, layer.post_per_layer_input_norm).normed(projection(gated))


def kv_sources(cfg: dict[str, Any]) -> dict[int, int]:
    """Each KV-shared layer (the last `num_kv_shared_layers`) -> the layer whose keys and values it
    reads: the last one before them of its type (sliding or full), as transformers picks it."""
    layer_types, num_cache_layers = cfg["layer_types"], num_kv_cache_layers(cfg)
    sources = {}
    for index in range(num_cache_layers, len(layer_types)):
        kind = layer_types[index]
        earlier = [i for i in range(num_cache_layers) if layer_types[i] == kind]
        if not earlier:
            raise ValueError(
                f"model: config.json's num_kv_shared_layers {len(layer_types) - num_cache_layers} leaves "
                f"layer {index} ({kind}) no earlier {kind} layer whose KV cache it could read"
            )
        sources[index] = earlier[-1]
    return sources


def cache_repeats(shapes: list[tuple[int, int]], num_heads: int, tp_size: int) -> list[int]:
    """How many times each layer's KV heads (`shapes`: (KV heads, head size) a layer) are held so that
    every layer's entry on a rank is the same: the largest one (a KV head on more ranks than one
    whole on each, as tensor parallelism replicates it)."""
    entry = max(max(heads, tp_size) // tp_size * dim for heads, dim in shapes)
    repeats = []
    for heads, dim in shapes:
        held = entry // dim * tp_size
        if entry % dim or held % heads or num_heads % held:
            raise ValueError(
                f"model: config.json's head sizes and KV heads give layers of {heads} KV heads of {dim}, "
                f"which cannot fill a KV entry of {entry} a rank ({tp_size} ranks, {num_heads} query heads)"
            )
        repeats.append(held // heads)
    return repeats


class Gemma4ForCausalLM(GemmaForCausalLM):
    """Gemma 4 (see the module docstring); Gemma4TextConfig's defaults where config.json leaves a key
    out. Gemma 1-3's embedding scale, forward pass and logit soft-capping."""

    architecture = "Gemma4ForCausalLM"
    local_rope = True

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        nn.Module.__init__(self)
        if cfg.get("use_bidirectional_attention") == "all":
            raise ValueError(
                "model: config.json's use_bidirectional_attention 'all' is not supported for Gemma 4"
            )
        hidden, num_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
        shapes = self.layer_shapes(cfg)
        local = [kind == "sliding_attention" for kind in cfg["layer_types"]]
        sources = kv_sources(cfg)  # a KV-shared layer's: the earlier layer whose KV cache it reads
        self.num_cache_layers = num_kv_cache_layers(cfg)
        # each cache layer's KV heads as the cache holds them: its real ones, each repeated `repeats[i]` times
        self.repeats = cache_repeats(
            shapes[: self.num_cache_layers], cfg["num_attention_heads"], get_tp_size()
        )
        self.k_eq_v = [bool(cfg.get("attention_k_eq_v")) and not is_local for is_local in local]
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], hidden)
        self.embedding_scale = hidden**0.5  # rounded to the dtype, as transformers rounds it
        global_dim = next((dim for (_, dim), is_local in zip(shapes, local) if not is_local), shapes[0][1])
        local_dim = next((dim for (_, dim), is_local in zip(shapes, local) if is_local), shapes[0][1])
        self.rotary_emb = RotaryEmbedding(global_dim, max_position, gemma3_rope_config(cfg, "full_attention"))
        self.local_rotary_emb = RotaryEmbedding(
            local_dim, max_position, gemma3_rope_config(cfg, "sliding_attention")
        )
        windows = layer_windows(cfg, self.architecture)
        self.layers = nn.ModuleList()
        for index in range(num_layers):
            attention: Gemma4Attention | Gemma4SharedAttention
            if index < self.num_cache_layers:
                attention = Gemma4Attention(
                    cfg,
                    backend,
                    index,
                    head_dim=shapes[index][1],
                    cache_kv_heads=shapes[index][0] * self.repeats[index],
                    local=local[index],
                    window=windows[index],
                )
            else:
                source = self.layers[sources[index]].self_attn
                attention = Gemma4SharedAttention(cfg, cast(Gemma4Attention, source).attn, local=local[index])
            self.layers.append(self.decoder_layer(cfg, attention, index))
        # per-layer embeddings (E2B, E4B): a token's own for every layer, and the embeddings projected
        self.per_layer = int(cfg.get("hidden_size_per_layer_input", 256) or 0)
        if self.per_layer:
            vocab = int(cfg.get("vocab_size_per_layer_input", 262_144))
            self.embed_tokens_per_layer = VocabParallelEmbedding(vocab, num_layers * self.per_layer)
            self.per_layer_model_projection = ReplicatedLinear(hidden, num_layers * self.per_layer)
            self.per_layer_projection_norm = Float32RMSNorm(self.per_layer, rms_norm_eps(cfg))
        self.norm = Float32RMSNorm(hidden, rms_norm_eps(cfg))
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(cfg["vocab_size"], hidden)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.softcap = float(cfg.get("final_logit_softcapping") or 0.0)

    @staticmethod
    def layer_shapes(cfg: dict[str, Any]) -> list[tuple[int, int]]:
        """Each layer's (KV heads, head size)."""
        return gemma4_layer_shapes(cfg)

    def decoder_layer(
        self, cfg: dict[str, Any], attention: Gemma4Attention | Gemma4SharedAttention, index: int
    ) -> nn.Module:
        """Layer `index` around its attention (`use_double_wide_mlp`: the KV-shared layers' MLPs twice
        as wide)."""
        width = int(cfg["intermediate_size"])
        if isinstance(attention, Gemma4SharedAttention) and cfg.get("use_double_wide_mlp"):
            width *= 2
        return Gemma4DecoderLayer(cfg, attention, index, width)

    @property
    def attention_layers(self) -> list[Attention]:
        """The layers with a KV cache of their own (the KV-shared ones read another's)."""
        return [layer.self_attn.attn for layer in self.decoder_layers[: self.num_cache_layers]]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        layer_step: LayerStep | None = None,
    ) -> torch.Tensor:
        """Gemma's, with each layer's per-layer input (E2B's, E4B's) after the four rotary tables."""
        if not self.per_layer:
            return super().forward(input_ids, positions, metadata, layer_step)
        hidden, rotary = self.embedded_and_rotary(input_ids, positions)
        hidden, residual = self.run_layers(rotary, hidden, metadata, layer_step)
        return cast(Float32RMSNorm, self.norm).normed(residual + hidden)

    def embedded_and_rotary(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, Rotary]:
        """The tokens' embeddings (scaled), and what every layer reads beside the stream: the full and
        the sliding layers' rotary tables, then the per-layer inputs."""
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        tables = (*self.rotary_emb(positions, hidden.dtype), *self.local_rotary_emb(positions, hidden.dtype))
        return hidden, (*tables, self.per_layer_inputs(input_ids, hidden))

    def per_layer_inputs(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """[tokens, layers, hidden_size_per_layer_input]: the embeddings (`embedded`) projected, times
        hidden_size^-1/2, RMS-normed, plus the tokens' own per-layer embeddings (times
        sqrt(hidden_size_per_layer_input)), times 2^-1/2."""
        per_layer, num_layers = self.per_layer, len(self.layers)
        own = self.embed_tokens_per_layer(input_ids)
        own = (own * torch.tensor(per_layer**0.5, dtype=own.dtype)).view(-1, num_layers, per_layer)
        projected = self.per_layer_model_projection(embedded) * embedded.shape[-1] ** -0.5
        projected = self.per_layer_projection_norm.normed(projected.view(-1, num_layers, per_layer))
        return (projected + own) * 2**-0.5

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        LlamaForCausalLM.load_weights(self, self._as_cached(weights))

    def _as_cached(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """k_proj's and v_proj's rows as the cache holds the heads (each repeated); a full layer's keys'
        projection as its values' too where `attention_k_eq_v`; the router under the experts' names,
        the stacked experts cut one by one; the vision and audio towers left out."""
        for name, tensor in weights:
            if re.match(r"^model\.(embed_vision|embed_audio|audio_tower)\.", name):
                continue
            name = re.sub(r"\.router\.proj\.", ".experts.gate.", name)
            name = re.sub(r"\.router\.(scale|per_expert_scale)$", r".experts.\1", name)
            stacked = re.search(r"\.experts\.(gate_up_proj|down_proj)$", name)
            if stacked is not None:
                yield from _experts_one_by_one(name[: stacked.start()], stacked[1], tensor)
                continue
            shared = re.search(r"(?:^|\.)layers\.(\d+)\.self_attn\.", name)
            if shared is not None and "vision_tower" not in name and int(shared[1]) >= self.num_cache_layers:
                # a KV-shared layer: its query projection alone (its checkpoint may hold unread k, v)
                if re.search(r"\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.", name):
                    continue
                yield name.replace(".self_attn.q_proj.", ".self_attn.query."), tensor
                continue
            match = re.search(r"(?:^|\.)layers\.(\d+)\.self_attn\.(k|v)_proj\.(weight|bias)$", name)
            if match is None or "vision_tower" in name:
                yield name, tensor
                continue
            index = int(match[1])
            head_dim = self.decoder_layers[index].self_attn.head_dim
            rows = tensor.unflatten(0, (-1, head_dim)).repeat_interleave(self.repeats[index], 0).flatten(0, 1)
            yield name, rows
            if match[2] == "k" and self.k_eq_v[index]:
                yield name.replace(".k_proj.", ".v_proj."), rows


def _experts_one_by_one(
    layer: str, projection: str, tensor: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' stacked experts (gate_up_proj [experts, 2 x intermediate, hidden], down_proj
    [experts, hidden, intermediate]) as each expert's gate, up and down projections."""
    for number, expert in enumerate(tensor.unbind(0)):
        if projection == "down_proj":
            yield f"{layer}.experts.experts.{number}.down_proj.weight", expert
        else:
            gate, up = expert.chunk(2)
            yield f"{layer}.experts.experts.{number}.gate_proj.weight", gate
            yield f"{layer}.experts.experts.{number}.up_proj.weight", up
