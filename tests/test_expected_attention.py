"""Expected Attention on the embedded model: its maths against a Monte-Carlo reference, its selection,
and its budget in bytes in both question protocols.

The closed form (the Gaussian's moment generating function) must equal the average of
exp(s q.k) over queries sampled from the prompt queries' pre-RoPE Gaussian and rotated the way
the method says future queries are: by RoPE at the next position (T = 1, exactly the attention
logit of a query there) and by RoPE averaged over the next T positions. RoPE is rebuilt here from
the model's config (rope_theta, head_dim; Llama's half-split convention), independently of the
method's code, and checked against the model's own rotary module; the query statistics the
prefill hands the method are checked against ones computed here from the captured queries.
"""

import pytest
import torch
from kv_samples import compressed

from kvlab.core.budgets import TOLERANCE, Budget
from kvlab.engine.prefill import prefill
from kvlab.engine.probe import Probe
from kvlab.engine.specs import GenerationSettings, Question, RunSpec
from kvlab.measure.health import budget_limits
from kvlab.methods import get
from kvlab.methods.expected_attention import (
    expected_attention_scores,
    expected_logits,
    future_query_stats,
    mean_rotation,
)
from kvlab.methods.handover import PrefillNeeds
from kvlab.tasks import split_ids

N_SINK = 4
SAMPLES = 60_000
LAYERS = (3, 17)


class ConfigRope:
    """RoPE from the config alone: cos/sin of position x inv_freq, halves rotated (Llama)."""

    def __init__(self, theta: float, head_dim: int):
        self.d = head_dim
        self.inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

    def cos_sin(self, positions):
        angles = positions.double()[:, None] * self.inv_freq[None]
        emb = torch.cat([angles, angles], -1)
        return emb.cos(), emb.sin()

    def half(self, x):
        return torch.cat([-x[..., self.d // 2 :], x[..., : self.d // 2]], -1)

    def rotate(self, x, positions):
        c, s = self.cos_sin(positions)
        return (x.double() * c + self.half(x.double()) * s).to(x.dtype)

    def unrotate(self, x, positions):
        c, s = self.cos_sin(positions)
        return (x.double() * c - self.half(x.double()) * s).to(x.dtype)


@pytest.fixture(scope="module")
def real(lm, long_text):
    """A ~300-token real prefill: post-RoPE keys/values, and the pre-RoPE Gaussian of the prompt's
    queries after the sinks (every query captured, un-rotated with the config's RoPE); the prefill's
    own statistics (what the method reads) equal it."""
    ids = lm.encode(long_text[:1200])
    n = len(ids)
    state, _ = prefill(lm, ids, PrefillNeeds(query_window=n, query_stats=n - N_SINK))
    rope = ConfigRope(lm.model.config.rope_parameters["rope_theta"], lm.info.head_dim)
    pos = torch.arange(n)
    cos, sin = lm.model.model.rotary_emb(torch.zeros(1), pos[None])  # the model's own, to check ours
    c, s = rope.cos_sin(pos)
    torch.testing.assert_close(cos[0].double(), c, atol=1e-4, rtol=0)
    torch.testing.assert_close(sin[0].double(), s, atol=1e-4, rtol=0)
    q = rope.unrotate(state.queries.double(), pos)[..., N_SINK:, :]  # [L, Hq, n - sinks, d] pre-RoPE
    mean = q.mean(-2)
    centred = q - mean.unsqueeze(-2)
    cov = centred.transpose(-1, -2) @ centred / q.shape[-2]
    handed = state.query_stats
    assert (handed.n, handed.first_pos) == (n - N_SINK, N_SINK)
    torch.testing.assert_close(handed.mean, mean.float(), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(handed.cov, cov.float(), atol=1e-3 * float(cov.abs().max()), rtol=1e-3)
    return state, rope, mean, cov


def _monte_carlo(rope, mean, cov, keys, c_bar, s_bar, scaling, gen):
    """log mean exp(s (Rbar q).k) over sampled q ~ N(mean, cov) per query head, and its standard error.

    mean [Hq, d], cov [Hq, d, d] (float64); keys [Hq, m, d] (each query head's own);
    Rbar q = q cos_bar + half(q) sin_bar (RoPE is linear: its average over positions is that of cos
    and sin). Returns ([Hq, m], [Hq, m])."""
    hq, d = mean.shape
    chol = torch.linalg.cholesky(cov + 1e-9 * torch.eye(d, dtype=cov.dtype))
    z = torch.randn(hq, SAMPLES, d, generator=gen, dtype=torch.float64)
    q = mean[:, None] + z @ chol.transpose(-1, -2)  # [Hq, S, d]
    q = q * c_bar + rope.half(q) * s_bar
    logits = scaling * q @ keys.double().transpose(-1, -2)  # [Hq, S, m]
    top = logits.amax(1, keepdim=True)
    w = (logits - top).exp()
    est = w.mean(1).log() + top.squeeze(1)
    se = w.std(1) / w.mean(1) / SAMPLES**0.5  # standard error of the log (delta method)
    return est, se


@pytest.mark.parametrize("horizon", [1, 512])
def test_closed_form_equals_monte_carlo(real, horizon):
    """On 24 real keys per head (scaled down where needed so that the logit variance s^2 k^T Sigma k
    is at most 3, where a lognormal's sample mean converges: relative error ~sqrt(e^3 / S) < 2%),
    closed form = sampled average within 5 standard errors."""
    state, rope, mean, cov = real
    n, d, s = state.n_tokens, mean.shape[-1], state.scaling
    future = torch.arange(n, n + horizon)
    rbar = mean_rotation(rope.rotate, future, d)
    c, sn = rope.cos_sin(future)
    gen = torch.Generator().manual_seed(0)
    picks = torch.linspace(0, n - 1, 24).long()
    for layer in LAYERS:
        mu, cv = future_query_stats(mean[layer].float(), cov[layer].float(), rbar)
        g = mean.shape[1] // state.keys.shape[1]
        keys = state.keys[layer, :, picks].repeat_interleave(g, 0)  # [Hq, m, d] real keys, spread over the prompt
        variance = 2 * (expected_logits(keys, mu, cv, s) - expected_logits(keys, mu, None, s))
        keys = keys * (3 / variance).clamp(max=1).sqrt()[..., None]  # logit variance s^2 k^T Sigma k <= 3
        est, se = _monte_carlo(rope, mean[layer], cov[layer], keys, c.mean(0), sn.mean(0), s, gen)
        want = expected_logits(keys, mu, cv, s).double()  # [Hq, m]: head h with its own keys
        err = (est - want).abs()
        assert (err <= 5 * se + 2e-3).all(), f"layer {layer}: worst {err.max():.4f} vs se {se.max():.4f}"


def test_mean_rotation_is_rope_averaged(real):
    """Rbar x = mean over the positions of RoPE(x): for T = 1 exactly the rotation, orthogonal; for a
    longer horizon a contraction (fast frequencies average out), slow frequencies nearly kept."""
    state, rope, _, _ = real
    n, d = state.n_tokens, 64
    x = torch.randn(5, d, generator=torch.Generator().manual_seed(1))
    one = mean_rotation(rope.rotate, torch.tensor([n]), d)
    torch.testing.assert_close(x @ one.T, rope.rotate(x[:, None], torch.tensor([n]))[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(one @ one.T, torch.eye(d), atol=1e-5, rtol=0)
    rbar = mean_rotation(rope.rotate, torch.arange(n, n + 512), d)
    want = torch.stack([rope.rotate(x[:, None], torch.tensor([t]))[:, 0] for t in range(n, n + 512)]).mean(0)
    torch.testing.assert_close(x @ rbar.T, want, atol=1e-5, rtol=0)
    gain = torch.linalg.svdvals(rbar)
    assert gain.max() <= 1 + 1e-5 and gain.min() < 0.05  # the fastest frequencies' pairs vanish
    assert gain.max() > 0.99  # the slowest (period >> 512 positions) stay


def test_scores_match_a_loop_over_heads(real):
    """Scores: softmax over keys of the expected logits per query head, averaged over each KV group,
    (+ epsilon) x ||v|| — written out head by head from the formula."""
    state, rope, mean, cov = real
    n, d, s, layer = state.n_tokens, 64, state.scaling, 9
    rbar = mean_rotation(rope.rotate, torch.arange(n, n + 64), d)
    mu, cv = future_query_stats(mean[layer].float(), cov[layer].float(), rbar)
    keys, values = state.keys[layer], state.values[layer]
    got = expected_attention_scores(keys, values, mu, cv, s, epsilon=0.01)
    hq, hkv = mu.shape[0], keys.shape[0]
    want = torch.zeros(hkv, n)
    for h in range(hq):
        k = keys[h // (hq // hkv)]
        logit = torch.stack([s * mu[h] @ k[i] + s * s / 2 * k[i] @ cv[h] @ k[i] for i in range(n)])
        want[h // (hq // hkv)] += torch.softmax(logit, 0) / (hq // hkv)
    want = (want + 0.01) * values.norm(dim=-1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    mean_only = expected_attention_scores(keys, values, mu, None, s, use_vnorm=False)
    assert torch.allclose(mean_only.sum(-1), torch.ones(hkv))  # expected attention sums to 1 per KV head


def test_keeps_the_sinks_and_the_top_scores(lm, real):
    """At 0.25: per layer and KV head, the first n_sink tokens, then the best-scored others in position
    order; every kept token outscores every dropped one."""
    state = real[0]
    comp, knobs = compressed(lm, state, "expected-attention", "0.25")
    scores = comp.scores(state)  # [L, Hkv, n - n_sink]
    assert scores.shape[-1] == state.n_tokens - N_SINK and knobs["sinks"] == N_SINK
    for layer in range(lm.info.n_layers):
        pos = comp.kept_positions(layer).long()  # [Hkv, capacity]
        assert pos.shape[-1] == knobs["capacity"] < state.n_tokens // 3
        assert (pos[:, :N_SINK] == torch.arange(N_SINK)).all() and (pos.diff(dim=-1) > 0).all()
        kept = torch.zeros_like(scores[layer], dtype=torch.bool).scatter_(1, pos[:, N_SINK:] - N_SINK, True)
        s = scores[layer]
        worst_kept = s.masked_fill(~kept, float("inf")).amin(-1)
        best_dropped = s.masked_fill(kept, float("-inf")).amax(-1)
        assert (worst_kept >= best_dropped).all(), layer


def test_holds_its_budget_in_bytes_in_both_protocols(engine, lm, long_text):
    """Through the engine at 0.25, with the question inside the compressed prompt and asked after it:
    the bytes held after prefill (or the question) and at every step stay within the budget
    (prefill-only: its share of the prompt, generated tokens on top) and fill at least 90% of it."""
    question = "What does the assert statement do?"
    ctx, rests = split_ids(lm, long_text[:1200], [question])
    runs = [RunSpec("expected-attention", Budget.parse("0.25"))]
    gen = GenerationSettings(max_new_tokens=3)
    aware = engine.compare(ctx + rests[0], runs, gen)
    agnostic = engine.compare(ctx, runs, gen, questions=[Question(rests[0], question)])
    assert aware.protocol != agnostic.protocol
    for result, n, asked in ((aware, len(ctx) + len(rests[0]), 0), (agnostic, len(ctx), len(rests[0]))):
        for run in result.runs:
            assert run.finish_reason in ("eos", "length") and not run.error, run.error
            limits = budget_limits(run, n, False, asked)
            assert len(limits) == len(run.kv_bytes_per_step) >= 2
            for k, (held, limit) in enumerate(zip(run.kv_bytes_per_step, limits)):
                assert held <= (1 + TOLERANCE) * limit, f"{run.budget} {result.protocol}: {held / limit:.3f} at {k}"
            assert run.kv_bytes_per_step[0] >= 0.9 * limits[0], (run.budget, result.protocol)


class _KeptAfterCompression(Probe):
    """Each run's kept positions per layer, read right after compression."""

    def __init__(self):
        self.kept = []

    def on_prefill(self, state, logits, compressors):
        self.kept = [[c.kept_positions(layer).clone() for layer in range(state.keys.shape[0])] for c in compressors]


def test_two_statistics_windows_in_one_comparison_each_get_their_own(engine, lm, long_text):
    """Two configurations with different ``stats_window`` in one comparison (one prefill): each keeps what
    it keeps when it runs alone, i.e. its statistics are over its own window, not the larger one's."""
    ids = lm.encode(long_text[:1200])
    budget = Budget.parse("0.25")
    configs = [{"stats_window": 8}, {"stats_window": 96}]
    gen = GenerationSettings(max_new_tokens=1)

    def kept(specs):
        probe = _KeptAfterCompression()
        result = engine.compare(ids, specs, gen, probes=[probe])
        assert all(not r.error for r in result.runs), [r.error for r in result.runs]
        return probe.kept

    together = kept([RunSpec("expected-attention", budget, c) for c in configs])
    for cfg, mine in zip(configs, together):
        (alone,) = kept([RunSpec("expected-attention", budget, cfg)])
        for layer, (a, b) in enumerate(zip(mine, alone)):
            assert torch.equal(a, b), (cfg, layer)
    assert any(not torch.equal(a, b) for a, b in zip(*together))  # the two windows do keep different tokens


def test_ada_expected_attention_beside_expected_attention_each_with_its_window(engine, lm, long_text):
    """kvpress's benchmarked entry (Expected Attention inside AdaKV, epsilon 1e-2) in one comparison with
    ``expected-attention`` at another ``stats_window``: each keeps what it keeps alone (its own statistics),
    AdaKV keeps the sinks in every head and spreads the same total over the heads unevenly."""
    ids = lm.encode(long_text[:1200])
    budget = Budget.parse("0.25")
    ada, plain = RunSpec("ada-expected-attention", budget), RunSpec("expected-attention", budget, {"stats_window": 8})
    assert get("ada-expected-attention").defaults()["epsilon"] == 0.01
    gen = GenerationSettings(max_new_tokens=1)

    def kept(specs):
        probe = _KeptAfterCompression()
        result = engine.compare(ids, specs, gen, probes=[probe])
        assert all(not r.error for r in result.runs), [r.error for r in result.runs]
        return probe.kept, result

    (ada_kept, plain_kept), both = kept([ada, plain])
    for spec, mine in ((ada, ada_kept), (plain, plain_kept)):
        (alone,), _ = kept([spec])
        for layer, (a, b) in enumerate(zip(mine, alone)):
            assert torch.equal(a, b), (spec.method, layer)
    counts = both.runs[0].kv_bytes_breakdown["head_counts"]
    assert counts > 0
    uneven = 0
    for layer, pos in enumerate(ada_kept):  # [Hkv, w] padded rows: each head's distinct positions
        held = [int(torch.unique(row).numel()) for row in pos]
        assert all((row[:N_SINK] == torch.arange(N_SINK)).all() for row in pos), layer
        uneven += len(set(held)) > 1
    assert uneven >= lm.info.n_layers // 2  # the allocation moves budget between heads in most layers
    plain_total = sum(int(p.numel()) for p in plain_kept)
    ada_total = sum(sum(int(torch.unique(row).numel()) for row in p) for p in ada_kept)
    assert abs(ada_total - plain_total) <= lm.info.n_layers * lm.info.n_kv_heads  # same budget, spread otherwise
