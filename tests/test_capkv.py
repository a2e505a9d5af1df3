"""CapKV against its own maths on a real prefill: the anchor built here (every prompt query after the sinks
turned back with RoPE rebuilt from the config, averaged, then rotated by RoPE matrices averaged over the next 512
positions), the weights and the capacity matrix inverted explicitly per layer and query head, in float64."""

import pytest
import torch
from kv_samples import compressed
from test_expected_attention import ConfigRope

from kvlab.engine.prefill import prefill
from kvlab.methods.handover import PrefillNeeds

N_SINK, TAU, T = 4, 5.0, 512


@pytest.fixture(scope="module")
def state(lm, long_text):
    ids = lm.encode(long_text[:1200])
    n = len(ids)
    st, _ = prefill(lm, ids, PrefillNeeds(query_window=n, query_stats=n - N_SINK))
    return st


def rotation_matrices(rope: ConfigRope, positions: torch.Tensor) -> torch.Tensor:
    """[T, d, d] RoPE's rotation at each position: cos on the diagonal, sin on Llama's half-split pairs."""
    c, s = rope.cos_sin(positions)
    d, h = rope.d, rope.d // 2
    half = torch.zeros(d, d, dtype=torch.float64)
    half[h:, :h], half[:h, h:] = torch.eye(h, dtype=torch.float64), -torch.eye(h, dtype=torch.float64)
    return torch.diag_embed(c) + s[:, None, :] * half  # R_t x = x cos + rotate_half(x) sin


def test_scores_match_the_explicit_capacity_leverage(lm, state):
    info, n = lm.info, state.n_tokens
    rope = ConfigRope(lm.model.config.rope_parameters["rope_theta"], info.head_dim)
    x = torch.randn(3, info.head_dim, dtype=torch.float64)
    pos = torch.tensor([5, 900, 4000])
    torch.testing.assert_close(torch.einsum("tij,tj->ti", rotation_matrices(rope, pos), x), rope.rotate(x, pos))
    rbar = rotation_matrices(rope, torch.arange(n, n + T)).mean(0)
    pre = rope.unrotate(state.queries.double(), torch.arange(n))[..., N_SINK:, :]  # [L, Hq, n - 4, d]
    anchor = pre.mean(-2) @ rbar.T  # [L, Hq, d]
    comp, knobs = compressed(lm, state, "capkv", "0.25")
    got = comp.scores(state).double()
    group = info.n_heads // info.n_kv_heads
    for layer in (0, info.n_layers // 2, info.n_layers - 1):
        want = torch.zeros(info.n_kv_heads, n - N_SINK, dtype=torch.float64)
        for h in range(info.n_heads):
            k = state.keys[layer, h // group, N_SINK:].double()
            v = state.values[layer, h // group, N_SINK:].double()
            cos = (k @ anchor[layer, h]) / (k.norm(dim=-1) * anchor[layer, h].norm())
            w = torch.exp(TAU * (cos - cos.max()))
            a = torch.eye(v.shape[-1], dtype=torch.float64) + (v * (w + 1e-6)[:, None]).T @ v
            want[h // group] += w * ((v @ torch.linalg.inv(a)) * v).sum(-1) / group
        torch.testing.assert_close(got[layer, :, N_SINK:], want, rtol=2e-3, atol=1e-6)
        assert (got[layer, :, :N_SINK] > want.max()).all()  # the sinks above every token
        kept = comp.kept_positions(layer).long()
        assert kept.shape[-1] == knobs["capacity"] and (kept[:, :N_SINK] == torch.arange(N_SINK)).all()
        bound = want.sort(-1, descending=True).values[:, knobs["capacity"] - N_SINK - 1 : knobs["capacity"] - N_SINK]
        assert (want.gather(-1, kept[:, N_SINK:] - N_SINK) >= bound * (1 - 1e-3)).all()


def test_refused_without_a_readable_rope(lm):
    import dataclasses

    from kvlab.core import semantics as sm
    from kvlab.core.budgets import Budget
    from kvlab.methods import get

    info = dataclasses.replace(lm.info, rope=None)
    for name in ("capkv", "leverage", "compactor"):
        with pytest.raises(sm.UnsupportedAttention, match="rotary position embedding"):
            get(name)(info, Budget.parse("0.5")).check_semantics()
