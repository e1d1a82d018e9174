"""The `pagedserve` command line: `pagedserve generate ...`, `pagedserve serve ...` and
`pagedserve health ...`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from pagedserve import logs
from pagedserve.errors import InvalidRequestError
from pagedserve.lora_config import parse_lora_modules
from pagedserve.rpc.cli import add_health_parser, add_serve_parser, run_health, run_serve
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.settings import (
    EngineSettings,
    SettingsError,
    add_settings_arguments,
    config_error,
    flags_given,
    setting_source,
    settings_from_args,
)


class GenerateSettings(EngineSettings):
    """`pagedserve generate`'s own flags, beside the engine's; each is also a PAGEDSERVE_* variable, as
    `serve`'s are. The prompts are not: they are the command's input, given as flags."""

    chat: bool = Field(True, description="apply the model's chat template (--no-chat: prompts as raw text)")
    max_tokens: int = Field(128, description="most tokens to generate per prompt")
    temperature: float = Field(0.0, description="0 = greedy")
    top_p: float = Field(1.0, description="nucleus sampling: the smallest token set with this probability")
    top_k: int = Field(-1, description="sample among the k most likely tokens (-1 = all)")
    sampling_seed: int | None = Field(None, description="per-request seed for random sampling")
    min_tokens: int = Field(0, description="tokens to generate before EOS or a stop string may end the text")
    n: int = Field(1, description="completions per prompt, each printed under '### completion i'")
    stop: list[str] | None = Field(None, description="a stop string: the text ends before it")
    json_schema: str | None = Field(
        None, description="a JSON schema the output must match: its text, or @path to a file holding it"
    )
    regex: str | None = Field(None, description="a regular expression the output must match")
    choice: list[str] | None = Field(None, description="a string the output must be one of")
    structural_tag: str | None = Field(
        None,
        description="a structural tag (vLLM's, JSON: free text until a trigger, then the structure it "
        "opens, e.g. a tool call): its text, or @path to a file holding it",
    )
    lora_name: str | None = Field(
        None,
        description="generate through this LoRA adapter, one of --lora-modules (default: the base model)",
    )

    @field_validator("json_schema", "structural_tag")
    @classmethod
    def _read_json(cls, value: str | None) -> str | None:
        """`@path` becomes the file's text; either must be JSON (whether it is a schema or structural tag
        the engine's compiler accepts is known only once the model's tokenizer is loaded)."""
        if value is None:
            return None
        if value.startswith("@"):
            try:
                value = Path(value[1:]).read_text()
            except OSError as exc:
                raise ValueError(f"cannot read {value[1:]!r}: {exc.strerror or exc}") from None
            except UnicodeDecodeError:
                raise ValueError(f"{value[1:]!r} is not UTF-8 text") from None
        try:
            json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        return value

    @model_validator(mode="after")
    def _check_sampling(self) -> GenerateSettings:
        """A bad value stops the command before the model loads, naming its flag or variable."""
        self.sampling_params()
        return self

    @model_validator(mode="after")
    def _check_lora_name(self) -> GenerateSettings:
        """An adapter not among --lora-modules stops the command before the model loads."""
        names = [name for name, _ in parse_lora_modules(self.lora_modules)]
        if self.lora_name and self.lora_name not in names:
            have = f"--lora-modules has: {', '.join(names)}" if names else "no --lora-modules given"
            raise ValueError(f"lora_name: unknown adapter {self.lora_name!r} ({have})")
        return self

    def sampling_params(self) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=self.sampling_seed,
                min_tokens=self.min_tokens,
                n=self.n,
                stop=self.stop or [],
                structured_outputs=self._structured_outputs(),
            )
        except InvalidRequestError as exc:  # `field: message`, said as the setting (see config_error)
            field = _SETTING_OF_REQUEST_FIELD.get(exc.field, exc.field)
            raise ValueError(f"{field}: {exc.message}") from None

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        given = [name for name in _STRUCTURED_OUTPUTS_SETTINGS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"{given[1]}: cannot be combined with {_flag(given[0])} "
                f"(give at most one of {', '.join(map(_flag, _STRUCTURED_OUTPUTS_SETTINGS))})"
            )
        if not given:
            return None
        return StructuredOutputsParams(
            json=self.json_schema, regex=self.regex, choice=self.choice, structural_tag=self.structural_tag
        )


_STRUCTURED_OUTPUTS_SETTINGS = ("json_schema", "regex", "choice", "structural_tag")
# Request fields that InvalidRequestError names, as the settings that set them.
_SETTING_OF_REQUEST_FIELD = {
    "seed": "sampling_seed",
    "structured_outputs.json": "json_schema",
    "structured_outputs.regex": "regex",
    "structured_outputs.choice": "choice",
    "structured_outputs.structural_tag": "structural_tag",
}
_LIST_SETTINGS = ("stop", "choice")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _generate_parser(subparsers: argparse._SubParsersAction) -> None:
    # "resolve": the list settings' flags, added again below, replace the one-value flags of the first pass
    parser = subparsers.add_parser(
        "generate", help="generate completions for prompts and print them", conflict_handler="resolve"
    )
    parser.add_argument(
        "--prompt", action="append", required=True, help="a prompt (repeat the flag for a batch)"
    )
    add_settings_arguments(parser, GenerateSettings)
    for name in _LIST_SETTINGS:
        description = GenerateSettings.model_fields[name].description
        parser.add_argument(
            _flag(name),
            dest=name,
            action="append",
            help=f"{description} (repeat the flag for more) [env PAGEDSERVE_{name.upper()}, a JSON list]",
        )


def _run_generate(args: argparse.Namespace) -> int:
    from pagedserve import LoRARequest

    settings = settings_from_args(GenerateSettings, args)
    params = settings.sampling_params()
    # the engine's modules import torch (~3 s): a bad flag is refused before them
    from pagedserve.engine.llm_engine import check_structured_outputs
    from pagedserve.llm import LLM

    given = flags_given(GenerateSettings, args)
    try:
        # a grammar the compiler refuses is refused before the model loads: the tokenizer alone compiles it
        if params.structured_outputs is not None:
            check_structured_outputs(settings.to_engine_config(), params.structured_outputs)
        llm = LLM(**settings.model_dump(include=set(EngineSettings.model_fields)))
    except InvalidRequestError as exc:
        raise _request_error(exc, given) from None
    except ValueError as exc:  # what only the model can tell (its path, its tokenizer), as `serve` says it
        raise config_error(exc, given) from None
    use_chat = settings.chat and bool(llm.engine.tokenizer.chat_template)
    batch = len(args.prompt) > 1
    lora = LoRARequest(settings.lora_name) if settings.lora_name else None
    try:
        if use_chat:
            outputs = llm.chat(
                [[{"role": "user", "content": p}] for p in args.prompt],
                params,
                use_tqdm=batch,
                lora_request=lora,
            )
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=batch, lora_request=lora)
    except InvalidRequestError as exc:  # a prompt too long for the context, a schema that does not compile
        raise _request_error(exc, given) from None
    except RuntimeError as exc:  # a request that failed (a model fault), a dead engine: said in one line
        print(f"pagedserve generate: error: {exc}", file=sys.stderr)
        return 1
    for prompt, output in zip(args.prompt, outputs):
        if batch:
            print(f"### {prompt}")
        for completion in output.outputs:
            if params.n > 1:
                print(f"### completion {completion.index + 1}")
            print(completion.text.strip())
    return 0


def _request_error(exc: InvalidRequestError, given: dict[str, object]) -> SettingsError:
    """What the engine refuses once the model is loaded, said as the flag or variable that set it (the
    prompt when it is no setting's: a prompt too long, a bad token)."""
    setting = _SETTING_OF_REQUEST_FIELD.get(exc.field, exc.field)
    if setting in GenerateSettings.model_fields:
        return SettingsError(f"{setting_source(setting, given)}: {exc.message}")
    return SettingsError(f"--prompt: {exc.message if exc.field == 'prompt' else exc}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _generate_parser(subparsers)
    add_serve_parser(subparsers)
    add_health_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure_from_environment("")  # (serve sets its own once its settings are read)
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "health":
            return run_health(args)
    except SettingsError as exc:
        _say_error(args, f"pagedserve {args.command}: error: {exc}")
        return 2
    return 2


def _say_error(args: argparse.Namespace, line: str) -> None:
    """A command's error (a bad setting): a plain line on stderr, or one JSON record where the run logs
    JSON lines (--log-format json, PAGEDSERVE_LOG_FORMAT=json), so that a log pipeline reads it as it
    reads every other line. The flag counts even when the settings failed before it was applied."""
    if getattr(args, "log_format", None) == "json" and not logs.writes_json():
        logs.configure(fmt="json")  # (a critical record passes whatever level was asked)
    if logs.writes_json():
        logging.getLogger("pagedserve").critical(line)
    else:
        print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
