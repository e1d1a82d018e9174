"""Per-request sampling parameters, validated once at construction (each error names its field)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pagedserve.errors import InvalidRequestError

MAX_LOGPROBS = 20
# Every stop string is searched for after every token, on the thread that steps everyone's batch:
# 300,000 of them on one request made another request's 300 tokens take 38 s instead of 3.4 s.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_INT64 = 2**63 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_list(value: Any, name: str) -> list[Any]:
    """A list, tuple or other iterable of values as a list; None (vLLM's default) as an empty one."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InvalidRequestError(name, f"must be a list, got {type(value).__name__}")
    return list(value)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class StructuredOutputsParams:
    """Constrain every sampled token so the completion matches one of: a JSON schema (`json`, as text or
    a dict), a regular expression, one of the `choice` strings, an EBNF grammar (xgrammar's syntax, a
    `root` rule), or any JSON object (`json_object=True`). Exactly one is set. Shaped like vLLM's.
    Once the grammar is complete only EOS may follow: the completion ends there (finish reason eos),
    also under `ignore_eos` or before `min_tokens` (as vLLM ends it). JSON allows any whitespace.

    Here the kind and the types are checked; the engine compiles the schema, regex or grammar when it
    admits the request, and rejects one that does not compile naming the field (`structured_outputs.json`)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            self.choice = _as_list(self.choice, "structured_outputs.choice")
        self._verify()
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise InvalidRequestError(
                "structured_outputs",
                f"set exactly one of json, regex, choice, grammar or json_object, got {kinds or 'none'}",
            )

    @property
    def kind(self) -> str:
        """The one constraint set: json, regex, choice, grammar or json_object."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def _verify(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(f"structured_outputs.{name}", message)

        check(isinstance(self.json_object, bool), "json_object", "must be a boolean")
        check(
            self.json is None or isinstance(self.json, (str, dict)),
            "json",
            "must be a JSON schema, as a string or a dict",
        )
        check(self.regex is None or isinstance(self.regex, str), "regex", "must be a string")
        check(self.grammar is None or isinstance(self.grammar, str), "grammar", "must be a string")
        check(
            self.choice is None or (bool(self.choice) and all(isinstance(c, str) and c for c in self.choice)),
            "choice",
            "must be a non-empty list of non-empty strings",
        )


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop. Shaped like vLLM's `SamplingParams`.

    `temperature == 0` is greedy. `top_k` 0 or -1 disables top-k. The text ends where a `stop` string is
    first completed (of several, the one that ends first); the stop string is cut from it unless
    `include_stop_str_in_output`, and so is the text of an EOS or stop token id that ended generation.
    No stop of any kind counts within the first `min_tokens` tokens. `logprobs=k` returns, per
    generated token, the log-probabilities of the sampled token (with its rank, even outside the k)
    and the k most likely ones, all of the raw model output: before penalties, temperature and
    top-k/top-p/min-p (vLLM's default, `raw_logprobs`); with `structured_outputs`, of the output the
    grammar allows (as vLLM's: its mask applies first), and tokens it disallows are not listed.

    Where we differ from vLLM, on purpose: a temperature in (0, 1e-5) is greedy and one in [1e-5, 0.01)
    is used as given, where vLLM raises both to 0.01 (the softmax subtracts the maximum logit, so
    nothing overflows); any finite temperature is taken (recent vLLM refuses those above 2).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list(self.stop, "stop")
        self.stop_token_ids = _as_list(self.stop_token_ids, "stop_token_ids")
        if _is_int(self.top_k) and self.top_k == 0:  # vLLM's "disabled", its default since 0.8
            self.top_k = -1
        self._verify()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def _verify(self) -> None:
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise InvalidRequestError(name, f"must be a finite number, got {value!r}")
        self._check(self.temperature >= 0.0, "temperature", "must be >= 0 (0 means greedy)")
        self._check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        self._check(  # the workers hold top_k as int64: a larger one failed the step of its batch
            _is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k <= MAX_INT64),
            "top_k",
            f"must be an integer in [1, {MAX_INT64}], or 0 or -1 to disable",
        )
        self._check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        self._check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        self._check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        self._check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        self._check(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        self._check(
            _is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1"
        )
        self._check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be an integer in [0, max_tokens]",
        )
        self._check(self.seed is None or _is_int(self.seed), "seed", "must be an integer")
        self._check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        self._check(
            len(self.stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
            "stop",
            f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters each",
        )
        self._check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )
        self._check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}]",
        )
        self._check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams",
        )

    @staticmethod
    def _check(ok: bool, name: str, message: str) -> None:
        if not ok:
            raise InvalidRequestError(name, message)
