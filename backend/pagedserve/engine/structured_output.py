"""Structured outputs on the engine side: compile a request's constraint (xgrammar), keep one grammar
matcher per sequence, fill each step's token bitmask for the workers, advance matchers with sampled tokens.

The workers only see the bitmask (`SchedulerOutput.grammar_bitmask`, plain numpy data that pickles to
tensor-parallel ranks) and mask the logits with it before sampling (`layers.sampler.apply_token_bitmask`).
A matcher lives as long as its sequence: preemption (swap or recompute) keeps the output tokens, so it
keeps the matcher; a finished or aborted sequence drops it. When the grammar is complete it allows only
the engine's EOS ids, and a sequence whose matcher accepted one ends with finish reason eos, also under
`ignore_eos` (as vLLM ends it): nothing may follow a complete grammar.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedserve.core.scheduler_output import SchedulerOutput
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.sequence import FinishReason, Sequence

if TYPE_CHECKING:  # xgrammar imports transformers (a second): loaded with the first grammar
    import xgrammar

logger = logging.getLogger(__name__)

# xgrammar keeps compiled grammars in a cache keyed by the spec, so the same schema for many requests
# compiles once; bounded as vLLM bounds it (VLLM_XGRAMMAR_CACHE_MB): clients may send endless new ones.
_CACHE_LIMIT_BYTES = 512 * 1024**2
_MAX_COMPILE_THREADS = 8
_MAX_ERROR_CHARS = 500
# xgrammar's errors open with "[12:00:00] /project/cpp/file.cc:123: " and often "Check failed: (...) is false: "
_ERROR_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


class StructuredOutputs:
    """Grammars of the requests with `SamplingParams.structured_outputs`. The compiler (and the
    tokenizer's vocabulary it indexes) is built on the first such request, once per engine: an engine
    that never sees one never imports xgrammar, and a step with no matcher costs one dict check."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the model's: padded rows past the tokenizer's are never allowed
        self._eos_token_ids = sorted(eos_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()  # validate_request compiles off the engine thread
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}  # by sequence id

    def compile(self, params: StructuredOutputsParams | None) -> xgrammar.CompiledGrammar | None:
        """The compiled grammar of a request (None without structured outputs). Raises
        InvalidRequestError naming the field (`structured_outputs.json`, ...) with the compiler's message."""
        if params is None:
            return None
        kind = params.kind
        try:
            grammar = self._compile(params)
        except InvalidRequestError:  # a malformed spec, said before the compiler sees it
            raise
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar raises RuntimeError (and subclasses)
            message = _ERROR_PREFIX.sub("", str(exc)).strip()
            if len(message) > _MAX_ERROR_CHARS:
                message = message[:_MAX_ERROR_CHARS] + "..."
            raise InvalidRequestError(f"structured_outputs.{kind}", f"does not compile: {message}") from None
        if not self._allows_a_first_token(grammar):
            raise InvalidRequestError(f"structured_outputs.{kind}", "matches no text: no token can begin it")
        return grammar

    def _allows_a_first_token(self, grammar: xgrammar.CompiledGrammar) -> bool:
        """Some token is allowed at the start (EOS where the empty text matches). A grammar whose
        language is empty (`root ::= root`, a regex of an empty class) compiles, and would fail its
        request at the first sampled token instead, as the grammar rejecting it."""
        import xgrammar

        bitmask = np.zeros((1, -(-self._vocab_size // 32)), dtype=np.int32)
        xgrammar.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())

    def _compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        compiler = self._get_compiler()
        any_whitespace = not params.disable_any_whitespace
        if params.json is not None:
            if isinstance(params.json, str):
                schema, doc = params.json, _json_or_none(params.json)
            else:
                schema, doc = json.dumps(params.json), params.json
            _refuse_unenforced(doc, "structured_outputs.json")
            return compiler.compile_json_schema(schema, any_whitespace=any_whitespace)
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:  # JSON's string escapes are EBNF's; other characters as they are
            # (ensure_ascii would spell one past U+FFFF as a surrogate pair, two characters to xgrammar)
            choices = (json.dumps(c, ensure_ascii=False) for c in params.choice)
            return compiler.compile_grammar("root ::= " + " | ".join(choices))
        if params.grammar is not None:
            return compiler.compile_grammar(params.grammar)
        if params.structural_tag is not None:
            tag = _structural_tag(params.structural_tag)
            for schema in _tag_schemas(json.loads(tag)):
                _refuse_unenforced(schema, "structured_outputs.structural_tag")
            return compiler.compile_structural_tag(tag)
        if not any_whitespace:  # the built-in JSON grammar has no such option: any object, as a schema
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        return compiler.compile_builtin_json_grammar()

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = self._tokenizer_info(xgrammar)
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=_MAX_COMPILE_THREADS, cache_limit_bytes=_CACHE_LIMIT_BYTES
                )
            return self._compiler

    def _tokenizer_info(self, xgrammar: Any) -> xgrammar.TokenizerInfo:
        """The vocabulary as xgrammar matches it, special tokens left out. `from_huggingface` knows only
        the tokenizer's named special tokens: SmolLM2's `<reponame>`, one of its added special tokens,
        passed for the text "<reponame>", so a grammar `"<" [a-z]+ ">"` was complete with that one token,
        which the detokenizer then skips (the completion read ""). A token with no text is one xgrammar
        never allows (but the stop tokens), as it never allows the rows past the tokenizer's."""
        tokenizer = self._tokenizer
        plain = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self._vocab_size)
        encoded = [""] * self._vocab_size
        for token, token_id in tokenizer.get_vocab().items():
            if token_id < self._vocab_size:
                encoded[token_id] = token
        for token_id, added in tokenizer.added_tokens_decoder.items():
            if added.special and token_id < self._vocab_size:
                encoded[token_id] = ""
        return xgrammar.TokenizerInfo(
            encoded,
            plain.vocab_type,
            vocab_size=self._vocab_size,
            stop_token_ids=self._eos_token_ids,
            add_prefix_space=plain.add_prefix_space,
        )

    # -- matchers, one per sequence ----------------------------------------------------------------

    def add(self, seq_ids: list[str], grammar: xgrammar.CompiledGrammar | None) -> None:
        """A matcher of `grammar` for each sequence (n > 1 siblings each their own, all at the start)."""
        if grammar is None:
            return
        import xgrammar

        for seq_id in seq_ids:
            self._matchers[seq_id] = xgrammar.GrammarMatcher(grammar)

    def remove(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._matchers

    def fill_bitmask(self, output: SchedulerOutput) -> None:
        """Set the step's bitmask: for each scheduled request that samples this step and has a grammar,
        a row for its last token, and with speculative decoding one for each draft: the grammar's
        state after the drafts before it (the matcher accepts them, then rolls them back). Past a
        draft the grammar rejects (or one that ends it), rows repeat the last: the token sampled
        before that draft cannot equal it, so verification never reaches them."""
        if not self._matchers:
            return
        grammar_requests = [r for r in output.scheduled if r.do_sample and r.request_id in self._matchers]
        if not grammar_requests:
            return
        num_rows = sum(1 + r.num_spec_tokens for r in grammar_requests)
        bitmask = np.zeros((num_rows, -(-self._vocab_size // 32)), dtype=np.int32)
        row = 0
        for req in grammar_requests:
            matcher = self._matchers[req.request_id]
            matcher.fill_next_token_bitmask(bitmask, row)
            drafts = req.token_ids[len(req.token_ids) - req.num_spec_tokens :]
            num_accepted = 0
            for i, draft in enumerate(drafts, start=1):
                accepted = matcher.accept_token(draft)
                num_accepted += accepted
                if not accepted or matcher.is_terminated():
                    bitmask[row + i : row + len(drafts) + 1] = bitmask[row + i - 1]
                    break
                matcher.fill_next_token_bitmask(bitmask, row + i)
            if num_accepted:
                matcher.rollback(num_accepted)
            row += 1 + len(drafts)
        output.structured_output_request_ids = [r.request_id for r in grammar_requests]
        output.grammar_bitmask = bitmask

    def advance(self, seq: Sequence) -> FinishReason | None:
        """Feed a running sequence's tokens of this step (one, or with speculative decoding its
        accepted drafts and one) to its matcher. Returns how the grammar ends the sequence: EOS once the
        matcher terminated (it accepted EOS and `ignore_eos` or min_tokens kept the sequence going;
        tokens after that one are dropped), ERROR if it rejected a token (the mask allowed it: never
        expected)."""
        matcher = self._matchers.get(seq.request_id)
        if matcher is None or seq.is_finished:
            return None
        new_token_ids = seq.token_ids[seq.num_tokens - seq.num_new_tokens :]
        for i, token_id in enumerate(new_token_ids):
            if not matcher.accept_token(token_id):
                logger.error(
                    "structured outputs: %s sampled token %d, which its grammar rejects",
                    seq.request_id,
                    token_id,
                )
                return FinishReason.ERROR
            if matcher.is_terminated():
                num_after = len(new_token_ids) - 1 - i
                if num_after:
                    del seq.token_ids[-num_after:]
                    seq.num_new_tokens -= num_after
                return FinishReason.EOS
        return None


# -- JSON schema keywords the compiler does not enforce ------------------------------------------------

# xgrammar (0.2.9) compiles these without enforcing them, so the output breaks the schema it was promised
# (allOf [string, maxLength 3] wrote a number; uniqueItems repeated items; contains allowed only []).
# vLLM's xgrammar backend refuses such schemas too ("features not supported by xgrammar").
_UNENFORCED: tuple[str, ...] = ("uniqueItems", "contains", "minContains", "maxContains", "not", "then")
_UNENFORCED += ("else", "dependentRequired", "dependentSchemas", "patternProperties")
# beside a $ref, only these: the compiler reads the reference and drops the other keywords
_REF_SIBLINGS = {"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description"}
_REF_SIBLINGS |= {"default", "examples", "deprecated", "readOnly", "writeOnly"}
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS: tuple[str, ...] = ("items", "additionalProperties", "unevaluatedProperties", "additionalItems")
_SUBSCHEMAS += ("unevaluatedItems", "contains", "not", "if", "then", "else", "propertyNames")


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # the compiler says what is wrong with it
        return None


def _refuse_unenforced(schema: Any, field: str) -> None:
    """InvalidRequestError naming `field`, the keyword and where it sits, for a schema the compiler
    would not enforce (a `uniqueItems`, an `allOf` of several schemas, a remote `$ref`, ...)."""
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        problem = _unenforced(node)
        if problem is not None:
            raise InvalidRequestError(
                field, f"{problem} (at {where}) is not supported: the grammar compiler would not enforce it"
            )
        for key in _SUBSCHEMAS:
            stack.append((node.get(key), f"{where}/{key}"))
        for key in _SUBSCHEMA_LISTS + ("items",):
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{where}/{key}/{i}") for i, sub in enumerate(node[key]))
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{where}/{key}/{name}") for name, sub in node[key].items())


def _unenforced(node: dict[str, Any]) -> str | None:
    """The keyword of this (sub)schema the compiler would drop, if any."""
    for key in _UNENFORCED:
        if key in node and not (key == "uniqueItems" and node[key] is False):
            return key
    if "multipleOf" in node and node.get("type") != "integer":  # enforced on integers alone
        return "multipleOf on a type but integer"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "allOf of more than one schema"
    if "$ref" in node:
        if not (isinstance(node["$ref"], str) and node["$ref"].startswith("#")):
            return "a $ref outside the schema"
        siblings = sorted(set(node) - _REF_SIBLINGS)
        if siblings:
            return f"{siblings[0]} beside $ref"
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        return "minLength or maxLength beside a pattern or format"
    return None


def _tag_schemas(doc: Any) -> list[Any]:
    """The JSON schemas in a structural tag's format: `{"type": "json_schema", "json_schema": {...}}`."""
    found, stack = [], [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                found.append(node["json_schema"])
            else:
                stack.extend(node.values())
    return found


# -- structural tags ---------------------------------------------------------------------------------


def _structural_tag(text: str) -> str:
    """A structural tag in xgrammar's current form, `{"type": "structural_tag", "format": {...}}`, from
    either form vLLM takes: that one, passed as is, or the classic one (vLLM takes it wherever
    "structures" is a key), turned into the `triggered_tags` format it stands for, as xgrammar's own
    (deprecated) conversion turns it. That conversion answers a missing key with a pydantic trace, and
    the compiler a JSON error with its source line: the shape is checked here, naming where it is wrong."""
    try:
        doc = json.loads(text)
    except RecursionError:
        raise _bad_tag("not JSON: nested too deeply") from None
    except ValueError as exc:
        raise _bad_tag(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise _bad_tag(f'must be a JSON object {{"type": "structural_tag", ...}}, got {type(doc).__name__}')
    if "structures" not in doc:
        if "format" not in doc:
            raise _bad_tag(
                'needs "format" (xgrammar\'s form) or "structures" and "triggers" (the classic form)'
            )
        return text
    return json.dumps({"type": "structural_tag", "format": _triggered_tags(doc)})


def _triggered_tags(doc: dict[str, Any]) -> dict[str, Any]:
    """The classic form's format: free text until one of the triggers, then the structure whose begin it
    starts; after that structure's end, free text again."""
    structures, triggers = doc["structures"], doc.get("triggers")
    if not isinstance(structures, list) or not all(isinstance(s, dict) for s in structures):
        raise _bad_tag('"structures" must be a list of {"begin": ..., "schema": ..., "end": ...} objects')
    if not isinstance(triggers, list) or not all(isinstance(t, str) for t in triggers):
        raise _bad_tag('"triggers" must be a list of strings, each the start of some structure\'s "begin"')
    tags = [_tag(structure, f"structures[{i}]") for i, structure in enumerate(structures)]
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}


def _tag(structure: dict[str, Any], where: str) -> dict[str, Any]:
    for key, kind in (("begin", str), ("schema", dict), ("end", str)):
        if key not in structure:
            raise _bad_tag(f'{where}: needs "{key}"')
        if not isinstance(structure[key], kind):
            raise _bad_tag(
                f'{where}: "{key}" must be {"a JSON schema object" if kind is dict else "a string"}'
            )
    schema = {"type": "json_schema", "json_schema": structure["schema"]}
    return {"type": "tag", "begin": structure["begin"], "content": schema, "end": structure["end"]}


def _bad_tag(message: str) -> InvalidRequestError:
    return InvalidRequestError("structured_outputs.structural_tag", message)
