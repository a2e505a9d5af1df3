"""ClusterGen Table 2: line retrieval at equal budget, greedy k-center vs Sink (StreamingLLM) vs H2O.

kvlab's ``lines`` task (LongEval-style: many ``line <name>: REGISTER_CONTENT is <number>`` lines,
then a question about one of them; exact match on the first number of the answer) is run for
several seeds with the exact cache, ``subgen-kcenter`` (recent tokens plus k-center centres of the
rest, computed once on the prompt), ``streaming`` (the paper's "Sink": first tokens plus a recent
window) and ``h2o`` at the same memory budget. The paper's claim is only informative where exact
answers: the table says how often exact does, and checks the direction only if exact answers at
least ``EXACT_MIN`` of the questions. The embedded 135M model fails the paper's shape (hundreds of
lines) outright, so the prompt is calibrated down until exact answers (docs/reproductions.md gives
the calibration): only a record of one line passes (160 tokens with the instructions, question
and chat template); at 2-6 lines exact picks the wrong line in half or more of the questions. With
one line the test is whether a method at half the cache keeps that line among the instructions.

As built, the claim is **not testable here**: a one-line record always lies in the prompt's last
half, inside Sink's recent window at half the cache, while the paper's records lie anywhere in
5k-9k tokens; and k-center keeps a fixed half of its budget for recent tokens
(``subgen.py``'s ``recent_ratio=0.5``) where the paper tunes (l, k) and reports the best. The
verdict is computed (paired on the same questions) only for prompts whose record lies outside
Sink's window, which this shape does not produce; the accuracies are reported with their exact
binomial intervals as context.
"""

from __future__ import annotations

import re
import time

from kvlab.core.budgets import Budget
from kvlab.core.statistics import binomial_interval, paired_difference
from kvlab.engine.specs import RunSpec
from kvlab.reproduce.common import INCONCLUSIVE, NOT_TESTABLE, Claim, Report, Row, estimate_fields
from kvlab.reproduce.setup import ReproductionSetup
from kvlab.tasks import make_task, prompt_ids, score_result

NAME = "clustergen-lines"
TITLE = "ClusterGen Table 2: line retrieval at equal budget, k-center vs Sink vs H2O"

CLAIMS = (
    Claim("clustergen", "Table 2, n = 9k, exact", "Exact\t2.351\t0.98\t3.488\t1.0\t4.613\t0.68", "exact 0.68"),
    Claim(
        "clustergen",
        "Table 2, n = 9k, Sink",
        "Sink (Xiao et al., 2023)\t1.511 $(35\\% \\downarrow)$\t0.56\t2.012 $(42\\% \\downarrow)$\t0.56\t"
        "2.262 $(50\\% \\downarrow)$\t0.38",
        "Sink 0.38",
    ),
    Claim(
        "clustergen",
        "Table 2, n = 9k, H2O",
        "$H2O$ (Zhang et al., 2023)\t1.511 $(35\\% \\downarrow)$\t0.66\t2.012 $(42\\% \\downarrow)$\t0.58\t"
        "2.262 $(50\\% \\downarrow)$\t0.38",
        "H2O 0.38",
    ),
    Claim(
        "clustergen",
        "Sec. 4.1",
        "we achieve an accuracy of 44% while utilizing only half of the cached KV embeddings",
        "ClusterGen 0.44 at half the cache",
    ),
)
PAPER = {"exact": "0.68", "subgen-kcenter": "0.44", "streaming": "0.38", "h2o": "0.38"}
LABELS = {"exact": "exact", "subgen-kcenter": "k-center (ClusterGen)", "streaming": "Sink (StreamingLLM)", "h2o": "H2O"}

FULL = {"length": 160, "seeds": 10, "budget": "0.5", "max_new_tokens": 12}
QUICK = {"length": 160, "seeds": 3, "budget": "0.5", "max_new_tokens": 12}
EXACT_MIN = 0.8  # the direction is checked only where exact answers this share of the questions


def run(ctx: ReproductionSetup) -> Report:

    t0 = time.perf_counter()
    cfg = ctx.settings(NAME, FULL, QUICK)
    budget = Budget.parse(cfg["budget"])
    methods = list(PAPER)
    scores: dict[str, list[float]] = {m: [] for m in methods}
    fractions: dict[str, list[float]] = {m: [] for m in methods}
    answers: list[dict] = []  # per seed: the answer, the prompt's tokens, each method's text
    for seed in range(cfg["seeds"]):
        task = make_task("lines", cfg["length"], seed, lambda t: ctx.loaded.encode(t))
        ids = prompt_ids(ctx.loaded, task)
        ctx.log(f"{NAME}: seed {seed}, {len(ids)} tokens")
        runs = [RunSpec("exact")] + [RunSpec(m, budget) for m in methods[1:]]
        result = ctx.compare(ids, runs, cfg["max_new_tokens"])
        score_result(task, result)
        at = _token_position(ctx.loaded.tokenizer, ids, str(task.answer))
        answers.append({"seed": seed, "answer": task.answer, "tokens": len(ids), "answer_at": at, "texts": {}})
        for m, r in zip(methods, result.runs):
            scores[m].append(float(r.metrics.get("task_score") or 0.0))
            fractions[m].append(r.kv_bytes_per_step[0] / r.exact_kv_bytes_per_step[0])
            answers[-1]["texts"][m] = r.text
    acc = {m: sum(v) / len(v) for m, v in scores.items()}
    same = {
        m: sum(_first_number(a["texts"][m]) == _first_number(a["texts"]["exact"]) for a in answers) for m in methods
    }
    frac = {m: sum(v) / len(v) for m, v in fractions.items()}
    seeds = cfg["seeds"]
    exact_ok = acc["exact"] >= EXACT_MIN
    cut = 1 - float(cfg["budget"])  # Sink's recent window at this budget: the prompt's last (1 - cut)
    outside = [i for i, a in enumerate(answers) if a["answer_at"] < a["tokens"] * cut]

    def est(m, idx=None):
        xs = [scores[m][i] for i in (range(seeds) if idx is None else idx)]
        return binomial_interval(int(sum(xs)), len(xs)) if set(xs) <= {0.0, 1.0} else None

    rows = [
        Row(
            f"{LABELS['exact']}",
            f"{PAPER['exact']} (n=9k)",
            f"{acc['exact']:.2f} ({round(acc['exact'] * seeds)}/{seeds})",
            note="the reference" + ("" if exact_ok else "; the model cannot do this task at this length"),
            **estimate_fields(est("exact")),
        )
    ]
    for m in methods[1:]:
        rows.append(
            Row(
                f"{LABELS[m]} at budget {cfg['budget']} (held {frac[m]:.2f} of exact)",
                f"{PAPER[m]} (n=9k, half the cache)",
                f"{acc[m]:.2f} ({round(acc[m] * seeds)}/{seeds}); same number as exact {same[m]}/{seeds}",
                **estimate_fields(est(m)),
            )
        )
    rows.append(
        Row(
            "where the record lies: in the prompt's last half (inside Sink's window at 0.5)",
            "(the paper: one line among hundreds, anywhere in 5k-9k tokens)",
            f"{seeds - len(outside)}/{seeds} prompts",
            note="exact retrieves one line among 2 in 7/10 prompts and among 4 in 3/6 here, so each record holds "
            "one line",
        )
    )
    rows.append(_claim_row(scores, outside, exact_ok, acc, seeds))
    setting = (
        f"lines task, ~{cfg['length']} tokens, {seeds} questions (seeds 0..{seeds - 1}), budget {cfg['budget']}, "
        f"{cfg['max_new_tokens']} greedy tokens; the paper: longchat-7B, 5k-9k tokens, 50 questions"
    )
    return Report(
        NAME,
        TITLE,
        ctx.command(NAME),
        setting,
        rows,
        {
            "settings": cfg,
            "accuracy": acc,
            "same_as_exact": same,
            "held_fraction": frac,
            "scores": scores,
            "answers": answers,
        },
        list(CLAIMS),
        _figure(acc, methods),
        time.perf_counter() - t0,
    )


def _claim_row(scores: dict, outside: list[int], exact_ok: bool, acc: dict, seeds: int) -> Row:
    """k-center > Sink and > H2O, paired on the questions whose record lies outside Sink's window."""
    setting, paper = "k-center > Sink and > H2O", "0.44 > 0.38, 0.38"
    measured = f"{acc['subgen-kcenter']:.2f} vs {acc['streaming']:.2f}, {acc['h2o']:.2f} (all {seeds} questions)"
    if not exact_ok:
        return Row(setting, paper, measured, verdict=NOT_TESTABLE, note="exact itself fails: not informative")
    if not outside:
        return Row(
            setting,
            paper,
            measured,
            verdict=NOT_TESTABLE,
            note="every record lies inside Sink's recent window (the only record length exact can retrieve on "
            "this model is one line), and k-center's recent share is fixed at half its budget where the "
            "paper tunes (l, k): this shape cannot test the claim on this model",
        )
    k = [scores["subgen-kcenter"][i] for i in outside]
    diffs = {
        m: paired_difference(k, [scores[m][i] for i in outside], names=("k-center", m)) for m in ("streaming", "h2o")
    }
    text = "; ".join(f"vs {m}: {d.difference.text()}" for m, d in diffs.items() if d is not None)
    verdicts = [d.verdict if d is not None else INCONCLUSIVE for d in diffs.values()]
    if all(v == "k-center higher" for v in verdicts):
        return Row(setting, paper, text, True, n=len(outside))
    if any(v != "k-center higher" and v != INCONCLUSIVE for v in verdicts):
        return Row(setting, paper, text, False, n=len(outside))
    return Row(setting, paper, text, verdict=INCONCLUSIVE, n=len(outside), note="a paired interval includes zero")


def _token_position(tokenizer, ids: list[int], answer: str) -> int:
    """The index of the token that completes the first occurrence of ``answer`` in the prompt."""
    lo, hi = 0, len(ids)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if answer in tokenizer.decode(ids[:mid]) else (mid, hi)
    return hi


def _first_number(text: str) -> str | None:
    nums = re.findall(r"\d+", text)
    return nums[0] if nums else None


def _figure(acc: dict, methods: list[str]):
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_bar(x=[LABELS[m] for m in methods], y=[acc[m] for m in methods], name="kvlab (embedded model)")
    fig.add_bar(x=[LABELS[m] for m in methods], y=[float(PAPER[m]) for m in methods], name="paper (n=9k)")
    fig.update_layout(height=380, title=TITLE, yaxis={"title": "accuracy", "range": [0, 1]}, barmode="group")
    return fig
