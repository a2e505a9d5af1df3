"""TurboQuant against its own maths: the Lloyd-Max codebook's optimality conditions for the sphere's
coordinate density (checked by sampling, not by the solver's quadrature), the paper's distortion
values, TurboQuant-prod's unbiased inner products over many rotations (a biased estimator fails the
same check), and the method on the real prefill."""

import math

import numpy as np
import pytest
import torch
from kv_samples import compressed

from kernels.qjl import make_sketch
from kernels.quant import unpack_codes, unpack_signs
from kernels.tensor_ops import group_queries
from kvlab.core.budgets import Budget, exact_bytes
from kvlab.core.semantics import attend
from kvlab.methods import budget_search, get
from kvlab.methods.turboquant import Instance, beta_codebook, codebook_mse

D = 64


def _sphere(n: int, d: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_codebook_meets_the_lloyd_conditions(bits):
    """Each centroid is the mean of the coordinate density over its cell (sampled: coordinates of uniform
    points on the sphere), and the cells' boundaries are the midpoints of neighbouring centroids."""
    c, b = beta_codebook(D, bits)
    np.testing.assert_allclose(b, (c[1:] + c[:-1]) / 2, rtol=0, atol=1e-15)
    x = _sphere(40_000, D, 1).flatten().numpy()  # 2.56M coordinates
    cell = np.searchsorted(b, x)
    means = np.array([x[cell == i].mean() for i in range(len(c))])
    sem = np.array([x[cell == i].std() / math.sqrt((cell == i).sum()) for i in range(len(c))])
    assert np.all(np.abs(means - c) < 5 * sem + 1e-6), (means, c)
    # a codebook moved off the conditions does worse on the same samples
    mse = ((x - c[cell]) ** 2).mean()
    shifted = c * 1.05
    assert ((x - shifted[np.searchsorted((shifted[1:] + shifted[:-1]) / 2, x)]) ** 2).mean() > mse


def test_distortion_matches_the_paper():
    """Theorem 1's values D_mse ~ 0.36, 0.117, 0.03, 0.009 for b = 1..4 (the paper rounds), between the
    lower bound 4^-b and the upper bound sqrt(3) pi / 2 * 4^-b; and measured on sampled unit vectors."""
    for b, paper in zip((1, 2, 3, 4), (0.36, 0.117, 0.03, 0.009)):
        got = codebook_mse(128, b)
        assert abs(got - paper) / paper < 0.15, (b, got)
        assert 4.0**-b < got < math.sqrt(3) * math.pi / 2 * 4.0**-b
    inst = _instance(D, 3, prod=False, seed=0)
    u = _sphere(4000, D, 2).float()
    codes = inst.encode(slice(0, 1), u[None, None])
    x_hat = inst.dequantize(0, {k: t[0] for k, t in codes.items()})[0]
    measured = ((x_hat - u) ** 2).sum(-1).mean().item()
    assert abs(measured - codebook_mse(D, 3)) < 0.003, measured


def _instance(m: int, bits: int, prod: bool, seed: int, draws: int = 1) -> Instance:
    """An instance with ``draws`` independent rotations (and sketches), one per "layer"."""
    g = torch.Generator().manual_seed(seed)
    rot = make_sketch(draws, m, m, g, orthogonalize=True) / math.sqrt(m)
    sk = make_sketch(draws, m, m, g, orthogonalize=False) if prod else None
    c, b = beta_codebook(m, bits - 1 if prod else bits) if (bits - prod) else (np.zeros(1), np.zeros(0))
    return Instance("key", m, bits, prod, rot, sk, torch.tensor(c).float(), torch.tensor(b).float())


def _estimates(inst: Instance, x: torch.Tensor, y: torch.Tensor, draws: int) -> np.ndarray:
    """<y, x_hat> for each draw, x_hat rebuilt here from the stored codes (Algorithm 2's DeQuant, written
    plainly): ||x|| (Pi^T c[idx] + sqrt(pi/2)/m * gamma * S^T sign)."""
    codes = inst.encode(slice(0, draws), x.expand(draws, 1, 1, -1))
    m = inst.m
    x_hat = torch.zeros(draws, m)
    if inst.code_bits:
        idx = unpack_codes(codes["key_codes"][:, 0, 0], inst.code_bits, m).long()
        x_hat = torch.einsum("lj,ljk->lk", inst.centroids[idx], inst.rotation)
    if inst.prod:
        signs = unpack_signs(codes["key_signs"][:, 0, 0], m)
        gamma = codes["key_residual_norms"][:, 0, 0].float() if inst.code_bits else torch.ones(draws)
        x_hat = x_hat + math.sqrt(math.pi / 2) / m * gamma[:, None] * torch.einsum("lj,ljk->lk", signs, inst.sketch)
    x_hat = x_hat * codes["key_norms"][:, 0, 0].float()[:, None]
    return (x_hat @ y).numpy()


def test_prod_is_unbiased_over_rotations_and_mse_is_not():
    """Theorem 2: E <y, x_hat> = <y, x> over the random rotation and sketch. The mean of the prod estimates
    over 2000 draws lands within 4 standard errors of the true inner product; the mse estimate at the same
    bits (b = 2: the paper's multiplicative bias) misses by far more than its own standard error."""
    x = _sphere(1, D, 3)[0].float()
    y = (x + 0.3 * _sphere(1, D, 4)[0].float()) * 5.0  # an inner product far from 0
    truth, draws = float(y @ x), 2000
    p = _estimates(_instance(D, 2, True, 0, draws), x, y, draws)
    m = _estimates(_instance(D, 2, False, 1, draws), x, y, draws)
    assert abs(p.mean() - truth) < 4 * p.std() / math.sqrt(draws), (p.mean(), truth)
    assert abs(m.mean() - truth) > 10 * m.std() / math.sqrt(draws), (m.mean(), truth)
    # the paper's inner-product distortion at b = 2: ~0.56 / d * ||y||^2
    assert ((p - truth) ** 2).mean() < 1.5 * 0.56 / D * float(y @ y)
    # the method's own logits are the same estimate
    inst = _instance(D, 2, True, 0, 3)
    codes = {k: t[1] for k, t in inst.encode(slice(0, 3), x.expand(3, 1, 1, -1)).items()}
    np.testing.assert_allclose(inst.logits(1, y[None, None], codes).item(), _estimates(inst, x, y, 3)[1], rtol=1e-4)


def test_logits_equal_the_dequantized_keys(lm, prefill_state):
    """The estimate is linear in the query: the codes' logits equal q . x_hat of Algorithm 2's DeQuant."""
    comp, knobs = compressed(lm, prefill_state, "turboquant", "0.25", residual=0, bits=2.25)
    assert knobs["outlier_channels"] == 16
    st, layer = comp.layers[3], 3
    q = prefill_state.queries[layer, :, -1:].float()
    k_hat, _ = comp.dequantize(layer, st)
    qg = group_queries(q * comp.sem[layer].scaling, st.res_k.shape[0])
    torch.testing.assert_close(comp.code_logits(layer, qg, st), qg @ k_hat.transpose(-1, -2), atol=2e-3, rtol=1e-3)


def test_budget_picks_bits_and_holds_bytes(lm, prefill_state):
    """The planner maps the budget to bits (more budget, more bits), then the window; bytes held stay
    within the budget, and the shared rotations and sketches are reported apart."""
    n, info = prefill_state.n_tokens, lm.info
    bits = []
    for b in ("0.15", "0.25", "0.5"):
        comp, knobs = compressed(lm, prefill_state, "turboquant", b)
        assert comp.nbytes() <= float(b) * exact_bytes(info, n) * 1.001
        bits.append(knobs["bits"])
        kinds = dict(comp.shared_nbytes_by_kind())
        assert {"rotation", "sketch", "codebook"} <= set(kinds)
        assert "rotation" not in comp.nbytes_by_kind()
    assert bits == sorted(bits) and bits[0] < bits[-1]


def test_attention_error_falls_with_bits(lm, prefill_state):
    """On real keys and values, attention through the codes alone (no window) gets closer to exact
    attention with more bits."""
    state, info, layer = prefill_state, lm.info, 5
    q = state.queries[layer, :, -1:]
    ref = attend(q.float(), state.keys[layer].half(), state.values[layer].half(), info.semantics[layer])
    errs = []
    for bits in (2.0, 3.0, 4.0):
        comp = get("turboquant")(info, Budget.parse("0.5"), {"bits": bits, "residual": 0, "keys": "mse"})
        budget_search.planned(comp, state.n_tokens)
        comp.compress(state)
        errs.append(((comp.attend(layer, q) - ref).norm() / ref.norm()).item())
    assert errs[0] > errs[1] > errs[2], errs
