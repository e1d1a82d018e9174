"""Turns a `SchedulerOutput` into one batched forward pass and a sample per finishing request.

Keeps per-request state across steps (block-table row, sampling params, token counts), so the
scheduler sends only what changed. Input metadata is built with numpy array operations over the whole
batch: no Python loop runs over tokens or blocks.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import torch
from pagedserve_kernels import cpu as cpu_kernels

from pagedserve.config import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagedserve.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    make_attention_backend,
    step_metadata,
)
from pagedserve.layers.chunked import chunk_prefills
from pagedserve.layers.linear import LinearBase, can_pack_weights, packed_before_compiling
from pagedserve.layers.moe import SparseMoeBlock
from pagedserve.layers.recurrent import ConvWindows, RecurrentStep, conv_windows
from pagedserve.layers.sampler import Sampler, SamplerOutput, SamplingTensors, apply_token_bitmask
from pagedserve.lora import LoRAModels
from pagedserve.models import llama
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.loader import checkpoint_tensors
from pagedserve.models.registry import get_model_class
from pagedserve.outputs import Logprob, TokenLogprobs
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker import huge_pages
from pagedserve.worker.cuda_graphs import CudaGraphs, Forward
from pagedserve.worker.fused_decode import FusedDecode

if TYPE_CHECKING:  # torch._dynamo imports triton.language: not at import time (tests/kernels/conftest.py)
    from torch._dynamo.types import GuardFilterEntry

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

# Prompt logprobs run the LM head over every prompt position of a chunk (2,048 by default): a slice
# of at most this many logits at a time (2**23 float32 values, 32 MiB; 170 rows of a 49,152-token
# vocabulary) bounds the memory to about three such tensors (the logits, their float32 copy, the
# log_softmax; the CPU kernel writes only the logits), whatever the chunk's length.
PROMPT_LOGPROBS_SLICE_ELEMENTS = 2**23


class TokenIds:
    """A request's token ids so far in one numpy array that doubles as it fills: a step's penalties copy
    each row's output ids as one slice, not as Python ints one by one (64 rows of 100-500 output ids
    walked as lists took ~0.8 ms a step, the slices ~0.1 ms)."""

    def __init__(self) -> None:
        self._ids = np.empty(0, np.int64)
        self._length = 0

    def replace_from(self, start: int, ids: list[int]) -> None:
        """Drops the ids from `start` on (drafts a step did not accept) and appends `ids` after the rest."""
        start = min(start, self._length)
        end = start + len(ids)
        if end > len(self._ids):
            grown = np.empty(max(end, 2 * len(self._ids), 64), np.int64)
            grown[:start] = self._ids[:start]
            self._ids = grown
        self._ids[start:end] = ids
        self._length = end

    def span(self, start: int, end: int) -> np.ndarray:
        """Ids start .. end - 1 (a view: valid until the next `replace_from`)."""
        return self._ids[start : min(end, self._length)]


@dataclass
class RequestState:
    row: int  # row of the persistent block table
    params: SamplingParams
    num_prompt_tokens: int
    num_tokens: int = 0  # tokens fed to the model so far
    num_blocks: int = 0
    token_ids: TokenIds = field(default_factory=TokenIds)  # kept only when penalties or bad words need it
    prompt_ids: torch.Tensor | None = None  # the prompt on the device, once penalties have read it
    allowed_ids: torch.Tensor | None = None  # params.allowed_token_ids on the device, made once
    bad_words: BadWords | None = None  # built on the request's first sample, where it has bad words
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (token ids, biases), on the device
    lora_index: int = -1  # its LoRA adapter's index in `ModelRunner.lora` (-1: the base model)
    argmax_only: bool = field(init=False)  # `params.only_argmax`, read for every row of every step

    def __post_init__(self) -> None:
        self.argmax_only = self.params.only_argmax

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def keeps_token_ids(self) -> bool:
        return self.params.has_penalties or bool(self.params.bad_words_token_ids)


@dataclass
class SampleRow:
    """A position a token is sampled at: a request's last, and with speculative decoding each of its
    drafts' (row i samples the token draft i is checked against, as if drafts 0 .. i - 1 were its
    tokens already). Every control that reads the request's tokens so far (penalties, bad words,
    min_tokens, the seed's output index) reads the row's."""

    request_id: str
    state: RequestState
    num_tokens: int  # the request's tokens this row's position closes

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.state.num_prompt_tokens

    @property
    def argmax_only(self) -> bool:
        """`SamplingParams.only_argmax`, and past min_tokens (before it, EOS and stop ids are banned)."""
        return self.state.argmax_only and self.num_output_tokens >= self.state.params.min_tokens

    @property
    def output_token_ids(self) -> np.ndarray:
        """Kept only where penalties or bad words need them (`RequestState.keeps_token_ids`)."""
        return self.state.token_ids.span(self.state.num_prompt_tokens, self.num_tokens)


@dataclass
class BadWords:
    """A request's bad words as each step bans them: the one-token words always; the last token of a
    longer one where the output ends with the rest of it, looked up by the output's last token (a step
    reads only the words that token could continue, not all of them, as vLLM does)."""

    always: list[int]
    by_last_token: dict[int, list[list[int]]]  # prefix's last token -> the words (their whole ids)

    @classmethod
    def build(cls, bad_words_token_ids: list[list[int]]) -> BadWords:
        """Indexes the request's own lists, copying none: each sequence of a request builds its own
        (n siblings, n builds), and copies of 2,048 long words took 43 ms a sequence, on the thread
        that steps everyone (n = 128: 5.5 s)."""
        words = cls([], {})
        for ids in bad_words_token_ids:
            if len(ids) == 1:
                words.always.append(ids[0])
            else:
                words.by_last_token.setdefault(ids[-2], []).append(ids)
        return words

    def banned(self, output_token_ids: np.ndarray) -> list[int]:
        n = len(output_token_ids)
        if not n:
            return self.always
        words = self.by_last_token.get(int(output_token_ids[-1]), ())
        return self.always + [
            ids[-1]
            for ids in words
            if len(ids) - 1 <= n and output_token_ids[n - len(ids) + 1 :].tolist() == ids[:-1]
        ]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _guards_but_the_model_tree(entries: list[GuardFilterEntry]) -> list[bool]:
    """Which of dynamo's guards the compiled forward pass keeps: all but those on the model's module
    tree (types, hook dicts, attributes: ~4,700 of ~4,900, 0.5 of the 0.7 ms a step they took).
    Nothing changes a model after it is compiled, so those guards could only fail for another model,
    and another model never runs this one's graphs: each compiles a forward of its own
    (`_of_its_own`)."""
    return [not entry.name.startswith("self.") for entry in entries]


def _of_its_own(function: F) -> F:
    """A copy of `function` with a code object of its own. Dynamo keeps a function's compiled graphs on
    its code object and compiles at most `torch._dynamo.config.recompile_limit` (8) of them: every
    engine's model gets graphs of its own (its own weights, frozen or as inputs), so with the class's
    one `forward` the ninth engine built in a process ran eagerly (and slowly) after a warning."""
    assert isinstance(function, types.FunctionType)
    own = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    return cast(F, own)


def _release_compiled(code: types.CodeType, modules: list[types.ModuleType]) -> None:
    """Free what a compiled forward pass holds once its model is gone: dynamo's graphs on the model's
    own code object, and the modules inductor generated for it with the frozen weights as attributes,
    which `sys.modules` and inductor's module cache keep for the life of the process (~600 MB for the
    default model, every compiled engine built and dropped in a process). Modules inductor caches
    by their source alone (no weights) may serve another engine: they stay."""
    import sys

    from torch._dynamo.eval_frame import reset_code
    from torch._inductor.codecache import PyCodeCache

    reset_code(code)
    shared = {id(module) for module in PyCodeCache.modules_no_attr.values()}
    for module in modules:
        if id(module) in shared:
            continue
        if sys.modules.get(module.__name__) is module:
            del sys.modules[module.__name__]
        with contextlib.suppress(ValueError):
            PyCodeCache.modules.remove(module)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, eos_token_ids: frozenset[int], backend: AttentionBackend | None = None
    ) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.model.dtype)
        self.block_size = config.cache.block_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.vocab_size = config.model.vocab_size
        self.backend = backend or make_attention_backend(config.attention_backend, self.device)
        self.lora: LoRAModels | None = None  # the adapters of --lora-modules, set by _load_model
        self.model = self._load_model()
        self.attention_layers = self.model.attention_layers  # in order, for `step_metadata`
        self.forward: Forward = self.model
        self.fused_decode: FusedDecode | None = None  # set with the KV cache (`bind_kv_cache`)
        self.cuda_graphs: CudaGraphs | None = None  # likewise, where config.cuda_graphs
        # whether the compiled pass froze the weights into its graph (`_compile`): `_freezes_weights`
        # reads False once the weights left to inductor are packed after it
        self.frozen_weights = False
        max_seqs = config.scheduler.max_num_seqs
        # layers with a state per request (LFM2's, Mamba2's), a row of it for each block-table row
        self.recurrent_layers = self.model.recurrent_layers
        if self.recurrent_layers:
            self._bind_states(max_seqs)
        self.conv_widths = sorted({layer.width for layer in self.recurrent_layers})
        # chunked attention's chunk sizes (Llama 4's), each step's prefills cut at their boundaries
        self.attention_chunks = sorted({attn.chunk for attn in self.attention_layers if attn.chunk})
        self.max_blocks_per_seq = -(-config.model.max_model_len // self.block_size)
        self.block_tables = torch.zeros(max_seqs, self.max_blocks_per_seq, dtype=torch.int32)
        self.free_rows = list(range(max_seqs - 1, -1, -1))
        self.requests: dict[str, RequestState] = {}
        # requests owing prompt logprobs -> their prompts; empty (no per-step work) when none asks
        self.prompt_token_ids: dict[str, list[int]] = {}
        self.pooling_request_ids: set[str] = set()  # embedding requests: empty (no work) when none
        # The last step's padded prompts (for repetition penalties) and the prompt tensors they pad:
        # the batch's rows stay the same for most steps.
        self._last_prompts: tuple[list[torch.Tensor], torch.Tensor] | None = None
        on_cpu_kernels = self.device.type == "cpu" and cpu_kernels.load()
        self.sampler = Sampler(
            config.seed,
            self.device,
            # greedy sampling's argmax, random rows' inversion and draws straight from the logits in
            # the C++ CPU kernels, where they build (else torch's)
            cpu_kernels.argmax_rows if on_cpu_kernels else None,
            cpu_kernels.invert_rows if on_cpu_kernels else None,
            cpu_kernels.sample_rows if on_cpu_kernels else None,
            cpu_kernels.logprob_rows if on_cpu_kernels else None,  # and logprobs, computed as read
        )

    def _load_model(self) -> LlamaForCausalLM:
        cfg = self.config.model
        with torch.device(self.device), _default_dtype(self.dtype):
            model = get_model_class(cfg.architecture)(cfg.hf_config, cfg.max_model_len, self.backend)
        model.load_weights(checkpoint_tensors(cfg.path, cfg.hf_config))
        # beside the Triton kernels (GPUs) the experts run in one, from stacked weights, and read
        # nothing back to the host: CUDA graphs capture their decode steps (`layers.moe`)
        if self.backend.name == "triton":
            for block in [m for m in model.modules() if isinstance(m, SparseMoeBlock)]:
                block.stack_experts()
        if self.config.lora_modules:  # before packing: the adapters are sliced beside the plain weights
            self.lora = LoRAModels(self.config.lora_modules, model, self.dtype)
        # A compiled pass reads the weights packed before it is traced, or leaves them to inductor
        # until it is compiled (`bind_kv_cache`); the LM head runs outside it.
        before = not self.config.compile or packed_before_compiling(self.device, self.dtype)
        self._pack_weights(model.modules() if before else [model.lm_head])
        return model.eval()

    def _bind_states(self, max_seqs: int) -> None:
        """A state for each of max_num_seqs requests in every recurrent layer, refused (ValueError naming
        max_num_seqs) where it would take more than half the device's free memory: the KV cache and
        the step's activations need the rest."""
        needed = sum(layer.state_bytes(max_seqs) for layer in self.recurrent_layers)
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        else:
            import psutil

            free = psutil.virtual_memory().available
        if needed > free / 2:
            raise ValueError(
                f"max_num_seqs: {max_seqs} requests' recurrent state ({len(self.recurrent_layers)} layers) "
                f"needs {needed / 2**30:.1f} GiB, more than half the {free / 2**30:.1f} GiB free; lower "
                "--max-num-seqs"
            )
        for layer in self.recurrent_layers:
            layer.bind_state(max_seqs)
        logger.info(
            "recurrent state of %d layers: %.1f MiB for max_num_seqs (%d) requests",
            len(self.recurrent_layers),
            needed / 2**20,
            max_seqs,
        )

    def _pack_weights(self, modules: Iterable[torch.nn.Module]) -> None:
        """Pack the linear weights of `modules` not packed yet, where packing pays (`layers.linear`)."""
        if not can_pack_weights(self.device, self.dtype):
            return
        packed: list[Any] = []  # modules: LinearBase and ParallelLMHead
        for module in modules:
            if hasattr(module, "pack_weights") and module.packed_weight is None:
                module.pack_weights(self.config.scheduler.max_num_seqs)
                packed.append(module)
        # Every decode step streams these: in huge pages they cost no TLB miss every 4 KiB. oneDNN's
        # opaque tensors (a layout of their own) stay where oneDNN put them.
        moved = [module for module in packed if module.packed_weight.layout == torch.strided]
        for module, copy in zip(moved, huge_pages.copy_to_huge_pages([m.packed_weight for m in moved])):
            module.packed_weight = copy

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for attention, (keys, values) in zip(self.model.attention_layers, kv_caches, strict=True):
            # (each layer's view of its entries, in heads of its own size: Gemma 4's differ by layer)
            shape = (*keys.shape[:2], attention.num_kv_heads, -1)
            attention.kv_cache = (keys.view(shape), values.view(shape))
        if self.config.compile:
            self.forward = self._compile()
            # Where the weights were left to inductor, its frozen graph holds packed copies of its
            # own and no longer reads the plain ones: they are packed (and released) now, for
            # decode_layers.
            self._pack_weights(self.model.modules())
        # Decode-only steps skip the forward pass, compiled or eager, where one C++ call runs every
        # layer (`fused_decode`), which reads the packed weights.
        self.fused_decode = FusedDecode.build(self.model, self.backend, self.dtype)
        blocks = [m for m in self.model.modules() if isinstance(m, SparseMoeBlock)]
        if self.config.cuda_graphs and any(block.w13 is None for block in blocks):
            # (experts the Triton kernel does not take, Nemotron 3's ungated ones, read how many rows
            # each gets on the host: no graph can capture that)
            logger.info("experts run one by one (not in the fused kernel): decode steps run eager")
        elif self.config.cuda_graphs:
            logger.info(
                "decode steps replay CUDA graphs, each captured at its first step (batch size, context)"
            )
            self.cuda_graphs = CudaGraphs(
                self.forward,
                self.device,
                self.config.scheduler.max_num_seqs,
                self.max_blocks_per_seq,
                self.block_size,
            )

    def _freezes_weights(self) -> bool:
        """Whether the compiled pass makes the weights graph constants ("freezing"): where a linear
        layer's weight was left to inductor (`layers.linear.packed_before_compiling`), which then
        packs it for oneDNN, as it does only for constants (float32 on Intel's CPUs, bfloat16 where
        AVX512-BF16 panels or nothing of ours packs it). It costs every start: torch keeps frozen
        graphs out of its on-disk AOTAutograd cache, and inductor's oneDNN constants out of its
        graph cache, so each start traces, freezes and lowers the whole model again. Where every
        weight is packed already (AMX tiles; oneDNN's layout, read through `onednn_linear`) the
        weights are graph inputs, and the next start takes the compiled graph from torch's cache."""
        return any(
            module.packed_weight is None for module in self.model.modules() if isinstance(module, LinearBase)
        )

    @torch.inference_mode()
    def _compile(self) -> Forward:
        """The model's forward pass through torch.compile (inductor), compiled now with a dummy
        two-token step so that no request waits for it. Where the weights are frozen as constants
        (`_freezes_weights`), the whole model is one graph. So it is where they are read through
        `onednn_linear` (float32 on CPUs other than Intel's), since every decode step runs the
        compiled pass there (`decode_layers` is bf16's): the float32 chat workload ran 9.5% slower
        than frozen with one layer compiled for all, 2.4-3.4% slower as one graph (bench/README.md,
        "Start-up"). Elsewhere (AMX tiles) one decoder layer is compiled and serves every layer, its
        weights graph inputs (`_compiled_layers`).

        The token count is unbacked: one graph serves every step size, 1 included, with no guard on
        it and no recompilation. Attention stays outside the graph (`layers.attention`)."""
        freezing = self._freezes_weights()
        one_graph = freezing or any(
            module.onednn_index is not None
            for module in self.model.modules()
            if isinstance(module, LinearBase)
        )
        forward, code = self._compiled_model() if one_graph else self._compiled_layers()
        logger.info("compiling the forward pass with torch.compile (--enforce-eager skips this)")
        start = time.perf_counter()
        ids = torch.zeros(2, dtype=torch.int64, device=self.device)
        metadata = self._dummy_metadata()
        try:
            # Freezing comes from the global config, patched around this first call (which traces
            # and compiles): dynamo reads it while tracing to make the parameters graph constants,
            # which inductor then packs. torch.compile's `options` reach inductor alone and would
            # leave every weight a graph input and every linear layer an unpacked bf16 matmul.
            from torch._inductor.codecache import PyCodeCache

            known = {id(module) for module in PyCodeCache.modules}
            with (
                step_metadata(metadata, self.attention_layers),
                torch._inductor.config.patch(freezing=freezing),
            ):
                forward(ids, torch.arange(2, device=self.device), metadata)
            generated = [module for module in PyCodeCache.modules if id(module) not in known]
            self.frozen_weights = freezing
            release = weakref.finalize(self.model, _release_compiled, code, generated)
            release.atexit = False  # the process frees everything then
        except Exception as exc:  # e.g. no C++ compiler for inductor: slower, but serving
            logger.warning("torch.compile failed, running the forward pass eagerly: %s", exc)
            self._pack_weights(self.model.modules())
            return self.model
        logger.info(
            "forward pass compiled in %.1f s (%s)",
            time.perf_counter() - start,
            "one graph, the weights frozen into it"
            if freezing
            else "one graph, the weights graph inputs"
            if one_graph
            else "one decoder layer's graph for every layer, the weights graph inputs",
        )
        return forward

    def _compiled_model(self) -> tuple[Forward, types.CodeType]:
        """The whole model as one graph (for frozen weights, which a graph cannot share between
        layers, and where every step runs it), and the code object dynamo keeps it on."""
        model: torch.nn.Module = self.model
        model.forward = types.MethodType(_of_its_own(type(model).forward), model)
        compiled = torch.compile(
            model,
            fullgraph=True,
            dynamic=False,
            options={"guard_filter_fn": _guards_but_the_model_tree},  # torch.compile takes it out of options
        )

        def forward(
            input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
        ) -> torch.Tensor:
            torch._dynamo.decorators.mark_unbacked(input_ids, 0)
            torch._dynamo.decorators.mark_unbacked(positions, 0)
            return compiled(input_ids, positions, metadata)

        return forward, model.forward.__code__

    def _compiled_layers(self) -> tuple[Forward, types.CodeType]:
        """The model's forward pass with its decoder layers run through one compiled function of the
        layer (`models.llama.run_layer`), and the code object dynamo keeps its graphs on. The layer's
        weights and its index are graph inputs, so dynamo traces one layer, not 30, and the graph
        (two: the first layer has no residual yet) serves them all: a default-model server was ready
        in 17.5 s from a warm cache against 27.1 s with the whole model traced, and in 45-48 s against
        86-96 s from an empty one (bench/README.md, "Start-up"). The embedding, the rotary tables and
        the final norm stay eager: a few small ops a step. What it gives up is the whole graph's edge
        on small steps with prompts, where a layer's call (its guards, inductor's wrapper) costs
        about what its fusions save: a 2-token step of the default model runs about as fast as the
        eager pass; a prefill of the chat workload's 64 prompts as fast as the whole graph."""
        run_layer = _of_its_own(llama.run_layer)
        compiled = torch.compile(run_layer, fullgraph=True, dynamic=False)
        unbacked = torch._dynamo.decorators.mark_unbacked

        def layer_step(
            layer: torch.nn.Module,
            rotary: llama.Rotary,
            hidden: torch.Tensor,
            residual: torch.Tensor | None,
            metadata: AttentionMetadata,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            # the rotary tables are the step's, shared by every layer: marked with the first's inputs
            for tensor in (*rotary, hidden) if residual is None else (hidden, residual):
                unbacked(tensor, 0)
            return compiled(layer, rotary, hidden, residual, metadata)

        model = self.model

        def forward(
            input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
        ) -> torch.Tensor:
            return model(input_ids, positions, metadata, layer_step)

        return forward, run_layer.__code__

    def _dummy_metadata(self) -> AttentionMetadata:
        """One two-token prefill that writes nothing (slots -1) and reads block 0 (what it holds)."""
        to_device = lambda values, dtype: torch.tensor(values, dtype=dtype, device=self.device)  # noqa: E731
        table = [[0] * -(-2 // self.block_size)]
        metadata = AttentionMetadata(
            slot_mapping=to_device([-1, -1], torch.int64),
            num_decodes=0,
            decode_block_tables=to_device(table, torch.int32)[:0],
            decode_context_lens=to_device([], torch.int32),
            prefill_block_tables=to_device(table, torch.int32),
            prefill_query_start_loc=to_device([0, 2], torch.int32),
            prefill_context_lens=to_device([2], torch.int32),
            max_prefill_query_len=2,
        )
        return metadata

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(output)
        if output.is_empty:
            return ModelRunnerOutput([], [])
        order = sorted(output.scheduled, key=_is_prefill)  # decodes (with their drafts) first, stable
        input_ids, positions, metadata, sample_indices = self._prepare_inputs(order)
        token_adapters = self._token_adapters(order) if self.lora is not None else None
        if token_adapters is not None:  # LoRA rows: the eager pass (the fast ones have base weights alone)
            assert self.lora is not None
            with (
                step_metadata(metadata, self.attention_layers),
                self.lora.running(token_adapters, self.device),
            ):
                hidden = self.model(input_ids, positions, metadata)
        elif self.fused_decode is not None and metadata.num_prefills == 0:
            hidden = self.fused_decode(input_ids, positions, metadata)
        elif self.cuda_graphs is not None and self.cuda_graphs.can_run(metadata):
            hidden = self.cuda_graphs(input_ids, positions, metadata)
        else:
            with step_metadata(metadata, self.attention_layers):
                hidden = self.forward(input_ids, positions, metadata)
        prompt_logprobs = self._prompt_logprobs(order, hidden) if self.prompt_token_ids else {}
        pooled = self._pool(order, hidden) if self.pooling_request_ids else {}
        sampled = [r for r in order if r.do_sample]
        if not sampled:  # chunks of prompts: nothing to sample, maybe prompt logprobs or embeddings
            return ModelRunnerOutput([], [], prompt_logprobs=prompt_logprobs, pooled=pooled)
        rows = self._sample_rows(sampled)
        result = self._sample(hidden[sample_indices], rows, output)
        runner_output = self._to_output(sampled, rows, result, prompt_logprobs)
        runner_output.pooled = pooled
        return runner_output

    def _sample(self, hidden: torch.Tensor, rows: list[SampleRow], output: SchedulerOutput) -> SamplerOutput:
        """The LM head and the sampler. Rows that all take the argmax alone build no SamplingTensors;
        without a grammar's mask to apply first, the LM head's kernel takes the argmax itself where it
        can (no logits written and read back)."""
        argmax_only = self.sampler.argmax_rows is not None and all(row.argmax_only for row in rows)
        if argmax_only and output.grammar_bitmask is None:
            token_ids = self.model.greedy_token_ids(hidden)
            if token_ids is not None:
                return SamplerOutput(token_ids)
        logits = self.model.compute_logits(hidden)
        grammar_masks = self._apply_grammar_bitmask(logits, rows, output)
        if argmax_only:
            assert self.sampler.argmax_rows is not None
            return SamplerOutput(self.sampler.argmax_rows(logits))
        return self.sampler(logits, self._sampling_tensors(rows, grammar_masks))

    def _sample_rows(self, sampled: list[ScheduledRequest]) -> list[SampleRow]:
        rows = []
        for req in sampled:
            state = self.requests[req.request_id]
            first = state.num_tokens - req.num_spec_tokens
            rows += [SampleRow(req.request_id, state, first + i) for i in range(1 + req.num_spec_tokens)]
        return rows

    def _apply_grammar_bitmask(
        self, logits: torch.Tensor, sample_rows: list[SampleRow], output: SchedulerOutput
    ) -> dict[int, np.ndarray]:
        """Structured outputs: mask the logits of the rows whose request has a grammar (before the
        sampler, so every fast path samples from masked logits), each of a request's rows (its last
        token, its drafts) with its own bitmask row. Returns the bitmask row of each such sample row."""
        if output.grammar_bitmask is None:
            return {}
        rows_of: dict[str, list[int]] = {}
        for i, row in enumerate(sample_rows):
            rows_of.setdefault(row.request_id, []).append(i)
        rows = [i for request_id in output.structured_output_request_ids for i in rows_of[request_id]]
        bitmask = torch.from_numpy(output.grammar_bitmask).to(self.device, non_blocking=True)
        apply_token_bitmask(logits, bitmask, rows)
        return dict(zip(rows, output.grammar_bitmask, strict=True))

    def load_lora(self, name: str, path: str) -> None:
        """Load a LoRA adapter between steps (ValueError naming `lora_modules` if it does not fit)."""
        if self.lora is None:  # the first one: the layers' LoRA hooks are added now
            self.lora = LoRAModels((), self.model, self.dtype)
        self.lora.add(name, path)

    def unload_lora(self, name: str) -> None:
        """Drop a LoRA adapter between steps. No request runs through it any more (the state of one
        that just ended may wait here for the next step to free it: it is never run again)."""
        assert self.lora is not None and name in self.lora.names, f"LoRA {name!r} is not loaded"
        self.lora.remove(name)

    def _token_adapters(self, order: list[ScheduledRequest]) -> torch.Tensor | None:
        """Each token's LoRA adapter index this step (-1: none), on the CPU; None when no request has one."""
        indices = [self.requests[r.request_id].lora_index for r in order]
        if max(indices) < 0:
            return None
        return torch.repeat_interleave(torch.tensor(indices), torch.tensor([len(r.token_ids) for r in order]))

    # -- per-request state ------------------------------------------------------------------------

    def _update_states(self, output: SchedulerOutput) -> None:
        for request_id in output.freed_request_ids:
            self._free_state(request_id)
        for req in output.scheduled:
            if req.is_new:
                self._add_state(req)
            state = self.requests[req.request_id]
            if req.new_block_ids:
                end = state.num_blocks + len(req.new_block_ids)
                self.block_tables[state.row, state.num_blocks : end] = torch.tensor(
                    req.new_block_ids, dtype=torch.int32
                )
                state.num_blocks = end
            # From the scheduler's count: drafts the last step ran and did not accept are dropped here.
            state.num_tokens = req.num_computed_tokens + len(req.token_ids)
            if state.keeps_token_ids:
                state.token_ids.replace_from(req.num_computed_tokens, req.token_ids)

    def _add_state(self, req: ScheduledRequest) -> None:
        """A request new to this worker (admitted, resumed or forked): tokens already in the cache count.

        An announcement carries the request's whole state (its whole block table, the tokens already
        in the cache), so one for an id this worker still holds replaces that state and gives back its
        row: taking a second row would lose the first for good."""
        assert req.sampling_params is not None
        self._free_state(req.request_id)
        if not self.free_rows:
            raise RuntimeError(
                f"no free block-table row for {req.request_id!r}: "
                f"{len(self.requests)} requests hold all {len(self.block_tables)} (max_num_seqs)"
            )
        if self.recurrent_layers and req.num_computed_tokens:
            raise RuntimeError(
                f"{req.request_id!r} resumes at token {req.num_computed_tokens}: a model with a state per "
                "request runs each from its first token"
            )
        state = RequestState(
            self.free_rows.pop(),
            req.sampling_params,
            req.num_prompt_tokens,
            num_tokens=req.num_computed_tokens,
        )
        if state.keeps_token_ids:
            state.token_ids.replace_from(0, req.computed_token_ids)
        for layer in self.recurrent_layers:
            layer.reset_state(state.row)
        if req.sampling_params.logit_bias:  # once, not every step: up to 1,024 entries
            bias = req.sampling_params.logit_bias
            state.logit_bias = (
                torch.tensor(list(bias), device=self.device),
                torch.tensor(list(bias.values()), dtype=torch.float32, device=self.device),
            )
        if req.prompt_token_ids is not None:
            self.prompt_token_ids[req.request_id] = req.prompt_token_ids
        if req.sampling_params.pooling is not None:
            self.pooling_request_ids.add(req.request_id)
        if req.lora_name is not None:
            assert self.lora is not None, f"{req.request_id!r} names LoRA {req.lora_name!r}: none loaded"
            state.lora_index = self.lora.index_of(req.lora_name)
        self.requests[req.request_id] = state

    def _free_state(self, request_id: str) -> None:
        self.prompt_token_ids.pop(request_id, None)
        self.pooling_request_ids.discard(request_id)
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.free_rows.append(state.row)

    # -- inputs --------------------------------------------------------------------------------------

    def _prepare_inputs(
        self, order: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's token ids, positions, attention metadata and rows to sample, built in numpy over
        the whole batch (a few microseconds an operation where torch's CPU ops take tens: this runs
        every step, between model passes that leave it a cold cache)."""
        n = len(order)
        num_decode_requests = sum(1 for r in order if not _is_prefill(r))
        q_lens = np.fromiter((len(r.token_ids) for r in order), np.int64, n)
        starts = np.fromiter((r.num_computed_tokens for r in order), np.int64, n)
        rows = np.fromiter((self.requests[r.request_id].row for r in order), np.int64, n)
        context_lens = starts + q_lens
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])

        num_tokens = int(query_start_loc[-1])
        token_seq = np.repeat(np.arange(n), q_lens)
        positions = starts[token_seq] + np.arange(num_tokens) - query_start_loc[:-1][token_seq]
        max_blocks = -(-int(context_lens.max()) // self.block_size)
        tables = self.block_tables.numpy()[rows, :max_blocks]
        slot_mapping = (
            tables[token_seq, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        # Every token of a decoding request is a decode row of its own: its drafts too, each attending
        # to the context up to its own position (the step writes all their K/V before any attends), so
        # a step verifying drafts stays a decode step (decode attention, `decode_layers`).
        num_decodes = int(query_start_loc[num_decode_requests])
        decode_context_lens = positions[:num_decodes] + 1
        do_sample = np.fromiter((r.do_sample for r in order), np.bool_, n)
        sample_indices = (query_start_loc[1:] - 1)[do_sample]
        if any(r.num_spec_tokens for r in order):  # a row at the last token and at every draft
            counts = np.fromiter((1 + r.num_spec_tokens for r in order), np.int64, n)[do_sample]
            firsts = query_start_loc[1:][do_sample] - counts
            offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            sample_indices = np.repeat(firsts, counts) + offsets

        def to_device(array: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device, dtype=dtype, non_blocking=True)

        prefill_starts = query_start_loc[num_decode_requests:] - query_start_loc[num_decode_requests]
        metadata = AttentionMetadata(
            slot_mapping=to_device(slot_mapping),
            num_decodes=num_decodes,
            decode_block_tables=to_device(tables[token_seq[:num_decodes]]),
            decode_context_lens=to_device(decode_context_lens, torch.int32),
            prefill_block_tables=to_device(tables[num_decode_requests:]),
            prefill_query_start_loc=to_device(prefill_starts, torch.int32),
            prefill_context_lens=to_device(context_lens[num_decode_requests:], torch.int32),
            max_decode_context_len=int(decode_context_lens.max()) if num_decodes else 0,
            max_prefill_query_len=int(q_lens[num_decode_requests:].max()) if n > num_decode_requests else 0,
        )
        if n > num_decode_requests:
            for chunk in self.attention_chunks:
                metadata.chunked_prefills[chunk] = chunk_prefills(
                    starts[num_decode_requests:],
                    q_lens[num_decode_requests:],
                    tables[num_decode_requests:],
                    chunk,
                    self.block_size,
                    self.device,
                )
        if self.recurrent_layers:
            metadata.recurrent = RecurrentStep(to_device(rows), rows.tolist(), q_lens.tolist())
            for width in self.conv_widths:
                taps, keep = conv_windows(q_lens, width)
                metadata.recurrent.windows[width] = ConvWindows(to_device(taps), to_device(keep))
        input_ids = np.fromiter(chain.from_iterable(r.token_ids for r in order), np.int64, num_tokens)
        return to_device(input_ids), to_device(positions), metadata, to_device(sample_indices)

    def _sampling_tensors(
        self, rows: list[SampleRow], grammar_masks: dict[int, np.ndarray]
    ) -> SamplingTensors:
        states = [row.state for row in rows]
        params = [s.params for s in states]
        device = self.device
        as_tensor = lambda values, dtype=torch.float32: torch.tensor(values, dtype=dtype, device=device)  # noqa: E731
        use_top_k = any(p.top_k > 0 for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)
        use_repetition = any(p.has_repetition_penalty for p in params)
        use_counts = any(p.has_count_penalties for p in params)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        controls = self._token_controls(rows, grammar_masks)
        return SamplingTensors(
            temperatures=as_tensor([p.temperature for p in params]),
            top_ks=as_tensor([p.top_k if p.top_k > 0 else self.vocab_size for p in params], torch.int64)
            if use_top_k
            else None,
            top_ps=as_tensor([p.top_p for p in params]) if use_top_p else None,
            min_ps=as_tensor([p.min_p for p in params]) if use_min_p else None,
            repetition_penalties=as_tensor([p.repetition_penalty for p in params])
            if use_repetition
            else None,
            presence_penalties=as_tensor([p.presence_penalty for p in params]) if use_counts else None,
            frequency_penalties=as_tensor([p.frequency_penalty for p in params]) if use_counts else None,
            prompt_token_ids=self._padded_prompts(states) if use_repetition else None,
            output_token_ids=self._padded([row.output_token_ids for row in rows])
            if use_repetition or use_counts
            else None,
            banned_tokens=[(row, banned) for row, (banned, _) in controls.items() if banned],
            seeded_rows=[
                (i, row.state.params.seed, row.num_output_tokens)
                for i, row in enumerate(rows)
                if row.state.params.seed is not None and not row.state.params.is_greedy
            ],
            max_num_logprobs=max(logprobs) if logprobs else None,
            allowed_tokens=[
                (row, self._allowed_ids(rows[row].state, allowed))
                for row, (_, allowed) in controls.items()
                if allowed
            ],
            logit_biases=[(i, *s.logit_bias) for i, s in enumerate(states) if s.logit_bias is not None],
        )

    def _token_controls(
        self, rows: list[SampleRow], grammar_masks: dict[int, np.ndarray]
    ) -> dict[int, tuple[list[int], list[int] | None]]:
        """(banned, allowed) token ids by row, for the rows that ban or allow any this step."""
        controls: dict[int, tuple[list[int], list[int] | None]] = {}
        for i, row in enumerate(rows):
            p = row.state.params
            if p.allowed_token_ids or p.bad_words_token_ids or row.num_output_tokens < p.min_tokens:
                controls[i] = self._banned_and_allowed(row, grammar_masks.get(i))
        return controls

    def _banned_and_allowed(
        self, row: SampleRow, grammar_mask: np.ndarray | None
    ) -> tuple[list[int], list[int] | None]:
        """The tokens this row may not sample this step (min_tokens' EOS and stop ids, bad words), and
        those alone it may (allowed_token_ids, None for all). Each yields where it would leave the row
        no token, in this order: allowed_token_ids to the grammar (none of them is in it), then the bans
        to allowed_token_ids or to the grammar (they ban all those allow; a complete grammar allows only
        EOS, which min_tokens bans)."""
        state = row.state
        params, allowed = state.params, state.params.allowed_token_ids
        if allowed is not None and grammar_mask is not None:
            allowed = _allowed_by(grammar_mask, allowed) or None
        banned: list[int] = []
        if row.num_output_tokens < params.min_tokens:
            banned += [*([] if params.ignore_eos else self.eos_token_ids), *params.stop_token_ids]
        if params.bad_words_token_ids:
            if state.bad_words is None:
                state.bad_words = BadWords.build(params.bad_words_token_ids)
            banned += state.bad_words.banned(row.output_token_ids)
        if not banned:
            return banned, allowed
        if allowed is not None:
            leaves_none = set(allowed) <= set(banned)
        else:
            leaves_none = grammar_mask is not None and _allows_only(grammar_mask, banned)
        return ([] if leaves_none else banned), allowed

    def _allowed_ids(self, state: RequestState, allowed: list[int]) -> torch.Tensor:
        """`allowed` on the device: the request's allowed_token_ids made once, a grammar's share of them
        each step (indexing the logits with a list of 1,000 ids took ~0.2 ms a row, with a tensor 14 us)."""
        if allowed is not state.params.allowed_token_ids:
            return torch.tensor(allowed, dtype=torch.int64, device=self.device)
        if state.allowed_ids is None:
            state.allowed_ids = torch.tensor(allowed, dtype=torch.int64, device=self.device)
        return state.allowed_ids

    def _padded_prompts(self, states: list[RequestState]) -> torch.Tensor:
        """The rows' prompts padded as `_padded`, from each request's own tensor of them: padding lists of
        ~1,000-token prompts into a tensor took ~3 ms a step for 64 rows. The last step's, where its rows
        had the same prompts (padding the tensors took ~0.6 ms for 64 prompts of 100-1,000 tokens)."""
        prompts = []
        for state in states:
            prompt = state.prompt_ids
            if prompt is None:
                ids = state.token_ids.span(0, state.num_prompt_tokens)
                prompt = torch.from_numpy(ids.copy()).to(self.device)
                if len(ids) == state.num_prompt_tokens:  # the whole prompt (a row samples after it)
                    state.prompt_ids = prompt
            prompts.append(prompt)
        last = self._last_prompts
        if last is not None and len(last[0]) == len(prompts) and all(map(operator.is_, last[0], prompts)):
            return last[1]
        if max(len(prompt) for prompt in prompts) == 0:
            padded = self._padded([np.empty(0, np.int64) for _ in states])
        else:
            padded = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True, padding_value=self.vocab_size)
        self._last_prompts = (prompts, padded)
        return padded

    def _padded(self, rows: list[np.ndarray]) -> torch.Tensor:
        """`rows` as one tensor, each padded with vocab_size (an id no token has) to the longest, at
        least 1 wide: one slice copied a row (torch.tensor of the padded lists took ~1.4 ms for 64
        rows of up to 128 ids)."""
        padded = np.full((len(rows), max(1, max(map(len, rows), default=0))), self.vocab_size, np.int64)
        for row, ids in zip(padded, rows):
            row[: len(ids)] = ids
        return torch.from_numpy(padded).to(self.device)

    def _to_output(
        self,
        sampled: list[ScheduledRequest],
        rows: list[SampleRow],
        result: SamplerOutput,
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]],
    ) -> ModelRunnerOutput:
        """One token per request, or with drafts: the drafts accepted (each equal to the token sampled at
        its position), then the token sampled at the first position that differs (or after the last).
        Logprobs of the rows whose token is kept."""
        token_ids = result.token_ids.tolist()  # the one host sync of the step (without prompt logprobs)
        output = ModelRunnerOutput([r.request_id for r in sampled], [], prompt_logprobs=prompt_logprobs)
        if result.logprobs is not None:
            assert result.logprob_token_ids is not None and result.sampled_ranks is not None
            values, ids, ranks = (
                result.logprobs.tolist(),
                result.logprob_token_ids.tolist(),
                result.sampled_ranks.tolist(),
            )
            output.logprobs = []

        def entry(row: int) -> TokenLogprobs:
            k = rows[row].state.params.logprobs
            return {} if k is None else _logprob_entry(ids[row], values[row], ranks[row], k)

        first = 0  # the request's first row
        for req in sampled:
            drafts = req.token_ids[len(req.token_ids) - req.num_spec_tokens :] if req.num_spec_tokens else []
            n = 0
            while n < len(drafts) and token_ids[first + n] == drafts[n]:
                n += 1
            output.sampled_token_ids.append(token_ids[first + n])
            if n:
                output.accepted_drafts[req.request_id] = drafts[:n]
            if output.logprobs is not None:
                output.logprobs.append(entry(first + n))
                if n:
                    output.draft_logprobs[req.request_id] = [entry(first + i) for i in range(n)]
            first += 1 + len(drafts)
        return output

    def _prompt_logprobs(
        self, order: list[ScheduledRequest], hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """The prompt logprobs this step's rows give, for the requests owing them.

        The logits at position j score prompt token j + 1. A chunk of positions [start, end) scores
        tokens start + 1 .. min(end, num_prompt - 1): its last row scores the next chunk's first token,
        which is why the workers hold the whole prompt. Positions past the prompt score nothing."""
        found: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        row = 0  # the request's first row in `hidden` (rows follow `order`)
        for req in order:
            first, row = row, row + len(req.token_ids)
            prompt = self.prompt_token_ids.get(req.request_id)
            if prompt is None:
                continue
            start = req.num_computed_tokens
            end = min(start + len(req.token_ids), len(prompt) - 1)
            if end > start:
                k = self.requests[req.request_id].params.prompt_logprobs
                assert k is not None
                entries = self._score(hidden[first : first + end - start], prompt[start + 1 : end + 1], k)
                found[req.request_id] = (start + 1, entries)
            if end == len(prompt) - 1:  # every prompt position scored
                del self.prompt_token_ids[req.request_id]
        return found

    def _pool(
        self, order: list[ScheduledRequest], hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[float]]]:
        """The embedding requests' part of this step's hidden states, per request (its first
        position this step, values): the sum of the rows of a "mean" one (the engine adds the chunks
        up, as a preemption drops this worker's state), the last prompt row of a "last" one, in the
        step that runs it."""
        found: dict[str, tuple[int, list[float]]] = {}
        row = 0  # the request's first row in `hidden` (rows follow `order`)
        for req in order:
            first, row = row, row + len(req.token_ids)
            if req.request_id not in self.pooling_request_ids:
                continue
            state = self.requests[req.request_id]
            assert state.params.pooling is not None
            if state.params.pooling.pooling == "mean":
                found[req.request_id] = (req.num_computed_tokens, hidden[first:row].float().sum(0).tolist())
            elif state.num_tokens == state.num_prompt_tokens:  # this step ran the last prompt token
                found[req.request_id] = (req.num_computed_tokens, hidden[row - 1].float().tolist())
        return found

    def _score(self, hidden: torch.Tensor, target_ids: list[int], k: int) -> list[TokenLogprobs]:
        """Each row's log-probability of its target token, with its rank, and the top k: from the raw
        logits in float32, a slice of rows at a time (`PROMPT_LOGPROBS_SLICE_ELEMENTS`)."""
        targets = torch.tensor(target_ids, device=self.device)
        num_rows = max(1, PROMPT_LOGPROBS_SLICE_ELEMENTS // self.vocab_size)
        values, ids, ranks = [], [], []
        for begin in range(0, len(target_ids), num_rows):
            logits = self.model.compute_logits(hidden[begin : begin + num_rows])
            slice_values, slice_ids, slice_ranks = self.sampler.logprobs(
                logits, targets[begin : begin + num_rows], k
            )
            values.append(slice_values)
            ids.append(slice_ids)
            ranks.append(slice_ranks)
        rows = zip(
            torch.cat(ids).tolist(), torch.cat(values).tolist(), torch.cat(ranks).tolist(), strict=True
        )
        return [_logprob_entry(i, v, rank, k) for i, v, rank in rows]


def _is_prefill(req: ScheduledRequest) -> bool:
    """A request running prompt tokens (or recomputing); the others decode one token (and its drafts)."""
    return len(req.token_ids) - req.num_spec_tokens > 1


def _allowed_by(bitmask_row: np.ndarray, token_ids: list[int]) -> list[int]:
    """Those of `token_ids` a grammar's bitmask row allows."""
    ids = np.array(token_ids, dtype=np.int64)
    words, bits = np.divmod(ids, 32)
    in_range = words < bitmask_row.shape[0]
    ids, words, bits = ids[in_range], words[in_range], bits[in_range]
    return ids[((bitmask_row[words] >> bits) & 1).astype(bool)].tolist()


def _logprob_entry(ids: list[int], values: list[float], rank: int, k: int) -> TokenLogprobs:
    """One token's entry from a row of ids and logprobs (the scored token, then the top k): the top k
    at ranks 1..k (a grammar's disallowed tokens, -inf, are no candidates: left out), and the scored
    token at its own `rank`, even outside them."""
    entry = {
        tid: Logprob(v, r + 1)
        for r, (tid, v) in enumerate(zip(ids[1 : k + 1], values[1 : k + 1]))
        if v != float("-inf")
    }
    entry[ids[0]] = Logprob(values[0], rank)
    return entry


def _allows_only(bitmask_row: np.ndarray, token_ids: list[int]) -> bool:
    """Whether a grammar's bitmask row allows no token outside `token_ids`."""
    num_allowed = int(np.unpackbits(bitmask_row.view(np.uint8)).sum())
    words, bits = np.divmod(np.array(sorted(set(token_ids)), dtype=np.int64), 32)
    in_range = words < bitmask_row.shape[0]
    num_listed = int(((bitmask_row[words[in_range]] >> bits[in_range]) & 1).sum())
    return num_allowed == num_listed
