"""DuoAttention's on-the-fly head scores computed plainly with the model's own rotary embedding, and the
streaming heads they choose on a real prefill."""

import pytest
import torch
from kv_samples import compressed

from kvlab.core.budgets import exact_bytes
from kvlab.engine.prefill import prefill
from kvlab.methods import PrefillNeeds


@pytest.fixture(scope="module")
def state(lm, long_text):
    ids = lm.encode(long_text[:1500])
    return prefill(lm, ids, PrefillNeeds(query_stats=len(ids)))[0]


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def test_head_scores_and_streaming_heads(lm, state):
    info, n = lm.info, state.n_tokens
    comp, knobs = compressed(lm, state, "duoattention", "0.25")
    length = comp.cfg["pattern_len"]
    rotary = lm.model.model.rotary_emb
    cos, sin = (t[0].float() for t in rotary(state.keys.float(), torch.arange(max(n, length))[None]))  # [P, d]
    # mean key before RoPE (each key rotated back by its position), mean query from the prefill's statistics
    k = state.keys.float()
    pre_k = (k * cos[:n] - _rotate_half(k) * sin[:n]).mean(-2)  # [L, Hkv, d]
    mean_q = state.stats_over(n).mean  # [L, Hq, d]
    keys = pre_k[:, :, None] * cos[:length] + _rotate_half(pre_k[:, :, None]) * sin[:length]  # [L, Hkv, P, d]
    query = mean_q * cos[length - 1] + _rotate_half(mean_q) * sin[length - 1]  # [L, Hq, d]
    g = info.n_heads // info.n_kv_heads
    keys = keys.repeat_interleave(g, dim=1)
    probs = torch.softmax((keys @ query[..., None])[..., 0] * state.scaling, dim=-1)  # [L, Hq, P]
    expected = probs.cumsum(-1).mean(-1).view(info.n_layers, info.n_kv_heads, g).mean(-1)
    torch.testing.assert_close(comp.head_scores, expected, atol=1e-4, rtol=1e-4)
    counts = comp.head_counts()  # [L, Hkv]
    streaming = counts < n
    assert 0 < int(streaming.sum()) < streaming.numel()
    assert expected[streaming].max() <= expected[~streaming].min()  # the lowest scores stream
    s = knobs["n_sink"]
    assert 0 < s < 128 and knobs["n_recent"] < 256  # kvpress's 128 + 256 shrunk for a short prompt
    for layer, head in torch.nonzero(streaming).tolist()[:5]:
        c = int(counts[layer, head])
        positions = comp.layers[layer].pos.split(comp.layers[layer].counts.tolist())[head].tolist()
        assert positions == list(range(s)) + list(range(n - (c - s), n))
    assert int(counts.sum()) == knobs["tokens"] and comp.nbytes() <= 0.25 * exact_bytes(info, n) * 1.001
