"""Speculative decoding by n-gram lookup (vLLM's `speculative_config` method "ngram", also called prompt
lookup decoding): a decoding sequence whose last n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) occurred earlier in its prompt or output proposes the tokens that followed that
occurrence as drafts, up to `num_speculative_tokens`. One step runs the last token and the drafts
together, and the sampler draws a token at each of their positions as it would have one step at a
time; the drafts are accepted while each equals the token drawn at its position, and the first draw
that differs (or the draw after the last draft) follows them. So outputs are those of decoding
without drafts, greedy or sampled, seeded or not (a seeded request draws the same tokens); a step
gives one token and up to `num_speculative_tokens` more where the text repeats itself (quoting,
code edits, extraction, lists). Torch-free: settings parse the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedserve.json_setting import parse_json_object

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    method: str = "ngram"
    # no drafts while more requests than this are in the engine (running, waiting or swapped): under
    # load a step is busy with other sequences' tokens, and rejected drafts cost it throughput
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From `--speculative-config`'s JSON object (its text, or a dict); ValueError naming
        `speculative_config` and the key."""
        if value is None:
            return None
        value = parse_json_object(value, "speculative_config", "speculative decoding settings")
        known = (
            "method",
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "disable_by_batch_size",
        )
        for key in value:
            if key not in known:
                raise ValueError(f"speculative_config: unknown key {key!r} (known: {', '.join(known)})")
        method = value.get("method", "ngram")
        if method not in METHODS:
            raise ValueError(
                f"speculative_config: method {method!r} is not supported ({', '.join(METHODS)} is: "
                "drafts from the sequence's own tokens, no draft model)"
            )
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        num_tokens = _int(value, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        # as vLLM: one of the lookup sizes given alone sets the other (one n-gram size)
        lookup_min = _int(value, "prompt_lookup_min", 1, 64) if "prompt_lookup_min" in value else None
        lookup_max = _int(value, "prompt_lookup_max", 1, 64) if "prompt_lookup_max" in value else None
        if lookup_max is None:
            lookup_max = cls.prompt_lookup_max if lookup_min is None else lookup_min
        elif lookup_min is None:
            lookup_min = lookup_max
        if lookup_min is None:
            lookup_min = cls.prompt_lookup_min
        if lookup_min > lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min {lookup_min} exceeds prompt_lookup_max {lookup_max}"
            )
        disable_by_batch_size = None
        if value.get("disable_by_batch_size") is not None:
            disable_by_batch_size = _int(value, "disable_by_batch_size", 1, 2**31)
        return cls(num_tokens, lookup_max, lookup_min, method, disable_by_batch_size)

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` (and `num_speculative_tokens`) tokens that followed the latest earlier
        occurrence of the longest suffix of `token_ids` (of `prompt_lookup_min` to `prompt_lookup_max`
        tokens) found; none where no such suffix occurred before."""
        max_drafts = min(max_drafts, self.num_speculative_tokens)
        if max_drafts <= 0 or len(token_ids) <= self.prompt_lookup_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Every earlier occurrence of a suffix ends where the last token occurred before (one pass over
        # the tokens); each such end then extends its match backwards, all of them a token at a time.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if not ends.size:
            return []
        lengths = np.ones(ends.size, dtype=np.int64)  # the suffix length matched at each end
        matching = np.ones(ends.size, dtype=bool)
        for k in range(1, min(self.prompt_lookup_max, len(tokens) - 1)):
            before = ends - k
            matching &= (before >= 0) & (tokens[np.maximum(before, 0)] == tokens[-1 - k])
            if not matching.any():
                break
            lengths += matching
        longest = int(lengths.max())
        if longest < self.prompt_lookup_min:
            return []
        start = int(ends[np.flatnonzero(lengths == longest)[-1]]) + 1  # the latest of the longest
        return token_ids[start : start + max_drafts]


def _int(value: dict[str, Any], key: str, low: int, high: int, default: int | None = None) -> int:
    number = value.get(key, default)
    if isinstance(number, bool) or not isinstance(number, int) or not low <= number <= high:
        raise ValueError(f"speculative_config: {key} must be an integer in [{low}, {high}], got {number!r}")
    return number
