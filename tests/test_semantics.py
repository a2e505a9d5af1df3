"""The shared attention maths (``kvlab.core.semantics``) against transformers' own eager formulas."""

import torch

from kernels.tensor_ops import group_queries
from kvlab.core import semantics as sm

HQ, HKV, D = 4, 2, 8


def _sem(**kw):
    return sm.LayerSemantics(scaling=D**-0.5, k_dim=D, v_dim=D, **kw)


def _eager(q, k, v, scaling, softcap=None, sinks=None, window=None):
    """Gemma 2 / gpt-oss eager attention for the last query (repeat_kv, cap, mask, sink column)."""
    k, v = k.repeat_interleave(HQ // HKV, 0), v.repeat_interleave(HQ // HKV, 0)
    w = q @ k.transpose(-1, -2) * scaling
    if softcap:
        w = torch.tanh(w / softcap) * softcap
    n = k.shape[-2]
    if window:
        w[..., : max(0, n - window)] = float("-inf")
    if sinks is not None:
        w = torch.cat([w, sinks.reshape(HQ, 1, 1).expand(HQ, w.shape[1], 1)], -1)
        return torch.softmax(w, -1)[..., :-1] @ v
    return torch.softmax(w, -1) @ v


def test_attend_and_grouped_softmax_match_the_eager_formulas():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(h, t, D, generator=g) for h, t in ((HQ, 1), (HKV, 40), (HKV, 40)))
    sinks = torch.randn(HQ, generator=g) + 2  # large enough to take a visible share
    for kw in ({}, {"softcap": 5.0}, {"sinks": sinks}, {"window": 16}, {"softcap": 5.0, "sinks": sinks, "window": 16}):
        sem = _sem(**kw)
        ref = _eager(q, k, v, sem.scaling, **kw)
        pos = torch.arange(40)
        out = sm.attend(q, k, v, sem, bias=sm.window_bias(sem, pos[-1:], pos))
        assert torch.allclose(out, ref, atol=1e-5), kw
        probs = sm.grouped_softmax(group_queries(q * sem.scaling, HKV) @ k.transpose(-1, -2), sem, HQ)
        grouped = (probs @ v).reshape(HQ, 1, D)
        assert torch.allclose(grouped, ref, atol=1e-5), kw
        if "sinks" in kw:  # the sink takes a share of every row: the weights sum to less than 1
            assert (probs.sum(-1) < 1 - 1e-4).all()


def test_with_sinks_is_the_normaliser_with_the_sink_column():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(HQ, 3, 10, generator=g)  # [Hq, t, n]
    sem = _sem(sinks=torch.randn(HQ, generator=g))
    full = torch.logsumexp(torch.cat([x, sem.sinks.reshape(HQ, 1, 1).expand(HQ, 3, 1)], -1), -1)
    assert torch.allclose(sm.log_normaliser(x, sem), full, atol=1e-6)
    grouped = torch.logsumexp(x, -1).reshape(HKV, -1)  # rows (head in group, query)
    assert torch.allclose(sm.with_sinks(grouped, sem, HQ), full.reshape(HKV, -1), atol=1e-6)


def test_unknown_attention_argument_is_refused():
    class M:
        layer_idx = 0

    q = torch.zeros(1, HQ, 2, D)
    try:
        sm.from_call(M(), q, q[:, :HKV], q[:, :HKV], 1.0, {"alibi_slopes": torch.ones(HQ)}, None)
    except sm.UnsupportedAttention as exc:
        assert "alibi_slopes" in str(exc)
    else:
        raise AssertionError("an unknown argument was dropped")
