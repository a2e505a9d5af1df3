"""Comparisons at equal memory: a budget that a fixed configuration's peak fits, and the bytes runs really held.

A method's plan predicts its bytes over the run; ``peak_fraction`` turns a configuration with every knob
fixed (a paper's operating point) into the budget fraction its peak uses, so that other methods can be
planned to the same cap (their planners fill the budget at their worst point; ``fill_kivi`` picks
KIVI's residual that fills it best). What a reproduction
reports is then measured from the runs: ``memory`` gives each run's peak and mean bytes and bits per
number, ``spread`` how far apart the peaks are (matched when within ``MATCH_TOLERANCE``).
"""

from __future__ import annotations

import math

from kvlab.core.budgets import Budget, exact_bytes
from kvlab.methods.budget_search import planned
from kvlab.methods.handover import PrefillState
from kvlab.methods.kivi import kivi_worst_ratio
from kvlab.methods.registry import get

MATCH_TOLERANCE = 0.05  # peaks within 5% of each other count as the same bytes


def peak_fraction(info, method: str, params: dict, n_prompt: int, steps: int) -> float:
    """The budget fraction that the peak of ``method`` with ``params`` (every knob that the budget would
    choose given) uses on an ``n_prompt``-token prompt decoded for ``steps`` steps, from its plan; rounded
    up to 4 decimals."""

    cap = 0.99  # a budget below 1, so that the method compresses; its knobs are all given
    comp = get(method)(info, Budget(fraction=cap), params)
    comp.decode_steps = steps
    planned(comp, n_prompt)
    ratio = comp.budget_ratio(n_prompt)
    if ratio is None:
        raise ValueError(f"{method} does not predict its bytes; its peak cannot be matched")
    return min(1.0, math.ceil(cap * ratio * 1e4) / 1e4)


def fill_kivi(info, budget, n_prompt: int, steps: int, bits: int, group: int) -> int | None:
    """The residual with which KIVI at ``bits`` comes closest to ``budget`` at its peak without passing it
    (None: nothing fits). A scan, not the planner's bisection: moving the residual by one token can move a
    whole group of ``group`` tokens between the codes and full precision, so the peak is not monotone in it."""

    best, best_ratio = None, 0.0
    for r in range(n_prompt + 1):
        ratio = kivi_worst_ratio(info, budget, n_prompt, bits, group, r, steps)
        if best_ratio < ratio <= 1.0:
            best, best_ratio = r, ratio
    return best


def memory(run, info) -> dict:
    """A run's peak and mean bytes, as KiB and as bits per number (the exact cache's bits x the fraction of
    the exact cache's bytes over the same points: peak / exact peak, mean / exact mean)."""
    m = run.memory
    bits = 8 * info.dtype_bytes
    return {
        "peak_kib": m["peak_bytes"] / 1024,
        "mean_kib": m["mean_bytes"] / 1024,
        "peak_bits": bits * (m["peak_fraction"] or 0.0),
        "mean_bits": bits * (m["mean_fraction"] or 0.0),
        "peak_bytes": m["peak_bytes"],
    }


def run_record(run, spec, info) -> dict:
    """What a reproduction stores of one run: whether it ran (its refusal if not), its budget, settings and
    text, its bytes (``memory``) and its mean KL and attention error (None where it did not run)."""
    ran = not run.error
    return {
        "ran": ran,
        "error": run.error,
        "budget": spec.budget.label if spec.budget is not None else None,
        "params": run.params,
        "text": run.text,
        **(memory(run, info) if ran else {}),
        "kl_mean": run.metrics.get("kl_mean") if ran else None,
        "attn_rel_error_mean": run.metrics.get("attn_rel_error_mean") if ran else None,
    }


def spread(peaks: list[float]) -> float:
    """How far apart the peaks are: max / min - 1 (0 when they are equal)."""
    peaks = [p for p in peaks if p > 0]
    return max(peaks) / min(peaks) - 1 if peaks else math.inf


def simulate_bytes(info, method: str, budget, params: dict, n_prompt: int, steps: int, seed: int = 0) -> list[int]:
    """The bytes ``method`` holds after compressing an ``n_prompt``-token prompt and after each of ``steps``
    decode steps, from its own tensors (``nbytes``), on random keys and values: the bytes depend on the
    shapes and the knobs, not on the numbers. A plan predicts the worst case (QJL counts its window full,
    though it flushes in groups and often holds less); this is what a run will hold."""
    import torch

    comp = get(method)(info, budget, params, seed=seed)
    comp.decode_steps = steps
    planned(comp, n_prompt)
    gen = torch.Generator().manual_seed(seed)
    shape = (info.n_layers, info.n_kv_heads, n_prompt, info.head_dim)
    keys, values = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    queries = torch.randn(info.n_layers, info.n_heads, 1, info.head_dim, generator=gen)
    with torch.inference_mode():
        comp.compress(PrefillState(keys, values, queries, info.head_dim**-0.5))
        held = [comp.nbytes()]
        for j in range(steps):
            k = torch.randn(info.n_kv_heads, 1, info.head_dim, generator=gen)
            for layer in range(info.n_layers):
                comp.append(layer, k, k, n_prompt + j)
            held.append(comp.nbytes())
    return held


def held_fraction(info, held: list[int], n_prompt: int) -> float:
    """The largest share of the exact cache that ``held`` (bytes after prefill and each step) reaches,
    rounded up to 4 decimals: the budget fraction a run holding those bytes needs."""

    worst = max(h / exact_bytes(info, n_prompt + j) for j, h in enumerate(held))
    return min(1.0, math.ceil(worst * 1e4) / 1e4)


def eviction_tokens(comp, n_prompt: int, steps: int) -> list[float]:
    """The tokens a planned eviction cache of the ``Scissorhands`` kind holds, mean over layers, after the
    prefill and after each of ``steps`` tokens: each layer grows by one token a step and drops
    ``decode_drop(n)`` tokens when it passes its capacity (``prefill_drop`` at prefill; Algorithm 1 over the
    prompt, a token at a time, where the method runs it so). Counts, from the method's own schedule: what a
    budget is chosen by; the bytes reported are measured from the run's tensors."""
    out = [0.0] * (steps + 1)
    token_prompt = bool(getattr(comp, "token_prompt", False))
    for layer in range(comp.info.n_layers):
        if token_prompt:  # the cache grows from empty over the prompt
            n = 0
            for _ in range(n_prompt):
                n += 1
                n -= comp.decode_drop(n, layer)
        else:
            n = n_prompt - comp.prefill_drop(n_prompt, layer)
        out[0] += n
        for j in range(1, steps + 1):
            n += 1
            n -= comp.decode_drop(n, layer)
            out[j] += n
    return [x / comp.info.n_layers for x in out]


def mean_matched_tokens(info, method: str, params: dict, n_prompt: int, steps: int, target: float) -> int:
    """The largest token budget B (per layer and KV head) at which ``method`` with ``params`` keeps on average
    at most ``target`` of the tokens the exact cache holds over the prefill and ``steps`` decode steps
    (``eviction_tokens``): B for a run matched to the full cache's *mean*, where ``Budget(tokens=B)`` caps the
    peak. A method that drops many tokens at once (Scissorhands: m = 0.5 B) holds well below its cap on
    average, so this B is larger than the peak-matched one."""

    def mean_share(b: int) -> float:
        comp = get(method)(info, Budget(tokens=b), params)
        comp.decode_steps = steps
        planned(comp, n_prompt)
        held = eviction_tokens(comp, n_prompt, steps)
        return sum(h / (n_prompt + j) for j, h in enumerate(held)) / len(held)

    lo, hi = 1, n_prompt
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if mean_share(mid) <= target else (lo, mid - 1)
    return lo
