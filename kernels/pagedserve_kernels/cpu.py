"""C++ kernels for CPU runs (`csrc/`), built on first use by torch's extension builder and cached
(`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions): ~28 s on 2 cores once per machine
and source version, then a library load.

They are compiled for the machine they run on (`-march=native`, the CPU's flags in the library's name,
so a cache shared between different CPUs never hands one the other's build). When no C++ compiler is
there, `load()` says so once and returns False; callers keep the pure-torch reference.

The attention kernels take the reference's `window`, `softcap` and `sinks` (GPT-OSS's per-head sink
logits: each head's online softmax starts from its sink), checked here as the reference checks them.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedserve_kernels.reference import check_alibi, check_sinks

logger = logging.getLogger(__name__)

_SOURCES = (
    Path(__file__).parent / "csrc" / "cpu_kernels.cpp",
    Path(__file__).parent / "csrc" / "linear_amx.cpp",
    Path(__file__).parent / "csrc" / "linear_avx512.cpp",
    Path(__file__).parent / "csrc" / "decode_layers.cpp",
    Path(__file__).parent / "csrc" / "mamba.cpp",
    Path(__file__).parent / "csrc" / "mamba2.cpp",
    Path(__file__).parent / "csrc" / "gated_delta.cpp",
)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]

# The head sizes the AVX512-BF16 attention kernels are instantiated for (csrc/cpu_kernels.cpp):
# `paged_attention_prefill` takes only these, and bfloat16 decode at any other size runs the generic
# loops. SmolLM2's 64, Phi-3's 96, Llama's 128, Gemma's 256.
PREFILL_HEAD_SIZES = (64, 96, 128, 256)


def _machine_tag() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


@functools.cache
def load() -> bool:
    """Build (or find the cached build of) the CPU kernels and register `torch.ops.pagedserve_cpu`."""
    try:
        from torch.utils import cpp_extension

        name = f"pagedserve_cpu_{_machine_tag()}"
        with _one_loader_at_a_time(Path(cpp_extension._get_build_directory(name, verbose=False))):
            cpp_extension.load(
                name=name,
                sources=[str(path) for path in _SOURCES],
                extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch reference still works
        logger.warning("CPU kernels unavailable, using the pure-torch reference: %s", str(exc)[-500:])
        return False
    torch.library.register_fake("pagedserve_cpu::linear_amx")(_linear_amx_shape)
    torch.library.register_fake("pagedserve_cpu::linear_avx512")(_linear_avx512_shape)
    return True


@contextlib.contextmanager
def _one_loader_at_a_time(build_dir: Path) -> Iterator[None]:
    """torch's builder guards the build directory with a `lock` file it deletes when done: a process
    killed inside it (a tensor-parallel rank stopped while its engine failed to start, a server killed
    during its first start) leaves the file, and every later load waits on it forever. Loaders here
    hold an OS lock first (released when its holder dies, however it dies), under which a `lock` file
    can only be such a leftover, and is removed."""
    with open(build_dir / "loader.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield  # (the OS lock goes with the file's closing)


def _linear_amx_shape(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What `linear_amx` returns, for tracing (torch.compile)."""
    return x.new_empty((*x.shape[:-1], packed.shape[0] * 16))


def _linear_avx512_shape(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What `linear_avx512` returns, for tracing (torch.compile)."""
    return x.new_empty((*x.shape[:-1], packed.shape[0] * packed.shape[2]))


def mamba_scan(
    state: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
) -> torch.Tensor:
    """Mamba (1)'s selective scan over a step's tokens (csrc/mamba.cpp; needs `load()`): request i's
    tokens starts[i]..starts[i + 1] in order, its state rows[i] of `state` [rows, channels, state_size]
    (float32 or bfloat16) advanced in place a token at a time, h <- exp(dt A) h + (dt x) B, and
    y = h . C [tokens, channels] (float32) returned, from x and dt [tokens, channels], A [channels,
    state_size], and B and C [tokens, state_size], all float32; `starts` int64 [requests + 1]."""
    return torch.ops.pagedserve_cpu.mamba_scan(state, rows, starts, x, dt, a, b, c)


def mamba2_decode(
    state: torch.Tensor,
    rows: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
) -> torch.Tensor:
    """Mamba2's decode step in one pass over the states (csrc/mamba2.cpp; needs `load()`): each
    request's state rows[i] of `state` [rows, heads, head_dim, state_size] (float32 or bfloat16)
    advanced in place, S <- exp(dt A) S + (dt x) B^T, and y = S C [requests, heads, head_dim] (float32)
    returned, from x [requests, heads, head_dim], dt [requests, heads], A [heads], and B and C
    [requests, groups, state_size] (each group's shared by heads / groups heads), all float32."""
    return torch.ops.pagedserve_cpu.mamba2_decode(state, rows, x, dt, a, b, c)


def gated_delta_decode(
    state: torch.Tensor,
    rows: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """The gated delta rule's decode step in two passes over the states (csrc/gated_delta.cpp; needs
    `load()`): each request's state rows[i] of `state` [rows, heads, head_k_dim, head_v_dim] (float32
    or bfloat16) decayed by exp(g) and advanced in place by k (beta (v - S^T k))^T, and o = S^T q
    [requests, heads, head_v_dim] (float32) of the advanced state returned, from q and k [requests,
    heads, head_k_dim], v [requests, heads, head_v_dim], beta [requests, heads] and g [requests,
    heads] (a decay a head) or [requests, heads, head_k_dim] (a decay a key channel, each row of S its
    own: Kimi's), all float32."""
    return torch.ops.pagedserve_cpu.gated_delta_decode(state, rows, q, k, v, g, beta)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`reference.write_kv_cache` in one call: a row copy per token, slot -1 skipped (needs `load()`)."""
    torch.ops.pagedserve_cpu.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """`reference.paged_attention_decode`, reading K/V straight from the paged cache (needs `load()`),
    under a sliding `window` only each context's last `window` slots, each score s soft-capped to
    softcap * tanh(s / softcap) under a `softcap` (0: none; a negative or non-finite one is a
    RuntimeError), each head's softmax joined by its sink logit under `sinks` (float32 [num_heads];
    None: none; a bad one is a ValueError), each score biased by distance under `alibi_slopes` (as
    the sinks: float32 [num_heads]). The block ids covering each context are checked first (a
    RuntimeError names one outside the cache); those past it are padding, never read, and may hold
    anything."""
    check_sinks(sinks, query)
    check_alibi(alibi_slopes, query)
    return torch.ops.pagedserve_cpu.paged_attention_decode(
        query, k_cache, v_cache, block_tables, context_lens, scale, window, softcap, sinks, alibi_slopes
    )


def paged_attention_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """`reference.paged_attention_prefill`, its sliding `window`, score `softcap`, `sinks` and
    `alibi_slopes` too (as for decode), for bfloat16 and head sizes 64, 96, 128 and 256 (`PREFILL_HEAD_SIZES`) on a build whose
    `decode_isa()` is "avx512_bf16" (a RuntimeError elsewhere): tiles of 16 (query token, query head)
    lanes sharing a KV head, scores and P V both by vdpbf16ps, the softmax weights rounded to bfloat16
    for P V as flash attention rounds them. Needs `load()`; block ids are checked as for decode."""
    check_sinks(sinks, query)
    check_alibi(alibi_slopes, query)
    return torch.ops.pagedserve_cpu.paged_attention_prefill(
        query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, window, softcap, sinks,
        alibi_slopes,
    )  # fmt: skip


def decode_isa() -> str:
    """The instructions bfloat16 decode attention runs on in this build: "avx512_bf16" where the
    compiler targets AVX512-BF16 (vdpbf16ps scoring), else "generic" (needs `load()`)."""
    return str(torch.ops.pagedserve_cpu.decode_isa())


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum, as `logits.max(dim=-1).indices` (NaN first), read in the logits' own
    dtype: greedy sampling without a float32 copy of the logits (needs `load()`)."""
    return torch.ops.pagedserve_cpu.argmax_rows(logits)


def invert_rows(probs: torch.Tensor, uniforms: torch.Tensor, block: int) -> torch.Tensor:
    """Each row of `probs` (float32 [rows, n]) drawn by inversion at its uniform (float64 [rows]): the
    first token whose cumulative probability reaches (1 - u) * total, summed in float64 in blocks of
    `block` tokens, as the sampler's `_draw` draws (needs `load()`)."""
    return torch.ops.pagedserve_cpu.invert_rows(probs, uniforms, block)


def sample_rows(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    uniforms: torch.Tensor,
    block: int,
    top_ks: torch.Tensor | None = None,
    top_ps: torch.Tensor | None = None,
    min_ps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row of `logits` ([rows, n], float32, bfloat16 or float16) sampled at its temperature
    (float32 [rows]; 0 or below: the argmax, as `argmax_rows`) and uniform (float64 [rows]): the token
    `invert_rows` draws from softmax(logits / temperature), up to float32 rounding: the weights
    exp((x - max) / T) are made as they are summed (in float64, in blocks of `block`), never written.
    A row cut by top-k (`top_ks`, int64 [rows], n: none), top-p (`top_ps`, float32 [rows], 1: none) or
    min-p (`min_ps`, float32 [rows], 0: none) draws from what the sampler's `_top_cut` keeps of those
    weights, most likely first, ties in id order: its likeliest tokens are gathered above a weight
    that is lowered only where the cut reaches below it, the cut's least weight is found among them
    by selection, and so is the token drawn among those kept (needs `load()`)."""
    return torch.ops.pagedserve_cpu.sample_rows(logits, temperatures, uniforms, block, top_ks, top_ps, min_ps)


def logprob_rows(
    logits: torch.Tensor, tokens: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the sampler reports of raw logits ([rows, n], float32, bfloat16 or float16) for each row's
    token (int64 [rows], in [0, n); None: each row's argmax, as `argmax_rows` finds it): float32
    logprobs and int64 ids [rows, 1 + min(k, n)], the token's then its row's min(k, n) likeliest, most
    likely first, ties in id order; and int64 ranks [rows], 1 + how many tokens of the row have a
    greater logprob. The logprobs are `log_softmax(logits.float())`'s up to rounding ((x - max) - log
    of the float64 sum of exp(x - max), in float32), computed as they are read, never written. A row
    with a NaN or +inf logit: every logprob NaN, rank 1, its first ids as the top (needs `load()`)."""
    return torch.ops.pagedserve_cpu.logprob_rows(logits, tokens, k)


@functools.cache
def decode_layers_supported() -> bool:
    """Whether `decode_layers` runs here: a build for a CPU with AVX512-BF16 (needs `load()`)."""
    return bool(torch.ops.pagedserve_cpu.decode_layers_supported())


@functools.cache
def linear_amx_supported() -> bool:
    """Whether `linear_amx` runs here: a build for a CPU with AMX bfloat16 tiles, which Linux lets this
    process use (needs `load()`)."""
    return bool(torch.ops.pagedserve_cpu.linear_amx_supported())


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight [N, K] (N and K multiples of 32) reordered once into the AMX tiles `linear_amx`
    reads: [N/16, K/32, 16, 16, 2] (needs `load()`)."""
    return torch.ops.pagedserve_cpu.pack_linear_weight(weight)


def linear_amx(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` in bfloat16 on AMX tiles from `pack_linear_weight(weight)`. Each row's
    result is the same in any batch, and F.linear's for batches of up to 32 rows (needs
    `linear_amx_supported()`)."""
    return torch.ops.pagedserve_cpu.linear_amx(x, packed, bias)


def linear_argmax_amx(
    x: torch.Tensor, packed: torch.Tensor, num_columns: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's argmax over the first `num_columns` outputs of `linear_amx(x, packed, bias)`, as
    `argmax_rows` reads them from its bfloat16 output (the first maximum, NaN first), without writing the
    outputs: greedy sampling from an LM head (needs `linear_amx_supported()`)."""
    return torch.ops.pagedserve_cpu.linear_argmax_amx(x, packed, bias, num_columns)


@functools.cache
def linear_avx512_supported() -> bool:
    """Whether `linear_avx512` runs here: a build for a CPU with AVX512-BF16 (needs `load()`)."""
    return bool(torch.ops.pagedserve_cpu.linear_avx512_supported())


def pack_linear_weight_avx512(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight [N, K] (N a multiple of 32, K even) reordered once into the panels
    `linear_avx512` reads: [N/32, K/2, 32, 2] (needs `load()`)."""
    return torch.ops.pagedserve_cpu.pack_linear_weight_avx512(weight)


def linear_avx512(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` in bfloat16 with AVX512-BF16 dot products from
    `pack_linear_weight_avx512(weight)`: float32 sums over k in order, rounded once, so each row's result
    is the same in any batch (needs `linear_avx512_supported()`)."""
    return torch.ops.pagedserve_cpu.linear_avx512(x, packed, bias)


def linear_argmax_avx512(
    x: torch.Tensor, packed: torch.Tensor, num_columns: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's argmax over the first `num_columns` outputs of `linear_avx512(x, packed, bias)`, as
    `argmax_rows` reads them from its bfloat16 output (the first maximum, NaN first), without writing the
    outputs: greedy sampling from an LM head (needs `linear_avx512_supported()`)."""
    return torch.ops.pagedserve_cpu.linear_argmax_avx512(x, packed, bias, num_columns)


def decode_layers(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    embedding: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    norms: list[torch.Tensor],
    qkv: list[torch.Tensor],
    qkv_bias: list[torch.Tensor],
    qk_norms: list[torch.Tensor],
    o_proj: list[torch.Tensor],
    gate_up: list[torch.Tensor],
    down: list[torch.Tensor],
    final_norm: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    scale: float,
    windows: list[int],
    embedding_scale: float,
    residual_scale: float,
    rotary_layers: list[bool],
) -> torch.Tensor:
    """Every decoder layer of a Llama-family model for a decode-only step, bfloat16 on packed weights
    (`csrc/decode_layers.cpp`): each one in AMX tiles (`pack_linear_weight`, needs
    `linear_amx_supported()`), in AVX512-BF16 panels (`pack_linear_weight_avx512`) or in oneDNN's layout
    (`torch.ops.mkldnn._reorder_linear_weight`);
    `qkv_bias` one a layer or none, `qk_norms` (Qwen3's query and key head norms) two a layer or none,
    `windows` each layer's sliding window (0: none), one a layer; `embedding_scale` and `residual_scale`
    Granite's multipliers of the embeddings and of each layer's attention and MLP outputs before they
    join the residual stream (1: none), each product rounded to bfloat16 as the eager model's;
    `rotary_layers` whether each layer turns q and k, one a layer (SmolLM3's NoPE layers do not).
    `cos_sin_cache` [positions, rotary_dim] turns the first rotary_dim values of each head (even, up to
    head_dim, which the KV caches give: Phi-3's partial rotary below it), the rest pass through.
    The final-normed hidden states [tokens, hidden] (needs `decode_layers_supported()`). Block tables are
    checked as `paged_attention_decode` checks them, before any layer runs."""
    return torch.ops.pagedserve_cpu.decode_layers(
        input_ids,
        positions,
        embedding,
        cos_sin_cache,
        norms,
        qkv,
        qkv_bias,
        qk_norms,
        o_proj,
        gate_up,
        down,
        final_norm,
        k_caches,
        v_caches,
        slot_mapping,
        block_tables,
        context_lens,
        num_heads,
        num_kv_heads,
        eps,
        scale,
        windows,
        embedding_scale,
        residual_scale,
        rotary_layers,
    )
