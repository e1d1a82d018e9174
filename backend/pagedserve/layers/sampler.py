"""Batched sampling: logit controls, penalties, temperature, top-k/top-p/min-p, greedy, seeded draws.

In vLLM's order: the logit controls on the raw logits (allowed_token_ids, then the bans of bad words and
of min_tokens, then logit_bias), then penalties, then temperature, then top-k, top-p and min-p on the
tempered distribution; greedy rows take the argmax of the penalized logits. Logprobs are those of the
raw logits (vLLM's default), whatever changed the distribution sampled from.

Random rows draw by inversion: one uniform a row, placed in the row's cumulative distribution (block
sums, then the tokens of one block, both in float64, so that a small token keeps its share beside a
sum near 1), which samples from probs exactly. The exponential trick (argmax(probs / q), q ~ Exp(1) a
token) samples the same distribution but draws a vocabulary of noise a row: ~0.7 ms a row of 49,152
tokens on CPU, 45 ms for 64 rows, longer than the decode step itself, against ~0.6 ms for the 64 rows
by inversion. A row cut by top-k, top-p or min-p draws from its most likely tokens alone, in their
order, found by `topk`: sorting each row's vocabulary, as vLLM's and transformers' definitions are
written, took 100 ms for 64 rows of 49,152 tokens, three times the decode step. A seeded request's
uniform comes from its own generator seeded by (seed, output index), so its tokens do not depend on
what else is in the batch, nor on preemption.

Structured outputs: the model runner applies a grammar's token bitmask (`apply_token_bitmask`) to the
logits before the sampler, so greedy and random rows, penalties and logprobs all see masked logits
(vLLM's order): a disallowed token's logprob is -inf.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

_GREEDY_EPS = 1e-5
# SamplingParams takes any finite temperature; past float32's range it would be inf here, and a banned
# token's -inf logit divided by inf is NaN, which poisons the whole row's softmax.
_MAX_TEMPERATURE = torch.finfo(torch.float32).max
# SamplingParams takes any repetition penalty above 0. One near 0 (0 in float32) or past float32's range
# sent a seen token's logit to +-inf, or a logit of 0 to NaN (0 * inf), and the row's softmax to NaN:
# every draw was token 0. Within these bounds every penalized logit is finite, and the extremes act as
# they mean to (a seen token's positive logit a million times larger, or its negative one).
_MIN_REPETITION_PENALTY, _MAX_REPETITION_PENALTY = 1e-6, 1e6
_SEED_STRIDE = 1_000_003  # mixes the output index into a request's seed
_SEED_MODULUS = 2**64  # torch takes 64-bit seeds: any integer seed folds into them
_INVERSION_BLOCK = 256  # tokens a block of a random row's two-level inversion (`_draw`)
# How many of a row's most likely tokens `_draw_from_top` looks among for its cut, before all of them
_TOP_WIDTHS = (64, 1024, 8192)
_RANK_WIDTH = 8  # the most likely tokens a sampled token's rank is first counted among (`_gather_logprobs`)


@dataclass
class SamplingTensors:
    """Per-row parameters of one step's batch of rows to sample (built by the model runner, which gives
    every field); what is not given is asked for by no row."""

    temperatures: torch.Tensor  # [B] float32; 0 = greedy
    top_ks: torch.Tensor | None = None  # [B] int64, vocab size where disabled; None if no row uses top-k
    top_ps: torch.Tensor | None = None  # [B] float32
    min_ps: torch.Tensor | None = None  # [B] float32
    # penalties: repetition None if no row has one; presence and frequency None (both) if no row has
    # either; the prompts' ids where some row has a repetition penalty, the outputs' where any penalty
    repetition_penalties: torch.Tensor | None = None  # [B]
    presence_penalties: torch.Tensor | None = None  # [B]
    frequency_penalties: torch.Tensor | None = None  # [B]
    prompt_token_ids: torch.Tensor | None = None  # [B, P] padded with vocab_size
    output_token_ids: torch.Tensor | None = None  # [B, O] padded with vocab_size
    # (row, token ids) that may not be sampled this step: EOS and stop ids before min_tokens, bad words
    banned_tokens: list[tuple[int, list[int]]] = field(default_factory=list)
    # (row, seed, output index) for seeded random rows
    seeded_rows: list[tuple[int, int, int]] = field(default_factory=list)
    max_num_logprobs: int | None = None  # None when no row asks for logprobs
    # (row, int64 token ids on the device): only these may be sampled (allowed_token_ids); empty where none
    allowed_tokens: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # (row, token ids, float32 biases): added to the logits (logit_bias); empty where no row has them
    logit_biases: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def penalized(self) -> bool:
        """Some row has a repetition, presence or frequency penalty."""
        return self.repetition_penalties is not None or self.presence_penalties is not None

    @property
    def logits_unchanged(self) -> bool:
        """No row changes its logits (penalties, bans, allowed tokens, biases; a grammar's mask comes
        before the sampler): each row takes its argmax or draws from softmax(logits / temperature),
        cut by its top-k, top-p and min-p where it has them."""
        return (
            not self.penalized
            and not self.banned_tokens
            and not self.allowed_tokens
            and not self.logit_biases
        )


class SampleRows(Protocol):
    """`Sampler`'s `sample_rows`: tokens [rows] from logits, temperatures, uniforms, the inversion's
    block and each cut's per-row values (None where no row has it)."""

    def __call__(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        uniforms: torch.Tensor,
        block: int,
        top_ks: torch.Tensor | None,
        top_ps: torch.Tensor | None,
        min_ps: torch.Tensor | None,
        /,
    ) -> torch.Tensor: ...


# `Sampler`'s `logprob_rows`: (logits, token ids [rows] or None for each row's argmax, k) -> the raw logprobs
# and ids [rows, 1 + k] (each row's token, then its top k) and the tokens' ranks [rows], as
# `_gather_logprobs` makes them
LogprobRows = Callable[
    [torch.Tensor, torch.Tensor | None, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B]
    logprobs: torch.Tensor | None = None  # [B, 1 + k]: sampled token's raw logprob, then the raw top-k
    logprob_token_ids: torch.Tensor | None = None  # [B, 1 + k]
    sampled_ranks: torch.Tensor | None = None  # [B]


class Sampler:
    """Each batch's tokens come from its logits as the rows' logit controls and penalties change them
    (a float32 copy, where some row has them), through the kernels where given. `argmax_rows` replaces
    `max(dim=-1).indices` for all-greedy batches (the C++ CPU kernel reads bf16 logits in place: ~0.3
    against ~1.1 ms for 64 rows). `invert_rows` draws as `_draw` does (probabilities, uniforms,
    _INVERSION_BLOCK): the C++ CPU kernel sums in float64 without a float64 copy of the probabilities
    (~0.3 against ~2 ms for 64 rows of 49,152 tokens). `sample_rows` samples batches with a random
    row straight from the logits (logits, temperatures with 0 for greedy rows, uniforms,
    _INVERSION_BLOCK, then top_ks (the kernel clamps them to [1, vocab]), top_ps and min_ps, each None
    where no row has it): the C++ CPU kernel weighs exp((x - max) / T) as it sums, so no float32 copy,
    tempered copy or softmax is made (~0.9 against ~3 ms for 64 bfloat16 rows of 49,152 tokens), and
    finds a cut row's set among its likeliest tokens without `topk` (~1.1-1.4 against 5-16 ms for 64
    rows of a chat model's logits at top-p 0.9 or top-k 50); its draws are the torch path's up to
    float32 rounding, so a seeded row draws the same token whichever path its batch takes.
    `logprob_rows` makes every batch's logprobs from the raw logits once its tokens are chosen, as
    `_gather_logprobs` makes them from a float32 log_softmax: the C++ CPU kernel computes each logprob
    as it reads it (~1-2 against ~7-15 ms for 64 bfloat16 rows of 49,152 tokens). An all-greedy batch
    whose logits nothing changes takes its tokens from that same read (the argmax it finds first),
    without `argmax_rows` reading the logits once more before."""

    def __init__(
        self,
        seed: int,
        device: torch.device | str = "cpu",
        argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
        invert_rows: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
        sample_rows: SampleRows | None = None,
        logprob_rows: LogprobRows | None = None,
    ) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)  # on the logits' device
        self.argmax_rows = argmax_rows
        self.invert_rows = invert_rows
        self.sample_rows = sample_rows
        self.logprob_rows = logprob_rows

    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        if t.max_num_logprobs is None:
            return SamplerOutput(self._token_ids(logits, t))
        if (
            self.logprob_rows is not None
            and t.logits_unchanged
            and bool((t.temperatures < _GREEDY_EPS).all())
        ):
            values, ids, ranks = self.logprob_rows(logits, None, t.max_num_logprobs)
            return SamplerOutput(ids[:, 0], values, ids, ranks)  # each row's token: its argmax
        token_ids = self._token_ids(logits, t, keep_logits=True)  # the logprobs are of the logits as given
        return SamplerOutput(token_ids, *self.logprobs(logits, token_ids, t.max_num_logprobs))

    def logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The raw logprobs of `token_ids` (one a row of `logits`), then each row's top k, with their
        ids ([rows, 1 + k] each), and the tokens' ranks [rows]: SamplerOutput's, for any tokens."""
        if self.logprob_rows is not None:
            return self.logprob_rows(logits, token_ids, k)
        return _gather_logprobs(torch.log_softmax(logits.float(), dim=-1), token_ids, k)

    def _token_ids(self, logits: torch.Tensor, t: SamplingTensors, keep_logits: bool = False) -> torch.Tensor:
        """Each row's token: greedy rows' argmax, the others' draws, from the logits as the rows' logit
        controls and penalties change them, in a float32 copy (in `logits` itself where it is float32,
        unless `keep_logits`). The kernels, where given, take the changed logits as they take raw ones."""
        changed = not t.logits_unchanged
        if changed:
            logits = _writable(logits, keep_logits)
            _apply_logit_controls(logits, t)
            if t.penalized:
                _apply_penalties(logits, t)
        greedy_rows = t.temperatures < _GREEDY_EPS
        num_greedy = int(greedy_rows.sum())  # one read back from the device
        if num_greedy == len(greedy_rows):
            return self.argmax_rows(logits) if self.argmax_rows is not None else _argmax(logits)
        if self.sample_rows is not None:
            temperatures = torch.where(greedy_rows, 0.0, t.temperatures.clamp(max=_MAX_TEMPERATURE))
            uniforms = self._uniforms(len(temperatures), t, logits.device)
            return self.sample_rows(
                logits, temperatures, uniforms, _INVERSION_BLOCK, t.top_ks, t.top_ps, t.min_ps
            )
        if not changed:  # _sample tempers its logits in place
            logits = _writable(logits, keep_logits)
        if num_greedy:
            greedy = _argmax(logits)  # before _sample tempers the logits
            return torch.where(greedy_rows, greedy, self._sample(logits, t))
        return self._sample(logits, t)  # no greedy row: no argmax over the vocabulary (0.8 ms for 64 rows)

    def _sample(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """Random rows' draws; tempers `logits` in place (the sampler's own: a float32 copy of the
        model's, or the model's float32 tensor, which the logit controls change in place already).
        Rows that cut their distribution (top-k, top-p, min-p) draw from their most likely tokens;
        the others by inversion over the whole vocabulary."""
        rows, vocab = logits.shape
        temperatures = torch.where(t.temperatures < _GREEDY_EPS, 1.0, t.temperatures)
        logits = logits.div_(temperatures.clamp(max=_MAX_TEMPERATURE).unsqueeze(1))
        probs = torch.softmax(logits, dim=-1)
        uniforms = self._uniforms(rows, t, probs.device)
        if t.top_ks is None and t.top_ps is None and t.min_ps is None:
            return self._draw_rows(probs, uniforms)
        no_cut = torch.full((rows,), vocab, dtype=torch.int64, device=probs.device)
        top_ks = t.top_ks.clamp(1, vocab) if t.top_ks is not None else no_cut
        top_ps = t.top_ps if t.top_ps is not None else torch.ones(rows, device=probs.device)
        min_ps = t.min_ps if t.min_ps is not None else torch.zeros(rows, device=probs.device)
        cut = (top_ks < vocab) | (top_ps < 1.0) | (min_ps > 0.0)
        token_ids = _draw_from_top(probs, top_ks, top_ps, min_ps, uniforms, cut)
        if bool(cut.all()):  # one read back from the device
            return token_ids
        return torch.where(cut, token_ids, self._draw_rows(probs, uniforms))

    def _draw_rows(self, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """`_draw`, in the kernel where the sampler has one."""
        if self.invert_rows is not None:
            return self.invert_rows(probs, uniforms, _INVERSION_BLOCK)
        return _draw(probs, uniforms)

    def _uniforms(self, rows: int, t: SamplingTensors, device: torch.device) -> torch.Tensor:
        """One float64 in [0, 1) a row: a seeded row's from its own generator at its output index."""
        uniforms = torch.rand(rows, dtype=torch.float64, generator=self.generator, device=device)
        for row, seed, index in t.seeded_rows:
            row_generator = torch.Generator(device=device).manual_seed(
                (seed * _SEED_STRIDE + index) % _SEED_MODULUS
            )
            uniforms[row] = torch.rand((), dtype=torch.float64, generator=row_generator, device=device)
        return uniforms


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """A token a row from `probs` by inversion: the first token whose cumulative probability reaches
    u * total, 1 - u the row's uniform. In two levels, both summed in float64: the block of
    _INVERSION_BLOCK tokens the target falls in, then the token within the block, so that a token far
    smaller than the running sum keeps its share (0.6 ms for 64 rows of 49,152 tokens, where one
    float64 cumulative sum over the vocabulary takes 5.9). Never a token of probability 0: its
    cumulative sum equals the one before it, which is below the target. A row of NaN (a model's
    overflow) gets some token of the vocabulary rather than an index past it: the step goes on for
    the other rows."""
    rows, vocab = probs.shape
    pad = -vocab % _INVERSION_BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    blocks = blocks.view(rows, -1, _INVERSION_BLOCK)
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # float32 sums lose 3e-8 at 0.5
    targets = (1.0 - uniforms) * block_cdf[:, -1]  # in (0, total]
    block = torch.searchsorted(block_cdf, targets.unsqueeze(1)).squeeze(1).clamp_(max=blocks.shape[1] - 1)
    before = block_cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    before = torch.where(block > 0, before, 0.0)  # below the target: searchsorted finds the first >=
    inner_cdf = blocks[torch.arange(rows, device=probs.device), block].double().cumsum(dim=-1)
    residual = torch.minimum(targets - before, inner_cdf[:, -1])  # the two sums' orders differ
    token_ids = block * _INVERSION_BLOCK + torch.searchsorted(inner_cdf, residual.unsqueeze(1)).squeeze(1)
    return token_ids.clamp_(max=vocab - 1)


def _writable(logits: torch.Tensor, keep: bool) -> torch.Tensor:
    """The logits as float32 that the sampler may change in place: a copy, but a float32 `logits`
    itself unless `keep`."""
    return logits.clone() if keep and logits.dtype == torch.float32 else logits.float()


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum, as `argmax` picks it; `max(dim)` finds the same index and
    is several times faster on CPU (about 0.8 ms against 2.1 ms for 64 rows of a 49,152-token vocabulary)."""
    return x.max(dim=-1).indices


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Structured outputs: set to -inf, in place, the logits of `rows` whose bit in `bitmask` is clear
    (int32 [len(rows), W]: bit t % 32 of word t // 32 is token t, as xgrammar fills it). Tokens past
    the mask's 32 * W (a vocabulary padded beyond the grammar's) are disallowed too. Each byte of the
    mask looks up its 8 tokens' caps (+inf allowed, -inf not) and each logit takes the minimum with its
    cap, so an allowed one keeps its bits: 1.5 ms for 64 rows of 49,152 tokens, where unpacking the
    bits one by one and a masked fill took 10.5 ms (xgrammar's own CPU kernel: 5.5)."""
    vocab = logits.shape[-1]
    bits = torch.arange(8, device=bitmask.device)
    byte_is_set = (torch.arange(256, device=bitmask.device).unsqueeze(1) >> bits) & 1 == 1
    byte_caps = torch.where(byte_is_set, math.inf, -math.inf).to(logits.dtype)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=bitmask.device)
    byte_values = ((bitmask.unsqueeze(-1) >> shifts) & 0xFF).flatten(1).long()  # in token order
    caps = torch.nn.functional.embedding(byte_values, byte_caps).flatten(1)[:, :vocab]
    if caps.shape[1] < vocab:
        caps = torch.nn.functional.pad(caps, (0, vocab - caps.shape[1]), value=-math.inf)
    every_row = rows == list(range(logits.shape[0]))
    index = None if every_row else torch.tensor(rows, device=logits.device)
    masked = torch.minimum(logits, caps, out=logits) if index is None else torch.minimum(logits[index], caps)
    if bool(masked.amax().isnan()):  # a model's NaN (amax keeps it): disallowed, it is -inf too
        masked.masked_fill_(caps < 0, -math.inf)
    if index is not None:
        logits[index] = masked


def _apply_logit_controls(logits: torch.Tensor, t: SamplingTensors) -> None:
    """allowed_token_ids, the bans (bad words, min_tokens) and logit_bias, in place (the bias after the
    -inf of a ban or of a token not allowed leaves it -inf). The model runner leaves every row a token."""
    for row, allowed_ids in t.allowed_tokens:
        kept = logits[row, allowed_ids]
        logits[row] = float("-inf")
        logits[row, allowed_ids] = kept
    for row, banned_ids in t.banned_tokens:
        logits[row, banned_ids] = float("-inf")
    for row, bias_ids, biases in t.logit_biases:
        logits[row, bias_ids] += biases


def _apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> None:
    """vLLM's penalties, in place, on the tokens each row has seen alone (a dense pass over the
    vocabulary for each, as the definitions are written, took ~6.5 ms a step for 64 rows of 49,152
    tokens). Repetition (prompt and output): a seen token's positive logit divided by the penalty, its
    negative one multiplied; then frequency and presence (output only), as OpenAI defines them. The
    padding of the id tensors (the vocabulary size) becomes a seen token of its row, written the same
    value as that token's other places, or, in a row with none, the last token rewritten unchanged.
    Each kind's pass runs only where some row has that kind."""
    assert t.output_token_ids is not None
    if t.repetition_penalties is not None:
        assert t.prompt_token_ids is not None
        _apply_repetition_penalties(logits, t.repetition_penalties, t.prompt_token_ids, t.output_token_ids)
    if t.presence_penalties is not None:
        assert t.frequency_penalties is not None
        _apply_count_penalties(logits, t.presence_penalties, t.frequency_penalties, t.output_token_ids)


def _apply_repetition_penalties(
    logits: torch.Tensor,
    penalties: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
) -> None:
    vocab = logits.shape[1]
    seen = torch.cat((prompt_token_ids, output_token_ids), dim=1)
    is_seen = seen < vocab
    some = is_seen.any(dim=1, keepdim=True)
    first = seen.gather(1, is_seen.int().argmax(dim=1, keepdim=True))  # a seen token, if the row has one
    seen = torch.where(is_seen, seen, first.clamp(max=vocab - 1))
    repetition = penalties.clamp(_MIN_REPETITION_PENALTY, _MAX_REPETITION_PENALTY).unsqueeze(1)
    penalty = torch.where(some, repetition, 1.0)
    values = logits.gather(1, seen)
    logits.scatter_(1, seen, torch.where(values > 0, values / penalty, values * penalty))


def _apply_count_penalties(
    logits: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor, output_token_ids: torch.Tensor
) -> None:
    """Frequency and presence: each output token's count, from the row's ids sorted (runs of one id)."""
    vocab = logits.shape[1]
    ids = output_token_ids.sort(dim=1).values  # the padding last
    is_output = ids < vocab
    starts = is_output.clone()
    starts[:, 1:] &= ids[:, 1:] != ids[:, :-1]
    run = (starts.cumsum(dim=1) - 1).clamp(min=0)  # the padding: the last run
    counts = torch.zeros(ids.shape, device=ids.device).scatter_add_(1, run, is_output.float()).gather(1, run)
    last = ids.gather(1, (is_output.sum(dim=1, keepdim=True) - 1).clamp(min=0))
    ids = torch.where(is_output, ids, last).clamp(max=vocab - 1)
    values = logits.gather(1, ids)
    values = values - frequency.unsqueeze(1) * counts
    logits.scatter_(1, ids, values - presence.unsqueeze(1) * (counts > 0))


def _draw_from_top(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    uniforms: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """A token for each of `rows` (a bool mask) from its most likely tokens, cut by top-k, top-p and
    min-p (`_top_cut`), by inversion in their order, most likely first; the other rows get token 0.
    A row looks among its _TOP_WIDTHS[0] most likely tokens, then among more, and sorts its whole
    vocabulary only when its cut lies further (a flat distribution, a large top-k): `topk` finds 64 of
    49,152 in ~2.2 ms for 64 rows, where sorting them takes ~100 ms. Tokens equally likely are drawn
    in id order (the C++ kernel's order; `topk` has its own)."""
    num_rows, vocab = probs.shape
    token_ids = torch.zeros(num_rows, dtype=torch.int64, device=probs.device)
    pending = rows.nonzero().squeeze(1)  # one read back from the device a width
    for width in [w for w in _TOP_WIDTHS if w < vocab] + [vocab]:
        part = probs if len(pending) == num_rows else probs[pending]
        if width < vocab:
            values, ids = part.topk(width, dim=-1)
            # ties in id order, as the whole sort below and the C++ kernel put them (topk's is its own)
            ids, by_id = ids.sort(dim=-1)
            values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
            ids = ids.gather(1, by_value)
        else:
            values, ids = part.sort(dim=-1, descending=True, stable=True)
        kept, inside = _top_cut(values, top_ks[pending], top_ps[pending], min_ps[pending], vocab)
        cdf = kept.double().cumsum(dim=-1)
        targets = (1.0 - uniforms[pending]) * cdf[:, -1]  # in (0, total]
        ranks = torch.searchsorted(cdf, targets.unsqueeze(1)).clamp_(max=width - 1)
        drawn = ids.gather(1, ranks).squeeze(1)
        token_ids[pending[inside]] = drawn[inside]
        pending = pending[~inside]
        if len(pending) == 0:
            break
    return token_ids


def _top_cut(
    values: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' largest probabilities (`values`, each row's in descending order, all of them when there
    are `vocab`) with those top-k, top-p and min-p drop set to 0, and whether all that each row keeps
    is among them. vLLM's and transformers' definitions, ties kept: top-k keeps every token at least as
    likely as the k-th (1 <= k <= vocab; vocab: no cut); top-p (1: no cut), on what top-k keeps, keeps
    every token whose more likely tokens hold less than p of its mass, which is the smallest most
    likely set holding at least p with the ties of its least likely token (a cut by rank would keep
    whichever tie the sort put first); min-p (0: no cut) then keeps those at least min_p times as
    likely as the most likely token."""
    width = values.shape[1]
    last = values[:, -1]
    kth = values.gather(1, (top_ks.clamp(max=width) - 1).unsqueeze(1)).squeeze(1)
    has_k = top_ks < vocab
    kept = values.masked_fill(has_k.unsqueeze(1) & (values < kth.unsqueeze(1)), 0.0)
    # top-k's set is here whole when its k-th is (and no tie of it lies beyond), or when every
    # token beyond is of probability 0 (a grammar's, a ban's): never drawn, whatever the cut
    inside = ~has_k | ((top_ks <= width) & (kth > last)) | (last == 0)
    mass = kept.cumsum(dim=-1)
    total = torch.where(has_k, mass[:, -1], 1.0)  # the mass of top-k's set, or the whole distribution
    num_kept = ((mass - kept) < (top_ps * total).unsqueeze(1)).sum(dim=-1)  # at least 1: 0 < p * total
    least = values.gather(1, (num_kept - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    uses_p = top_ps < 1.0
    kept = kept.masked_fill(uses_p.unsqueeze(1) & (values < least.unsqueeze(1)), 0.0)
    inside &= ~uses_p | (least > last) | (last == 0)
    floor = min_ps * values[:, 0]  # the most likely token always stays
    kept = kept.masked_fill(kept < floor.unsqueeze(1), 0.0)
    inside &= has_k | uses_p | (floor > last) | (last == 0)  # min-p's set is exact alone
    if width == vocab:
        inside = torch.ones_like(inside)
    return kept, inside


def _gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled token's raw logprob and rank (1 + how many tokens are more likely) and the raw top k.
    The rank counts among the _RANK_WIDTH most likely tokens where the sampled one is among them (all
    those more likely are then), and over the vocabulary only in the other rows: a count over every
    row's vocabulary took 1.5 ms a step for 64 rows of 49,152 tokens."""
    vocab = raw_logprobs.shape[1]
    sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1))
    top_values, top_ids = raw_logprobs.topk(min(vocab, max(k, _RANK_WIDTH)), dim=-1)
    ranks = (top_values > sampled).sum(dim=-1) + 1
    beyond = sampled.squeeze(1) < top_values[:, -1]
    if bool(beyond.any()):  # one read back from the device
        rows = beyond.nonzero().squeeze(1)
        ranks[rows] = (raw_logprobs[rows] > sampled[rows]).sum(dim=-1) + 1
    return (
        torch.cat((sampled, top_values[:, :k]), dim=1),
        torch.cat((token_ids.unsqueeze(1), top_ids[:, :k]), dim=1),
        ranks,
    )
