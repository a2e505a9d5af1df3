"""Compactor against its own maths on a real prefill: the chunked non-causal attention written as plain loops
(the reference's zero padding of the last chunk spelled out), the leverage from an explicit inverse, the
z-scores and the blend by hand; the sinks kept; the blend's default from the budget."""

import pytest
import torch
from kv_samples import compressed
from test_expected_attention import ConfigRope
from test_leverage import reference_leverage

from kvlab.engine.prefill import prefill
from kvlab.methods.compactor import chunked_attention_sums
from kvlab.methods.handover import PrefillNeeds

CHUNK = 64  # small chunks: several of them and a padded last one on a ~300-token prompt


@pytest.fixture(scope="module")
def state(lm, long_text):
    ids = lm.encode(long_text[:1200])
    st, _ = prefill(lm, ids, PrefillNeeds(query_window=len(ids)))
    return st


def loop_sums(q: torch.Tensor, k: torch.Tensor, chunk: int, reference: bool) -> torch.Tensor:
    """[Hq, m] column sums of the chunked non-causal softmax, one chunk and one head at a time (float64).
    ``reference``: the last chunk of r < chunk tokens gets chunk - r zero keys (logit 0 in every real row's
    normaliser) and chunk - r zero queries, each spreading 1/chunk over the chunk's keys."""
    hq, m, _ = q.shape
    group = hq // k.shape[0]
    out = torch.zeros(hq, m, dtype=torch.float64)
    for h in range(hq):
        for start in range(0, m, chunk):
            end = min(m, start + chunk)
            logits = q[h, start:end].double() @ k[h // group, start:end].double().T
            pad = chunk - (end - start) if reference else 0
            top = logits.amax(-1, keepdim=True).clamp_min(0)  # the padding's logit 0 joins the max
            e = (logits - top).exp()
            w = e / (e.sum(-1, keepdim=True) + pad * (-top).exp())
            out[h, start:end] = w.sum(0) + pad / chunk
    return out


@pytest.mark.parametrize("reference", [True, False])
def test_chunked_attention_matches_the_loop(lm, state, reference):
    layer = 5
    q = state.queries[layer, :, -200:]  # 200 tokens: three chunks of 64 and a last one of 8
    k = state.keys[layer, :, -200:]
    got = chunked_attention_sums(q, k, CHUNK, reference).double()
    want = loop_sums(q, k, CHUNK, reference)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    last = want[:, 192:].mean()
    assert (last > 1.5) if reference else (0.5 < last < 1.5)  # the padding's share: +56/64 per key


def test_scores_blend_the_two_z_scores_and_keep_the_sinks(lm, state):
    n, info = state.n_tokens, lm.info
    comp, knobs = compressed(lm, state, "compactor", "0.25", chunk_size=CHUNK)
    assert knobs["blending"] == pytest.approx(1 - knobs["capacity"] / n, abs=1e-6)
    left, right = 8, 4
    keys, values = state.keys[:, :, left : n - right], state.values[:, :, left : n - right]
    rope = ConfigRope(lm.model.config.rope_parameters["rope_theta"], info.head_dim)
    lev = reference_leverage(keys, rope, seed=0, k=48, first=left)
    queries = state.queries[:, :, left : n - right]
    attn = torch.stack([loop_sums(queries[i], keys[i], CHUNK, True) for i in range(info.n_layers)])
    attn = attn.view(info.n_layers, info.n_kv_heads, -1, attn.shape[-1]).mean(2) * values.double().norm(dim=-1)
    attn = torch.nn.functional.avg_pool1d(attn, 3, stride=1, padding=1)

    def z(x):
        flat = x.flatten(1)
        return (x - flat.mean(1)[:, None, None]) / flat.std(1)[:, None, None]

    want = knobs["blending"] * z(lev) + z(attn)
    got = comp.scores(state).double()
    torch.testing.assert_close(got[..., left : n - right], want, atol=5e-3, rtol=1e-3)
    top = want.flatten(1).amax(1)[:, None, None]
    torch.testing.assert_close(got[..., :left], top.expand(-1, info.n_kv_heads, left), atol=5e-3, rtol=1e-3)
    for layer in (0, info.n_layers - 1):
        kept = comp.kept_positions(layer).long()
        assert kept.shape[-1] == knobs["capacity"]
        assert (kept[:, :left] == torch.arange(left)).all() and (kept[:, -right:] == torch.arange(n - right, n)).all()


def test_budgets_on_one_prefill_share_the_terms_but_not_the_blend(lm, state):
    """The two terms do not depend on the budget: computed once per prefill (``PrefillState.memo``); the blend
    does (its default is the fraction removed), so the scores differ."""
    before = {k for k in state.memo if k[0] == "Compactor"}
    quarter, _ = compressed(lm, state, "compactor", "0.25", chunk_size=CHUNK)
    half, _ = compressed(lm, state, "compactor", "0.5", chunk_size=CHUNK)
    assert len({k for k in state.memo if k[0] == "Compactor"} - before) <= 1
    assert quarter.blending != half.blending
    assert not torch.equal(quarter.scores(state), half.scores(state))
