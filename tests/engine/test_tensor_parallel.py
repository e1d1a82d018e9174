"""Tensor parallelism on CPU with gloo: greedy outputs equal single-rank outputs token for token (also
under swap preemption, chunked prefill and prefix caching, and with KV heads replicated), a rank
killed mid-generation fails the engine with `EngineDeadError` in bounded time and leaves no process
behind, and sizes that cannot split the heads fail before any rank starts.

Token ids must be equal, with no allowance for near-ties; the sampled tokens' logprobs must agree
within LOGPROB_ATOL (a different all-reduce summation order moves float32 logits by rounding only).
A failure names the first diverging position and the single-rank top-2 logprob gap there."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from pagedserve import LLM, PoolingParams, SamplingParams
from pagedserve.distributed import get_tp_size
from pagedserve.errors import EngineDeadError
from pagedserve.outputs import TokenLogprobs

LOGPROB_ATOL = 1e-3
MAX_TOKENS = 32
DEAD_WITHIN_S = 60.0


@dataclass
class Reference:
    """A single-rank greedy run, with the top-2 logprobs of every generated token."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs]]


def tiny_prompts() -> list[list[int]]:
    """Mixed lengths; the first four share a 40-token prefix (five full blocks of 8: prefix-cache hits)."""
    system = [1, *range(400, 440)]
    shared = [system + list(range(1000 + 13 * i, 1003 + 18 * i)) for i in range(4)]
    alone = [[1, *range(100 + 7 * i, 103 + 7 * i + 11 * i)] for i in range(4)]
    return shared + alone


def greedy(max_tokens: int = MAX_TOKENS, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def single_rank_reference(model_dir: str, prompts: list[list[int]], **settings: object) -> Reference:
    return greedy_reference(LLM(model=model_dir, dtype="float32", **settings), prompts)


def greedy_reference(llm: LLM, prompts: list[list[int]]) -> Reference:
    outputs = [r.outputs[0] for r in llm.generate(prompts, greedy(logprobs=2))]
    return Reference([o.token_ids for o in outputs], [o.logprobs or [] for o in outputs])


def assert_matches_reference(ours: Reference, reference: Reference) -> None:
    """Token-for-token equal to the single-rank run, with the sampled tokens' logprobs close."""
    rows = zip(ours.token_ids, ours.logprobs, reference.token_ids, reference.logprobs, strict=True)
    for i, (ids, logprobs, expected_ids, expected_logprobs) in enumerate(rows):
        assert len(ids) == len(expected_ids) == MAX_TOKENS
        if ids != expected_ids:
            pos = next(j for j, (x, y) in enumerate(zip(ids, expected_ids)) if x != y)
            top = sorted((lp.logprob for lp in expected_logprobs[pos].values()), reverse=True)
            pytest.fail(
                f"prompt {i}: tensor-parallel output diverged at token {pos} ({ids[pos]} vs "
                f"{expected_ids[pos]}); the single-rank top-2 logprob gap there is {top[0] - top[1]:.2e}"
            )
        for pos, token_id in enumerate(ids):
            got, expected = logprobs[pos][token_id].logprob, expected_logprobs[pos][token_id].logprob
            assert abs(got - expected) < LOGPROB_ATOL, f"prompt {i}, token {pos}: logprob {got} vs {expected}"


@contextlib.contextmanager
def tensor_parallel_llm(model_dir: str, tp: int, **settings: object) -> Iterator[LLM]:
    llm = LLM(model=model_dir, dtype="float32", tensor_parallel_size=tp, **settings)
    pids = llm.engine.executor.worker_pids  # type: ignore[attr-defined]
    assert len(pids) == tp - 1
    try:
        yield llm
    finally:
        llm.engine.executor.shutdown()
        assert_all_exited(pids)
        assert get_tp_size() == 1  # the process groups are gone: another engine can start here
    with pytest.raises(EngineDeadError, match="shut down"):  # not a silent single-rank step
        llm.generate([[1, 2, 3]], greedy(max_tokens=2))


def running(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
    return alive


def assert_all_exited(pids: list[int]) -> None:
    assert not running(pids), f"worker processes still running: {running(pids)}"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return tiny_prompts()


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama_dir: str, prompts: list[list[int]]) -> Reference:
    return single_rank_reference(tiny_llama_dir, prompts, num_kv_blocks=256, block_size=8)


def test_tp2_matches_single_rank(
    tiny_llama_dir: str, prompts: list[list[int]], tiny_reference: Reference
) -> None:
    with tensor_parallel_llm(tiny_llama_dir, 2, num_kv_blocks=256, block_size=8) as llm:
        executor = llm.engine.executor
        assert executor.tensor_parallel_size == 2
        assert executor.num_kv_blocks == 256
        assert executor.worker.num_kv_heads == 1  # type: ignore[attr-defined]  # 2 KV heads split 2 ways
        # the first request alone fills the prefix cache the others then hit, on every rank
        assert_matches_reference(greedy_reference(llm, prompts[:1]), _subset(tiny_reference, slice(0, 1)))
        assert_matches_reference(greedy_reference(llm, prompts), tiny_reference)
        assert llm.engine.stats().num_prefix_hits >= 3 * 40


def test_tp2_matches_single_rank_under_swap_and_chunked_prefill(
    tiny_llama_dir: str, prompts: list[list[int]], tiny_reference: Reference
) -> None:
    # a 24-token budget splits prompts into chunks; 24 blocks of 8 cannot hold all 8 requests
    settings = {"num_kv_blocks": 24, "block_size": 8, "max_num_batched_tokens": 24, "max_num_seqs": 8}
    with tensor_parallel_llm(tiny_llama_dir, 2, **settings) as llm:
        assert_matches_reference(greedy_reference(llm, prompts), tiny_reference)
        stats = llm.engine.stats()
        assert stats.num_swap_preemptions > 0
        assert stats.num_swapped_in_blocks > 0
        assert stats.num_free_blocks == 24
        # embeddings: the final hidden states every rank holds whole, pooled as one rank pools them
        pooling = [PoolingParams("mean"), PoolingParams("last")] * (len(prompts) // 2)
        ours = [out.outputs.embedding for out in llm.embed(prompts, pooling)]
    single_rank = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, block_size=8)
    expected = [out.outputs.embedding for out in single_rank.embed(prompts, pooling)]
    for got, want in zip(ours, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_tp4_replicates_kv_heads(
    tiny_llama_dir: str, prompts: list[list[int]], tiny_reference: Reference
) -> None:
    with tensor_parallel_llm(tiny_llama_dir, 4, num_kv_blocks=256, block_size=8) as llm:
        # 2 KV heads on 4 ranks: each rank keeps the one its 1 query head uses
        assert llm.engine.executor.worker.num_kv_heads == 1  # type: ignore[attr-defined]
        assert_matches_reference(
            greedy_reference(llm, prompts[::2]), _subset(tiny_reference, slice(None, None, 2))
        )


def test_tp2_qwen3_splits_heads_and_keeps_their_norms_whole(
    tmp_path: Path, default_model_dir: str, prompts: list[list[int]]
) -> None:
    """Qwen3: each rank norms its own query and key heads with the whole (replicated) head norms, and
    biases its slice of q, k and v (`attention_bias`)."""
    from tiny_models import build_tiny_llama

    model_dir = build_tiny_llama(
        tmp_path / "qwen3", default_model_dir, config_class="Qwen3Config", attention_bias=True
    )
    reference = single_rank_reference(model_dir, prompts, num_kv_blocks=256, block_size=8)
    with tensor_parallel_llm(model_dir, 2, num_kv_blocks=256, block_size=8) as llm:
        assert llm.engine.executor.worker.num_kv_heads == 1  # type: ignore[attr-defined]
        assert_matches_reference(greedy_reference(llm, prompts), reference)


@pytest.mark.parametrize(
    ("config_class", "overrides"),
    [
        # q, k and v cut from one checkpoint tensor, then each rank's heads from each part; and a
        # rotary over the first half of each head
        (
            "Phi3Config",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        ),
        # every multiplier, and the o and down projections' biases, added once after the all-reduce
        (
            "GraniteConfig",
            {
                "embedding_multiplier": 12.0,
                "attention_multiplier": 0.1,
                "residual_multiplier": 0.22,
                "logits_scaling": 8.0,
                "attention_bias": True,
                "mlp_bias": True,
            },
        ),
        # each rank's heads normed and turned by the local or the global rope, a local layer's window
        (
            "Gemma3TextConfig",
            {"query_pre_attn_scalar": 10, "sliding_window": 12, "sliding_window_pattern": 2},
        ),
        # each rank's share of every expert's intermediate features and of the shared expert's,
        # summed under the router's weights and the shared expert's gate, reduced once; a dense layer
        (
            "Qwen2MoeConfig",
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 48,
                "mlp_only_layers": [1],
            },
        ),
        # GPT-OSS: each rank's heads' sinks; each rank's share of every expert's biased, clamped
        # SwiGLU, the down projections' biases added once (by rank 0); layer 0 sliding
        (
            "GptOssConfig",
            {
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "sliding_window": 12,
                "swiglu_limit": 2.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        # OLMo 3: q normed over all four heads of both ranks, k over its one KV head (on both ranks:
        # each sums its copy), a rank's share of each norm's weight; layers 0-2 sliding
        ("Olmo3Config", {"num_kv_heads": 1, "num_layers": 4, "sliding_window": 12}),
        # GLM-4: each rank's heads' q and k rows reordered for GPT-J's rotary over half of each head,
        # the norms after attention and the MLP
        ("Glm4Config", {}),
        # GLM-4.5: the float32 router and its picking bias whole on each rank, each rank's share of
        # every expert's and of the ungated shared expert's intermediate features, layer 0 dense
        (
            "Glm4MoeConfig",
            {
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "n_group": 4,
                "topk_group": 2,
                "routed_scaling_factor": 2.5,
                "moe_intermediate_size": 16,
                "first_k_dense_replace": 1,
            },
        ),
        # StarCoder2: each rank's share of the ungated MLP's biased up projection, the down one's bias
        # added once; LayerNorms with biases whole on each rank; a window
        ("Starcoder2Config", {"sliding_window": 12}),
        # Apertus: xIELU's parameters whole on each rank, each rank's heads normed
        ("ApertusConfig", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}),
        # GPT-NeoX: each rank's heads cut from the fused query_key_value, attention and the MLP side by
        # side on their two norms
        ("GPTNeoXConfig", {"num_kv_heads": 4}),
        # Command R+: each rank's query heads' rows of the head norms' weights, the one KV head's row
        # on both ranks, reordered for GPT-J's rotary as q's and k's rows are
        ("CohereConfig", {"num_kv_heads": 1, "use_qk_norm": True}),
        # MiniMax-M2: q and k normed over all heads of both ranks, a rank's share of each norm's weight;
        # the float32 router and its picking bias whole on each rank; NeoX's rotary over half a head
        # GPT-2: each rank's heads' rows cut from the fused, transposed c_attn, the learned position
        # embeddings whole on each rank; GPTBigCode's one KV head on both ranks; OPT's offset positions
        # Gemma 4: the full layers' one KV head of 32 held twice (one a rank), the sliding layers' two
        # of 16 each twice (two a rank): one entry size on each rank; their values their keys'; each
        # rank's share of every expert beside the dense MLP, the router whole on each; each rank's
        # vocabulary rows of the per-layer embeddings; layers 2 and 3 reading layers 0's and 1's KV
        # caches, each rank its heads'
        (
            "Gemma4TextConfig",
            {
                "num_layers": 4,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "global_head_dim": 32,
                "num_global_key_value_heads": 1,
                "attention_k_eq_v": True,
                "sliding_window": 12,
                "hidden_size_per_layer_input": 8,
                "vocab_size_per_layer_input": 49152,
                "num_kv_shared_layers": 2,
                "enable_moe_block": True,
                "num_experts": 4,
                "top_k_experts": 2,
                "moe_intermediate_size": 32,
            },
        ),
        # Gemma 3n: the sparse layers' gates cut at a mean and deviation over both ranks' halves of the
        # gate; AltUp's and LAuReL's weights whole on each rank; layers 3 and 4 reading 2's and 1's caches
        (
            "Gemma3nTextConfig",
            {
                "num_layers": 5,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]
                + ["sliding_attention", "full_attention"],
                "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0, 0.0],
                "sliding_window": 12,
                "hidden_size_per_layer_input": 8,
                "vocab_size_per_layer_input": 1000,
                "laurel_rank": 8,
                "num_kv_shared_layers": 2,
            },
        ),
        # MiniMax-Text-01: each rank its lightning heads (their rows of qkv_proj and output_gate, their
        # decay rates and states), their outputs normed over both ranks' heads
        (
            "MiniMaxConfig",
            {
                "num_layers": 3,
                "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                "num_local_experts": 4,
                "full_attn_alpha_factor": 1.7,
                "linear_attn_beta_factor": 0.8,
            },
        ),
        # LFM3: each rank its convolution channels (7 taps), its heads' gates, both ropes' tables whole
        (
            "Lfm3Config",
            {
                "num_layers": 3,
                "layer_types": ["conv", "sliding_attention", "full_attention"],
                "sliding_window": 12,
            },
        ),
        ("GPT2Config", {}),
        ("GPTBigCodeConfig", {}),
        ("OPTConfig", {"ffn_dim": 96, "word_embed_proj_dim": 64}),
        ("BioGptConfig", {"num_kv_heads": 4}),
        (
            "MiniMaxM2Config",
            {"rotary_dim": 8, "num_local_experts": 8, "num_experts_per_tok": 2},
        ),
        # each rank's heads biased by their own ALiBi slopes (BLOOM's; MPT's), BLOOM's fused heads
        # and embedding norm, MPT's Wqkv and unbiased norms
        # Persimmon's head LayerNorms (one weight for all heads, whole on every rank), its fused heads
        ("PersimmonConfig", {"num_kv_heads": 4}),
        # Hunyuan-A13B's experts beside a shared MLP (each split across the ranks), the router whole
        ("HunYuanMoEV1Config", {"num_experts": 4, "moe_topk": 2}),
        # StableLM 2 12B's head norms: each rank its heads' rows (2 KV heads, one a rank)
        ("StableLmConfig", {"qk_layernorm": True, "use_parallel_residual": True}),
        ("BloomConfig", {}),
        ("MptConfig", {}),
        # DBRX's Wqkv cut into each rank's heads (2 KV heads: one a rank), clamped; its experts' shared
        # rows cut into experts, each split across the ranks
        (
            "DbrxConfig",
            {
                "d_model": 64,  # (DbrxConfig sizes its experts by d_model, not by hidden_size)
                "attn_config": {"clip_qkv": 2.0, "kv_n_heads": 2, "rope_theta": 10000.0},
                "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
            },
        ),
        # Phi-3.5-MoE's sparsemixer routing (the same picks on every rank), each rank's slice of the LM
        # head's bias, LayerNorms with biases
        (
            "PhimoeConfig",
            {
                "num_local_experts": 4,
                "attention_bias": True,
                "lm_head_bias": True,
                "router_jitter_noise": 0.3,
            },
        ),
        # each rank's heads attending within chunks of 16 (two blocks of 8) in layer 0, layer 1 NoPE
        # with its query temperature; experts in both
        (
            "Llama4TextConfig",
            {
                "intermediate_size_mlp": 96,
                "num_local_experts": 2,
                "no_rope_layers": [1, 0],
                "attention_chunk_size": 16,
                "floor_scale": 4,
            },
        ),
    ],
    ids=[
        "phi3",
        "granite",
        "gemma3",
        "qwen2-moe",
        "gpt-oss",
        "olmo3-one-kv-head",
        "glm4",
        "glm4-moe",
        "starcoder2",
        "apertus",
        "gpt-neox",
        "cohere-head-norms",
        "gemma4",
        "gemma3n",
        "minimax-lightning",
        "lfm3",
        "gpt2",
        "gpt-bigcode",
        "opt",
        "biogpt",
        "minimax-m2",
        "persimmon",
        "hunyuan-a13b",
        "stablelm-head-norms",
        "bloom",
        "mpt",
        "dbrx",
        "phimoe",
        "llama4-chunked",
    ],
)
def test_tp2_llama_family_layouts_match_single_rank(
    tmp_path: Path,
    default_model_dir: str,
    prompts: list[list[int]],
    config_class: str,
    overrides: dict[str, object],
) -> None:
    from tiny_models import build_tiny_llama

    model_dir = build_tiny_llama(
        tmp_path / "model", default_model_dir, config_class=config_class, **overrides
    )
    # (the default model's tokenizer, which every layout holds: read from one directory, each engine's
    # a copy of the first's rather than a load of its own)
    settings: dict[str, object] = {"num_kv_blocks": 256, "block_size": 8, "tokenizer": default_model_dir}
    reference = single_rank_reference(model_dir, prompts, **settings)
    with tensor_parallel_llm(model_dir, 2, **settings) as llm:
        assert_matches_reference(greedy_reference(llm, prompts), reference)


def test_tp2_zamba2_shared_blocks_and_adapters_match_single_rank(
    tmp_path: Path, default_model_dir: str, prompts: list[list[int]]
) -> None:
    """Zamba2: each rank its Mamba2 heads and groups, its heads of the two shared blocks (taken in turn
    by three hybrid layers, each with a KV cache of its own) and its rows of every adapter's up
    projection (q's, k's, v's heads 2 x hidden_size wide, as its adapters need them)."""
    from tiny_models import save_tiny_model
    from transformers import Zamba2Config

    config = Zamba2Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        layers_block_type=["mamba", "hybrid"] * 3,
        num_mem_blocks=2,
        use_shared_attention_adapter=True,
        adapter_rank=8,
        use_mem_rope=True,
        n_mamba_heads=8,
        mamba_ngroups=2,
        mamba_d_state=16,
        chunk_size=32,
        max_position_embeddings=1024,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model_dir = save_tiny_model(tmp_path / "zamba2", default_model_dir, config)
    reference = single_rank_reference(model_dir, prompts, num_kv_blocks=256, block_size=8)
    with tensor_parallel_llm(model_dir, 2, num_kv_blocks=256, block_size=8) as llm:
        assert_matches_reference(greedy_reference(llm, prompts), reference)


def test_tp2_deepseek_latent_attention_matches_single_rank_under_swap_and_chunked_prefill(
    tmp_path: Path, default_model_dir: str, prompts: list[list[int]]
) -> None:
    """DeepSeek-V3's multi-head latent attention: each rank its query heads and their rows of q_b_proj,
    kv_b_proj and o_proj (o's bias added once), over a latent cache every rank holds whole (one KV
    head, written alike by each), swapped out and back under memory pressure, prompts in chunks;
    GLM-4.5's routing past the dense layer 0."""
    from tiny_models import DEEPSEEK_V3, build_tiny_llama

    model_dir = build_tiny_llama(
        tmp_path / "deepseek-v3",
        default_model_dir,
        config_class="DeepseekV3Config",
        **DEEPSEEK_V3,
        attention_bias=True,
    )
    reference = single_rank_reference(model_dir, prompts, num_kv_blocks=256, block_size=8)
    settings = {"num_kv_blocks": 24, "block_size": 8, "max_num_batched_tokens": 24, "max_num_seqs": 8}
    with tensor_parallel_llm(model_dir, 2, **settings) as llm:
        assert llm.engine.executor.worker.num_kv_heads == 1  # type: ignore[attr-defined]
        assert_matches_reference(greedy_reference(llm, prompts), reference)
        assert llm.engine.stats().num_swap_preemptions > 0


@pytest.mark.slow
def test_default_model_tp3_with_speculative_decoding_matches_single_rank(default_model_dir: str) -> None:
    """Every rank verifies the same drafts and keeps the same tokens (each takes the scheduler's count
    of them at the next step), as one rank does."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    texts = [
        "Copy this list exactly: apple, banana, cherry, date, elderberry, fig. Copy: apple, banana,",
        "Repeat after me. One two three four five six. One two three four five six. One",
    ]
    single_rank = LLM(model=default_model_dir, dtype="float32", num_kv_blocks=64, speculative_config=ngram)
    prompts = [single_rank.engine.encode_prompt(text) for text in texts]
    reference = greedy_reference(single_rank, prompts)
    with tensor_parallel_llm(default_model_dir, 3, num_kv_blocks=64, speculative_config=ngram) as llm:
        assert_matches_reference(greedy_reference(llm, prompts), reference)
        stats = llm.engine.stats()
        assert stats.num_draft_tokens > stats.num_accepted_draft_tokens > 0


def _subset(reference: Reference, rows: slice) -> Reference:
    return Reference(reference.token_ids[rows], reference.logprobs[rows])


@pytest.mark.slow
def test_default_model_tp3_matches_single_rank(default_model_dir: str) -> None:
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Summarize the plot of Romeo and Juliet in one paragraph, mentioning the families involved.",
        "Hi!",
    ]
    single_rank = LLM(model=default_model_dir, dtype="float32", num_kv_blocks=64)
    prompts = [single_rank.engine.encode_chat([{"role": "user", "content": q}]) for q in questions]
    reference = greedy_reference(single_rank, prompts)
    with tensor_parallel_llm(default_model_dir, 3, num_kv_blocks=64) as llm:
        assert llm.engine.executor.worker.num_kv_heads == 1  # type: ignore[attr-defined]  # 3 KV heads
        assert_matches_reference(greedy_reference(llm, prompts), reference)


def test_killed_rank_fails_the_engine_in_bounded_time(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=16, tensor_parallel_size=2)
    engine, executor = llm.engine, llm.engine.executor
    pids = executor.worker_pids  # type: ignore[attr-defined]
    try:
        engine.add_request("a", [1, 2, 3, 4, 5], greedy(max_tokens=500))
        engine.add_request("b", [1, *range(300, 340)], greedy(max_tokens=500))
        for _ in range(3):
            assert engine.step()
        os.kill(pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < DEAD_WITHIN_S
        with pytest.raises(EngineDeadError):  # and again at once, without touching a collective
            engine.step()
        with pytest.raises(EngineDeadError):
            executor.check_health()
        assert get_tp_size() == 1
    finally:
        executor.shutdown()
    assert_all_exited(pids)


def test_rank_death_between_steps_is_noticed(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    executor = llm.engine.executor
    try:
        executor.check_health()
        os.kill(executor.worker_pids[0], signal.SIGKILL)  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                executor.check_health()
            except EngineDeadError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("a dead rank went unnoticed for 10 s")
        with pytest.raises(RuntimeError, match="rank 1"):
            llm.generate([[1, 2, 3]], greedy(max_tokens=4))
    finally:
        executor.shutdown()


def test_workers_exit_when_the_engine_process_dies(tiny_llama_dir: str) -> None:
    script = (
        "import time; from pagedserve import LLM\n"
        f"llm = LLM(model={tiny_llama_dir!r}, dtype='float32', num_kv_blocks=16, tensor_parallel_size=2)\n"
        "print(*llm.engine.executor.worker_pids, flush=True)\n"
        "time.sleep(120)\n"
    )
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout is not None
        pids = [int(pid) for pid in engine.stdout.readline().split()]
        assert len(pids) == 1
    finally:
        engine.kill()  # no atexit, no STOP: the workers see rank 0's sockets close
        engine.wait()
    deadline = time.monotonic() + DEAD_WITHIN_S
    while time.monotonic() < deadline and running(pids):
        time.sleep(0.1)
    assert_all_exited(pids)


def test_a_process_that_ignores_sigterm_is_killed_and_said_so(caplog: pytest.LogCaptureFixture) -> None:
    """stop_processes (ranks, engine processes): SIGTERM, then after 5 s SIGKILL, with a warning
    naming the process (an engine process that stopped answering used to be named so)."""
    from pagedserve.worker.processes import stop_processes

    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", stubborn], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()  # its handler is in place
    stop_processes([proc], 0.0)
    assert proc.returncode == -signal.SIGKILL
    assert f"process {proc.pid} did not stop within 5 s of SIGTERM: killed" in caplog.text


def test_sizes_that_cannot_split_the_heads_fail_before_any_rank_starts(
    tiny_llama_dir: str, default_model_dir: str, tmp_path: Path
) -> None:
    from tiny_models import build_tiny_llama

    children_before = set(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide the 4 attention heads"):
        LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=16, tensor_parallel_size=3)
    six_heads = build_tiny_llama(tmp_path / "six-heads", default_model_dir, num_heads=6, num_kv_heads=3)
    with pytest.raises(
        ValueError, match="tensor_parallel_size: 2 neither divides nor is a multiple of the 3 KV"
    ):
        LLM(model=six_heads, dtype="float32", num_kv_blocks=16, tensor_parallel_size=2)
    assert set(psutil.Process().children(recursive=True)) == children_before
    assert get_tp_size() == 1


@pytest.mark.slow
def test_torchrun_launch_matches_single_rank(tiny_llama_dir: str, tmp_path: Path) -> None:
    """Every rank runs the same command; rank 1 turns into a worker and exits when rank 0 is done."""
    prompt, max_tokens = "The quick brown fox", 16
    expected = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens)
    )[0]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--log-dir", str(tmp_path / "torchrun"),  # torchrun's default is a new dir under /tmp, never removed
        "-m", "pagedserve", "generate", "--model", tiny_llama_dir, "--dtype", "float32",
        "--num-kv-blocks", "64", "--tensor-parallel-size", "2", "--no-chat", "--prompt", prompt,
        "--max-tokens", str(max_tokens), "--temperature", "0",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tensor-parallel size 2" in done.stderr
    assert done.stdout.strip() == expected.outputs[0].text.strip()
