"""BalanceKV on the embedded model's real keys/values: the walk balances, the halving beats uniform
sampling (paper Fig. 2), and the engine runs it within its byte budget."""

import math

import pytest
import torch

from kernels.tensor_ops import gather_tokens, group_queries, ungroup
from kvlab.core import semantics as sm
from kvlab.core.budgets import Budget, exact_bytes
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.methods import budget_search
from kvlab.methods.balancekv import (
    BalanceKV,
    WalkConfig,
    balance_blocks,
    balance_kv,
    balance_signs,
    block_kernel,
    fit_layout,
    halve,
)

LAYERS = [1, 2, 5]  # the layers of the paper's Fig. 2
SINK = 32


def _blocks(x, start, nb, b):
    """[L, H, n, d] -> [L, H, nb, b, d], tokens start .. start + nb*b."""
    return x[:, :, start : start + nb * b].reshape(*x.shape[:2], nb, b, x.shape[-1])


def _discrepancy(signs, k, v, q, lam):
    """Relative norm of sum_i s_i exp(<k_i,q>/sqrt(d)) (v_i, sqrt(lam)) per block and query, averaged.

    signs [L, H, nb, b]; k, v [L, H, nb, b, d]; q [L, H, w, d] (queries of one KV head's group).
    """
    k, v, q, s = k.double(), v.double(), q.double(), signs.double()
    e = torch.exp(torch.einsum("lhnbd,lhwd->lhnwb", k, q) / math.sqrt(k.shape[-1]))
    vv = torch.cat([v, torch.full((*v.shape[:-1], 1), math.sqrt(lam), dtype=v.dtype)], -1)
    signed = torch.einsum("lhnwb,lhnb,lhnbe->lhnwe", e, s, vv)
    total = torch.einsum("lhnwb,lhnbe->lhnwe", e, vv)
    return (signed.norm(dim=-1) / total.norm(dim=-1)).mean().item()


def test_halve_rule_exact_half():
    signs = torch.tensor([[1.0, 1, -1, 1, 1, -1, -1, -1], [-1.0, 1, -1, 1, -1, 1, 1, -1]])
    keep, mult = halve(signs)
    # row 0: '+' reaches 4 at position 4 -> keep the '-' of [0, 4] (pos 2) doubled, then 5, 6, 7 as they are
    assert keep[0].tolist() == [2, 5, 6, 7] and mult[0].tolist() == [2, 1, 1, 1]
    # row 1: '+' reaches 4 at position 6 -> keep '-' at 0, 2, 4 doubled, then 7
    assert keep[1].tolist() == [0, 2, 4, 7] and mult[1].tolist() == [2, 2, 2, 1]


def test_walk_balances_better_than_random_split(prefill_state):
    st = prefill_state
    b, nb = 128, (st.n_tokens - SINK) // 128
    k, v = _blocks(st.keys[LAYERS], SINK, nb, b), _blocks(st.values[LAYERS], SINK, nb, b)
    q = group_queries(st.queries[LAYERS][:, :, -16:], k.shape[1])  # [L, Hkv, g*16, d] test queries
    cfg = WalkConfig()
    walk, rand = [], []
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        signs = balance_signs(*block_kernel(k, v, None, cfg), cfg, gen)
        assert set(signs.unique().tolist()) <= {-1.0, 1.0}
        walk.append(_discrepancy(signs, k, v, q, cfg.denom_weight))
        perm = torch.rand(signs.shape, generator=gen).argsort(-1)  # a uniform random split into halves
        rand.append(_discrepancy(torch.where(perm < b // 2, 1.0, -1.0), k, v, q, cfg.denom_weight))
    assert sum(walk) / len(walk) < 0.85 * sum(rand) / len(rand)


def test_walk_balances_synthetic_kernel():
    """Small-norm Gaussian keys (where Theorem 3.2's bound is tight): the walk is far below chance."""
    gen = torch.Generator().manual_seed(0)
    k = 0.7 * torch.randn(1, 1, 4, 256, 16, generator=gen)
    v = torch.randn(1, 1, 4, 256, 16, generator=gen)
    q = 0.7 * torch.randn(1, 1, 32, 16, generator=gen)
    cfg, fair_cfg = WalkConfig(), WalkConfig(gamma=0.0)  # gamma 0: independent fair coins
    signs = balance_signs(*block_kernel(k, v, None, cfg), cfg, gen)
    fair = balance_signs(*block_kernel(k, v, None, fair_cfg), fair_cfg, gen)
    assert _discrepancy(signs, k, v, q, cfg.denom_weight) < 0.6 * _discrepancy(fair, k, v, q, cfg.denom_weight)


def _attend(q, keys, values, idx, logw, scaling):
    """Causal attention of the last w prompt queries over the kept tokens idx [L, H, m] (with log-weights)."""
    n, w, g = keys.shape[-2], q.shape[-2], q.shape[1] // keys.shape[1]
    logits = sm.logits(q, gather_tokens(keys, idx), scaling, logw)
    qpos = torch.arange(n - w, n).view(w, 1)
    logits = logits.masked_fill(idx.repeat_interleave(g, 1).unsqueeze(-2) > qpos, float("-inf"))
    return ungroup(group_queries(logits.softmax(-1), keys.shape[1]) @ gather_tokens(values, idx), q.shape[1])


@pytest.mark.parametrize("rounds", [1, 2, 3, 4])
def test_attention_error_below_uniform(prefill_state, rounds):
    """Paper Sec. 4.1 / Fig. 2: first and recent tokens exact, the middle halved T times, vs uniform."""
    st = prefill_state
    k, v, q = st.keys, st.values, st.queries  # every layer: a few layers alone are too noisy for uniform
    L, H, n, _ = k.shape
    w = q.shape[-2]
    m = n - SINK - w
    e = SINK + m
    exact = _attend(q, k, v, torch.arange(n).expand(L, H, n), None, st.scaling)

    def rel_error(mid, logw):
        idx = torch.cat([torch.arange(SINK).expand(L, H, SINK), mid + SINK, torch.arange(e, n).expand(L, H, n - e)], -1)
        lw = torch.cat([torch.zeros(L, H, SINK), logw, torch.zeros(L, H, n - e)], -1)
        z = _attend(q, k, v, idx, lw, st.scaling)
        return ((z - exact).norm(dim=-1) / exact.norm(dim=-1)).mean().item()

    ours, unif = [], []
    for seed in range(2):  # the walk is nearly deterministic on real keys (p is clipped to 0 or 1)
        gen = torch.Generator().manual_seed(seed)
        mid, logw = balance_kv(k[:, :, SINK:e], v[:, :, SINK:e], rounds, 128, WalkConfig(), gen)
        assert mid.shape == (L, H, -(-m >> rounds))
        assert (mid.diff(dim=-1) > 0).all() and mid.min() >= 0 and mid.max() < m
        assert torch.allclose(logw.exp().mean(), torch.tensor(2.0**rounds), rtol=0.35)
        ours.append(rel_error(mid, logw))
    for seed in range(8):
        gen = torch.Generator().manual_seed(seed)
        umid = torch.rand(L, H, m, generator=gen).argsort(-1)[..., : mid.shape[-1]].sort(-1).values
        unif.append(rel_error(umid, torch.full(umid.shape, math.log(m / umid.shape[-1]))))
    print(f"T={rounds}: balancekv {sum(ours) / len(ours):.4f}, uniform {sum(unif) / len(unif):.4f}")
    assert sum(ours) / len(ours) < sum(unif) / len(unif)


def test_layout_fits_budget(lm):
    comp_cap = BalanceKV(lm.info, Budget.parse("0.25"))
    for n, frac in [(600, 0.25), (2048, 0.25), (2048, 0.125), (5000, 0.5), (300, 0.1)]:
        cap = int(frac * n * 512 / 520)
        lay = fit_layout(n, cap, 256, 256)
        assert lay.rounds >= 1
        assert cap - 2 <= lay.kept <= cap  # at or just under the budget
        assert lay.n_sink <= max(256, cap // 4) and lay.n_sink + lay.n_middle + lay.n_recent == n
    assert fit_layout(2048, 1000, 256, 256).rounds < fit_layout(2048, 300, 256, 256).rounds
    assert budget_search.planned(comp_cap, 600)["T"] >= 1
    assert budget_search.planned(BalanceKV(lm.info, Budget.parse("1.0")), 600)["T"] == 0


def test_engine_runs_within_budget(engine, lm, long_text):
    ids = lm.encode(long_text[:2600])
    n = len(ids)
    res = engine.compare(ids, [RunSpec("balancekv", Budget.parse("0.25"))], GenerationSettings(max_new_tokens=4))
    r = res.runs[0]
    target = 0.25 * exact_bytes(lm.info, n)
    assert 0.93 * target <= r.kv_bytes <= target
    assert r.params["T"] >= 2 and r.params["n_sink"] >= 1 and r.params["kept_tokens"] < n
    assert set(r.kv_bytes_breakdown) == {"keys", "values", "positions", "log_weights"}
    # prefill-only (Sec. 4.2): every generated token is kept, K + V + position + log-weight per head and layer
    per_token = lm.info.n_layers * lm.info.n_kv_heads * (lm.info.head_dim * 2 * 2 + 4 + 4)  # 16-bit K and V
    assert [b - r.kv_bytes for b in r.kv_bytes_per_step] == [i * per_token for i in range(len(r.kv_bytes_per_step))]
    assert len(r.token_ids) >= 1 and r.finish_reason in ("eos", "length")


def test_compressor_uses_log_weights(prefill_state, lm):
    """The kept middle tokens carry log(weight) > 0 on their logits; sinks and recent carry 0."""
    comp = BalanceKV(lm.info, Budget.parse("0.25"), {"block_size": 64})
    knobs = budget_search.planned(comp, prefill_state.n_tokens)
    comp.compress(prefill_state)
    k, v, pos, lw = comp.layers[3].views()
    a = knobs["n_sink"]
    mid = slice(a, a + -(-knobs["n_middle"] >> knobs["T"]))
    assert (lw[:, :a] == 0).all() and (lw[:, mid.stop :] == 0).all()
    assert (lw[:, mid] > 0).float().mean() > 0.9 and abs(lw[:, mid].exp().mean().item() / 2 ** knobs["T"] - 1) < 0.35
    assert torch.equal(k, gather_tokens(prefill_state.keys[3], pos.long()).to(k.dtype))  # stored in the cache dtype


def test_streaming_merge_and_reduce(prefill_state, lm):
    """balancekv-stream: generated tokens go through the MergeAndReduce tree (Algorithm 3)."""

    from kvlab.methods.balancekv import BalanceKVStream
    from kvlab.methods.handover import PrefillState

    st, n0, g = prefill_state, 200, 96
    comp = BalanceKVStream(lm.info, Budget.parse("0.25"), {"block_size": 16})
    comp.decode_steps = g  # the plan holds the budget for the g tokens appended below
    knobs = budget_search.planned(comp, n0)
    comp.compress(PrefillState(st.keys[:, :, :n0], st.values[:, :, :n0], st.queries[..., :0, :], st.scaling))
    start = comp.layers[0].n
    for p in range(n0, n0 + g):
        for layer in range(lm.info.n_layers):
            comp.append(layer, st.keys[layer, :, p : p + 1], st.values[layer, :, p : p + 1], p)
    # 96 tokens in blocks of 16: 48 reach level 1, 24 level 2 (16 of them halved on to level 3); with
    # T = 3 levels the 8 at level 3 are final, with T = 4 they wait at level 3. Either way 16 are held.
    expected = {3: [0, 0, 8], 4: [0, 0, 8, 8]}
    assert knobs["stream_T"] in expected and comp.levels[0] == expected[knobs["stream_T"]]
    assert comp.layers[0].n == start + 8 + 8
    k, v, pos, lw = comp.layers[0].views()
    assert (pos.diff(dim=-1) > 0).all()
    gen = pos[0] >= n0
    assert abs(lw[:, gen].exp().sum(-1).mean().item() / g - 1) < 0.35  # the weights stand for all 96 tokens
    ours, unif = [], []
    rng = torch.Generator().manual_seed(0)
    q = st.queries[:, :, -16:]
    for layer in range(lm.info.n_layers):
        k, v, pos, lw = comp.layers[layer].views()
        sel = pos[0] >= n0
        a = sm.attend(q[layer], st.keys[layer, :, n0 : n0 + g], st.values[layer, :, n0 : n0 + g], st.scaling)
        z = sm.attend(q[layer], k[:, sel], v[:, sel], st.scaling, lw[:, sel])
        ours.append(((z - a).norm(dim=-1) / a.norm(dim=-1)).mean().item())
        m = int(sel.sum())
        ui = torch.rand(3, g, generator=rng).argsort(-1)[:, :m].sort(-1).values + n0
        zu = sm.attend(
            q[layer],
            gather_tokens(st.keys[layer], ui),
            gather_tokens(st.values[layer], ui),
            st.scaling,
            torch.full((3, m), math.log(g / m)),
        )
        unif.append(((zu - a).norm(dim=-1) / a.norm(dim=-1)).mean().item())
    assert sum(ours) < sum(unif)


@pytest.mark.parametrize("cfg", [WalkConfig(), WalkConfig(c=0.5)], ids=["gamma", "paper-c"])
def test_walk_on_kernel_rows_matches_the_full_kernel_walk(prefill_state, cfg):
    """``balance_blocks`` (kernel rows made chunk by chunk) signs real blocks exactly as the walk on the
    full [b, b] block kernels does, with and without token weights, from the same random draws."""
    k, v = _blocks(prefill_state.keys, SINK, 2, 128), _blocks(prefill_state.values, SINK, 2, 128)
    g = torch.Generator().manual_seed(3)
    logw = torch.rand(k.shape[:-1], generator=g, dtype=torch.float64) * 2
    for lw in (None, logw):
        full = balance_signs(*block_kernel(k, v, lw, cfg), cfg, torch.Generator().manual_seed(0))
        rows = balance_blocks(k, v, lw, cfg, torch.Generator().manual_seed(0))
        assert torch.equal(full, rows)
        assert 0.2 < float((rows > 0).float().mean()) < 0.8  # a real walk, not all one sign


def test_algorithm2_step_matches_a_plain_reference():
    """step=algorithm2 is Algorithm 2, lines 2-11, written plainly (float64, one token at a time):
    p_j = 1/2 - y^T eta / (2 c R^2) with c = 30 log(b / delta), keys not centred; R^2 taken as the
    largest diagonal entry of the kernel (kvlab's R, see docs/methods/balancekv.md)."""
    from kvlab.methods.balancekv import algorithm2_config

    torch.manual_seed(0)
    nb, b, d, lam = 3, 16, 8, 0.025
    k, v = torch.randn(nb, b, d) * 1.5, torch.randn(nb, b, d)
    cfg = algorithm2_config(b, lam)
    assert not cfg.center and cfg.c == pytest.approx(30 * math.log(b / 0.01))
    signs = balance_blocks(k, v, None, cfg, torch.Generator().manual_seed(5))
    u = torch.rand(nb, b, generator=torch.Generator().manual_seed(5))  # the walk's coins, drawn alike
    flips = 0
    for blk in range(nb):
        kk, vv = k[blk].double(), v[blk].double()
        kern = torch.exp(kk @ kk.T / math.sqrt(d)) * (vv @ vv.T + lam)
        r2 = kern.diagonal().max()
        eta = torch.zeros(b, dtype=torch.float64)
        for j in range(b):
            p = 0.5 - float(kern[j] @ eta) / (2 * cfg.c * float(r2))
            assert abs(float(kern[j] @ eta)) <= cfg.c * float(r2)  # line 7 never FAILs here
            eta[j] = 1.0 if float(u[blk, j]) < p else -1.0
            flips += abs(p - 0.5) > 1e-6
        assert torch.equal(signs[blk].double(), eta)
    assert flips > 0  # the step moved p off 1/2: not a test of fair coins alone


def test_paper_preset_runs_T2_and_shrinks_its_windows_to_fit(lm):
    """balancekv@paper (Sec. 4.2: T = 2, b = 256): at 0.25 the 32 + 32 windows shrink to what fits; at
    0.4 they are kept whole."""
    from kvlab.methods import get

    cls = get("balancekv@paper")
    assert cls.name == "balancekv@paper" and cls.defaults()["T"] == 2 and cls.defaults()["block_size"] == 256
    tight = budget_search.planned(cls(lm.info, Budget(fraction=0.25)), 1000)
    loose = budget_search.planned(cls(lm.info, Budget(fraction=0.4)), 1000)
    assert tight["T"] == loose["T"] == 2
    assert tight["n_sink"] < 32 and loose["n_sink"] == 32
    default = budget_search.planned(get("balancekv")(lm.info, Budget(fraction=0.25)), 1000)
    assert default["T"] == 3  # kvlab's default picks T from the budget
