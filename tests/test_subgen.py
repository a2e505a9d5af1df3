"""SubGen (Algorithm 1) and its k-center variant: clustering, reservoir statistics, estimator, engine runs."""

import pytest
import torch

from kvlab.core import semantics as sm
from kvlab.core.budgets import Budget
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.methods import budget_search
from kvlab.methods.clustering import cluster_stream, greedy_kcenter
from kvlab.methods.subgen import SubGenState, kcenter_compress

# chi-square critical values at p = 0.001
CHI2_CRIT = {5: 20.52, 7: 24.32}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _one_cluster_stream(n_streams, n, d=8, norms=None):
    """n tokens with one-hot keys (token i = e_i, all within one cluster of radius 2) in every stream."""
    keys = torch.eye(d)[:n].expand(1, n_streams, n, d).clone()
    vn = torch.ones(n) if norms is None else norms
    values = (torch.eye(d)[:n] * vn.unsqueeze(-1)).expand(1, n_streams, n, d).clone()
    return keys, values


def _build_then_stream(keys, values, n_prompt, t, s, seed):
    """Algorithm 1 over a prompt of n_prompt tokens, then the rest one token at a time (decode path)."""
    gen = torch.Generator().manual_seed(seed)
    delta = torch.full(keys.shape[:2], 2.0)
    st = SubGenState.build(keys[:, :, :n_prompt], values[:, :, :n_prompt], delta, t, s, m_cap=4, gen=gen)
    for i in range(n_prompt, keys.shape[2]):
        st.append(0, keys[0, :, i], values[0, :, i], gen)
    return st


@pytest.mark.parametrize("n_prompt", [6, 2])  # all in the prompt (closed form), or mostly streamed (coins)
def test_cluster_reservoir_is_uniform(n_prompt):
    keys, values = _one_cluster_stream(3000, 6)
    st = _build_then_stream(keys, values, n_prompt, t=2, s=1, seed=1)
    assert (st.count == 1).all() and (st.sizes[..., 0] == 6).all()
    picked = st.samples[0, :, 0].argmax(-1).flatten()  # which token each slot holds
    counts = torch.bincount(picked, minlength=6).float()
    assert _chi2(counts, torch.full((6,), 1 / 6)) < CHI2_CRIT[5]


@pytest.mark.parametrize("n_prompt", [8, 1])
def test_value_reservoir_is_proportional_to_squared_norm(n_prompt):
    norms = torch.tensor([0.5, 1.0, 1.5, 2.0, 1.0, 3.0, 0.7, 2.5])
    keys, values = _one_cluster_stream(3000, 8, norms=norms)
    st = _build_then_stream(keys, values, n_prompt, t=1, s=2, seed=2)
    picked = st.mk[0].argmax(-1).flatten()
    assert torch.equal(st.mv[0].argmax(-1).flatten(), picked)  # keys and values travel together
    counts = torch.bincount(picked, minlength=8).float()
    probs = norms**2 / (norms**2).sum()
    assert _chi2(counts, probs) < CHI2_CRIT[7]
    assert torch.allclose(st.mu, torch.full_like(st.mu, float((norms**2).sum())))


def _clustered(seed, n_streams=4, n=512, d=16, n_clusters=8):
    g = torch.Generator().manual_seed(seed)
    centers = 1.5 * torch.randn(n_streams, n_clusters, d, generator=g)
    which = torch.randint(0, n_clusters, (n_streams, n), generator=g)
    keys = torch.gather(centers, 1, which.unsqueeze(-1).expand(-1, -1, d)) + 0.1 * torch.randn(
        n_streams, n, d, generator=g
    )
    values = torch.randn(n_streams, n, d, generator=g)
    q = torch.randn(n_streams, 1, d, generator=g)
    return keys.unsqueeze(0), values.unsqueeze(0), q


def _subgen_error(s, t, seeds=range(6)):
    errs = []
    for seed in seeds:
        keys, values, q = _clustered(seed)
        scaling = keys.shape[-1] ** -0.5
        gen = torch.Generator().manual_seed(100 + seed)
        st = SubGenState.build(keys, values, torch.full(keys.shape[:2], 1.0), t, s, m_cap=64, gen=gen)
        exact = sm.attend(q, keys[0], values[0], scaling)
        z = st.attend(0, q, scaling)
        errs.append(((z - exact).norm(dim=-1) / exact.norm(dim=-1)).mean())
    return float(torch.stack(errs).mean())


def test_error_falls_as_s_and_t_grow():
    errs = [_subgen_error(s, t) for s, t in [(4, 1), (32, 4), (256, 16), (2048, 64)]]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < 0.1 * errs[0], errs  # the numerator sampler converges like 1/sqrt(s)


def test_greedy_kcenter_covers_within_radius():
    keys, _, _ = _clustered(3)
    x = keys[0]
    kc = greedy_kcenter(x, 8)
    assert kc.centers.shape == (4, 8) and all(len(set(c.tolist())) == 8 for c in kc.centers)
    dist = (x - torch.gather(x, 1, torch.gather(kc.centers, 1, kc.assign).unsqueeze(-1).expand_as(x))).norm(dim=-1)
    assert torch.allclose(dist.amax(-1), kc.radius, atol=1e-4)
    assert (kc.radius < 1.0).all()  # 8 tight clusters, 8 centers: one per cluster


def test_kcenter_weighted_centers_approximate_attention():
    keys, values, q = _clustered(4, n=400)
    scaling = keys.shape[-1] ** -0.5
    k, v, pos, logw = kcenter_compress(keys, values, recent=16, k=8)
    assert k.shape[2] == 24 and torch.equal(pos[0, :, 8:], torch.arange(384, 400).expand(4, -1))
    assert torch.allclose(logw[0, :, :8].exp().sum(-1), torch.full((4,), 384.0))
    exact = sm.attend(q, keys[0], values[0], scaling)

    def err(vals, lw):
        z = sm.attend(q, k[0], vals[0], scaling, lw)
        return float(((z - exact).norm(dim=-1) / exact.norm(dim=-1)).mean())

    own = kcenter_compress(keys, values, recent=16, k=8, value="center")[1]
    # a center standing for its cluster with the mean value: close; unweighted or own value: far off
    assert err(v, logw[0]) < 0.25 and 10 * err(v, logw[0]) < min(err(v, None), err(own, logw[0]))


def test_both_modes_through_engine_hold_budget(engine, lm, long_text):
    ids = lm.encode(long_text[:2400])
    assert 400 < len(ids) <= 600
    runs = [RunSpec(m, Budget.parse("0.25")) for m in ("subgen", "subgen-kcenter", "subgen-kcenter-w")]
    res = engine.compare(ids, runs, GenerationSettings(max_new_tokens=5))
    sg, kp, kc = res.runs
    for r in res.runs:
        assert len(r.token_ids) == 5 and r.finish_reason == "length"
        assert 0.2 * r.exact_kv_bytes_per_step[0] < r.kv_bytes <= 0.25 * r.exact_kv_bytes_per_step[0]
    # streaming: within the budget at every decode step too
    assert all(b <= 0.25 * e for b, e in zip(sg.kv_bytes_per_step, sg.exact_kv_bytes_per_step))
    assert {"centers", "cluster_samples", "sample_keys", "sample_values", "value_mass"} <= set(sg.kv_bytes_breakdown)
    assert sg.params["m_cap"] >= 1 and sg.params["s"] >= 1 and sg.params["t"] == 4
    # prefill-only: each generated token adds one 16-bit token (+ position, and log-weight in the variant)
    per_token = 30 * 3 * (64 * 2 * 2 + 4 + 4)
    assert kc.kv_bytes_per_step[1] - kc.kv_bytes_per_step[0] == per_token
    assert kc.params["l"] + kc.params["k"] == int(0.25 * len(ids) * 256 // (256 + 8))
    assert kc.kv_bytes_breakdown["log_weights"] == 30 * 3 * (kc.params["l"] + kc.params["k"]) * 4
    # the paper's form: recent tokens + center tokens, no weights
    assert kp.kv_bytes_per_step[1] - kp.kv_bytes_per_step[0] == 30 * 3 * (64 * 2 * 2 + 4)
    assert kp.params["l"] + kp.params["k"] == int(0.25 * len(ids) * 256 // (256 + 4))
    assert "log_weights" not in kp.kv_bytes_breakdown and kp.params["weighted"] is False


def test_full_budget_is_exact(engine, lm):
    ids = lm.encode("Write a haiku about autumn leaves.")
    runs = [RunSpec("exact"), RunSpec("subgen", Budget.parse("1.0")), RunSpec("subgen-kcenter", Budget.parse("1.0"))]
    res = engine.compare(ids, runs, GenerationSettings(max_new_tokens=8))
    assert res.runs[0].token_ids == res.runs[1].token_ids == res.runs[2].token_ids


def test_algorithm1_delta_fits_m_cap_on_the_prompt(lm, prefill_state):
    """Algorithm 1 on the embedded model's prompt (~700 tokens): the chosen delta (bisection) makes
    leader clustering open at most m_cap clusters, so the cap does not bind on the prompt.

    The attention error of the last prompt query at budget 0.25 is ~0.6 (relative to ||a||) with the
    4 sink tokens and the recent window held exactly; Algorithm 1 alone on the whole prompt is ~2.2
    (its numerator weights mu / (s ||v||^2) are heavy-tailed on the attention sinks)."""
    from kvlab.methods import get

    st = prefill_state
    c = get("subgen")(lm.info, Budget.parse("0.25"), {})
    knobs = budget_search.planned(c, st.n_tokens)
    c.compress(st)
    m_cap = knobs["m_cap"]
    count = c.state.count
    assert int(count.max()) <= m_cap and knobs["clusters_max"] <= m_cap
    assert knobs["cap_bound"] is False and int(c.state.cap_joins.sum()) == 0
    assert float(count.float().mean()) > 0.5 * m_cap  # about m_cap: the budget is used
    # delta is the smallest radius that fits (to the bisection's precision): a bit smaller opens too many
    n_layers, h, n, d = st.keys.shape
    sink, recent = knobs["sink"], knobs["recent"]
    assert sink == 4 and recent > 0 and int(c.state.sizes.sum(-1).max()) == n - sink - recent
    stream = st.keys[:, :, sink : n - recent].reshape(n_layers * h, -1, d).float()
    tighter = cluster_stream(stream, c.state.delta.reshape(-1) * 0.97, m_cap + 1)[2]
    assert (tighter > m_cap).float().mean() > 0.5
    errs = []
    for layer in range(n_layers):
        q = st.queries[layer, :, -1:]
        exact = sm.attend(q, st.keys[layer], st.values[layer], st.scaling)
        z = c.attend(layer, q)
        errs.append(float(((z - exact).norm(dim=-1) / exact.norm(dim=-1)).mean()))
    print(f"subgen@0.25: m_cap {m_cap}, clusters {float(count.float().mean()):.1f}, err {sum(errs) / len(errs):.3f}")
    assert sum(errs) / len(errs) < 1.0  # measured 0.58-0.65 over seeds 0-2
    assert all(e == e for e in errs)


@pytest.mark.parametrize("name", ["subgen-kcenter", "subgen-kcenter-w"])
def test_kcenter_duplicate_keys_no_nan(name):
    """Repeated keys: greedy k-center never picks a token twice and every center is its own member,
    so no cluster is empty (no 0/0 mean, no log 0)."""
    from kvlab.core.model import ModelInfo
    from kvlab.methods import PrefillState, get

    info = ModelInfo("synthetic", 2, 4, 2, 16, "float32", "cpu", 4096)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 2, 3, 16, generator=g)
    keys = base.repeat_interleave(40, dim=2)  # 120 tokens, 3 distinct keys
    values = torch.randn(2, 2, 120, 16, generator=g)
    state = PrefillState(keys, values, torch.zeros(2, 4, 0, 16), 16**-0.5)
    c = get(name)(info, Budget(tokens=24), {})
    budget_search.planned(c, 120)
    c.compress(state)
    q = torch.randn(4, 1, 16, generator=g)
    for layer in range(2):
        k, v, pos, lw = c.layers[layer].views()
        assert torch.isfinite(k).all() and torch.isfinite(v).all()
        assert lw is None or torch.isfinite(lw).all()
        assert all(len(set(p.tolist())) == len(p) for p in pos)  # distinct tokens
        assert torch.isfinite(c.attend(layer, q)).all()


def test_recent_window_slides_into_the_stream(lm, prefill_state):
    """While decoding, the newest token enters the exact window and the window's oldest token goes on
    into Algorithm 1 (its cluster sizes grow by one per step); the sink tokens stay."""
    from kvlab.methods import get

    st = prefill_state
    c = get("subgen")(lm.info, Budget.parse("0.25"), {})
    knobs = budget_search.planned(c, st.n_tokens)
    c.compress(st)
    sink, recent, n = knobs["sink"], knobs["recent"], st.n_tokens
    before = c.state.sizes.sum(-1).clone()
    sinks = c.exact.keys[:, :, :sink].clone()
    oldest = c.exact.keys[0, :, sink].clone()  # prompt token n - recent
    g = torch.Generator().manual_seed(0)
    new = [torch.randn(3, 1, 64, generator=g).half() for _ in range(3)]
    for i, k in enumerate(new):
        for layer in range(30):
            c.append(layer, k, k, n + i)
    assert torch.equal(c.state.sizes.sum(-1), before + 3)
    assert torch.equal(c.exact.keys[:, :, :sink], sinks)
    window = c.exact.keys[0, :, sink:]
    assert all(any(torch.equal(window[:, j], k[:, 0]) for j in range(recent)) for k in new)
    assert not any(torch.equal(window[:, j], oldest) for j in range(recent))
    # the literal Algorithm 1 (no exact tokens) puts every token in the stream
    lit = get("subgen")(lm.info, Budget.parse("0.25"), {"sink": 0, "recent_share": 0.0})
    assert budget_search.planned(lit, n)["recent"] == 0
    lit.compress(st)
    assert int(lit.state.sizes.sum(-1).max()) == n and lit.exact.keys.shape[2] == 0


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_local_layers_hold_the_window_and_attend_exactly(lm, long_text, arch):
    """On a model with sliding-window layers, ``subgen``'s local layers hold at most their window (a
    sliding dense store that drops the token leaving it) and Algorithm 1 runs on the global layers only.
    Gemma 3 (local and global layers): the budget pays for the whole window beside Algorithm 1, so a
    local layer's output equals exact sliding-window attention over every token seen, while decoding
    too. Mistral (every layer local): each local layer holds its share of the budget, the latest tokens."""
    from bench.tiny_models import WINDOW, build
    from kvlab.engine.loader import from_model
    from kvlab.engine.prefill import prefill
    from kvlab.methods import get

    loaded = from_model(build(arch), lm.tokenizer, arch).with_cache_dtype("float32")
    info, sem = loaded.info, loaded.info.semantics
    ids = lm.encode(long_text)[: 3 * WINDOW]
    st, _ = prefill(loaded, ids)
    n, h, d = st.n_tokens, info.n_kv_heads, info.head_dim
    c = get("subgen")(info, Budget.parse("0.5"), {})
    knobs = budget_search.planned(c, n)
    c.compress(st)
    local = [i for i, s in enumerate(sem.layers) if s.is_local]
    assert local and c.local_layers == local
    assert knobs["local_whole_window"] == (arch == "gemma3")
    g = torch.Generator().manual_seed(0)
    keys, values = st.keys.float(), st.values.float()
    for step in range(WINDOW + 3):  # past a whole window of generated tokens
        k = torch.randn(info.n_layers, h, 1, d, generator=g)
        v = torch.randn(info.n_layers, h, 1, info.v_head_dim, generator=g)
        keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
        for layer in range(info.n_layers):
            c.append(layer, k[layer], v[layer], n + step)
        q = torch.randn(info.n_heads, 1, d, generator=g)
        for layer in local:
            held_k, _, pos, _ = c.local[layer].views()
            cap = WINDOW if arch == "gemma3" else int(0.5 * WINDOW)
            assert held_k.shape[1] == cap <= sem[layer].window
            assert torch.equal(pos[0], torch.arange(n + step + 1 - cap, n + step + 1, dtype=pos.dtype))
            if arch == "gemma3":  # exact sliding-window attention of the newest token over all it has seen
                seen = torch.arange(keys.shape[2])
                hide = torch.zeros(h, seen.numel()).masked_fill(seen <= n + step - sem[layer].window, float("-inf"))
                want = sm.attend(q, keys[layer], values[layer], sem[layer], hide)
                torch.testing.assert_close(c.attend(layer, q), want, rtol=1e-5, atol=1e-6)
    assert c.state is None if arch == "mistral" else c.state.centers.shape[0] == info.n_layers - len(local)
