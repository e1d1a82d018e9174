"""Models that carry a state per request beside their KV cache (LFM2's short convolutions, Granite
4.0's, Nemotron-H's and Zamba2's Mamba2 layers, MiniMax's lightning attention: `layers.recurrent`) through the engine's paths that break a sequence's steps
apart: prompts in chunks, preemption under memory pressure, parallel samples, shared prefixes. Each
gives the tokens a roomy engine gives, since the state is built only by the steps computing the
sequence from its first token: no prefix caching, no swapping, forks that share no blocks. What cannot
run with such a state (speculative decoding, LoRA) is refused naming the setting; Mamba2 splits its
heads across tensor-parallel ranks."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pagedserve import LLM, SamplingParams
from pagedserve.worker.executor import check_tensor_parallel_size
from test_tensor_parallel import (
    assert_matches_reference,
    greedy_reference,
    single_rank_reference,
    tensor_parallel_llm,
    tiny_prompts,
)
from tiny_models import save_tiny_model, tiny_hybrid_config

MAX_TOKENS = 24


def lfm2_config() -> Any:
    return tiny_hybrid_config("lfm2")


def granite4_h_config() -> Any:
    return tiny_hybrid_config("granite4-h")


def nemotron_h_config() -> Any:
    return tiny_hybrid_config("nemotron-h")


HYBRIDS = {
    "lfm2": lfm2_config,
    "granite4-h": granite4_h_config,
    "nemotron-h": nemotron_h_config,
    "mamba2": lambda: tiny_hybrid_config("mamba2"),
    "mamba": lambda: tiny_hybrid_config("mamba"),
    "jamba": lambda: tiny_hybrid_config("jamba"),
    "qwen3.5": lambda: tiny_hybrid_config("qwen3.5"),
    "kimi-linear": lambda: tiny_hybrid_config("kimi-linear"),
    "falcon-h1": lambda: tiny_hybrid_config("falcon-h1"),
    "minimax": lambda: tiny_hybrid_config("minimax"),
    "zamba2": lambda: tiny_hybrid_config("zamba2"),
    "olmo-hybrid": lambda: tiny_hybrid_config("olmo-hybrid"),
}


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, default_model_dir: str
) -> str:
    config = HYBRIDS[request.param]()
    return save_tiny_model(tmp_path_factory.mktemp(request.param), default_model_dir, config)


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("lfm2"), default_model_dir, lfm2_config())


def prompts() -> list[list[int]]:
    """Eight prompts of 4-120 tokens, the first four sharing 40 tokens."""
    return tiny_prompts()


def greedy(llm: LLM, prompts: list[list[int]], n: int = 1) -> list[list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)
    return [[o.token_ids for o in r.outputs] for r in llm.generate(prompts, params)]


def test_chunks_preemption_and_parallel_samples_give_a_roomy_engines_tokens(hybrid_dir: str) -> None:
    roomy = LLM(model=hybrid_dir, dtype="float32", num_kv_blocks=256, block_size=8)
    expected = greedy(roomy, prompts())
    assert roomy.engine.config.cache.enable_prefix_caching is False
    # a 16-token budget splits every prompt past it into chunks (of any size: the state carries
    # between them); 16 blocks of 8 hold 128 tokens of the 8 requests' ~600: they preempt each other
    tight = LLM(
        model=hybrid_dir,
        dtype="float32",
        num_kv_blocks=16,
        block_size=8,
        max_num_batched_tokens=16,
        max_num_seqs=8,
    )
    assert tight.engine.config.scheduler.preemption_mode == "swap"  # (the default, which it cannot use)
    assert greedy(tight, prompts()) == expected
    stats = tight.engine.stats()
    assert stats.num_recompute_preemptions > 0 and stats.num_swap_preemptions == 0
    # two greedy samples of each prompt: each sibling computes its prompt anew, both equal the one sample
    samples = greedy(tight, prompts()[:4], n=2)
    assert samples == [[tokens[0], tokens[0]] for tokens in expected[:4]]
    assert tight.engine.stats().num_free_blocks == 16


def test_a_prefix_another_request_computed_is_computed_again(hybrid_dir: str) -> None:
    llm = LLM(model=hybrid_dir, dtype="float32", num_kv_blocks=256, block_size=8)
    alone = [greedy(llm, [prompt])[0] for prompt in prompts()[:4]]
    assert greedy(llm, prompts()[:4]) == alone  # four prompts sharing 40 tokens, run together
    assert llm.engine.stats().num_prefix_hits == 0


def test_tp2_splits_the_convolutions_channels_and_matches_single_rank(lfm2_dir: str) -> None:
    """Each rank its half of every convolution's channels (in_proj's rows of B, C and x, their taps and
    state), out_proj's partial sums all-reduced; under chunked prefill and recompute preemption."""
    reference = single_rank_reference(lfm2_dir, tiny_prompts(), num_kv_blocks=256, block_size=8)
    settings = {"num_kv_blocks": 24, "block_size": 8, "max_num_batched_tokens": 24, "max_num_seqs": 8}
    with tensor_parallel_llm(lfm2_dir, 2, **settings) as llm:
        assert llm.engine.executor.worker.model_runner.recurrent_layers[0].channels == 32  # type: ignore[attr-defined]
        assert_matches_reference(greedy_reference(llm, tiny_prompts()), reference)
        assert llm.engine.stats().num_recompute_preemptions > 0


def test_speculative_decoding_and_lora_are_refused_naming_them(hybrid_dir: str, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    name = json.loads((Path(hybrid_dir) / "config.json").read_text())["architectures"][0]
    base = AutoModelForCausalLM.from_pretrained(hybrid_dir)
    # (a convolution's or Mamba2's; Gated DeltaNet's; KDA's; lightning attention's)
    targets = ["in_proj", "in_proj_qkv", "b_proj", "qkv_proj"]
    get_peft_model(base, LoraConfig(r=4, target_modules=targets)).save_pretrained(tmp_path)
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(
        ValueError, match=f"speculative_config: {name} is not served with speculative decoding"
    ):
        LLM(model=hybrid_dir, dtype="float32", num_kv_blocks=16, speculative_config=ngram)
    with pytest.raises(ValueError, match=f"lora_modules: {name}'s LoRA adapters are not served"):
        LLM(model=hybrid_dir, dtype="float32", num_kv_blocks=16, lora_modules={"sql": str(tmp_path)})
    llm = LLM(model=hybrid_dir, dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match=f"lora_path: {name}'s LoRA adapters are not served"):
        llm.engine.load_lora_adapter("sql", str(tmp_path))
    assert greedy(llm, prompts()[:1]) == greedy(llm, prompts()[:1])  # and it still serves


# Nemotron 3's experts in its MLP layers: 2 of 8 ungated ones a token in 2 of 4 groups, a shared one
NEMOTRON3_EXPERTS = {
    # (transformers' names, set on a built config: "linear_attention" for Mamba2)
    "layers_block_type": ["linear_attention", "moe", "full_attention", "moe", "linear_attention", "mlp"],
    "n_routed_experts": 8,
    "n_group": 4,
    "topk_group": 2,
    "moe_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 32,
}


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("granite4-h", {"mamba_n_groups": 1}),
        ("nemotron-h", {}),
        ("nemotron-h", NEMOTRON3_EXPERTS),
        ("mamba2", {}),
        ("falcon-h1", {}),
    ],
)
def test_tp2_splits_mamba2s_heads_and_matches_single_rank(
    tmp_path: Path, default_model_dir: str, name: str, change: dict[str, object]
) -> None:
    """Each rank its half of the Mamba2 heads (their z, x and dt rows of in_proj, convolution channels,
    A, D, dt_bias, norm weights and states) and its groups' B and C: Nemotron-H's 2 groups split,
    Granite's one group whole on each rank, its gated norm's sum of squares all-reduced; Nemotron 3's
    ungated experts and shared expert split by their intermediate features; Falcon-H1's Mamba2 beside
    attention in every layer, its multipliers folded into each rank's rows; under chunked prefill and
    recompute preemption."""
    config = HYBRIDS[name]()
    for key, value in change.items():
        setattr(config, key, value)
    model_dir = save_tiny_model(tmp_path / name, default_model_dir, config)
    reference = single_rank_reference(model_dir, tiny_prompts(), num_kv_blocks=256, block_size=8)
    settings = {"num_kv_blocks": 24, "block_size": 8, "max_num_batched_tokens": 24, "max_num_seqs": 8}
    with tensor_parallel_llm(model_dir, 2, **settings) as llm:
        mixer = llm.engine.executor.worker.model_runner.recurrent_layers[0]  # type: ignore[attr-defined]
        assert (mixer.num_heads, mixer.num_groups) == (4, 1)
        assert_matches_reference(greedy_reference(llm, tiny_prompts()), reference)
        assert llm.engine.stats().num_recompute_preemptions > 0


def test_tp2_splits_mambas_channels_and_matches_single_rank(tmp_path: Path, default_model_dir: str) -> None:
    """Mamba (1): each rank its half of the channels (their x and z rows of in_proj, convolution taps,
    dt_proj rows and bias, A and D rows, states); x_proj's partial sums over them all-reduced; under
    chunked prefill and recompute preemption."""
    model_dir = save_tiny_model(tmp_path / "mamba", default_model_dir, HYBRIDS["mamba"]())
    reference = single_rank_reference(model_dir, tiny_prompts(), num_kv_blocks=256, block_size=8)
    settings = {"num_kv_blocks": 24, "block_size": 8, "max_num_batched_tokens": 24, "max_num_seqs": 8}
    with tensor_parallel_llm(model_dir, 2, **settings) as llm:
        mixer = llm.engine.executor.worker.model_runner.recurrent_layers[0]  # type: ignore[attr-defined]
        assert mixer.inner == 64  # (of 128 channels)
        assert_matches_reference(greedy_reference(llm, tiny_prompts()), reference)
        assert llm.engine.stats().num_recompute_preemptions > 0


@pytest.mark.parametrize("family", ["qwen3.5", "qwen3-next", "kimi-linear", "olmo-hybrid"])
def test_tp2_splits_the_gated_delta_heads_and_matches_single_rank(
    tmp_path: Path, default_model_dir: str, family: str
) -> None:
    """Qwen3.5's linear attention: each rank one of the 2 key heads and the 2 value heads it serves
    (their rows of in_proj_qkv, the convolution, z, b and a, their A_log, dt_bias and states), the
    gated attention's query-and-gate pairs split by head; under chunked prefill and recompute
    preemption. Qwen3-Next's fused projections (in_proj_qkvz, in_proj_ba: each key head's rows
    together) give each rank the same rows. Kimi Linear's KDA: each rank one of its 2 heads (their
    rows of q, k, v, b, the forget gate's and the output gate's up-projections, dt_bias a channel,
    A_log), the low-rank down-projections whole; its latent attention's heads split. OLMo Hybrid's
    six projections each give each rank its heads' rows."""
    model_dir = save_tiny_model(tmp_path / family, default_model_dir, tiny_hybrid_config(family))
    reference = single_rank_reference(model_dir, tiny_prompts(), num_kv_blocks=256, block_size=8)
    settings = {"num_kv_blocks": 24, "block_size": 8, "max_num_batched_tokens": 24, "max_num_seqs": 8}
    with tensor_parallel_llm(model_dir, 2, **settings) as llm:
        mixer = llm.engine.executor.worker.model_runner.recurrent_layers[0]  # type: ignore[attr-defined]
        assert (mixer.num_k_heads, mixer.num_v_heads) == ((1, 1) if family == "kimi-linear" else (1, 2))
        assert_matches_reference(greedy_reference(llm, tiny_prompts()), reference)
        assert llm.engine.stats().num_recompute_preemptions > 0


@pytest.mark.parametrize("family", ["qwen3.5", "qwen3-next", "kimi-linear", "olmo-hybrid"])
def test_gated_delta_splits_it_cannot_make_are_refused(
    tmp_path: Path, default_model_dir: str, family: str
) -> None:
    model_dir = save_tiny_model(tmp_path / family, default_model_dir, tiny_hybrid_config(family))
    with pytest.raises(
        ValueError, match="tensor_parallel_size: 4 does not divide the 2 linear-attention key heads"
    ):
        LLM(model=model_dir, dtype="float32", num_kv_blocks=16, tensor_parallel_size=4)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    # (by the start-up check, before any rank starts)
    model = SimpleNamespace(num_layers=1, num_heads=4, num_kv_heads=2, hf_config=config)
    engine = SimpleNamespace(model=model, parallel=SimpleNamespace(tensor_parallel_size=4))
    with pytest.raises(ValueError, match="4 does not divide the 2 linear-attention key heads"):
        check_tensor_parallel_size(engine)  # type: ignore[arg-type]
    if family != "kimi-linear":  # (KDA has as many key heads as value heads)
        (Path(model_dir) / "config.json").write_text(json.dumps({**config, "linear_num_value_heads": 3}))
        with pytest.raises(ValueError, match="2 linear-attention key heads do not divide its 3 value heads"):
            LLM(model=model_dir, dtype="float32", num_kv_blocks=16)
    (Path(model_dir) / "config.json").write_text(
        json.dumps({**config, "layer_types": ["linear_attention", "full_attention", "mamba"]})
    )
    with pytest.raises(
        ValueError, match="layer_types must name 3 layers, each full_attention or linear_attention"
    ):
        LLM(model=model_dir, dtype="float32", num_kv_blocks=16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({}, "tensor_parallel_size: 4 does not divide the 2 Mamba2 groups"),
        (
            {"mamba_n_heads": 2, "mamba_d_head": 64},
            "tensor_parallel_size: 4 does not divide the 2 Mamba2 heads",
        ),
    ],
)
def test_mamba2_splits_it_cannot_make_are_refused_before_any_rank_starts(
    tmp_path: Path, default_model_dir: str, change: dict[str, object], message: str
) -> None:
    config = granite4_h_config()
    for key, value in change.items():
        setattr(config, key, value)
    model_dir = save_tiny_model(tmp_path / "granite4-h", default_model_dir, config)
    with pytest.raises(ValueError, match=message):
        LLM(model=model_dir, dtype="float32", num_kv_blocks=16, tensor_parallel_size=4)


@pytest.mark.parametrize("family", ["mamba", "jamba"])
def test_mamba_channel_splits_it_cannot_make_are_refused_before_any_rank_starts(
    tmp_path: Path, default_model_dir: str, family: str
) -> None:
    model_dir = save_tiny_model(tmp_path / family, default_model_dir, HYBRIDS[family]())
    config = json.loads((Path(model_dir) / "config.json").read_text())
    # (Jamba's channels are its Mamba layers' own, not the MLP's intermediate_size, which 3 divides)
    model = SimpleNamespace(num_layers=0, num_heads=4, num_kv_heads=2, hf_config=config)
    engine = SimpleNamespace(model=model, parallel=SimpleNamespace(tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide Mamba's 128 channels"):
        check_tensor_parallel_size(engine)  # type: ignore[arg-type]
    if family == "mamba":
        with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide Mamba's 128 channels"):
            LLM(model=model_dir, dtype="float32", num_kv_blocks=16, tensor_parallel_size=3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": ["conv", "mamba", "full_attention"]}, "layer_types must name 3 layers, each"),
        ({"conv_L_cache": 1}, "conv_L_cache must be at least 2, got 1"),
    ],
)
def test_config_values_it_cannot_run_are_refused_naming_them(
    lfm2_dir: str, tmp_path: Path, change: dict[str, object], message: str
) -> None:
    for file in Path(lfm2_dir).iterdir():
        if file.name != "config.json":
            (tmp_path / file.name).symlink_to(file)
    config = json.loads((Path(lfm2_dir) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=f"model: config.json's {message}"):
        LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=16)


@pytest.mark.parametrize(("name", "state_dtype"), [("granite4-h", "bfloat16"), ("nemotron-h", "float32")])
def test_mamba2_states_keep_the_models_dtype_unless_it_names_one(
    tmp_path: Path, default_model_dir: str, name: str, state_dtype: str
) -> None:
    """vLLM's default, the model's dtype; Nemotron-H's config names float32 (`mamba_ssm_cache_dtype`)."""
    model_dir = save_tiny_model(tmp_path / name, default_model_dir, HYBRIDS[name]())
    llm = LLM(model=model_dir, dtype="bfloat16", num_kv_blocks=16)
    mixer = llm.engine.executor.worker.model_runner.recurrent_layers[0]  # type: ignore[attr-defined]
    assert str(mixer.ssm_state.dtype) == f"torch.{state_dtype}"
    assert mixer.conv_state.dtype == mixer.conv_weight.dtype == torch.bfloat16
    assert greedy(llm, prompts()[:2]) == greedy(llm, prompts()[:2])


def test_a_state_past_half_the_free_memory_is_refused_naming_max_num_seqs(
    tmp_path: Path, default_model_dir: str
) -> None:
    """Nemotron-H's float32 states of 8 heads x 16 x 4,096 in 2 layers: 4 MiB a request, 16 GiB for
    4,096 requests, refused at start with the remedy rather than taken until the machine swaps."""
    import psutil

    config = nemotron_h_config()
    config.ssm_state_size = 4096
    model_dir = save_tiny_model(tmp_path / "nemotron-h", default_model_dir, config)
    num_seqs = 1 << max(12, int(psutil.virtual_memory().available / 2 / 2**22).bit_length())
    with pytest.raises(ValueError, match=rf"max_num_seqs: {num_seqs} requests' recurrent state \(2 layers\)"):
        LLM(
            model=model_dir,
            dtype="float32",
            num_kv_blocks=16,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=num_seqs,
        )
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=16, max_num_seqs=4)  # (4 requests: 16 MiB)
    assert greedy(llm, prompts()[:2]) == greedy(llm, prompts()[:2])


def test_a_model_without_attention_keeps_no_kv_cache_and_runs_past_any_position_limit(
    tmp_path: Path, default_model_dir: str
) -> None:
    """Mamba2 alone: no KV cache (its blocks only count tokens for the scheduler), 2,048 tokens of
    context unless asked for more (it has no positions to run past), and a prompt past 2,048 tokens
    gives transformers' tokens."""
    from test_hf_parity import hf_greedy

    model_dir = save_tiny_model(tmp_path / "mamba2", default_model_dir, tiny_hybrid_config("mamba2"))
    llm = LLM(model=model_dir, dtype="float32")
    assert llm.engine.config.model.num_layers == 0 and llm.engine.config.model.max_model_len == 2048
    assert llm.engine.executor.worker.cache_engine.kv_cache.numel() == 0  # type: ignore[attr-defined]
    long_prompt = [[1, *range(100, 3100)]]
    model, theirs = hf_greedy(model_dir, long_prompt, 8)
    longer = LLM(model=model_dir, dtype="float32", max_model_len=8192, max_num_batched_tokens=1024)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [r.outputs[0].token_ids for r in longer.generate(long_prompt, params)] == theirs
