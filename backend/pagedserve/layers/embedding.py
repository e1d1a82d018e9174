"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pagedserve_kernels import cpu as cpu_kernels
from torch import nn

from pagedserve.distributed import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size
from pagedserve.layers.linear import linear, pack_weight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.vocab_per_rank = -(-vocab_size // self.tp_size)  # the last shard is zero-padded
        self.vocab_size = vocab_size
        self.vocab_start = self.tp_rank * self.vocab_per_rank
        self.weight = nn.Parameter(torch.zeros(self.vocab_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded[self.vocab_start : self.vocab_start + self.vocab_per_rank]
        param.data[: shard.shape[0]].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary, gathered from each rank's slice. A packed copy of the weight
    (see `layers.linear`) sits beside the plain one, which a tied input embedding still reads. `bias`:
    a logit bias a token (Phi-2's), each rank its slice."""

    packed_weight: torch.Tensor | None = None

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False) -> None:
        super().__init__(vocab_size, hidden_size)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.vocab_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def pack_weights(self, batch_size_hint: int) -> None:
        self.packed_weight = pack_weight(self.weight, batch_size_hint)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = linear(hidden, self.weight, self.packed_weight, self.bias)
        return all_gather_last_dim(local)[..., : self.vocab_size]

    def greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of `compute_logits(hidden)` (the first maximum, NaN first), taken by the
        AMX or AVX512-BF16 kernel as it computes them, without the logits: on one rank, where the weight
        is in their tiles or panels and there is no bias. None elsewhere."""
        if self.tp_size != 1 or self.packed_weight is None or self.bias is not None:
            return None
        if self.packed_weight.dim() == 5:
            return cpu_kernels.linear_argmax_amx(hidden, self.packed_weight, self.vocab_size)
        if self.packed_weight.dim() == 4:
            return cpu_kernels.linear_argmax_avx512(hidden, self.packed_weight, self.vocab_size)
        return None
