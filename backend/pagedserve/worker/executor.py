"""Runs each step's plan on the worker(s). This is the in-process executor (tensor-parallel size 1)."""

from __future__ import annotations

import logging

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.worker.worker import Worker

logger = logging.getLogger(__name__)


class Executor:
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size: only 1 is supported by this build")
        torch.manual_seed(config.seed)
        self.worker = Worker(config, eos_token_ids)
        self.num_kv_blocks = self.worker.determine_num_blocks()
        self.num_cpu_blocks = self.worker.determine_num_cpu_blocks()
        self.worker.init_cache(self.num_kv_blocks, self.num_cpu_blocks)
        self._log_capacity(config)

    def _log_capacity(self, config: EngineConfig) -> None:
        block_size, max_len = config.cache.block_size, config.model.max_model_len
        kv_bytes = self.num_kv_blocks * self.worker.bytes_per_block()
        max_concurrency = self.num_kv_blocks * block_size / max_len
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %d tokens, %s); max concurrency at %d tokens "
            "per request: %.2fx",
            self.num_kv_blocks,
            block_size,
            kv_bytes / 1024**3,
            self.num_kv_blocks * block_size,
            config.model.dtype,
            max_len,
            max_concurrency,
        )

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(output)

    def shutdown(self) -> None:
        """Nothing to release in-process; multi-process executors stop their ranks here."""
