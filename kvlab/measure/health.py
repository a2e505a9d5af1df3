"""Health flags: signs that a run's result cannot be trusted, on its card and in its JSON.

``HealthProbe`` is an engine probe (cheap, always on); after the run each ``RunResult.health``
lists the flags raised, each ``{"flag": name, "detail": one line}``:

* ``over_budget`` — the bytes held exceed the budget's share of the exact cache by more than
  ``TOLERANCE`` after prefill, after a question fed after compression (query-agnostic) or at any
  decode step (a token budget counts as its share of the tokens seen at that step);
* ``non_finite_logits`` — NaN or inf in the run's logits at some step;
* ``not_compressed`` — at a budget <= 0.5, the run's tokens *and* logits equal the exact run's
  at every step: the sign of a cache that silently did not compress (not raised when no query after
  the prompt sees a prompt token on any layer: chunked layers whose block ends with the prompt);
* ``evicted_nothing`` — at a budget < 1, a method kept every prompt position in every layer and
  head at full size (a composition that keeps every token quantized is not flagged).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.core.budgets import TOLERANCE, Budget
from kvlab.engine.probe import Probe


def _flag(name: str, detail: str) -> dict:
    return {"flag": name, "detail": detail}


class HealthProbe(Probe):
    """Engine probe: watches every step's logits, then checks bytes and eviction per run.

    ``forkable``: stateless until ``on_prefill`` and only ``on_prefill`` / ``on_chunk`` / ``on_step`` /
    ``finish`` hooks, so a copy can follow each question when several decode as one batch."""

    forkable = True
    sees_chunks = True

    def on_prefill(self, state, logits: Tensor, compressors) -> None:
        self.comps = compressors
        self.n = state.n_tokens
        self.exact = next((i for i, c in enumerate(compressors) if c.name == "exact"), None)
        finite = bool(torch.isfinite(logits).all())
        self.non_finite: dict[int, int] = {} if finite else dict.fromkeys(range(len(compressors)), 0)
        self.same_logits = [True] * len(compressors)  # the first token's logits are shared by all
        # whether a query after the prompt sees a prompt token on some layer (a chunked layer whose block ends
        # with the prompt does not): if none does, what compression kept cannot show in the logits
        self.prompt_seen = any(s.visible_from(self.n) < self.n for s in state.semantics.layers)
        self.evicted_nothing = [self._kept_everything(c) for c in compressors]
        self.question_tokens = 0

    def on_chunk(self, layer: int, rows: list[int], pos: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
        self.question_tokens = k.shape[-2]  # a question fed after compression: bytes entry 1 follows it

    def on_step(self, step: int, rows: list[int], logits: Tensor) -> None:
        bad = (~torch.isfinite(logits)).any(-1).tolist()
        for r, i in enumerate(rows):
            if bad[r]:
                self.non_finite.setdefault(i, step)
        if self.exact in rows:
            ref = logits[rows.index(self.exact)]
            for r, i in enumerate(rows):
                if i != self.exact and self.same_logits[i]:
                    self.same_logits[i] = bool(torch.equal(logits[r], ref))
        else:  # the exact run ended: runs still going can no longer be compared step by step
            for i in rows:
                self.same_logits[i] = False

    def finish(self, runs) -> None:
        exact = runs[self.exact] if self.exact is not None else None
        for i, r in enumerate(runs):
            flags = bytes_flags(r, self.n, self.comps[i].streaming, self.question_tokens)
            r.budget_use = budget_use(r, self.n, self.comps[i].streaming, self.question_tokens)
            if i in self.non_finite:
                flags.append(
                    _flag("non_finite_logits", f"NaN or inf in the logits at decode step {self.non_finite[i]}")
                )
            budget = _budget(r)
            small = budget is not None and budget.fraction_of(self.n) <= 0.5
            if small and exact is not None and i != self.exact and self.same_logits[i] and self.prompt_seen:
                if r.token_ids == exact.token_ids:
                    flags.append(
                        _flag(
                            "not_compressed", "tokens and logits equal the exact run's at every step at budget <= 0.5"
                        )
                    )
            full_size = r.kv_bytes >= (1 - TOLERANCE) * (r.exact_kv_bytes_per_step or [0])[0]
            if budget is not None and budget.fraction_of(self.n) < 1 and self.evicted_nothing[i] and full_size:
                flags.append(_flag("evicted_nothing", "every prompt position is still in the cache of every layer"))
            r.health = flags

    def _kept_everything(self, comp) -> bool:
        n_layers = comp.info.n_layers
        for layer in range(n_layers):
            try:
                pos = comp.kept_positions(layer)
            except (IndexError, AttributeError):
                return False
            if pos is None:
                return False
            prompt = pos[pos < self.n] if pos.numel() else pos
            if prompt.numel() < self.n * pos.shape[0]:
                return False
        return True


def _budget(run) -> Budget | None:
    return None if run.budget is None else Budget.parse(run.budget)


def budget_limits(run, n_prompt: int, streaming: bool, question_tokens: int = 0) -> list[float]:
    """The bytes the run's budget allows at each entry of ``run.kv_bytes_per_step`` ([] without a budget).

    A streaming method holds its budget's share of every token seen; a prefill-only method holds
    its share of the prompt plus its generated tokens in full (docs/design.md, budgets).
    ``question_tokens`` > 0 (query-agnostic): entry 1 of the bytes is after that many question
    tokens fed after compression (held like generated ones), entry k >= 2 after decode step k - 1.
    """
    budget = _budget(run)
    if budget is None:
        return []
    limits = []
    prompt_exact = run.exact_kv_bytes_per_step[0] if run.exact_kv_bytes_per_step else 0
    for k, exact in enumerate(run.exact_kv_bytes_per_step):
        if streaming:
            seen = n_prompt + k if not question_tokens or k == 0 else n_prompt + question_tokens + k - 1
            limits.append(budget.fraction_of(seen) * exact)
        else:
            limits.append(budget.fraction_of(n_prompt) * prompt_exact + (exact - prompt_exact))
    return limits


def budget_use(run, n_prompt: int, streaming: bool, question_tokens: int = 0) -> float | None:
    """Mean over the run (after prefill and every step) of the bytes held / the bytes the budget allows
    then: near 1 for a method that fills its budget, well below for one that holds much less for most
    of the run (Scissorhands after its first eviction). None without a budget."""
    pairs = [
        (h, a) for h, a in zip(run.kv_bytes_per_step, budget_limits(run, n_prompt, streaming, question_tokens)) if a > 0
    ]
    return round(sum(h / a for h, a in pairs) / len(pairs), 4) if pairs else None


def budget_overrun(run, n_prompt: int, streaming: bool, question_tokens: int = 0) -> tuple[float, str] | None:
    """(factor, reason) when the run's peak passes its budget's share of the exact cache's peak by more than
    ``TOLERANCE`` (factor: peak / (share x exact peak)); None otherwise, or without a budget. The reason: a
    prefill-only method keeps its generated tokens (and a question fed after compression) whole; a
    quantizer's smallest configuration is above the budget; else it held more than its budget allows."""
    budget = _budget(run)
    held, exact = run.kv_bytes_per_step, run.exact_kv_bytes_per_step
    if budget is None or not held or not exact or budget.fraction_of(n_prompt) >= 1:
        return None
    factor = max(held) / (budget.fraction_of(n_prompt) * max(exact))
    if factor <= 1 + TOLERANCE:
        return None
    if run.params.get("fits_budget") is False:
        reason = "its smallest configuration is above the budget"
    elif not streaming:
        reason = "question and generated tokens kept whole" if question_tokens else "generated tokens kept whole"
    else:
        reason = "held more than its budget allows"
    return factor, reason


def bytes_flags(run, n_prompt: int, streaming: bool, question_tokens: int = 0) -> list[dict]:
    """``over_budget`` when the bytes held exceed what the budget allows (``budget_limits``) by more than
    ``TOLERANCE``: the budget caps the peak."""
    worst = None
    for k, (held, limit) in enumerate(
        zip(run.kv_bytes_per_step, budget_limits(run, n_prompt, streaming, question_tokens))
    ):
        if limit > 0 and held > (1 + TOLERANCE) * limit and (worst is None or held / limit > worst[1]):
            worst = (k, held / limit)
    if worst is None:
        return []
    k, ratio = worst
    where = "after prefill" if k == 0 else f"at decode step {k}"
    if question_tokens and k > 0:
        where = "after the question" if k == 1 else f"at decode step {k - 1}"
    return [_flag("over_budget", f"holds {ratio:.2f}x the bytes its budget allows {where}")]
