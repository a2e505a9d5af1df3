"""``METHOD@paper`` / ``subgen@theorem``: each paper's operating point by name, its settings cited, and
the options it needs (Scissorhands' per-layer budgets and token-by-token prompt, SubGen with no cap)."""

import pytest
import torch

from kvlab import cli
from kvlab.core.budgets import Budget
from kvlab.engine.prefill import prefill
from kvlab.methods import UnknownMethodError, budget_search, get
from kvlab.methods.handover import PrefillNeeds
from kvlab.methods.paper_presets import PRESETS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_resolves_with_its_settings_as_defaults(name, lm):
    preset = PRESETS[name]
    cls = get(name)
    assert cls.name == name and cls.preset is preset and issubclass(cls, get(preset.method))
    comp = cls(lm.info, Budget(fraction=0.5))
    for s in preset.settings:
        assert s.where and (
            "Sec." in s.where or "Algorithm" in s.where or "Theorem" in s.where or "reference" in s.where
        )
        want = {"2d": 2 * lm.info.head_dim, "d/16": lm.info.head_dim // 16}.get(s.value, s.value)
        assert comp.cfg[s.param] == want, s
    assert get(preset.method).defaults() != cls.defaults()  # a preset changes something


def test_unknown_preset_is_refused_with_the_allowed_names():
    with pytest.raises(UnknownMethodError, match="allowed"):
        get("h2o@paper")


def test_methods_lists_the_presets(capsys):
    assert cli.main(["methods"]) == 0
    out = capsys.readouterr().out
    for name, preset in PRESETS.items():
        assert f"{name} " in out and preset.settings[0].where in out


def test_scissorhands_paper_gives_later_layers_more_budget(lm):
    comp = get("scissorhands@paper")(lm.info, Budget(tokens=100))
    knobs = budget_search.planned(comp, 400)
    caps = knobs["layer_B"]
    assert len(caps) == lm.info.n_layers and sum(caps) == 100 * lm.info.n_layers
    assert caps == sorted(caps) and caps[-1] >= 2.5 * caps[0]  # ramp 0.5: 50 .. 150
    assert comp.planned_tokens(400) == pytest.approx(100)


def test_scissorhands_token_prompt_runs_algorithm_1_over_the_prompt(lm, long_text):
    """prompt=token: each layer ends between B - m + 1 and B tokens (the cache was compressed whenever
    it passed B), keeps the last r prompt tokens, and chooses differently from the one-shot ranking."""
    ids = lm.encode(long_text[:1500])
    n = len(ids)
    state, _ = prefill(lm, ids, PrefillNeeds(query_window=n))
    b = n // 3
    token = get("scissorhands")(lm.info, Budget(tokens=b), {"prompt": "token"})
    budget_search.planned(token, n)
    assert token.prefill_needs(n).query_window == n
    token.compress(state)
    window = get("scissorhands")(lm.info, Budget(tokens=b))
    budget_search.planned(window, n)
    window.compress(state)
    r, m = token.recent, token.m
    differ = 0
    for layer in range(lm.info.n_layers):
        pos = token.kept_positions(layer)
        assert b - m < pos.shape[-1] <= b
        assert set(range(n - r, n)) <= set(pos[0].tolist())
        assert token.scores[layer].shape == pos.shape
        differ += pos.shape != window.kept_positions(layer).shape or not torch.equal(pos, window.kept_positions(layer))
    assert differ > 0


def test_subgen_with_no_cap_opens_clusters_as_the_keys_need(prefill_state, lm):
    """max_clusters=none (Theorem 1's regime): the prompt opens as many clusters as delta needs (more
    than the budget's cap), decoding far keys opens more (the tensors grow), and nothing joins a far
    cluster."""
    alone = {"delta": 8.0, "sink": 0, "recent_share": 0.0}  # Algorithm 1 alone: appended keys enter the stream
    capped = get("subgen")(lm.info, Budget(fraction=0.25), alone)
    budget_search.planned(capped, prefill_state.n_tokens)
    capped.compress(prefill_state)
    free = get("subgen")(lm.info, Budget(fraction=0.25), {**alone, "max_clusters": "none"})
    budget_search.planned(free, prefill_state.n_tokens)
    assert free.budget_ratio(prefill_state.n_tokens) is None  # bytes follow the keys: measured, not planned
    free.compress(prefill_state)
    st = free.state
    assert int(st.count.max()) > capped.state.m_cap and int(st.cap_joins.sum()) == 0
    before, room = st.count.clone(), st.m_cap
    d, h = lm.info.head_dim, lm.info.n_kv_heads
    for i in range(room + 4):  # keys far from every centre and from each other
        k = torch.zeros(h, 1, d)
        k[:, 0, i % d] = 1000.0 * (1 + i // d)
        free.append(0, k, torch.randn(h, 1, d), prefill_state.n_tokens + i)
    assert int(st.count[0].min()) >= int(before[0].max()) and st.m_cap > room
    assert int(st.cap_joins.sum()) == 0
