"""Decode steps replayed from CUDA graphs (`worker.cuda_graphs`): the buckets, the padding of a step
into the static buffers, which steps replay (speculative drafts' rows too), greedy tokens equal to
the eager pass's, and the forward pass when a capture fails.

A CUDA graph needs a GPU. On CPU the engine runs with `EagerReplay`, whose "graph" runs the forward
pass again over the static buffers it was captured on, which is what a replay does: everything else
(the buckets, the padding, the model runner's choice of path) is the real code. On a GPU the same
workload runs with real graphs against enforce_eager.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from pagedserve import LLM, SamplingParams
from pagedserve.config import resolve_cuda_graphs
from pagedserve.layers.attention import AttentionMetadata
from pagedserve.settings import EngineSettings
from pagedserve.spec_decode import SpeculativeConfig
from pagedserve.worker.cuda_graphs import (
    CudaGraphs,
    capture_sizes,
    context_bucket,
    padded_batch_size,
)

MAX_NUM_SEQS = 8
# The output lengths make the batch shrink step by step, so most steps are padded, and the longest
# prompts finish first, so the batch's longest context falls from the 1,024-token bucket to 512's and
# then 256's.
PROMPT_LENS = [3, 17, 40, 90, 200, 250, 300, 520]
MAX_TOKENS = [48, 40, 33, 27, 20, 14, 9, 5]


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(128) == [1, 2, 4, *range(8, 129, 8)]


def test_padded_batch_size() -> None:
    sizes = capture_sizes(20)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 20)] == [
        1, 2, 4, 4, 8, 8, 16, 16, 20, 20,
    ]  # fmt: skip


def test_context_bucket() -> None:
    assert [context_bucket(n, 1024) for n in (1, 255, 256, 257, 512, 513, 1000, 1024)] == [
        256, 256, 256, 512, 512, 1024, 1024, 1024,
    ]  # fmt: skip
    assert context_bucket(700, 720) == 720  # never past what a block-table row holds


def test_cuda_graphs_only_on_gpus_with_triton_and_one_rank(tiny_llama_dir: str) -> None:
    assert resolve_cuda_graphs(False, "cuda", "triton", 1)
    assert resolve_cuda_graphs(False, "cuda:1", "triton", 1)
    assert not resolve_cuda_graphs(True, "cuda", "triton", 1)  # --enforce-eager
    assert not resolve_cuda_graphs(False, "cuda", "torch", 1)  # the reference's per-step plan
    assert not resolve_cuda_graphs(False, "cuda", "triton", 2)  # all-reduce in a graph: unverified
    assert not resolve_cuda_graphs(False, "cpu", "torch", 1)
    # the settings' choice on this host (on a GPU test_cuda_graphs_give_the_eager_tokens checks it is on)
    settings = EngineSettings(model=tiny_llama_dir, device="cpu", enforce_eager=False)
    assert not settings.to_engine_config().cuda_graphs


def decode_metadata(context_lens: list[int], tables: list[list[int]], slots: list[int]) -> AttentionMetadata:
    int32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=len(context_lens),
        decode_block_tables=int32(tables),
        decode_context_lens=int32(context_lens),
        prefill_block_tables=int32([[0] * len(tables[0])])[:0],
        prefill_query_start_loc=int32([0]),
        prefill_context_lens=int32([]),
        max_decode_context_len=max(context_lens),
    )


def test_fill_pads_the_step_and_resets_stale_rows() -> None:
    """A step of 3 after a step of 6: the padding row (3) gets slot -1 and one token of context; rows
    past the batch (4, 5) are not its inputs, whatever they hold."""
    graphs = CudaGraphs(lambda *_: torch.empty(0), torch.device("cpu"), 8, 32, 16)
    six = decode_metadata(
        [20, 21, 22, 23, 24, 25], [[i, i + 10] for i in range(6)], [100, 101, 102, 103, 104, 105]
    )
    graphs.fill(torch.arange(6) + 7, torch.arange(6) + 19, six, 8)
    assert graphs.slot_mapping.tolist() == [100, 101, 102, 103, 104, 105, -1, -1]
    assert graphs.context_lens.tolist() == [20, 21, 22, 23, 24, 25, 1, 1]

    three = decode_metadata([40, 41, 42], [[7], [8], [9]], [200, 201, 202])
    graphs.fill(torch.tensor([1, 2, 3]), torch.tensor([39, 40, 41]), three, 4)
    input_ids, positions, metadata = graphs.static_inputs(4, context_bucket(42, graphs.max_context))
    assert input_ids[:3].tolist() == [1, 2, 3] and positions[:3].tolist() == [39, 40, 41]
    assert metadata.slot_mapping.tolist() == [200, 201, 202, -1]
    assert metadata.decode_context_lens.tolist() == [40, 41, 42, 1]
    assert metadata.decode_block_tables[:3, 0].tolist() == [7, 8, 9]
    assert metadata.decode_block_tables.shape == (4, 32)
    assert (metadata.num_decodes, metadata.num_prefills, metadata.max_decode_context_len) == (4, 0, 256)


def test_only_decode_steps_that_fit_replay() -> None:
    """Steps with prompt tokens, or more decode rows than the buffers hold (speculative drafts), run
    the forward pass."""
    graphs = CudaGraphs(lambda *_: torch.empty(0), torch.device("cpu"), 4, 8, 16)
    assert graphs.can_run(decode_metadata([5] * 4, [[0]] * 4, [0, 1, 2, 3]))
    assert not graphs.can_run(decode_metadata([5] * 5, [[0]] * 5, [0, 1, 2, 3, 4]))
    with_prompt = decode_metadata([5], [[0]], [0])
    with_prompt.prefill_context_lens = torch.tensor([3], dtype=torch.int32)
    assert not graphs.can_run(with_prompt)


class EagerGraph:
    """What a captured graph does on replay, on a CPU: run the forward pass over the static buffers,
    deriving again whatever it derives from them (chunked attention's views of the step)."""

    def __init__(self, run: Callable[[], torch.Tensor]) -> None:
        self.graph, self.run, self.hidden = self, run, torch.empty(0)

    def replay(self) -> None:
        self.hidden = self.run()


class EagerReplay(CudaGraphs):
    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.captured: list[tuple[int, int]] = []

    def _capture(self, batch: int, context: int) -> EagerGraph:  # type: ignore[override]
        self.captured.append((batch, context))
        return EagerGraph(lambda: self.forward(*self.static_inputs(batch, context)))


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in PROMPT_LENS]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    return prompts, params


def engine(model_dir: str, device: str, enforce_eager: bool, **settings: object) -> LLM:
    return LLM(
        model=model_dir,
        dtype="float32",
        device=device,
        enforce_eager=enforce_eager,
        block_size=16,
        num_kv_blocks=128,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=1024,
        **settings,
    )


def greedy_token_ids(llm: LLM) -> list[list[int]]:
    prompts, params = workload()
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def tiny_llama4(tmp_path: Path, tokenizer_dir: str) -> str:
    """A Llama 4 whose layer 0 attends within chunks of 32 positions (two blocks of 16), layer 1
    (NoPE) over everything: the workload's decodes cross chunks."""
    from tiny_models import build_tiny_llama

    return build_tiny_llama(
        tmp_path / "llama4",
        tokenizer_dir,
        config_class="Llama4TextConfig",
        intermediate_size_mlp=96,
        num_local_experts=2,
        no_rope_layers=[1, 0],
        attention_chunk_size=32,
    )


def test_padded_replays_give_the_eager_tokens(tiny_llama_dir: str) -> None:
    expected = greedy_token_ids(engine(tiny_llama_dir, "cpu", enforce_eager=True))
    llm = engine(tiny_llama_dir, "cpu", enforce_eager=True)
    runner = llm.engine.executor.worker.model_runner
    runner.fused_decode = None  # AVX512-BF16 hosts: bfloat16 only, but said outright
    replay = EagerReplay(runner.forward, runner.device, MAX_NUM_SEQS, runner.max_blocks_per_seq, 16)
    runner.cuda_graphs = replay

    assert greedy_token_ids(llm) == expected
    # every batch size from 8 down, padded to 8, 4, 2, 1, in three context buckets
    assert {batch for batch, _ in replay.captured} == {8, 4, 2, 1}
    assert {context for _, context in replay.captured} == {256, 512, 1024}


def test_chunked_attention_replays_give_the_eager_tokens(default_model_dir: str, tmp_path: Path) -> None:
    """Llama 4's chunked attention views the step (its decode rows' block tables shifted to their
    chunks, contexts cut) from the static buffers, padding rows and all, at every replay."""
    model_dir = tiny_llama4(tmp_path, default_model_dir)
    expected = greedy_token_ids(engine(model_dir, "cpu", enforce_eager=True))
    llm = engine(model_dir, "cpu", enforce_eager=True)
    runner = llm.engine.executor.worker.model_runner
    assert runner.attention_chunks == [32]
    replay = EagerReplay(runner.forward, runner.device, MAX_NUM_SEQS, runner.max_blocks_per_seq, 16)
    runner.cuda_graphs = replay

    assert greedy_token_ids(llm) == expected
    assert {batch for batch, _ in replay.captured} == {8, 4, 2, 1}


def test_draft_rows_replay_with_the_tokens_drafts_leave_unchanged(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculative decoding: a step verifying drafts is a decode step of a row per draft, which
    replays while the rows fit (two sequences, up to three drafts each: up to 8 rows). Drafts from an
    oracle (the eager run's tokens, every third one wrong), so some are accepted and some rejected."""
    from spec_drafts import oracle_proposer

    prompts, params = workload()
    prompts, params = prompts[4:6], params[4:6]  # 200 and 250 prompt tokens, 20 and 14 new
    plain = engine(tiny_llama_dir, "cpu", enforce_eager=True)
    expected = [out.outputs[0].token_ids for out in plain.generate(prompts, params)]
    reference = [(p, list(ids)) for p, ids in zip(prompts, expected, strict=True)]
    monkeypatch.setattr(SpeculativeConfig, "propose", oracle_proposer(reference))
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    llm = engine(tiny_llama_dir, "cpu", enforce_eager=True, speculative_config=ngram)
    runner = llm.engine.executor.worker.model_runner
    runner.fused_decode = None
    replay = EagerReplay(runner.forward, runner.device, MAX_NUM_SEQS, runner.max_blocks_per_seq, 16)
    runner.cuda_graphs = replay

    assert [out.outputs[0].token_ids for out in llm.generate(prompts, params)] == expected
    stats = llm.engine.stats()
    assert stats.num_draft_tokens > stats.num_accepted_draft_tokens > 0
    assert max(batch for batch, _ in replay.captured) > 2  # rows for drafts, not only a row a sequence


class FailingCapture(EagerReplay):
    def _capture(self, batch: int, context: int) -> EagerGraph:  # type: ignore[override]
        super()._capture(batch, context)
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_falls_back_to_the_forward_pass(
    tiny_llama_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    expected = greedy_token_ids(engine(tiny_llama_dir, "cpu", enforce_eager=True))
    llm = engine(tiny_llama_dir, "cpu", enforce_eager=True)
    runner = llm.engine.executor.worker.model_runner
    runner.fused_decode = None
    failing = FailingCapture(runner.forward, runner.device, MAX_NUM_SEQS, runner.max_blocks_per_seq, 16)
    runner.cuda_graphs = failing

    with caplog.at_level("WARNING", logger="pagedserve.worker.cuda_graphs"):
        assert greedy_token_ids(llm) == expected
    assert failing.failed and failing.captured == [(8, 1024)]  # one try, then the forward pass alone
    assert "CUDA graph capture failed" in caplog.text and "stream is capturing" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("model", ["llama", "llama4-chunked"])
def test_cuda_graphs_give_the_eager_tokens(
    tiny_llama_dir: str, default_model_dir: str, tmp_path: Path, model: str
) -> None:
    """Llama 4's chunked attention derives its view of the step inside the graph (captured on
    metadata of the capture's own), so every replay derives it again."""
    model_dir = tiny_llama_dir if model == "llama" else tiny_llama4(tmp_path, default_model_dir)
    expected = greedy_token_ids(engine(model_dir, "cuda", enforce_eager=True))
    llm = engine(model_dir, "cuda", enforce_eager=False)
    graphs = llm.engine.executor.worker.model_runner.cuda_graphs
    assert graphs is not None

    assert greedy_token_ids(llm) == expected
    assert {batch for batch, _ in graphs.graphs} == {8, 4, 2, 1}
    assert {context for _, context in graphs.graphs} == {256, 512, 1024}
    captured = dict(graphs.graphs)
    assert greedy_token_ids(llm) == expected  # the same graphs replayed, none captured again
    assert graphs.graphs == captured
