"""pagedserve: a gRPC inference backend with a paged KV cache and continuous batching."""

from pagedserve.llm import LLM
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
