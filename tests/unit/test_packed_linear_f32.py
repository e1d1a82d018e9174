"""float32 weights are packed into oneDNN's layout on CPUs that are not Intel's (where `F.linear`'s
MKL sgemm copies the whole weight on every call), never into the bf16 kernels' tiles or panels, and
give `F.linear`'s products within float32 rounding; on Intel's CPUs they stay plain. An engine packs
them accordingly and generates the same greedy tokens either way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pagedserve import LLM, SamplingParams
from pagedserve.layers import linear
from pagedserve.layers.embedding import ParallelLMHead
from pagedserve.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")

CPU = torch.device("cpu")


@pytest.fixture
def vendor(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Set the CPU vendor `layers.linear` sees."""

    def set_vendor(name: str) -> None:
        monkeypatch.setattr(linear, "cpu_vendor", lambda: name)

    return set_vendor


@pytest.mark.parametrize(
    ("name", "packs"), [("AuthenticAMD", True), ("HygonGenuine", True), ("GenuineIntel", False), ("", False)]
)
def test_float32_weights_are_packed_on_cpus_other_than_intels(
    vendor: Callable[[str], None], name: str, packs: bool
) -> None:
    vendor(name)
    assert linear.can_pack_weights(CPU, torch.float32) is packs
    assert linear.can_pack_weights(torch.device("meta"), torch.float32) is False
    assert linear.can_pack_weights(CPU, torch.float16) is False


def test_the_vendor_is_read_from_proc_cpuinfo() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        assert linear.cpu_vendor() == ""
        return
    vendors = {
        line.partition(":")[2].strip()
        for line in cpuinfo.read_text().splitlines()
        if line.startswith("vendor_id")
    }
    assert vendors == {linear.cpu_vendor()}


@pytest.mark.parametrize("batch_size", [1, 7, 64, 300])
@pytest.mark.parametrize("kind", ["column", "column_bias", "row", "lm_head"])
def test_packed_float32_layers_equal_f_linear_within_rounding(kind: str, batch_size: int) -> None:
    generator = torch.Generator().manual_seed(batch_size)
    layer = {
        "column": lambda: ColumnParallelLinear(576, 1536),
        "column_bias": lambda: ColumnParallelLinear(576, 192, bias=True),
        "row": lambda: RowParallelLinear(1536, 576),
        "lm_head": lambda: ParallelLMHead(1024, 576),
    }[kind]()
    for param in layer.parameters():
        param.data = torch.randn(param.shape, generator=generator)
    weight = layer.weight.detach().clone()
    bias = None if getattr(layer, "bias", None) is None else layer.bias.detach().clone()  # type: ignore[union-attr]
    x = torch.randn(batch_size, weight.shape[1], generator=generator)
    expected = F.linear(x, weight, bias)
    layer.pack_weights(batch_size_hint=64)  # type: ignore[operator]
    packed = layer.packed_weight
    assert packed is not None and packed.dim() == 2  # oneDNN's layout: the bf16 kernels take no float32
    out = layer.compute_logits(x) if isinstance(layer, ParallelLMHead) else layer(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    if isinstance(layer, LinearBase):
        assert layer.weight.numel() == 0  # the plain copy is released


def test_a_float32_engine_packs_its_weights_by_the_vendor_and_decodes_the_same(
    vendor: Callable[[str], None], tiny_llama_dir: str
) -> None:
    prompts = [[1, *range(100 + 7 * i, 110 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for name in ("AuthenticAMD", "GenuineIntel"):
        vendor(name)
        llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8, enforce_eager=True)
        model = llm.engine.executor.worker.model_runner.model
        packed = [m.packed_weight for m in model.modules() if isinstance(m, LinearBase)]
        packed.append(model.lm_head.packed_weight)
        if name == "GenuineIntel":
            assert all(p is None for p in packed)
        else:
            assert all(p is not None and p.dim() == 2 for p in packed)
        tokens[name] = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    assert tokens["AuthenticAMD"] == tokens["GenuineIntel"]
