"""End to end: greedy token ids with the Triton attention backend (KV write, paged decode and
prefill kernels; under Triton's interpreter on CPU, natively on a GPU) equal those with the torch
reference backend on the same device.

The workload makes every kernel path run inside the engine: a token budget of 32 chunks the long
prompts (prefill over context already in the cache) and mixes decodes into the same steps, and a
second batch reuses cached prompt prefixes (prefill starting past a prefix-cache hit).

Tolerance: none, the greedy token ids must be equal.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from pagedserve import LLM, SamplingParams
from pagedserve.layers.attention import TorchAttentionBackend, TritonAttentionBackend
from spec_drafts import oracle_proposer

PROMPT_LENS = [1, 15, 16, 17, 45, 70]
PREFIX_LEN = 32  # two whole blocks of 16: shared through the prefix cache
MAX_TOKENS = 12


def random_prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """A first batch of the listed lengths, and a second batch extending prefixes of the first."""
    rng = random.Random(seed)
    first = [[rng.randrange(3, 49152) for _ in range(n)] for n in PROMPT_LENS]
    second = [first[-1][:PREFIX_LEN] + [rng.randrange(3, 49152) for _ in range(9)], first[-2][:40]]
    return first, second


def greedy_token_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def run(model_dir: str, attention_backend: str, device: torch.device) -> tuple[type, int, list[list[int]]]:
    llm = LLM(
        model=model_dir,
        dtype="float32",
        device=str(device),
        attention_backend=attention_backend,
        num_kv_blocks=64,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
    )
    first, second = random_prompts(seed=1)
    token_ids = greedy_token_ids(llm, first) + greedy_token_ids(llm, second)
    backend = type(llm.engine.executor.worker.model_runner.backend)
    return backend, llm.engine.scheduler.block_manager.num_prefix_hits, token_ids


def with_window(model_dir: str, root: Path, window: int) -> str:
    """`model_dir` as a Mistral sliding every layer by `window` (its files linked, config.json new)."""
    root.mkdir()
    for file in Path(model_dir).iterdir():
        if file.name != "config.json":
            (root / file.name).symlink_to(file)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


def short_prompts_llm(model_dir: str, device: torch.device, backend: str) -> LLM:
    """An engine for a few short prompts, 16 tokens a step (chunks after cached context beside
    decodes), blocks of 8."""
    return LLM(
        model=model_dir,
        dtype="float32",
        device=str(device),
        attention_backend=backend,
        num_kv_blocks=16,
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("window", [0, 20], ids=["full", "window-20"])
def test_triton_backend_greedy_equals_torch_backend(
    tiny_llama_dir: str, device: torch.device, window: int, tmp_path: Path
) -> None:
    """A window of 20 slides inside the chunks, the cached prefixes and the decode steps alike."""
    model_dir = with_window(tiny_llama_dir, tmp_path / "window", window) if window else tiny_llama_dir
    torch_backend, _, expected = run(model_dir, "torch", device)
    triton_backend, num_prefix_hits, actual = run(model_dir, "triton", device)
    assert (torch_backend, triton_backend) == (TorchAttentionBackend, TritonAttentionBackend)
    assert num_prefix_hits >= 2 * PREFIX_LEN  # the second batch started past cached prefixes
    assert all(len(ids) == MAX_TOKENS for ids in actual)
    assert actual == expected
    if window:  # the window changes the tokens: a kernel ignoring it would not pass
        assert expected != run(tiny_llama_dir, "torch", device)[2]


@pytest.mark.timeout(600)
def test_experts_in_the_triton_kernel_equal_the_torch_dispatch(
    default_model_dir: str, device: torch.device, tmp_path: Path
) -> None:
    """Beside the Triton backend the experts' weights are stacked and run by `fused_moe`; beside the
    torch backend each expert's rows run apart (`run_experts`): the same tokens. A Qwen2-MoE with a
    shared expert and a dense layer, so every path of the block runs."""
    from pagedserve.layers.moe import SparseMoeBlock
    from tiny_models import build_tiny_qwen2_moe

    model_dir = build_tiny_qwen2_moe(tmp_path / "qwen2-moe", default_model_dir)
    prompts = [list(range(100, 121)), list(range(900, 907)), [5]]  # (short: the interpreter is slow)

    def tokens(backend: str) -> tuple[list[list[int]], SparseMoeBlock]:
        llm = LLM(
            model=model_dir, dtype="float32", device=str(device), attention_backend=backend, num_kv_blocks=16
        )
        [block] = [
            m
            for m in llm.engine.executor.worker.model_runner.model.modules()
            if isinstance(m, SparseMoeBlock)
        ]
        return greedy_token_ids(llm, prompts), block

    expected, unstacked = tokens("torch")
    actual, stacked = tokens("triton")
    assert unstacked.w13 is None and len(unstacked.experts) == 6
    assert stacked.w13 is not None and stacked.w13.shape == (6, 64, 64) and not list(stacked.experts)
    assert actual == expected


@pytest.mark.timeout(600)
def test_gpt_oss_in_the_triton_kernels_equals_the_torch_backend(
    default_model_dir: str, device: torch.device, tmp_path: Path
) -> None:
    """GPT-OSS beside the Triton backend: its sinks in the attention kernels (layer 0 sliding by 8,
    inside the prompts), its experts' biases and clamped SwiGLU in `fused_moe`: the torch backend's
    tokens."""
    from pagedserve.layers.moe import SparseMoeBlock
    from tiny_models import build_tiny_llama

    model_dir = build_tiny_llama(
        tmp_path / "gpt-oss",
        default_model_dir,
        config_class="GptOssConfig",
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        swiglu_limit=2.0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )
    prompts = [list(range(100, 121)), list(range(900, 907)), [5]]  # (short: the interpreter is slow)

    def tokens(backend: str) -> tuple[list[list[int]], list[SparseMoeBlock]]:
        llm = LLM(
            model=model_dir, dtype="float32", device=str(device), attention_backend=backend, num_kv_blocks=16
        )
        model = llm.engine.executor.worker.model_runner.model
        return greedy_token_ids(llm, prompts), [m for m in model.modules() if isinstance(m, SparseMoeBlock)]

    expected, _ = tokens("torch")
    actual, blocks = tokens("triton")
    assert all(b.w13_bias is not None and b.w2_bias is not None for b in blocks) and len(blocks) == 2
    assert actual == expected


@pytest.mark.timeout(600)
def test_deepseeks_latent_attention_in_the_triton_kernels_equals_the_torch_backend(
    default_model_dir: str, device: torch.device, tmp_path: Path
) -> None:
    """DeepSeek-V3 beside the Triton backend: 4 query heads over the one latent head of 56 + 8 (the
    cache's key and value entries alike) in the attention kernels, chunks of a prompt over the latents
    already cached, its experts in `fused_moe`: the torch backend's tokens."""
    from tiny_models import DEEPSEEK_V3, build_tiny_llama

    model_dir = build_tiny_llama(
        tmp_path / "deepseek-v3",
        default_model_dir,
        config_class="DeepseekV3Config",
        **DEEPSEEK_V3,
    )
    prompts = [list(range(100, 121)), list(range(900, 907)), [5]]  # (short: the interpreter is slow)

    def tokens(backend: str) -> list[list[int]]:
        llm = short_prompts_llm(model_dir, device, backend)
        assert llm.engine.executor.worker.num_kv_heads == 1
        return greedy_token_ids(llm, prompts)

    assert tokens("triton") == tokens("torch")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config_class", ["BloomConfig", "MptConfig"])
def test_alibi_in_the_triton_kernels_equals_the_torch_backend(
    default_model_dir: str, device: torch.device, tmp_path: Path, config_class: str
) -> None:
    """BLOOM and MPT beside the Triton backend: their ALiBi slopes (6 heads: no power of two) in the
    decode and prefill kernels, prompts arriving 16 tokens a step: the torch backend's tokens (the C++
    kernels' attention with the slopes)."""
    from tiny_models import build_tiny_llama

    model_dir = build_tiny_llama(
        tmp_path / "alibi", default_model_dir, config_class=config_class, num_heads=6
    )
    prompts = [list(range(100, 121)), list(range(900, 907)), [5]]  # (short: the interpreter is slow)

    def tokens(backend: str) -> list[list[int]]:
        llm = short_prompts_llm(model_dir, device, backend)
        [slopes] = {attn.alibi_slopes for attn in llm.engine.executor.worker.model_runner.attention_layers}
        assert slopes is not None and slopes.shape == (6,)
        return greedy_token_ids(llm, prompts)

    assert tokens("triton") == tokens("torch")


@pytest.mark.timeout(600)
def test_llama4s_chunked_attention_in_the_triton_kernels_equals_the_torch_backend(
    default_model_dir: str, device: torch.device, tmp_path: Path
) -> None:
    """Llama 4 beside the Triton backend: layer 0 attends within chunks of 16 positions (two blocks of
    8), layer 1 (NoPE) over everything; prompts of 21 and 7 tokens arrive 16 tokens a step, so prefill
    parts start inside chunks and cross them, and decodes cross them too: the torch backend's tokens,
    which the chunks change."""
    from tiny_models import build_tiny_llama

    def build(name: str, chunk: int) -> str:
        if (tmp_path / name).exists():
            return str(tmp_path / name)
        return build_tiny_llama(
            tmp_path / name,
            default_model_dir,
            config_class="Llama4TextConfig",
            intermediate_size_mlp=96,
            num_local_experts=2,
            no_rope_layers=[1, 0],
            attention_chunk_size=chunk,
        )

    prompts = [list(range(100, 121)), list(range(900, 907)), [5]]  # (short: the interpreter is slow)

    def tokens(chunk: int, backend: str) -> list[list[int]]:
        llm = short_prompts_llm(build(f"chunk-{chunk}", chunk), device, backend)
        chunks = [attn.chunk for attn in llm.engine.executor.worker.model_runner.attention_layers]
        assert chunks == [chunk, 0]
        return greedy_token_ids(llm, prompts)

    expected = tokens(16, "torch")
    assert tokens(16, "triton") == expected
    assert tokens(1024, "torch") != expected  # (one chunk as long as the context: no cut)


@pytest.mark.timeout(600)
def test_triton_backend_verifies_drafts_as_decode_rows(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculative decoding: a step's drafts are decode rows of their own, each attending to the
    context up to its position, in the Triton paged decode kernel as in the torch one."""
    from pagedserve.spec_decode import SpeculativeConfig

    prompts, _ = random_prompts(seed=2)
    plain = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=16)
    expected = greedy_token_ids(plain, prompts)
    monkeypatch.setattr(SpeculativeConfig, "propose", oracle_proposer(list(zip(prompts, expected))))
    for backend in ("torch", "triton"):
        llm = LLM(
            model=tiny_llama_dir,
            dtype="float32",
            attention_backend=backend,
            num_kv_blocks=64,
            block_size=16,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        )
        assert greedy_token_ids(llm, prompts) == expected, backend
        stats = llm.engine.stats()
        assert stats.num_draft_tokens > stats.num_accepted_draft_tokens > 0, backend
