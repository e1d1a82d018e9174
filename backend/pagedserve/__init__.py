"""pagedserve: a gRPC inference backend with a paged KV cache and continuous batching.

`LLM` imports torch (seconds), so it loads on first use: `pagedserve serve` has its signal handlers in
place, and `pagedserve --help` answers, before torch is imported."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagedserve.llm import LLM

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pagedserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
