"""Exact's measured accuracy per model, task and prompt length: which tasks a model can do.

A task tells compression methods apart only where the exact cache answers it; the page offers a
RULER task as a preset only where exact's mean score at the preset's length is at least ``ABLE``
on the loaded model. The numbers come from ``python -m bench.ruler_calibrate`` (every sample in
``bench/results/calibrate-<task>.json``; the table and its seeds in docs/tasks.md). A model that
is not listed has not been calibrated, and no RULER preset is offered for it.
"""

from __future__ import annotations

ABLE = 0.8

# model id (LoadedModel.info.id) -> task -> prompt length -> exact's mean score
CALIBRATED: dict[str, dict[str, dict[int, float]]] = {
    "SmolLM2-135M-Instruct (embedded Q4_1 GGUF)": {
        "niah_single_1": {1024: 0.8, 2048: 1.0, 4096: 1.0},  # 10 seeds per length
        "niah_single_2": {1024: 0.8, 2048: 0.3, 4096: 0.1},  # 10 seeds per length
        "niah_multikey_1": {1024: 0.6, 2048: 0.1, 4096: 0.0},  # 10 seeds per length
        "niah_multivalue": {1024: 0.675, 2048: 0.35, 4096: 0.225},  # 10 seeds per length
        "niah_multiquery": {1024: 0.225, 2048: 0.15, 4096: 0.025},  # 10 seeds per length
        "vt": {1024: 0.0, 2048: 0.0, 4096: 0.0},  # 10 seeds per length
        "cwe": {1024: 0.07, 2048: 0.09, 4096: 0.04},  # 10 seeds per length
        "fwe": {1024: 0.367, 2048: 0.367, 4096: 0.333},  # 10 seeds per length
    },
    "Gemma 3 270M (embedded Q4_K_M GGUF)": {
        "niah_single_1": {1024: 1.0, 2048: 1.0, 4096: 1.0, 8192: 0.714},  # 10 seeds per length to 4k, 7 at 8k
        "niah_single_2": {1024: 0.7, 2048: 0.9, 4096: 0.7, 8192: 0.571},  # 10 seeds per length to 4k, 7 at 8k
        "niah_multikey_1": {1024: 0.5, 2048: 0.3, 4096: 0.4, 8192: 0.429},  # 10 seeds per length to 4k, 7 at 8k
        "niah_multivalue": {1024: 0.5, 2048: 0.25, 4096: 0.35, 8192: 0.292},  # 10 seeds per length to 4k, 6 at 8k
        "niah_multiquery": {1024: 0.175, 2048: 0.225, 4096: 0.2, 8192: 0.208},  # 10 seeds per length to 4k, 6 at 8k
        "vt": {1024: 0.0, 2048: 0.0, 4096: 0.0, 8192: 0.0},  # 10 seeds per length to 4k, 5 at 8k
        "cwe": {1024: 0.51, 2048: 0.64, 4096: 0.27, 8192: 0.46},  # 10 seeds per length to 4k, 5 at 8k
        "fwe": {1024: 0.467, 2048: 0.433, 4096: 0.467, 8192: 0.333},  # 10 seeds per length to 4k, 4 at 8k
    },
}


def accuracy(model: str, task: str, length: int) -> float | None:
    """Exact's calibrated mean score, at the calibrated length nearest ``length``; None if never measured."""
    per = CALIBRATED.get(model, {}).get(task)
    if not per:
        return None
    return per[min(per, key=lambda n: abs(n - length))]


def able(model: str, task: str, length: int) -> bool:
    """Whether exact reaches ``ABLE`` on ``task`` at about ``length`` tokens on ``model``."""
    acc = accuracy(model, task, length)
    return acc is not None and acc >= ABLE


def able_tasks(model: str, length: int) -> list[str]:
    """The calibrated tasks exact can do on ``model`` at about ``length`` tokens."""
    return [t for t in CALIBRATED.get(model, {}) if able(model, t, length)]
