"""Paged attention: write this step's K/V into the cache, then attend through block tables.

The packed batch puts decode tokens (one query token per sequence) first, then the prefill tokens
(prompts, prompt chunks, recomputes), each sequence's tokens contiguous:

    tokens   [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]
              decodes     prefill seq 0  prefill seq 1

A backend implements the KV write and the two attention calls; the torch reference and the
Triton kernels share the layouts described in `pagedserve_kernels.reference`.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from pagedserve_kernels import cpu as cpu_kernels
from pagedserve_kernels import reference
from torch import nn

from pagedserve.distributed import get_tp_rank
from pagedserve.layers.chunked import ChunkedPrefills, chunk_decodes

if TYPE_CHECKING:
    from pagedserve.layers.recurrent import RecurrentStep

logger = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    # decode rows come first, one token each: a decoding sequence's, and (speculative decoding) each of
    # its drafts, a row of its own with the sequence's block table and the context up to its position
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, relative to the first prefill token
    prefill_context_lens: torch.Tensor  # [num_prefills] int32
    # host-side maxima, so a kernel launch sizes its grid without a device-to-host sync
    max_decode_context_len: int = 0
    max_prefill_query_len: int = 0
    # derived by the torch backend on a step's first layer of each sliding window (0: none) and
    # shared by its other layers of that window
    decode_key_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    prefill_batches: dict[int, reference.PrefillBatch | None] = field(default_factory=dict)
    # the step's sequences as a model's layers with a state per request read them (LFM2's, Mamba2's:
    # `layers.recurrent`), built by the model runner for such a model alone
    recurrent: RecurrentStep | None = None
    # the step's prefills cut at each chunk size's boundaries (`layers.chunked`), built by the model
    # runner for a model with chunked attention alone; and the step as such layers see it (`chunk_local`)
    chunked_prefills: dict[int, ChunkedPrefills] = field(default_factory=dict)
    chunk_views: dict[int, AttentionMetadata] = field(default_factory=dict)

    @property
    def num_prefills(self) -> int:
        return self.prefill_context_lens.shape[0]

    def chunk_local(self, chunk: int, block_size: int) -> AttentionMetadata:
        """The step as a layer attending within chunks of `chunk` positions sees it: each sequence's
        queries over their own chunk's keys alone (`layers.chunked`). Derived by the step's first such
        layer, shared by the others."""
        view = self.chunk_views.get(chunk)
        if view is not None:
            return view
        tables, context_lens, longest = chunk_decodes(
            self.decode_block_tables, self.decode_context_lens, self.max_decode_context_len, chunk, block_size
        )
        view = AttentionMetadata(
            slot_mapping=self.slot_mapping,
            num_decodes=self.num_decodes,
            decode_block_tables=tables,
            decode_context_lens=context_lens,
            prefill_block_tables=self.prefill_block_tables,
            prefill_query_start_loc=self.prefill_query_start_loc,
            prefill_context_lens=self.prefill_context_lens,
            max_decode_context_len=longest,
            max_prefill_query_len=self.max_prefill_query_len,
        )
        if self.num_prefills:
            assert chunk in self.chunked_prefills, "the model runner cuts a step's prefills at its chunks"
            prefills = self.chunked_prefills[chunk]
            view.prefill_block_tables = prefills.block_tables
            view.prefill_query_start_loc = prefills.query_start_loc
            view.prefill_context_lens = prefills.context_lens
            view.max_prefill_query_len = prefills.max_query_len
        self.chunk_views[chunk] = view
        return view


class AttentionBackend(abc.ABC):
    """Paged attention of a layer whose queries see the last `window` positions (0: all of them),
    its scores soft-capped by `softcap` (0: none), each query head's softmax joined by its logit in
    `sinks` (float32 [heads]; None: none; GPT-OSS's attention sinks), its scores biased by distance
    under `alibi_slopes` (float32 [heads]; None: none; BLOOM's and MPT's ALiBi)."""

    name: str

    @abc.abstractmethod
    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    @abc.abstractmethod
    def decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None,
        alibi_slopes: torch.Tensor | None,
    ) -> torch.Tensor:
        """[num_decodes, heads, head_dim] queries over the decode sequences' paged context."""

    @abc.abstractmethod
    def prefill(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None,
        alibi_slopes: torch.Tensor | None,
    ) -> torch.Tensor:
        """The packed prefill tokens' queries, causal over their paged context."""


# Past this head size decode attention runs the reference, not the C++ kernel (whose head sizes past 256
# take its generic loop, a query head at a time): DeepSeek's latent heads, 576 wide and read by 16-128
# query heads, ran up to 2.9x faster in the reference's batched matmuls (0.95-2.93x over the shapes and
# runs measured), MiniCPM3's 288 by 40 heads 1.2-1.8x (bench/README.md "Latent attention's decode")
MAX_KERNEL_DECODE_HEAD_SIZE = 256


class TorchAttentionBackend(AttentionBackend):
    """CPU runs: the pure-torch reference (scaled_dot_product_attention over gathered blocks), with
    the KV writes and decode attention in the C++ CPU kernels (`pagedserve_kernels.cpu`, decode read
    straight from the paged cache) where they build. The decode mask and the padded prefill layout
    are built once per step, not once per layer.

    Decode attention at head sizes past 256 (DeepSeek's latent heads) runs the reference
    (`MAX_KERNEL_DECODE_HEAD_SIZE`).

    Prefill attention in bfloat16, head size 64, 96, 128 or 256 (`cpu.PREFILL_HEAD_SIZES`), on a build
    with AVX512-BF16 runs in the C++ prefill kernel (`cpu.paged_attention_prefill`: tiles of query
    tokens and heads sharing a KV head, flash-attention style), read straight from the paged cache:
    at head size 64 3.4-4.9x faster than scaled_dot_product_attention and 1.8-2.4x faster than the
    decode kernel run one row a prompt token on prompts of 100 tokens and more, at 96 and 256
    2.1-3.9x faster than SDPA (bench/cpu_attention.py, bench/README.md).

    The reference's decode mask and padded prefill layout are built on a step's first layer of each
    window, not once per layer."""

    name = "torch"

    def __init__(self, device: torch.device | None = None) -> None:
        self.cpu_kernels = device is not None and device.type == "cpu" and cpu_kernels.load()
        self.bf16_prefill = self.cpu_kernels and cpu_kernels.decode_isa() == "avx512_bf16"
        if self.cpu_kernels:
            logger.info("KV writes and attention: the C++ CPU kernels (%s)", cpu_kernels.decode_isa())

    def _prefill_in_kernel(self, dtype: torch.dtype, head_dim: int) -> bool:
        return self.bf16_prefill and dtype == torch.bfloat16 and head_dim in cpu_kernels.PREFILL_HEAD_SIZES

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self.cpu_kernels:
            cpu_kernels.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        else:
            reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None,
        alibi_slopes: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.cpu_kernels and query.shape[-1] <= MAX_KERNEL_DECODE_HEAD_SIZE:
            return cpu_kernels.paged_attention_decode(
                query,
                k_cache,
                v_cache,
                metadata.decode_block_tables,
                metadata.decode_context_lens,
                scale,
                window=window,
                softcap=softcap,
                sinks=sinks,
                alibi_slopes=alibi_slopes,
            )
        if window not in metadata.decode_key_masks:
            num_blocks = -(-metadata.max_decode_context_len // k_cache.shape[1])
            metadata.decode_key_masks[window] = reference.decode_key_mask(
                metadata.decode_context_lens, num_blocks * k_cache.shape[1], query.dtype, window
            )
        return reference.paged_attention_decode(
            query,
            k_cache,
            v_cache,
            metadata.decode_block_tables,
            metadata.decode_context_lens,
            scale,
            max_context_len=metadata.max_decode_context_len,
            key_mask=metadata.decode_key_masks[window],
            window=window,
            softcap=softcap,
            sinks=sinks,
            alibi_slopes=alibi_slopes,
        )

    def prefill(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None,
        alibi_slopes: torch.Tensor | None,
    ) -> torch.Tensor:
        if self._prefill_in_kernel(query.dtype, query.shape[-1]):
            return cpu_kernels.paged_attention_prefill(
                query,
                k_cache,
                v_cache,
                metadata.prefill_block_tables,
                metadata.prefill_query_start_loc,
                metadata.prefill_context_lens,
                scale,
                window=window,
                softcap=softcap,
                sinks=sinks,
                alibi_slopes=alibi_slopes,
            )
        if window not in metadata.prefill_batches:
            metadata.prefill_batches[window] = reference.plan_prefill_batch(
                metadata.prefill_query_start_loc,
                metadata.prefill_context_lens,
                k_cache.shape[1],
                query.dtype,
                window,
            )
        return reference.paged_attention_prefill(
            query,
            k_cache,
            v_cache,
            metadata.prefill_block_tables,
            metadata.prefill_query_start_loc,
            metadata.prefill_context_lens,
            scale,
            batch=metadata.prefill_batches[window],
            window=window,
            softcap=softcap,
            sinks=sinks,
            alibi_slopes=alibi_slopes,
        )


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels (`pagedserve_kernels.attention` and `.cache`): GPU runs, or CPU runs under
    Triton's interpreter (the same kernel code, orders of magnitude slower: tests and debugging)."""

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        self._attention, self._cache = _import_triton_kernels(device)

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._cache.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None,
        alibi_slopes: torch.Tensor | None,
    ) -> torch.Tensor:
        return self._attention.paged_attention_decode(
            query,
            k_cache,
            v_cache,
            metadata.decode_block_tables,
            metadata.decode_context_lens,
            scale,
            max_context_len=metadata.max_decode_context_len,
            window=window,
            softcap=softcap,
            sinks=sinks,
            alibi_slopes=alibi_slopes,
        )

    def prefill(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None,
        alibi_slopes: torch.Tensor | None,
    ) -> torch.Tensor:
        return self._attention.paged_attention_prefill(
            query,
            k_cache,
            v_cache,
            metadata.prefill_block_tables,
            metadata.prefill_query_start_loc,
            metadata.prefill_context_lens,
            scale,
            max_query_len=metadata.max_prefill_query_len,
            window=window,
            softcap=softcap,
            sinks=sinks,
            alibi_slopes=alibi_slopes,
        )


_KERNEL_MODULES = ("pagedserve_kernels.attention", "pagedserve_kernels.cache")


def _import_triton_kernels(device: torch.device) -> tuple[ModuleType, ModuleType]:
    """Triton wraps a kernel for its GPU compiler or for its interpreter when the kernel's module is
    imported, so a CPU run switches the interpreter on before that first import."""
    import triton

    if device.type != "cuda" and not triton.knobs.runtime.interpret:
        if any(name in sys.modules for name in _KERNEL_MODULES):
            raise RuntimeError(
                "attention_backend triton on CPU runs under Triton's interpreter, but the kernels were "
                "already loaded for the GPU compiler: set TRITON_INTERPRET=1 before starting"
            )
        triton.knobs.runtime.interpret = True  # also exports TRITON_INTERPRET=1 to worker processes
    if device.type != "cuda":
        logger.warning("attention backend triton on %s runs under Triton's interpreter: very slow", device)
    from pagedserve_kernels import attention, cache

    return attention, cache


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`name` is a resolved `EngineConfig.attention_backend`: torch or triton."""
    logger.info("attention backend: %s on %s", name, device)
    if name == "triton":
        return TritonAttentionBackend(device)
    if name == "torch":
        return TorchAttentionBackend(device)
    raise ValueError(f"attention_backend: unknown backend {name!r}")


class Attention(nn.Module):
    """Attention of one layer over its slice of the KV cache (`kv_cache` is bound by the model runner)."""

    layer_index: torch.Tensor  # a buffer (register_buffer): int64, 0-d

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: AttentionBackend,
        layer_index: int,
        scale: float | None = None,
        window: int = 0,
        softcap: float = 0.0,
        sinks: bool = False,
        chunk: int = 0,
    ) -> None:
        """`scale` multiplies q.k: 1 / sqrt(head_dim) unless the model names its own (Granite's).
        `window`: a query sees the last `window` positions alone (a sliding window; 0, all).
        `chunk` C: a query at p sees positions C * (p // C)..p alone (Llama 4's chunked attention,
        `layers.chunked`; 0, all).
        `softcap` c: each score s becomes c * tanh(s / c) (Gemma 2's soft-capping; 0, none).
        `sinks`: a learned logit a query head (the parameter `sinks`, this rank's `num_heads` of
        them) joins each softmax with no value (GPT-OSS's attention sinks).
        `alibi_slopes` (a buffer, None unless a model sets this rank's heads' float32 slopes): each
        score biased by slope x (key position - query position) (BLOOM's and MPT's ALiBi)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window, self.softcap, self.chunk = window, softcap, chunk
        self.alibi_slopes: torch.Tensor | None
        self.register_buffer("alibi_slopes", None, persistent=False)
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = self._sinks_loader  # type: ignore[attr-defined]
        self.backend = backend
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # Its place among the model's layers, for the compiled pass's op. A tensor, not an int: dynamo
        # would guard on an int attribute and compile one graph per layer where a layer compiled alone
        # (`ModelRunner._compile`) serves all of them; a buffer is a graph input. On the CPU whatever
        # the model's device, so that the op reads it without a device sync.
        self.register_buffer("layer_index", torch.tensor(layer_index, device="cpu"), persistent=False)

    def _sinks_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's query heads' sinks (heads split across ranks in order)."""
        start = get_tp_rank() * self.num_heads
        param.data.copy_(loaded.narrow(0, start, self.num_heads))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if torch.compiler.is_compiling():
            return torch.ops.pagedserve.attention(q, k, v, self.layer_index)
        return self.attend(q, k, v, metadata)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Write this step's k, v into the cache, then attend: [num_tokens, num_heads * head_dim]. k and
        v of no rows write nothing: another layer's queries read this one's cache (Gemma 4's KV-shared
        layers, after this layer wrote the step's keys and values)."""
        assert self.kv_cache is not None, (
            "KV cache not bound: the model runner binds it before the first step"
        )
        k_cache, v_cache = self.kv_cache
        if k.shape[0]:
            self.backend.write_kv_cache(k, v, k_cache, v_cache, metadata.slot_mapping)
        if self.chunk:
            metadata = metadata.chunk_local(self.chunk, k_cache.shape[1])
        # (the sinks stay float32 whatever the model's dtype: the kernels take them so)
        sinks = None if self.sinks is None else self.sinks.float()
        num_decodes, scale = metadata.num_decodes, self.scale
        limits = (self.window, self.softcap, sinks, self.alibi_slopes)
        if metadata.num_prefills == 0:
            out = self.backend.decode(q, k_cache, v_cache, metadata, scale, *limits)
        else:
            out = torch.empty_like(q)
            if num_decodes:
                out[:num_decodes] = self.backend.decode(
                    q[:num_decodes], k_cache, v_cache, metadata, scale, *limits
                )
            out[num_decodes:] = self.backend.prefill(
                q[num_decodes:], k_cache, v_cache, metadata, scale, *limits
            )
        return out.view(-1, self.num_heads * self.head_dim)


# -- the torch.compile boundary -------------------------------------------------------------------
# A compiled forward pass (see `ModelRunner`) leaves attention out of the graph, as one opaque op per
# layer: the step's metadata (block tables, Python ints that change every step) would otherwise be
# traced, guarded on and recompiled for, and the cache writes would be functionalized into copies of
# the whole cache. The op finds the step's metadata and the model's attention layers in
# `step_metadata`, and its layer among them by its index in the model (a graph input): two models of
# the same shapes trace to the same graph, which torch's on-disk cache then serves to both, and to the
# next start of a server; so do the layers of one model, compiled one at a time. It is declared free
# of mutations because the caches it writes are not graph inputs: nothing in the graph reads them, so
# no ordering is lost.

_step: tuple[AttentionMetadata, Sequence[Attention]] | None = None


@contextlib.contextmanager
def step_metadata(metadata: AttentionMetadata, layers: Sequence[Attention]) -> Iterator[None]:
    """The metadata, and the model's attention layers in order, that the compiled forward pass's
    attention ops read during one step."""
    global _step
    _step = metadata, layers
    try:
        yield
    finally:
        _step = None


# Defined through torch.library's low-level API rather than `torch.library.custom_op`, whose wrapper
# (dynamo guard, aliasing checks) cost 8 us a call: 0.23 ms a 30-layer step (bench/README.md). The
# schema has no alias annotations, so the op is functional to the compiler, as the comment above needs.
_LIBRARY = torch.library.Library("pagedserve", "FRAGMENT")
_LIBRARY.define("attention(Tensor q, Tensor k, Tensor v, Tensor layer_index) -> Tensor")


def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: torch.Tensor
) -> torch.Tensor:
    assert _step is not None, "a compiled forward pass runs inside step_metadata()"
    metadata, layers = _step
    return layers[int(layer_index)].attend(q, k, v, metadata)


_LIBRARY.impl("attention", _attention_op, "CompositeExplicitAutograd")  # every device, not traced into


@torch.library.register_fake("pagedserve::attention", lib=_LIBRARY)
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
