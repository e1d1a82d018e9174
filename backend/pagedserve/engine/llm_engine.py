"""The synchronous engine: admit requests, and `step()` = schedule, execute, update, detokenize."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any

from pagedserve.chat_template import parse_chat_template_kwargs
from pagedserve.config import EngineConfig
from pagedserve.core.block_manager import BlockManager, KvEvent
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import ModelRunnerOutput
from pagedserve.engine.detokenizer import IncrementalDetokenizer, decode_ids
from pagedserve.engine.structured_output import StructuredOutputs
from pagedserve.errors import (
    AdapterInUseError,
    AdapterLoadedError,
    AdapterNotLoadedError,
    EngineDeadError,
    InvalidRequestError,
)
from pagedserve.lora_config import check_adapter_name, read_adapter_config
from pagedserve.outputs import PromptLogprobs, RequestDelta, RequestMetrics, TokenLogprobs
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.sequence import FinishReason, Sequence
from pagedserve.settings import EngineSettings
from pagedserve.telemetry import EngineMetrics, cache_config_labels
from pagedserve.tokenizer import load_tokenizer
from pagedserve.worker.executor import Executor, create_executor

logger = logging.getLogger(__name__)

_BAD_WORDS_CACHE_SIZE = 256  # lists of bad words whose token ids the engine keeps


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_unfinished: int  # client requests
    num_free_blocks: int
    num_total_blocks: int
    num_free_cpu_blocks: int
    num_total_cpu_blocks: int
    num_preemptions: int
    num_recompute_preemptions: int
    num_swap_preemptions: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    num_prefix_queries: int  # tokens looked up in the prefix cache
    num_prefix_hits: int  # tokens found there
    num_spec_drafts: int  # speculative decoding: drafts run (one a sequence and step)
    num_draft_tokens: int  # their tokens
    num_accepted_draft_tokens: int  # those accepted


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None, tokenizer: Any = None) -> None:
        """`executor` and `tokenizer`: those of `config` unless given (an EngineFace's: the engine
        process's, and its tokenizer loaded while that process started)."""
        self.config = config
        # before the model: a wrong one fails in a second
        self.tokenizer = load_tokenizer(config.model) if tokenizer is None else tokenizer
        if config.chat_template is not None:
            self.tokenizer.chat_template = config.chat_template
        self.eos_token_ids = _eos_token_ids(config.model.path, self.tokenizer)
        self._token_texts: dict[int, str] = {}  # token_text's: a token id's text, decoded once
        self.executor = executor or create_executor(config, self.eos_token_ids)
        self.num_kv_blocks = self.executor.num_kv_blocks
        block_manager = BlockManager(
            self.num_kv_blocks,
            config.cache.block_size,
            config.cache.watermark,
            num_cpu_blocks=self.executor.num_cpu_blocks,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            find_room=config.device == "cpu",  # where decode attention reads runs of blocks faster
        )
        self.scheduler = Scheduler(config.scheduler, block_manager)
        self.metrics = EngineMetrics(
            config.model.served_model_name,
            config.model.kv_bytes_per_token * config.cache.block_size,
            max_model_len=config.model.max_model_len,
        )
        self.metrics.watch_ranks(self.executor.worker_pids)
        self.metrics.set_cache_config_info(
            cache_config_labels(
                config.cache, config.model.dtype, self.num_kv_blocks, self.executor.num_cpu_blocks
            )
        )
        # the adapters loaded now, name -> path: --lora-modules, then loads and unloads
        self._lora_paths = dict(config.lora_modules)
        self._serves_lora = bool(self._lora_paths)  # stats and metrics follow the adapters once any is loaded
        if self._serves_lora:
            self.metrics.set_num_lora_adapters(len(self._lora_paths))
        self._requests: dict[str, _Request] = {}  # by client request id
        self._completions: dict[str, _Completion] = {}  # by sequence id
        self.structured_outputs = StructuredOutputs(
            self.tokenizer, config.model.vocab_size, self.eos_token_ids
        )
        # bad words -> their token ids, the most recent last (see tokenize_bad_words)
        self._bad_words_ids: OrderedDict[tuple[str, ...], list[list[int]] | None] = OrderedDict()
        self._bad_words_lock = threading.Lock()
        if config.model.sampling_defaults:
            logger.info(
                "sampling parameters a request leaves unset take the model's generation_config.json "
                "values %s (--generation-config vllm: the built-in defaults)",
                config.model.sampling_defaults,
            )

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> LLMEngine:
        return cls(settings.to_engine_config())

    def sampling_params(self, **given: Any) -> SamplingParams:
        """A request's parameters: those `given`, the model's defaults for the rest (generation_config.json,
        unless --generation-config vllm), SamplingParams' own for what neither sets."""
        return SamplingParams(**{**self.config.model.sampling_defaults, **given})

    # -- inputs --------------------------------------------------------------------------------------

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def encode_chat(
        self,
        messages: list[dict[str, str]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[int]:
        """The conversation's prompt through the chat template (`chat_template`, else --chat-template's,
        else the model's), with the template variables `chat_template_kwargs` over the server's
        defaults, as vLLM applies it: `add_generation_prompt` opens the assistant's turn,
        `continue_final_message` leaves the last message open for the model to go on with."""
        from jinja2 import TemplateError, TemplateSyntaxError

        if chat_template is None and not self.tokenizer.chat_template:
            raise InvalidRequestError(
                "messages", "this model has no chat template (--chat-template sets one)"
            )
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "continue_final_message", "cannot be true while add_generation_prompt is (set it false)"
            )
        try:
            given = parse_chat_template_kwargs(chat_template_kwargs, "chat_template_kwargs")
        except ValueError as exc:
            field, _, message = str(exc).partition(": ")
            raise InvalidRequestError(field, message) from None
        try:
            ids = self.tokenizer.apply_chat_template(
                messages,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=True,
                **{**self.config.default_chat_template_kwargs, **given},
            )
        except TemplateSyntaxError as exc:
            raise InvalidRequestError("chat_template", f"not a Jinja template: {exc}") from None
        except TemplateError as exc:  # the template's raise_exception(), e.g. roles that must alternate
            raise InvalidRequestError("messages", f"refused by the chat template: {exc}") from None
        except ValueError as exc:  # transformers': the final message to continue is not in the prompt
            if not continue_final_message:
                raise _template_failed(exc) from None
            raise InvalidRequestError("continue_final_message", str(exc)) from None
        except Exception as exc:  # the template's own code failed on this conversation or its variables
            raise _template_failed(exc) from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def truncate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt a request runs with: its last `params.truncate_prompt_tokens` tokens when set.
        Front ends call this where they tokenize, so that what they report (prompt logprobs, the
        prompt's tokens) is the prompt the engine runs."""
        k = params.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        max_len = self.config.model.max_model_len
        if k == -1:  # an embedding generates nothing: it may fill the context
            # max_tokens None keeps the most prompt that still generates: room for one token
            room = 1 if params.max_tokens is None else params.max_tokens
            k = max_len if params.pooling is not None else max(1, max_len - room)
        elif k > max_len:
            raise InvalidRequestError(
                "truncate_prompt_tokens", f"{k} is greater than the context length {max_len}"
            )
        return prompt_token_ids[-k:]

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        return decode_ids(self.tokenizer, token_ids, skip_special_tokens, spaces_between_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text as a logprob names it (`decode([token_id])`), decoded once per token id: a
        request asking for 5 logprobs names 6 tokens a step (64 rows: ~0.7 ms a step decoded afresh on
        the 2-core host, 2% of a chat round). At most the vocabulary's size of entries."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = str(self.tokenizer.decode([token_id]))
        return text

    # -- requests ------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> None:
        """Queue a request. With `n > 1` it runs as n sequences that share the prompt's blocks (and
        its `priority`: under --scheduling-policy priority a lower value runs earlier). `lora_name`
        runs it through that LoRA adapter of --lora-modules (None or "": the base model). A
        `max_tokens` of None runs to the context: the request holds a copy of `params` with it resolved."""
        prompt_token_ids = self.truncate_prompt(prompt_token_ids, params)  # the front end's, unchanged
        self._validate(prompt_token_ids, params, priority, lora_name)
        params = _with_max_tokens(params, self._max_tokens(len(prompt_token_ids), params))
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        grammar = self.structured_outputs.compile(params.structured_outputs)  # cached after validate_request
        seqs = [
            Sequence(
                self._seq_id(request_id, i, params.n),
                prompt_token_ids,
                _child_params(params, i),
                self.eos_token_ids,
                arrival_time,
                priority,
                lora_name or None,
            )
            for i in range(params.n)
        ]
        seqs[0].pending_forks = seqs[1:]
        for seq in seqs:
            seq.is_multi_sequence = params.n > 1
        self.scheduler.add(seqs[0])
        self.structured_outputs.add([seq.request_id for seq in seqs], grammar)
        if params.pooling is None:
            metrics = RequestMetrics(seqs[0].arrival_time, n=params.n, max_tokens=params.max_tokens)
        else:  # an embedding: no generation parameters for vLLM's request_params_* histograms
            metrics = RequestMetrics(seqs[0].arrival_time)
        metrics.lora_name = seqs[0].lora_name
        self._requests[request_id] = _Request(metrics, len(seqs))
        logger.debug(
            "request %s queued: %d prompt tokens, n %d, max_tokens %s, priority %d, lora %s",
            request_id,
            len(prompt_token_ids),
            params.n,
            params.max_tokens,
            priority,
            lora_name or "-",
        )
        for index, seq in enumerate(seqs):
            detokenizer = self._detokenizer(prompt_token_ids, params)
            self._completions[seq.request_id] = _Completion(request_id, index, detokenizer)

    def _detokenizer(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> IncrementalDetokenizer | None:
        """A completion's detokenizer; None under `detokenize=False` (vLLM's): no decoding at all, the
        text stays "" (such params take no stop strings)."""
        if not params.detokenize:
            return None
        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            params.stop,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
            params.min_tokens,
            params.spaces_between_special_tokens,
        )

    @staticmethod
    def _seq_id(request_id: str, index: int, n: int) -> str:
        return request_id if n == 1 else f"{request_id}#{index}"

    def _seq_ids(self, request_id: str) -> list[str]:
        """The ids of all the sequences of a request the engine holds, finished ones included."""
        n = self._requests[request_id].num_sequences
        return [self._seq_id(request_id, i, n) for i in range(n)]

    def validate_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> None:
        """Everything add_request() would reject, checked without touching engine state (any thread)."""
        prompt_token_ids = self.truncate_prompt(prompt_token_ids, params)
        self._validate(prompt_token_ids, params, priority, lora_name)
        self.scheduler.check_can_ever_fit(
            len(prompt_token_ids), self._max_tokens(len(prompt_token_ids), params)
        )
        self.structured_outputs.compile(params.structured_outputs)  # last: the costliest check

    def _validate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> None:
        """What `SamplingParams` cannot check alone: the prompt, the priority, the LoRA adapter and the
        limits of this model and engine. Cheap checks first: a prompt of a million ids is refused for
        its length before its ids are read. Tokenizes the bad words into `params` (they go to the
        workers with them)."""
        self._validate_priority(priority)
        self._validate_lora_name(lora_name)
        max_len = self.config.model.max_model_len
        vocab_size = self.config.model.vocab_size
        max_num_seqs = self.config.scheduler.max_num_seqs
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if params.pooling is not None:  # an embedding: the prompt alone, up to the whole context
            if len(prompt_token_ids) > max_len:
                raise InvalidRequestError(
                    "prompt", f"{len(prompt_token_ids)} tokens exceed the context length {max_len}"
                )
        elif len(prompt_token_ids) >= max_len:
            raise InvalidRequestError(
                "prompt",
                f"{len(prompt_token_ids)} tokens leave no room to generate within the context length {max_len}",
            )
        elif len(prompt_token_ids) + self._max_tokens(len(prompt_token_ids), params) > max_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the context length {max_len}",
            )
        if params.n > max_num_seqs:  # its n sequences must fit one batch (and n objects the memory)
            raise InvalidRequestError("n", f"must be at most {max_num_seqs}, the engine's --max-num-seqs")
        check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)  # min_tokens bans them by index
        check_token_ids("prompt_token_ids", prompt_token_ids, vocab_size)
        self._validate_logit_controls(params)

    def _max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The request's max_tokens; vLLM's None (until the context is full) is the room the context
        leaves after the prompt."""
        if params.max_tokens is None:
            return self.config.model.max_model_len - num_prompt_tokens
        return params.max_tokens

    def _validate_logit_controls(self, params: SamplingParams) -> None:
        """Their token ids index the logits: each in the model's vocabulary (vLLM's check and message)."""
        vocab_size = self.config.model.vocab_size
        self.tokenize_bad_words(params)  # a word whose tokens the model lacks is refused too
        for name, token_ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("bad_words", [t for ids in params.bad_words_token_ids for t in ids]),
        ):
            outside = sorted({t for t in token_ids if t >= vocab_size})
            if outside:
                raise InvalidRequestError(
                    name,
                    f"contains out-of-vocab token id(s) {outside[:8]}: the vocabulary size is {vocab_size}",
                )

    def tokenize_bad_words(self, params: SamplingParams) -> None:
        """Fill `params`' bad words' token ids (`SamplingParams.update_from_tokenizer`), from a cache of
        the last _BAD_WORDS_CACHE_SIZE lists. Front ends call this on their tokenizer thread before they
        check a request: 1,024 words of 1,024 characters take half a second to tokenize, which the
        event loop (check) and then the engine thread (add_request) would otherwise each spend again,
        and a fast tokenizer is not to be shared between threads."""
        if not params.bad_words:
            params.update_from_tokenizer(self.tokenizer)  # none: clears a caller's own ids
            return
        key = tuple(params.bad_words)
        with self._bad_words_lock:
            cached = self._bad_words_ids.get(key)
            if cached is not None:
                self._bad_words_ids.move_to_end(key)
        if cached is not None:
            params._bad_words_token_ids = cached  # the engine's own: shared, never changed
            return
        params.update_from_tokenizer(self.tokenizer)
        self.remember_bad_words(params)

    def remember_bad_words(self, params: SamplingParams) -> None:
        """Cache the token ids of `params`' bad words, tokenized by `tokenize_bad_words` (an engine
        process takes its front end's: the same tokenizer, and tokenizing on its step thread would
        stall every stream)."""
        if not params.bad_words or params._bad_words_token_ids is None:
            return
        with self._bad_words_lock:
            self._bad_words_ids[tuple(params.bad_words)] = params._bad_words_token_ids
            while len(self._bad_words_ids) > _BAD_WORDS_CACHE_SIZE:
                self._bad_words_ids.popitem(last=False)

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters requests may name: --lora-modules in the order given, then those loaded
        since, less those unloaded."""
        return tuple(self._lora_paths)

    def lora_path(self, name: str) -> str | None:
        """Where the loaded adapter `name` was read from (None: no such adapter is loaded)."""
        return self._lora_paths.get(name)

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter between steps (vLLM's runtime LoRA updating), on every rank; then
        requests may name it. A name loaded already, or an adapter that does not fit the model, is an
        InvalidRequestError naming `lora_name` or `lora_path`, and nothing of it stays loaded."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("lora_name", "must not be empty")
        try:
            check_adapter_name(name, self.config.model.served_model_name)
        except ValueError as exc:
            raise InvalidRequestError("lora_name", str(exc)) from None
        if name in self._lora_paths:
            raise AdapterLoadedError(
                "lora_name", f"an adapter named {name[:256]!r} is loaded already (unload it first)"
            )
        try:
            read_adapter_config(name, path)  # the cheap checks, before any rank reads a tensor
            self.executor.load_lora(name, path)
        except ValueError as exc:
            raise InvalidRequestError("lora_path", str(exc).removeprefix("lora_modules: ")) from None
        self._lora_paths[name] = path
        self._serves_lora = True
        self.metrics.set_num_lora_adapters(len(self._lora_paths))
        logger.info("loaded LoRA adapter %r from %s", name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Drop a LoRA adapter between steps, with the prefix-cache blocks it computed. Refused
        (AdapterInUseError) while requests run or wait through it."""
        if name not in self._lora_paths:
            raise AdapterNotLoadedError("lora_name", f"no adapter named {str(name)[:256]!r} is loaded")
        s = self.scheduler
        users = {
            self._completions[seq.request_id].request_id
            for seq in chain(s.running, s.waiting, s.swapped)
            if seq.lora_name == name
        }
        if users:
            raise AdapterInUseError(
                "lora_name",
                f"{name!r} is in use by {len(users)} request(s): unload it once they finish (or abort them)",
            )
        del self._lora_paths[name]
        s.block_manager.forget_lora(name)
        self.executor.unload_lora(name)
        self.metrics.set_num_lora_adapters(len(self._lora_paths))
        logger.info("unloaded LoRA adapter %r", name)

    def _validate_lora_name(self, lora_name: str | None) -> None:
        if lora_name is None:
            return
        if not isinstance(lora_name, str):
            raise InvalidRequestError("lora_name", f"must be a string, got {type(lora_name).__name__}")
        if lora_name and lora_name not in self.lora_names:
            served = (
                f"this server has: {', '.join(self.lora_names)}"
                if self.lora_names
                else "this server serves no LoRA adapters (--lora-modules)"
            )
            raise InvalidRequestError("lora_name", f"unknown adapter {lora_name[:256]!r} ({served})")

    def _validate_priority(self, priority: int) -> None:
        """An int64 (the gRPC field's range), and 0 unless the engine schedules by priority: vLLM also
        refuses a priority it would silently ignore."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError("priority", f"must be an integer, got {type(priority).__name__}")
        if not -(2**63) <= priority < 2**63:
            raise InvalidRequestError("priority", f"must be a 64-bit signed integer, got {priority}")
        if priority != 0 and self.config.scheduler.scheduling_policy != "priority":
            raise InvalidRequestError(
                "priority",
                f"got {priority}, but the scheduling policy is fcfs; start the server with "
                "--scheduling-policy priority",
            )

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestDelta]:
        """Abort requests (all their sequences); their blocks are free when this returns. Returns a final
        delta (finish reason aborted, the request's own timing and token counts) per completion that
        was still running; unknown or finished ids are skipped."""
        now, deltas = time.monotonic(), []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            for seq in self.scheduler.abort(self._seq_ids(request_id)):
                deltas.append(self._delta(seq, [], self._rest_of_text(seq), None, now))
            if request_id in self._requests:  # a sequence the scheduler ended in a step cut short
                self._drop(request_id)  # (Ctrl-C) before its output was processed: no delta came
        if deltas:  # no step may follow: the gauges must not keep showing the aborted requests
            self.metrics.record_aborted(self.stats(), deltas, now)
            self._record_lora_in_use()
        return deltas

    def _record_lora_in_use(self) -> None:
        """`vllm:lora_requests_info`'s adapters of the running and of the waiting (or swapped)
        requests: a pass over them, made only once an adapter is loaded."""
        if self._serves_lora:
            s = self.scheduler
            self.metrics.set_lora_in_use(_lora_names(s.running), _lora_names(chain(s.waiting, s.swapped)))

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's `reset_prefix_cache`): the next requests compute their
        prompts in full. False, and nothing forgotten, while requests are unfinished (their blocks
        stay named while they run)."""
        if self.has_unfinished_requests():
            return False
        forgotten = self.scheduler.block_manager.reset_prefix_cache()
        logger.info("prefix cache reset: %d cached blocks forgotten", forgotten)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Unfinished requests, or ended ones whose per-request state the workers still hold (they
        drop it with the next step): a server steps until neither is left, so an idle engine holds
        nothing of any request in any layer."""
        return self.has_unfinished_requests() or self.scheduler.has_freed_requests()

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.scheduler.block_manager
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_swapped=len(s.swapped),
            num_unfinished=len(self._requests),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_free_cpu_blocks=bm.num_free_cpu_blocks,
            num_total_cpu_blocks=bm.num_cpu_blocks,
            num_preemptions=s.num_preemptions,
            num_recompute_preemptions=s.num_recompute_preemptions,
            num_swap_preemptions=s.num_swap_preemptions,
            num_swapped_out_blocks=s.num_swapped_out_blocks,
            num_swapped_in_blocks=s.num_swapped_in_blocks,
            num_prefix_queries=bm.num_prefix_queries,
            num_prefix_hits=bm.num_prefix_hits,
            num_spec_drafts=s.num_spec_drafts,
            num_draft_tokens=s.num_draft_tokens,
            num_accepted_draft_tokens=s.num_accepted_draft_tokens,
        )

    def record_kv_events(self, on: bool) -> list[bytes]:
        """Follow the prefix cache's changes (or stop): the block hashes it holds now. Between steps."""
        return self.scheduler.block_manager.record_kv_events(on)

    def take_kv_events(self) -> list[KvEvent]:
        """The prefix cache's changes since the last call, while followed. Between steps."""
        return self.scheduler.block_manager.take_kv_events()

    # -- the step ------------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not scheduler_output.freed_request_ids:
            return []  # else the workers still run it: they drop the freed requests' state
        now = time.monotonic()
        for req in scheduler_output.scheduled:
            metrics = self._requests[self._completions[req.request_id].request_id].metrics
            if metrics.first_scheduled_time is None:  # the request's first sequence, first scheduled
                metrics.first_scheduled_time = now
                metrics.num_cached_tokens = req.num_computed_tokens  # prefix-cache hits
            if scheduler_output.blocks_to_swap_in and req.is_new:
                _note_swap_in(self.scheduler.requests[req.request_id], now)
        try:
            self.structured_outputs.fill_bitmask(scheduler_output)  # a grammar's fault fails the batch alone
            runner_output = self.executor.execute(scheduler_output)
        except EngineDeadError:
            raise
        except BaseException as exc:
            # A fault before the workers dropped the requests freed since the last step, or a Ctrl-C
            # (offline): they would hold those requests' rows for good.
            self.scheduler.requeue_freed(scheduler_output.freed_request_ids)
            if not isinstance(exc, Exception):
                raise
            # a model fault fails this batch's requests, not the engine
            logger.exception("model step failed")
            failed = [r.request_id for r in scheduler_output.scheduled]
            deltas = self._fail(failed, f"model step failed: {exc!r}")
        else:
            updated = self.scheduler.update(scheduler_output, runner_output)
            deltas = self._process_outputs(updated, runner_output)
        self.metrics.record_step(self.stats(), deltas)
        self._record_lora_in_use()
        return deltas

    def _process_outputs(
        self, updated: list[Sequence], runner_output: ModelRunnerOutput
    ) -> list[RequestDelta]:
        now = time.monotonic()
        logprobs_by_id = dict(zip(runner_output.request_ids, runner_output.logprobs or [], strict=False))
        self._take_prompt_logprobs(runner_output.prompt_logprobs)
        self._take_pooled(runner_output.pooled)
        deltas = []
        for seq in updated:
            if seq.sampling_params.pooling is not None:  # an embedding, finished by the scheduler
                deltas.append(self._embedding_delta(seq, now))
                continue
            grammar_end = self.structured_outputs.advance(seq)
            if grammar_end is not None:
                self.scheduler.finish(seq, grammar_end)
            new_token_ids = self._detokenize(seq)
            entries = [
                *runner_output.draft_logprobs.get(seq.request_id, []),
                logprobs_by_id.get(seq.request_id),
            ]
            new_logprobs = self._decode_logprobs(entries[: len(new_token_ids)], seq)
            prompt_logprobs = self._first_prompt_logprobs(seq)  # before _delta, which may forget the request
            detokenizer = self._completions[seq.request_id].detokenizer
            text = "" if detokenizer is None else detokenizer.take_delta(seq.is_finished)
            deltas.append(self._delta(seq, new_token_ids, text, new_logprobs, now))
            deltas[-1].prompt_logprobs = prompt_logprobs
            if grammar_end is FinishReason.ERROR:
                deltas[-1].error = "structured outputs: the grammar rejected the sampled token"
        return deltas

    def _detokenize(self, seq: Sequence) -> list[int]:
        """Feed the step's new tokens to the detokenizer one at a time (several with speculative
        decoding), ending the sequence at a stop string: the tokens after the one that completes it
        are dropped. Returns the tokens the sequence keeps."""
        detokenizer = self._completions[seq.request_id].detokenizer
        new_token_ids = seq.token_ids[seq.num_tokens - seq.num_new_tokens :]
        if detokenizer is None:
            return new_token_ids
        stop_terminated = seq.finish_reason in (FinishReason.EOS, FinishReason.STOP)
        stop = None
        for i, token_id in enumerate(new_token_ids):
            stop = detokenizer.update([token_id], stop_terminated and i == len(new_token_ids) - 1)
            if stop is not None:
                del seq.token_ids[seq.num_tokens - (len(new_token_ids) - 1 - i) :]
                new_token_ids = new_token_ids[: i + 1]
                break
        if stop is None and seq.is_finished:
            stop = detokenizer.flush()
        if stop is not None:
            if seq.is_finished:  # the text was cut at a stop string on the same token
                seq.finish_reason = FinishReason.STOP
            seq.stop_reason = stop
            self.scheduler.finish(seq, FinishReason.STOP)
        return new_token_ids

    def _delta(
        self, seq: Sequence, token_ids: list[int], text: str, logprobs: list[TokenLogprobs] | None, now: float
    ) -> RequestDelta:
        completion = self._completions[seq.request_id]
        request = self._requests[completion.request_id]
        metrics = request.metrics
        if token_ids:
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
        reason = seq.finish_reason.value if seq.finish_reason else None
        if seq.is_finished:
            request.num_finished += 1
            metrics.completion_ends[completion.index] = (reason or "unknown", seq.num_output_tokens)
            metrics.num_preemptions += seq.num_preemptions
            metrics.preemption_events.extend(seq.preemption_events)
            self._forget(seq.request_id)
        request_finished = request.num_finished == request.num_sequences
        if request_finished:
            metrics.finished_time = now
            logger.debug("request %s finished: %s", completion.request_id, metrics.completion_ends)
        return RequestDelta(
            request_id=completion.request_id,
            new_token_ids=token_ids,
            new_text=text,
            new_logprobs=logprobs,
            finished=seq.is_finished,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            metrics=metrics,
            index=completion.index,
            request_finished=request_finished,
            stop_reason=seq.stop_reason,  # set as it finishes, None before
        )

    def _rest_of_text(self, seq: Sequence) -> str:
        """An aborted completion's text not yet sent (held back as a possible stop-string start, or a
        character still incomplete): its stream ends with all of its tokens' text, like a finished one."""
        detokenizer = self._completions[seq.request_id].detokenizer
        if detokenizer is None:
            return ""
        detokenizer.flush()
        return detokenizer.take_delta(finished=True)

    def _decode_logprobs(
        self, entries: list[TokenLogprobs | None], seq: Sequence
    ) -> list[TokenLogprobs] | None:
        known = [entry for entry in entries if entry is not None]
        if seq.sampling_params.logprobs is None or len(known) < len(entries):
            return None
        if not seq.sampling_params.detokenize:  # decoded tokens stay None, as vLLM leaves them
            return known
        for entry in known:
            for token_id, logprob in entry.items():
                logprob.decoded_token = self.token_text(token_id)
        return known

    def _take_prompt_logprobs(self, chunks: dict[str, tuple[int, list[TokenLogprobs]]]) -> None:
        """Keep each request's prompt logprobs as its chunks come in, in prompt order (such a request
        takes no prefix-cache hits). One run again after a recompute preemption adds only the
        positions not held yet: each is reported once."""
        for seq_id, (first, entries) in chunks.items():
            completion = self._completions.get(seq_id)
            if completion is None:  # aborted while its step ran
                continue
            request = self._requests[completion.request_id]
            held = request.prompt_logprobs = request.prompt_logprobs or [None]
            assert first <= len(held), f"{seq_id}: prompt logprobs from token {first}, {len(held)} held"
            held.extend(entries[len(held) - first :])

    def _take_pooled(self, chunks: dict[str, tuple[int, list[float]]]) -> None:
        """Add up each embedding request's hidden states as its chunks come in: a chunk from position
        0 starts again (a recompute after a preemption runs the prompt again)."""
        for seq_id, (first, values) in chunks.items():
            completion = self._completions.get(seq_id)
            if completion is None:  # aborted while its step ran
                continue
            request = self._requests[completion.request_id]
            if first == 0 or request.pooled is None:
                request.pooled = values
            else:
                request.pooled = [a + b for a, b in zip(request.pooled, values, strict=True)]

    def _embedding_delta(self, seq: Sequence, now: float) -> RequestDelta:
        """The one delta of an embedding request: its vector, pooled as asked."""
        pooling = seq.sampling_params.pooling
        request = self._requests[self._completions[seq.request_id].request_id]
        assert pooling is not None and request.pooled is not None, f"{seq.request_id}: no hidden states"
        embedding = request.pooled
        if pooling.pooling == "mean":
            embedding = [value / seq.num_prompt_tokens for value in embedding]
        if pooling.normalize:
            norm = max(math.sqrt(math.fsum(value * value for value in embedding)), 1e-12)
            embedding = [value / norm for value in embedding]
        delta = self._delta(seq, [], "", None, now)
        delta.embedding = embedding
        return delta

    def _first_prompt_logprobs(self, seq: Sequence) -> PromptLogprobs | None:
        """The request's prompt logprobs, decoded, for completion 0's first token (the prompt is all
        computed by then); None for any other delta, or when not asked."""
        if seq.sampling_params.prompt_logprobs is None or seq.num_output_tokens != 1:
            return None
        completion = self._completions[seq.request_id]
        if completion.index != 0:
            return None
        held = self._requests[completion.request_id].prompt_logprobs or [None]  # a 1-token prompt: none
        if not seq.sampling_params.detokenize:  # decoded tokens stay None, as vLLM leaves them
            return held
        for entry in held:
            for token_id, logprob in (entry or {}).items():
                logprob.decoded_token = self.token_text(token_id)
        return held

    def _fail(self, seq_ids: list[str], message: str) -> list[RequestDelta]:
        """Fail the requests these sequences belong to, every completion of each: a front end ends a
        call at its first failed completion, so siblings left running (not in the failed step: swapped,
        preempted or over the budget) would compute for nobody and the request would never finish."""
        now, deltas = time.monotonic(), []
        request_ids = dict.fromkeys(
            self._completions[s].request_id for s in seq_ids if s in self._completions
        )
        for request_id in request_ids:
            live = (self.scheduler.requests.get(seq_id) for seq_id in self._seq_ids(request_id))
            ended = [seq for seq in live if seq is not None]  # collected first: a parent's finish
            for seq in ended:  # ends its never-forked siblings too
                self.scheduler.finish(seq, FinishReason.ERROR)
            for seq in ended:
                delta = self._delta(seq, [], "", None, now)
                delta.error = message
                deltas.append(delta)
        return deltas

    def _forget(self, seq_id: str) -> None:
        """A sequence finished; the request goes when its last sequence has."""
        completion = self._completions.pop(seq_id)
        self.structured_outputs.remove(seq_id)
        request = self._requests[completion.request_id]
        if request.num_finished == request.num_sequences:
            del self._requests[completion.request_id]

    def _drop(self, request_id: str) -> None:
        """Forget a request whose sequences the scheduler no longer holds, whatever their deltas."""
        for seq_id in self._seq_ids(request_id):
            self._completions.pop(seq_id, None)
            self.structured_outputs.remove(seq_id)
        del self._requests[request_id]


@dataclass
class _Request:
    """The engine's record of a client request: its metrics and how many sequences it has."""

    metrics: RequestMetrics
    num_sequences: int
    num_finished: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # as computed so far, when asked
    pooled: list[float] | None = None  # an embedding request's hidden states, added up so far


@dataclass
class _Completion:
    """One sequence of a request: which request, which completion index, its detokenizer (None under
    `detokenize=False`)."""

    request_id: str
    index: int
    detokenizer: IncrementalDetokenizer | None


def check_token_ids(field: str, token_ids: list[int], vocab_size: int) -> None:
    """InvalidRequestError naming the first id outside the vocabulary by its index and value, under
    `field` as the caller wrote it (`token_ids[3]: 50000 is not in [0, 49152)`): "must be in [0, vocab)"
    left the caller to find it in a long list. min and max run in C, so a list in range costs no Python
    loop."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        i = next(i for i, t in enumerate(token_ids) if not 0 <= t < vocab_size)
        raise InvalidRequestError(f"{field}[{i}]", f"{token_ids[i]} is not in [0, {vocab_size})")


def _note_swap_in(seq: Sequence, now: float) -> None:
    """A resumed sequence whose last event was a swap-out was just swapped back in (for its span)."""
    if seq.preemption_events and seq.preemption_events[-1][1] == "swap":
        seq.preemption_events.append((now, "swap_in"))


def _lora_names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    return tuple(sorted({seq.lora_name for seq in seqs if seq.lora_name is not None}))


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    """`params` with max_tokens None resolved (for the sequences, the scheduler, the stop checks): a
    copy, since one params object may serve prompts of many lengths. A min_tokens past the room comes
    down to it, which bans the stop tokens to the end as vLLM's unreached min_tokens does."""
    if params.max_tokens == max_tokens:
        return params
    return replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index` of a parallel-sampling request samples with its own seed. Sequence 0 alone
    scores the prompt the others share (so they may take prefix-cache hits)."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def _template_failed(exc: Exception) -> InvalidRequestError:
    """A chat template that raised while rendering (e.g. it iterates a variable the request did not
    give, as `{% for t in tools %}` with no tools): the request's fault or the template's, not the
    server's, and the server goes on serving."""
    return InvalidRequestError("messages", f"the chat template failed on them: {type(exc).__name__}: {exc}")


def check_structured_outputs(config: EngineConfig, params: StructuredOutputsParams) -> None:
    """Compile a request's grammar with the model's tokenizer alone, no model loaded: what the engine
    would refuse as the request arrives (InvalidRequestError naming the field), said before a start that
    takes tens of seconds (`pagedserve generate`)."""
    tokenizer = load_tokenizer(config.model)
    eos_token_ids = _eos_token_ids(config.model.path, tokenizer)
    StructuredOutputs(tokenizer, config.model.vocab_size, eos_token_ids).compile(params)


def _eos_token_ids(model_path: str, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the model directory's generation_config.json (int or list) and the tokenizer's (the
    one --tokenizer names, when given)."""
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
