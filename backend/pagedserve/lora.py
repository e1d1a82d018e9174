"""LoRA adapters (PEFT's format) served beside the base model, as vLLM's multi-LoRA serving.

The adapters given at start-up (`--lora-modules name=path,...`) and those loaded since (`add`, between
steps) stay loaded until removed; a request names one (`lora_name`) or none, and one batch mixes them
freely. A targeted linear layer adds, for the rows of each adapter in the step,
`scale * (x @ A^T) @ B^T` to the base product (PEFT's forward, with `scale = lora_alpha / r`, or
`lora_alpha / sqrt(r)` under rsLoRA). The merged layers (q/k/v, gate/up) take their parts' A stacked
and B block-diagonal, and a step mixing adapters multiplies by all of them side by side, masking
other adapters' columns per token: one pair of thin products a layer whatever the mix. A LoRA of a
fused module (Phi-3's `qkv_proj`, `gate_up_proj`) is its parts' LoRAs sharing one A. With tensor
parallelism each rank keeps the slices its base weights have: B split as a column-parallel layer's
outputs, A as a row-parallel layer's inputs (its update is added before the all-reduce).

A step with LoRA rows runs the eager forward pass: the compiled one and `decode_layers` are built
for the base weights alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from pagedserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.lora_config import (
    ADAPTER_WEIGHTS,
    FUSED_TARGETS,
    MODULE_NAMES,
    TARGETS,
    WEIGHT_NAME,
    AdapterConfig,
    read_adapter_config,
)

if TYPE_CHECKING:
    from pagedserve.models.llama import LlamaForCausalLM


class LoRAStep:
    """The step under way: each token's adapter index (-1: none), or `single`, the one adapter every
    token of the step runs through; and the masks the layers share (`mask`)."""

    def __init__(self) -> None:
        self.token_adapters: torch.Tensor | None = None  # None: no LoRA in this step
        self.single: int | None = None
        self._masks: dict[int, torch.Tensor] = {}

    def mask(self, column_adapters: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, columns]: 1 where the column belongs to the token's adapter, else 0. Made once a step
        per column layout (layers with the same targets and ranks share theirs)."""
        assert self.token_adapters is not None
        mask = self._masks.get(id(column_adapters))
        if mask is None:
            mask = (self.token_adapters[:, None] == column_adapters[None, :]).to(dtype)
            self._masks[id(column_adapters)] = mask
        return mask

    def start(self, token_adapters: torch.Tensor, single: int | None) -> None:
        self.token_adapters, self.single, self._masks = token_adapters, single, {}

    def end(self) -> None:
        self.token_adapters, self.single, self._masks = None, None, {}


class LoRALinear:
    """The adapters' updates of one linear layer on this rank, the scale folded into B: per adapter
    (A^T [in, r], B^T [r, out]), and all of them side by side (A^T [in, R], B^T [R, out], R the sum
    of their ranks) with each column's adapter, for steps that mix adapters."""

    def __init__(self, step: LoRAStep) -> None:
        self.step = step
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.stacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # `stack`

    def stack(self, layouts: dict[tuple[int, ...], torch.Tensor]) -> None:
        """Lay the adapters side by side (again, after one is added or removed); `layouts` shares equal
        column layouts."""
        if not self.weights:
            self.stacked = None
            return
        indices = sorted(self.weights)
        a = torch.cat([self.weights[i][0] for i in indices], dim=1)
        b = torch.cat([self.weights[i][1] for i in indices], dim=0)
        layout = tuple(i for i in indices for _ in range(self.weights[i][0].shape[1]))
        if layout not in layouts:
            layouts[layout] = torch.tensor(layout, device=a.device)
        self.stacked = (a, b, layouts[layout])

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base product of `x`) plus each token's adapter's update: one pair of products
        whatever the mix (a step of one adapter multiplies by its own A and B alone; in a mixed one,
        the columns of the other adapters are masked to 0 for each token)."""
        step = self.step
        if step.token_adapters is None or self.stacked is None:
            return out
        if step.single is not None:
            weights = self.weights.get(step.single)
            return out if weights is None else out.addmm(x @ weights[0], weights[1])
        a, b, column_adapters = self.stacked
        return out.addmm((x @ a) * step.mask(column_adapters, x.dtype), b)


class LoRAModels:
    """The loaded adapters (`--lora-modules`, then `add` and `remove` at run time), in the model's
    linear layers (`layer.lora`). An adapter keeps its index while loaded; a removed one's is reused."""

    def __init__(
        self, adapters: tuple[tuple[str, str], ...], model: LlamaForCausalLM, dtype: torch.dtype
    ) -> None:
        if model.recurrent_layers:
            raise ValueError(f"lora_modules: {type(model).__name__}'s LoRA adapters are not served")
        self.dtype = dtype
        self.names: list[str | None] = []  # by index; None: a free index
        self.step = LoRAStep()
        self.layers = _target_layers(model)
        # a checkpoint's rows as the model reads them (ERNIE 4.5's and GLM-4's q and k reordered)
        self.checkpoint_rows = model.checkpoint_rows
        self.updates = {key: LoRALinear(self.step) for key in self.layers}
        for key, layer in self.layers.items():
            layer.lora = self.updates[key]
        for name, path in adapters:
            self.add(name, path, stack=False)
        self._stack()

    def index_of(self, name: str | None) -> int:
        """The adapter's index, -1 for the base model."""
        return -1 if name is None else self.names.index(name)

    def add(self, name: str, path: str, stack: bool = True) -> None:
        """Load an adapter; on a ValueError (naming `lora_modules`) nothing of it stays loaded."""
        index = self.names.index(None) if None in self.names else len(self.names)
        try:
            self._load(index, read_adapter_config(name, path), self.dtype)
        except ValueError:
            self._drop(index)
            raise
        if index == len(self.names):
            self.names.append(name)
        self.names[index] = name
        if stack:
            self._stack()

    def remove(self, name: str) -> None:
        index = self.names.index(name)
        self.names[index] = None
        self._drop(index)
        self._stack()

    def _drop(self, index: int) -> None:
        for update in self.updates.values():
            update.weights.pop(index, None)

    def _stack(self) -> None:
        layouts: dict[tuple[int, ...], torch.Tensor] = {}
        for update in self.updates.values():
            update.stack(layouts)

    @contextlib.contextmanager
    def running(self, token_adapters: torch.Tensor, device: torch.device) -> Iterator[None]:
        """Apply the adapters in the forward pass run inside: `token_adapters` [tokens] (on the CPU:
        no device sync) holds each token's adapter index (-1: none)."""
        first = int(token_adapters[0])
        single = first if first >= 0 and bool((token_adapters == first).all()) else None
        self.step.start(token_adapters.to(device, non_blocking=True), single)
        try:
            yield
        finally:
            self.step.end()

    def _load(self, index: int, config: AdapterConfig, dtype: torch.dtype) -> None:
        """Read the adapter's A and B of every targeted module and hand each layer its slices."""

        def fail(why: str) -> ValueError:
            return ValueError(f"lora_modules: adapter {config.name!r} ({config.path}): {why}")

        try:
            with safe_open(str(Path(config.path) / ADAPTER_WEIGHTS), framework="pt") as weights:
                tensors = {key: weights.get_tensor(key) for key in weights.keys()}  # noqa: SIM118
        except Exception as exc:  # safetensors' own error (a truncated file, not safetensors at all)
            raise fail(f"{ADAPTER_WEIGHTS} does not read: {exc}") from None
        parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            match = WEIGHT_NAME.fullmatch(key)
            if match is None or match.group(2) not in MODULE_NAMES:
                raise fail(
                    f"weight {key!r} is not a LoRA of a decoder layer's projection ({', '.join(MODULE_NAMES)})"
                )
            layer, module, which = int(match.group(1)), match.group(2), match.group(3)
            parts.setdefault((layer, module), {})[which] = tensor.float()
        by_layer: dict[tuple[int, str], list[tuple[str | int | None, torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), pair in sorted(parts.items()):
            if set(pair) != {"A", "B"}:
                raise fail(f"layer {layer} {module} has lora_{''.join(pair)} alone")
            a, b = pair["A"], pair["B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                raise fail(
                    f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not chain"
                )
            try:
                b = self.checkpoint_rows(module, b)
            except ValueError as exc:
                raise fail(f"layer {layer} {module} does not fit the model: {exc}") from None
            our_layer = TARGETS[FUSED_TARGETS.get(module, (module,))[0]][0]
            if (layer, our_layer) not in self.layers and (layer, module) in self.layers:
                # a projection the model holds alone under the checkpoint's name (an ungated MLP's
                # up_proj, DeepSeek-V2-Lite's q_proj)
                our_layer = module
            if (layer, our_layer) not in self.layers:
                there = any(number == layer for number, _ in self.layers)  # the layer, not the module
                if there and our_layer == "qkv_proj":
                    raise fail(
                        f"layer {layer} {module}: the layer's attention has no such projection (multi-head "
                        "latent attention: its o_proj, and its q_proj where it has one, take a LoRA)"
                    )
                if there:
                    raise fail(
                        f"layer {layer} {module}: the layer's MLP is a mixture of experts, whose "
                        "projections take no LoRA here (its attention's do)"
                    )
                raise fail(f"layer {layer} {module}: the model has {_num_layers(self.layers)} layers")
            pieces = by_layer.setdefault((layer, our_layer), [])
            try:
                b_parts = _parts(self.layers[layer, our_layer], module, b)
            except ValueError as exc:
                raise fail(f"layer {layer} {module} does not fit the model: {exc}") from None
            for shard, b_part in b_parts:
                if any(shard == other for other, _, _ in pieces):
                    raise fail(
                        f"layer {layer}: {module} overlaps another module adapted (a fused one and its part)"
                    )
                pieces.append((shard, a, b_part * config.scale(module, a.shape[0])))
        for key, pieces in by_layer.items():
            try:
                self.updates[key].weights[index] = _slices(self.layers[key], pieces, dtype)
            except ValueError as exc:  # a shape that is not the base weight's
                raise fail(f"layer {key[0]} {key[1]} does not fit the model: {exc}") from None


Linear = ColumnParallelLinear | RowParallelLinear


def _target_layers(model: LlamaForCausalLM) -> dict[tuple[int, str], Linear]:
    """(layer number, our layer name) -> the linear layer, for every layer a LoRA can target."""
    found: dict[tuple[int, str], Linear] = {}
    for number, layer in enumerate(model.decoder_layers):
        for name, module in (*layer.self_attn.named_children(), *layer.mlp.named_children()):
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                found[number, name] = module
    return found


def _parts(layer: Linear, module: str, b: torch.Tensor) -> list[tuple[str | int | None, torch.Tensor]]:
    """(shard id, its rows of lora_B) for each part of the layer `module` adapts: one for a module
    of its own, each part's rows for a fused one (ValueError where they do not add up)."""
    if module not in FUSED_TARGETS:  # (a part of a merged layer, or a layer of its own)
        merged = isinstance(layer, QKVParallelLinear | MergedColumnParallelLinear)
        return [(TARGETS[module][1] if merged else None, b)]
    shards = [TARGETS[part][1] for part in FUSED_TARGETS[module]]
    sizes = [_out_features(layer, shard) for shard in shards]
    if b.shape[0] != sum(sizes):
        raise ValueError(f"lora_B has {b.shape[0]} output features, the fused layer {sum(sizes)}")
    return list(zip(shards, b.split(sizes)))


def _num_layers(layers: dict[tuple[int, str], Linear]) -> int:
    return 1 + max(number for number, _ in layers)


def _slices(
    layer: Linear,
    pieces: list[tuple[str | int | None, torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A^T, B^T) of one layer on this rank: the parts' A stacked [R, in], B placed block-diagonally
    [out, R], then sharded by the layer's own weight loaders as its base weight is. Raises ValueError
    where a part's shape is not its base weight's (the loaders would slice a larger one silently)."""
    total_rank = sum(a.shape[0] for _, a, _ in pieces)
    a_full = torch.cat([a for _, a, _ in pieces])
    shape, tp_size = layer.weight_shape, layer.tp_size
    device = (layer.packed_weight if layer.packed_weight is not None else layer.weight).device
    in_features = shape[1] * (tp_size if isinstance(layer, RowParallelLinear) else 1)
    if a_full.shape[1] != in_features:
        raise ValueError(f"lora_A has {a_full.shape[1]} input features, the layer {in_features}")
    for shard, _, b in pieces:
        out_features = _out_features(layer, shard)
        if b.shape[0] != out_features:
            part = "" if shard is None else f" ({shard})"
            raise ValueError(f"lora_B{part} has {b.shape[0]} output features, the layer {out_features}")
    to = lambda t: t.detach().t().contiguous().to(device=device, dtype=dtype)  # noqa: E731
    if isinstance(layer, RowParallelLinear):  # one part: A split by input, B whole
        a_local = _zeros(total_rank, shape[1])
        layer.weight_loader(a_local, a_full)
        return to(a_local), to(pieces[0][2])
    b_local = _zeros(shape[0], total_rank)  # A whole, B split by output
    offset = 0
    for shard, a, b in pieces:
        padded = torch.zeros(b.shape[0], total_rank)
        padded[:, offset : offset + a.shape[0]] = b
        offset += a.shape[0]
        if isinstance(layer, QKVParallelLinear):
            layer.weight_loader(b_local, padded, str(shard))
        elif isinstance(layer, MergedColumnParallelLinear):
            assert isinstance(shard, int)
            layer.weight_loader(b_local, padded, shard)
        else:
            layer.weight_loader(b_local, padded)
    return to(a_full), to(b_local)


def _zeros(*shape: int) -> torch.nn.Parameter:
    """What the layers' weight loaders write into (they take a parameter, as a checkpoint's)."""
    return torch.nn.Parameter(torch.zeros(*shape), requires_grad=False)


def _out_features(layer: Linear, shard: str | int | None) -> int:
    """The whole model's output features of `layer`'s part `shard` (every rank's)."""
    if isinstance(layer, QKVParallelLinear):
        heads = layer.num_heads * layer.tp_size
        if shard != "q":
            heads = layer.num_kv_heads * layer.tp_size // layer.num_kv_head_replicas
        return heads * layer.head_dim
    if isinstance(layer, MergedColumnParallelLinear):
        assert isinstance(shard, int)
        return layer.output_sizes[shard]
    return int(layer.weight_shape[0] * (1 if isinstance(layer, RowParallelLinear) else layer.tp_size))
