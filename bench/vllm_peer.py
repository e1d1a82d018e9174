"""vLLM's offline engine as a peer of bench/throughput.py, run in vLLM's own Python environment.

vLLM pins its own torch and transformers, so it lives in a virtual environment of its own and this
script runs there, driven by throughput.py over a pipe (`--peers ...,vllm --vllm-python PATH`). It
imports vLLM and the standard library only.

Protocol, one JSON object a line: the first line on stdin is the engine's settings
(`{"model": ..., "dtype": ..., "llm_kwargs": {...}}`); the script builds `vllm.LLM`, warms it up and
answers `{"ready": true, "version": ...}`. Each later line is a round (`{"prompts": [[ids]],
"lengths": [n], "sampling": {"temperature": t, "top_k": k, "top_p": p, "repetition_penalty": r}}`): the
prefix cache is reset, every prompt runs with `ignore_eos` and exactly its forced length, greedy (t 0,
the default) or sampled at t with vLLM's top-k and top-p (0 and 1: off), after its repetition penalty
r (1: off), and the answer is
`{"num_output_tokens": ..., "seconds": ...}`. vLLM logs to stdout, so the answers go to a private copy
of it and everything else to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    # bench/ is first on the path: none of its modules may stand in for a package of the same name
    # that vLLM or transformers imports
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's logging and prints: stderr
    sys.stdout = sys.stderr

    try:
        from vllm import LLM, SamplingParams, __version__
        from vllm.inputs import TokensPrompt
    except ImportError as e:
        raise SystemExit(f"vLLM is not importable in {sys.executable}: {e}") from e

    settings = json.loads(sys.stdin.readline())
    llm = LLM(settings["model"], dtype=settings["dtype"], **settings.get("llm_kwargs", {}))
    warmup = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], warmup, use_tqdm=False)
    answers.write(json.dumps({"ready": True, "version": __version__}) + "\n")

    for line in sys.stdin:
        job = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
        sampling = job.get("sampling", {"temperature": 0.0})  # temperature 0: greedy (top_k, top_p unused)
        params = [SamplingParams(max_tokens=n, ignore_eos=True, **sampling) for n in job["lengths"]]
        if not llm.reset_prefix_cache():  # as pagedserve's runner: every round computes every prompt
            raise SystemExit("vLLM did not reset its prefix cache")
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        num_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        answers.write(json.dumps({"num_output_tokens": num_tokens, "seconds": seconds}) + "\n")


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing's spawn
    main()
