"""Per-request sampling parameters, validated once at construction (each error names its field)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from pagedserve.pooling_params import PoolingParams

MAX_LOGPROBS = 20
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam search round asks for 2 * beam_width logprobs
# Every stop string is searched for after every token, on the thread that steps everyone's batch:
# 300,000 of them on one request made another request's 300 tokens take 38 s instead of 3.4 s.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_INT64 = 2**63 - 1
# A schema, regex, grammar, structural tag or choice list compiles on one thread before its request is
# admitted, and compile time grows faster than the spec: an enum of 20,000 values compiled in 2 s, of
# 100,000 in 38 s (xgrammar 0.2.8, this machine); 64 KiB (an enum of ~7,000) compiles in a third of a second.
MAX_STRUCTURED_OUTPUTS_CHARS = 64 * 1024
# Nesting costs far more than length: a JSON schema of arrays nested 100 deep compiled in 0.06 s, 200
# deep in 0.33 s, 600 deep (15 KiB) in 10.5 s, and a grammar or regex of 5,000 nested groups (10 KiB)
# in minutes, holding every other request's constraint behind it on the one compile thread. OpenAI's
# structured outputs allow 10 levels of a schema; 64 of any spec take milliseconds.
MAX_STRUCTURED_OUTPUTS_NESTING = 64
# Optional properties (those an object's `required` leaves out) cost about their count squared to compile,
# per object: one object of 500 of them compiled in 0.5 s, 1,000 in 7 s, 3,000 (32 KiB) in 75 s, and
# 5,000 (54 KiB) ran past 5 minutes, holding every other request's constraint behind it. A schema's
# objects together may cost 32,768 (one object of 181 optional properties, or 128 objects of 16: 0.7 s).
MAX_STRUCTURED_OUTPUTS_OPTIONAL_PROPERTIES_COST = 32 * 1024
# The logit controls cost each step of their request's row on the same thread: an index into the logits
# per entry, and for bad words a match of the last tokens. Capped as vLLM's GPU sampler caps
# allowed_token_ids and logit_bias (1,024 ids each): more would only make one request slow everyone's batch.
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 1024
# and stop token ids, each masked on every step while its request is below min_tokens: 300,000 of them on
# one request slowed another request's stream from 1,121 to 24 tokens/s (tiny model, this machine)
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's range, to which vLLM's OpenAI server clamps each bias
_MAX_TOKEN_ID_DIGITS = 18


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


def _is_finite(value: float) -> bool:
    """math.isfinite, but an int too large for a float (10**400) is not finite rather than an error."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _as_logit_bias(value: Any) -> dict[int, float]:
    """A dict of token id to bias, its keys ints or their decimal strings (JSON objects have only string
    keys), its biases finite numbers clamped to [-100, 100]."""
    if not isinstance(value, Mapping):
        raise InvalidRequestError(
            "logit_bias", f"must be a dict of token id to bias, got {type(value).__name__}"
        )
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            "logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} token ids, got {len(value)}"
        )
    bias = {}
    for key, amount in value.items():
        # a string of more digits than any token id has is none (nor parsed: int() refuses 4,300 digits)
        is_digits = isinstance(key, str) and key.isdecimal() and len(key) <= _MAX_TOKEN_ID_DIGITS
        token_id = key if _is_int(key) else int(key) if is_digits else None
        if token_id is None or token_id < 0:
            raise InvalidRequestError("logit_bias", f"keys must be token ids (integers >= 0), got {key!r}")
        if not _is_number(amount) or (isinstance(amount, float) and not math.isfinite(amount)):
            raise InvalidRequestError(
                "logit_bias", f"biases must be finite numbers, got {amount!r} for {key!r}"
            )
        # clamped before float(): an int of 400 digits is a finite number, but fits no float
        bias[token_id] = float(min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, amount)))
    return bias


@dataclass
class StructuredOutputsParams:
    """Constrain every sampled token so the completion matches one of: a JSON schema (`json`, as text or
    a dict), a regular expression, one of the `choice` strings, an EBNF grammar (xgrammar's syntax, a
    `root` rule), a `structural_tag` (JSON text: free text until a trigger, then a forced structure
    such as a tool call), or any JSON object (`json_object=True`). Exactly one is set. Shaped like vLLM's.
    `structural_tag` takes what vLLM takes: the classic `{"type": "structural_tag", "structures":
    [{"begin": ..., "schema": {...}, "end": ...}], "triggers": [...]}` (a section opens where the text
    reaches a trigger, a prefix of its `begin`; between `begin` and `end` it matches the schema as
    JSON) or xgrammar's `{"type": "structural_tag", "format": {...}}`.
    Once the grammar is complete only EOS may follow: the completion ends there (finish reason eos),
    also under `ignore_eos` or before `min_tokens` (as vLLM ends it). JSON allows any whitespace unless
    `disable_any_whitespace` (vLLM's option): then none but single spaces after `:` and `,`, so that a
    weak model cannot spend its tokens on newlines between the fields.

    Here the kind and the types are checked; the engine compiles the schema, regex or grammar when it
    admits the request, and rejects one that does not compile naming the field (`structured_outputs.json`)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False  # json and json_object only
    structural_tag: str | None = None  # last, as in vLLM's (positional arguments keep their meaning)

    def __post_init__(self) -> None:
        if self.choice is not None:
            self.choice = _as_list(self.choice, "structured_outputs.choice")
        self._verify()
        kinds = [name for name in _SPEC_KINDS if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise InvalidRequestError(
                "structured_outputs",
                "set exactly one of json, regex, choice, grammar, structural_tag or json_object, "
                f"got {kinds or 'none'}",
            )

    @property
    def kind(self) -> str:
        """The one constraint set: json, regex, choice, grammar, structural_tag or json_object."""
        for name in _SPEC_KINDS:
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def _verify(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(f"structured_outputs.{name}", message)

        check(isinstance(self.json_object, bool), "json_object", "must be a boolean")
        check(isinstance(self.disable_any_whitespace, bool), "disable_any_whitespace", "must be a boolean")
        check(
            self.json is None or isinstance(self.json, (str, dict)),
            "json",
            "must be a JSON schema, as a string or a dict",
        )
        check(self.regex is None or isinstance(self.regex, str), "regex", "must be a string")
        check(self.grammar is None or isinstance(self.grammar, str), "grammar", "must be a string")
        check(
            self.structural_tag is None or isinstance(self.structural_tag, str),
            "structural_tag",
            "must be a string (the structural tag as JSON text)",
        )
        check(
            self.choice is None or (bool(self.choice) and all(isinstance(c, str) and c for c in self.choice)),
            "choice",
            "must be a non-empty list of non-empty strings",
        )
        kind = self.kind
        if kind != "json_object":
            size = _spec_size(getattr(self, kind))
            check(
                size <= MAX_STRUCTURED_OUTPUTS_CHARS,
                kind,
                f"at most {MAX_STRUCTURED_OUTPUTS_CHARS} characters, got {size}",
            )
        if kind in ("json", "regex", "grammar", "structural_tag"):
            depth = _nesting(getattr(self, kind), kind)
            check(
                depth <= MAX_STRUCTURED_OUTPUTS_NESTING,
                kind,
                f"nested at most {MAX_STRUCTURED_OUTPUTS_NESTING} levels deep, got {depth}",
            )
        if kind in ("json", "structural_tag"):  # checked nested at most 64 deep: parsed at no risk
            cost = _optional_properties_cost(getattr(self, kind))
            check(
                cost <= MAX_STRUCTURED_OUTPUTS_OPTIONAL_PROPERTIES_COST,
                kind,
                "too many optional properties (not in their object's required) to compile: each object "
                "costs their count squared, at most "
                f"{MAX_STRUCTURED_OUTPUTS_OPTIONAL_PROPERTIES_COST} in all (one object of 181), got {cost}",
            )


_SPEC_KINDS = ("json", "regex", "choice", "grammar", "structural_tag")


def _spec_size(spec: str | dict[str, Any] | list[str]) -> int:
    """Characters of a spec: a schema, regex, grammar, structural tag or choice list (a dict schema as
    its JSON text)."""
    if isinstance(spec, str):
        return len(spec)
    if isinstance(spec, list):
        return sum(len(choice) for choice in spec)
    try:
        return len(json.dumps(spec))
    except (TypeError, ValueError, RecursionError):  # not JSON at all: the compiler says so
        return 0


# What does not nest, dropped before a spec's brackets are counted: JSON strings; a regex's escapes and
# character classes; a grammar's quoted strings, character classes and escapes.
_NOT_NESTING = {
    "json": re.compile(r'"(?:[^"\\]|\\.)*"'),
    "regex": re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]"),
    "grammar": re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:\\.|[^\]\\])*\]|\\.'),
}
_BRACKETS = {"json": re.compile(r"[\[\]{}]"), "regex": re.compile(r"[()]"), "grammar": re.compile(r"[()]")}


def _nesting(spec: str | dict[str, Any], kind: str) -> int:
    """How deep a spec nests: a JSON text's (a schema's, a structural tag's) arrays and objects, a
    regex's or grammar's groups; a spec that does not parse is the compiler's to refuse. Quoted text,
    character classes and escapes are dropped first, then only the brackets are walked (an enum's
    68 KiB schema: 1.3 ms, against 2.3 ms for a loop over every character)."""
    if not isinstance(spec, str):  # a dict schema
        try:
            spec = json.dumps(spec)
        except (TypeError, ValueError):
            return 0
        except RecursionError:
            return MAX_STRUCTURED_OUTPUTS_NESTING + 1
    syntax = "json" if kind == "structural_tag" else kind
    depth = deepest = 0
    for bracket in _BRACKETS[syntax].findall(_NOT_NESTING[syntax].sub("", spec)):
        depth += 1 if bracket in "([{" else -1
        deepest = max(deepest, depth)
    return deepest


def _optional_properties_cost(spec: str | dict[str, Any]) -> int:
    """The sum, over a JSON spec's objects with `properties`, of the square of how many of them their
    `required` leaves out (every dict with a `properties` dict counts, wherever it sits: schemas of a
    structural tag too); 0 for a spec that does not parse, which the compiler refuses."""
    doc: Any = spec
    if isinstance(spec, str):
        try:
            doc = json.loads(spec)
        except (ValueError, RecursionError):
            return 0
    cost, stack = 0, [doc]
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, dict):
            properties, required = value.get("properties"), value.get("required")
            if isinstance(properties, dict):
                names = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
                names &= properties.keys()
                cost += (len(properties) - len(names)) ** 2
            stack.extend(value.values())
    return cost


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop. Shaped like vLLM's `SamplingParams`.

    `max_tokens=None` (vLLM's) generates until the context is full: the engine resolves it per request
    to the room the context leaves after the prompt (after `truncate_prompt_tokens`), on a copy of the
    params, so that one object serves prompts of any length; a `min_tokens` past that room then ends
    at the context, as in vLLM (its check against max_tokens holds only for a max_tokens given).
    `temperature == 0` is greedy. `top_k` 0 or -1 disables top-k. The text ends where a `stop` string is
    first completed (of several, the one that ends first); the stop string is cut from it unless
    `include_stop_str_in_output`, and so is the text of an EOS or stop token id that ended generation.
    No stop of any kind counts within the first `min_tokens` tokens. `logprobs=k` returns, per
    generated token, the log-probabilities of the sampled token (with its rank, even outside the k)
    and the k most likely ones, all of the raw model output: before penalties, temperature and
    top-k/top-p/min-p (vLLM's default, `raw_logprobs`); with `structured_outputs`, of the output the
    grammar allows (as vLLM's: its mask applies first), and tokens it disallows are not listed.
    `prompt_logprobs=k` returns the same for every prompt token after the first (the token itself and
    the k most likely there), computing the whole prompt: such a request takes no prefix-cache hits.
    `truncate_prompt_tokens=k` keeps only the prompt's last k tokens (left truncation, vLLM's): -1
    keeps as many as leave `max_tokens` of room in the context, with `max_tokens=None` room for one
    token (vLLM's -1 keeps the context length, which leaves none); a k above the context length is
    refused, as vLLM refuses it.

    Detokenization, vLLM's flags: `detokenize=False` decodes nothing for the request: its outputs carry
    the token ids, text "" and logprobs whose `decoded_token` is None, and it takes no `stop` strings
    (they are matched against the text; vLLM refuses them the same way). `skip_special_tokens` leaves
    special tokens out of the text; `spaces_between_special_tokens` goes to the tokenizer's decode, as
    in vLLM: transformers 4's slow tokenizers joined special tokens with spaces unless it is False,
    while fast tokenizers (the default model's) and transformers 5's ignore it.

    Logit controls, vLLM's, applied to every row they are set on, greedy ones included, before
    penalties and temperature (logprobs stay the raw model's): `logit_bias` adds to the logits of its
    token ids (keys may be decimal strings, as JSON sends them; each bias clamped to [-100, 100], as
    vLLM's OpenAI server does); only `allowed_token_ids` may be sampled; no `bad_words` word is ever
    completed: each is tokenized as given and after a space (" word" and "word" differ), and the last
    token of either is banned where the output so far ends with the rest of it (a one-token word at
    every step). Where a structured-outputs grammar and `allowed_token_ids` share no token the grammar
    wins, and where bans (bad words, `min_tokens`) would leave nothing the grammar or
    `allowed_token_ids` allow, the bans yield for that token: a row never has no token to sample.

    Where we differ from vLLM, on purpose: a temperature in (0, 1e-5) is greedy and one in [1e-5, 0.01)
    is used as given, where vLLM raises both to 0.01 (the softmax subtracts the maximum logit, so
    nothing overflows); any finite temperature is taken (recent vLLM refuses those above 2); a bad
    word's form after a space is banned whenever it differs from the word's own, where vLLM keeps it
    only when it is as many tokens (and so lets " word" through when "word" is two tokens and " word" one).
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
    max_tokens: int | None = 16  # None: until the context is full (the engine resolves it per prompt)
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's detokenization flags, here after the fields above so that their positions stay as they were
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's private field: the bad words' token ids, set by the engine at admission (it holds the
    # tokenizer; `update_from_tokenizer`), whatever a caller passed. They travel with the params to the
    # workers (pickled to tensor-parallel ranks); an init field so that `dataclasses.replace` keeps them.
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)
    # An embedding request's pooling (`PoolingParams.as_sampling_params`): it samples nothing.
    _pooling: PoolingParams | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list(self.stop, "stop")
        self.stop_token_ids = _as_list(self.stop_token_ids, "stop_token_ids")
        if self.logit_bias is not None:
            self.logit_bias = _as_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list(self.allowed_token_ids, "allowed_token_ids")
        if self.bad_words is not None:
            self.bad_words = _as_list(self.bad_words, "bad_words")
        if _is_int(self.top_k) and self.top_k == 0:  # vLLM's "disabled", its default since 0.8
            self.top_k = -1
        self._verify()

    @property
    def pooling(self) -> PoolingParams | None:
        """The `PoolingParams` of an embedding request, None for generation."""
        return self._pooling

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def has_count_penalties(self) -> bool:
        """A presence or frequency penalty (both count the output's tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_penalties(self) -> bool:
        return self.has_repetition_penalty or self.has_count_penalties

    @property
    def only_argmax(self) -> bool:
        """Greedy, with nothing read from the logits but their argmax and nothing changed in them: no
        logprobs, penalties or logit controls (min_tokens aside: its bans hold only before its count,
        which the model runner checks a row at a time). A new logit control belongs here too."""
        return (
            self.is_greedy
            and self.logprobs is None
            and not self.has_penalties
            and not self.allowed_token_ids
            and not self.bad_words_token_ids
            and not self.logit_bias
        )

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """Each bad word's token ids, as given and after a space (empty until the engine admits it)."""
        return self._bad_words_token_ids or []

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize the bad words (vLLM's method: the engine calls it at admission). Each word, stripped
        of leading spaces, as it is and after one space; the spaced form where its tokens differ."""
        if not self.bad_words:
            self._bad_words_token_ids = None
            return
        words = [word.lstrip() for word in self.bad_words]
        plain = tokenizer(words, add_special_tokens=False)["input_ids"]
        spaced = tokenizer([" " + word for word in words], add_special_tokens=False)["input_ids"]
        token_ids: list[list[int]] = []
        for word, ids, spaced_ids in zip(self.bad_words, plain, spaced, strict=True):
            if not ids:
                raise InvalidRequestError("bad_words", f"{word!r} is no token of this model's tokenizer")
            token_ids.append(list(ids))
            if spaced_ids and spaced_ids != ids:
                token_ids.append(list(spaced_ids))
        self._bad_words_token_ids = token_ids

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
            if not _is_number(value) or not _is_finite(value):
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
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            "must be an integer >= 1, or None (until the context is full)",
        )
        self._check(
            _is_int(self.min_tokens)
            and self.min_tokens >= 0
            and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
            "min_tokens",
            "must be an integer in [0, max_tokens]",
        )
        self._check(self.seed is None or _is_int(self.seed), "seed", "must be an integer")
        self._check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "detokenize",
            "spaces_between_special_tokens",
        ):  # a string such as "no" would read as true
            self._check(isinstance(getattr(self, name), bool), name, "must be a boolean")
        self._check(  # vLLM's rule and words: a stop string is matched against the text
            self.detokenize or not self.stop,
            "stop",
            "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.",
        )
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
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}",
        )
        self._check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}]",
        )
        self._check(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
            "prompt_logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}]",
        )
        self._check(
            self.truncate_prompt_tokens is None
            or (
                _is_int(self.truncate_prompt_tokens)
                and (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)
            ),
            "truncate_prompt_tokens",
            "must be an integer >= 1, or -1 (as many as leave max_tokens of room in the context)",
        )
        self._check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams",
        )
        self._verify_allowed_token_ids_and_bad_words()

    def _verify_allowed_token_ids_and_bad_words(self) -> None:
        """Types and sizes; that the ids are in the model's vocabulary the engine checks at admission."""
        if self.allowed_token_ids is not None:
            self._check(
                0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS,
                "allowed_token_ids",
                f"must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids, got {len(self.allowed_token_ids)}",
            )
            self._check(
                all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids",
                "must be token ids (integers >= 0)",
            )
        if self.bad_words is not None:
            self._check(
                len(self.bad_words) <= MAX_BAD_WORDS
                and all(isinstance(w, str) and len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words),
                "bad_words",
                f"at most {MAX_BAD_WORDS} strings of at most {MAX_BAD_WORD_CHARS} characters each",
            )
            self._check(
                all(w.strip() for w in self.bad_words), "bad_words", "must not be empty or only spaces"
            )

    @staticmethod
    def _check(ok: bool, name: str, message: str) -> None:
        if not ok:
            raise InvalidRequestError(name, message)


@dataclass
class BeamSearchParams:
    """What `LLM.beam_search` takes, shaped like vLLM's `BeamSearchParams` (its fields, order and
    defaults; vLLM checks none of them, these are checked here as SamplingParams' are, naming the field).

    Each step every live beam is extended by its `2 * beam_width` most likely tokens (HF's and vLLM's
    count: enough that `beam_width` beams go on when up to one candidate per beam is an EOS), so
    `beam_width` is at most half of `logprobs`' limit. `temperature` only picks the one token sampled
    at each step, which joins the candidates where it is not among them; the candidates' logprobs are
    the raw model's, as vLLM's. `length_penalty` divides a beam's cumulative logprob by its length to
    that power when beams of different lengths are ranked. `include_stop_str_in_output` is taken, as
    vLLM's `LLM.beam_search` takes it, and changes nothing offline: `tokens` keep the EOS either way."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        check = SamplingParams._check
        check(
            _is_int(self.beam_width) and 1 <= self.beam_width <= MAX_BEAM_WIDTH,
            "beam_width",
            f"must be an integer in [1, {MAX_BEAM_WIDTH}] (each step asks for 2 * beam_width logprobs)",
        )
        check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            check(isinstance(getattr(self, name), bool), name, "must be a boolean")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            check(_is_number(value) and _is_finite(value), name, f"must be a finite number, got {value!r}")
        check(self.temperature >= 0.0, "temperature", "must be >= 0 (0 means greedy)")

    @classmethod
    def from_request(
        cls, params: SamplingParams, length_penalty: float = 1.0
    ) -> tuple[SamplingParams, BeamSearchParams]:
        """The search a server runs for a request's `params` (the fields it set, the model's defaults for
        the rest: n is the width), and those params cut to what beam search honours (BEAM_SEARCH_FIELDS:
        the model's other defaults, its top_p say, would not apply, nor be traced as if they did)."""
        honoured = SamplingParams(**{name: getattr(params, name) for name in BEAM_SEARCH_FIELDS})
        search = cls(
            beam_width=honoured.n,
            max_tokens=honoured.max_tokens,  # type: ignore[arg-type]  # an int: neither default is None
            ignore_eos=honoured.ignore_eos,
            temperature=honoured.temperature,
            length_penalty=length_penalty,
            include_stop_str_in_output=honoured.include_stop_str_in_output,
        )
        return honoured, search


# The front ends' rule for a request with use_beam_search (our gRPC API's, the KServe v2 / Triton
# adapters'), by SamplingParams' field names. Beam search honours what BeamSearchParams has (n is its
# width) and what only shapes the prompt or the text:
BEAM_SEARCH_FIELDS = (
    "n",
    "temperature",
    "max_tokens",
    "ignore_eos",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)
# Every other field is refused, naming it, when set to anything but the values that leave it off, rather
# than silently ignored: (field, those values; none: any value set is refused). A list or mapping field
# is off empty.
NOT_IN_BEAM_SEARCH: dict[str, tuple[object, ...]] = {
    "top_p": (1.0,),
    "top_k": (0, -1),
    "min_p": (0.0,),
    "repetition_penalty": (1.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "seed": (),
    "min_tokens": (0,),
    "logprobs": (),
    "prompt_logprobs": (),
    "detokenize": (True,),
    "stop": ([],),
    "stop_token_ids": ([],),
    "logit_bias": ({},),
    "allowed_token_ids": ([],),
    "bad_words": ([],),
    "structured_outputs": (),
}


def check_beam_search_field(name: str, value: object, where: str = "") -> None:
    """InvalidRequestError naming `where` (default: `name`) when the SamplingParams field `name`, set to
    `value`, is one beam search would not honour (NOT_IN_BEAM_SEARCH) at a value that changes anything."""
    neutral = NOT_IN_BEAM_SEARCH.get(name)
    if neutral is None or value in neutral:
        return
    why = "beam search (use_beam_search) does not honour it: leave it unset"
    scalar = [v for v in neutral if not isinstance(v, (list, dict))]  # the value to name, if any
    raise InvalidRequestError(where or name, f"{why} (or {json.dumps(scalar[0])})" if scalar else why)


def check_beam_width(n: int, where: str = "n") -> None:
    """With use_beam_search `n` is the beam width: InvalidRequestError naming `where` outside its range."""
    if not (_is_int(n) and 1 <= n <= MAX_BEAM_WIDTH):
        raise InvalidRequestError(
            where, f"is the beam width with use_beam_search: must be in [1, {MAX_BEAM_WIDTH}]"
        )
