"""The `pagedserve` command line: `pagedserve generate ...` and `pagedserve serve ...`."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedserve.rpc.cli import add_serve_parser, run_serve
from pagedserve.settings import EngineSettings, SettingsError, add_settings_arguments, settings_from_args


def _generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate completions for prompts and print them")
    parser.add_argument(
        "--prompt", action="append", required=True, help="a prompt (repeat the flag for a batch)"
    )
    parser.add_argument(
        "--no-chat",
        action="store_true",
        help="use prompts as raw text instead of applying the model's chat template",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument(
        "--sampling-seed", type=int, default=None, help="per-request seed for random sampling"
    )
    add_settings_arguments(parser, EngineSettings)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedserve.errors import InvalidRequestError
    from pagedserve.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    settings = settings_from_args(EngineSettings, args)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sampling_seed,
        )
    except InvalidRequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    llm = LLM(**settings.model_dump())
    use_chat = not args.no_chat and bool(llm.engine.tokenizer.chat_template)
    batch = len(args.prompt) > 1
    if use_chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=batch)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=batch)
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
    except SettingsError as exc:
        print(f"pagedserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
