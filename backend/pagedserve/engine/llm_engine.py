"""The synchronous engine: admit requests, and `step()` = schedule, execute, update, detokenize."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.core.block_manager import BlockManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import ModelRunnerOutput
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.errors import EngineDeadError, InvalidRequestError
from pagedserve.outputs import RequestDelta, RequestMetrics, TokenLogprobs
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import FinishReason, Sequence
from pagedserve.settings import EngineSettings
from pagedserve.worker.executor import Executor

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_unfinished: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self.eos_token_ids = _eos_token_ids(config.model.path, self.tokenizer)
        self.executor = Executor(config, self.eos_token_ids)
        self.num_kv_blocks = self.executor.num_kv_blocks
        block_manager = BlockManager(self.num_kv_blocks, config.cache.block_size, config.cache.watermark)
        self.scheduler = Scheduler(config.scheduler, block_manager)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._metrics: dict[str, RequestMetrics] = {}

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> LLMEngine:
        return cls(settings.to_engine_config())

    # -- inputs --------------------------------------------------------------------------------------

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise InvalidRequestError("messages", "this model has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    # -- requests ------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        self._validate_prompt(prompt_token_ids, params)
        seq = Sequence(request_id, prompt_token_ids, params, self.eos_token_ids, arrival_time)
        self.scheduler.add(seq)
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            params.stop,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
        )
        self._metrics[request_id] = RequestMetrics(arrival_time=seq.arrival_time)

    def _validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        max_len = self.config.model.max_model_len
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if any(not 0 <= t < self.config.model.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(
                "prompt_token_ids", f"token ids must be in [0, {self.config.model.vocab_size})"
            )
        if len(prompt_token_ids) >= max_len:
            raise InvalidRequestError(
                "prompt",
                f"{len(prompt_token_ids)} tokens leave no room to generate within "
                f"the context length {max_len}",
            )
        if len(prompt_token_ids) + params.max_tokens > max_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                f"({params.max_tokens}) exceeds the context length {max_len}",
            )

    def abort_request(self, request_ids: Iterable[str]) -> None:
        for seq in self.scheduler.abort(request_ids):
            self._forget(seq.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.scheduler.block_manager
        return EngineStats(
            len(s.running),
            len(s.waiting),
            len(s.requests),
            bm.num_free_blocks,
            bm.num_blocks,
            s.num_preemptions,
        )

    # -- the step ------------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        now = time.monotonic()
        for req in scheduler_output.scheduled:
            metrics = self._metrics[req.request_id]
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
        try:
            runner_output = self.executor.execute(scheduler_output)
        except EngineDeadError:
            raise
        except Exception as exc:  # a model fault fails this batch's requests, not the engine
            logger.exception("model step failed")
            return self._fail(
                [r.request_id for r in scheduler_output.scheduled], f"model step failed: {exc!r}"
            )
        updated = self.scheduler.update(scheduler_output, runner_output)
        return self._process_outputs(updated, runner_output)

    def _process_outputs(
        self, updated: list[Sequence], runner_output: ModelRunnerOutput
    ) -> list[RequestDelta]:
        now = time.monotonic()
        logprobs_by_id = dict(zip(runner_output.request_ids, runner_output.logprobs or [], strict=False))
        deltas = []
        for seq in updated:
            detokenizer = self._detokenizers[seq.request_id]
            if detokenizer.update(seq.token_ids[-1:]) is not None:
                if seq.is_finished:  # the text was cut at a stop string on the same token
                    seq.finish_reason = FinishReason.STOP
                self.scheduler.finish(seq, FinishReason.STOP)
            elif seq.is_finished:
                detokenizer.flush()
            metrics = self._metrics[seq.request_id]
            metrics.first_token_time = metrics.first_token_time or now
            new_logprobs = self._decode_logprobs(logprobs_by_id.get(seq.request_id), seq)
            deltas.append(
                self._delta(
                    seq, [seq.token_ids[-1]], detokenizer.take_delta(seq.is_finished), new_logprobs, now
                )
            )
        return deltas

    def _delta(
        self, seq: Sequence, token_ids: list[int], text: str, logprobs: list[TokenLogprobs] | None, now: float
    ) -> RequestDelta:
        metrics = self._metrics[seq.request_id]
        if seq.is_finished:
            metrics.finished_time = now
            metrics.num_preemptions = seq.num_preemptions
            self._forget(seq.request_id)
        reason = seq.finish_reason.value if seq.finish_reason else None
        return RequestDelta(
            seq.request_id,
            token_ids,
            text,
            logprobs,
            seq.is_finished,
            reason,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            metrics,
        )

    def _decode_logprobs(self, entry: TokenLogprobs | None, seq: Sequence) -> list[TokenLogprobs] | None:
        if seq.sampling_params.logprobs is None or entry is None:
            return None
        for token_id, logprob in entry.items():
            logprob.decoded_token = self.tokenizer.decode([token_id])
        return [entry]

    def _fail(self, request_ids: list[str], message: str) -> list[RequestDelta]:
        now, deltas = time.monotonic(), []
        for request_id in request_ids:
            seq = self.scheduler.requests.get(request_id)
            if seq is None:
                continue
            self.scheduler.finish(seq, FinishReason.ERROR)
            delta = self._delta(seq, [], "", None, now)
            delta.error = message
            deltas.append(delta)
        return deltas

    def _forget(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self._metrics.pop(request_id, None)


def _eos_token_ids(model_path: str, tokenizer: Any) -> frozenset[int]:
    """EOS ids from generation_config.json (int or list) and the tokenizer."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
