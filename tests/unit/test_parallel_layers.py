"""Parallel layers on real gloo ranks against their unsharded selves: each rank loads full checkpoint
tensors through the weight loaders and must reproduce its slice (column-parallel) or the whole
output (row-parallel, embedding, LM head). Four ranks cover KV-head replication (2 KV heads) and a
padded vocabulary (10 tokens). Also: a collective whose peer never answers fails within its timeout."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from pagedserve import distributed
from pagedserve.distributed import CollectiveError
from pagedserve.launch import LaunchEnv
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, INTER, VOCAB = 32, 8, 4, 2, 24, 10
TIMEOUT_S = 2.0


def run_ranks(target: Callable[..., None], world_size: int, *args: object) -> list[int | None]:
    """Run `target(rank, world_size, store_port, *args)` in `world_size` fresh processes; exit codes."""
    store = distributed.create_store(world_size, 60.0)
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=target, args=(rank, world_size, store.port, *args)) for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    return [proc.exitcode for proc in procs]


def _join(rank: int, world_size: int, store_port: int, timeout_s: float = 60.0) -> None:
    store = distributed.connect_store("127.0.0.1", store_port, 60.0)
    launch = LaunchEnv(rank, world_size, rank, world_size)
    distributed.init_tensor_parallel(launch, "gloo", timeout_s, 60.0, store)


def _check_layers(rank: int, world_size: int, store_port: int) -> None:
    _join(rank, world_size, store_port)
    torch.manual_seed(0)  # every rank draws the same full weights and inputs
    x = torch.randn(5, HIDDEN)
    _check_qkv(x, rank, world_size)
    _check_gate_up(x, rank, world_size)
    _check_row(rank, world_size)
    _check_vocab(rank, world_size)
    distributed.destroy_tensor_parallel()


def _check_qkv(x: torch.Tensor, rank: int, world_size: int) -> None:
    q_w, q_b = torch.randn(NUM_HEADS * HEAD_DIM, HIDDEN), torch.randn(NUM_HEADS * HEAD_DIM)
    k_w, k_b = torch.randn(NUM_KV_HEADS * HEAD_DIM, HIDDEN), torch.randn(NUM_KV_HEADS * HEAD_DIM)
    v_w, v_b = torch.randn(NUM_KV_HEADS * HEAD_DIM, HIDDEN), torch.randn(NUM_KV_HEADS * HEAD_DIM)
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, bias=True)
    assert layer.bias is not None
    for shard_id, w, b in (("q", q_w, q_b), ("k", k_w, k_b), ("v", v_w, v_b)):
        layer.weight_loader(layer.weight, w, shard_id)
        layer.weight_loader(layer.bias, b, shard_id)
    heads_per_rank = NUM_HEADS // world_size
    kv_head = rank * heads_per_rank * NUM_KV_HEADS // NUM_HEADS  # the KV head of this rank's queries
    kv_heads = range(kv_head, kv_head + max(1, NUM_KV_HEADS // world_size))
    q_rows = _head_rows(range(rank * heads_per_rank, (rank + 1) * heads_per_rank))
    expected = torch.cat(
        [
            F.linear(x, q_w[q_rows], q_b[q_rows]),
            F.linear(x, k_w[_head_rows(kv_heads)], k_b[_head_rows(kv_heads)]),
            F.linear(x, v_w[_head_rows(kv_heads)], v_b[_head_rows(kv_heads)]),
        ],
        dim=-1,
    )
    torch.testing.assert_close(layer(x), expected)


def _head_rows(heads: range) -> list[int]:
    return [h * HEAD_DIM + d for h in heads for d in range(HEAD_DIM)]


def _check_gate_up(x: torch.Tensor, rank: int, world_size: int) -> None:
    gate, up = torch.randn(INTER, HIDDEN), torch.randn(INTER, HIDDEN)
    layer = MergedColumnParallelLinear(HIDDEN, [INTER, INTER])
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    shard = INTER // world_size
    rows = slice(rank * shard, (rank + 1) * shard)
    torch.testing.assert_close(layer(x), torch.cat([F.linear(x, gate[rows]), F.linear(x, up[rows])], -1))


def _check_row(rank: int, world_size: int) -> None:
    w, b, x = torch.randn(HIDDEN, INTER), torch.randn(HIDDEN), torch.randn(5, INTER)
    layer = RowParallelLinear(INTER, HIDDEN, bias=True)
    layer.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)  # type: ignore[union-attr]
    shard = INTER // world_size
    torch.testing.assert_close(layer(x[:, rank * shard : (rank + 1) * shard]), F.linear(x, w, b))


def _check_vocab(rank: int, world_size: int) -> None:
    table, ids, hidden = torch.randn(VOCAB, HIDDEN), torch.arange(VOCAB).flip(0), torch.randn(3, HIDDEN)
    embedding, head = VocabParallelEmbedding(VOCAB, HIDDEN), ParallelLMHead(VOCAB, HIDDEN)
    for layer in (embedding, head):
        layer.weight_loader(layer.weight, table)
    torch.testing.assert_close(embedding(ids), F.embedding(ids, table))
    torch.testing.assert_close(head.compute_logits(hidden), F.linear(hidden, table))


def _check_timeout(rank: int, world_size: int, store_port: int) -> None:
    _join(rank, world_size, store_port, timeout_s=TIMEOUT_S)
    try:
        if rank == 0:
            _expect_timeout()
        else:
            time.sleep(TIMEOUT_S + 1.0)  # never answers rank 0's all-reduce
    finally:
        distributed.destroy_tensor_parallel()  # a group left with a timed-out op aborts at exit


def _expect_timeout() -> None:
    start = time.monotonic()
    try:
        distributed.all_reduce(torch.ones(4))
    except CollectiveError as exc:
        assert "Timed out" in str(exc), exc
    else:
        raise AssertionError("the all-reduce returned without its peer")
    assert TIMEOUT_S * 0.9 <= time.monotonic() - start < TIMEOUT_S + 2.0


def test_parallel_layers_match_unsharded_on_four_ranks() -> None:
    assert run_ranks(_check_layers, 4) == [0, 0, 0, 0]


def test_parallel_layers_match_unsharded_on_two_ranks() -> None:
    assert run_ranks(_check_layers, 2) == [0, 0]


def test_collective_with_a_silent_peer_fails_within_its_timeout() -> None:
    assert run_ranks(_check_timeout, 2) == [0, 0]


def test_without_process_groups_everything_is_one_rank() -> None:
    assert (distributed.get_tp_size(), distributed.get_tp_rank()) == (1, 0)
    x = torch.randn(3, 4)
    assert distributed.all_reduce(x) is x
    assert distributed.all_gather_last_dim(x) is x
    assert distributed.all_reduce_min(7) == 7
    assert distributed.broadcast_object({"a": 1}) == {"a": 1}


def test_one_ranks_row_parallel_bias_is_rounded_with_the_product_as_f_linear_rounds_it() -> None:
    """On one rank the bias goes into the product (one rounding, F.linear's and PEFT's base layer's),
    not onto its bfloat16 result (two): an o_proj's or down_proj's bias rounded twice put a dots.llm1
    token 1.7 below float32's best where transformers' bfloat16 sat 0.03 below it."""
    generator = torch.Generator().manual_seed(0)
    layer = RowParallelLinear(INTER, HIDDEN, bias=True)
    for param in layer.parameters():
        param.data = torch.randn(param.shape, generator=generator).to(torch.bfloat16)
    x = torch.randn(64, INTER, generator=generator).to(torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert not torch.equal(layer(x), F.linear(x, layer.weight) + layer.bias)  # (the two differ here)
