"""Measurements of a comparison: attention error, teacher-forced fidelity, text diffs, attention maps.

Definitions are docs/design.md §5; the JSON layout is docs/metrics.md. Two parts:

* ``MetricsProbe`` — an engine ``Probe`` for the costly measurements (``--probes``): a shadow full
  cache per run (shared exact prompt K/V + the run's own generated K/V) gives the exact attention
  for the run's own query at every layer and decode step; teacher-forced logits (the engine feeds
  forked copies of the compressors the exact run's tokens) give KL, top-1 agreement and perplexity;
  attention maps of one layer and head for the last few decode queries.
* ``add_text_metrics`` — cheap, always on: token-level diff of each run's free-running text against
  the exact run, first differing token, similarity.

The JSON layout of ``run.metrics`` and ``run.extras`` (``CompareResult.to_json()``) is documented in
docs/metrics.md. A value is ``null`` where it cannot be measured; floats are rounded to 4 significant
digits, and NaN or inf become null.
"""

from __future__ import annotations

import difflib
import math
import re
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.tensor_ops import group_queries, ungroup
from kvlab.core import semantics as sm
from kvlab.core.semantics import LayerSemantics, window_bias
from kvlab.engine.probe import Probe
from kvlab.methods.dense import DenseCompressor


def _round(x, digits: int = 4):
    """Round floats (or nested lists of them) to ``digits`` significant digits for compact JSON."""
    if isinstance(x, (list, tuple)):
        return [_round(v, digits) for v in x]
    x = float(x)
    if not math.isfinite(x):
        return None  # NaN / inf (a broken estimate) shows as null, never as a good-looking 0
    return 0.0 if x == 0 else float(f"{x:.{digits}g}")


# ----- free-running text ----------------------------------------------------------------------
@dataclass
class TokenDiff:
    """Token-level comparison of a run's tokens against the reference (exact) tokens."""

    opcodes: list[list]  # [tag, i1, i2, j1, j2]: reference[i1:i2] vs run[j1:j2]
    first_divergence: int | None  # first index where the lists differ (None: identical)
    similarity: float  # difflib ratio, 0..1


def token_diff(reference: list[int], tokens: list[int]) -> TokenDiff:
    sm = difflib.SequenceMatcher(a=reference, b=tokens, autojunk=False)
    ops = [list(op) for op in sm.get_opcodes()]
    first = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), None)
    if first is None and len(reference) != len(tokens):
        first = min(len(reference), len(tokens))
    return TokenDiff(ops, first, sm.ratio() if reference or tokens else 1.0)


def add_text_metrics(result) -> None:
    """Set first_divergence, text_similarity and diff on every run against the exact run (if any)."""
    exact = next((r for r in result.runs if r.method == "exact"), None)
    for r in result.runs:
        if exact is None:
            r.metrics.update(first_divergence=None, text_similarity=None, diff=None)
            continue
        d = token_diff(exact.token_ids, r.token_ids)
        r.metrics.update(first_divergence=d.first_divergence, text_similarity=_round(d.similarity), diff=d.opcodes)


# ----- attention ------------------------------------------------------------------------------
def relative_error(z: Tensor, a: Tensor) -> Tensor:
    """||z - a|| / ||a|| over the last dim, averaged over heads: z, a [..., Hq, t, d] -> [...]."""
    err = (z.float() - a.float()).norm(dim=-1) / a.float().norm(dim=-1).clamp_min(1e-12)
    return err.mean(dim=(-1, -2))


def shadow_attention(
    q: Tensor, kp: Tensor, vp: Tensor, kg: Tensor, vg: Tensor, scaling: LayerSemantics | float
) -> tuple[Tensor, Tensor]:
    """Exact attention over a shared prompt cache plus per-row generated tokens.

    q: [R, Hq, t, d]; kp, vp: [Hkv, n, d] (shared by every row); kg, vg: [R, Hkv, s, d]. The t
    queries are the last t of the s generated tokens (t = 1 at a decode step; t > 1 for a question
    fed after compression, causal inside it). Returns out [R, Hq, t, d] and probs [R, Hq, t, n + s].
    The prompt part is one batched matmul against the shared keys, so R rows cost about one pass
    over the prompt cache. ``scaling`` a ``LayerSemantics``: the layer's soft-cap, window and sinks
    (the prompt at positions 0..n-1, the generated tokens after).
    """
    hq, hkv, n = q.shape[-3], kp.shape[-3], kp.shape[-2]
    q = q.float()
    gen = sm.mask_future(sm.logits(q, kg.float(), scaling), q.shape[-2])
    logits = torch.cat([sm.logits(q, kp, scaling), gen], dim=-1)
    if isinstance(scaling, LayerSemantics) and scaling.is_local:
        m, t = logits.shape[-1], q.shape[-2]
        bias = window_bias(scaling, torch.arange(m - t, m, device=q.device), torch.arange(m, device=q.device))
        logits = logits if bias is None else logits + bias
    probs = sm.softmax(logits, scaling)
    gp = group_queries(probs, hkv)  # [R, Hkv, g, n + s]
    out = torch.matmul(gp[..., :n], vp.float()) + torch.matmul(gp[..., n:], vg.float())
    return ungroup(out, hq), probs


def method_weights(comp, layer: int, q: Tensor, head: int, n: int) -> Tensor | None:
    """The method's own weights (``Compressor.estimated_weights``) of query head ``head`` over the
    first n positions (the prompt): q [Hq, 1, d] -> [n] on the CPU, or None when it has none."""
    w = comp.estimated_weights(layer, q)
    if w is None:
        return None
    row = w[head, :n].float().cpu()
    return torch.cat([row, row.new_zeros(n - row.shape[0])]) if row.shape[0] < n else row


def evicts(comp) -> bool:
    """Whether the method drops tokens (a dense store of kept tokens), rather than holding every one compressed."""
    return isinstance(comp, DenseCompressor)


def answer_positions(ids: list[int], answer: str | None, decode) -> list[int]:
    """Prompt positions of the first occurrence of ``answer``'s text (e.g. a needle's number), [] if absent.

    ``decode``: token ids -> text. Positions are found on the decoded text, so a number split into
    several tokens (or glued to its neighbours) is found as the tokens that cover it.
    """
    if not answer:
        return []
    ends, text = [], ""
    for t in ids:
        text += decode([t])
        ends.append(len(text))
    found = re.search(rf"(?<![0-9A-Za-z]){re.escape(answer)}(?![0-9A-Za-z])", text)
    if found is None:
        return []
    first = next(i for i, e in enumerate(ends) if e > found.start())
    last = next(i for i, e in enumerate(ends) if e >= found.end())
    return list(range(first, last + 1))


def kept_density(comp, n_layers: int, n: int) -> Tensor | None:
    """Per prompt position, the fraction of (layer, KV head) pairs that keep it: [n] (None if not position-based)."""
    counts, pairs = torch.zeros(n), 0
    for layer in range(n_layers):
        pos = comp.kept_positions(layer)
        if pos is None:
            return None
        p = pos.reshape(-1).long().cpu()
        counts += torch.bincount(p[p < n], minlength=n).float()[:n]
        pairs += pos.shape[0]
    return counts / max(1, pairs)


# ----- the probe ------------------------------------------------------------------------------
class _Growing:
    """Per-layer buffer of generated K or V for every run: [runs, Hkv, cap, d], grown by doubling."""

    def __init__(self, runs: int, like: Tensor):
        self.buf = like.new_zeros(runs, like.shape[0], 16, like.shape[-1])

    def put(self, rows: list[int], s: int, x: Tensor) -> None:
        """x [R, Hkv, t, d] at positions s..s+t-1 of ``rows``."""
        t = x.shape[-2]
        if s + t > self.buf.shape[-2]:
            new = self.buf.new_zeros(*self.buf.shape[:2], 2 * (s + t), self.buf.shape[-1])
            new[..., : self.buf.shape[-2], :] = self.buf
            self.buf = new
        self.buf[rows, :, s : s + t] = x

    def get(self, rows: list[int], s: int) -> Tensor:
        return self.buf[rows, :, : s + 1]


@dataclass
class ProbeSettings:
    attn_error: bool = True  # shadow full cache, attention relative error per step and layer
    fidelity: bool = True  # teacher-forced KL, top-1 agreement, perplexity (needs an exact run)
    maps: bool = True  # attention maps and kept positions
    map_layer: int | None = None  # default: n_layers // 2
    map_head: int = 0
    map_queries: int = 8  # last decode queries kept for the maps


class MetricsProbe(Probe):
    """The costly measurements as an engine probe; ``finish`` writes them into each run's metrics/extras.

    It reads every decode layer (``on_layer``) and question chunk (``on_chunk``); with ``fidelity`` it
    is teacher-forced (``on_forced``)."""

    sees_layers = True
    sees_chunks = True

    def __init__(self, settings: ProbeSettings | None = None):
        self.cfg = settings or ProbeSettings()
        self.teacher_forced = self.cfg.fidelity

    # hooks ---------------------------------------------------------------------------------
    def on_prefill(self, state, logits: Tensor, compressors) -> None:
        self.comps = compressors
        # the reference is the exact cache as kvlab stores it: K/V rounded to the cache dtype (kept
        # in the compute dtype, so each step's matmuls need no cast)
        self.cache_dtype = compressors[0].info.torch_cache_dtype if compressors else state.keys.dtype
        self.keys, self.values = self._rounded(state.keys), self._rounded(state.values)
        self.scaling = state.scaling
        self.semantics = state.semantics  # per layer: soft-cap, window, sinks (None: plain)
        self.n, self.n_layers = state.n_tokens, state.keys.shape[0]
        self.prefill_logp = torch.log_softmax(logits.float(), -1)
        runs = len(compressors)
        self.errors: list[list[list[float]]] = [[] for _ in range(runs)]  # [run][step][layer]
        self.kg = (
            [_Growing(runs, self.keys[0]) for _ in range(self.n_layers)] if self.cfg.attn_error or self.cfg.maps else []
        )
        self.vg = [_Growing(runs, self.values[0]) for _ in range(self.n_layers)] if self.kg else []
        self.kl: list[list[float]] = [[] for _ in range(runs)]
        self.agree: list[list[bool]] = [[] for _ in range(runs)]
        self.nll: list[list[float]] = [[] for _ in range(runs)]
        self.layer = self.n_layers // 2 if self.cfg.map_layer is None else self.cfg.map_layer
        # per run: (decode step, exact's weights [n], the method's [n] or None) of the last queries
        self.maps: list[deque[tuple[int, Tensor, Tensor | None]]] = [
            deque(maxlen=self.cfg.map_queries) for _ in range(runs)
        ]
        self.question_errors: list[list[float]] = [[] for _ in range(runs)]  # [run][layer] (query-agnostic)
        self.first_logp: dict[int, Tensor] = {}  # query-agnostic: each run's first-token log-probs
        self.question_tokens = 0  # query-agnostic: tokens fed after the context, before decoding

    def _sem(self, layer: int) -> LayerSemantics | float:
        return self.scaling if self.semantics is None else self.semantics[layer]

    def _rounded(self, x: Tensor) -> Tensor:
        return x if x.dtype == self.cache_dtype else x.to(self.cache_dtype).to(x.dtype)

    def on_step(self, step: int, rows: list[int], logits: Tensor) -> None:
        if step == 0:  # query-agnostic: each run's own logits after the question
            self.first_logp = {i: torch.log_softmax(logits[r].float(), -1) for r, i in enumerate(rows)}

    def on_chunk(self, layer: int, rows: list[int], pos: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
        """A question's c tokens fed after compression: into each run's shadow cache, and their attention error.

        q/out [R, Hq, c, d], k/v [R, Hkv, c, d] at positions pos..pos+c-1 (right after the context).
        """
        if not self.kg or not (self.cfg.attn_error or layer == self.layer):
            return
        s, c = pos - self.n, q.shape[-2]
        self.question_tokens = c
        self.kg[layer].put(rows, s, self._rounded(k))
        self.vg[layer].put(rows, s, self._rounded(v))
        if self.cfg.attn_error:
            kg, vg = self.kg[layer].get(rows, s + c - 1), self.vg[layer].get(rows, s + c - 1)
            exact, _ = shadow_attention(q, self.keys[layer], self.values[layer], kg, vg, self._sem(layer))
            for r, err in zip(rows, relative_error(out, exact).tolist()):
                self.question_errors[r].append(err)

    def on_layer(self, layer: int, rows: list[int], pos: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
        if not self.kg or not (self.cfg.attn_error or layer == self.layer):
            return
        s = pos - self.n
        self.kg[layer].put(rows, s, self._rounded(k))
        self.vg[layer].put(rows, s, self._rounded(v))
        exact, probs = shadow_attention(
            q,
            self.keys[layer],
            self.values[layer],
            self.kg[layer].get(rows, s),
            self.vg[layer].get(rows, s),
            self._sem(layer),
        )
        if self.cfg.attn_error:
            err = relative_error(out, exact).tolist()
            for r, i in enumerate(rows):
                if layer == 0:
                    self.errors[i].append([])
                self.errors[i][-1].append(err[r])
        if self.cfg.maps and layer == self.layer:
            self._record_map(rows, s - self.question_tokens, q, probs)  # labelled by decode step

    def _record_map(self, rows: list[int], s: int, q: Tensor, probs: Tensor) -> None:
        h, n = self.cfg.map_head, self.n
        for r, i in enumerate(rows):
            method = method_weights(self.comps[i], self.layer, q[r], h, n)
            self.maps[i].append((s + 1, probs[r, h, 0, :n].cpu(), method))

    def on_forced(self, step: int, token: int, exact_logits: Tensor, forced: dict[int, Tensor]) -> None:
        lp_e = torch.log_softmax(exact_logits.float(), -1)
        top = int(torch.argmax(lp_e))
        for i, logits in forced.items():
            lp_m = torch.log_softmax(logits.float(), -1)
            self.kl[i].append(float((lp_e.exp() * (lp_e - lp_m)).sum().clamp_min(0)))
            self.agree[i].append(int(torch.argmax(lp_m)) == top)
            self.nll[i].append(-float(lp_m[token]))

    # results -------------------------------------------------------------------------------
    def finish(self, runs) -> None:
        exact = next((i for i, r in enumerate(runs) if r.method == "exact"), None)
        for i, r in enumerate(runs):
            if self.cfg.attn_error:
                errs = self.errors[i]
                if errs and len(errs[-1]) < self.n_layers:  # a step stopped inside its forward (time limit)
                    errs = errs[:-1]
                flat = [e for row in errs for e in row]
                r.metrics["attn_rel_error"] = _round(errs)
                r.metrics["attn_rel_error_mean"] = _round(sum(flat) / len(flat)) if flat else None
                if self.question_errors[i]:  # query-agnostic: the question's tokens, per layer
                    qe = self.question_errors[i]
                    r.metrics["question_attn_rel_error"] = _round(qe)
                    r.metrics["question_attn_rel_error_mean"] = _round(sum(qe) / len(qe))
            if self.cfg.fidelity:
                r.metrics.update(self._fidelity(i, exact, runs))
            if self.cfg.maps:
                r.extras.update(self._maps(i))

    def _fidelity(self, i: int, exact: int | None, runs) -> dict:
        if exact is None:
            return {"kl": None, "kl_mean": None, "top1_agreement": None, "perplexity": None, "forced_logprob": None}
        first = self.first_logp.get(i, self.prefill_logp)  # query-aware: shared by every run
        nll0 = -float(first[runs[exact].token_ids[0]])
        kl, nll = self.kl[i], [nll0] + self.nll[i]
        extra = {}
        if self.first_logp:  # query-agnostic: how far the first token's distribution after the question moved
            lp_e = self.first_logp[exact]
            extra["question_kl"] = _round(float((lp_e.exp() * (lp_e - first)).sum().clamp_min(0)))
        return {
            **extra,
            "forced_logprob": _round([-x for x in nll]),  # log p of each exact token, along exact's continuation
            "kl": _round(kl),
            "kl_mean": _round(sum(kl) / len(kl)) if kl else 0.0,
            "top1_agreement": _round(sum(self.agree[i]) / len(self.agree[i])) if self.agree[i] else 1.0,
            "perplexity": _round(math.exp(sum(nll) / len(nll))),
        }

    def _maps(self, i: int) -> dict:
        comp, h = self.comps[i], self.cfg.map_head
        entries = list(self.maps[i])
        methods = [m for _, _, m in entries if m is not None]
        has_method = bool(entries) and len(methods) == len(entries)
        kept = comp.kept_positions(self.layer) if evicts(comp) else None  # else: every position held, compressed
        if kept is not None:
            kv = h * kept.shape[0] // comp.info.n_heads
            kept = sorted(p for p in kept[kv].tolist() if p < self.n)
        density = kept_density(comp, self.n_layers, self.n)
        return {
            "attn_map": {
                "layer": self.layer,
                "head": h,
                "steps": [s for s, _, _ in entries],
                "exact": [_round(e.tolist()) for _, e, _ in entries],
                "method": [_round(m.tolist()) for m in methods] if has_method else None,
            },
            "kept_positions": kept,
            "kept_density": None if density is None else _round(density.tolist(), 3),
        }
