"""The fused mixture-of-experts kernels against the pure-torch reference (odd hidden and intermediate
sizes, top-1 to top-3, experts with no tokens, one token, several blocks per expert), the expert
alignment on its own, the launchers' argument checks, the reference against the serving path
(`pagedserve.layers.moe.run_experts`), and GPT-OSS's experts (biases, clamped SwiGLU): the reference
against transformers' `GptOssExperts`.

Tolerances: float32 atol = rtol = 1e-5 (the kernel sums its products in another order than torch's
matmul: observed errors below 1e-6 on outputs of magnitude 1). float16 atol = rtol = 1e-3, about one
float16 ulp at the outputs' magnitude, and at least 99% of the outputs (all but one of a small output)
bitwise equal: the kernel rounds where the reference does, so only the summation order differs.
bfloat16 atol = rtol = 5e-2: the
interpreter truncates float32 to bfloat16 where torch rounds to nearest, at each of the five rounding
points (gate and up, silu, h, the expert's output, the sum), each a bias of up to one ulp (2^-7 relative)
toward zero that the down projection sums over (observed up to 0.04 on outputs near 2). On a GPU
bfloat16 rounds to nearest and the errors are smaller. GPT-OSS's clamped SwiGLU rounds at five more
points (the clamps, alpha * gate, the sigmoid, gate * sigmoid, up + 1) and on larger values (the
gates scaled so the clamps bind, h up to 7 * 8): bfloat16 atol 1e-1 there (48 random draws needed up
to 0.06 beside rtol 5e-2). The interpreter's output there was checked bitwise equal to the
reference's ops with truncation in place of rounding to nearest, so the whole gap is the truncation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch
from pagedserve.layers.moe import Expert, run_experts
from pagedserve_kernels import moe, reference
from torch import nn

if TYPE_CHECKING:  # imported where used: transformers' modeling costs ~2 s at every collection
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 5e-2, "rtol": 5e-2},
}
SWIGLU_OAI_TOLERANCES = {**TOLERANCES, torch.bfloat16: {"atol": 1e-1, "rtol": 5e-2}}
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
# (tokens, hidden, intermediate, experts, top_k, unused experts). The kernels' tiles are 64 columns
# by 32 of the reduction (BLOCK_M 16 to 64 rows): no size here is a multiple of them, and hidden 72
# takes two column tiles in the down projection and three reduction steps in gate/up.
CASES = [
    pytest.param(5, 72, 40, 4, 2, (), id="top2"),
    pytest.param(1, 72, 40, 4, 1, (), id="one-token-top1"),
    pytest.param(7, 40, 24, 6, 3, (1, 4), id="top3-idle-experts"),
    pytest.param(40, 48, 20, 4, 1, (1, 2), id="several-blocks-per-expert"),  # 16-row blocks, ~20 rows each
]


def make_routing(
    num_tokens: int, num_experts: int, top_k: int, unused: tuple[int, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router weights (float32, each token's summing to one) and top_k distinct experts per token,
    as `layers.moe.route` gives them, never choosing the `unused` experts."""
    logits = torch.randn(num_tokens, num_experts, device=device)
    logits[:, list(unused)] = float("-inf")
    weights, expert_ids = logits.softmax(-1).topk(top_k)
    return weights / weights.sum(-1, keepdim=True), expert_ids


def make_experts(
    num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] and w2 [E, H, I], scaled so each product has unit variance."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device=device) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden", "inter", "num_experts", "top_k", "unused"), CASES)
def test_fused_moe_matches_reference(
    num_tokens: int,
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
    unused: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    w13, w2 = make_experts(num_experts, hidden, inter, dtype, device)
    weights, expert_ids = make_routing(num_tokens, num_experts, top_k, unused, device)
    out = moe.fused_moe(x, w13, w2, weights, expert_ids)
    expected = reference.fused_moe_reference(x, w13, w2, weights, expert_ids)
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])
    if dtype == torch.float16:
        assert_mostly_bitwise_equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden", "inter", "num_experts", "top_k", "unused"), CASES[:2])
def test_fused_moe_weighted_inputs_matches_reference(
    num_tokens: int,
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
    unused: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Llama 4's experts: each pair's weight scales the expert's input (rounded to x's dtype, the
    product too), its output summed unweighted; weights away from one, so that the kernel weighting
    the output instead (or not at all) is told apart."""
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    w13, w2 = make_experts(num_experts, hidden, inter, dtype, device)
    weights, expert_ids = make_routing(num_tokens, num_experts, top_k, unused, device)
    weights = torch.sigmoid(torch.randn_like(weights) * 2)  # (Llama 4's: a sigmoid a pair)
    out = moe.fused_moe(x, w13, w2, weights, expert_ids, weighted_inputs=True)
    expected = reference.fused_moe_reference(x, w13, w2, weights, expert_ids, weighted_inputs=True)
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])
    weighted_outputs = reference.fused_moe_reference(x, w13, w2, weights, expert_ids)
    assert not torch.allclose(weighted_outputs.float(), expected.float(), **TOLERANCES[dtype])


def assert_mostly_bitwise_equal(out: torch.Tensor, expected: torch.Tensor) -> None:
    """At most 1% of the outputs (or one, of a small output) differ: an ulp from the summation order."""
    assert int((out != expected).sum()) <= max(1, expected.numel() // 100)


def test_fused_moe_int32_expert_ids(device: torch.device) -> None:
    x = torch.randn(6, 40, device=device)
    w13, w2 = make_experts(3, 40, 24, torch.float32, device)
    weights, expert_ids = make_routing(6, 3, 2, (), device)
    out = moe.fused_moe(x, w13, w2, weights, expert_ids.int())
    expected = reference.fused_moe_reference(x, w13, w2, weights, expert_ids)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def test_fused_moe_no_tokens(device: torch.device) -> None:
    w13, w2 = make_experts(3, 40, 24, torch.float32, device)
    weights, expert_ids = make_routing(0, 3, 2, (), device)
    out = moe.fused_moe(torch.randn(0, 40, device=device), w13, w2, weights, expert_ids)
    assert out.shape == (0, 40)


@pytest.mark.parametrize(
    "dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
)
def test_reference_is_the_serving_path(dtype: torch.dtype) -> None:
    """`run_experts` on `Expert`s loaded as a checkpoint loads them (gate_proj as gate_up_proj's shard
    0, up_proj as shard 1) gives the reference's output to the bit: the same linears, rounded in the
    model's dtype, weighted and summed in float32 in the same order."""
    num_tokens, hidden, inter, num_experts = 9, 40, 24, 5
    x = torch.randn(num_tokens, hidden).to(dtype)
    w13, w2 = make_experts(num_experts, hidden, inter, dtype, torch.device("cpu"))
    weights, expert_ids = make_routing(num_tokens, num_experts, 2, (3,), torch.device("cpu"))
    experts = [Expert(hidden, inter).to(dtype) for _ in range(num_experts)]
    for expert, gate_up, down in zip(experts, w13, w2, strict=True):
        expert.gate_up_proj.weight_loader(expert.gate_up_proj.weight, gate_up[:inter], 0)
        expert.gate_up_proj.weight_loader(expert.gate_up_proj.weight, gate_up[inter:], 1)
        expert.down_proj.weight_loader(expert.down_proj.weight, down)
    expected = run_experts(nn.ModuleList(experts), x, weights, expert_ids)
    torch.testing.assert_close(
        reference.fused_moe_reference(x, w13, w2, weights, expert_ids), expected, atol=0, rtol=0
    )
    # and Llama 4's weighted inputs
    expected = run_experts(nn.ModuleList(experts), x, weights, expert_ids, weighted_inputs=True)
    torch.testing.assert_close(
        reference.fused_moe_reference(x, w13, w2, weights, expert_ids, weighted_inputs=True),
        expected,
        atol=0,
        rtol=0,
    )


# -- GPT-OSS's experts: biases and the clamped SwiGLU ----------------------------------------------
# Weights scaled so the gate/up projections have a standard deviation near 5: about 8% of the gates
# exceed the limit 7 and 15% of the ups lie outside [-7, 7], so every clamp binds somewhere.
GPT_OSS_SCALE = 5.0
ALPHA, LIMIT = 1.702, 7.0  # GptOssConfig's swiglu_alpha and swiglu_limit


def assert_clamps_bind(gate_up: torch.Tensor) -> None:
    """Some gates above the limit, some ups above it and some below -limit ([..., 2I], gate first)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert (gate > LIMIT).any() and (up > LIMIT).any() and (up < -LIMIT).any()


def transformers_apply_gate(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """A transcription of transformers' `GptOssExperts._apply_gate` (gate and up interleaved)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's interleaved gate/up columns [..., 2I] (gate 2i, up 2i + 1) as ours: gates, then ups."""
    return torch.cat((t[..., ::2], t[..., 1::2]), dim=-1)


@pytest.mark.parametrize(
    "dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
)
def test_swiglu_oai_and_mul_matches_transformers(dtype: torch.dtype) -> None:
    """The reference's clamped SwiGLU is transformers' to the bit: the same ops in the same order,
    each rounded to the input's dtype (the transcription checked against the module's own method)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    gate_up = (torch.randn(6, 2 * 20) * GPT_OSS_SCALE).to(dtype)
    assert_clamps_bind(deinterleave(gate_up))
    expected = transformers_apply_gate(gate_up, ALPHA, LIMIT)
    experts = GptOssExperts(gpt_oss_config(hidden=8, inter=20, num_experts=1, top_k=1))
    torch.testing.assert_close(experts._apply_gate(gate_up), expected, atol=0, rtol=0)
    out = reference.swiglu_oai_and_mul(deinterleave(gate_up), ALPHA, LIMIT)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def gpt_oss_config(hidden: int, inter: int, num_experts: int, top_k: int) -> GptOssConfig:
    """A tiny GPT-OSS config (only its experts' sizes and SwiGLU constants matter here)."""
    from transformers import GptOssConfig

    config = GptOssConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        swiglu_limit=LIMIT,
        swiglu_alpha=ALPHA,
    )
    config._experts_implementation = "eager"  # the module's own loop over experts (None warns)
    return config


def build_gpt_oss_experts(
    hidden: int, inter: int, num_experts: int, top_k: int
) -> tuple[GptOssExperts, GptOssTopKRouter]:
    """transformers' GPT-OSS experts and router with random parameters (biases included), in float32."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    config = gpt_oss_config(hidden, inter, num_experts, top_k)
    experts, router = GptOssExperts(config), GptOssTopKRouter(config)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(num_experts, hidden, 2 * inter) * GPT_OSS_SCALE / hidden**0.5)
        experts.gate_up_proj_bias.copy_(torch.randn(num_experts, 2 * inter))
        experts.down_proj.copy_(torch.randn(num_experts, inter, hidden) / inter**0.5)
        experts.down_proj_bias.copy_(torch.randn(num_experts, hidden))
        router.weight.copy_(torch.randn(num_experts, hidden))
        router.bias.copy_(torch.randn(num_experts))
    return experts, router


def test_reference_matches_transformers_gpt_oss_experts() -> None:
    """`fused_moe_reference` with GPT-OSS's biases and clamped SwiGLU, its weights converted to our
    layout (gate/up de-interleaved, both projections transposed to [out, in]), gives transformers'
    `GptOssExperts` output under the model's own top-k routing. float32: both sum the weighted
    experts in float32 in expert order, so only the matmuls' summation order differs."""
    num_tokens, hidden, inter, num_experts, top_k = 11, 40, 24, 6, 2
    experts, router = build_gpt_oss_experts(hidden, inter, num_experts, top_k)
    x = torch.randn(num_tokens, hidden)
    with torch.no_grad():
        _, weights, expert_ids = router(x)
        expected = experts(x, router_indices=expert_ids, routing_weights=weights)
        w13 = deinterleave(experts.gate_up_proj).transpose(1, 2).contiguous()  # [E, 2I, H]
        w13_bias = deinterleave(experts.gate_up_proj_bias)
        w2 = experts.down_proj.transpose(1, 2).contiguous()  # [E, H, I]
        gate_up = torch.einsum("th,enh->ten", x, w13) + w13_bias  # [T, E, 2I]
        assert_clamps_bind(gate_up[torch.arange(num_tokens)[:, None], expert_ids])  # the routed pairs'
        out = reference.fused_moe_reference(
            x,
            w13,
            w2,
            weights,
            expert_ids,
            w13_bias=w13_bias,
            w2_bias=experts.down_proj_bias,
            activation="swiglu_oai",
            swiglu_alpha=ALPHA,
            swiglu_limit=LIMIT,
        )
    assert len(expert_ids.unique()) > 1
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_fused_moe_reference_rejects_an_unknown_activation() -> None:
    w13, w2 = make_experts(3, 40, 24, torch.float32, torch.device("cpu"))
    weights, expert_ids = make_routing(6, 3, 2, (), torch.device("cpu"))
    with pytest.raises(ValueError, match="activation: expected one of"):
        reference.fused_moe_reference(torch.randn(6, 40), w13, w2, weights, expert_ids, activation="gelu")


def make_gpt_oss_experts(
    num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device, scale: float
) -> dict[str, torch.Tensor]:
    """w13, w2 and their biases (unit normal), w13 scaled by `scale` (GPT_OSS_SCALE: the clamps bind)
    and w2 scaled back, so the outputs stay near unit size (the tolerances are set for that)."""
    w13, w2 = make_experts(num_experts, hidden, inter, torch.float32, device)
    return {
        "w13": (w13 * scale).to(dtype),
        "w2": (w2 / scale).to(dtype),
        "w13_bias": torch.randn(num_experts, 2 * inter, device=device).to(dtype),
        "w2_bias": torch.randn(num_experts, hidden, device=device).to(dtype),
    }


# (activation, biases): GPT-OSS's experts, then each new part on its own
VARIANTS = [
    pytest.param("swiglu_oai", ("w13_bias", "w2_bias"), id="gpt-oss"),
    pytest.param("swiglu_oai", (), id="swiglu_oai"),
    pytest.param("silu", ("w13_bias",), id="silu-w13_bias"),
    pytest.param("silu", ("w2_bias",), id="silu-w2_bias"),
    pytest.param("gelu_tanh", (), id="gelu_tanh"),  # (Gemma 4's experts)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("activation", "biases"), VARIANTS)
@pytest.mark.parametrize(("num_tokens", "hidden", "inter", "num_experts", "top_k", "unused"), CASES)
def test_fused_moe_gpt_oss_matches_reference(
    num_tokens: int,
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
    unused: tuple[int, ...],
    activation: str,
    biases: tuple[str, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Large gate/up values for the clamped SwiGLU (SiLU's products at unit size: bfloat16's error,
    see the top, grows with them)."""
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    scale = GPT_OSS_SCALE if activation == "swiglu_oai" else 1.0
    experts = make_gpt_oss_experts(num_experts, hidden, inter, dtype, device, scale)
    weights, expert_ids = make_routing(num_tokens, num_experts, top_k, unused, device)
    if activation == "swiglu_oai" and num_tokens > 1:  # (one token's few values may not reach 7)
        gate_up = torch.einsum("th,enh->ten", x.float(), experts["w13"].float()) + experts["w13_bias"].float()
        assert_clamps_bind(gate_up[torch.arange(num_tokens, device=device)[:, None], expert_ids])
    kwargs = {"activation": activation, **{name: experts[name] for name in biases}}
    out = moe.fused_moe(x, experts["w13"], experts["w2"], weights, expert_ids, **kwargs)
    expected = reference.fused_moe_reference(x, experts["w13"], experts["w2"], weights, expert_ids, **kwargs)
    assert out.shape == expected.shape and out.dtype == dtype
    tolerances = SWIGLU_OAI_TOLERANCES if activation == "swiglu_oai" else TOLERANCES
    torch.testing.assert_close(out.float(), expected.float(), **tolerances[dtype])
    if dtype == torch.float16:  # every rounding point where the reference's: almost all bits agree
        assert_mostly_bitwise_equal(out, expected)


def test_fused_moe_swiglu_oai_takes_alpha_and_limit(device: torch.device) -> None:
    """A model's own alpha and limit (runtime scalars of the kernel) reach the activation: a limit
    of 2.5 binds far more often than 7, and alpha 1 is a plain SiLU of the clamped gate."""
    x = torch.randn(9, 40, device=device)
    experts = make_gpt_oss_experts(4, 40, 24, torch.float32, device, GPT_OSS_SCALE)
    weights, expert_ids = make_routing(9, 4, 2, (), device)
    kwargs = {**experts, "activation": "swiglu_oai", "swiglu_alpha": 1.0, "swiglu_limit": 2.5}
    out = moe.fused_moe(x, weights=weights, expert_ids=expert_ids, **kwargs)
    expected = reference.fused_moe_reference(x, weights=weights, expert_ids=expert_ids, **kwargs)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    default = reference.fused_moe_reference(
        x, weights=weights, expert_ids=expert_ids, **experts, activation="swiglu_oai"
    )
    assert (default - expected).abs().max() > 0.1  # the scalars matter at these values


# -- align_by_expert ------------------------------------------------------------------------------


def test_align_by_expert_example(device: torch.device) -> None:
    """The example drawn at the top of moe.py: pairs 1, 4 go to expert 0, pairs 0, 2, 3 to expert 2;
    each run padded to 4 rows with 5 (= T*k), no block for idle expert 1, the rest padding."""
    expert_ids = torch.tensor([[2], [0], [2], [2], [0]], device=device)
    sorted_pair_ids, block_expert_ids, num_valid_rows = moe.align_by_expert(expert_ids, 3, 4)
    # bound: 5 pairs + 3 experts * 3 padding rows = 14, rounded up to 16
    assert sorted_pair_ids.tolist() == [1, 4, 5, 5, 0, 2, 3, 5] + [5] * 8
    assert block_expert_ids.tolist() == [0, 2, -1, -1]
    assert num_valid_rows.tolist() == [8]
    assert sorted_pair_ids.dtype == block_expert_ids.dtype == num_valid_rows.dtype == torch.int32


@pytest.mark.parametrize("block_m", [16, 32])
def test_align_by_expert_groups_every_pair_once(block_m: int, device: torch.device) -> None:
    num_tokens, top_k, num_experts = 37, 3, 8
    _, expert_ids = make_routing(num_tokens, num_experts, top_k, (2, 5), device)
    sorted_pair_ids, block_expert_ids, num_valid_rows = moe.align_by_expert(expert_ids, num_experts, block_m)
    num_pairs, valid = expert_ids.numel(), int(num_valid_rows)
    pair_experts = expert_ids.flatten().tolist()
    assert len(sorted_pair_ids) == moe.max_padded_rows(num_pairs, num_experts, block_m)
    assert len(block_expert_ids) * block_m == len(sorted_pair_ids)

    rows = sorted_pair_ids.tolist()
    assert sorted(p for p in rows if p < num_pairs) == list(range(num_pairs))  # every pair once
    assert all(p == num_pairs for p in rows[valid:])  # past the valid rows, only padding
    counts = torch.bincount(expert_ids.flatten(), minlength=num_experts).tolist()
    assert valid == sum(-(-count // block_m) * block_m for count in counts)

    blocks = block_expert_ids.tolist()
    assert all(e == -1 for e in blocks[valid // block_m :])
    valid_blocks = blocks[: valid // block_m]
    assert valid_blocks == sorted(valid_blocks) and 2 not in valid_blocks and 5 not in valid_blocks
    for block, expert in enumerate(valid_blocks):
        block_rows = rows[block * block_m : (block + 1) * block_m]
        pairs = [p for p in block_rows if p < num_pairs]
        assert pairs and all(pair_experts[p] == expert for p in pairs)  # one expert a block
        assert block_rows == pairs + [num_pairs] * (block_m - len(pairs))  # padding at a run's end
        assert pairs == sorted(pairs)  # stable: a run keeps the pairs' order


def test_align_by_expert_shapes_depend_on_sizes_only() -> None:
    """On the meta device (shapes, no data) the alignment still runs: it never reads a value back
    to the host nor sizes a tensor by one, so a CUDA graph can capture it."""
    expert_ids = torch.empty(37, 3, dtype=torch.int64, device="meta")
    sorted_pair_ids, block_expert_ids, num_valid_rows = moe.align_by_expert(expert_ids, 8, 16)
    bound = moe.max_padded_rows(37 * 3, 8, 16)
    assert bound == 111 + 8 * 15 + 9  # 231 rounded up to 240
    assert sorted_pair_ids.shape == (bound,) and block_expert_ids.shape == (bound // 16,)
    assert num_valid_rows.shape == (1,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode needs a GPU")
@pytest.mark.parametrize("gpt_oss", [pytest.param(False, id="silu"), pytest.param(True, id="gpt-oss")])
def test_fused_moe_never_syncs(gpt_oss: bool) -> None:
    """No host read, GPT-OSS's biases and activation included (its checks read no tensor)."""
    x = torch.randn(5, 72, device="cuda")
    experts = make_gpt_oss_experts(4, 72, 40, torch.float32, torch.device("cuda"), GPT_OSS_SCALE)
    if not gpt_oss:
        experts = {"w13": experts["w13"], "w2": experts["w2"]}
    kwargs = {**experts, "activation": "swiglu_oai" if gpt_oss else "silu"}
    weights, expert_ids = make_routing(5, 4, 2, (), torch.device("cuda"))
    moe.fused_moe(x, weights=weights, expert_ids=expert_ids, **kwargs)  # compiles outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe.fused_moe(x, weights=weights, expert_ids=expert_ids, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# -- argument checks ------------------------------------------------------------------------------


def good_moe_args(device: torch.device) -> dict[str, torch.Tensor]:
    w13, w2 = make_experts(3, 40, 24, torch.float32, device)
    weights, expert_ids = make_routing(6, 3, 2, (), device)
    return {
        "x": torch.randn(6, 40, device=device),
        "w13": w13,
        "w2": w2,
        "weights": weights,
        "expert_ids": expert_ids,
    }


def bad_moe_args(device: torch.device) -> dict[str, dict]:
    """fused_moe's arguments, each set with one problem, keyed by the error it must raise."""
    good = good_moe_args(device)
    w13, w2, weights, expert_ids = good["w13"], good["w2"], good["weights"], good["expert_ids"]
    b13, b2 = torch.randn(3, 48, device=device), torch.randn(3, 40, device=device)
    return {
        "x: dtype": {**good, "x": good["x"].int()},
        "x: expected 2 dimensions": {**good, "x": good["x"][None]},
        "x: must be contiguous": {**good, "x": torch.randn(6, 80, device=device)[:, ::2]},
        "w13: dtype torch.float16 must be x's dtype": {**good, "w13": w13.half()},
        "w13: expected shape": {**good, "w13": w13[:, :, :32].contiguous()},
        r"w13: expected \[experts": {**good, "w13": w13[:, :47].contiguous()},
        "w13: expected 3 dimensions": {**good, "w13": w13[0]},
        "w2: dtype torch.bfloat16 must be x's dtype": {**good, "w2": w2.bfloat16()},
        "w2: expected shape": {**good, "w2": w2[:, :, :16].contiguous()},
        "w2: must be contiguous": {**good, "w2": w2.transpose(1, 2).contiguous().transpose(1, 2)},
        "weights: dtype": {**good, "weights": weights.bfloat16()},
        "weights: expected shape": {**good, "weights": weights[:5]},
        "expert_ids: dtype": {**good, "expert_ids": expert_ids.float()},
        "expert_ids: expected shape": {**good, "expert_ids": expert_ids[:, :1].contiguous()},
        "expert_ids: must be contiguous": {**good, "expert_ids": expert_ids.t().contiguous().t()},
        # the device check names every tensor and its device
        "weights.*meta": {**good, "weights": weights.to("meta")},
        # GPT-OSS's biases and activation
        "w13_bias: dtype torch.float16 must be x's dtype": {**good, "w13_bias": b13.half()},
        "w13_bias: expected shape": {**good, "w13_bias": b13[:, :47].contiguous()},
        "w13_bias: expected 2 dimensions": {**good, "w13_bias": b13[None]},
        "w13_bias: must be contiguous": {**good, "w13_bias": b13.t().contiguous().t()},
        "w13_bias.*meta": {**good, "w13_bias": b13.to("meta")},
        "w2_bias: dtype torch.bfloat16 must be x's dtype": {**good, "w2_bias": b2.bfloat16()},
        "w2_bias: dtype torch.int32 not in": {**good, "w2_bias": b2.int()},
        "w2_bias: expected a torch.Tensor": {**good, "w2_bias": b2.tolist()},
        "w2_bias: expected shape": {**good, "w2_bias": b2[:2]},
        "w2_bias: must be contiguous": {**good, "w2_bias": b2.t().contiguous().t()},
        "activation: expected one of": {**good, "activation": "gelu"},
        "swiglu_alpha: must be finite, got nan": {**good, "swiglu_alpha": float("nan")},
        "swiglu_limit: must be positive and finite, got 0.0": {**good, "swiglu_limit": 0.0},
        "swiglu_limit: must be positive and finite, got -7": {**good, "swiglu_limit": -7},
        "swiglu_limit: must be positive and finite, got inf": {**good, "swiglu_limit": float("inf")},
        "swiglu_limit: must be positive and finite, got nan": {**good, "swiglu_limit": float("nan")},
        "swiglu_limit: must be positive and finite, got True": {**good, "swiglu_limit": True},
    }


@pytest.mark.parametrize("problem", list(bad_moe_args(torch.device("cpu"))))
def test_fused_moe_rejects_bad_arguments(problem: str, device: torch.device) -> None:
    """A bad argument fails in the launcher with a ValueError naming it, not inside the kernel."""
    with pytest.raises(ValueError, match=problem):
        moe.fused_moe(**bad_moe_args(device)[problem])


def test_fused_moe_rejects_cpu_tensors_outside_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without TRITON_INTERPRET (read when the launcher runs), CPU tensors are refused by name."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="x: on cpu; Triton kernels need CUDA tensors"):
        moe.fused_moe(**good_moe_args(torch.device("cpu")))


@pytest.mark.parametrize(
    ("problem", "args"),
    [
        ("expert_ids: dtype", (torch.zeros(4, 2), 3, 16)),
        ("expert_ids: expected 2 dimensions", (torch.zeros(8, dtype=torch.int64), 3, 16)),
        ("num_experts: must be positive", (torch.zeros(4, 2, dtype=torch.int64), 0, 16)),
        ("block_m: must be positive", (torch.zeros(4, 2, dtype=torch.int64), 3, 0)),
    ],
)
def test_align_by_expert_rejects_bad_arguments(problem: str, args: tuple, device: torch.device) -> None:
    with pytest.raises(ValueError, match=problem):
        moe.align_by_expert(args[0].to(device), *args[1:])
