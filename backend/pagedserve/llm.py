"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from itertools import count
from typing import Any, cast

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import CompletionOutput, RequestDelta, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import EngineSettings

Prompt = str | list[int]


class LLM:
    """`model=None` is the embedded default (SmolLM2-135M-Instruct). Keyword arguments are the
    engine settings (`dtype`, `kv_cache_memory`, `max_num_seqs`, `num_kv_blocks`, ...)."""

    def __init__(self, model: str | None = None, **settings: Any) -> None:
        self.engine = LLMEngine.from_settings(EngineSettings(model=model, **settings))
        self._ids = count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without `sampling_params`: the model's generation_config.json
        values where it has them (as vLLM's), else SamplingParams' defaults."""
        return self.engine.sampling_params()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run all prompts in one continuous batch; outputs come back in input order."""
        one = isinstance(prompts, str) or (
            isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
        )
        batch = [cast(Prompt, prompts)] if one else list(cast(Seq[Prompt], prompts))  # one: text or token ids
        token_ids = [self.engine.encode_prompt(p) if isinstance(p, str) else list(p) for p in batch]
        texts = [p if isinstance(p, str) else None for p in batch]
        return self._run(texts, token_ids, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_ids = [self.engine.encode_chat(c) for c in conversations]  # type: ignore[arg-type]
        texts = [self.engine.decode(ids) for ids in token_ids]
        return self._run(list(texts), token_ids, sampling_params, use_tqdm)

    def _run(
        self,
        texts: list[str | None],
        token_ids: list[list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, len(token_ids))
        outputs: dict[str, RequestOutput] = {}
        request_ids = []
        for text, ids, p in zip(texts, token_ids, params):
            request_id = f"llm-{next(self._ids)}"
            self.engine.add_request(request_id, ids, p)
            request_ids.append(request_id)
            completions = [CompletionOutput(i, "", [], None) for i in range(p.n)]
            outputs[request_id] = RequestOutput(request_id, text, ids, completions, False)
        progress = _progress_bar(len(request_ids)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                if delta.error:
                    raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
                out = outputs[delta.request_id]
                _accumulate(out.outputs[delta.index], delta)
                if delta.request_finished:
                    out.finished, out.metrics = True, delta.metrics
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [outputs[rid] for rid in request_ids]


def _accumulate(completion: CompletionOutput, delta: RequestDelta) -> None:
    completion.text += delta.new_text
    completion.token_ids.extend(delta.new_token_ids)
    if delta.new_logprobs is not None:
        completion.logprobs = (completion.logprobs or []) + delta.new_logprobs
    if delta.finished:
        completion.finish_reason = delta.finish_reason


def _per_prompt(params: SamplingParams | Seq[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
    return list(params)


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="req")
