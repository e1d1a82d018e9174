"""LoRA adapters loaded and unloaded while the engine runs (vLLM's runtime LoRA updating): a loaded
adapter gives PEFT's tokens, also on an engine started without any; an unloaded one is refused by name
and its prefix-cache blocks are dropped, so a new adapter loaded under the same name never reads the
old one's KV; one in use is not unloaded; a bad one is refused whole and leaves the engine serving."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_adapters import build_lora_adapter, peft_greedy_tokens
from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.errors import AdapterInUseError, InvalidRequestError

MAX_TOKENS = 12
PROMPT = [1, *range(300, 323)]  # 24 tokens: three full blocks of 8


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-runtime")
    return {
        "first": build_lora_adapter(root / "first", tiny_llama_dir, rank=8, seed=11),
        "second": build_lora_adapter(
            root / "second", tiny_llama_dir, rank=4, targets=("q_proj", "down_proj"), seed=12
        ),
    }


@pytest.fixture(scope="module")
def peft_tokens(tiny_llama_dir: str, adapters: dict[str, str]) -> dict[str | None, list[int]]:
    return {
        name: peft_greedy_tokens(tiny_llama_dir, adapters.get(name or ""), PROMPT, MAX_TOKENS)
        for name in (None, "first", "second")
    }


def tokens(llm: LLM, lora: LoRARequest | None) -> list[int]:
    return llm.generate([PROMPT], greedy(), lora_request=lora)[0].outputs[0].token_ids


def test_an_engine_started_without_adapters_loads_one(
    tiny_llama_dir: str, adapters: dict[str, str], peft_tokens: dict
) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=8)
    assert tokens(llm, None) == peft_tokens[None]
    llm.engine.load_lora_adapter("first", adapters["first"])
    assert llm.engine.lora_names == ("first",)
    assert tokens(llm, LoRARequest("first")) == peft_tokens["first"]
    assert tokens(llm, None) == peft_tokens[None]


def test_a_lora_request_with_a_path_loads_its_adapter_on_first_use(
    tiny_llama_dir: str, adapters: dict[str, str], peft_tokens: dict
) -> None:
    """vLLM's offline API: `LoRARequest(name, id, path)` names an adapter to load where none of that
    name is loaded."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=8)
    requests = [
        LoRARequest("second", 2, adapters["second"]),
        None,
        LoRARequest("first", 1, adapters["first"]),
    ]
    outs = llm.generate([PROMPT] * 3, greedy(), lora_request=requests)
    assert [o.outputs[0].token_ids for o in outs] == [
        peft_tokens["second"],
        peft_tokens[None],
        peft_tokens["first"],
    ]
    assert llm.engine.lora_names == ("second", "first")
    assert tokens(llm, LoRARequest("second", 2, adapters["second"])) == peft_tokens["second"]  # loaded once
    with pytest.raises(
        InvalidRequestError, match=r"^lora_request: 'second' is loaded from .*, not .*first: unload"
    ):
        tokens(llm, LoRARequest("second", 2, adapters["first"]))  # another adapter under a loaded name
    assert (
        tokens(llm, LoRARequest("second", 2, adapters["second"] + "/")) == peft_tokens["second"]
    )  # same dir


def test_an_adapter_reloaded_under_its_name_never_reads_the_old_kv(
    tiny_llama_dir: str, adapters: dict[str, str], peft_tokens: dict
) -> None:
    """PROMPT's blocks cached under "x" (the first adapter) would be hits for the same name and
    tokens: unloading "x" drops them, so "x" reloaded from the second adapter computes its own."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=8, lora_modules={"x": adapters["first"]})
    assert tokens(llm, LoRARequest("x")) == peft_tokens["first"]
    llm.engine.unload_lora_adapter("x")
    assert llm.engine.lora_names == ()
    with pytest.raises(InvalidRequestError, match="^lora_name: unknown adapter 'x'"):
        tokens(llm, LoRARequest("x"))
    llm.engine.load_lora_adapter("x", adapters["second"])
    out = llm.generate([PROMPT], greedy(), lora_request=LoRARequest("x"))[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == peft_tokens["second"]
    assert tokens(llm, LoRARequest("x")) == peft_tokens["second"]  # and its own blocks are hits again


def test_an_adapter_in_use_is_not_unloaded(
    tiny_llama_dir: str, adapters: dict[str, str], peft_tokens: dict
) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=8, lora_modules={"first": adapters["first"]})
    engine = llm.engine
    engine.add_request("busy", PROMPT, greedy(), lora_name="first")
    out = [t for delta in engine.step() for t in delta.new_token_ids]
    with pytest.raises(AdapterInUseError, match=r"^lora_name: 'first' is in use by 1 request"):
        engine.unload_lora_adapter("first")
    while engine.has_unfinished_requests():
        out += [t for delta in engine.step() for t in delta.new_token_ids]
    assert out == peft_tokens["first"]  # the refused unload changed nothing
    engine.unload_lora_adapter("first")
    assert engine.lora_names == ()


def test_bad_loads_and_unloads_are_refused_and_the_engine_serves_on(
    tiny_llama_dir: str, default_model_dir: str, adapters: dict[str, str], peft_tokens: dict, tmp_path: Path
) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=8, lora_modules={"first": adapters["first"]})
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="^lora_name: an adapter named 'first' is loaded already"):
        engine.load_lora_adapter("first", adapters["second"])
    with pytest.raises(InvalidRequestError, match="^lora_name: must not be empty"):
        engine.load_lora_adapter("", adapters["second"])
    with pytest.raises(
        InvalidRequestError, match=r"^lora_path: adapter 'y' \(/nowhere\): no adapter_config.json"
    ):
        engine.load_lora_adapter("y", "/nowhere")
    other_model = build_lora_adapter(tmp_path / "smollm", default_model_dir, rank=2, targets=("o_proj",))
    with pytest.raises(InvalidRequestError, match="^lora_path: adapter 'z' .*: the model has 2 layers"):
        engine.load_lora_adapter("z", other_model)
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        data = (Path(adapters["second"]) / name).read_bytes()
        (truncated / name).write_bytes(data if name.endswith(".json") else data[: len(data) // 2])
    with pytest.raises(InvalidRequestError, match="^lora_path: .*adapter_model.safetensors does not read"):
        engine.load_lora_adapter("t", str(truncated))
    with pytest.raises(InvalidRequestError, match="^lora_name: no adapter named 'nope' is loaded"):
        engine.unload_lora_adapter("nope")
    assert engine.lora_names == ("first",)
    assert tokens(llm, LoRARequest("first")) == peft_tokens["first"]
    assert tokens(llm, None) == peft_tokens[None]


@pytest.mark.slow
def test_tensor_parallel_ranks_load_and_unload_together(
    tiny_llama_dir: str, adapters: dict[str, str], peft_tokens: dict
) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=8, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        llm.engine.load_lora_adapter("first", adapters["first"])
        llm.engine.load_lora_adapter("second", adapters["second"])
        outs = llm.generate(
            [PROMPT] * 3, greedy(), lora_request=[LoRARequest("first"), None, LoRARequest("second")]
        )
        assert [o.outputs[0].token_ids for o in outs] == [peft_tokens[n] for n in ("first", None, "second")]
        llm.engine.unload_lora_adapter("first")
        assert tokens(llm, LoRARequest("second")) == peft_tokens["second"]
        with pytest.raises(InvalidRequestError, match="^lora_path: .*no adapter_config.json"):
            llm.engine.load_lora_adapter("bad", "/nowhere")
        assert tokens(llm, None) == peft_tokens[None]
    finally:
        llm.engine.executor.shutdown()


def test_lora_requests_info_follows_loads_and_unloads(tiny_llama_dir: str, adapters: dict[str, str]) -> None:
    """Absent while the engine serves no adapter; its `max_lora` then counts the adapters loaded."""
    from prometheus_client.parser import text_string_to_metric_families

    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=8)

    def info() -> list[dict[str, str]]:
        families = text_string_to_metric_families(llm.engine.metrics.render().decode())
        return [s.labels for f in families if f.name == "vllm:lora_requests_info" for s in f.samples]

    assert info() == []
    llm.engine.load_lora_adapter("first", adapters["first"])
    llm.engine.load_lora_adapter("second", adapters["second"])
    idle = {"waiting_lora_adapters": "", "running_lora_adapters": ""}
    assert info() == [{"max_lora": "2", **idle}]
    llm.engine.unload_lora_adapter("first")
    assert info() == [{"max_lora": "1", **idle}]
