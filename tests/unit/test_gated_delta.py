"""The gated delta rule (`layers.gated_delta`): a step's decodes advanced together and each longer
sequence's chunked form, against the rule applied token by token in float64; with a decay a head
(Gated DeltaNet's) or a key channel (Kimi Delta Attention's)."""

from __future__ import annotations

import torch
from pagedserve.layers.gated_delta import chunked_channel_delta_rule, chunked_delta_rule, delta_rule_step


def token_by_token(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule as written: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q (g [tokens, heads]
    a head's, or [tokens, heads, dk] each row of S its own)."""
    outputs = []
    for t in range(q.shape[0]):
        state = state * (torch.exp(g[t])[:, :, None] if g.dim() == 3 else torch.exp(g[t])[:, None, None])
        predicted = torch.einsum("hkv,hk->hv", state, k[t])
        state = state + k[t][:, :, None] * (beta[t][:, None] * (v[t] - predicted))[:, None, :]
        outputs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(outputs), state


def inputs(tokens: int, heads: int = 3, dk: int = 8, dv: int = 6, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dk, generator=generator, dtype=torch.float64)
    k = torch.nn.functional.normalize(
        torch.randn(tokens, heads, dk, generator=generator, dtype=torch.float64), dim=-1
    )
    v = torch.randn(tokens, heads, dv, generator=generator, dtype=torch.float64)
    g = -torch.rand(tokens, heads, generator=generator, dtype=torch.float64) * 0.7
    beta = torch.rand(tokens, heads, generator=generator, dtype=torch.float64)
    state = torch.randn(heads, dk, dv, generator=generator, dtype=torch.float64)
    return q, k, v, g, beta, state


def test_the_chunked_form_is_the_rule_token_by_token() -> None:
    """Sequences shorter than a chunk, a chunk exactly, and several with a partial last one; from a
    state a previous step left."""
    for tokens in (1, 5, 8, 8 * 3 + 3):
        q, k, v, g, beta, state = inputs(tokens, seed=tokens)
        expected, expected_state = token_by_token(q, k, v, g, beta, state)
        out, final = chunked_delta_rule(q, k, v, g, beta, state.clone(), chunk_size=8)
        torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(final, expected_state, rtol=1e-9, atol=1e-9)


def test_a_chunked_sequence_split_anywhere_carries_its_state() -> None:
    q, k, v, g, beta, state = inputs(30)
    expected, expected_state = token_by_token(q, k, v, g, beta, state)
    first, middle = chunked_delta_rule(q[:11], k[:11], v[:11], g[:11], beta[:11], state.clone(), chunk_size=4)
    second, final = chunked_delta_rule(q[11:], k[11:], v[11:], g[11:], beta[11:], middle, chunk_size=4)
    torch.testing.assert_close(torch.cat((first, second)), expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(final, expected_state, rtol=1e-9, atol=1e-9)


def test_decodes_advance_their_states_together() -> None:
    """Four sequences' next tokens at once, each from its own state, in place."""
    rows = [inputs(1, seed=10 + i) for i in range(4)]
    q, k, v, g, beta, states = (
        torch.cat([r[i] for r in rows]) if i < 5 else torch.stack([r[5] for r in rows]) for i in range(6)
    )
    before = states.clone()
    out = delta_rule_step(states, q, k, v, g, beta)
    for i in range(4):
        expected, expected_state = token_by_token(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], before[i]
        )
        torch.testing.assert_close(out[i], expected[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(states[i], expected_state, rtol=1e-12, atol=1e-12)


def channel_inputs(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    """`inputs` with a decay a key channel, one of them strong: exp(-100) a token, exp(-G) over a chunk
    of 8 past float64's range."""
    q, k, v, _, beta, state = inputs(tokens, seed=seed)
    generator = torch.Generator().manual_seed(seed + 100)
    g = -torch.rand(*k.shape, generator=generator, dtype=torch.float64) * 0.7
    g[:, :, 0] = -100.0
    return q, k, v, g, beta, state


def test_a_decay_a_key_channel_chunked_is_the_rule_token_by_token() -> None:
    """Kimi's decay a channel: shorter than a chunk, a chunk, several with a partial last one, and a
    chunk whose strongest channel decays to nothing across it (its pairs' differences taken before
    exp: no overflow); split mid-sequence, the state carries; decodes advance together."""
    for tokens in (1, 5, 8, 8 * 3 + 3):
        q, k, v, g, beta, state = channel_inputs(tokens, seed=tokens)
        expected, expected_state = token_by_token(q, k, v, g, beta, state)
        out, final = chunked_channel_delta_rule(q, k, v, g, beta, state.clone(), chunk_size=8)
        torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(final, expected_state, rtol=1e-9, atol=1e-9)
    q, k, v, g, beta, state = channel_inputs(30, seed=1)
    expected, expected_state = token_by_token(q, k, v, g, beta, state)
    first, middle = chunked_channel_delta_rule(q[:11], k[:11], v[:11], g[:11], beta[:11], state.clone(), 4)
    second, final = chunked_channel_delta_rule(q[11:], k[11:], v[11:], g[11:], beta[11:], middle, 4)
    torch.testing.assert_close(torch.cat((first, second)), expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(final, expected_state, rtol=1e-9, atol=1e-9)
    states = torch.stack([state, state.flip(0)])
    out = delta_rule_step(states, q[:2], k[:2], v[:2], g[:2], beta[:2])
    for i, start in enumerate((state, state.flip(0))):
        one, after = token_by_token(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], start
        )
        torch.testing.assert_close(out[i], one[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(states[i], after, rtol=1e-12, atol=1e-12)
