"""The thread governor: torch gets the cores other processes leave free, or the count KVLAB_THREADS pins."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvlab.core import threads
from kvlab.core.threads import Governor, Sample


def test_other_processes_busy_time_excludes_this_process():
    earlier = Sample(wall=10.0, machine_busy=100.0, own=5.0)
    later = Sample(wall=12.0, machine_busy=104.0, own=7.0)  # 4 s busy in 2 s, 2 s of it ours
    assert later.others_busy(earlier) == pytest.approx(1.0)
    assert Sample(12.0, 101.0, 7.0).others_busy(earlier) == 0.0  # never below zero


CASES = [(0.0, 1, 2), (0.3, 1, 2), (1.0, 1, 1), (1.9, 1, 1), (0.0, 2, 1)]


@pytest.mark.parametrize(("others", "active", "want"), CASES)
def test_threads_are_the_free_cores_rounded_at_least_one(others, active, want):
    gov = Governor(cores=2, active=active)
    assert gov.wanted(others) == want


def test_a_pinned_count_wins_and_a_bad_one_says_what_is_allowed(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("KVLAB_THREADS", "1")
        assert Governor(cores=2).fit() == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("KVLAB_THREADS", "two")
        with pytest.raises(ValueError, match="whole number"):
            Governor(cores=2).fit()
    finally:
        torch.set_num_threads(before)


def test_unpinned_the_count_follows_the_measured_load(monkeypatch):
    """With /proc/stat read for real, an unpinned fit picks 1 or 2 threads and the comparison's events
    pass through unchanged."""
    before = torch.get_num_threads()
    monkeypatch.delenv("KVLAB_THREADS", raising=False)
    gov = Governor(cores=2)
    monkeypatch.setattr(threads, "GOVERNOR", gov)
    try:
        assert list(threads.governed(iter([1, 2, 3]))) == [1, 2, 3]
        assert gov.threads in (1, 2) and gov.active == 0
    finally:
        torch.set_num_threads(before)


def test_kvlab_sets_a_passive_wait_policy_before_torch_loads():
    code = "import os, kvlab, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "PASSIVE"
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # the environment's own choice stays
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "ACTIVE"
