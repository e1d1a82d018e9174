"""`--tokenizer` (`LLM(tokenizer=...)`), as vLLM's: the tokenizer and its chat template are read from
that directory instead of the model's. A model directory without a tokenizer serves with one; a model
directory without one and no `--tokenizer`, a `--tokenizer` that holds none, and one that does not load
are each refused at start-up naming `tokenizer`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from model_files import model_without_tokenizer
from pagedserve import LLM, SamplingParams
from pagedserve.settings import EngineSettings
from tiny_models import copy_tokenizer

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
ENGINE = {"dtype": "float32", "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def bare_model_dir(default_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return model_without_tokenizer(default_model_dir, tmp_path_factory.mktemp("bare") / "SmolLM2-bare")


def test_a_model_without_a_tokenizer_serves_with_tokenizer_as_the_model_does(
    default_model_dir: str, bare_model_dir: str
) -> None:
    """Greedy text and token ids, raw prompts and a chat (the tokenizer's chat template), equal the
    model's with its own tokenizer; the EOS ids (generation_config.json of the model, the tokenizer's
    own) are the same."""
    plain = LLM(model=default_model_dir, **ENGINE)
    expected = [
        [(o.outputs[0].text, o.outputs[0].token_ids) for o in plain.generate(PROMPTS, GREEDY)],
        [(o.outputs[0].text, o.outputs[0].token_ids) for o in plain.chat(QUESTION, GREEDY)],
    ]
    eos_token_ids = plain.engine.eos_token_ids
    del plain
    served = LLM(model=bare_model_dir, tokenizer=default_model_dir, **ENGINE)
    got = [
        [(o.outputs[0].text, o.outputs[0].token_ids) for o in served.generate(PROMPTS, GREEDY)],
        [(o.outputs[0].text, o.outputs[0].token_ids) for o in served.chat(QUESTION, GREEDY)],
    ]
    assert got == expected
    assert "Paris" in got[1][0][0]
    assert served.engine.eos_token_ids == eos_token_ids
    assert served.engine.config.model.served_model_name == "SmolLM2-bare"  # still the model's name


def test_without_tokenizer_a_model_without_one_is_refused_saying_to_pass_it(bare_model_dir: str) -> None:
    with pytest.raises(
        ValueError, match=r"^tokenizer: the model directory .* holds no tokenizer .*--tokenizer"
    ):
        LLM(model=bare_model_dir, **ENGINE)


def test_a_tokenizer_path_without_a_tokenizer_is_refused_naming_it(
    bare_model_dir: str, tmp_path: Path
) -> None:
    for path, says in [
        (tmp_path / "nowhere", "is not a directory"),
        (Path(bare_model_dir), "holds no tokenizer"),
        (Path(bare_model_dir) / "config.json", "is not a directory"),
    ]:
        with pytest.raises(ValueError, match=rf"tokenizer\n.*{says}") as info:
            EngineSettings(model=bare_model_dir, tokenizer=str(path))
        assert str(path) in str(info.value)


def test_a_tokenizer_that_does_not_load_is_refused_naming_it(
    default_model_dir: str, bare_model_dir: str, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(default_model_dir, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=r"^tokenizer: the tokenizer in .*broken' does not load: "):
        LLM(model=bare_model_dir, tokenizer=str(broken), **ENGINE)


def test_the_chat_template_is_the_tokenizers(tiny_llama_dir: str, tmp_path: Path) -> None:
    """A tokenizer whose chat template differs from the model directory's: the chat prompt is its."""
    tokenizer_dir = tmp_path / "plain-chat"
    tokenizer_dir.mkdir()
    copy_tokenizer(tiny_llama_dir, tokenizer_dir)
    (tokenizer_dir / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    )
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    own = LLM(model=tiny_llama_dir, **ENGINE).chat(QUESTION, one_token)[0].prompt
    [out] = LLM(model=tiny_llama_dir, tokenizer=str(tokenizer_dir), **ENGINE).chat(QUESTION, one_token)
    assert own is not None and own.startswith("<|im_start|>")  # the model directory's (ChatML)
    assert out.prompt == "[user] What is the capital of France?\n[assistant]"
