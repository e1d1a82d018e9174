"""A bad setting is reported in the operator's terms: the flag or PAGEDSERVE_* variable that set it,
what is wrong and the value given, before `serve` binds a port or loads a model."""

from __future__ import annotations

import argparse
import json
import typing
from pathlib import Path

import pytest
from pagedserve.rpc.cli import ServeSettings
from pagedserve.settings import SettingsError, add_settings_arguments, config_error, settings_from_args


def parse(argv: list[str]) -> ServeSettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, ServeSettings)
    return settings_from_args(ServeSettings, parser.parse_args(argv))


@pytest.fixture(autouse=True)
def no_pagedserve_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [n for n in os.environ if n.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(name)


def lora_adapter_dir(path: Path, **config: object) -> str:
    """A LoRA adapter directory as far as `--lora-modules`' start-up checks read it."""
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, **config}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return str(path)


@pytest.mark.parametrize("value", ["24", "0", "512"])
def test_a_bad_flag_names_the_flag_and_the_value(value: str) -> None:
    with pytest.raises(SettingsError) as info:
        parse(["--block-size", value])
    assert str(info.value) == f"--block-size: must be a power of two in [1, 256], got {value}"


def test_a_bad_variable_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_MAX_NUM_SEQS", "many")
    with pytest.raises(SettingsError) as info:
        parse([])
    message = str(info.value)
    assert message.startswith("PAGEDSERVE_MAX_NUM_SEQS: ") and "(got 'many')" in message, message


def test_a_flag_wins_over_its_variable_and_is_the_one_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_NUM_KV_BLOCKS", "10")
    assert parse([]).num_kv_blocks == 10
    with pytest.raises(SettingsError, match=r"^--num-kv-blocks: must be >= 1$"):
        parse(["--num-kv-blocks", "0"])  # config.py calls it num_blocks; the operator never sees that


def test_a_limit_across_settings_names_the_one_to_raise() -> None:
    with pytest.raises(SettingsError) as info:
        parse(["--max-num-seqs", "4096"])
    # max_num_batched_tokens was left at its default: both ways to set it are named
    assert str(info.value).startswith(
        "--max-num-batched-tokens / PAGEDSERVE_MAX_NUM_BATCHED_TOKENS: must be >="
    )


def test_every_bad_setting_is_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_SWAP_SPACE", "lots")
    monkeypatch.setenv("PAGEDSERVE_PORT", "http")  # a flag of the wrong type is argparse's to reject
    with pytest.raises(SettingsError) as info:
        parse([])
    lines = str(info.value).splitlines()
    assert sorted(line.split(":")[0] for line in lines) == ["PAGEDSERVE_PORT", "PAGEDSERVE_SWAP_SPACE"], lines


def test_config_errors_from_the_model_name_their_source() -> None:
    model_error = ValueError("max_model_len: must be in [1, 8192] for this model, got 99999")
    assert str(config_error(model_error, {"max_model_len"})) == (
        "--max-model-len: must be in [1, 8192] for this model, got 99999"
    )
    plain = ValueError("something without a field")
    assert str(config_error(plain, set())) == "something without a field"


def test_triton_priority_levels_are_checked_against_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's rule: the default level is one of the levels, [1, priority_levels]."""
    assert (parse([]).triton_priority_levels, parse([]).triton_default_priority_level) == (3, 2)
    with pytest.raises(SettingsError) as info:
        parse(["--triton-priority-levels", "3", "--triton-default-priority-level", "5"])
    assert str(info.value) == (
        "--triton-default-priority-level: must be at most --triton-priority-levels (3), got 5"
    )
    monkeypatch.setenv("PAGEDSERVE_TRITON_PRIORITY_LEVELS", "1")
    with pytest.raises(SettingsError) as info:
        parse([])  # 1 level by the variable, the default level 2 left as it is
    assert str(info.value) == (
        "--triton-default-priority-level / PAGEDSERVE_TRITON_DEFAULT_PRIORITY_LEVEL: must be at most "
        "--triton-priority-levels (1), got 2"
    )
    monkeypatch.delenv("PAGEDSERVE_TRITON_PRIORITY_LEVELS")
    with pytest.raises(SettingsError, match=r"^--triton-priority-levels: .* 1 \(got 0\)$"):
        parse(["--triton-priority-levels", "0"])


def test_a_bad_lora_adapter_names_the_flag_or_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dora = lora_adapter_dir(tmp_path / "dora", use_dora=True)
    with pytest.raises(
        SettingsError, match=rf"^--lora-modules: adapter 'd' \({dora}\): DoRA is not supported"
    ):
        parse(["--lora-modules", f"d={dora}"])
    monkeypatch.setenv("PAGEDSERVE_LORA_MODULES", "nothing-here")
    with pytest.raises(SettingsError, match=r"^PAGEDSERVE_LORA_MODULES: 'nothing-here' is not name=path"):
        parse([])
    good = lora_adapter_dir(tmp_path / "good")
    assert parse(["--lora-modules", f"good={good}"]).lora_modules == f"good={good}"


def test_a_bad_chat_template_names_the_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        SettingsError, match=r"^--chat-template: no file 'templates/chat\.jinja' \(nor a Jinja"
    ):
        parse(["--chat-template", "templates/chat.jinja"])
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(SettingsError, match=r"^--chat-template: not a Jinja template: .*endfor.* \(line 1\)"):
        parse(["--chat-template", str(broken)])
    monkeypatch.setenv("PAGEDSERVE_CHAT_TEMPLATE", "{{ messages[0].content ")
    with pytest.raises(SettingsError, match=r"^PAGEDSERVE_CHAT_TEMPLATE: not a Jinja template"):
        parse([])
    monkeypatch.delenv("PAGEDSERVE_CHAT_TEMPLATE")
    good = tmp_path / "good.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert parse(["--chat-template", str(good)]).chat_template == str(good)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("enable_thinking=false", r"not JSON: "),
        ("[1, 2]", r"must be a JSON object of template variables, got list"),
        ('{"messages": []}', r"'messages' is set by the chat request itself, not a template variable"),
        ('{"not a name": 1}', r"'not a name' is not a template variable name"),
    ],
)
def test_bad_default_chat_template_kwargs_name_the_flag(value: str, error: str) -> None:
    with pytest.raises(SettingsError, match=error) as info:
        parse(["--default-chat-template-kwargs", value])
    assert str(info.value).startswith("--default-chat-template-kwargs"), str(info.value)


def test_default_chat_template_kwargs_from_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.chat_template import parse_chat_template_kwargs

    monkeypatch.setenv("PAGEDSERVE_DEFAULT_CHAT_TEMPLATE_KWARGS", '{"enable_thinking": false}')
    value = parse([]).default_chat_template_kwargs
    assert parse_chat_template_kwargs(value, "default_chat_template_kwargs") == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ('{"method": "eagle", "num_speculative_tokens": 2}', r"method 'eagle' is not supported \(ngram is"),
        ('{"method": "ngram"}', r"num_speculative_tokens is required"),
        ('{"num_speculative_tokens": 0}', r"num_speculative_tokens must be an integer in \[1, 16\], got 0"),
        (
            '{"num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 5}',
            r"prompt_lookup_min 5 exceeds prompt_lookup_max 3",
        ),
        (
            '{"num_speculative_tokens": 2, "disable_by_batch_size": 0}',
            r"disable_by_batch_size must be an integer",
        ),
        ('{"num_speculative_tokens": 2, "draft_model": "x"}', r"unknown key 'draft_model'"),
        ("ngram", r"not JSON"),
    ],
)
def test_a_bad_speculative_config_names_the_flag(value: str, error: str) -> None:
    with pytest.raises(SettingsError, match=error) as info:
        parse(["--speculative-config", value])
    assert str(info.value).startswith("--speculative-config: "), str(info.value)


def test_a_speculative_config_reaches_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.spec_decode import SpeculativeConfig

    monkeypatch.setenv("PAGEDSERVE_SPECULATIVE_CONFIG", '{"method": "ngram", "num_speculative_tokens": 3}')
    settings = parse([])
    assert settings._scheduler_config(64).speculative == SpeculativeConfig(
        3, prompt_lookup_max=4, prompt_lookup_min=1
    )
    assert parse(["--speculative-config", '{"num_speculative_tokens": 2}'])._scheduler_config(
        64
    ).speculative == (SpeculativeConfig(2))


def test_auto_tool_choice_needs_a_parser_and_a_parser_is_one_we_have(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError) as info:
        parse(["--enable-auto-tool-choice"])
    assert (
        str(info.value)
        == "--enable-auto-tool-choice: needs --tool-call-parser (the format of the model's calls)"
    )
    assert parse(["--tool-call-parser", "hermes"]).auto_tool_call_parser is None  # not enabled: auto refused
    settings = parse(["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"])
    assert settings.auto_tool_call_parser == "pythonic"
    monkeypatch.setenv("PAGEDSERVE_TOOL_CALL_PARSER", "xlam")
    with pytest.raises(SettingsError) as info:
        parse([])
    assert str(info.value).startswith("PAGEDSERVE_TOOL_CALL_PARSER: ") and "'hermes'" in str(info.value)
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, ServeSettings)
    with pytest.raises(SystemExit):  # argparse's choices: exit 2 with the choices listed
        parser.parse_args(["--tool-call-parser", "xlam"])


def test_gpt_oss_calls_need_its_reasoning_parser() -> None:
    """--tool-call-parser openai reads the calls the harmony reasoning parser passes on whole."""
    with pytest.raises(SettingsError) as info:
        parse(["--enable-auto-tool-choice", "--tool-call-parser", "openai"])
    assert str(info.value).startswith(
        "--tool-call-parser: openai reads the calls --reasoning-parser openai_gptoss"
    )
    both = [
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "openai",
        "--reasoning-parser",
        "openai_gptoss",
    ]
    assert parse(both).auto_tool_call_parser == "openai"


@pytest.mark.parametrize(
    ("value", "error"),
    [("{rope", "not JSON"), ("[1]", "must be a JSON object of config.json keys, got list")],
)
def test_bad_hf_overrides_name_the_flag(value: str, error: str) -> None:
    with pytest.raises(SettingsError, match=error) as info:
        parse(["--hf-overrides", value])
    assert str(info.value).startswith("--hf-overrides: "), str(info.value)


def test_hf_overrides_from_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.config import parse_hf_overrides

    monkeypatch.setenv("PAGEDSERVE_HF_OVERRIDES", '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}')
    assert parse_hf_overrides(parse([]).hf_overrides) == {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0}
    }


def test_the_reasoning_parser_is_one_we_have(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.reasoning import REASONING_PARSERS

    assert parse(["--reasoning-parser", "deepseek_r1"]).reasoning_parser == "deepseek_r1"
    assert parse([]).reasoning_parser is None
    monkeypatch.setenv("PAGEDSERVE_REASONING_PARSER", "granite")
    with pytest.raises(
        SettingsError,
        match=r"^PAGEDSERVE_REASONING_PARSER: .*'deepseek_r1', 'deepseek_v3', 'glm45', 'kimi_k2', 'mistral', 'olmo3', 'openai_gptoss', "
        "'qwen3' or 'seed_oss'",
    ):
        parse([])
    annotation = ServeSettings.model_fields["reasoning_parser"].annotation
    assert (
        typing.get_args(next(a for a in typing.get_args(annotation) if a is not type(None)))
        == REASONING_PARSERS
    )


def test_a_bad_api_key_is_refused_without_repeating_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The message may reach logs other people read: it names the setting, never the value."""
    with pytest.raises(SettingsError) as info:
        parse(["--api-key", "my secret"])
    assert str(info.value) == "--api-key: must be 1 or more visible ASCII characters, no spaces"
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "tab\tkey")
    with pytest.raises(SettingsError) as info:
        parse([])
    assert str(info.value) == "PAGEDSERVE_API_KEY: must be 1 or more visible ASCII characters, no spaces"
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-a-secret")
    assert parse([]).api_key == "from-a-secret"


def test_the_cli_module_leaves_grpc_unimported() -> None:
    """`serve` and `health` set GRPC_VERBOSITY before grpc's first import (gRPC core reads it once):
    otherwise every refused TLS handshake prints a line of gRPC's own on stderr."""
    import subprocess
    import sys

    code = "import sys, pagedserve.rpc.cli; assert 'grpc' not in sys.modules, 'grpc imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--max-num-seqs", "-3"], "--max-num-seqs: must be >= 1"),
        (["generate", "--prompt", "hi", "--max-num-seqs", "-3"], "--max-num-seqs: must be >= 1"),
        (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature: must be >= 0"),
    ],
)
def test_a_bad_flag_is_refused_before_torch_is_imported(argv: list[str], message: str) -> None:
    """The operator hears of a bad flag at once, not after torch's ~3 s import (settings validation
    resolved the device through torch, and `generate` imported the engine first)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from pagedserve.__main__ import main\n"
        f"code = main({argv!r})\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch', code)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert message in done.stderr, done.stderr[-2000:]
    assert done.stdout.split() == ["no", "torch", "2"], done.stdout


def test_a_unix_socket_path_is_made_absolute_and_refused_where_no_socket_could_have_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse(["--uds", "ps.sock"]).uds == str(tmp_path / "ps.sock")  # bound, logged and removed as one
    longest = "/tmp/" + "s" * 102  # 107 bytes: sun_path's 108 less its NUL
    assert parse(["--uds", longest]).uds == longest
    with pytest.raises(SettingsError) as info:
        parse(["--uds", longest + "s"])
    assert str(info.value).startswith(
        "--uds: 108 bytes long as an absolute path: a Unix socket's may have at most 107"
    ), info.value
    with pytest.raises(SettingsError, match=r"^--uds: must be a path"):
        parse(["--uds", ""])


def test_a_unix_socket_with_a_port_given_is_refused_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """--uds serves gRPC in place of the TCP port: a port given as well would be silently unused."""
    message = "--uds: serves gRPC in place of the port setting: give one of them"
    with pytest.raises(SettingsError) as info:
        parse(["--uds", "/tmp/ps.sock", "--port", "9001"])
    assert str(info.value) == message
    monkeypatch.setenv("PAGEDSERVE_PORT", "9001")
    with pytest.raises(SettingsError) as info:
        parse(["--uds", "/tmp/ps.sock"])
    assert str(info.value) == message
    monkeypatch.delenv("PAGEDSERVE_PORT")
    settings = parse(["--uds", "/tmp/ps.sock", "--http-port", "9000"])  # HTTP keeps its port
    assert (settings.uds, settings.http_port, settings.port) == ("/tmp/ps.sock", 9000, 8001)


def test_tokenizer_is_a_directory_holding_one_named_by_its_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    with pytest.raises(SettingsError, match=rf"^--tokenizer: '{tokenizer}' holds no tokenizer \(none of "):
        parse(["--tokenizer", str(tokenizer)])
    (tokenizer / "tokenizer.json").write_text("{}")
    assert parse(["--tokenizer", str(tokenizer)]).tokenizer == str(tokenizer)
    assert parse([]).tokenizer is None
    monkeypatch.setenv("PAGEDSERVE_TOKENIZER", str(tmp_path / "nowhere"))
    with pytest.raises(SettingsError, match=r"^PAGEDSERVE_TOKENIZER: '.*nowhere' is not a directory"):
        parse([])


def test_a_model_file_that_is_no_gguf_file_is_named_by_its_flag(tmp_path: Path) -> None:
    """Told before anything loads: a GGUF file missing, or a file that is not one."""
    with pytest.raises(SettingsError, match=r"^--model: no such file or directory: '.*missing\.gguf'"):
        parse(["--model", str(tmp_path / "missing.gguf")])
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00")
    with pytest.raises(SettingsError, match=r"^--model: '.*model\.safetensors' is not a GGUF file"):
        parse(["--model", str(tmp_path / "model.safetensors")])
    assert parse(["--model", str(tmp_path)]).model == str(tmp_path)  # a directory: read as the engine loads
