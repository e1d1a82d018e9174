"""Incremental detokenization with stop strings.

Text is produced by decoding a small window of tokens and emitting only what became stable: a
window whose text ends in U+FFFD is an incomplete UTF-8 sequence (a multi-byte character split
across tokens) and waits for the next token. The text is always `decode(output ids)` cut where
generation first completes a stop string. When streaming, the last `len(longest stop) - 1`
characters are held back until they cannot be the start of a stop string that would cut them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output, for correct leading spaces
_REPLACEMENT_CHAR = "\ufffd"  # what decode() makes of an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
        min_tokens: int = 0,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._rust_decode = _rust_decode(tokenizer)
        self.token_ids = self._prompt_context(prompt_token_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens  # stop strings completed within the first min_tokens do not count
        self.num_output_tokens = 0
        # A stop string kept in the output never cuts text before its end, which is in the newest text:
        # then nothing already decoded can be taken back, and nothing needs holding back (as in vLLM).
        self.hold_back = max(len(s) for s in stop) - 1 if stop and not include_stop_str_in_output else 0
        self.text = ""  # all output text so far (cut at a stop string)
        self.num_emitted = 0  # characters of `text` already returned

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Add tokens; returns the stop string hit, if any (then `text` ends at it). `stop_terminated`:
        the last token ended the sequence as EOS or a stop token id; like vLLM, its text is left out
        unless `include_stop_str_in_output`."""
        if stop_terminated and not self.include_stop:
            new_token_ids = new_token_ids[:-1]
        for token_id in new_token_ids:  # one at a time: min_tokens counts tokens, not steps
            self.token_ids.append(token_id)
            self.num_output_tokens += 1
            stop = self._append(self._decode_new())
            if stop is not None:
                return stop
        return None

    def flush(self) -> str | None:
        """At the end of generation: add text still waiting for more bytes (as U+FFFD, like decode()).
        That text can complete a stop string too: returns it, if any."""
        return self._append(self._decode_new(final=True))

    def take_delta(self, finished: bool) -> str:
        """New text since the last call; holds back a possible stop-string prefix until finished."""
        end = len(self.text) if finished else max(self.num_emitted, len(self.text) - self.hold_back)
        delta = self.text[self.num_emitted : end]
        self.num_emitted = end
        return delta

    def _append(self, new_text: str) -> str | None:
        start = len(self.text)
        self.text += new_text
        if not new_text or self.num_output_tokens <= self.min_tokens:
            return None
        return self._cut_at_stop(start)

    def _cut_at_stop(self, start: int) -> str | None:
        """Cut `text` at the stop string that ends first in the text added at `start` (ties: the first
        listed): where generation would have stopped had each character been its own token. Every
        earlier end was searched before, so only matches ending after `start` are looked for."""
        first: tuple[int, str] | None = None  # (end, stop string)
        for stop in self.stop:
            index = self.text.find(stop, max(0, start - len(stop) + 1))
            if index != -1 and (first is None or index + len(stop) < first[0]):
                first = (index + len(stop), stop)
        if first is None:
            return None
        end, stop = first
        self.text = self.text[: end if self.include_stop else end - len(stop)]
        return stop

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's last tokens, less any that end it inside a character: the output's first bytes
        would complete that character, and the text would no longer be decode(output ids)."""
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        while context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context.pop()
        return context

    def _decode_new(self, final: bool = False) -> str:
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if (full.endswith(_REPLACEMENT_CHAR) and not final) or len(full) <= len(prefix):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full[len(prefix) :]

    def _decode(self, token_ids: list[int]) -> str:
        if self._rust_decode is not None:  # (fast tokenizers ignore spaces_between_special_tokens)
            return self._rust_decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        return decode_ids(
            self.tokenizer, token_ids, self.skip_special_tokens, self.spaces_between_special_tokens
        )


def decode_ids(
    tokenizer: Any,
    token_ids: list[int],
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool = True,
) -> str:
    """The tokenizer's decode with vLLM's flags. `spaces_between_special_tokens` is passed only when
    False: True was the default where transformers used it (its slow tokenizers, before transformers 5);
    its fast ones ignore it, as the `tokenizers` library has no such option; and a decode that refuses
    unknown keywords (mistral-common's) still works for every request that leaves it at True."""
    spaces = {} if spaces_between_special_tokens else {"spaces_between_special_tokens": False}
    return str(tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, **spaces))


def _rust_decode(tokenizer: Any) -> Callable[..., str] | None:
    """The `tokenizers` library's decode under a transformers tokenizer, where transformers adds nothing
    to it (its own decode, not a subclass's, and no clean-up of spaces): two calls a token, each ~1.8 us
    through transformers and ~0.5 us direct. None for any other tokenizer."""
    import tokenizers  # here, not at import: importing the engine does not import transformers
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    backend = getattr(tokenizer, "_tokenizer", None)
    plain = (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and type(tokenizer).decode is PreTrainedTokenizerBase.decode
        and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    )
    return backend.decode if plain and isinstance(backend, tokenizers.Tokenizer) else None
