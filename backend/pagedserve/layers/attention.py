"""Paged attention: write this step's K/V into the cache, then attend through block tables.

The packed batch puts decode tokens (one query token per sequence) first, then the prefill tokens
(prompts, prompt chunks, recomputes), each sequence's tokens contiguous:

    tokens   [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]
              decodes     prefill seq 0  prefill seq 1

A backend implements the two attention calls; the torch reference and the Triton kernels share
the layouts described in `pagedserve_kernels.reference`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
from pagedserve_kernels import reference
from torch import nn


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int  # decode sequences come first, one token each
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, relative to the first prefill token
    prefill_context_lens: torch.Tensor  # [num_prefills] int32

    @property
    def num_prefills(self) -> int:
        return self.prefill_context_lens.shape[0]


class AttentionBackend(abc.ABC):
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
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...

    @abc.abstractmethod
    def prefill(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...


class TorchAttentionBackend(AttentionBackend):
    """The pure-torch reference (scaled_dot_product_attention over gathered blocks): CPU runs."""

    name = "torch"

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return reference.paged_attention_decode(query, k_cache, v_cache, block_tables, context_lens, scale)

    def prefill(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return reference.paged_attention_prefill(
            query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale
        )


class Attention(nn.Module):
    """Attention of one layer over its slice of the KV cache (`kv_cache` is bound by the model runner)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        assert self.kv_cache is not None, (
            "KV cache not bound: the model runner binds it before the first step"
        )
        k_cache, v_cache = self.kv_cache
        q = q.view(-1, self.num_heads, self.head_dim)
        self.backend.write_kv_cache(
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
            k_cache,
            v_cache,
            metadata.slot_mapping,
        )
        num_decodes = metadata.num_decodes
        if metadata.num_prefills == 0:
            out = self.backend.decode(
                q, k_cache, v_cache, metadata.decode_block_tables, metadata.decode_context_lens, self.scale
            )
        else:
            out = torch.empty_like(q)
            if num_decodes:
                out[:num_decodes] = self.backend.decode(
                    q[:num_decodes],
                    k_cache,
                    v_cache,
                    metadata.decode_block_tables,
                    metadata.decode_context_lens,
                    self.scale,
                )
            out[num_decodes:] = self.backend.prefill(
                q[num_decodes:],
                k_cache,
                v_cache,
                metadata.prefill_block_tables,
                metadata.prefill_query_start_loc,
                metadata.prefill_context_lens,
                self.scale,
            )
        return out.view(-1, self.num_heads * self.head_dim)
