"""Quantized checkpoints, dequantized on load. FP8 (`models.fp8`): a scale a block (DeepSeek's,
Qwen's FP8 releases: held to transformers' own loading of the same files), a tensor (vLLM's), a row
(Meta's fbgemm, Red Hat's compressed-tensors). Ints (`models.int_weights`): GPTQ (v1 4-bit, v2 8-bit
act-ordered), AWQ, compressed-tensors' W4A16 and W8A8. Each held to transformers on the products
the stored values, zero points and scales make: float32 greedy tokens equal, logprobs equal;
shards split between a weight and its scale; each refusal naming what it refuses."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from pagedserve import LLM, SamplingParams
from pagedserve.config import Fp8Layout, IntLayout, ModelConfig
from pagedserve.models import fp8, int_weights
from pagedserve.models.fp8 import dequantize_fp8
from pagedserve.models.loader import checkpoint_tensors
from test_hf_parity import assert_greedy_equal, hf_greedy
from test_model_config_audit import MLA, TINY, gemma3_multimodal, hf_logprobs
from tiny_models import (
    INT_LAYOUTS,
    build_tiny_llama,
    pack_int32,
    save_fp8,
    save_int_quantized,
    save_tiny_model,
)
from transformers import DeepseekV3Config

MAX_TOKENS = 12


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[1] + [rng.randrange(3, 49152) for _ in range(40 + 37 * i)] for i in range(2)]


def assert_serves_as(model_dir: str, model: object, theirs: list[list[int]]) -> list[list[int]]:
    """Our float32 greedy tokens on `model_dir` are transformers' (`theirs`, by `model`), their
    logprobs its logprobs."""
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    ours = [r.outputs[0] for r in llm.generate(prompts(), params)]
    assert_greedy_equal(model, prompts(), [o.token_ids for o in ours], theirs)
    for prompt, completion in zip(prompts(), ours):
        expected = float(hf_logprobs(model, prompt, completion.token_ids)[0].sum())
        assert completion.cumulative_logprob == pytest.approx(expected, abs=1e-3)
    return [o.token_ids for o in ours]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    # (96-wide MLP, 64-wide attention: blocks of 8 fit; rows of 100 exercise a partial block below)
    return build_tiny_llama(tmp_path_factory.mktemp("llama"), default_model_dir)


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory: pytest.TempPathFactory, llama_dir: str) -> str:
    return save_fp8(tmp_path_factory.mktemp("fp8"), llama_dir, "fp8-block")[0]


@pytest.mark.parametrize("architecture", ["llama", "deepseek-v3"])
def test_a_checkpoint_of_fp8_blocks_serves_what_transformers_dequantizes(
    tmp_path: Path, default_model_dir: str, llama_dir: str, architecture: str
) -> None:
    """DeepSeek-V3's layout (its latents, experts and shared expert in FP8 too): transformers loads
    the same files on a CPU by dequantizing them, and our tokens and logprobs are its."""
    from transformers import FineGrainedFP8Config

    if architecture == "llama":
        model_dir = llama_dir
    else:
        config = DeepseekV3Config(**{**TINY, **MLA}, n_shared_experts=1, n_group=4, topk_group=2)
        model_dir = save_tiny_model(tmp_path / "deepseek", default_model_dir, config)
    fp8_dir, _ = save_fp8(tmp_path, model_dir, "fp8-block")
    model, theirs = hf_greedy(
        fp8_dir, prompts(), MAX_TOKENS, quantization_config=FineGrainedFP8Config(dequantize=True)
    )
    ours = assert_serves_as(fp8_dir, model, theirs)
    _, unquantized = hf_greedy(model_dir, prompts(), MAX_TOKENS)
    assert ours != unquantized  # (FP8's rounding moves these tokens: the scales were applied)


@pytest.mark.parametrize("layout", ["fp8-tensor", "fbgemm", "compressed-tensors"])
def test_fp8_layouts_serve_the_products_of_their_values_and_scales(
    tmp_path: Path, llama_dir: str, layout: str
) -> None:
    """A scale a tensor beside static activation scales (vLLM's), a row beside activation bounds
    (fbgemm's), a row beside KV-cache scales (compressed-tensors'): each serves as transformers
    serves the weights their products make."""
    fp8_dir, product_dir = save_fp8(tmp_path, llama_dir, layout)
    model, theirs = hf_greedy(product_dir, prompts(), MAX_TOKENS)
    assert_serves_as(fp8_dir, model, theirs)


@pytest.mark.parametrize("layout", list(INT_LAYOUTS))
def test_int_layouts_serve_the_products_of_their_ints_zero_points_and_scales(
    tmp_path: Path, llama_dir: str, layout: str
) -> None:
    """GPTQ's ints packed along the inputs (v1 4-bit symmetric: zero points stored less one; v2
    8-bit with act order's g_idx; zero biases beside, as AutoGPTQ saves them), AWQ's along the
    outputs in its order, compressed-tensors' offset ints beside weight_shape (4-bit symmetric and
    asymmetric, its zero points packed along the outputs; 8-bit with act order's weight_g_idx) and
    its int8 weights (symmetric, and asymmetric with int8 zero points): each serves as transformers
    serves their products."""
    int_dir, product_dir = save_int_quantized(tmp_path, llama_dir, layout)
    model, theirs = hf_greedy(product_dir, prompts(), MAX_TOKENS)
    ours = assert_serves_as(int_dir, model, theirs)
    _, unquantized = hf_greedy(llama_dir, prompts(), MAX_TOKENS)
    if INT_LAYOUTS[layout].get("bits") == 4 or layout.startswith("w4a16"):
        assert ours != unquantized  # (4 bits' rounding moves these tokens)


def test_a_packed_weight_without_its_zero_points_is_refused_naming_it(tmp_path: Path, llama_dir: str) -> None:
    int_dir, _ = save_int_quantized(tmp_path, llama_dir, "awq")
    model_dir = edited(tmp_path / "m", int_dir, lambda w: w.pop("model.layers.1.mlp.up_proj.qzeros"))
    with pytest.raises(
        ValueError,
        match=r"the awq weight 'model.layers.1.mlp.up_proj.qweight' cannot be read: .*up_proj.qzeros is not in the checkpoint",
    ):
        LLM(model=model_dir, dtype="float32", num_kv_blocks=8)


def test_a_bias_the_model_has_not_is_refused_unless_zeros(tmp_path: Path, llama_dir: str) -> None:
    """AutoGPTQ's zero biases load (the test above); one that is not zeros is the model's mistake."""
    int_dir, _ = save_int_quantized(tmp_path, llama_dir, "gptq")
    model_dir = edited(
        tmp_path / "m", int_dir, lambda w: w["model.layers.0.self_attn.k_proj.bias"].fill_(0.5)
    )
    with pytest.raises(
        ValueError,
        match="checkpoint has a weight this model does not: 'model.layers.0.self_attn.k_proj.bias'",
    ):
        LLM(model=model_dir, dtype="float32", num_kv_blocks=8)


def test_a_multimodal_checkpoint_in_fp8_serves_its_text_decoder(
    tmp_path: Path, default_model_dir: str
) -> None:
    """Gemma 3's multimodal layout, its text decoder in FP8 blocks: the outer config's
    quantization_config reaches the text decoder served."""
    fp8_dir, product_dir = save_fp8(
        tmp_path, gemma3_multimodal(tmp_path / "gemma3", default_model_dir), "fp8-block"
    )
    model, theirs = hf_greedy(product_dir, prompts(), MAX_TOKENS)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert_serves_as(fp8_dir, model, theirs)


def test_a_scale_in_another_shard_than_its_weight(tmp_path: Path, fp8_llama: str) -> None:
    """Sharded as an index names the files, each weight's scale in the other shard."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(Path(fp8_llama) / "model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for file in Path(fp8_llama).iterdir():
        if file.name != "model.safetensors":
            (sharded / file.name).symlink_to(file)
    shards: dict[str, dict[str, torch.Tensor]] = {"a.safetensors": {}, "b.safetensors": {}}
    for name, tensor in weights.items():
        shards["b.safetensors" if name.endswith("_scale_inv") else "a.safetensors"][name] = tensor
    for file, tensors in shards.items():
        save_file(tensors, str(sharded / file))
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = [
        [
            r.outputs[0].token_ids
            for r in LLM(model=d, dtype="float32", num_kv_blocks=64).generate(prompts(), params)
        ]
        for d in (fp8_llama, str(sharded))
    ]
    assert outputs[0] == outputs[1]


def test_dequantizing_blocks_partial_at_the_edges() -> None:
    """A scale a block of 32 x 32 over 100 x 70 (the last blocks 4 rows and 6 columns): each value
    times its own block's scale; bfloat16 and power-of-two-byte (ue8m0) scales; experts stacked."""
    generator = torch.Generator().manual_seed(0)
    values = (torch.randn(3, 100, 70, generator=generator) * 50).to(torch.float8_e4m3fn)
    scales = torch.rand(3, 4, 3, generator=generator) + 0.1
    ours = dequantize_fp8(values, scales, (32, 32))
    expected = torch.empty(3, 100, 70)
    for e in range(3):
        for i in range(100):
            for j in range(70):
                expected[e, i, j] = values[e, i, j].float() * scales[e, i // 32, j // 32]
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    torch.testing.assert_close(
        dequantize_fp8(values[0], scales[0].bfloat16(), (32, 32)),
        dequantize_fp8(values[0], scales[0].bfloat16().float(), (32, 32)),
        rtol=0,
        atol=0,
    )
    exponents = torch.randint(120, 135, (4, 3), dtype=torch.uint8, generator=generator)
    powers = torch.exp2(exponents.float() - 127)
    torch.testing.assert_close(
        dequantize_fp8(values[0], exponents, (32, 32)), dequantize_fp8(values[0], powers, (32, 32))
    )
    rows = torch.rand(100, generator=generator)
    torch.testing.assert_close(
        dequantize_fp8(values[0], rows, None), values[0].float() * rows[:, None], rtol=0, atol=0
    )
    torch.testing.assert_close(
        dequantize_fp8(values[0], rows[:, None], None), values[0].float() * rows[:, None], rtol=0, atol=0
    )
    assert torch.equal(dequantize_fp8(values[0], torch.tensor([0.5]), None), values[0].float() * 0.5)
    with pytest.raises(
        ValueError,
        match=r"scale \(4, 2\) is not one a tensor, a row or a block of \(32, 32\) of the weight \(100, 70\)",
    ):
        dequantize_fp8(values[0], scales[0, :, :2], (32, 32))


class Stored:
    """A tensor as an open safetensors file gives it (`get_tensor`)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensor


def test_packed_ints_and_fp8_blocks_past_the_weight_are_cut_at_its_shape() -> None:
    """compressed-tensors packs each row's inputs into whole int32s: 12 4-bit inputs fill one int and
    half of the next, the rest padding (`weight_shape` names 12), and 5 rows' zero points half an
    int of 8 along the outputs; an FP8 weight padded to whole blocks of 8 x 8 names its own shape
    (`weight_shape_original`). Each dequantizes to the weight alone."""
    generator = torch.Generator().manual_seed(0)
    ints = torch.randint(-8, 8, (5, 12), generator=generator)
    zero_points = torch.randint(-8, 8, (5, 1), generator=generator)
    scales = torch.rand(5, 1, generator=generator) + 0.1
    padded = torch.nn.functional.pad(ints + 8, (0, 4))  # (padding: offset values of 0)
    stored = {
        "l.weight_packed": pack_int32(padded, 4),
        "l.weight_scale": scales,
        "l.weight_shape": torch.tensor([5, 12]),
        "l.weight_zero_point": pack_int32(torch.nn.functional.pad(zero_points.T + 8, (0, 3)), 4).T,
    }
    layout = IntLayout("compressed-tensors", 4, -1, zero_points=True)
    tensors = dict(int_weights.dequantized_tensors({n: Stored(t) for n, t in stored.items()}, layout))
    assert tensors.keys() == {"l.weight"}
    torch.testing.assert_close(tensors["l.weight"], (ints - zero_points).float() * scales, rtol=0, atol=0)

    values = (torch.randn(16, 16, generator=generator) * 50).to(torch.float8_e4m3fn)
    block_scales = torch.rand(2, 2, generator=generator) + 0.1
    stored = {
        "l.weight": values,
        "l.weight_scale": block_scales,
        "l.weight_shape_original": torch.tensor([10, 12]),
    }
    tensors = dict(
        fp8.dequantized_tensors(
            {n: Stored(t) for n, t in stored.items()}, Fp8Layout("compressed-tensors", (8, 8))
        )
    )
    assert tensors.keys() == {"l.weight"}
    expected = values.float() * block_scales.repeat_interleave(8, 0).repeat_interleave(8, 1)
    torch.testing.assert_close(tensors["l.weight"], expected[:10, :12], rtol=0, atol=0)


def edited(root: Path, model_dir: str, edit: object = None, config_edit: object = None) -> str:
    """`model_dir`'s checkpoint with its tensors and config.json edited in place of a copy."""
    from safetensors.torch import load_file, save_file

    root.mkdir()
    for file in Path(model_dir).iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            (root / file.name).symlink_to(file)
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    if callable(edit):
        edit(weights)
    save_file(weights, str(root / "model.safetensors"))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if callable(config_edit):
        config_edit(config)
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


def test_an_fp8_weight_without_its_scale_is_refused_naming_it(tmp_path: Path, fp8_llama: str) -> None:
    model_dir = edited(
        tmp_path / "m", fp8_llama, lambda w: w.pop("model.layers.1.mlp.up_proj.weight_scale_inv")
    )
    with pytest.raises(ValueError, match=r"the FP8 weight 'model.layers.1.mlp.up_proj.weight' has no scale"):
        LLM(model=model_dir, dtype="float32", num_kv_blocks=8)


def test_fp8_weights_without_a_quantization_config_are_refused(tmp_path: Path, fp8_llama: str) -> None:
    model_dir = edited(tmp_path / "m", fp8_llama, config_edit=lambda c: c.pop("quantization_config"))
    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.mlp.down_proj.weight' is torch.float8_e4m3fn but config.json's quantization_config names no FP8",
    ):
        list(checkpoint_tensors(model_dir, ModelConfig.from_path(model_dir, "float32").hf_config))


def test_scales_of_another_block_than_config_json_names_are_refused(tmp_path: Path, fp8_llama: str) -> None:
    model_dir = edited(
        tmp_path / "m",
        fp8_llama,
        config_edit=lambda c: c["quantization_config"].update(weight_block_size=[16, 16]),
    )
    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.mlp.down_proj.weight': scale \(8, 12\) is not one a tensor, a row or a block of \(16, 16\) of the weight \(64, 96\)",
    ):
        list(checkpoint_tensors(model_dir, ModelConfig.from_path(model_dir, "float32").hf_config))


CT = "compressed-tensors"


def ct_weights(**weights: object) -> dict[str, object]:
    """A compressed-tensors config of one group of `weights` stored pack-quantized."""
    return {
        "quant_method": CT,
        "format": "pack-quantized",
        "config_groups": {"group_0": {"weights": weights}},
    }


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        (
            {"quant_method": "fp8", "weight_block_size": [128]},
            "weight_block_size must be two positive integers",
        ),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt must be e4m3, got 'e5m2'"),
        (
            {"quant_method": CT, "format": "marlin-24", "config_groups": {}},
            "format must be float-quantized, naive-quantized, pack-quantized or int-quantized, got 'marlin-24'",
        ),
        (
            ct_weights(type="float", num_bits=4, strategy="group"),
            r"config_groups.group_0.weights must be 8-bit floats .* got type 'float', num_bits 4, strategy 'group'",
        ),
        (
            ct_weights(type="int", num_bits=4, strategy="tensor", symmetric=False),
            r"config_groups.group_0.weights must be .* or ints a channel or a group, .*strategy 'tensor'",
        ),
        (
            ct_weights(type="float", num_bits=8, strategy="channel"),
            "compressed-tensors format 'pack-quantized' does not hold its config_groups' weights",
        ),
        (
            ct_weights(type="int", num_bits=4, strategy="group", group_size=None),
            r"config_groups.group_0.weights.group_size must be positive or -1, got None",
        ),
        (
            {"quant_method": "gptq", "bits": 3, "group_size": 128},
            "quantization_config.bits must be 2, 4 or 8, got 3",
        ),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 0},
            "quantization_config.group_size must be positive or -1, got 0",
        ),
        (
            {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
            "GPTQ quantization_config.checkpoint_format must be gptq or gptq_v2, got 'marlin'",
        ),
        (
            {"quant_method": "awq", "bits": 4, "version": "gemv"},
            "AWQ quantization_config.version must be gemm, got 'gemv'",
        ),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "AWQ quantization_config.zero_point false"),
        ({"quant_method": "awq", "bits": 8}, "AWQ quantization_config.bits must be 4, got 8"),
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True},
            r"quantization_config \(bitsandbytes\) is not supported",
        ),
    ],
)
def test_a_quantization_config_not_served_is_refused_naming_it(
    tmp_path: Path, llama_dir: str, quantization: dict[str, object], message: str
) -> None:
    model_dir = edited(
        tmp_path / "m", llama_dir, config_edit=lambda c: c.update(quantization_config=quantization)
    )
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_path(model_dir, "float32")
