"""Tensor-parallel linear layers. Each parameter carries a `weight_loader` that takes the full
checkpoint tensor and keeps this rank's shard, so sharding happens at load time.

Column-parallel splits output features across ranks (no communication); row-parallel splits input
features and all-reduces the partial sums.

On CPUs, bfloat16 weights are packed once (`pack_weights`): an unpacked bf16 `F.linear` reorders its
weight on every call, which costs about as much as the matmul itself at decode batch sizes. Where the
C++ kernels build, the weight goes into the tiles of `pagedserve_kernels.cpu.linear_amx` on CPUs with
AMX (about 1.5x as fast as oneDNN at decode batch sizes), else into the panels of
`pagedserve_kernels.cpu.linear_avx512` on CPUs with AVX512-BF16 for in_features up to 2,048 (1.13-1.75x
as fast as oneDNN from 1 to 128 rows on a Zen 4 EPYC; bench/README.md); else into oneDNN's blocked
layout. A compiled pass reads AMX and oneDNN weights as graph inputs (`packed_before_compiling`); it
leaves weights that would go into panels to inductor, which packs them for oneDNN, and the decode
steps (`decode_layers`), the LM head and eager steps read ours. The AMX product is
bit-identical to `F.linear`'s for up to 32 rows; beyond that oneDNN changes how it sums, while both of
our kernels give each row what they give that row alone.

float32 weights are packed into oneDNN's layout on CPUs that are not Intel's. There `F.linear` runs
MKL's sgemm, which copies the whole weight into a layout of its own on every call (on a Zen 4 EPYC,
`mkl_blas_def_sgemm_scopy_right16_bdz` is 41% of a 4-row LM head's samples): oneDNN's packed product
is 1.3-3.9x as fast at 1-64 rows there (bench/README.md, "float32 weights packed"). It sums in another
order, so its float32 products differ from `F.linear`'s by rounding. On Intel's CPUs, where MKL is
tuned, packing float32 measured slower and stays off.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pagedserve_kernels import cpu as cpu_kernels
from torch import nn

from pagedserve.config import cpuinfo
from pagedserve.distributed import all_reduce, get_tp_rank, get_tp_size

if TYPE_CHECKING:
    from pagedserve.lora import LoRALinear


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _shard(tensor: torch.Tensor, dim: int, num_shards: int, index: int) -> torch.Tensor:
    size = tensor.shape[dim] // num_shards
    return tensor.narrow(dim, index * size, size)


def can_pack_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Packing pays for bfloat16 on CPUs whose oneDNN has native bf16 (AVX-512 / AMX), where it is
    exact, and for float32 on CPUs other than Intel's, where it rounds differently (above)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32 and cpu_vendor() not in ("GenuineIntel", "")


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor id ("GenuineIntel", "AuthenticAMD", ...); "" where /proc/cpuinfo does not say."""
    return cpuinfo("vendor_id")


@functools.cache
def amx_linear_available() -> bool:
    """The C++ kernels build here and the CPU lets them use AMX bfloat16 tiles."""
    return cpu_kernels.load() and cpu_kernels.linear_amx_supported()


def packs_for_amx(weight: torch.Tensor) -> bool:
    """Whether `pack_weight` puts this CPU weight into AMX tiles: it needs bfloat16 and both sizes in
    multiples of 32."""
    out_features, in_features = weight.shape
    return (
        weight.dtype == torch.bfloat16
        and out_features % 32 == 0
        and in_features % 32 == 0
        and amx_linear_available()
    )


@functools.cache
def avx512_linear_available() -> bool:
    """The C++ kernels build here for a CPU with AVX512-BF16 (`pack_weight` prefers AMX tiles where
    there are some)."""
    return cpu_kernels.load() and cpu_kernels.linear_avx512_supported()


# The longest in_features packed for linear_avx512: up to here a panel (in_features x 64 bytes) stays
# in L1/L2 while the row tiles reuse it. On the Zen 4 machine the kernel beat oneDNN at every decode
# batch size up to 1,536; from 2,048 to 4,096 it still wins at 1-16 rows but runs 5-20% behind at 64
# (bench/README.md, "linear_avx512").
MAX_AVX512_IN_FEATURES = 2048


def packs_for_avx512(weight: torch.Tensor) -> bool:
    """Whether `pack_weight` can put this CPU weight into AVX512-BF16 panels: it needs bfloat16, out
    features in multiples of 32 and even in features up to MAX_AVX512_IN_FEATURES."""
    out_features, in_features = weight.shape
    return (
        weight.dtype == torch.bfloat16
        and out_features % 32 == 0
        and in_features % 2 == 0
        and in_features <= MAX_AVX512_IN_FEATURES
        and avx512_linear_available()
    )


def packed_before_compiling(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the weights are packed before a compiled pass is traced, which then reads them as graph
    inputs with the kernels inductor's frozen graph would use: AMX tiles, and oneDNN's layout (through
    `onednn_linear`). Not where AVX512-BF16 panels would take some (made for decode rows, slower than
    oneDNN on prefills): the compiled pass leaves those weights to inductor, which freezes them into
    its graph and packs them for oneDNN; ours are packed after it is compiled, for decode_layers."""
    if not can_pack_weights(device, dtype):
        return False
    return dtype != torch.bfloat16 or amx_linear_available() or not avx512_linear_available()


def pack_weight(weight: torch.Tensor, batch_size_hint: int) -> torch.Tensor:
    """`weight` [out, in] reordered once, for `linear`: into AMX tiles where `packs_for_amx` (a 5-d
    tensor), else into AVX512-BF16 panels where `packs_for_avx512` (4-d), else (float32 too) into
    oneDNN's blocked layout (2-d)."""
    if packs_for_amx(weight):
        return cpu_kernels.pack_linear_weight(weight.detach())
    if packs_for_avx512(weight):
        return cpu_kernels.pack_linear_weight_avx512(weight.detach())
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)


def linear(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, read from `packed` (`pack_weight`) when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.dim() == 5:
        return cpu_kernels.linear_amx(x, packed, bias)
    if packed.dim() == 4:
        return cpu_kernels.linear_avx512(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], None)


# oneDNN's packed weights reached through an index. A tensor in oneDNN's own layout cannot be a graph
# input (torch.compile makes a fake of every input), so without this a compiled pass had to leave those
# weights to inductor and freeze them into its graph as constants, which torch's on-disk caches refuse:
# every start traced, froze and lowered the whole model again (~60 s for the default model in float32 on
# an AVX2 EPYC, bench/README.md, "Start-up"). Through this op the graph's input is the weight's index,
# a 0-d tensor like the attention op's layer index (`layers.attention`), and the graph is the same for
# every model of the same shapes and every start. The registry holds the packed weights weakly: the
# layer that packed one owns it.
_ONEDNN_WEIGHTS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_ONEDNN_INDICES = itertools.count()

# torch.library's low-level API, as for the attention op: `torch.library.custom_op`'s wrapper costs
# ~8 us a call. No alias annotations: the op is functional.
_LIBRARY = torch.library.Library("pagedserve", "FRAGMENT")
_LIBRARY.define("onednn_linear(Tensor x, Tensor weight_index, Tensor? bias, SymInt out_features) -> Tensor")


def _onednn_linear(
    x: torch.Tensor, weight_index: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    packed = _ONEDNN_WEIGHTS[int(weight_index)]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], None)


_LIBRARY.impl("onednn_linear", _onednn_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("pagedserve::onednn_linear", lib=_LIBRARY)
def _(
    x: torch.Tensor, weight_index: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class LinearBase(nn.Module):
    """Holds `weight` [out, in] (this rank's shard); after `pack_weights` the matmul reads the packed copy
    and the plain weight is released."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    packed_weight: torch.Tensor | None = None
    # A weight packed into oneDNN's layout is read through `onednn_linear` by its index there: a
    # buffer (int64, 0-d), so a graph input of a compiled pass.
    onednn_index: torch.Tensor | None
    unpacked_shape: torch.Size  # set by pack_weights
    lora: LoRALinear | None = None  # LoRA adapters' updates (`pagedserve.lora`), when any are loaded

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("onednn_index", None, persistent=False)

    def pack_weights(self, batch_size_hint: int) -> None:
        self.unpacked_shape = self.weight.shape
        self.packed_weight = pack_weight(self.weight, batch_size_hint)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)
        if self.packed_weight.is_mkldnn:
            index = next(_ONEDNN_INDICES)
            _ONEDNN_WEIGHTS[index] = self.packed_weight
            self.onednn_index = torch.tensor(index)

    @property
    def weight_shape(self) -> torch.Size:
        """This rank's [out, in], also once the plain weight is released."""
        return self.unpacked_shape if self.packed_weight is not None else self.weight.shape

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.onednn_index is not None:
            return torch.ops.pagedserve.onednn_linear(x, self.onednn_index, bias, self.unpacked_shape[0])
        return linear(x, self.weight, self.packed_weight, bias)


def check_head_split(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Query heads split evenly; KV heads split evenly, or each replicated on tp_size / num_kv_heads ranks."""
    if num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size: {tp_size} does not divide the {num_heads} attention heads")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size: {tp_size} neither divides nor is a multiple of the {num_kv_heads} KV heads"
        )


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        if output_size % self.tp_size:
            raise ValueError(
                f"tensor_parallel_size: {self.tp_size} does not divide the output size {output_size}"
            )
        self.weight = _param(output_size // self.tp_size, input_size)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias = _param(output_size // self.tp_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(_shard(loaded, 0, self.tp_size, self.tp_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.bias)
        return out if self.lora is None else self.lora.add_to(x, out)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        # each projection is sharded on its own, so each must split evenly (not just their sum)
        for size in output_sizes:
            if size % self.tp_size:
                raise ValueError(
                    f"tensor_parallel_size: {self.tp_size} does not divide the output size {size}"
                )
        self.output_sizes = output_sizes

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        param.data.narrow(0, offset, size).copy_(_shard(loaded, 0, self.tp_size, self.tp_rank))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul. Query heads are split across ranks; KV heads too, or
    replicated when there are more ranks than KV heads (each rank keeps the KV head its queries use)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp_size = get_tp_size()
        check_head_split(num_heads, num_kv_heads, tp_size)
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.num_kv_head_replicas = max(1, tp_size // num_kv_heads)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        shard_index = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, shard_index * size, size))


class RowParallelLinear(LinearBase):
    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True
    ) -> None:
        """`reduce_results=False` leaves each rank its partial sums, for a caller that adds several
        layers' before one all-reduce (the experts of `layers.moe`); rank 0 alone adds the bias to
        its partial sums then, so that the sum holds it once."""
        super().__init__()
        self.reduce_results = reduce_results
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        if input_size % self.tp_size:
            raise ValueError(
                f"tensor_parallel_size: {self.tp_size} does not divide the input size {input_size}"
            )
        self.weight = _param(output_size, input_size // self.tp_size)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias = _param(output_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self._bias_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(_shard(loaded, 1, self.tp_size, self.tp_rank))

    def _bias_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # the bias in the product, rounded once with it (F.linear's, PEFT's base)
            out = self.matmul(x, self.bias)
            return out if self.lora is None else self.lora.add_to(x, out)
        out = self.matmul(x)
        if self.lora is not None:  # this rank's share of the update, summed with the product's
            out = self.lora.add_to(x, out)
        if not self.reduce_results:
            return out if self.bias is None or self.tp_rank else out + self.bias
        out = all_reduce(out)
        return out if self.bias is None else out + self.bias


class ReplicatedLinear(LinearBase):
    """A whole weight [out, in] on every rank, for small layers every rank needs whole (a mixture of
    experts' router)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(output_size, input_size)
        self.bias = _param(output_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)
