"""Keys and values at their own bit widths: the pairs a plan may take and the one a budget picks; KIVI and
TurboQuant hold the bytes of the pair they run."""

import pytest
from kv_samples import compressed, planned

from kvlab.core.budgets import exact_bytes
from kvlab.methods.bit_split import candidates, choose
from kvlab.methods.kivi import kivi_bytes
from kvlab.methods.params import ParamError


def test_candidates_follow_the_given_sides_and_the_split():
    w = (4, 3, 2)
    assert candidates(w, w, 3, None, None, "auto") == [(3, 3)]
    assert candidates(w, w, 3, 4, None, "auto") == [(4, 3)]  # bits for both, kbits for the keys
    assert candidates(w, w, None, 4, None, "equal") == [(4, 4), (4, 3), (4, 2)]  # one side given: the other free
    assert candidates(w, w, None, None, None, "equal") == [(4, 4), (3, 3), (2, 2)]
    assert all(k >= v for k, v in candidates(w, w, None, None, None, "keys"))
    assert all(k <= v for k, v in candidates(w, w, None, None, None, "values"))
    assert len(candidates(w, w, None, None, None, "auto")) == 9
    with pytest.raises(ParamError, match="split"):
        candidates(w, w, None, None, None, "sideways")


def test_choose_fills_the_budget_then_prefers_equal_then_keys():
    pairs = candidates((4, 3, 2), (4, 3, 2), None, None, None, "auto")
    size = lambda p: p[0] + p[1]  # noqa: E731
    assert choose(pairs, lambda p: size(p) <= 6, size) == ((3, 3), True)  # 4/2, 3/3, 2/4 tie: the equal split
    assert choose(pairs, lambda p: size(p) <= 7, size) == ((4, 3), True)  # 4/3 and 3/4 tie: the keys
    assert choose(pairs, lambda p: False, size) == ((2, 2), False)  # nothing fits: the smallest


def test_kivi_runs_its_pair_and_the_budget_picks_one(lm, prefill_state):
    n, info = prefill_state.n_tokens, lm.info
    comp, knobs = compressed(lm, prefill_state, "kivi", "0.5", kbits=4, vbits=2, residual=0)
    assert (knobs["kbits"], knobs["vbits"]) == (4, 2)
    assert comp.nbytes() == kivi_bytes(info, n, (4, 2), 32, 0) == kivi_bytes(info, n, (3, 3), 32, 0)
    assert comp.layers[3].kq.bits == 4 and comp.layers[3].vq.bits == 2
    _, equal = planned(lm, "kivi", "0.33", n)  # the papers' equal split by default
    _, auto = planned(lm, "kivi", "0.33", n, split="auto")
    assert equal["kbits"] == equal["vbits"] and auto["kbits"] > auto["vbits"]
    assert kivi_bytes(info, n, auto["bits"], 32, 0) > kivi_bytes(info, n, equal["bits"], 32, 0)


def test_turboquant_runs_its_pair(lm, prefill_state):
    n, info = prefill_state.n_tokens, lm.info
    comp, knobs = compressed(lm, prefill_state, "turboquant", "0.5", kbits=4, vbits=2, keys="mse", residual=0)
    assert (knobs["kbits"], knobs["vbits"]) == (4.0, 2.0)
    assert {m: i.bits for m, i in comp.instances.items()} == {"key": 4, "value": 2}
    per_token = (32 + 2) + (16 + 2)  # 4-bit and 2-bit codes of 64 numbers, a float16 norm each
    assert comp.nbytes() == info.n_layers * info.n_kv_heads * n * per_token
    assert comp.nbytes() / exact_bytes(info, n) == pytest.approx(52 / 256)
