"""Incremental detokenization with stop strings.

Text is produced by decoding a small window of tokens and emitting only what became stable: a
window whose text ends in U+FFFD is an incomplete UTF-8 sequence (a multi-byte character split
across tokens) and waits for the next token. With stop strings, the last `len(longest stop) - 1`
characters are held back until they cannot be the start of a stop string.
"""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output, for correct leading spaces


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all output text so far (cut at a stop string)
        self.num_emitted = 0  # characters of `text` already returned

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string hit, if any (then `text` ends at it)."""
        self.token_ids.extend(new_token_ids)
        start = len(self.text)
        self.text += self._decode_new()
        for stop in self.stop:
            index = self.text.find(stop, max(0, start - len(stop) + 1))
            if index != -1:
                self.text = self.text[: index + len(stop) if self.include_stop else index]
                return stop
        return None

    def flush(self) -> None:
        """At the end of generation: add text still waiting for more bytes (as U+FFFD, like decode())."""
        self.text += self._decode_new(final=True)

    def take_delta(self, finished: bool) -> str:
        """New text since the last call; holds back a possible stop-string prefix until finished."""
        end = len(self.text) if finished else max(self.num_emitted, len(self.text) - self.hold_back)
        delta = self.text[self.num_emitted : end]
        self.num_emitted = end
        return delta

    def _decode_new(self, final: bool = False) -> str:
        decode = self.tokenizer.decode
        prefix = decode(
            self.token_ids[self.prefix_offset : self.read_offset],
            skip_special_tokens=self.skip_special_tokens,
        )
        full = decode(self.token_ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if (full.endswith("\ufffd") and not final) or len(full) <= len(prefix):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full[len(prefix) :]
