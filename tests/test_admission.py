"""Admission control: duplicate budgets merge, limits refuse with numbers, the plan bounds the real caches."""

from __future__ import annotations

import time

import pytest

from kvlab.core.budgets import Budget, parse_budgets
from kvlab.engine.admission import AdmissionError, AdmissionLimits, admit, estimate, unique_budgets


def test_duplicate_budgets_merge():
    budgets = parse_budgets(",".join(["0.5"] * 200 + ["0.50", "0.25", "64t", "64t"]))
    assert unique_budgets(budgets) == [Budget(fraction=0.5), Budget(fraction=0.25), Budget(tokens=64)]


def test_limits_refuse_in_one_line_with_the_numbers(lm):
    info = lm.info
    many = estimate(info, 100, [Budget(fraction=0.5)] * 30, 16)
    with pytest.raises(AdmissionError, match=r"30 runs requested.*allows 24"):
        admit(many, AdmissionLimits(), "cpu")
    long = estimate(info, 4000, [None] + [Budget(fraction=0.25)] * 20, 16)
    with pytest.raises(AdmissionError, match=r"4000 prompt tokens x 21 runs = 84000.*allows 65536"):
        admit(long, AdmissionLimits(), "cpu")
    t0 = time.perf_counter()
    with pytest.raises(AdmissionError) as err:
        admit(
            estimate(info, 2000, [None, Budget(fraction=0.5)], 32, probes=True),
            AdmissionLimits(max_request_bytes=10 * 1024**2),
            "cpu",
        )
    assert time.perf_counter() - t0 < 1.0
    msg = str(err.value)
    assert "\n" not in msg and "2 runs on 2000 prompt tokens" in msg and "10 MiB" in msg
    admit(estimate(info, 2000, [None, Budget(fraction=0.5)], 32), AdmissionLimits(), "cpu")  # fits


def test_estimate_grows_with_the_request(lm):
    info = lm.info
    base = estimate(info, 1000, [None, Budget(fraction=0.25)], 32)
    assert estimate(info, 2000, [None, Budget(fraction=0.25)], 32).peak_bytes > base.peak_bytes
    assert estimate(info, 1000, [None, Budget(fraction=0.25)] * 3, 32).peak_bytes > base.peak_bytes
    assert estimate(info, 1000, [None, Budget(fraction=0.25)], 32, probes=True).peak_bytes > base.peak_bytes


def test_planned_caches_bound_the_bytes_really_held(engine, lm, long_text):
    from kvlab.engine.specs import RunSpec

    ids = lm.encode(long_text[:1200])
    specs = [
        RunSpec("exact"),
        RunSpec("snapkv", Budget(fraction=0.25)),
        RunSpec("qjl", Budget(fraction=0.25)),
        RunSpec("balancekv", Budget(fraction=0.25)),
    ]
    from kvlab.engine.specs import GenerationSettings

    result = engine.compare(ids, specs, GenerationSettings(max_new_tokens=6))
    est = estimate(lm.info, len(ids), [s.budget for s in specs], 6)
    held = sum(max(r.kv_bytes_per_step) for r in result.runs)
    assert held <= est.parts["run_caches"]
