"""torch's CPU threads, fitted to the cores that other processes leave free.

A comparison is thousands of small torch operations per step (each layer's attention through each
compressed cache) as well as the model's large matrix products. Each parallel operation ends at a
barrier where every thread of torch's OpenMP team waits for the others. On a machine that other
work shares, one of those threads is often waiting for a core: with the OpenMP default the waiting
threads spin (and take the core from the thread they wait for), and every small operation costs
a scheduler time slice. Measured on the 2-core machine beside one other CPU-heavy process, a
comparison slowed 17x where transformers' own forward (fewer, larger operations) slowed 2.5x.

Two things keep the thread use robust (bench/README.md, "Under load", has the numbers):

* ``configure_openmp``: waiting threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``),
  set before torch loads its OpenMP runtime (``kvlab/__init__.py``) unless the environment says
  otherwise;
* ``Governor``: before a comparison and every ``interval_s`` while it runs, the busy time of the
  machine's other processes is read from ``/proc/stat`` (all CPU time, minus this process's own)
  and torch gets the cores left free, rounded, at least one and at most the cores this process
  may use. ``KVLAB_THREADS`` pins the count instead (results are bit-for-bit repeatable for a
  fixed count: some methods' float sums depend on how the work is split).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

ENV = "KVLAB_THREADS"
PROC_STAT = Path("/proc/stat")


def configure_openmp() -> None:
    """Let torch's idle OpenMP threads sleep rather than spin (only before torch is imported, and only
    where the environment sets no policy of its own)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def pinned() -> int | None:
    """The thread count ``KVLAB_THREADS`` pins (None: not set, fitted to the load)."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    try:
        return max(1, int(value))
    except ValueError:
        raise ValueError(f"{ENV}={value!r} is not a thread count; use a whole number such as 1 or 2") from None


@dataclass
class Sample:
    """CPU seconds the whole machine spent busy and this process used, at a wall-clock time."""

    wall: float
    machine_busy: float
    own: float

    @classmethod
    def now(cls) -> Sample | None:
        try:
            fields = PROC_STAT.read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        jiffies = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
        idle = jiffies[3] + jiffies[4]
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        return cls(time.perf_counter(), (sum(jiffies) - idle) / tick, time.process_time())

    def others_busy(self, earlier: Sample) -> float:
        """Cores kept busy by other processes between ``earlier`` and this sample."""
        wall = self.wall - earlier.wall
        if wall <= 0:
            return 0.0
        return max(0.0, (self.machine_busy - earlier.machine_busy) - (self.own - earlier.own)) / wall


@dataclass
class Governor:
    """Sets torch's thread count from the load other processes put on the machine.

    ``fit`` (before a comparison) samples for ``first_sample_s`` when it has no recent sample;
    ``tick`` (between steps) refits once ``interval_s`` has passed since the last sample, from the
    time in between, without waiting. Each ``active`` comparison of this process beyond the first
    counts as one more busy core (a page serving several visitors at once)."""

    interval_s: float = 2.0
    first_sample_s: float = 0.1
    cores: int = field(default_factory=usable_cores)
    active: int = 0
    last: Sample | None = None
    threads: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wanted(self, others: float) -> int:
        free = self.cores - others - max(0, self.active - 1)
        return max(1, min(self.cores, int(free + 0.5)))

    def fit(self) -> int:
        """Fit the thread count now (sampling briefly when the last sample is old); returns it."""
        fixed = pinned()
        if fixed is not None:
            return self._set(fixed)
        now = Sample.now()
        if now is None:
            return self._set(self.threads or self.cores)
        if self.last is None or now.wall - self.last.wall > 4 * self.interval_s:
            time.sleep(self.first_sample_s)
            self.last, now = now, Sample.now()
            assert now is not None
        return self._refit(now)

    def tick(self) -> None:
        """Between steps: refit once ``interval_s`` has passed since the last sample."""
        if self.last is None or pinned() is not None:
            return
        if time.perf_counter() - self.last.wall >= self.interval_s:
            now = Sample.now()
            if now is not None:
                self._refit(now)

    def _refit(self, now: Sample) -> int:
        assert self.last is not None
        others = now.others_busy(self.last)
        self.last = now
        return self._set(self.wanted(others))

    def _set(self, n: int) -> int:
        import torch

        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        self.threads = n
        return n

    @contextmanager
    def fitted(self):
        """Around one comparison: counts it as active and fits the threads at its start."""
        with self.lock:
            self.active += 1
            self.fit()
        try:
            yield self
        finally:
            with self.lock:
                self.active -= 1


GOVERNOR = Governor()  # one per process: torch's thread count is the process's


def governed(events: Iterator[T]) -> Iterator[T]:
    """``events`` (a comparison's progress) with the threads fitted at its start and refitted between events."""
    with GOVERNOR.fitted():
        for event in events:
            GOVERNOR.tick()
            yield event
