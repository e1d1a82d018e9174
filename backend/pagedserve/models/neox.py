"""EleutherAI's GPT-NeoX lineage on the Llama family's layers: Stability AI's StableLM (StableLM 2,
StableLM-3B-4E1T, Stable Code): LayerNorms with a bias where Llama has RMSNorms, the rope over the
first `partial_rotary_factor` of each head (0.25 by default), q, k and v biased by `use_qkv_bias`,
Llama's SwiGLU; attention and the MLP side by side on one norm where `use_parallel_residual`
(StableLM 2 12B's), as transformers' StableLm computes them."""

from __future__ import annotations

from typing import Any

from pagedserve.config import rope_parameters
from pagedserve.layers.attention import AttentionBackend
from pagedserve.layers.norm import LayerNorm, RMSNorm
from pagedserve.models.cohere import ParallelDecoderLayer
from pagedserve.models.llama import Biases, LlamaDecoderLayer, LlamaForCausalLM


def layer_norm(cfg: dict[str, Any]) -> LayerNorm:
    return LayerNorm(cfg["hidden_size"], float(cfg.get("layer_norm_eps", 1e-5)))


class StableLmDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with LayerNorms (a bias each)."""

    def norm(self, cfg: dict[str, Any]) -> RMSNorm:
        return layer_norm(cfg)


class StableLmParallelDecoderLayer(ParallelDecoderLayer):
    """StableLM 2 12B's: attention and the MLP side by side on one LayerNorm (with its bias)."""

    def norm(self, cfg: dict[str, Any]) -> RMSNorm:
        return layer_norm(cfg)


class StableLmForCausalLM(LlamaForCausalLM):
    """StableLM (see the module docstring); StableLmConfig's defaults where config.json leaves a key out.
    Per-head LayerNorms of q and k (`qk_layernorm`, StableLM 2 12B's) are refused by name."""

    rotates_part_of_a_head = True
    decoder_layer_class: type[LlamaDecoderLayer] = StableLmDecoderLayer

    def __init__(self, cfg: dict[str, Any], max_position: int, backend: AttentionBackend) -> None:
        if cfg.get("qk_layernorm"):
            raise ValueError(
                "model: config.json's qk_layernorm (per-head LayerNorms of q and k) is not supported"
            )
        if cfg.get("use_parallel_residual"):  # (this model's layers, before they are built)
            self.decoder_layer_class = StableLmParallelDecoderLayer
        super().__init__(cfg, max_position, backend)
        self.norm = layer_norm(cfg)

    @staticmethod
    def attention_biases(cfg: dict[str, Any]) -> Biases:
        return bool(cfg.get("use_qkv_bias", False)), False

    @staticmethod
    def rope_config(cfg: dict[str, Any]) -> dict[str, Any]:
        """StableLmConfig's partial_rotary_factor (0.25) where config.json names none."""
        if "partial_rotary_factor" in rope_parameters(cfg):
            return cfg
        return {**cfg, "partial_rotary_factor": 0.25}
