"""Drafts for speculative decoding tests whatever the model: an n-gram lookup rarely matches a tiny
random model's text, so these tests replace `SpeculativeConfig.propose` with an oracle that drafts a
reference run's next tokens, every third one wrong, so that steps both accept and reject drafts.

Kept out of conftest.py so tests import it by a name no other folder's conftest shares.
"""

from __future__ import annotations

from collections.abc import Callable

VOCAB_SIZE = 49152


def oracle_proposer(
    reference: list[tuple[list[int], list[int]]],
) -> Callable[[object, list[int], int], list[int]]:
    """A `propose` drafting, for a sequence that starts with a reference prompt, the next tokens of
    that prompt's reference output (at most 3), the third one off by one."""

    def propose(self: object, token_ids: list[int], max_drafts: int) -> list[int]:
        for prompt, output in reference:
            if token_ids[: len(prompt)] == prompt:
                done = len(token_ids) - len(prompt)
                drafts = output[done : done + min(max_drafts, 3)]
                return [(t + 1) % VOCAB_SIZE if i == 2 else t for i, t in enumerate(drafts)]
        return []

    return propose
