"""kernels.compiled: the fused CPU paths compiled by torch.compile equal their eager references on
real tensors (the embedded model's prefill keys and values), and the eager fallback serves when
compiling is switched off, fails, or has not finished."""

import pytest
import torch

from kernels import compiled as C
from kernels.qjl import make_sketch, outlier_channels, qjl_estimate_grouped, qjl_estimate_split_pair, qjl_quantize_torch
from kernels.quant import dequantize_groups, quantize_groups, weighted_token_sum

# Compiling from an empty cache takes minutes on a 2-core machine, and the compiled paths are off by
# default (KVLAB_COMPILE=1), so these run in `make test-all`.
pytestmark = pytest.mark.acceptance

GROUP, N_OUT = 32, 8


@pytest.fixture(scope="module")
def real(prefill_state):
    """QJL keys and 2-bit values of layer 5's prefill (a multiple of the outlier group), a decode query."""
    k, v = prefill_state.keys[5].float(), prefill_state.values[5].float()  # [Hkv, n, d]
    n = k.shape[1] // GROUP * GROUP
    k, v = k[:, :n], v[:, :n]
    hkv, _, d = k.shape
    gen = torch.Generator().manual_seed(0)
    s, s_out = make_sketch(2, 2 * d, d, gen)
    idx = outlier_channels(k, GROUP, N_OUT)
    keys = qjl_quantize_torch(k, s, s_out, idx, GROUP)
    qg = k[:, -3:] * 1.1  # [Hkv, 3, d]: real key statistics as the queries of one decode row
    probs = torch.softmax(torch.randn(hkv, 3, n, generator=gen), -1)
    return {"keys": keys, "qg": qg, "probs": probs, "v": quantize_groups(v, 2, 32), "k2": quantize_groups(k, 2, 32, -2)}


@pytest.fixture(scope="module")
def warmed():
    mp = pytest.MonkeyPatch()
    mp.setenv("KVLAB_COMPILE", "1")
    if not C.enabled():
        mp.undo()
        pytest.skip("no C++ compiler")
    C.warm_up(background=False)
    mp.undo()
    assert all(f.compiled is not None and f.error is None for f in C.ALL), C.status()


def split_args(r):
    kq = r["keys"]
    return (r["qg"], kq.sketch, kq.bits, kq.norms, kq.out_sketch, kq.out_bits, kq.out_norms, kq.out_idx)


def test_compiled_equals_eager_on_real_tensors(real, warmed, monkeypatch):
    kq, v, k2 = real["keys"], real["v"], real["k2"]
    with C.eager():
        want_split = qjl_estimate_split_pair(*split_args(real), GROUP)
        want_est = qjl_estimate_grouped(real["qg"], kq.sketch, kq.bits, kq.norms)
    monkeypatch.setattr(C.SPLIT_PAIR, "faster", True)  # as if it had won the warm-up's timing
    got_split = qjl_estimate_split_pair(*split_args(real), GROUP)  # dispatches to the compiled code
    scale = want_split.abs().max()
    assert torch.allclose(got_split, want_split, atol=1e-5 * scale, rtol=1e-4)
    sh = C.shifts_for(2)
    with torch.no_grad():
        got_est = C.ESTIMATE.compiled(real["qg"], kq.sketch, kq.bits, kq.norms)
        got_v = C.VALUE_READ.compiled(real["probs"], v.codes, v.scale, v.minimum, sh, v.group)[..., : v.length]
        got_k = C.DEQUANTIZE_KEYS.compiled(k2.codes, k2.scale, k2.minimum, sh, k2.group)[:, : k2.length]
    assert torch.allclose(got_est, want_est, atol=1e-5 * want_est.abs().max(), rtol=1e-4)
    assert torch.allclose(got_v, weighted_token_sum(real["probs"], v), atol=1e-5, rtol=1e-4)
    assert torch.allclose(got_k, dequantize_groups(k2), atol=1e-5, rtol=1e-5)


def test_growing_cache_does_not_recompile(real, warmed):
    """Dynamic shapes: a cache of another length (fewer token groups, more query rows) runs the same code."""
    from torch._dynamo.utils import counters

    kq, half = real["keys"], real["keys"].bits.shape[1] // GROUP // 2 * GROUP
    qg = torch.cat([real["qg"]] * 5, 1)  # five rows in lockstep
    args = (qg, kq.sketch, kq.bits[:, :half], kq.norms[:, :half], kq.out_sketch)
    args += (kq.out_bits[:, :half], kq.out_norms[:, :half], kq.out_idx[:, : half // GROUP])
    args = tuple(a.contiguous() for a in args)  # a cache's segments are contiguous tensors
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():  # the decode step's mode, and the warm-up's
        got = C.SPLIT_PAIR.compiled(*args)
    assert counters["stats"]["unique_graphs"] == graphs
    want = C.split_pair_estimate(*args)
    assert got.shape == (3, 15, half) and torch.allclose(got, want, atol=1e-5 * want.abs().max(), rtol=1e-4)


def test_eager_fallback(real, monkeypatch):
    """Switched off, failing to compile, or not compiled yet: the eager reference answers."""
    monkeypatch.setenv("KVLAB_COMPILE", "0")
    assert not C.enabled() and C.warm_up() is None
    monkeypatch.setenv("KVLAB_COMPILE", "2")
    with pytest.raises(ValueError, match="allowed 0 or 1"):
        C.enabled()

    def broken(*a, **k):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(torch, "compile", broken)
    f = C.Fused("split", C.split_pair_estimate)
    want = f(*split_args(real))  # not compiled yet: eager
    f.compile(*split_args(real))
    assert not f.ready and "no compiler" in f.error
    assert torch.equal(f(*split_args(real)), want)
    with C.eager():
        assert torch.allclose(want, qjl_estimate_split_pair(*split_args(real), GROUP), atol=1e-4, rtol=1e-4)
