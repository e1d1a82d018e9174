"""One rank's worker: the model runner plus this rank's KV cache, sized from a memory budget."""

from __future__ import annotations

import logging

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.worker.cache_engine import CacheEngine
from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 1024**3  # zero-filling CPU memory is slow: raise with --kv-cache-memory
_CPU_DEFAULT_KV_SHARE = 0.25  # of available memory, when that is less than the default
# On every device the default is at most this many times what max_num_seqs sequences of max_model_len
# tokens hold: every live sequence at full length, and as much again for cached prefixes (vLLM's users
# asked for such a cap, vllm#33263: 18.78 GiB taken for max_num_seqs 1 and a 1,024-token context).
# Only small models or small settings reach it: the tests' tiny model takes 64 MiB, where filling 1 GiB
# took 2-3.5 s of a start here; SmolLM2-135M's defaults would need 2 x 128 x 8,192 tokens x 23 KB = 45 GiB.
_DEFAULT_KV_LIVE_FACTOR = 2


def gpu_kv_budget(free: int, total: int, memory_utilization: float) -> int:
    """The bytes a GPU leaves the KV cache when no budget is given: its memory up to
    `memory_utilization` of the total, less what is in use (this process's weights and buffers, and
    whatever else runs on the device). ValueError naming memory_utilization when nothing is left."""
    budget = int(free - (1.0 - memory_utilization) * total)
    if budget <= 0:
        raise ValueError(
            f"memory_utilization: {memory_utilization:g} of the GPU's {total / 1024**3:.1f} GiB leaves nothing "
            f"for the KV cache, {(total - free) / 1024**3:.1f} GiB being in use already; raise it, free the "
            "GPU, or set kv_cache_memory"
        )
    return budget


class Worker:
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        self.config = config
        self.model_runner = ModelRunner(config, eos_token_ids)
        self.cache_engine: CacheEngine | None = None

    @property
    def num_kv_heads(self) -> int:
        layers = self.model_runner.model.attention_layers
        if not layers:  # (no attention: 1)
            return self.config.model.num_kv_heads
        # this rank's heads of the model's head size (Gemma 4's layers hold the same entry in heads of
        # sizes of their own: `config.kv_cache_entry`)
        return layers[0].num_kv_heads * layers[0].head_dim // self.config.model.head_dim

    def bytes_per_block(self) -> int:
        model = self.config.model
        return CacheEngine.bytes_per_block(
            model.num_layers,
            self.config.cache.block_size,
            self.num_kv_heads,
            model.head_dim,
            self.model_runner.dtype,
            model.values_in_keys,
        )

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.config.model.num_layers == 0:  # no attention (Mamba2's): blocks of nothing, as many as
            # every request can fill (they count the tokens for the scheduler alone)
            blocks_per_seq = -(-self.config.model.max_model_len // cache.block_size)
            return self.config.scheduler.max_num_seqs * blocks_per_seq
        budget = cache.kv_cache_memory if cache.kv_cache_memory is not None else self._default_kv_budget()
        num_blocks = budget // self.bytes_per_block()
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory: {budget} bytes is less than one KV block ({self.bytes_per_block()} bytes)"
            )
        return num_blocks

    def _default_kv_budget(self) -> int:
        blocks_per_seq = -(-self.config.model.max_model_len // self.config.cache.block_size)
        most = (
            _DEFAULT_KV_LIVE_FACTOR
            * self.config.scheduler.max_num_seqs
            * blocks_per_seq
            * self.bytes_per_block()
        )
        if self.model_runner.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.model_runner.device)
            budget = gpu_kv_budget(free, total, self.config.cache.memory_utilization)
        else:
            import psutil

            budget = min(_CPU_DEFAULT_KV_BYTES, _CPU_DEFAULT_KV_SHARE * psutil.virtual_memory().available)
        if most < budget:
            logger.info(
                "KV cache budget: %.2f GiB, twice what max_num_seqs (%d) sequences of max_model_len (%d) "
                "tokens hold (--kv-cache-memory sets it)",
                most / 1024**3,
                self.config.scheduler.max_num_seqs,
                self.config.model.max_model_len,
            )
        return int(min(budget, most))

    def determine_num_cpu_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_cpu_blocks is not None:
            return cache.num_cpu_blocks
        return int(cache.swap_space * 1024**3) // self.bytes_per_block()

    def init_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        model = self.config.model
        self.cache_engine = CacheEngine(
            model.num_layers,
            num_blocks,
            self.config.cache.block_size,
            self.num_kv_heads,
            model.head_dim,
            self.model_runner.dtype,
            self.model_runner.device,
            num_cpu_blocks,
            model.values_in_keys,
        )
        self.model_runner.bind_kv_cache(self.cache_engine.kv_caches)

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        # The order matters: blocks freed by a swap out may be the destinations of this step's copies.
        cache = self.cache_engine
        assert cache is not None, "init_cache() first"
        if output.blocks_to_swap_out:
            cache.swap_out(output.blocks_to_swap_out)
        if output.blocks_to_swap_in:
            cache.swap_in(output.blocks_to_swap_in)
        if output.blocks_to_copy:
            cache.copy_blocks(output.blocks_to_copy)
        return self.model_runner.execute(output)

    def load_lora(self, name: str, path: str) -> None:
        self.model_runner.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.model_runner.unload_lora(name)
