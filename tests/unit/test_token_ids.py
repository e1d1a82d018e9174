"""`TokenIds`, a request's token ids as the model runner keeps them for penalties and bad words: one
numpy array that grows as tokens come, where a step's unaccepted drafts are dropped and replaced. Held
against a Python list doing the same (`del ids[start:]`, then `extend`)."""

from __future__ import annotations

import numpy as np
from pagedserve.worker.model_runner import TokenIds


def test_token_ids_follow_a_list_through_growth_and_dropped_drafts() -> None:
    rng = np.random.default_rng(7)
    kept, expected = TokenIds(), []
    for step in range(400):
        # Mostly one token a step; sometimes a prompt chunk or drafts; sometimes drafts dropped.
        start = (
            len(expected) - int(rng.integers(0, 4)) if step % 7 == 3 else len(expected) + int(step % 11 == 5)
        )
        ids = [int(x) for x in rng.integers(0, 50_000, size=int(rng.choice([1, 1, 3, 130])))]
        kept.replace_from(start, ids)
        del expected[start:]
        expected.extend(ids)
        assert kept.span(0, 1 << 30).tolist() == expected
        a, b = sorted(int(x) for x in rng.integers(0, len(expected) + 5, size=2))
        assert kept.span(a, b).tolist() == expected[a:b]


def test_a_span_is_int64_and_empty_ids_add_nothing() -> None:
    kept = TokenIds()
    kept.replace_from(0, [])
    assert kept.span(0, 10).dtype == np.int64 and kept.span(0, 10).size == 0
    kept.replace_from(0, [3, 4, 5])
    kept.replace_from(3, [])
    assert kept.span(0, 10).tolist() == [3, 4, 5]
    kept.replace_from(1, [])  # drafts dropped with nothing after them
    assert kept.span(0, 10).tolist() == [3]
