"""Scissorhands on the real embedded model and on synthetic streams, against independent references."""

import pytest
import torch

from kvlab.core.budgets import Budget, exact_bytes
from kvlab.core.model import ModelInfo
from kvlab.engine.prefill import prefill, prefill_for
from kvlab.engine.probe import Probe
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.methods import PrefillNeeds, PrefillState, budget_search, get
from kvlab.methods.scored import eviction_keep

SYN = ModelInfo(
    id="synthetic", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, dtype="float32", device="cpu", max_positions=4096
)


class CacheWatch(Probe):
    """Probe recording, at every decode attention, each scissorhands run's cache size and kept positions."""

    attends = True

    def __init__(self, n_prompt):
        self.n_prompt, self.step, self.seen = n_prompt, 1, []

    def on_prefill(self, state, logits, comps):
        self.comps = comps

    def on_attend(self, layer, row, q, out):
        comp = self.comps[row]
        pos = comp.kept_positions(layer).clone()
        self.seen.append((row, layer, self.n_prompt + self.step - 1, pos, comp.scores[layer].shape))

    def on_step(self, step, rows, logits):
        self.step = step + 1

    def finish(self, runs):
        pass


@pytest.fixture(scope="module")
def decode_run(engine, lm, long_text):
    """Two scissorhands runs on a ~350-token prompt: a 40-token budget compressing every 4 steps, and 0.25."""
    ids = lm.encode(long_text[:1500])
    runs = [
        RunSpec("scissorhands", Budget.parse("40t"), {"m_ratio": 0.1}),
        RunSpec("scissorhands", Budget.parse("0.25")),
    ]
    watch = CacheWatch(len(ids))
    res = engine.compare(ids, runs, GenerationSettings(max_new_tokens=10), probes=[watch])
    return ids, res, watch


def test_eviction_keep_drops_largest_outside_recent():
    key = torch.tensor([[5.0, 1.0, 5.0, 0.0, 9.0, 9.0], [0.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    keep = eviction_keep(key, 2, recent=2)
    assert keep.tolist() == [[1, 3, 4, 5], [0, 3, 4, 5]]  # ties: the earlier token goes first


def test_cache_never_exceeds_budget_and_keeps_recent(decode_run, lm):
    ids, res, watch = decode_run
    assert all(r.finish_reason in ("eos", "length") for r in res.runs)
    knobs = [r.params for r in res.runs]
    assert knobs[0]["B"] == 40 and knobs[0]["m"] == 4 and knobs[0]["r"] == 10
    sizes = {0: set(), 1: set()}
    for row, layer, newest, pos, score_shape in watch.seen:
        B, r = knobs[row]["B"], knobs[row]["r"]
        assert pos.shape[-1] <= B
        assert score_shape == tuple(pos.shape)  # one record per kept token
        recent = torch.arange(newest - r + 1, newest + 1)
        assert torch.isin(recent, pos).all(), f"run {row} layer {layer} dropped a recent token"
        assert (pos.sort(-1).values == pos).all()  # positional order kept
        sizes[row].add(pos.shape[-1])
    # the 40-token run really compressed while decoding: B + 1 - m .. B
    assert min(sizes[0]) == 40 + 1 - 4 and max(sizes[0]) == 40
    layers = lm.info.n_layers
    assert len(watch.seen) == layers * sum(len(r.token_ids) - 1 for r in res.runs) > layers * 2 * 5


def test_bytes_within_budget_while_decoding(decode_run, lm):
    ids, res, _ = decode_run
    r = res.runs[1]
    target = 0.25 * exact_bytes(lm.info, len(ids))
    assert max(r.kv_bytes_per_step) <= target
    assert r.kv_bytes >= 0.97 * target  # the prompt compression fills the budget
    # K and V: 64 dims x 2 (K, V) x 2 bytes (16-bit cache dtype) = 256; int32 position 4; int16 record 2
    per_token = 64 * 2 * lm.info.dtype_bytes + 4 + 2
    assert lm.info.dtype_bytes == 2 and per_token == 262
    assert r.kv_bytes == r.params["B"] * per_token * 30 * 3
    assert r.kv_bytes_breakdown["scores"] == r.params["B"] * 2 * 30 * 3


def _reference_records(state, w, scaling, n_kv):
    """Per layer and KV head, how many of the last w prompt queries gave each visible key a
    group-averaged attention below 1/t (t = keys visible to that query); loop over queries."""
    L, hq, _, d = state.queries.shape
    n = state.n_tokens
    g = hq // n_kv
    rec = torch.zeros(L, n_kv, n, dtype=torch.int64)
    for i in range(w):
        p = n - w + i
        q = state.queries[:, :, state.queries.shape[2] - w + i].float()  # [L, Hq, d]
        k = state.keys[:, :, : p + 1].float().repeat_interleave(g, dim=1)  # [L, Hq, p+1, d]
        a = torch.softmax(torch.einsum("lhd,lhnd->lhn", q, k) * scaling, -1)
        a = a.view(L, n_kv, g, p + 1).mean(2)
        rec[..., : p + 1] += (a < 1.0 / (p + 1)).long()
    return rec


@pytest.mark.parametrize("rows", [None, 7], ids=["streams-per-block", "7-query-rows-per-block"])
def test_prefill_drops_tokens_with_highest_records(prefill_state, lm, monkeypatch, rows):
    state = prefill_state
    n = state.n_tokens
    if rows:  # blocks of a few query rows, as for long windows
        monkeypatch.setattr("kvlab.methods.scissorhands._PROBS_CHUNK_BYTES", rows * 3 * n * 4)
    comp = get("scissorhands")(lm.info, None, {"B": 100})
    knobs = budget_search.planned(comp, n)
    assert knobs == {"B": 100, "m": 50, "w": 50, "r": 25, "w_decode": 50}
    assert comp.prefill_needs(n).query_window == 50
    comp.compress(state)
    rec = _reference_records(state, 50, state.scaling, 3)
    for layer in range(30):
        pos = comp.kept_positions(layer).long()
        assert pos.shape == (3, 100)
        for h in range(3):
            cand = rec[layer, h, : n - 25]
            order = sorted(range(n - 25), key=lambda j: (-int(cand[j]), j))
            dropped = set(order[: n - 100])
            expected = [j for j in range(n) if j not in dropped]
            assert pos[h].tolist() == expected
        # the survivors carry their records into decoding (the first decode compression reuses this window)
        assert torch.equal(comp.scores[layer].long(), torch.gather(rec[layer], -1, pos))


@pytest.mark.parametrize("block_rows", [None, 7], ids=["one-block", "7-query-rows-per-block"])
def test_records_counted_during_the_prefill_equal_the_reference(lm, long_text, monkeypatch, block_rows):
    """The engine's prefill attends the last w queries itself and counts the records as it goes: the
    same records as the reference, and the same prefill (up to float rounding) as plain SDPA."""
    ids = lm.encode(long_text[:3000])
    n = len(ids)
    if block_rows:
        monkeypatch.setattr("kvlab.engine.attention.PrefillCapture.BLOCK_BYTES", block_rows * lm.info.n_heads * n * 4)
    comp = get("scissorhands")(lm.info, None, {"B": 100})
    budget_search.planned(comp, n)
    state, logits, _ = prefill_for(lm, ids, [comp])
    assert comp.counted is not None and comp.counted.complete(n)
    plain, plain_logits = prefill(lm, ids, PrefillNeeds(query_window=50))
    torch.testing.assert_close(logits, plain_logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(state.keys, plain.keys, rtol=0, atol=1e-4)
    rec = _reference_records(plain, 50, plain.scaling, 3)
    rank, kept = comp.initial_scores(state)
    assert torch.equal(rank.long(), rec) and kept is rank  # carry window == w here
    assert comp.counted is None  # used once; a later compress recomputes unless a prefill counted again


def _synthetic(n=64, heavy=(3, 17, 30), seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(SYN.n_layers, SYN.n_kv_heads, 1, SYN.head_dim, generator=g), dim=-1)
    keys = 0.3 * torch.randn(SYN.n_layers, SYN.n_kv_heads, n, SYN.head_dim, generator=g)
    keys[:, :, list(heavy)] = 6.0 * u
    values = torch.randn(SYN.n_layers, SYN.n_kv_heads, n, SYN.head_dim, generator=g)
    return g, u, keys, values


def _aligned_queries(g, u, t):
    """Queries [L, Hq, t, d] pointing along their KV group's direction u, plus noise."""
    q = 6.0 * u.repeat_interleave(SYN.n_heads // SYN.n_kv_heads, dim=1).expand(-1, -1, t, -1)
    return q + 0.3 * torch.randn(q.shape, generator=g)


def test_persistently_attended_tokens_survive():
    heavy = (3, 17, 30)
    g, u, keys, values = _synthetic(heavy=heavy)
    n = keys.shape[2]
    comp = get("scissorhands")(SYN, None, {"B": 24})
    knobs = budget_search.planned(comp, n)
    state = PrefillState(keys, values, _aligned_queries(g, u, comp.prefill_needs(n).query_window), SYN.head_dim**-0.5)
    comp.compress(state)
    for step in range(60):
        pos = n + step
        for layer in range(SYN.n_layers):
            k = 0.3 * torch.randn(SYN.n_kv_heads, 1, SYN.head_dim, generator=g)
            comp.append(layer, k, torch.randn(k.shape, generator=g), pos)
            comp.attend(layer, _aligned_queries(g, u[layer : layer + 1], 1)[0])
            kept = comp.kept_positions(layer)
            assert kept.shape[-1] <= knobs["B"]
            assert torch.isin(torch.tensor(heavy), kept).all(), f"step {step}: a heavy hitter was dropped"
    # the cache did turn over: old ordinary prompt tokens are gone
    assert comp.kept_positions(0).min(-1).values.tolist() == [3, 3]
    assert (comp.kept_positions(0) < n).sum() == 2 * len(heavy)


def test_full_budget_keeps_everything(prefill_state, lm):
    comp = get("scissorhands")(lm.info, Budget.parse("1.0"))
    budget_search.planned(comp, prefill_state.n_tokens)
    assert comp.prefill_needs(prefill_state.n_tokens) == PrefillNeeds()  # no eviction: nothing to capture
    comp.compress(prefill_state)
    assert comp.nbytes() == exact_bytes(lm.info, prefill_state.n_tokens)
    assert "scores" not in comp.nbytes_by_kind()


def test_low_attention_threshold_uses_position():
    """Algorithm 2: a decode query at position p counts a token as unimportant below 1/t, t = p + 1
    (the number of tokens the full sequence holds), not 1 / (the compressed cache's size)."""
    comps = {
        form: get("scissorhands")(SYN, Budget(tokens=8), {"threshold": form} if form else {})
        for form in (None, "position", "cache")
    }
    for c in comps.values():
        budget_search.planned(c, 8)
        c.scores = [torch.zeros(SYN.n_kv_heads, 8, dtype=torch.int16) for _ in range(SYN.n_layers)]
        c.position = 99  # the 100th token's query: threshold 1/100, while the cache holds 8 tokens
    attn = torch.full((SYN.n_kv_heads, 8), 0.05)  # above 1/100, below 1/8
    for form, c in comps.items():
        c.observe(0, attn)
        low = int(c.scores[0].sum())
        assert low == (16 if form == "cache" else 0), form
    assert comps[None].cfg["threshold"] == "position"
    assert comps["position"].threshold(8) == pytest.approx(1 / 100)
    assert comps["cache"].threshold(8) == pytest.approx(1 / 8)
