"""Multi-LoRA serving against PEFT itself: adapters made and run by PEFT (`tests/lora_adapters.py`) give
the same greedy tokens through `LLM(lora_modules=...)`, alone, mixed with other adapters and the base
model in one batch, after preemption, with tensor parallelism and beside the compiled pass; the
same tokens under different adapters never share prefix-cache blocks; a bad adapter or name is
refused naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lora_adapters import build_lora_adapter, peft_greedy_tokens
from pagedserve import LLM, LoRARequest, PoolingParams, SamplingParams
from pagedserve.errors import InvalidRequestError

MAX_TOKENS = 12
# 24 prompt tokens: three full blocks of 8, so a repeated prompt hits the prefix cache
PROMPT = [1, *range(300, 323)]
OTHER_PROMPT = [1, *range(700, 711)]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """`all`: rank 8 on every projection; `qv`: rank 4 on q and v alone, rsLoRA (another scale)."""
    root = tmp_path_factory.mktemp("lora")
    return {
        "all": build_lora_adapter(root / "all", tiny_llama_dir, rank=8, seed=1),
        "qv": build_lora_adapter(
            root / "qv",
            tiny_llama_dir,
            rank=4,
            alpha=8,
            targets=("q_proj", "v_proj"),
            seed=2,
            use_rslora=True,
        ),
    }


@pytest.fixture(scope="module")
def peft_tokens(tiny_llama_dir: str, adapters: dict[str, str]) -> dict[tuple[str | None, int], list[int]]:
    """PEFT's greedy tokens for (adapter or None, prompt number)."""
    return {
        (name, i): peft_greedy_tokens(tiny_llama_dir, adapters.get(name or ""), prompt, MAX_TOKENS)
        for name in (None, "all", "qv")
        for i, prompt in enumerate((PROMPT, OTHER_PROMPT))
    }


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str, adapters: dict[str, str]) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", block_size=8, lora_modules=adapters)


def test_adapters_differ_from_the_base_model(peft_tokens: dict) -> None:
    """Guards the tests below: an adapter that changed nothing would pass them unapplied."""
    for i in (0, 1):
        assert peft_tokens["all", i] != peft_tokens[None, i]
        assert peft_tokens["qv", i] != peft_tokens[None, i]


@pytest.mark.parametrize("name", ["all", "qv"])
def test_one_adapter_matches_peft(llm: LLM, peft_tokens: dict, name: str) -> None:
    out = llm.generate([PROMPT], greedy(), lora_request=LoRARequest(name))
    assert out[0].outputs[0].token_ids == peft_tokens[name, 0]


def test_a_batch_mixes_adapters_and_the_base_model(llm: LLM, peft_tokens: dict) -> None:
    """The same prompt under every adapter and none, in one batch: each row gets its own update (and
    none shares another's cached blocks)."""
    cases = [(name, i) for i in (0, 1) for name in ("all", None, "qv")]
    prompts = [(PROMPT, OTHER_PROMPT)[i] for _, i in cases]
    requests = [None if name is None else LoRARequest(name) for name, _ in cases]
    outs = llm.generate(prompts, greedy(), lora_request=requests)
    assert [o.outputs[0].token_ids for o in outs] == [peft_tokens[case] for case in cases]
    assert [o.lora_request for o in outs] == requests  # as vLLM's RequestOutput says it


def test_the_prefix_cache_keeps_adapters_apart(llm: LLM, peft_tokens: dict) -> None:
    """A prompt cached under one adapter is a miss under another and under the base model, a hit
    under the same one."""
    for name in ("all", None, "qv", "all"):
        request = None if name is None else LoRARequest(name)
        out = llm.generate([PROMPT], greedy(), lora_request=request)[0]
        assert out.outputs[0].token_ids == peft_tokens[name, 0], name
    assert (
        out.num_cached_tokens == 16
    )  # the last run: "all"'s blocks from the first (all but the last token's)


def test_preempted_lora_requests_resume_through_their_adapter(
    tiny_llama_dir: str, adapters: dict[str, str], peft_tokens: dict
) -> None:
    """Too few blocks for all at once: requests are preempted (recompute and swap) and re-announced to
    the worker, which must find their adapter again."""
    for mode in ("recompute", "swap"):
        llm = LLM(
            model=tiny_llama_dir,
            dtype="float32",
            block_size=8,
            num_kv_blocks=12,
            preemption_mode=mode,
            enable_prefix_caching=False,
            lora_modules=adapters,
        )
        names = ["all", "qv", None, "all", "qv", None]
        outs = llm.generate(
            [PROMPT] * len(names),
            greedy(),
            lora_request=[None if n is None else LoRARequest(n) for n in names],
        )
        assert llm.engine.stats().num_preemptions > 0, mode
        assert [o.outputs[0].token_ids for o in outs] == [peft_tokens[n, 0] for n in names], mode


def test_embeddings_run_through_the_adapter(llm: LLM) -> None:
    base = llm.embed([PROMPT], PoolingParams())[0].outputs.embedding
    adapted = llm.embed([PROMPT], PoolingParams(), lora_request=LoRARequest("all"))[0].outputs.embedding
    again = llm.embed([PROMPT], PoolingParams(), lora_request=LoRARequest("all"))[0].outputs.embedding
    assert adapted == pytest.approx(again, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(base, adapted, strict=True)) > 1e-2


@pytest.mark.slow
def test_tensor_parallel_ranks_slice_the_adapters(
    tiny_llama_dir: str, adapters: dict[str, str], peft_tokens: dict
) -> None:
    """Two gloo ranks: B split with a column-parallel layer's outputs, A with a row-parallel layer's
    inputs (its update summed by the all-reduce)."""
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        block_size=8,
        num_kv_blocks=64,
        tensor_parallel_size=2,
        lora_modules=adapters,
    )
    try:
        cases = [("all", 0), (None, 0), ("qv", 1), ("all", 1)]
        outs = llm.generate(
            [(PROMPT, OTHER_PROMPT)[i] for _, i in cases],
            greedy(),
            lora_request=[None if n is None else LoRARequest(n) for n, _ in cases],
        )
        assert [o.outputs[0].token_ids for o in outs] == [peft_tokens[c] for c in cases]
    finally:
        llm.engine.executor.shutdown()


@pytest.mark.slow
def test_lora_steps_leave_the_compiled_pass_and_decode_layers(
    tiny_llama_dir: str, adapters: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 with torch.compile (and decode_layers where the CPU has it): a LoRA request's steps
    run eagerly with its update, the tokens an eager engine gives; base requests keep the fast paths."""
    monkeypatch.setenv("PAGEDSERVE_ENFORCE_EAGER", "0")
    settings = {"model": tiny_llama_dir, "dtype": "bfloat16", "block_size": 8, "lora_modules": adapters}
    compiled = LLM(**settings)
    assert compiled.engine.config.compile
    eager = LLM(**settings, enforce_eager=True)
    for name in ("all", "qv"):
        want = eager.generate([PROMPT], greedy(), lora_request=LoRARequest(name))[0].outputs[0].token_ids
        got = compiled.generate([PROMPT], greedy(), lora_request=LoRARequest(name))[0].outputs[0].token_ids
        assert got == want, name
    base = compiled.generate([PROMPT], greedy())[0].outputs[0].token_ids
    assert base != want


def test_unknown_adapter_names_are_refused(llm: LLM, tiny_llama_dir: str) -> None:
    with pytest.raises(
        InvalidRequestError, match=r"^lora_name: unknown adapter 'nope' \(this server has: all, qv\)"
    ):
        llm.generate([PROMPT, PROMPT], greedy(), lora_request=[None, LoRARequest("nope")])
    with pytest.raises(InvalidRequestError, match="^lora_request: got 1 for 2 prompts"):
        llm.generate([PROMPT, PROMPT], greedy(), lora_request=[LoRARequest("all")])
    with pytest.raises(InvalidRequestError, match="^lora_request: must be a LoRARequest"):
        llm.generate([PROMPT], greedy(), lora_request="all")  # type: ignore[arg-type]
    assert llm.generate([PROMPT], greedy(), lora_request=LoRARequest("all"))[0].outputs[0].token_ids
    plain = LLM(model=tiny_llama_dir, dtype="float32")
    with pytest.raises(InvalidRequestError, match=r"serves no LoRA adapters \(--lora-modules\)"):
        plain.generate([PROMPT], greedy(), lora_request=LoRARequest("all"))
    with pytest.raises(
        InvalidRequestError, match=r"^lora_path: adapter 'all' \(/some/path\): no adapter_config"
    ):
        plain.generate(
            [PROMPT], greedy(), lora_request=LoRARequest("all", 1, "/some/path")
        )  # loads on first use


def _copy_adapter(source: str, dest: Path) -> Path:
    dest.mkdir()
    for f in Path(source).iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def test_adapters_that_do_not_fit_the_model_are_refused(
    tiny_llama_dir: str, default_model_dir: str, adapters: dict[str, str], tmp_path: Path
) -> None:
    """Checked where the adapter loads, naming `lora_modules`, the adapter and what is wrong."""
    from tiny_models import build_tiny_llama

    deeper = build_lora_adapter(tmp_path / "smollm", default_model_dir, rank=2, targets=("o_proj",))
    with pytest.raises(
        ValueError, match=r"^lora_modules: adapter 'deep' \(.*\): layer 2 o_proj: the model has 2 layers"
    ):
        LLM(model=tiny_llama_dir, dtype="float32", lora_modules={"deep": deeper})
    narrow_model = build_tiny_llama(tmp_path / "narrow-model", default_model_dir, head_dim=8)
    narrow = build_lora_adapter(tmp_path / "narrow", narrow_model, rank=2, targets=("o_proj",))
    with pytest.raises(
        ValueError, match=r"^lora_modules: adapter 'narrow' \(.*\): layer 0 o_proj does not fit"
    ):
        LLM(model=tiny_llama_dir, dtype="float32", lora_modules={"narrow": narrow})

    from safetensors.torch import load_file, save_file

    extra = _copy_adapter(adapters["qv"], tmp_path / "extra")
    tensors = load_file(str(extra / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = next(iter(tensors.values())).clone()
    save_file(tensors, str(extra / "adapter_model.safetensors"))
    with pytest.raises(
        ValueError, match="lm_head.lora_A.weight' is not a LoRA of a decoder layer's projection"
    ):
        LLM(model=tiny_llama_dir, dtype="float32", lora_modules={"extra": str(extra)})

    one_sided = _copy_adapter(adapters["qv"], tmp_path / "one-sided")
    tensors = load_file(str(one_sided / "adapter_model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if "lora_B" not in k}, str(one_sided / "adapter_model.safetensors")
    )
    with pytest.raises(ValueError, match="layer 0 q_proj has lora_A alone"):
        LLM(model=tiny_llama_dir, dtype="float32", lora_modules={"one": str(one_sided)})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "DoRA is not supported"),
        ({"modules_to_save": ["lm_head"]}, r"modules_to_save \(fully trained modules\) is not supported"),
        ({"bias": "all"}, "bias 'all' is not supported"),
        ({"peft_type": "IA3"}, r"peft_type 'IA3' \(LORA is served\)"),
        ({"alpha_pattern": {"layers.0.q_proj": 4}}, "alpha_pattern keys must be module names"),
    ],
)
def test_adapter_configs_peft_would_apply_otherwise_are_refused(
    adapters: dict[str, str], tmp_path: Path, change: dict, message: str
) -> None:
    from pagedserve.settings import EngineSettings
    from pydantic import ValidationError

    adapter = _copy_adapter(adapters["qv"], tmp_path / "a")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValidationError, match=message):
        EngineSettings(lora_modules=f"bad={adapter}")


def test_lora_requests_info_names_the_running_and_waiting_adapters(
    tiny_llama_dir: str, adapters: dict[str, str]
) -> None:
    """vLLM's `vllm:lora_requests_info`: one series, relabelled as the adapters in use change."""
    from prometheus_client.parser import text_string_to_metric_families

    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=8, max_num_seqs=1, lora_modules=adapters)
    engine = llm.engine

    def info() -> list[dict[str, str]]:
        families = text_string_to_metric_families(engine.metrics.render().decode())
        family = next(f for f in families if f.name == "vllm:lora_requests_info")
        return [sample.labels for sample in family.samples]

    idle = {"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": ""}
    assert info() == [idle]
    engine.add_request("a", PROMPT, greedy(), lora_name="qv")
    engine.add_request("b", PROMPT, greedy(), lora_name="all")
    engine.add_request("c", PROMPT, greedy())
    engine.step()  # one sequence a batch: "a" runs, the others wait
    assert info() == [{"max_lora": "2", "waiting_lora_adapters": "all", "running_lora_adapters": "qv"}]
    while engine.has_unfinished_requests():
        engine.step()
    assert info() == [idle]


def test_a_requests_span_names_its_adapter(llm: LLM) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from pagedserve.telemetry import RequestTracer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider, "m")
    engine = llm.engine
    for request_id, lora_name in (("traced-qv", "qv"), ("traced-base", None)):
        engine.add_request(request_id, PROMPT, greedy(), lora_name=lora_name)
        deltas = []
        while engine.has_unfinished_requests():
            deltas.extend(engine.step())
        last = deltas[-1]
        tracer.finish_request({}, request_id, greedy(), last, (last.metrics.arrival_time,) * 2, len(PROMPT))
    spans = {
        s.attributes["gen_ai.request.id"]: s for s in exporter.get_finished_spans() if s.name == "llm_request"
    }
    assert spans["traced-qv"].attributes["gen_ai.pagedserve.lora_name"] == "qv"
    assert "gen_ai.pagedserve.lora_name" not in spans["traced-base"].attributes


def test_chunked_prefill_runs_every_chunk_through_the_adapter(
    tiny_llama_dir: str, adapters: dict[str, str], peft_tokens: dict
) -> None:
    """A 24-token prompt in chunks of 16 budgeted tokens, beside a base request: each chunk's rows take
    the adapter (a chunk that missed it would leave wrong KV behind)."""
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        lora_modules=adapters,
    )
    outs = llm.generate([PROMPT, OTHER_PROMPT], greedy(), lora_request=[LoRARequest("all"), None])
    assert [o.outputs[0].token_ids for o in outs] == [peft_tokens["all", 0], peft_tokens[None, 1]]


def test_a_qwen3_adapter_updates_q_and_k_before_their_head_norms(
    tmp_path: Path, default_model_dir: str
) -> None:
    """Qwen3 norms each query and key head after the projection: PEFT's update of q_proj and k_proj
    enters before the norm, as ours (added to the qkv product) does."""
    from tiny_models import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path / "qwen3", default_model_dir, config_class="Qwen3Config")
    adapter = build_lora_adapter(tmp_path / "qk", model_dir, rank=8, targets=("q_proj", "k_proj"), seed=3)
    theirs = peft_greedy_tokens(model_dir, adapter, PROMPT, MAX_TOKENS)
    assert theirs != peft_greedy_tokens(model_dir, None, PROMPT, MAX_TOKENS)
    llm = LLM(model=model_dir, dtype="float32", block_size=8, lora_modules={"qk": adapter})
    [out] = llm.generate([PROMPT], greedy(), lora_request=LoRARequest("qk"))
    assert out.outputs[0].token_ids == theirs


def test_a_mixture_of_experts_takes_adapters_of_its_attention_and_dense_mlps(
    tmp_path: Path, default_model_dir: str
) -> None:
    """Qwen2-MoE with layer 1 dense: an adapter of every layer's attention and layer 1's MLP matches
    PEFT; one of an MLP made of experts is refused naming the layer (LoRAs of experts are not served)."""
    from safetensors.torch import load_file, save_file
    from tiny_models import build_tiny_qwen2_moe

    model_dir = build_tiny_qwen2_moe(tmp_path / "qwen2-moe", default_model_dir, num_experts=4)
    targets = r".*\.(self_attn\.(q|k|v|o)_proj|layers\.1\.mlp\.(gate|up|down)_proj)"
    adapter = build_lora_adapter(tmp_path / "adapter", model_dir, rank=8, targets=targets, seed=4, std=0.3)
    assert any(".layers.1.mlp.gate_proj." in key for key in load_file(f"{adapter}/adapter_model.safetensors"))
    theirs = peft_greedy_tokens(model_dir, adapter, PROMPT, MAX_TOKENS)
    assert theirs != peft_greedy_tokens(model_dir, None, PROMPT, MAX_TOKENS)
    llm = LLM(model=model_dir, dtype="float32", block_size=8, lora_modules={"a": adapter})
    [out] = llm.generate([PROMPT], greedy(), lora_request=LoRARequest("a"))
    assert out.outputs[0].token_ids == theirs

    experts = _copy_adapter(adapter, tmp_path / "experts")
    tensors = load_file(str(experts / "adapter_model.safetensors"))
    moved = {key.replace(".layers.1.mlp.", ".layers.0.mlp."): tensor for key, tensor in tensors.items()}
    save_file(moved, str(experts / "adapter_model.safetensors"))
    with pytest.raises(
        ValueError, match=r"adapter 'e' \(.*\): layer 0 down_proj: the layer's MLP is a mixture of experts"
    ):
        LLM(model=model_dir, dtype="float32", lora_modules={"e": str(experts)})


def test_deepseeks_latent_attention_takes_an_adapter_of_its_q_proj_and_o_proj(
    tmp_path: Path, default_model_dir: str
) -> None:
    """DeepSeek-V2-Lite's shape (its query in one projection, q_proj, whose rope rows are reordered on
    load for GPT-J's rotary, lora_B's with them): an adapter of q_proj and o_proj matches PEFT; one of
    k_proj, which the latent attention has no place for (its keys are the latent's), is refused
    naming the layer and the module. (PEFT 0.21 turns a pattern naming layer 0's dense gate_proj,
    up_proj and down_proj on this model into LoRAs of every layer's stacked experts instead, which take
    none here: dense MLPs' adapters are held to PEFT on other models.)"""
    from safetensors.torch import load_file, save_file
    from tiny_models import build_tiny_llama

    model_dir = build_tiny_llama(
        tmp_path / "deepseek-v2-lite",
        default_model_dir,
        config_class="DeepseekV2Config",
        num_kv_heads=4,
        kv_lora_rank=24,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
    )
    adapter = build_lora_adapter(
        tmp_path / "adapter", model_dir, rank=8, targets=("q_proj", "o_proj"), seed=4, std=0.3
    )
    theirs = peft_greedy_tokens(model_dir, adapter, PROMPT, MAX_TOKENS)
    assert theirs != peft_greedy_tokens(model_dir, None, PROMPT, MAX_TOKENS)
    llm = LLM(model=model_dir, dtype="float32", block_size=8, lora_modules={"a": adapter})
    [out] = llm.generate([PROMPT], greedy(), lora_request=LoRARequest("a"))
    assert out.outputs[0].token_ids == theirs

    keys = _copy_adapter(adapter, tmp_path / "k")
    tensors = load_file(str(keys / "adapter_model.safetensors"))
    save_file(
        {k.replace(".q_proj.", ".k_proj."): t for k, t in tensors.items()},
        str(keys / "adapter_model.safetensors"),
    )
    with pytest.raises(
        ValueError, match=r"adapter 'k' \(.*\): layer 0 k_proj: the layer's attention has no such projection"
    ):
        LLM(model=model_dir, dtype="float32", lora_modules={"k": str(keys)})


@pytest.mark.parametrize(
    ("config_class", "overrides"),
    [
        (
            "GraniteConfig",
            {
                "embedding_multiplier": 12.0,
                "attention_multiplier": 0.1,
                "residual_multiplier": 0.22,
                "logits_scaling": 8.0,
            },
        ),
        (
            "Gemma3TextConfig",
            {"query_pre_attn_scalar": 10, "sliding_window": 12, "sliding_window_pattern": 2},
        ),
        ("Olmo2Config", {}),
        # (q_proj's and k_proj's lora_B rows reordered as the base weights are for GPT-J's rotary)
        ("Glm4Config", {}),
        # (an ungated MLP: up_proj a layer of its own, not a part of gate_up_proj)
        ("ArceeConfig", {}),
    ],
    ids=["granite", "gemma3", "olmo2", "glm4", "arcee"],
)
def test_an_adapter_enters_before_what_the_layer_does_to_its_output(
    tmp_path: Path, default_model_dir: str, config_class: str, overrides: dict[str, object]
) -> None:
    """Granite scales each layer's attention and MLP output (o_proj's, down_proj's) before the
    residual add, Gemma 3, OLMo 2 and GLM-4 norm it (OLMo 2 its whole q and k projections too; GLM-4's
    rotary turns neighbouring dimensions, whose q and k rows are reordered on load): PEFT's update of
    those projections is scaled or normed (or reordered) with them, as ours (added to the product) is."""
    from tiny_models import build_tiny_llama

    model_dir = build_tiny_llama(
        tmp_path / "model", default_model_dir, config_class=config_class, **overrides
    )
    adapter = build_lora_adapter(tmp_path / "all", model_dir, rank=8, seed=6, std=0.3)
    theirs = peft_greedy_tokens(model_dir, adapter, PROMPT, MAX_TOKENS)
    assert theirs != peft_greedy_tokens(model_dir, None, PROMPT, MAX_TOKENS)
    llm = LLM(model=model_dir, dtype="float32", block_size=8, lora_modules={"all": adapter})
    [out] = llm.generate([PROMPT], greedy(), lora_request=LoRARequest("all"))
    assert out.outputs[0].token_ids == theirs


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_a_phi3_adapter_of_its_fused_modules_matches_peft(
    tmp_path: Path, default_model_dir: str, tensor_parallel_size: int
) -> None:
    """Phi-3's adapters name its fused modules (qkv_proj, gate_up_proj): one lora_A, and a lora_B
    whose rows stack the parts, cut as the base weight is (every rank its heads of q, k and v). An
    alpha_pattern scales one of them as PEFT does."""
    from tiny_models import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path / "phi3", default_model_dir, config_class="Phi3Config")
    adapter = build_lora_adapter(
        tmp_path / "fused",
        model_dir,
        rank=4,
        targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
        seed=4,
        alpha_pattern={"qkv_proj": 32},
    )
    theirs = peft_greedy_tokens(model_dir, adapter, PROMPT, MAX_TOKENS)
    assert theirs != peft_greedy_tokens(model_dir, None, PROMPT, MAX_TOKENS)
    llm = LLM(
        model=model_dir,
        dtype="float32",
        block_size=8,
        tensor_parallel_size=tensor_parallel_size,
        lora_modules={"fused": adapter},
    )
    try:
        [out] = llm.generate([PROMPT], greedy(), lora_request=LoRARequest("fused"))
        assert out.outputs[0].token_ids == theirs
    finally:
        llm.engine.executor.shutdown()


def test_a_fused_module_adapted_with_its_part_or_cut_wrong_is_refused(
    tmp_path: Path, default_model_dir: str
) -> None:
    from safetensors.torch import load_file, save_file
    from tiny_models import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path / "phi3", default_model_dir, config_class="Phi3Config")
    adapter = build_lora_adapter(tmp_path / "fused", model_dir, rank=4, targets=("qkv_proj",), seed=5)
    tensors = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.self_attn"
    overlapping = _copy_adapter(adapter, tmp_path / "overlapping")
    save_file(
        {
            **tensors,
            f"{prefix}.q_proj.lora_A.weight": tensors[f"{prefix}.qkv_proj.lora_A.weight"].clone(),
            f"{prefix}.q_proj.lora_B.weight": tensors[f"{prefix}.qkv_proj.lora_B.weight"][:64].clone(),
        },
        str(overlapping / "adapter_model.safetensors"),
    )
    with pytest.raises(ValueError, match=r"layer 0: qkv_proj overlaps another module adapted"):
        LLM(model=model_dir, dtype="float32", lora_modules={"overlapping": str(overlapping)})
    short = _copy_adapter(adapter, tmp_path / "short")
    save_file(
        {
            **tensors,
            f"{prefix}.qkv_proj.lora_B.weight": tensors[f"{prefix}.qkv_proj.lora_B.weight"][:-1].clone(),
        },
        str(short / "adapter_model.safetensors"),
    )
    with pytest.raises(
        ValueError,
        match=r"layer 0 qkv_proj does not fit the model: lora_B has 127 output features, the fused layer 128",
    ):
        LLM(model=model_dir, dtype="float32", lora_modules={"short": str(short)})


def test_speculative_decoding_verifies_drafts_through_the_adapter(
    tiny_llama_dir: str, adapters: dict[str, str], peft_tokens: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts (an oracle's: PEFT's next tokens, every third one wrong) run through the request's adapter
    as its other tokens do: the tokens are PEFT's."""
    from pagedserve.spec_decode import SpeculativeConfig
    from spec_drafts import oracle_proposer

    reference = [(PROMPT, peft_tokens["all", 0]), (OTHER_PROMPT, peft_tokens[None, 1])]
    monkeypatch.setattr(SpeculativeConfig, "propose", oracle_proposer(reference))
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        block_size=8,
        lora_modules=adapters,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    outs = llm.generate([PROMPT, OTHER_PROMPT], greedy(), lora_request=[LoRARequest("all"), None])
    assert [o.outputs[0].token_ids for o in outs] == [peft_tokens["all", 0], peft_tokens[None, 1]]
    stats = llm.engine.stats()
    assert stats.num_draft_tokens > stats.num_accepted_draft_tokens > 0
