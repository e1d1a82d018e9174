"""pagedserve: a gRPC inference backend with a paged KV cache and continuous batching.

`LLM` imports torch (seconds), so it loads on first use: `pagedserve serve` has its signal handlers in
place, and `pagedserve --help` answers, before torch is imported."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from pagedserve.beam_search import BeamSearchOutput, BeamSearchSequence
from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagedserve.llm import LLM

# oneDNN, under torch's CPU linear layers, caches a primitive for each input shape it meets, and ideep
# (between torch and oneDNN) a primitive descriptor: 1,024 of each by default. The engine's steps
# run a new token count nearly every step, and an entry holds 0.1-1 MB (JIT kernels, brgemm
# descriptors), so a server's memory grew with every new step size up to those caps (the tiny test
# model: 30-65 MB per round of 48 requests; pytorch#27971). 128 of each keep the four to six linear
# shapes of 20-30 recent step sizes; a size evicted and met again is re-created (~0.5 ms a shape).
# Both are read once, at oneDNN's first use in the process, so they are set on import, before torch
# runs anything. A value already in the environment wins.
ONEDNN_CACHE_CAPACITY = 128
for _variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_variable, str(ONEDNN_CACHE_CAPACITY))

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
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
