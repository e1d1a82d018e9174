"""Command-line and environment settings: every flag is a field here, also read from `PAGEDSERVE_<NAME>`.

This is the one place environment variables are read. Settings turn into the frozen `EngineConfig`.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pagedserve.chat_template import parse_chat_template_kwargs, resolve_chat_template
from pagedserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    checkpoint_dtype,
    for_recurrent_state,
    parse_generation_overrides,
    parse_hf_overrides,
    resolve_attention_backend,
    resolve_block_size,
    resolve_compile,
    resolve_cuda_graphs,
    resolve_device,
    resolve_dtype,
)
from pagedserve.gguf_model import check_model_file
from pagedserve.lora_config import parse_lora_modules
from pagedserve.spec_decode import SpeculativeConfig
from pagedserve.tokenizer import check_tokenizer_dir

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}


def cache_root() -> Path:
    """Where converted models are cached: $PAGEDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pagedserve."""
    if os.environ.get("PAGEDSERVE_CACHE_DIR"):
        return Path(os.environ["PAGEDSERVE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedserve"


def parse_size(value: str | int | None) -> int | None:
    """'4GiB', '512MiB', '2e9' or a byte count -> bytes."""
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a memory size: {value!r} (use e.g. 4GiB, 512MiB or a byte count)")
    size = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if not math.isfinite(size):  # '1e999': int() of it would raise OverflowError, not a ValueError
        raise ValueError(f"not a memory size: {value!r} is too large")
    return int(size)


# field -> the parser that checks it as the engine will read it (ValueError naming the field)
_PARSED_FIELDS: dict[str, Callable[[Any], object]] = {
    "model": check_model_file,
    "tokenizer": check_tokenizer_dir,
    "lora_modules": parse_lora_modules,
    "chat_template": resolve_chat_template,
    "default_chat_template_kwargs": lambda value: parse_chat_template_kwargs(
        value, "default_chat_template_kwargs"
    ),
    "speculative_config": SpeculativeConfig.parse,
    "hf_overrides": parse_hf_overrides,
    "override_generation_config": parse_generation_overrides,
}


class EngineSettings(BaseSettings):
    """Everything needed to build an engine. Field `max_num_seqs` is flag `--max-num-seqs` and env
    `PAGEDSERVE_MAX_NUM_SEQS`."""

    model_config = SettingsConfigDict(env_prefix="PAGEDSERVE_", protected_namespaces=(), extra="ignore")

    model: str | None = Field(
        None,
        description="a local Hugging Face model directory, or a GGUF file converted once into a cached one "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    tokenizer: str | None = Field(
        None,
        description="a directory holding the tokenizer (and its chat template) to use instead of the "
        "model directory's, as vLLM's --tokenizer",
    )
    served_model_name: str | None = Field(
        None,
        description="name clients use for the model (default: the directory's name, a GGUF file's without .gguf)",
    )
    dtype: str = Field("auto", description="auto, float32, bfloat16 or float16")
    generation_config: Literal["auto", "vllm"] = Field(
        "auto",
        description="auto: sampling parameters a request leaves unset take the model's generation_config.json "
        "values (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as in vLLM; "
        "vllm: the built-in defaults",
    )
    hf_overrides: str | dict[str, Any] | None = Field(
        None,
        description="config.json keys to replace, a JSON object as vLLM's: e.g. '{\"rope_scaling\": "
        '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}\' for '
        "Qwen3's 128K context",
    )
    override_generation_config: str | dict[str, Any] | None = Field(
        None,
        description="sampling defaults over the model's generation_config.json (or alone, with "
        "--generation-config vllm), a JSON object of its keys as vLLM's: e.g. '{\"temperature\": 0.6, "
        '"max_new_tokens": 512}\'',
    )
    device: str = Field("auto", description="auto, cpu or cuda")
    max_model_len: int | None = Field(None, description="context length limit (default: the model's)")
    block_size: int | None = Field(
        None, description="tokens per KV-cache block (default: 16 for the Triton kernels, 8 on CPU)"
    )
    kv_cache_memory: str | None = Field(
        None, description="KV-cache budget, e.g. 4GiB (default: a share of free memory)"
    )
    memory_utilization: float = Field(
        0.9,
        description="GPU: the share of its total memory the server may fill when no KV budget is given "
        "(as vLLM's --gpu-memory-utilization): the KV cache takes what the weights and the GPU's other "
        "users leave of it; unused on CPU",
    )
    num_kv_blocks: int | None = Field(
        None, description="exact number of KV-cache blocks (overrides the budget)"
    )
    swap_space: float = Field(
        4.0,
        ge=0,
        allow_inf_nan=False,
        description="GiB of CPU memory for preempted requests' KV blocks (0 = recompute only)",
    )
    num_cpu_kv_blocks: int | None = Field(
        None, description="exact number of CPU swap blocks (overrides --swap-space)"
    )
    preemption_mode: str = Field(
        "swap", description="swap (when the CPU pool has room, else recompute) or recompute"
    )
    scheduling_policy: str = Field(
        "fcfs",
        description="fcfs (first come, first served) or priority (a request's priority, lower first, then "
        "arrival; a more urgent request preempts less urgent running ones when the batch or the KV cache is "
        "full)",
    )
    enable_prefix_caching: bool = Field(True, description="share KV blocks of identical prompt prefixes")
    max_num_seqs: int = Field(128, description="most sequences in one batch")
    max_num_batched_tokens: int = Field(2048, description="token budget of one engine step")
    tensor_parallel_size: int = Field(1, description="number of tensor-parallel worker ranks")
    seed: int = Field(0, description="seed for unseeded random sampling")
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="auto (triton on CUDA, torch on CPU), torch (on CPU the C++ kernels, built on first "
        "use, where a C++ compiler is found; else the pure-torch reference) or triton "
        "(Triton kernels; on CPU under Triton's interpreter, which is slow)",
    )
    enforce_eager: bool = Field(
        False,
        description="run the forward pass eagerly: no CUDA graphs for decode steps on a GPU, no "
        "torch.compile on a CPU (ready ~10 s sooner on a CPU with "
        "AMX once torch's compile cache holds the compiled layer, ~40 s on a machine's first start, "
        "~12 s with float32 weights in oneDNN's layout (CPUs other than Intel's), ~55 s on a first start, "
        "55 to 65 s at every start where the weights are frozen into the graph: float32 on Intel's CPUs, "
        "or bfloat16 without AMX; "
        "decode steps still run in the C++ kernels, steps with prompts run slower: 3 to 6 percent less "
        "throughput on the benchmarks; compile is used on CPU with the torch backend and one rank)",
    )

    lora_modules: str | dict[str, str] | None = Field(
        None,
        description="LoRA adapters to serve beside the model, name=path items separated by commas (PEFT "
        "directories: adapter_config.json and adapter_model.safetensors); a request names one as lora_name",
    )

    chat_template: str | None = Field(
        None,
        description="a Jinja chat template replacing the model's, or the path of a file holding one",
    )
    default_chat_template_kwargs: str | dict[str, Any] | None = Field(
        None,
        description="chat template variables every chat request gets unless it sets them: a JSON object, "
        "e.g. '{\"enable_thinking\": false}' for Qwen3",
    )

    speculative_config: str | dict[str, Any] | None = Field(
        None,
        description='speculative decoding, a JSON object as vLLM\'s: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}: drafts from the '
        "sequence's own earlier tokens, verified in one step",
    )

    @field_validator(*_PARSED_FIELDS)
    @classmethod
    def _check_parsed(cls, value: Any, info: ValidationInfo) -> Any:
        """The fields their own parser checks, whose errors name the field first (pydantic's error
        names the flag or variable instead)."""
        field = str(info.field_name)
        try:
            _PARSED_FIELDS[field](value)
        except ValueError as exc:
            raise ValueError(str(exc).removeprefix(f"{field}: ")) from None
        return value

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_size(cls, value: str | None) -> str | None:
        parse_size(value)
        return value

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        """Checked here, not by torch once the ports are bound and the weights half loaded."""
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", value):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        if value.startswith("cuda"):
            import torch

            index = int(value.partition(":")[2] or 0)
            if index >= torch.cuda.device_count():
                raise ValueError(f"{torch.cuda.device_count()} CUDA devices are visible")
        return value

    @model_validator(mode="after")
    def _check_limits(self) -> EngineSettings:
        """The checks that need no model, at once: a bad value stops `serve` before it binds a port.
        Without importing torch to resolve the device (~3 s): an unset block size's default for it (8 or
        16) is valid either way, so any stands in for it here."""
        self._cache_config(16 if self.block_size is None else self.block_size)
        self._scheduler_config(self.max_model_len or 1)
        ParallelConfig(tensor_parallel_size=self.tensor_parallel_size)
        return self

    def _cache_config(self, block_size: int) -> CacheConfig:
        return CacheConfig(
            block_size=block_size,
            kv_cache_memory=parse_size(self.kv_cache_memory),
            memory_utilization=self.memory_utilization,
            num_blocks=self.num_kv_blocks,
            swap_space=self.swap_space,
            num_cpu_blocks=self.num_cpu_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
        )

    def _scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            preemption_mode=self.preemption_mode,
            scheduling_policy=self.scheduling_policy,
            speculative=SpeculativeConfig.parse(self.speculative_config),
        )

    def to_engine_config(self) -> EngineConfig:
        from pagedserve.default_model import resolve_model_path

        device = resolve_device(self.device)
        backend = resolve_attention_backend(self.attention_backend, device)
        model_path = resolve_model_path(self.model)
        model = ModelConfig.from_path(
            model_path,
            resolve_dtype(self.dtype, device, checkpoint_dtype(model_path)),
            self.max_model_len,
            self.served_model_name,
            self.generation_config,
            parse_hf_overrides(self.hf_overrides),
            parse_generation_overrides(self.override_generation_config),
            self.tokenizer,
        )
        cache, scheduler = for_recurrent_state(
            model,
            self._cache_config(resolve_block_size(self.block_size, backend)),
            self._scheduler_config(model.max_model_len),
        )
        # A model with a state per request runs eagerly: compiled (its recurrent layers opaque ops) it
        # ran slower here (bench/README.md, "Hybrid models"), and its decode steps' rows and gather
        # indices are not kept in static buffers for CUDA graphs.
        eager = self.enforce_eager or model.recurrent
        return EngineConfig(
            model=model,
            cache=cache,
            scheduler=scheduler,
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            device=device,
            seed=self.seed,
            attention_backend=backend,
            compile=resolve_compile(eager, device, backend, self.tensor_parallel_size),
            cuda_graphs=resolve_cuda_graphs(eager, device, backend, self.tensor_parallel_size),
            lora_modules=parse_lora_modules(self.lora_modules),
            chat_template=resolve_chat_template(self.chat_template),
            default_chat_template_kwargs=parse_chat_template_kwargs(
                self.default_chat_template_kwargs, "default_chat_template_kwargs"
            ),
        )


class OtelSettings(BaseSettings):
    """The standard OpenTelemetry variables pagedserve acts on itself (the SDK and the OTLP exporter read
    the rest, e.g. OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)."""

    model_config = SettingsConfigDict(env_prefix="OTEL_", extra="ignore")

    traces_exporter: str | None = Field(None, description="otlp, console or none, comma separated")
    exporter_otlp_traces_protocol: str | None = Field(None, description="grpc or http/protobuf")
    exporter_otlp_protocol: str | None = Field(None, description="fallback for the traces protocol")
    sdk_disabled: bool = Field(False, description="true turns tracing off whatever else is set")


def add_settings_arguments(parser: argparse.ArgumentParser, settings_cls: type[BaseSettings]) -> None:
    """One `--kebab-case` flag per settings field. Unset flags stay None so env vars and defaults apply."""
    for name, info in settings_cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        base = _base_type(info.annotation)
        help_text = f"{info.description or ''} [env PAGEDSERVE_{name.upper()}]"
        if base is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif get_origin(_unset_removed(info.annotation)) is Literal:
            choices = get_args(_unset_removed(info.annotation))
            parser.add_argument(flag, dest=name, choices=choices, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=base, default=None, help=help_text)


class SettingsError(ValueError):
    """A bad setting, said in the operator's terms: the flag or the environment variable that set it."""


# Config fields named differently from the setting that fills them (config.py's messages use these).
_SETTING_OF_CONFIG_FIELD = {"num_blocks": "num_kv_blocks", "num_cpu_blocks": "num_cpu_kv_blocks"}


def flags_given(settings_cls: type[BaseSettings], args: argparse.Namespace) -> dict[str, Any]:
    return {
        name: getattr(args, name)
        for name in settings_cls.model_fields
        if getattr(args, name, None) is not None
    }


# settings whose values an error message never repeats (it may reach logs other people read)
SECRET_SETTINGS = frozenset({"api_key"})


def settings_from_args(settings_cls: type[BaseSettings], args: argparse.Namespace) -> Any:
    given = flags_given(settings_cls, args)
    try:
        return settings_cls(**given)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            message = str(error["msg"]).removeprefix("Value error, ")
            if error["loc"]:
                name = str(error["loc"][0])
                got = "" if name in SECRET_SETTINGS else f" (got {error['input']!r})"
                lines.append(f"{setting_source(name, given)}: {message}{got}")
            else:  # a check across fields (config.py), its message starting with the field it is about
                lines.append(str(config_error(ValueError(message), given)))
        raise SettingsError("\n".join(lines)) from None


def config_error(exc: ValueError, given: dict[str, Any] | set[str]) -> SettingsError:
    """config.py's `field: what is wrong`, with the field said as the flag or variable that set it."""
    field, _, rest = str(exc).partition(": ")
    if not rest or not field.isidentifier():
        return SettingsError(str(exc))
    return SettingsError(f"{setting_source(_SETTING_OF_CONFIG_FIELD.get(field, field), given)}: {rest}")


def setting_source(name: str, given: dict[str, Any] | set[str]) -> str:
    """`--max-num-seqs` or `PAGEDSERVE_MAX_NUM_SEQS`, whichever set it (both when neither did)."""
    flag, variable = "--" + name.replace("_", "-"), f"PAGEDSERVE_{name.upper()}"
    if name in given:
        return flag
    if variable in os.environ:
        return variable
    return f"{flag} / {variable}"


def _unset_removed(annotation: Any) -> Any:
    """`X | None` -> X."""
    if get_origin(annotation) in (Union, types.UnionType):
        return next(arg for arg in get_args(annotation) if arg is not type(None))
    return annotation


def _base_type(annotation: Any) -> type:
    annotation = _unset_removed(annotation)
    return annotation if isinstance(annotation, type) else str
