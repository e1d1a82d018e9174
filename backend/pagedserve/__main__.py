"""The `pagedserve` command line: `pagedserve generate ...`, `pagedserve serve ...` and
`pagedserve health ...`."""

from __future__ import annotations

import argparse
import logging
import sys

from pydantic import Field, model_validator

from pagedserve.errors import InvalidRequestError
from pagedserve.rpc.cli import add_health_parser, add_serve_parser, run_health, run_serve
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import EngineSettings, SettingsError, add_settings_arguments, settings_from_args


class GenerateSettings(EngineSettings):
    """`pagedserve generate`'s own flags, beside the engine's; each is also a PAGEDSERVE_* variable, as
    `serve`'s are. The prompts are not: they are the command's input, given as flags."""

    chat: bool = Field(True, description="apply the model's chat template (--no-chat: prompts as raw text)")
    max_tokens: int = Field(128, description="most tokens to generate per prompt")
    temperature: float = Field(0.0, description="0 = greedy")
    top_p: float = Field(1.0, description="nucleus sampling: the smallest token set with this probability")
    top_k: int = Field(-1, description="sample among the k most likely tokens (-1 = all)")
    sampling_seed: int | None = Field(None, description="per-request seed for random sampling")

    @model_validator(mode="after")
    def _check_sampling(self) -> GenerateSettings:
        """A bad value stops the command before the model loads, naming its flag or variable."""
        self.sampling_params()
        return self

    def sampling_params(self) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=self.sampling_seed,
            )
        except InvalidRequestError as exc:  # `field: message`, said as the setting (see config_error)
            field = "sampling_seed" if exc.field == "seed" else exc.field
            raise ValueError(f"{field}: {exc.message}") from None


def _generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate completions for prompts and print them")
    parser.add_argument(
        "--prompt", action="append", required=True, help="a prompt (repeat the flag for a batch)"
    )
    add_settings_arguments(parser, GenerateSettings)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedserve.llm import LLM

    settings = settings_from_args(GenerateSettings, args)
    params = settings.sampling_params()
    llm = LLM(**settings.model_dump(include=set(EngineSettings.model_fields)))
    use_chat = settings.chat and bool(llm.engine.tokenizer.chat_template)
    batch = len(args.prompt) > 1
    try:
        if use_chat:
            outputs = llm.chat(
                [[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=batch
            )
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=batch)
    except InvalidRequestError as exc:  # a prompt the model cannot take (too long for its context)
        raise SettingsError(f"--prompt: {exc.message if exc.field == 'prompt' else exc}") from None
    except RuntimeError as exc:  # a request that failed (a model fault), a dead engine: said in one line
        print(f"pagedserve generate: error: {exc}", file=sys.stderr)
        return 1
    for prompt, output in zip(args.prompt, outputs):
        if batch:
            print(f"### {prompt}")
        print(output.outputs[0].text.strip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _generate_parser(subparsers)
    add_serve_parser(subparsers)
    add_health_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "health":
            return run_health(args)
    except SettingsError as exc:
        print(f"pagedserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
