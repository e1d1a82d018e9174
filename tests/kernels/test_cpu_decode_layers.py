"""Every decoder layer of a decode step in one C++ call (`pagedserve_kernels.cpu.decode_layers`) against
the same layers composed from the torch references (`pagedserve_kernels.reference`) and F.linear:
hidden states within bfloat16 rounding, the KV cache written at the step's slots, layers under sliding
windows of their own, and the inputs it refuses. Runs where the build has it (CPUs with AVX512-BF16),
on weights packed as the engine packs them there (AMX tiles where the CPU has them, else AVX512-BF16
panels), and on every layout it can.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from pagedserve_kernels import cpu, reference

pytestmark = [
    pytest.mark.skipif(
        shutil.which("c++") is None and shutil.which("g++") is None,
        reason="no C++ compiler to build the kernel",
    ),
    pytest.mark.skipif("not cpu.load() or not cpu.decode_layers_supported()", reason="no AVX512-BF16 build"),
]
PACKINGS = [
    pytest.param(
        "amx",
        marks=pytest.mark.skipif("not cpu.load() or not cpu.linear_amx_supported()", reason="no AMX bf16"),
    ),
    pytest.param(
        "avx512",
        marks=pytest.mark.skipif(
            "not cpu.load() or not cpu.linear_avx512_supported()", reason="no AVX512-BF16"
        ),
    ),
    pytest.param(
        "onednn",
        marks=pytest.mark.skipif(
            "not torch.ops.mkldnn._is_mkldnn_bf16_supported()", reason="no oneDNN bf16 here"
        ),
    ),
]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 64, 4, 2, 16, 96, 2
BLOCK_SIZE, NUM_BLOCKS, EPS = 8, 160, 1e-5


@dataclass
class Model:
    embedding: torch.Tensor
    norms: list[torch.Tensor]
    qkv: list[torch.Tensor]
    qkv_bias: list[torch.Tensor]
    qk_norms: list[torch.Tensor]  # Qwen3's query and key head norms, two a layer, or none
    o_proj: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    final_norm: torch.Tensor
    cos_sin_cache: torch.Tensor


def bf16(*shape: int, scale: float = 0.1) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(torch.bfloat16)


def make_model(
    qkv_bias: bool, head_dim: int = HEAD_DIM, qk_norms: bool = False, rotary_dim: int | None = None
) -> Model:
    """Random layers; the rotary table over each head's first `rotary_dim` values (by default all)."""
    torch.manual_seed(0)
    qkv_size = (HEADS + 2 * KV_HEADS) * head_dim
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(256).float()[:, None] * inv_freq[None, :]
    return Model(
        embedding=bf16(1000, HIDDEN, scale=1.0),
        norms=[1 + bf16(HIDDEN) for _ in range(2 * LAYERS)],
        qkv=[bf16(qkv_size, HIDDEN) for _ in range(LAYERS)],
        qkv_bias=[bf16(qkv_size) for _ in range(LAYERS)] if qkv_bias else [],
        qk_norms=[1 + bf16(head_dim, scale=0.5) for _ in range(2 * LAYERS)] if qk_norms else [],
        o_proj=[bf16(HIDDEN, HEADS * head_dim) for _ in range(LAYERS)],
        gate_up=[bf16(2 * INTER, HIDDEN) for _ in range(LAYERS)],
        down=[bf16(HIDDEN, INTER) for _ in range(LAYERS)],
        final_norm=1 + bf16(HIDDEN),
        cos_sin_cache=torch.cat((freqs.cos(), freqs.sin()), dim=-1),
    )


def make_step(num_seqs: int, head_dim: int = HEAD_DIM) -> dict[str, torch.Tensor]:
    """A decode step: sequence i has 5 + (7 i mod 27) tokens (its new token last) in blocks 4 i .. 4 i + 3."""
    context_lens = torch.tensor([5 + (7 * i) % 27 for i in range(num_seqs)], dtype=torch.int32)
    tables = torch.arange(num_seqs * 4, dtype=torch.int32).view(num_seqs, 4)
    positions = context_lens.long() - 1
    slots = (
        tables[torch.arange(num_seqs), positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    )
    caches = [bf16(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, head_dim, scale=1.0) for _ in range(2 * LAYERS)]
    return {
        "input_ids": torch.randint(0, 1000, (num_seqs,)),
        "positions": positions,
        "slot_mapping": slots,
        "block_tables": tables,
        "context_lens": context_lens,
        "k_caches": caches[:LAYERS],
        "v_caches": caches[LAYERS:],
    }


def pack(weight: torch.Tensor, packing: str | None) -> torch.Tensor:
    """`weight` as `layers.linear.pack_weight` packs it: into AMX tiles, AVX512-BF16 panels or oneDNN's
    layout (by default the one the engine picks on this CPU)."""
    if packing is None:
        packing = "amx" if cpu.linear_amx_supported() else "avx512"
    if packing == "amx":
        return cpu.pack_linear_weight(weight)
    if packing == "avx512":
        return cpu.pack_linear_weight_avx512(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


def run_kernel(
    model: Model,
    step: dict,
    head_dim: int = HEAD_DIM,
    packing: str | None = None,
    num_kv_heads: int = KV_HEADS,
    windows: list[int] | None = None,
    embedding_scale: float = 1.0,
    residual_scale: float = 1.0,
    rotary_layers: list[bool] | None = None,
) -> torch.Tensor:
    return cpu.decode_layers(
        step["input_ids"],
        step["positions"],
        model.embedding,
        model.cos_sin_cache,
        model.norms,
        [pack(w, packing) for w in model.qkv],
        model.qkv_bias,
        model.qk_norms,
        [pack(w, packing) for w in model.o_proj],
        [pack(w, packing) for w in model.gate_up],
        [pack(w, packing) for w in model.down],
        model.final_norm,
        step["k_caches"],
        step["v_caches"],
        step["slot_mapping"],
        step["block_tables"],
        step["context_lens"],
        HEADS,
        num_kv_heads,
        EPS,
        head_dim**-0.5,
        [0] * LAYERS if windows is None else windows,
        embedding_scale,
        residual_scale,
        [True] * LAYERS if rotary_layers is None else rotary_layers,
    )


def run_reference(
    model: Model,
    step: dict,
    head_dim: int = HEAD_DIM,
    windows: list[int] | None = None,
    embedding_scale: float = 1.0,
    residual_scale: float = 1.0,
    rotary_layers: list[bool] | None = None,
) -> torch.Tensor:
    """The model's layers as the eager model runs them (`LlamaDecoderLayer.forward`), on the torch
    references: layer l's attention under `windows[l]` (by default none), its q and k turned where
    `rotary_layers[l]` (by default every layer), over each head's first rotary_dim values (the rotary
    table's width); the embeddings times `embedding_scale` and each attention and MLP output times
    `residual_scale` in bfloat16 (Granite's, where they are not 1)."""
    q_size, kv_size = HEADS * head_dim, KV_HEADS * head_dim
    cos, sin = reference.rotary_cos_sin(step["positions"], model.cos_sin_cache, torch.bfloat16)
    hidden = model.embedding[step["input_ids"]]
    if embedding_scale != 1.0:
        hidden = hidden * embedding_scale
    residual = None
    for layer in range(LAYERS):
        weight = model.norms[2 * layer]
        if residual is None:
            residual, hidden = hidden, reference.rms_norm(hidden, weight, EPS)
        else:
            hidden, residual = reference.fused_add_rms_norm(hidden, residual, weight, EPS)
        bias = model.qkv_bias[layer] if model.qkv_bias else None
        qkv = F.linear(hidden, model.qkv[layer], bias)
        qk = qkv[:, : q_size + kv_size].view(-1, HEADS + KV_HEADS, head_dim)
        if model.qk_norms:
            q, k = qk.split([HEADS, KV_HEADS], dim=1)
            q_norm, k_norm = model.qk_norms[2 * layer], model.qk_norms[2 * layer + 1]
            qk = torch.cat((reference.rms_norm(q, q_norm, EPS), reference.rms_norm(k, k_norm, EPS)), dim=1)
        if rotary_layers is None or rotary_layers[layer]:
            qk = reference.apply_rotary(qk, cos, sin)
        q, k = qk.split([HEADS, KV_HEADS], dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, KV_HEADS, head_dim)
        k_cache, v_cache = step["k_caches"][layer], step["v_caches"][layer]
        reference.write_kv_cache(k, v, k_cache, v_cache, step["slot_mapping"])
        attn = reference.paged_attention_decode(
            q,
            k_cache,
            v_cache,
            step["block_tables"],
            step["context_lens"],
            head_dim**-0.5,
            window=windows[layer] if windows else 0,
        )
        hidden = F.linear(attn.reshape(-1, q_size), model.o_proj[layer])
        if residual_scale != 1.0:
            hidden = hidden * residual_scale
        hidden, residual = reference.fused_add_rms_norm(hidden, residual, model.norms[2 * layer + 1], EPS)
        hidden = F.linear(reference.silu_and_mul(F.linear(hidden, model.gate_up[layer])), model.down[layer])
        if residual_scale != 1.0:
            hidden = hidden * residual_scale
    hidden, _ = reference.fused_add_rms_norm(hidden, residual, model.final_norm, EPS)
    return hidden


def clone_step(step: dict) -> dict:
    return {k: [c.clone() for c in v] if isinstance(v, list) else v.clone() for k, v in step.items()}


@pytest.mark.parametrize("num_seqs", [1, 5, 16, 40])
@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("packing", PACKINGS)
def test_matches_the_reference_layers(num_seqs: int, qkv_bias: bool, packing: str) -> None:
    model, step = make_model(qkv_bias), make_step(num_seqs)
    ours, ref_step = clone_step(step), clone_step(step)
    out = run_kernel(model, ours, packing=packing)
    expected = run_reference(model, ref_step)
    assert out.shape == (num_seqs, HIDDEN) and out.dtype == torch.bfloat16
    # bfloat16 rounding differs in places (inductor-style single roundings here, eager's per-op ones
    # there); the layers' outputs agree to a few bf16 ulps of the largest values
    torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.03)
    for layer in range(LAYERS):  # this step's K/V went to its slots, and nothing else moved
        for name in ("k_caches", "v_caches"):
            written = ours[name][layer].view(-1, KV_HEADS, HEAD_DIM)
            torch.testing.assert_close(
                written.float(),
                ref_step[name][layer].view(-1, KV_HEADS, HEAD_DIM).float(),
                atol=0.05,
                rtol=0.03,
            )
            untouched = torch.ones(written.shape[0], dtype=torch.bool)
            untouched[step["slot_mapping"]] = False
            assert torch.equal(written[untouched], step[name][layer].view(-1, KV_HEADS, HEAD_DIM)[untouched])


@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_a_head_wider_than_a_vector(head_dim: int) -> None:
    """head_dim 64 (SmolLM2's): rotary halves of 32 values, two vectors each; Phi-3's 96 (halves of 48)
    and Gemma's 256 (halves of 128), each on its AVX512-BF16 attention rows (2 query heads a KV head:
    one pass of 2 heads at 96, two of 1 at 256)."""
    model, step = make_model(False, head_dim=head_dim), make_step(8, head_dim=head_dim)
    ours, ref_step = clone_step(step), clone_step(step)
    torch.testing.assert_close(
        run_kernel(model, ours, head_dim=head_dim).float(),
        run_reference(model, ref_step, head_dim=head_dim).float(),
        atol=0.05,
        rtol=0.03,
    )


@pytest.mark.parametrize("head_dim", [16, 24, 128])
def test_query_and_key_head_norms(head_dim: int) -> None:
    """Qwen3's RMSNorm of each query and key head before the rotation, over heads of one vector, of a
    vector and a half (the masked tail) and of eight; the norms change the result."""
    step = make_step(5, head_dim=head_dim)
    model = make_model(True, head_dim=head_dim, qk_norms=True)
    out = run_kernel(model, clone_step(step), head_dim=head_dim)
    torch.testing.assert_close(
        out.float(), run_reference(model, clone_step(step), head_dim=head_dim).float(), atol=0.05, rtol=0.03
    )
    model.qk_norms = []
    without = run_kernel(model, clone_step(step), head_dim=head_dim)
    assert not torch.allclose(out.float(), without.float(), atol=0.05, rtol=0.03)


def test_rows_do_not_depend_on_the_batch() -> None:
    """Each sequence's hidden state is the same alone as among 16 (the multiplies and attention are
    per row; the elementwise loops too)."""
    model, step = make_model(False), make_step(16)
    together = run_kernel(model, clone_step(step))
    for i in (0, 7, 15):
        alone = {
            k: ([c.clone() for c in v] if isinstance(v, list) else v[i : i + 1].clone())
            for k, v in step.items()
        }
        assert torch.equal(run_kernel(model, alone)[0], together[i])


def draft_step(head_dim: int = HEAD_DIM) -> dict[str, torch.Tensor]:
    """A verifying step of speculative decoding: six rows, rows 2-4 one sequence's last token and two
    drafts (positions 20-22, each attending to the rows before it), across the middle where two
    threads split the rows; the others one sequence each."""
    step = make_step(4, head_dim=head_dim)
    rows = torch.tensor([0, 1, 1, 1, 2, 3])
    positions = step["positions"][rows].clone()
    positions[1:4] = torch.tensor([20, 21, 22])
    tables = step["block_tables"][rows].contiguous()
    slots = tables[torch.arange(6), positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    return {
        **step,
        "input_ids": step["input_ids"][rows].clone(),
        "positions": positions,
        "slot_mapping": slots,
        "block_tables": tables,
        "context_lens": (positions + 1).to(torch.int32),
    }


@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
def test_draft_rows_read_the_rows_before_them(head_dim: int) -> None:
    """Rows of one sequence in one step: each row's attention reads the K/V the rows before it wrote
    this step, whichever thread wrote them (head_dim 64 takes the AVX512-BF16 attention rows)."""
    model, step = make_model(False, head_dim=head_dim), draft_step(head_dim)
    ours, ref_step = clone_step(step), clone_step(step)
    torch.testing.assert_close(
        run_kernel(model, ours, head_dim=head_dim).float(),
        run_reference(model, ref_step, head_dim=head_dim).float(),
        atol=0.05,
        rtol=0.03,
    )
    for name in ("k_caches", "v_caches"):
        for layer in range(LAYERS):
            torch.testing.assert_close(
                ours[name][layer].float(), ref_step[name][layer].float(), atol=0.05, rtol=0.03
            )


@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 256])
@pytest.mark.parametrize("windows", [[0, 6], [13, 1]], ids=["full-then-6", "13-then-1"])
@pytest.mark.parametrize("packing", PACKINGS)
def test_each_layer_attends_under_its_own_window(head_dim: int, windows: list[int], packing: str) -> None:
    """Sliding-window layers (Mistral's, Qwen2's sliding ones) beside full ones: each layer's attention
    sees its window's last tokens of contexts of 5 to 31 (windows below a block of 8, and across two),
    as the reference layers under the same windows; without the windows the step differs. Head size 16
    takes the generic attention rows, 64 and 256 the AVX512-BF16 ones; 40 rows split over runs of the
    threads."""
    model, step = make_model(False, head_dim=head_dim), make_step(40, head_dim=head_dim)
    assert int(step["context_lens"].max()) > max(windows)
    ours = run_kernel(model, clone_step(step), head_dim=head_dim, packing=packing, windows=windows)
    expected = run_reference(model, clone_step(step), head_dim=head_dim, windows=windows)
    torch.testing.assert_close(ours.float(), expected.float(), atol=0.05, rtol=0.03)
    full = run_reference(model, clone_step(step), head_dim=head_dim)
    assert not torch.allclose(ours.float(), full.float(), atol=0.05, rtol=0.03)


@pytest.mark.parametrize("packing", PACKINGS)
def test_refuses_windows_that_are_not_one_a_layer(packing: str) -> None:
    """A window a layer, none negative: checked before any layer runs (on AMX tiles and AVX512-BF16
    panels, before the one parallel region where nothing may throw)."""
    model, step = make_model(False), make_step(4)
    for windows in ([0], [0, 0, 0]):
        with pytest.raises(RuntimeError, match=f"windows: one a layer .*got {len(windows)} for 2 layers"):
            run_kernel(model, clone_step(step), packing=packing, windows=windows)
    with pytest.raises(RuntimeError, match="layer 1's window must be 0 .none. or positive, got -3"):
        run_kernel(model, clone_step(step), packing=packing, windows=[4, -3])


@pytest.mark.parametrize("num_seqs", [1, 7, 40])
def test_the_same_bits_on_any_number_of_threads(num_seqs: int) -> None:
    """The step's threads split rows, panels and attention rows among themselves and meet at barriers:
    one thread, two, and more threads than this machine has cores (waits that yield) give the same
    hidden states and caches to the bit. A thread done with its panels of a multiply takes another's
    that are not taken yet, which makes who multiplies which panel a matter of timing: with five
    threads on two cores they take each other's in every run (counted in a build that counted them),
    so several runs each check different hand-overs."""
    model, step = make_model(True, head_dim=64), make_step(num_seqs, head_dim=64)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 2, 2, 5, 5, 5, 5, 5):
            torch.set_num_threads(n)
            ours = clone_step(step)
            results.append((run_kernel(model, ours, head_dim=64), ours["k_caches"], ours["v_caches"]))
    finally:
        torch.set_num_threads(threads)
    first = results[0]
    for out, k_caches, v_caches in results[1:]:
        assert torch.equal(out, first[0])
        assert all(torch.equal(a, b) for a, b in zip(k_caches + v_caches, first[1] + first[2], strict=True))


def test_refuses_bad_inputs_with_a_message() -> None:
    model, step = make_model(False), make_step(4)
    bad_id = clone_step(step)
    bad_id["input_ids"][2] = 5000
    with pytest.raises(RuntimeError, match="token id 5000 is out of the vocabulary"):
        run_kernel(model, bad_id)
    bad_pos = clone_step(step)
    bad_pos["positions"][0] = 10_000
    with pytest.raises(RuntimeError, match="position 10000 is out of the rotary table"):
        run_kernel(model, bad_pos)
    with_head_norms = make_model(False, qk_norms=True)
    with_head_norms.qk_norms = with_head_norms.qk_norms[:-1]
    with pytest.raises(RuntimeError, match="two head norms, if any"):
        run_kernel(with_head_norms, clone_step(step))
    with_head_norms.qk_norms = [bf16(HEAD_DIM + 1) for _ in range(2 * LAYERS)]
    with pytest.raises(RuntimeError, match=r"head norm weights must be bfloat16 \[head_dim\]"):
        run_kernel(with_head_norms, clone_step(step))
    model.norms = model.norms[:-1]
    with pytest.raises(RuntimeError, match="two norms a layer"):
        run_kernel(model, clone_step(step))


@pytest.mark.parametrize("packing", PACKINGS[:2])  # AMX tiles, AVX512-BF16 panels
def test_refuses_what_its_threads_would_misread(packing: str) -> None:
    """On AMX tiles and AVX512-BF16 panels the step runs in one parallel region, where nothing may
    throw: a slot past the cache, a weight packed for other sizes and a cache of other heads are
    refused before it."""
    model, step = make_model(False), make_step(4)
    bad_slot = clone_step(step)
    bad_slot["slot_mapping"][1] = NUM_BLOCKS * BLOCK_SIZE
    with pytest.raises(RuntimeError, match=f"slot {NUM_BLOCKS * BLOCK_SIZE} is past the cache's"):
        run_kernel(model, bad_slot, packing=packing)
    wide = make_model(False)
    wide.down = [bf16(HIDDEN, INTER + 32) for _ in range(LAYERS)]
    with pytest.raises(RuntimeError, match="a down weight packed for 64 x 96 does not match"):
        run_kernel(wide, clone_step(step), packing=packing)
    other_heads = clone_step(step)  # (blocks of 16 one-head slots: the caches give head_dim)
    for name in ("k_caches", "v_caches"):
        other_heads[name] = [c.view(NUM_BLOCKS, 2 * BLOCK_SIZE, 1, HEAD_DIM) for c in other_heads[name]]
    with pytest.raises(
        RuntimeError, match=r"KV caches must be contiguous bfloat16 \[blocks, block_size, 2, 16\]"
    ):
        run_kernel(model, other_heads, packing=packing)


@pytest.mark.skipif("not cpu.load() or not cpu.linear_amx_supported()", reason="no AMX bf16")
@pytest.mark.parametrize("num_seqs", [1, 7, 17, 32])
def test_amx_tiles_in_one_region_give_the_bits_of_onednn_s_ops(num_seqs: int) -> None:
    """With the weights in AMX tiles the step's threads multiply panels of 32 columns inside the one
    region, each row as linear_amx multiplies it, whose product equals oneDNN's up to 32 rows: the
    step equals, to the bit, the one whose weights are in oneDNN's layout (an op per part)."""
    model, step = make_model(True, head_dim=64), make_step(num_seqs, head_dim=64)
    tiles, onednn = clone_step(step), clone_step(step)
    out = run_kernel(model, tiles, head_dim=64, packing="amx")
    assert torch.equal(out, run_kernel(model, onednn, head_dim=64, packing="onednn"))
    for name in ("k_caches", "v_caches"):
        assert all(torch.equal(a, b) for a, b in zip(tiles[name], onednn[name], strict=True))


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("num_kv_heads", [0, 3])
def test_refuses_query_heads_the_kv_heads_do_not_divide(packing: str, num_kv_heads: int) -> None:
    """Checked with the other arguments, whichever path the packing takes: 0 KV heads would divide by
    zero (inside the parallel region on AVX512-BF16 panels), 3 do not divide 4 query heads."""
    model, step = make_model(False), make_step(4)
    with pytest.raises(
        RuntimeError, match=f"query heads must be a multiple of the KV heads, got 4 and {num_kv_heads}"
    ):
        run_kernel(model, clone_step(step), packing=packing, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize(
    ("embedding_scale", "residual_scale"),
    [(12.0, 0.22), (1.0, 0.22), (12.0, 1.0)],
    ids=["both", "residual", "embedding"],
)
@pytest.mark.parametrize("packing", PACKINGS)
def test_granite_s_embedding_and_residual_multipliers(
    embedding_scale: float, residual_scale: float, packing: str
) -> None:
    """Granite's multipliers: the embeddings times `embedding_scale`, and each layer's attention and MLP
    outputs times `residual_scale` before they join the residual stream (the last MLP's before the
    final norm), each product rounded to bfloat16, as the reference layers compute them; the step
    differs from Llama's (both 1)."""
    model, step = make_model(True, head_dim=64), make_step(16, head_dim=64)
    scales = {"embedding_scale": embedding_scale, "residual_scale": residual_scale}
    ours, ref_step = clone_step(step), clone_step(step)
    out = run_kernel(model, ours, head_dim=64, packing=packing, **scales)
    expected = run_reference(model, ref_step, head_dim=64, **scales)
    torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.03)
    for name in ("k_caches", "v_caches"):
        for layer in range(LAYERS):
            torch.testing.assert_close(
                ours[name][layer].float(), ref_step[name][layer].float(), atol=0.05, rtol=0.03
            )
    unscaled = run_reference(model, clone_step(step), head_dim=64)
    assert not torch.allclose(out.float(), unscaled.float(), atol=0.05, rtol=0.03)


@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
@pytest.mark.parametrize(
    "rotary_layers", [[True, False], [False, True], [False, False]], ids=["nope-1", "nope-0", "nope-all"]
)
@pytest.mark.parametrize("packing", PACKINGS)
def test_layers_without_rotary(head_dim: int, rotary_layers: list[bool], packing: str) -> None:
    """SmolLM3's NoPE layers: a layer that does not rotate writes its q and k as the qkv multiply gave
    them (its KV cache rows too), as the reference layers that skip the rotation; the others rotate.
    Each differs from the step whose every layer rotates."""
    model, step = make_model(False, head_dim=head_dim), make_step(16, head_dim=head_dim)
    ours, ref_step = clone_step(step), clone_step(step)
    out = run_kernel(model, ours, head_dim=head_dim, packing=packing, rotary_layers=rotary_layers)
    expected = run_reference(model, ref_step, head_dim=head_dim, rotary_layers=rotary_layers)
    torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.03)
    for layer in range(LAYERS):
        torch.testing.assert_close(
            ours["k_caches"][layer].float(), ref_step["k_caches"][layer].float(), atol=0.05, rtol=0.03
        )
    # a layer that does not rotate writes the very keys the multiply gave
    nope = rotary_layers.index(False)
    plain = clone_step(step)
    run_kernel(model, plain, head_dim=head_dim, packing=packing)
    assert not torch.allclose(
        ours["k_caches"][nope].float(), plain["k_caches"][nope].float(), atol=0.05, rtol=0.03
    )
    rotating = run_reference(model, clone_step(step), head_dim=head_dim)
    assert not torch.allclose(out.float(), rotating.float(), atol=0.05, rtol=0.03)


@pytest.mark.parametrize(
    ("head_dim", "rotary_dim"), [(64, 48), (16, 8), (64, 32)], ids=["64-48", "16-8", "64-32"]
)
@pytest.mark.parametrize("qk_norms", [False, True])
@pytest.mark.parametrize("packing", PACKINGS)
def test_partial_rotary(head_dim: int, rotary_dim: int, qk_norms: bool, packing: str) -> None:
    """Phi-3's partial rotary (Phi-4-mini's 3/4 of a head): the rotary table's width turns each head's
    first rotary_dim values, NeoX halves within them, and the rest pass through, as the reference's
    `apply_rotary`; with and without Qwen3-style head norms before it (normed in place, then turned).
    Layer 0's keys in the cache keep, past rotary_dim, the bits of the same keys unturned (a step whose
    layers do not rotate); the step differs from one whose whole heads turn."""
    model = make_model(True, head_dim=head_dim, qk_norms=qk_norms, rotary_dim=rotary_dim)
    assert model.cos_sin_cache.shape[1] == rotary_dim
    step = make_step(16, head_dim=head_dim)
    ours, ref_step = clone_step(step), clone_step(step)
    out = run_kernel(model, ours, head_dim=head_dim, packing=packing)
    expected = run_reference(model, ref_step, head_dim=head_dim)
    torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.03)
    slots = step["slot_mapping"]
    for layer in range(LAYERS):
        for name in ("k_caches", "v_caches"):
            written = ours[name][layer].view(-1, KV_HEADS, head_dim)[slots]
            wanted = ref_step[name][layer].view(-1, KV_HEADS, head_dim)[slots]
            torch.testing.assert_close(written.float(), wanted.float(), atol=0.05, rtol=0.03)
    unturned = clone_step(step)
    run_kernel(model, unturned, head_dim=head_dim, packing=packing, rotary_layers=[False] * LAYERS)
    keys = ours["k_caches"][0].view(-1, KV_HEADS, head_dim)[slots]
    unturned_keys = unturned["k_caches"][0].view(-1, KV_HEADS, head_dim)[slots]
    assert torch.equal(keys[..., rotary_dim:], unturned_keys[..., rotary_dim:])
    assert not torch.equal(keys[..., :rotary_dim], unturned_keys[..., :rotary_dim])
    whole = make_model(True, head_dim=head_dim, qk_norms=qk_norms)
    rotating_whole_heads = run_reference(whole, clone_step(step), head_dim=head_dim)
    assert not torch.allclose(out.float(), rotating_whole_heads.float(), atol=0.05, rtol=0.03)


@pytest.mark.parametrize("packing", PACKINGS)
def test_refuses_rotary_layers_that_are_not_one_a_layer_and_odd_or_wide_tables(packing: str) -> None:
    """rotary_layers one a layer, and a rotary table of an even width up to head_dim (the KV caches'
    last size): checked before any layer runs."""
    model, step = make_model(False), make_step(4)
    for rotary_layers in ([True], [True, False, True]):
        with pytest.raises(
            RuntimeError, match=f"rotary_layers: one a layer .*got {len(rotary_layers)} for 2 layers"
        ):
            run_kernel(model, clone_step(step), packing=packing, rotary_layers=rotary_layers)
    for width in (HEAD_DIM - 3, 2 * HEAD_DIM):
        model.cos_sin_cache = torch.zeros(256, width)
        with pytest.raises(
            RuntimeError, match=f"rotary_dim .its width. must be even and at most head_dim 16, got {width}"
        ):
            run_kernel(model, clone_step(step), packing=packing)
