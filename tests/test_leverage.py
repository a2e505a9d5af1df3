"""LeverageScore against its own maths on the real prefill: the keys turned back from RoPE with RoPE rebuilt
from the config, the sketch drawn again from the seed, the leverage from an explicit inverse in float64."""

import math

import torch
from kv_samples import compressed
from test_expected_attention import ConfigRope

from kvlab.methods.leverage import cholesky_with_jitter


def reference_leverage(keys: torch.Tensor, rope: ConfigRope, seed: int, k: int, first: int = 0) -> torch.Tensor:
    """[L, Hkv, n] float64: x_i^T (X^T X + 0.01 I)^{-1} x_i, X the centred pre-RoPE keys (post-RoPE ``keys`` at
    positions first..first+n-1) times the sketch."""
    n_layers, h, n, d = keys.shape
    pre = rope.unrotate(keys.double(), torch.arange(first, first + n))
    gen = torch.Generator().manual_seed(seed)
    sketch = torch.cat([torch.randn(1, h, d, k, generator=gen) for _ in range(n_layers)]).double() / math.sqrt(k)
    x = (pre - pre.mean(-2, keepdim=True)) @ sketch
    inv = torch.linalg.inv(x.transpose(-1, -2) @ x + 0.01 * torch.eye(k, dtype=torch.float64))
    return ((x @ inv) * x).sum(-1).clamp_min(0)


def test_scores_and_kept_tokens_match_the_explicit_leverage(lm, prefill_state):
    state = prefill_state
    rope = ConfigRope(lm.model.config.rope_parameters["rope_theta"], lm.info.head_dim)
    ref = reference_leverage(state.keys, rope, seed=0, k=48)
    comp, knobs = compressed(lm, state, "leverage", "0.25")
    got = comp.scores(state).double()
    assert got.shape == ref.shape and (ref > 0.01).float().mean() > 0.5  # informative scores, not all zero
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-3)
    cap = knobs["capacity"]
    for layer in (0, lm.info.n_layers // 2, lm.info.n_layers - 1):
        kept = comp.kept_positions(layer).long()
        bound = ref[layer].sort(-1, descending=True).values[:, cap - 1 : cap]  # each head's cap-th largest
        assert kept.shape[-1] == cap
        assert (ref[layer].gather(-1, kept) >= bound - 1e-4).all(), layer  # ties at the boundary aside


def test_an_outlier_key_has_leverage_near_one_and_a_seed_changes_the_sketch(lm, prefill_state):
    keys = torch.randn(1, 1, 200, 64, generator=torch.Generator().manual_seed(1)) * 0.1
    keys[..., 7, :] = 5.0  # one token far outside the others' spread
    from kvlab.methods.leverage import gaussian_sketch, leverage_scores

    scores = leverage_scores(keys, gaussian_sketch(0, 1, 1, 64, 48))
    assert scores[0, 0].argmax() == 7 and scores[0, 0, 7] > 0.9 and scores[0, 0].median() < 0.5
    assert not torch.equal(gaussian_sketch(0, 2, 3, 64, 48), gaussian_sketch(1, 2, 3, 64, 48))
    assert torch.equal(gaussian_sketch(0, 2, 3, 64, 48)[1], gaussian_sketch(0, 3, 3, 64, 48)[1])  # layer by layer


def test_jitter_grows_until_the_factorisation_succeeds():
    singular = torch.zeros(2, 4, 4)
    singular[0] = -torch.eye(4) * 0.05  # needs a jitter above 0.05: 1e-2 fails, 1e-1 works
    factor = cholesky_with_jitter(singular)
    torch.testing.assert_close(factor @ factor.transpose(-1, -2), singular + 0.1 * torch.eye(4))
