"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import difflib
import functools
import gc
import operator
import threading
import weakref
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from itertools import count
from pathlib import Path
from typing import Any, TypeVar, cast

from pagedserve.beam_search import BeamSearch, BeamSearchOutput, step_candidates, step_params
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import InvalidRequestError
from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestDelta,
    RequestOutput,
)
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import BeamSearchParams, SamplingParams, _is_int
from pagedserve.settings import EngineSettings
from pagedserve.tool_calls import call_arguments

# text, token ids, or vLLM's TextPrompt / TokensPrompt: {"prompt": text} or {"prompt_token_ids": ids}
Prompt = str | list[int] | Mapping[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids")
P = TypeVar("P", SamplingParams, PoolingParams)
LoRARequests = LoRARequest | Seq[LoRARequest | None] | None  # one for all prompts, or one per prompt


class _HeapFreeze:
    """The heap freezes of the live `LLM`s. Freeing one thaws the heap, so that the collector frees
    its engine's reference cycles (a dropped compiled engine's are its generated code with the
    weights frozen into it: ~600 MB for the default model); the others' freeze is taken again before
    their next run, after a full collection (`refreeze`). Not taken where the caller froze the heap
    themselves: once found, the caller's freeze is taken to hold for the rest of the process, and no
    later LLM freezes or thaws the heap (where the caller thaws it after all, its LLMs are only
    collected as often as any other objects). Looking again each time would walk every frozen object
    (`gc.get_freeze_count` counts them one by one): 37 ms a build under the test suite's frozen
    collection (~500,000 objects); its eager audit (314 LLMs) took 85.7 s looking each time, 70.5 s
    without."""

    def __init__(self) -> None:
        self.holders = 0  # live LLMs that froze the heap
        self.callers = False  # the heap was found frozen with no LLM holding it: the caller's
        self.stale = False  # thawed for a freed LLM while others live: collect, then freeze again
        # A finalizer runs in whichever thread drops the last reference, and in this one within
        # `_collect_if_stale`'s collection: reentrant.
        self.lock = threading.RLock()

    def freeze(self) -> bool:
        """Freeze the heap for a new LLM; False where the caller's freeze holds it already."""
        with self.lock:
            if self.holders == 0 and (self.callers or gc.get_freeze_count() > 0):
                self.callers = True
                return False
            self._collect_if_stale()
            gc.freeze()
            self.holders += 1
            return True

    def thaw(self) -> None:
        with self.lock:
            self.holders -= 1
            gc.unfreeze()
            self.stale = self.holders > 0

    def refreeze(self) -> None:
        """Freeze the heap again for the live LLMs, where freeing another thawed it."""
        with self.lock:
            if self._collect_if_stale() and self.holders:  # none where the collection freed the last
                gc.freeze()

    def _collect_if_stale(self) -> bool:
        """Collect a heap thawed for a freed LLM, before it is frozen again (or the freed LLM's cycles
        would be frozen again with the live objects); whether it was."""
        if not self.stale:
            return False
        gc.collect()
        self.stale = False
        return True


_HEAP = _HeapFreeze()


class LLM:
    """`model=None` is the embedded default (SmolLM2-135M-Instruct). Keyword arguments are the
    engine settings (`dtype`, `kv_cache_memory`, `max_num_seqs`, `num_kv_blocks`, ...).

    Building one freezes the process's heap (`gc.freeze`: the collector's scans skip every object
    alive then), and freeing one thaws it (`gc.unfreeze`), so that the collector frees its engine's
    reference cycles; the LLMs still alive freeze it again at their next call, after a full
    collection. An LLM that only a reference cycle holds (a method of its engine replaced by a
    closure over it, say) is frozen with its cycle: it is freed when another LLM is, or never. A
    heap the caller froze before the first LLM is theirs: it is left as it is, neither frozen
    further nor thawed, by that LLM and every later one (`_HeapFreeze`)."""

    def __init__(self, model: str | None = None, **settings: Any) -> None:
        _check_setting_names(settings)
        self.engine = LLMEngine.from_settings(EngineSettings(model=model, **settings))
        self._ids = count()
        # What start-up built (~600,000-800,000 objects for the default model: its modules, compiled
        # code, the tokenizer) leaves the garbage collector's scans, as in `pagedserve serve`
        # (rpc/cli.py). Otherwise a full collection walks it all whenever the objects surviving into
        # the oldest generation since the last one number a quarter of it: outputs holding logprobs
        # bring one every 3-4 chat rounds (5 a token), 838 ms each, against 6-7 ms frozen. Frozen
        # without a collection first (~0.4-0.8 s): the start-up's cyclic garbage (~200,000 small
        # objects) waits for the thaw.
        if _HEAP.freeze():
            weakref.finalize(self, _HEAP.thaw)

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (a transformers tokenizer), as vLLM's `LLM.get_tokenizer()`."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without `sampling_params`: the model's generation_config.json
        values where it has them (as vLLM's), else SamplingParams' defaults."""
        return self.engine.sampling_params()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, so the next prompts are computed in full (a benchmark repeating a
        workload, say); False while requests are unfinished."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        priority: list[int] | None = None,
        lora_request: LoRARequests = None,
    ) -> list[RequestOutput]:
        """Run all prompts in one continuous batch; outputs come back in input order. `use_tqdm` may
        be a tqdm-like class to make the progress bar with (as in vLLM). `priority`, one int per
        prompt (lower runs earlier), needs `LLM(scheduling_policy="priority")`, as in vLLM.
        `lora_request` runs the prompts (all, or each its own: a list, None for the base model)
        through a LoRA adapter of `LLM(lora_modules=...)`."""
        texts, token_ids = self._tokenized(prompts)
        return self._run(texts, token_ids, sampling_params, use_tqdm, priority, lora_request)

    def embed(
        self,
        prompts: Prompt | Seq[Prompt],
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        priority: list[int] | None = None,
        lora_request: LoRARequests = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's `LLM.embed`), in input order: the model's final hidden
        state of the last prompt token, L2-normalized, unless `pooling_params` say otherwise. The
        prompts share the batches, the KV cache and the prefix cache with generation."""
        texts, token_ids = self._tokenized(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        pooling = _per_prompt(pooling_params, len(texts), PoolingParams, "pooling_params")
        embeddings: dict[str, list[float]] = {}
        outputs = self._run(
            texts,
            token_ids,
            [p.as_sampling_params() for p in pooling],
            use_tqdm,
            priority,
            lora_request,
            embeddings,
        )
        return [
            EmbeddingRequestOutput(
                out.request_id, out.prompt, out.prompt_token_ids, EmbeddingOutput(embeddings[out.request_id])
            )
            for out in outputs
        ]

    def beam_search(
        self,
        prompts: Prompt | Seq[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequests = None,
        use_tqdm: bool | Callable[..., Any] = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: one `BeamSearchOutput` per prompt, in input order, holding its best
        `beam_width` beams, best first. Prompts as `generate` takes them (vLLM's takes prompt dicts).

        Built on the engine's own steps, as vLLM's: each of up to `max_tokens` rounds runs every live
        beam of every prompt (of `concurrency_limit` prompts at a time, all by default) for one token
        in one `generate` call, asking for `2 * beam_width` logprobs, then each prompt keeps its best
        `beam_width` beams (`BeamSearch.extend`). A beam runs its whole sequence as a new request each
        round: the prefix cache (on by default) finds all but its last block's tokens computed.
        `use_tqdm` counts the rounds, of which fewer may run (every beam finished)."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError("params", f"must be a BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and not (_is_int(concurrency_limit) and concurrency_limit >= 1):
            raise InvalidRequestError("concurrency_limit", "must be an integer >= 1, or None (all prompts)")
        _, token_ids = self._tokenized(prompts)
        lora_requests = _lora_requests(lora_request, len(token_ids))
        eos_token_ids = self.engine.eos_token_ids
        searches = [
            BeamSearch(ids, lora, params, eos_token_ids) for ids, lora in zip(token_ids, lora_requests)
        ]
        limit = concurrency_limit or max(len(searches), 1)
        for start in range(0, len(searches), limit):
            self._run_beam_searches(searches[start : start + limit], params, use_tqdm)
        decode = functools.partial(self.engine.decode, skip_special_tokens=False)
        return [search.best(decode) for search in searches]

    def _run_beam_searches(
        self, searches: list[BeamSearch], params: BeamSearchParams, use_tqdm: bool | Callable[..., Any]
    ) -> None:
        """Extend the searches' beams a token a round, all of them in one engine call each round."""
        step = step_params(params)
        max_model_len = self.engine.config.model.max_model_len
        progress = _progress_bar(use_tqdm, params.max_tokens, "beam search", "token")
        try:
            for _ in range(params.max_tokens):
                for search in searches:
                    search.end_at_context(max_model_len)
                beams = [beam for search in searches for beam in search.beams]
                if not beams:
                    break
                outputs = iter(
                    self._run(
                        [None] * len(beams),
                        [beam.tokens for beam in beams],
                        step,
                        False,
                        None,
                        [beam.lora_request for beam in beams],
                    )
                )
                for search in searches:
                    search.extend([step_candidates(next(outputs).outputs[0].logprobs) for _ in search.beams])
                if progress is not None:
                    progress.update(1)
        finally:
            if progress is not None:
                progress.close()

    def _tokenized(self, prompts: Prompt | Seq[Prompt]) -> tuple[list[str | None], list[list[int]]]:
        """Each prompt's text (None for token ids) and token ids."""
        texts: list[str | None] = []
        token_ids = []
        for index, prompt in enumerate(_batch(prompts)):
            parsed = _parse_prompt(prompt, index)
            texts.append(parsed if isinstance(parsed, str) else None)
            token_ids.append(self.engine.encode_prompt(parsed) if isinstance(parsed, str) else parsed)
        return texts, token_ids

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        priority: list[int] | None = None,
        lora_request: LoRARequests = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate. Each output's
        `prompt` is the templated text, special tokens included (as vLLM's). `priority` and
        `lora_request`: as `generate`'s, per conversation. As vLLM's: `chat_template` (its text)
        replaces the model's (or --chat-template's) for this call, `add_generation_prompt` opens the
        assistant's turn, `continue_final_message` leaves the last message open instead, `tools`
        reach the template as `tools`, and `chat_template_kwargs` are further template variables
        (e.g. {"enable_thinking": False} for Qwen3) over the engine's defaults."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        if not isinstance(conversations, list):
            raise InvalidRequestError(
                "messages", f"expected a list of message dicts, got {type(messages).__name__}"
            )
        for index, conversation in enumerate(conversations):
            if not isinstance(conversation, list) or not all(
                isinstance(m, Mapping) and "role" in m for m in conversation
            ):
                raise InvalidRequestError(
                    "messages",
                    f"conversation {index}: expected a list of {{'role': ..., 'content': ...}} dicts",
                )
        if tools is not None:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        token_ids = [
            self.engine.encode_chat(
                [_chat_message(message, index, at) for at, message in enumerate(conversation)],
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                chat_template=chat_template,
            )
            for index, conversation in enumerate(cast(list[list[dict[str, Any]]], conversations))
        ]
        texts = [self.engine.decode(ids, skip_special_tokens=False) for ids in token_ids]
        return self._run(list(texts), token_ids, sampling_params, use_tqdm, priority, lora_request)

    def _run(
        self,
        texts: list[str | None],
        token_ids: list[list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
        use_tqdm: bool | Callable[..., Any],
        priority: list[int] | None,
        lora_request: LoRARequests,
        embeddings: dict[str, list[float]] | None = None,
    ) -> list[RequestOutput]:
        """Run the requests to their end; `embeddings` receives each embedding request's vector."""
        _HEAP.refreeze()
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, len(token_ids), SamplingParams, "sampling_params")
        priorities = _priorities(priority, len(token_ids))
        lora_requests = _lora_requests(lora_request, len(token_ids))
        lora_names = [None if r is None else r.lora_name for r in lora_requests]
        self._load_new_adapters(lora_request)
        # a bad prompt adds none of the batch
        for index, (ids, p, prio, lora) in enumerate(zip(token_ids, params, priorities, lora_names)):
            try:
                token_ids[index] = self.engine.truncate_prompt(ids, p)  # what the outputs report
                self.engine.validate_request(token_ids[index], p, prio, lora)
            except InvalidRequestError as exc:
                raise InvalidRequestError(exc.field, f"{exc.message} (prompts[{index}])") from None
        outputs: dict[str, RequestOutput] = {}  # in input order
        progress = _progress_bar(use_tqdm, len(token_ids))
        try:
            for text, ids, p, prio, adapter in zip(texts, token_ids, params, priorities, lora_requests):
                request_id = f"llm-{next(self._ids)}"
                completions = [CompletionOutput(i, "", [], None) for i in range(p.n)]
                outputs[request_id] = RequestOutput(
                    request_id, text, ids, completions, False, lora_request=adapter
                )
                name = None if adapter is None else adapter.lora_name
                self.engine.add_request(request_id, ids, p, priority=prio, lora_name=name)
            error = self._step_until_finished(outputs, progress, embeddings)
        finally:
            # A failed request, an exception or a Ctrl-C (from tqdm, the model, anywhere in here) must
            # not leave this call's other requests in the engine: the next call would step them too.
            self.engine.abort_request([rid for rid, out in outputs.items() if not out.finished])
            if progress is not None:
                progress.close()
        self._drop_worker_state()
        if error is not None:
            raise RuntimeError(error)
        return list(outputs.values())

    def _load_new_adapters(self, lora_request: LoRARequests) -> None:
        """As vLLM's offline API: a LoRARequest with a path loads its adapter on first use (where none
        of its name is loaded)."""
        requests = [lora_request] if isinstance(lora_request, LoRARequest) else list(lora_request or ())
        for request in requests:
            if request is None or not request.lora_path:
                continue
            loaded = self.engine.lora_path(request.lora_name)
            if loaded is None:
                self.engine.load_lora_adapter(request.lora_name, request.lora_path)
            elif Path(loaded).resolve() != Path(request.lora_path).resolve():
                raise InvalidRequestError(
                    "lora_request",
                    f"{request.lora_name!r} is loaded from {loaded}, not {request.lora_path}: unload it "
                    "first (llm.engine.unload_lora_adapter) to load another adapter under its name",
                )

    def _step_until_finished(
        self, outputs: dict[str, RequestOutput], progress: Any, embeddings: dict[str, list[float]] | None
    ) -> str | None:
        """Step until every request in `outputs` finished; the first failure's message ends it early."""
        num_unfinished = len(outputs)
        while num_unfinished and self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                out = outputs.get(delta.request_id)
                if out is None:  # someone else's, added to self.engine directly
                    continue
                if delta.error:
                    return f"request {delta.request_id} failed: {delta.error}"
                _accumulate(out.outputs[delta.index], delta)
                if delta.prompt_logprobs is not None:
                    out.prompt_logprobs = delta.prompt_logprobs
                if delta.embedding is not None and embeddings is not None:
                    embeddings[delta.request_id] = delta.embedding
                if delta.request_finished:
                    out.finished, out.metrics = True, delta.metrics
                    num_unfinished -= 1
                    if progress is not None:
                        progress.update(1)
        return None

    def _drop_worker_state(self) -> None:
        """The workers drop an ended request's state with the next step; a server steps once more when
        idle (`LLMEngine.has_work`). Offline no step may come for a long time, so take it now: it runs
        no model, it only frees the last batch's rows and sampling state."""
        while not self.engine.has_unfinished_requests() and self.engine.has_work():
            self.engine.step()


def _chat_message(message: Mapping[str, Any], conversation: int, index: int) -> dict[str, Any]:
    """`message` as vLLM's `LLM.chat` gives it to the template: its text content parts joined, and an
    assistant message's tool calls with their arguments (OpenAI's JSON text) parsed to an object, as
    templates print them (`tojson`) and as the gRPC `ChatMessage.tool_calls` reach them."""
    out = _text_content(message, conversation, index)
    calls = out.get("tool_calls")
    if out.get("role") == "assistant" and isinstance(calls, list):
        out["tool_calls"] = [
            _parsed_call(call, f"conversation {conversation}, message {index}, tool call {at}")
            for at, call in enumerate(calls)
        ]
    return out


def _parsed_call(call: Any, where: str) -> Any:
    """A call whose `function.arguments` is JSON text (or empty: no arguments), with them parsed; any
    other call as given (arguments already an object, or a shape of the caller's own template)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments") or "", str):
        return call
    try:
        arguments = call_arguments(function.get("arguments") or "", "messages")
    except InvalidRequestError as exc:
        raise InvalidRequestError("messages", f"{where}: function.arguments {exc.message}") from None
    return {**call, "function": {**function, "arguments": arguments}}


def _text_content(message: Mapping[str, Any], conversation: int, index: int) -> dict[str, Any]:
    """`message` with OpenAI-style content parts (`[{"type": "text", "text": ...}, ...]`) joined into
    one string by newlines (null or absent content: ""), as vLLM gives them to a template that takes
    string content (most do, and a template that takes parts takes a string as well); parts of any
    other type are refused (this engine reads text only)."""
    content = message.get("content")
    if content is None:  # OpenAI's null (an assistant turn that only calls tools), or none given
        return {**message, "content": ""}
    if not isinstance(content, list):
        return dict(message)
    texts = []
    for part in content:
        if not (
            isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidRequestError(
                "messages",
                f"conversation {conversation}, message {index}: a content part of type {kind!r}; "
                'only text parts ({"type": "text", "text": ...}) are read',
            )
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def _check_setting_names(settings: dict[str, Any]) -> None:
    """Engine settings are read by name, and an unknown one would be ignored: vLLM's
    `gpu_memory_utilization` silently doing nothing is worse than an error naming it."""
    known = [name for name in EngineSettings.model_fields if name != "model"]
    for name in settings:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the settings are {', '.join(known)}"
            raise InvalidRequestError(name, f"not an engine setting of LLM(){hint}")


def _batch(prompts: Prompt | Seq[Prompt]) -> list[Any]:
    """One prompt (text, a token-id list, a prompt dict) or a list or tuple of them, as a list."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, list) and prompts and not isinstance(prompts[0], (str, list, tuple, Mapping)):
        return [prompts]  # token ids; an element that is not an integer is refused in _token_ids
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise InvalidRequestError(
        "prompts",
        f"expected a string, a list of token ids, a prompt dict, or a list of them; got {type(prompts).__name__}",
    )


def _parse_prompt(prompt: Any, index: int) -> str | list[int]:
    """A text prompt's text, or a token prompt's ids."""
    if isinstance(prompt, Mapping):
        unknown = [key for key in prompt if key not in PROMPT_KEYS]
        if unknown:
            raise InvalidRequestError(f"prompts[{index}]", f"unsupported keys {unknown} (only {PROMPT_KEYS})")
        if "prompt_token_ids" in prompt:
            return _token_ids(prompt["prompt_token_ids"], index)
        if "prompt" not in prompt:
            raise InvalidRequestError(
                f"prompts[{index}]", "a prompt dict needs 'prompt' or 'prompt_token_ids'"
            )
        prompt = prompt["prompt"]
    return prompt if isinstance(prompt, str) else _token_ids(prompt, index)


def _token_ids(ids: Any, index: int) -> list[int]:
    """A token-id prompt as a list of Python ints (NumPy or torch integers too, not bools or floats)."""
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Seq):
        raise InvalidRequestError(
            f"prompts[{index}]", f"expected a string or a list of token ids, got {type(ids).__name__}"
        )
    try:
        if any(isinstance(t, bool) for t in ids):
            raise TypeError
        return [operator.index(t) for t in ids]
    except TypeError:
        raise InvalidRequestError(
            "prompt_token_ids", f"token ids must be integers (prompts[{index}])"
        ) from None


def _accumulate(completion: CompletionOutput, delta: RequestDelta) -> None:
    completion.text += delta.new_text
    completion.token_ids.extend(delta.new_token_ids)
    if delta.new_logprobs is not None:
        completion.logprobs = (completion.logprobs or []) + delta.new_logprobs
        completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sum(
            entry[token_id].logprob for token_id, entry in zip(delta.new_token_ids, delta.new_logprobs)
        )
    if delta.finished:
        completion.finish_reason = delta.finish_reason
        completion.stop_reason = delta.stop_reason


def _per_prompt(params: P | Seq[P], n: int, kind: type[P], name: str) -> list[P]:
    """One parameters object per prompt: `params` given once for all, or a list of one each."""
    if isinstance(params, kind):
        return [params] * n
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, kind) for p in params):
        raise InvalidRequestError(name, f"must be a {kind.__name__} or a list of one per prompt")
    if len(params) != n:
        raise InvalidRequestError(name, f"got {len(params)} for {n} prompts")
    return list(params)


def _priorities(priority: Seq[int] | None, n: int) -> list[int]:
    """One priority per prompt, as Python ints (NumPy or torch integers too, not bools or floats)."""
    if priority is None:
        return [0] * n
    if not isinstance(priority, (list, tuple)):
        raise InvalidRequestError(
            "priority", f"must be a list of one int per prompt, got {type(priority).__name__}"
        )
    if len(priority) != n:
        raise InvalidRequestError("priority", f"got {len(priority)} for {n} prompts")
    try:
        if any(isinstance(p, bool) for p in priority):
            raise TypeError
        return [operator.index(p) for p in priority]
    except TypeError:
        raise InvalidRequestError("priority", "must be integers") from None


def _lora_requests(lora_request: LoRARequests, n: int) -> list[LoRARequest | None]:
    """Each prompt's LoRARequest (None: the base model) from one LoRARequest or a list of them."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, (list, tuple)):
        raise InvalidRequestError(
            "lora_request", f"must be a LoRARequest or a list of them, got {type(lora_request).__name__}"
        )
    if len(lora_request) != n:
        raise InvalidRequestError("lora_request", f"got {len(lora_request)} for {n} prompts")
    if not all(r is None or isinstance(r, LoRARequest) for r in lora_request):
        raise InvalidRequestError("lora_request", "must hold LoRARequest objects (or None)")
    return list(lora_request)


def _progress_bar(
    use_tqdm: bool | Callable[..., Any], total: int, desc: str = "generating", unit: str = "req"
) -> Any:
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc=desc, unit=unit)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit)
