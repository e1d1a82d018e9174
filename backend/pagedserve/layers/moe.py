"""Mixture-of-experts MLPs (Mixtral, Granite MoE, Qwen2-MoE, Qwen3-MoE, GPT-OSS, GLM-4.5, DeepSeek). A router
scores every expert for each token; the token goes through its `top_k` best, and its output is their
outputs weighted by the router's probabilities (softmax over all experts, then the top k, renormalized
to sum to one where the model says so). Qwen2-MoE adds a shared expert every token goes through, scaled
by a sigmoid gate. GPT-OSS biases the router and the experts, and clamps its SwiGLU (`Experts`).
GLM-4.5 and DeepSeek-V3 score each expert by a sigmoid, pick by the scores plus a bias of their own
among the best groups of experts, scale the weights, and add an ungated shared expert; their router
is float32 (`Router`). DeepSeek-V2 picks by the softmax among the best groups. Nemotron 3 routes as
DeepSeek-V3 does to ungated ReLU² experts (`Experts.gated`), which run one by one on GPUs too; Llama
4 picks its top expert by the logits and scales the expert's input by the sigmoid of its logit
(`Experts.weighted_inputs`, in the fused kernel too).

Experts are tensor-parallel as the dense MLP is: every rank holds each expert's share of the
intermediate features (gate and up column-parallel, down row-parallel), sums its partial outputs,
and the block all-reduces once.

Dispatch, two ways:
- Beside the torch attention backend (CPU): the step's (token, expert) pairs sorted by expert; each
  expert with tokens runs its rows in two matmuls, its weights packed as the dense layers' are. How
  many rows each expert gets is read on the host once a layer (`run_experts`).
- Beside the Triton backend (GPUs): the experts' weights stacked once after loading
  (`stack_experts`) and run by the Triton kernel `pagedserve_kernels.moe.fused_moe`, which groups the
  pairs by expert on the device and reads nothing back: decode steps replay CUDA graphs as a dense
  model's do.
A compiled forward pass leaves the dispatch out of its graph, as one opaque op
(`pagedserve::moe_experts`), as it does attention.
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pagedserve_kernels import reference
from torch import nn

from pagedserve.distributed import all_reduce
from pagedserve.layers import ops
from pagedserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

UNGATED_ACTIVATIONS = ("relu2",)  # (ungated experts': Nemotron 3's)


@dataclass(frozen=True)
class Experts:
    """One layer's experts, as config.json describes them."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    # the top k probabilities scaled to sum to one (Mixtral, Granite; Qwen by norm_topk_prob)
    renormalize: bool
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    bias: bool = False  # GPT-OSS's: the router's, and each expert's gate/up and down projections'
    # "silu": SwiGLU; "swiglu_oai": GPT-OSS's clamped SwiGLU (`swiglu_oai_and_mul`); "gelu_tanh":
    # GELU's tanh approximation of the gate (Gemma 4's)
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # GLM-4.5's routing (DeepSeek-V3's): each expert's score a "sigmoid" of its logit (else a
    # "softmax" over all); the top k picked by the scores plus a bias of the router's own
    # (`e_score_correction_bias`), among the `topk_groups` best of `num_groups` groups of experts (a
    # group's worth: its best two scores summed); the weights (the scores, without the bias) scaled
    # by `routed_scaling_factor`; a router in float32 (`Router`). DeepSeek-V2's groups are worth their
    # best score alone (`group_worth_experts` 1; V3's and GLM's their best two)
    scoring: str = "softmax"
    selection_bias: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_worth_experts: int = 2
    routed_scaling_factor: float = 1.0
    router_float32: bool = False
    shared_gate: bool = True  # Qwen2-MoE's shared expert scaled by a sigmoid gate; GLM-4.5's is not
    # SwiGLU experts (gate and up); Nemotron 3's are ungated: up, ReLU² ("relu2"), down, as is their
    # shared expert
    gated: bool = True
    # Llama 4's: each expert's input scaled by the token's weight for it, its output summed as it is
    weighted_inputs: bool = False
    # "sparsemixer" scoring (Phi-3.5-MoE's, top 2): `route_sparsemixer`'s, within this relative margin
    sparsemixer_eps: float = 0.01

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"model: config.json names {self.num_experts} experts (at least 1)")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"model: config.json's num_experts_per_tok {self.top_k} must be 1 to the {self.num_experts} experts"
            )
        activations = reference.MOE_ACTIVATIONS if self.gated else UNGATED_ACTIVATIONS
        if self.activation not in activations:
            raise ValueError(f"model: experts' activation {self.activation!r} ({' or '.join(activations)})")
        if not (self.swiglu_limit > 0 and math.isfinite(self.swiglu_limit)):
            raise ValueError(f"model: config.json's swiglu_limit must be positive, got {self.swiglu_limit}")
        if self.scoring not in ("softmax", "sigmoid", "sparsemixer"):
            raise ValueError(f"model: experts' scoring {self.scoring!r} (softmax, sigmoid or sparsemixer)")
        if self.scoring == "sparsemixer" and self.top_k != 2:
            raise ValueError(f"model: config.json's num_experts_per_tok {self.top_k}: sparsemixer picks 2")
        if not (self.num_groups >= 1 and self.num_experts % self.num_groups == 0):
            raise ValueError(
                f"model: config.json's n_group {self.num_groups} must divide the {self.num_experts} experts"
            )
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"model: config.json's topk_group {self.topk_groups} must be 1 to n_group {self.num_groups}"
            )
        per_group = self.num_experts // self.num_groups
        if self.num_groups > 1 and per_group < self.group_worth_experts:
            raise ValueError(
                f"model: config.json's n_group leaves groups of {per_group} expert (a group is worth its "
                f"best {self.group_worth_experts})"
            )
        if self.topk_groups * per_group < self.top_k:
            raise ValueError(
                f"model: config.json's topk_group {self.topk_groups} keeps {self.topk_groups * per_group} "
                f"experts, fewer than num_experts_per_tok {self.top_k}"
            )


class Expert(nn.Module):
    """A SwiGLU MLP (GPT-OSS's: clamped, biased), or an ungated one (up, ReLU², down: Nemotron 3's),
    whose output is this rank's partial sums (the block reduces them; rank 0 alone adds the down
    projection's bias)."""

    def __init__(self, hidden_size: int, intermediate_size: int, spec: Experts | None = None) -> None:
        super().__init__()
        bias = spec is not None and spec.bias
        if spec is not None and not spec.gated:
            self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
        else:
            self.gate_up_proj = MergedColumnParallelLinear(
                hidden_size, [intermediate_size, intermediate_size], bias=bias
            )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, reduce_results=False)
        self.spec = spec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec is not None and not self.spec.gated:  # (relu2, `UNGATED_ACTIVATIONS`)
            return self.down_proj(torch.square(F.relu(self.up_proj(x))))
        gate_up = self.gate_up_proj(x)
        if self.spec is None or self.spec.activation == "silu":
            return self.down_proj(ops.silu_and_mul(gate_up))
        if self.spec.activation == "gelu_tanh":  # (Gemma 4's)
            return self.down_proj(reference.gelu_tanh_and_mul(gate_up))
        alpha, limit = self.spec.swiglu_alpha, self.spec.swiglu_limit
        return self.down_proj(reference.swiglu_oai_and_mul(gate_up, alpha, limit))


def route(
    router_logits: torch.Tensor, spec: Experts, selection_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's `top_k` experts [tokens, top_k] (int64) and their weights (float32): the softmax
    of the logits over all experts (or each one's sigmoid), in float32 as transformers takes it; the
    experts picked by those scores, or by the scores plus `selection_bias` among the best groups
    (`Experts`); under "sparsemixer" scoring, `route_sparsemixer`'s."""
    if spec.scoring == "sparsemixer":
        return route_sparsemixer(router_logits, spec.sparsemixer_eps)
    if spec.scoring == "sigmoid":
        scores = router_logits.float().sigmoid()
    else:
        scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    if selection_bias is None and spec.num_groups == 1:
        weights, expert_ids = scores.topk(spec.top_k, dim=-1)
    else:
        choice = scores if selection_bias is None else scores + selection_bias
        if spec.num_groups > 1:
            groups = choice.unflatten(-1, (spec.num_groups, -1))  # [tokens, groups, experts a group]
            worth = groups.topk(spec.group_worth_experts, dim=-1).values.sum(dim=-1)
            best = worth.topk(spec.topk_groups, dim=-1).indices
            kept = torch.zeros_like(worth, dtype=torch.bool).scatter_(1, best, True)
            choice = groups.masked_fill(~kept[..., None], float("-inf")).flatten(-2)
        expert_ids = choice.topk(spec.top_k, dim=-1).indices
        weights = scores.gather(1, expert_ids)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, expert_ids


def route_sparsemixer(router_logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE's routing at inference (transformers' `sparsemixer`, not training): the best expert,
    weighted by its softmax over the experts whose logits lie within a relative 2 `eps` of it; then the
    best of the others, weighted by its softmax over those of the others within 2 `eps` of it (the
    margins measured against each expert's |logit|, at least the best's). In float32."""
    scores = router_logits.float()
    candidates, weights, expert_ids = scores, [], []
    for _ in range(2):
        best, top = candidates.max(dim=-1, keepdim=True)
        far = (best - scores) / scores.abs().clamp(min=best) > 2 * eps
        gates = candidates.masked_fill(far, float("-inf")).softmax(dim=-1)
        weights.append(gates.gather(-1, top))
        expert_ids.append(top)
        candidates = candidates.scatter(-1, top, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(expert_ids, dim=-1)


class Router(nn.Module):
    """GLM-4.5's and DeepSeek's router: its weight [experts, hidden] and the bias it picks experts by
    (`e_score_correction_bias` [experts]) in float32, its logits computed in float32 (transformers
    keeps both in float32 whatever the model's dtype)."""

    def __init__(self, hidden_size: int, num_experts: int, selection_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
            if selection_bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


def run_experts(
    experts: nn.ModuleList,
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    weighted_inputs: bool = False,
) -> torch.Tensor:
    """Each token's experts' outputs weighted by `weights` (or, `weighted_inputs`, their inputs: Llama
    4's, the weight rounded to x's dtype first as transformers' router rounds it) and summed, in
    float32, then in x's dtype."""
    num_tokens, top_k = expert_ids.shape
    pairs = expert_ids.flatten()
    order = pairs.argsort(stable=True)  # the (token, expert) pairs, grouped by expert
    counts = torch.bincount(pairs, minlength=len(experts)).tolist()
    tokens = order // top_k  # each sorted pair's token
    pair_weights = weights.flatten()[order, None]
    inputs = x[tokens] * pair_weights.to(x.dtype) if weighted_inputs else x[tokens]
    outputs = [
        expert(rows)
        for expert, rows, count in zip(experts, inputs.split(counts), counts, strict=True)
        if count
    ]
    summed = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    if outputs:
        out = torch.cat(outputs).float()
        summed.index_add_(0, tokens, out if weighted_inputs else out * pair_weights)
    return summed.to(x.dtype)


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP made of experts. Its parameters carry Qwen's checkpoint names (`gate`,
    `experts.N.gate_proj`...; the model maps Mixtral's and Granite's to them)."""

    moe_index: torch.Tensor  # a buffer: int64, 0-d

    def __init__(self, hidden_size: int, spec: Experts) -> None:
        super().__init__()
        self.spec = spec
        self.gate: ReplicatedLinear | Router = (
            Router(hidden_size, spec.num_experts, spec.selection_bias)
            if spec.router_float32
            else ReplicatedLinear(hidden_size, spec.num_experts, bias=spec.bias)
        )
        self.experts = nn.ModuleList(
            Expert(hidden_size, spec.intermediate_size, spec) for _ in range(spec.num_experts)
        )
        self.shared_expert = self.shared_expert_gate = None
        # every expert's gate/up [E, 2I, H] and down [E, H, I] weights, once `stack_experts` ran
        self.w13: nn.Parameter | None = None
        self.w2: nn.Parameter | None = None
        # and their biases [E, 2I], [E, H] (GPT-OSS's; w2's on rank 0 alone, as `Expert` adds it)
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if spec.shared_intermediate_size:  # (ungated where the experts are: Nemotron 3's)
            self.shared_expert = Expert(
                hidden_size, spec.shared_intermediate_size, None if spec.gated else spec
            )
            if spec.shared_gate:
                self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)
        # its index in `_BLOCKS`, for the compiled pass's op: a buffer, so a graph input (as
        # `Attention.layer_index` is), on the CPU whatever the model's device
        index = next(_INDICES)
        _BLOCKS[index] = self
        self.register_buffer("moe_index", torch.tensor(index, device="cpu"), persistent=False)

    def stack_experts(self) -> None:
        """The experts' weights (this rank's shards) as two stacked tensors for the Triton kernel;
        the per-expert layers go (their weights would be a second copy). Ungated experts, which the
        kernel does not take, stay per expert (`run_experts`) on GPUs too."""
        if not self.spec.gated:
            return
        experts: list[Expert] = list(self.experts)  # type: ignore[arg-type]
        self.w13 = _stacked([e.gate_up_proj.weight for e in experts])
        self.w2 = _stacked([e.down_proj.weight for e in experts])
        if self.spec.bias:
            self.w13_bias = _stacked([e.gate_up_proj.bias for e in experts])
            if experts[0].down_proj.tp_rank == 0:
                self.w2_bias = _stacked([e.down_proj.bias for e in experts])
        self.experts = nn.ModuleList()

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        if self.w13 is None or self.w2 is None:
            return run_experts(self.experts, x, weights, expert_ids, self.spec.weighted_inputs)
        from pagedserve_kernels.moe import fused_moe  # (Triton: imported where it runs)

        spec = self.spec
        return fused_moe(
            x,
            self.w13,
            self.w2,
            weights,
            expert_ids,
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias,
            activation=spec.activation,
            swiglu_alpha=spec.swiglu_alpha,
            swiglu_limit=spec.swiglu_limit,
            weighted_inputs=spec.weighted_inputs,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.gate.e_score_correction_bias if isinstance(self.gate, Router) else None
        weights, expert_ids = route(self.gate(x), self.spec, bias)
        if torch.compiler.is_compiling():
            out = torch.ops.pagedserve.moe_experts(x, weights, expert_ids, self.moe_index)
        else:
            out = self.run_experts(x, weights, expert_ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                # the gate is a per-token scalar, the same on every rank: it scales the partial sums
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return all_reduce(out)


def _stacked(tensors: list[torch.Tensor | None]) -> nn.Parameter:
    assert all(t is not None for t in tensors)
    return nn.Parameter(torch.stack(tensors), requires_grad=False)  # type: ignore[arg-type]


# -- the torch.compile boundary (see `layers.attention`'s) ----------------------------------------
# The blocks are held weakly: the model owns them.
_BLOCKS: weakref.WeakValueDictionary[int, SparseMoeBlock] = weakref.WeakValueDictionary()
_INDICES = itertools.count()

_LIBRARY = torch.library.Library("pagedserve", "FRAGMENT")
_LIBRARY.define("moe_experts(Tensor x, Tensor weights, Tensor expert_ids, Tensor moe_index) -> Tensor")


def _moe_experts_op(
    x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, moe_index: torch.Tensor
) -> torch.Tensor:
    return _BLOCKS[int(moe_index)].run_experts(x, weights, expert_ids)


_LIBRARY.impl("moe_experts", _moe_experts_op, "CompositeExplicitAutograd")


@torch.library.register_fake("pagedserve::moe_experts", lib=_LIBRARY)
def _(
    x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, moe_index: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape)
