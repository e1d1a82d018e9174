"""Sampling defaults from the model's generation_config.json, as vLLM's `--generation-config auto`:
a parameter a request leaves unset takes the model's value on every front end (the offline `LLM`,
our gRPC API, the KServe/Triton adapter); one the request sets wins; `--generation-config vllm`
keeps SamplingParams' own defaults."""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

import pytest
from inprocess_server import InProcessServer
from pagedserve import LLM, SamplingParams
from pagedserve.rpc.v1 import generate_pb2 as pb

PROMPT = "The capital of France is"
# greedy, 3 tokens: what a request without parameters gets from this model
GENERATION_CONFIG = {
    "eos_token_id": 2,
    "max_new_tokens": 3,
    "temperature": 0.0,
    "top_k": 5,
    "do_sample": True,
}


def model_with_generation_config(root: Path, model_dir: str, generation_config: dict[str, object]) -> str:
    """`model_dir`'s files with this generation_config.json."""
    root.mkdir(parents=True)
    for file in Path(model_dir).iterdir():
        if file.name != "generation_config.json":
            (root / file.name).symlink_to(file)
    (root / "generation_config.json").write_text(json.dumps(generation_config))
    return str(root)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str) -> str:
    return model_with_generation_config(
        tmp_path_factory.mktemp("gen") / "m", tiny_llama_dir, GENERATION_CONFIG
    )


def greedy_text(llm: LLM, max_tokens: int) -> str:
    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].outputs[0].text


def test_the_offline_api_takes_the_models_defaults(model_dir: str) -> None:
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=64)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=5, max_tokens=3)
    [out] = llm.generate(PROMPT)
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == greedy_text(llm, 3)
    assert llm.engine.sampling_params(max_tokens=5).max_tokens == 5  # a given value wins


def test_generation_config_vllm_keeps_the_builtin_defaults(model_dir: str) -> None:
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=64, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()


def test_a_value_sampling_params_refuses_stops_the_load_naming_the_file(
    tmp_path: Path, tiny_llama_dir: str
) -> None:
    bad = model_with_generation_config(tmp_path / "bad", tiny_llama_dir, {"temperature": -1.0})
    with pytest.raises(ValueError, match=r"^model: generation_config.json's temperature: must be >= 0"):
        LLM(model=bad, dtype="float32", num_kv_blocks=64)


def test_override_generation_config_goes_over_the_file_or_alone(model_dir: str, tmp_path: Path) -> None:
    """vLLM's --override-generation-config: its keys over the file's, the others kept; with
    --generation-config vllm, its keys alone. A bad file value it replaces is no error."""
    override = {"max_new_tokens": 5, "top_p": 0.9}
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=64, override_generation_config=override)
    assert llm.get_default_sampling_params() == SamplingParams(
        temperature=0.0, top_k=5, top_p=0.9, max_tokens=5
    )
    [out] = llm.generate(PROMPT)
    assert len(out.outputs[0].token_ids) == 5
    alone = LLM(
        model=model_dir,
        dtype="float32",
        num_kv_blocks=64,
        generation_config="vllm",
        override_generation_config=json.dumps(override),
    )
    assert alone.get_default_sampling_params() == SamplingParams(top_p=0.9, max_tokens=5)
    bad_file = model_with_generation_config(tmp_path / "m", model_dir, {"temperature": -1.0, "top_k": 5})
    fixed = LLM(
        model=bad_file, dtype="float32", num_kv_blocks=64, override_generation_config={"temperature": 0.5}
    )
    assert fixed.get_default_sampling_params() == SamplingParams(temperature=0.5, top_k=5)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (
            '{"do_sample": false}',
            "'do_sample' is not one of temperature, top_p, top_k, min_p, repetition_penalty",
        ),
        ('{"temperature": -1}', "temperature: must be >= 0"),
        ('{"max_new_tokens": 0}', "max_new_tokens: must be an integer >= 1"),
        ('"greedy"', "must be a JSON object of generation_config.json keys, got str"),
    ],
)
def test_a_bad_override_stops_serve_naming_the_flag(value: str, error: str) -> None:
    from pagedserve.rpc.cli import ServeSettings
    from pagedserve.settings import SettingsError, settings_from_args

    with pytest.raises(SettingsError) as info:
        settings_from_args(ServeSettings, argparse.Namespace(override_generation_config=value))
    assert str(info.value).startswith(f"--override-generation-config: {error}"), str(info.value)


def test_every_front_end_takes_the_models_defaults(model_dir: str) -> None:
    srv = InProcessServer(model_dir, dtype="float32", served_model_name="m", num_kv_blocks=64).start()
    try:
        unset = list(srv.stub.Generate(pb.GenerateRequest(text=PROMPT), timeout=60))
        text, tokens = "".join(r.text for r in unset), [t for r in unset for t in r.token_ids]
        assert len(tokens) == 3
        given = list(
            srv.stub.Generate(
                pb.GenerateRequest(
                    text=PROMPT, sampling=pb.SamplingParameters(temperature=0.0, max_tokens=3)
                ),
                timeout=60,
            )
        )
        assert text == "".join(r.text for r in given)  # the defaults were greedy, as the file says
        five = list(
            srv.stub.Generate(
                pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParameters(max_tokens=5)), timeout=60
            )
        )
        assert sum(len(r.token_ids) for r in five) == 5

        body = json.dumps({"text_input": PROMPT, "parameters": {"exclude_input_in_output": True}}).encode()
        request = urllib.request.Request(srv.http_url("/v2/models/m/generate"), data=body)
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert json.loads(reply.read())["text_output"] == text
    finally:
        srv.stop()
