"""Per-request embedding parameters (vLLM's `PoolingParams` for the embed task), validated once."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import SamplingParams, _is_int

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """How an embedding request turns its prompt into one vector: the final-normed hidden states
    (the model's last layer, as Hugging Face's `last_hidden_state`) of its last token (`"last"`, vLLM's
    default for decoder models) or their mean over every prompt token (`"mean"`: such a request takes
    no prefix-cache hits, as every position must run), scaled to unit L2 norm unless `normalize` is
    False. `truncate_prompt_tokens` keeps the prompt's last k tokens, -1 as many as the context holds.

    An embedding request runs its prompt through the same batches as generation and samples nothing:
    it ends, with its vector, in the step that computes its last prompt token."""

    pooling: str = "last"
    normalize: bool = True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise InvalidRequestError(
                "pooling", f"must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}"
            )
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError("normalize", f"must be a bool, got {type(self.normalize).__name__}")
        k = self.truncate_prompt_tokens
        if k is not None and not (_is_int(k) and (k == -1 or k >= 1)):
            raise InvalidRequestError(
                "truncate_prompt_tokens", "must be an integer >= 1, or -1 (as many as the context holds)"
            )

    def as_sampling_params(self) -> SamplingParams:
        """What the engine runs: one step past the prompt at most, nothing sampled (the pooling
        rides along in the parameters to the scheduler, the block manager and the workers)."""
        return SamplingParams(
            temperature=0.0, max_tokens=1, truncate_prompt_tokens=self.truncate_prompt_tokens, _pooling=self
        )
