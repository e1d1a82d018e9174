"""The torch.compile'd forward pass: where it is used, one graph for every step, and the same tokens as
the eager pass. Greedy parity with Hugging Face, compiled, is in test_hf_parity.py."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pagedserve.layers.linear
import pagedserve.worker.model_runner
import pytest
import torch
from pagedserve import LLM, SamplingParams
from pagedserve.config import resolve_compile
from pagedserve.layers.attention import step_metadata
from pagedserve.layers.linear import (
    LinearBase,
    amx_linear_available,
    avx512_linear_available,
    packed_before_compiling,
)
from pagedserve.settings import EngineSettings
from rounding_flips import first_difference
from tiny_models import build_tiny_llama

if TYPE_CHECKING:
    from pagedserve.outputs import CompletionOutput

# Two greedy tokens whose logprobs are this close may swap places when bf16 sums round another way: a
# logit of 8-16 is a multiple of 1/16 in bf16.
BF16_TIE = 0.07

Step = tuple[torch.Tensor, torch.Tensor, object, torch.Tensor]  # input ids, positions, metadata, hidden


def recording(forward: Callable[..., torch.Tensor], steps: list[Step]) -> Callable[..., torch.Tensor]:
    """`forward` (a runner's forward pass or its `fused_decode`), keeping each step's inputs and output."""

    def record(input_ids: torch.Tensor, positions: torch.Tensor, metadata: object) -> torch.Tensor:
        hidden = forward(input_ids, positions, metadata)
        steps.append((input_ids.clone(), positions.clone(), metadata, hidden))
        return hidden

    return record


def test_compile_is_used_on_cpu_with_the_torch_backend_and_one_rank() -> None:
    assert resolve_compile(False, "cpu", "torch", 1)
    assert not resolve_compile(True, "cpu", "torch", 1)  # --enforce-eager
    assert not resolve_compile(False, "cuda", "triton", 1)  # slower on an H200 (bench/README.md)
    assert not resolve_compile(False, "cpu", "triton", 1)  # Triton's interpreter: tests only
    assert not resolve_compile(False, "cpu", "torch", 2)  # collectives stay eager


def test_enforce_eager_comes_from_the_flag_or_the_environment(
    monkeypatch: pytest.MonkeyPatch, default_model_dir: str
) -> None:
    monkeypatch.delenv("PAGEDSERVE_ENFORCE_EAGER")  # set for the suite by conftest.py
    # (default_model_dir: to_engine_config reads the default model's config.json)
    assert EngineSettings(device="cpu").to_engine_config().compile
    assert not EngineSettings(device="cpu", enforce_eager=True).to_engine_config().compile
    monkeypatch.setenv("PAGEDSERVE_ENFORCE_EAGER", "1")
    assert not EngineSettings(device="cpu").to_engine_config().compile


def test_one_graph_serves_every_step_and_outputs_equal_the_eager_pass(tiny_llama_dir: str) -> None:
    """Steps of 1 token (a lone decode), many decodes, chunked prefills beside decodes, preemption:
    compiled once at start-up, never again, and token for token what the eager pass gives."""
    prompts = [[1, *range(300 + 13 * i, 300 + 13 * i + 5 + 9 * i)] for i in range(8)]
    lengths = [3 + 7 * i for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    settings = dict(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=24,
        block_size=8,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    eager = LLM(**settings, enforce_eager=True).generate(prompts, params)

    # imported here, not at collection: torch._dynamo imports triton.language, which must wait until
    # tests/kernels/conftest.py has switched Triton's interpreter on
    from torch._dynamo.utils import counters

    counters.clear()
    llm = LLM(**settings, enforce_eager=False)
    assert counters["stats"]["unique_graphs"] == 1  # compiled while the engine was built
    single = llm.generate([prompts[0]], params[0])  # one token per decode step
    compiled = llm.generate(prompts, params)
    assert counters["stats"]["unique_graphs"] == 1
    assert llm.engine.stats().num_swap_preemptions > 0

    assert single[0].outputs[0].token_ids == eager[0].outputs[0].token_ids
    assert [r.outputs[0].token_ids for r in compiled] == [r.outputs[0].token_ids for r in eager]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_compiled_models_in_one_process_each_run_their_own_weights(
    tiny_llama_dir: str, tmp_path: Path, default_model_dir: str, dtype: str
) -> None:
    """The compiled pass keeps none of the ~4,700 guards on each model's module tree: a second model
    of the same shapes, compiled while the first is alive in the same process, still gets graphs of
    its own, with its own weights: its greedy tokens are its eager pass's, not the first model's.

    Where every linear weight is packed before compiling (AMX tiles; oneDNN's layout, as float32's on
    CPUs other than Intel's), the weights stay graph inputs, and the second model takes the first
    one's graphs from torch's on-disk cache: one decoder layer's for all with AMX (two graphs: the
    first layer's, which has no residual yet, and the others'), the whole model's with oneDNN.
    Elsewhere (float32 on Intel's CPUs, bfloat16 without AMX) they are left to inductor, which packs
    them only when frozen: the whole model one graph, frozen, not cached. float32 tokens are the
    eager pass's to the last. bf16 sums differ from the eager pass's by rounding (inductor's fused
    code skips some of eager's roundings: on an AVX2-only CPU the fourth token of a completion
    differed), so a greedy step whose likeliest tokens tie within bf16's resolution may take another:
    the rest of that completion is not compared."""
    from torch._dynamo.utils import counters

    other_dir = build_tiny_llama(tmp_path / "other", default_model_dir, seed=1)
    prompts = [[1, 400, 401, 402], [1, *range(500, 520)]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    settings = dict(dtype=dtype, num_kv_blocks=16, block_size=8)

    def completions(llm: LLM) -> list[CompletionOutput]:
        return [r.outputs[0] for r in llm.generate(prompts, params)]

    first = LLM(model=tiny_llama_dir, **settings, enforce_eager=False)
    counters.clear()
    other = LLM(model=other_dir, **settings, enforce_eager=False)
    runner = other.engine.executor.worker.model_runner
    assert runner.forward is not runner.model  # compiled
    frozen = not packed_before_compiling(torch.device("cpu"), getattr(torch, dtype))
    assert runner.frozen_weights == frozen
    aot = counters["aot_autograd"]
    # unfrozen: the whole model where it reads oneDNN's weights, else one graph for the first layer and
    # one for the others
    onednn = any(m.onednn_index is not None for m in runner.model.modules() if isinstance(m, LinearBase))
    hits = 0 if frozen else 1 if onednn else 2
    assert (aot["autograd_cache_hit"], aot["autograd_cache_bypass"]) == (hits, int(frozen)), aot

    other_compiled, first_compiled = completions(other), completions(first)
    for compiled, eager_dir in ((first_compiled, tiny_llama_dir), (other_compiled, other_dir)):
        eager = completions(LLM(model=eager_dir, **settings, enforce_eager=True))
        for ours, theirs in zip(compiled, eager, strict=True):
            pos = first_difference(list(ours.token_ids), list(theirs.token_ids))
            if dtype == "float32" or pos is None:
                assert ours.token_ids == theirs.token_ids
                continue
            assert ours.logprobs and theirs.logprobs
            top = max(lp.logprob for lp in theirs.logprobs[pos].values())
            ours_there = theirs.logprobs[pos].get(ours.token_ids[pos])
            assert ours_there is not None and top - ours_there.logprob < BF16_TIE, (
                f"token {pos}: {ours.token_ids[pos]} against {theirs.logprobs[pos]}, not a bf16 tie"
            )
    assert [c.token_ids for c in first_compiled] != [c.token_ids for c in other_compiled]


def test_weights_packed_for_onednn_are_graph_inputs_and_the_next_engine_takes_the_cache(
    tiny_llama_dir: str, tmp_path: Path, default_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 weights are packed for oneDNN on CPUs other than Intel's (here on any CPU: the vendor is
    patched). A tensor in oneDNN's layout cannot be a graph input, so the compiled pass reads each one
    through `onednn_linear` by its index, a graph input: nothing is frozen, and a second engine of the
    same shapes takes the model's graph from torch's on-disk cache instead of tracing, freezing and
    lowering it again (~60 s on the default model, bench/README.md, "Start-up"). Its tokens are its
    eager pass's, which reads the same packed weights through the same op; dropping the engine frees
    its packed weights."""
    import weakref

    from pagedserve.layers.linear import _ONEDNN_WEIGHTS
    from torch._dynamo.utils import counters

    monkeypatch.setattr(pagedserve.layers.linear, "cpu_vendor", lambda: "AuthenticAMD")
    other_dir = build_tiny_llama(tmp_path / "other", default_model_dir, seed=1)
    settings = dict(dtype="float32", num_kv_blocks=16, block_size=8)
    first = LLM(model=tiny_llama_dir, **settings, enforce_eager=False)
    counters.clear()
    other = LLM(model=other_dir, **settings, enforce_eager=False)
    runner = other.engine.executor.worker.model_runner
    assert runner.forward is not runner.model and not runner.frozen_weights
    aot = counters["aot_autograd"]
    assert (aot["autograd_cache_hit"], aot["autograd_cache_bypass"]) == (1, 0), aot  # the whole model
    linears = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.packed_weight.is_mkldnn and m.weight.numel() == 0 for m in linears)
    assert all(_ONEDNN_WEIGHTS[int(m.onednn_index)] is m.packed_weight for m in linears)

    prompts = [[1, 400, 401, 402], [1, *range(500, 520)]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled = [r.outputs[0].token_ids for r in other.generate(prompts, params)]
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("pagedserve::onednn_linear") == 6 * len(linears)  # 6 steps, each linear once
    eager = LLM(model=other_dir, **settings, enforce_eager=True)
    assert compiled == [r.outputs[0].token_ids for r in eager.generate(prompts, params)]
    assert compiled != [r.outputs[0].token_ids for r in first.generate(prompts, params)]

    packed = [weakref.ref(m.packed_weight) for m in linears]
    del other, runner, linears, eager
    for _ in range(10):
        if not gc.collect():
            break
    assert not [ref for ref in packed if ref() is not None]


@pytest.mark.skipif(not amx_linear_available(), reason="one decoder layer is compiled for all with AMX alone")
def test_one_compiled_decoder_layer_serves_every_layer_with_its_own_weights(
    tmp_path: Path, default_model_dir: str
) -> None:
    """Where the weights stay graph inputs, torch.compile traces one decoder layer, not the model: two
    graphs (the first layer, which has no residual yet, and the others) serve all four layers and
    every step size, chunked prefills beside decodes included, and each layer reads its own weights
    and KV cache: a prefill step's hidden states equal the eager pass's within bfloat16 rounding."""
    from torch._dynamo.utils import counters

    four_layers = build_tiny_llama(tmp_path / "four", default_model_dir, num_layers=4)
    counters.clear()
    llm = LLM(
        model=four_layers,
        dtype="bfloat16",
        num_kv_blocks=32,
        block_size=8,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        enforce_eager=False,
    )
    runner = llm.engine.executor.worker.model_runner
    assert not runner.frozen_weights
    assert counters["stats"]["unique_graphs"] == 2  # compiled while the engine was built
    steps: list[Step] = []
    runner.forward = recording(runner.forward, steps)  # type: ignore[assignment]
    prompts = [[1, *range(300 + 13 * i, 305 + 22 * i)] for i in range(5)]  # 5 to 93 tokens: chunked
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert len(llm.generate([[1, 400, 401]], params)[0].outputs[0].token_ids) == 6  # a 3-token step
    assert all(len(o.outputs[0].token_ids) == 6 for o in llm.generate(prompts, params))
    assert counters["stats"]["unique_graphs"] == 2
    assert len({len(ids) for ids, *_ in steps}) > 1  # steps of several sizes went through the graphs

    input_ids, positions, metadata, hidden = max(steps, key=lambda step: len(step[0]))
    with torch.inference_mode(), step_metadata(metadata, runner.attention_layers):  # type: ignore[arg-type]
        eager = runner.model(input_ids, positions, metadata)  # rewrites the same K/V slots
    # bf16 rounding over four layers: 3.0% here (the compiled layers read the rotary tables in float32,
    # the eager pass in bf16); with every layer but the first reading the last one's weights, 118%
    error = (hidden.float() - eager.float()).abs().max() / eager.float().abs().max()
    assert error < 0.06, f"the compiled layers differ from the eager pass by {error:.3%} of the largest value"


@pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="the bf16 compiled pass packs weights for oneDNN's native bf16",
)
def test_compiled_bf16_is_as_close_to_float32_as_the_eager_pass(tiny_llama_dir: str) -> None:
    """In bf16 inductor keeps fused elementwise chains in float32 where eager rounds every op to bf16:
    the two differ by rounding, so each is held to its distance from the float32 pass. Measured on
    this model: at most 0.08 (eager) and 0.09 (compiled) in a top-5 logprob over 6 prompts."""
    prompts = [[1, *range(500 + 50 * k, 540 + 50 * k)] for k in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    runs = {}
    for name, dtype, enforce_eager in (
        ("float32", "float32", True),
        ("eager", "bfloat16", True),
        ("compiled", "bfloat16", False),
    ):
        llm = LLM(model=tiny_llama_dir, dtype=dtype, num_kv_blocks=16, enforce_eager=enforce_eager)
        runs[name] = [r.outputs[0].logprobs[0] for r in llm.generate(prompts, params)]

    def worst_error(name: str) -> float:
        return max(
            abs(ours[token].logprob - ref[token].logprob)
            for ours, ref in zip(runs[name], runs["float32"])
            for token in ref
            if token in ours
        )

    assert worst_error("compiled") <= 2 * worst_error("eager") + 0.02


@pytest.mark.skipif(
    not torch.backends.mkldnn.is_available()
    or not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    or not avx512_linear_available(),
    reason="bf16 weights are left to inductor where AVX512-BF16 panels would take them",
)
def test_compiled_bf16_linear_layers_read_packed_frozen_weights(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without AMX, on AVX512-BF16 (whose panels are for decode steps, `packed_before_compiling`): every
    linear layer of every decoder layer (qkv, o, gate_up, down) becomes a oneDNN matmul on a weight
    inductor packs once at compile time. Without freezing at trace time the weights would stay graph
    inputs and each step run plain bf16 matmuls that reorder them (1.4x the linear layers' time on the
    chat benchmark)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(pagedserve.layers.linear, "amx_linear_available", lambda: False)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)  # count the passes' matches
    counters.clear()
    llm = LLM(model=tiny_llama_dir, dtype="bfloat16", num_kv_blocks=16, enforce_eager=False)
    num_layers = llm.engine.config.model.num_layers
    assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] == 4 * num_layers
    out = llm.generate([[1, 400, 401, 402]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_bf16_linear_layers_run_on_amx_tiles(tiny_llama_dir: str, enforce_eager: bool) -> None:
    """With AMX, every linear layer and the LM head hold their weight in the AMX kernel's tiles (the
    plain copy released, the LM head's kept for the embedding) and every step multiplies on them:
    eager or compiled, four `linear_amx` calls a decoder layer in the prefill step, then each decode
    step is one `decode_layers` call, which multiplies the tiles itself (no op dispatched per
    multiply). Greedy, the LM head takes each row's argmax itself (`linear_argmax_amx`, no logits),
    each step."""
    if not amx_linear_available():
        pytest.skip("no AMX bf16 tiles (or no C++ compiler) here")
    llm = LLM(model=tiny_llama_dir, dtype="bfloat16", num_kv_blocks=16, enforce_eager=enforce_eager)
    model = llm.engine.executor.worker.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 4 * llm.engine.config.model.num_layers
    assert all(m.packed_weight.dim() == 5 and m.weight.numel() == 0 for m in linears)
    assert model.lm_head.packed_weight.dim() == 5 and model.lm_head.weight.numel() > 0
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = llm.generate([[1, 400, 401, 402]], params)
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("pagedserve_cpu::linear_argmax_amx") == 3  # each step's LM head
    assert calls.get("pagedserve_cpu::decode_layers") == 2  # the two decode steps
    assert calls.get("pagedserve_cpu::linear_amx") == len(linears)  # the prefill step's
    assert "mkldnn::_linear_pointwise" not in calls
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_bf16_linear_layers_run_on_avx512_panels_without_amx(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch, enforce_eager: bool
) -> None:
    """Without AMX, on AVX512-BF16: the prefill step's multiplies read the AVX512-BF16 panels eager,
    and are inductor's oneDNN matmuls compiled; either way each decode step is one `decode_layers`
    call, which multiplies the panels itself (no op dispatched per multiply), and the LM head is ours
    each step. Greedy, it takes each row's argmax itself (`linear_argmax_avx512`, no logits)."""
    if not decode_layers_available():
        pytest.skip("no AVX512-BF16 build of the C++ kernels here")
    monkeypatch.setattr(pagedserve.layers.linear, "amx_linear_available", lambda: False)
    llm = LLM(model=tiny_llama_dir, dtype="bfloat16", num_kv_blocks=16, enforce_eager=enforce_eager)
    model = llm.engine.executor.worker.model_runner.model
    num_linears = 4 * llm.engine.config.model.num_layers
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = llm.generate([[1, 400, 401, 402]], params)
    assert model.lm_head.packed_weight.dim() == 4
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("pagedserve_cpu::linear_argmax_avx512") == 3  # each step's LM head
    assert calls.get("pagedserve_cpu::decode_layers") == 2  # the two decode steps
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == num_linears and all(m.packed_weight.dim() == 4 for m in linears)
    if enforce_eager:
        assert calls.get("pagedserve_cpu::linear_avx512") == num_linears  # the prefill step's
        assert "mkldnn::_linear_pointwise" not in calls
    else:
        assert "pagedserve_cpu::linear_avx512" not in calls
        assert calls.get("mkldnn::_linear_pointwise") == num_linears  # the prefill, in the compiled pass
    assert len(out[0].outputs[0].token_ids) == 3


def decode_layers_available() -> bool:
    from pagedserve_kernels import cpu

    return cpu.load() and cpu.decode_layers_supported()


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
@pytest.mark.parametrize("packing", ["this-cpu", "without-amx", "onednn"])
def test_decode_steps_run_every_layer_in_one_cpp_call(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch, packing: str, enforce_eager: bool
) -> None:
    """bf16 on a CPU with AVX512-BF16: a decode-only step is one `decode_layers` call (the forward pass,
    compiled or eager, runs the prefill step) whose hidden states are the forward pass's within
    bfloat16 rounding (the kernel against the reference layers: tests/kernels/test_cpu_decode_layers.py).
    Greedy tokens may part where two logits are that close; tests/engine/test_hf_parity.py holds the
    float32 path to Hugging Face. The linear weights it reads are packed, their plain copies
    released: into AVX512-BF16 panels (`linear_avx512`, 4-d), compiled without AMX once the pass is
    compiled (inductor packs its own copies for oneDNN), or for oneDNN (2-d) where panels are not to
    be had, before the pass is compiled, which reads them through `onednn_linear`."""
    if not decode_layers_available():
        pytest.skip("no AVX512-BF16 build of the C++ kernels here")
    if packing != "this-cpu":
        monkeypatch.setattr(pagedserve.layers.linear, "amx_linear_available", lambda: False)
    if packing == "onednn":
        monkeypatch.setattr(pagedserve.layers.linear, "avx512_linear_available", lambda: False)
    llm = LLM(model=tiny_llama_dir, dtype="bfloat16", num_kv_blocks=64, enforce_eager=enforce_eager)
    runner = llm.engine.executor.worker.model_runner
    assert (runner.forward is runner.model) is enforce_eager
    fused = runner.fused_decode
    assert fused is not None
    if packing != "this-cpu" or not amx_linear_available():
        linears = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
        packed_dim = 2 if packing == "onednn" else 4  # the tiny model's shapes all fit the panels
        assert all(m.packed_weight.dim() == packed_dim and m.weight.numel() == 0 for m in linears)
        assert runner.model.lm_head.packed_weight.dim() == packed_dim
    steps: list[Step] = []
    runner.fused_decode = recording(fused, steps)  # type: ignore[assignment]
    prompts = [[1, 400 + i, 401, 402 + 3 * i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        outputs = llm.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("pagedserve_cpu::decode_layers") == 7 == len(steps)  # one prefill step, 7 decodes
    if not enforce_eager:  # the compiled pass calls attention as an op outside its graph
        assert calls.get("pagedserve::attention") == llm.engine.config.model.num_layers  # the prefill's
    input_ids, positions, metadata, hidden = steps[3]
    with torch.inference_mode(), step_metadata(metadata, runner.attention_layers):  # type: ignore[arg-type]
        forward = runner.forward(input_ids, positions, metadata)  # rewrites the same K/V slots
    assert hidden.shape == forward.shape == (6, runner.model.embed_tokens.weight.shape[1])
    error = (hidden.float() - forward.float()).abs().max() / forward.float().abs().max()
    assert error < 0.03, f"fused decode differs from the forward pass by {error:.3%} of the largest value"


def test_every_engine_in_a_process_compiles(tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo compiles at most `recompile_limit` graphs for one function: each engine compiles its
    model's forward as a function of its own, so engines past that limit (the ninth in a process by
    default, the third here) still get a compiled pass instead of a warning and the eager one."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for _ in range(3):
        llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=16, enforce_eager=False)
        runner = llm.engine.executor.worker.model_runner
        assert runner.forward is not runner.model  # _compile returns the model itself when it fails
        assert len(llm.generate([[1, 400, 401]], params)[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_dropped_compiled_engine_frees_its_weights(tiny_llama_dir: str, dtype: str) -> None:
    """Inductor keeps the modules it generates (with the frozen weights on them) in `sys.modules` and
    its module cache for the life of the process: each compiled engine built and dropped left ~600
    MB behind on the default model. Once the model is gone, its modules and graphs go too (where the
    weights are frozen; where they are graph inputs, AMX tiles or oneDNN's layout, nothing compiled
    may keep them)."""
    import weakref

    llm = LLM(model=tiny_llama_dir, dtype=dtype, num_kv_blocks=16, enforce_eager=False)
    runner = llm.engine.executor.worker.model_runner
    assert runner.forward is not runner.model  # compiled
    weights = [weakref.ref(p) for p in runner.model.parameters()]
    outputs = llm.generate([[1, 400, 401]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(outputs[0].outputs[0].token_ids) == 2
    del llm, runner
    # the model, then (its finalizer run) the generated modules, then what they held in cycles: as
    # many passes as that takes (three for bfloat16 left to inductor, on a CPU without AMX)
    for _ in range(10):
        if not gc.collect():
            break
    alive = [ref() for ref in weights if ref() is not None]
    assert weights and not alive, [tuple(t.shape) for t in alive]


def test_decode_layers_only_where_it_applies(tiny_llama_dir: str) -> None:
    """Not for float32 (the kernel is bf16 only), compiled or eager, nor on tensor-parallel ranks (the
    kernel has no all-reduce): they keep the forward pass for every step. --enforce-eager turns off
    torch.compile, not the C++ kernels: a bf16 eager engine takes it where it builds."""
    for eager in (False, True):
        llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=16, enforce_eager=eager)
        assert llm.engine.executor.worker.model_runner.fused_decode is None
    eager_bf16 = LLM(model=tiny_llama_dir, dtype="bfloat16", num_kv_blocks=16, enforce_eager=True)
    runner = eager_bf16.engine.executor.worker.model_runner
    assert (runner.fused_decode is not None) == decode_layers_available()
    tp = LLM(model=tiny_llama_dir, dtype="bfloat16", num_kv_blocks=16, tensor_parallel_size=2)
    try:
        assert tp.engine.executor.worker.model_runner.fused_decode is None  # rank 0's, in this process
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(tp.generate([[1, 400, 401]], params)[0].outputs[0].token_ids) == 4
    finally:
        tp.engine.executor.shutdown()


def test_sampling_takes_the_cpp_kernels_on_cpu(tiny_llama_dir: str) -> None:
    """Where the C++ CPU kernels build, the engine's sampler reads the argmax of all-greedy batches
    from them (tests/kernels/test_cpu_argmax.py: the same index as torch's max), draws the random rows
    of batches that only draw straight from the logits (tests/unit/test_sampler_draw_kernel.py) and
    the others' by the kernel's inversion (tests/unit/test_sampler_inversion.py); greedy parity with
    Hugging Face through this path is in test_hf_parity.py."""
    from pagedserve_kernels import cpu

    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=16, enforce_eager=True)
    assert cpu.load()
    sampler = llm.engine.executor.worker.model_runner.sampler
    assert sampler.argmax_rows is cpu.argmax_rows
    assert sampler.invert_rows is cpu.invert_rows
    assert sampler.sample_rows is cpu.sample_rows


def test_without_a_cpp_compiler_the_engine_runs_eagerly(tiny_llama_dir: str, tmp_path: Path) -> None:
    """Inductor and the C++ CPU kernels (pagedserve_kernels.cpu) are built with the C++ compiler:
    none found (and nothing cached) means warnings, the eager forward pass and the pure-torch
    attention, with the same outputs, not a failed start."""
    script = (
        "from pagedserve import LLM, SamplingParams\n"
        f"llm = LLM(model={tiny_llama_dir!r}, dtype='float32', num_kv_blocks=16, enforce_eager=False)\n"
        "out = llm.generate([[1, 400, 401, 402]], SamplingParams(temperature=0, max_tokens=5))\n"
        "print('TOKENS', out[0].outputs[0].token_ids)\n"
        "print('ARGMAX', llm.engine.executor.worker.model_runner.sampler.argmax_rows)\n"
    )
    env = {
        **os.environ,
        "CXX": str(tmp_path / "no-such-g++"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache"),
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),
    }
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch.compile failed, running the forward pass eagerly" in result.stderr
    assert "CPU kernels unavailable, using the pure-torch reference" in result.stderr
    assert "ARGMAX None" in result.stdout  # greedy sampling on torch's max too
    eager = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=16, enforce_eager=True)
    expected = eager.generate([[1, 400, 401, 402]], SamplingParams(temperature=0, max_tokens=5))
    assert f"TOKENS {expected[0].outputs[0].token_ids}" in result.stdout
