"""Runs each step's plan on the model's rank(s) and returns the sampled tokens.

`Executor` is the seam between the engine and the ranks. Two implementations: `InProcessExecutor`
(tensor-parallel size 1, here) and `MultiprocExecutor` (worker/multiproc_executor.py: N ranks, this
process is rank 0). `create_executor` picks one.

Importing this module imports no torch (the ranks' code is imported by the functions that build
them): the front end of an engine process holds an `Executor` (its `EngineProcess`) and starts
without torch, which would cost it a second of start-up and hundreds of MB.
"""

from __future__ import annotations

import abc
import logging
from typing import TYPE_CHECKING

from pagedserve import logs
from pagedserve.config import EngineConfig, architecture_of
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.launch import launch_env

if TYPE_CHECKING:
    from pagedserve.worker.worker import Worker

logger = logging.getLogger(__name__)


class Executor(abc.ABC):
    tensor_parallel_size: int
    num_kv_blocks: int  # per rank: each rank holds this many blocks of its own KV heads
    num_cpu_blocks: int  # per rank, for swapped-out blocks

    @abc.abstractmethod
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank. Raises `EngineDeadError` when a rank is gone."""

    @abc.abstractmethod
    def load_lora(self, name: str, path: str) -> None:
        """Load a LoRA adapter on every rank, between steps. ValueError (naming `lora_modules`) where it
        does not fit the model: then no rank holds any of it."""

    @abc.abstractmethod
    def unload_lora(self, name: str) -> None:
        """Drop a LoRA adapter on every rank, between steps; no request may run through it."""

    @abc.abstractmethod
    def switch_logs(self, switches: logs.LogSwitches) -> None:
        """Every rank in a process of its own writes the records `switches` turns on, between steps."""

    @abc.abstractmethod
    def check_health(self) -> None:
        """Raise `EngineDeadError` if a rank has died (also between steps)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the ranks and release the process groups. Idempotent."""

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 when this server started them, rank order (none in-process)."""
        return []


class InProcessExecutor(Executor):
    tensor_parallel_size = 1

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        self.worker, self.num_kv_blocks, self.num_cpu_blocks = build_worker(config, eos_token_ids)
        log_capacity(config, self.worker, self.num_kv_blocks)

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(output)

    def load_lora(self, name: str, path: str) -> None:
        self.worker.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.worker.unload_lora(name)

    def switch_logs(self, switches: logs.LogSwitches) -> None:
        """One process, whose logging the caller has switched."""

    def check_health(self) -> None:
        """One process: if it runs, it is healthy."""

    def shutdown(self) -> None:
        """Nothing to release in-process."""


def create_executor(config: EngineConfig, eos_token_ids: frozenset[int]) -> Executor:
    """The executor for `config.parallel.tensor_parallel_size`.

    With N > 1 ranks and no launcher, this process becomes rank 0 and starts ranks 1..N-1 on this
    machine. Under a launcher (torchrun sets WORLD_SIZE and RANK), every rank runs the same command:
    rank 0 gets its executor here, and on every other rank this call runs the worker loop and exits
    the process, never returning."""
    tp = config.parallel.tensor_parallel_size
    if tp == 1:
        return InProcessExecutor(config, eos_token_ids)
    check_tensor_parallel_size(config)
    from pagedserve.worker.multiproc_executor import MultiprocExecutor, run_launched_worker

    launch = launch_env()
    if launch is not None and launch.world_size != tp:
        raise ValueError(
            f"tensor_parallel_size: {tp}, but the launcher started {launch.world_size} ranks "
            "(WORLD_SIZE); they must be equal"
        )
    if launch is not None and launch.rank != 0:
        run_launched_worker(config, eos_token_ids, launch)
    return MultiprocExecutor(config, eos_token_ids, launch)


def check_tensor_parallel_size(config: EngineConfig) -> None:
    """Fail before any rank starts when the model's heads or MLP cannot be split `tp` ways."""
    from pagedserve.layers.linear import check_head_split
    from pagedserve.layers.mamba2 import check_split as check_mamba2_split
    from pagedserve.models.hybrid import mamba1_dims, mamba2_dims
    from pagedserve.models.kimi_linear import kimi_delta_dims
    from pagedserve.models.olmo_hybrid import olmo_hybrid_delta_dims
    from pagedserve.models.qwen3_5 import gated_delta_dims

    model, tp = config.model, config.parallel.tensor_parallel_size
    if model.num_layers:  # (the attention heads, where there is attention)
        check_head_split(model.num_heads, model.num_kv_heads, tp)
    dims = mamba2_dims(model.hf_config)
    if dims is not None:
        check_mamba2_split(dims, tp)
    mamba_channels = mamba1_dims(model.hf_config)
    if mamba_channels is not None:
        mamba_channels.check_split(tp)
    if architecture_of(model.hf_config) in (
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3NextForCausalLM",
    ):  # (its linear attention's key heads)
        gated_delta_dims(model.hf_config).check_split(tp)
    if architecture_of(model.hf_config) == "KimiLinearForCausalLM":  # (its linear attention's heads)
        kimi_delta_dims(model.hf_config).check_split(tp)
    if architecture_of(model.hf_config) == "OlmoHybridForCausalLM":
        olmo_hybrid_delta_dims(model.hf_config).check_split(tp)
    widths = model.hf_config.get("intermediate_size", 0)  # (Gemma 3n's: one a layer)
    for intermediate_size in widths if isinstance(widths, list) else [widths]:
        if int(intermediate_size) % tp:
            raise ValueError(
                f"tensor_parallel_size: {tp} does not divide the model's intermediate size {intermediate_size}"
            )


def build_worker(config: EngineConfig, eos_token_ids: frozenset[int]) -> tuple[Worker, int, int]:
    """This rank's worker and its KV cache: (worker, KV blocks, CPU blocks).

    The scheduler's block ids index every rank's cache, so all ranks take the same number of blocks:
    the minimum of what each has room for."""
    import torch

    from pagedserve.distributed import all_reduce_min
    from pagedserve.worker.worker import Worker

    torch.manual_seed(config.seed)
    worker = Worker(config, eos_token_ids)
    num_blocks = all_reduce_min(worker.determine_num_blocks())
    num_cpu_blocks = all_reduce_min(worker.determine_num_cpu_blocks())
    worker.init_cache(num_blocks, num_cpu_blocks)
    return worker, num_blocks, num_cpu_blocks


def log_capacity(config: EngineConfig, worker: Worker, num_blocks: int) -> None:
    block_size, max_len = config.cache.block_size, config.model.max_model_len
    logger.info(
        "KV cache: %d blocks of %d tokens per rank (%.2f GiB, %d tokens, %d KV heads, %s); "
        "tensor-parallel size %d; max concurrency at %d tokens per request: %.2fx",
        num_blocks,
        block_size,
        num_blocks * worker.bytes_per_block() / 1024**3,
        num_blocks * block_size,
        worker.num_kv_heads,
        config.model.dtype,
        config.parallel.tensor_parallel_size,
        max_len,
        num_blocks * block_size / max_len,
    )
