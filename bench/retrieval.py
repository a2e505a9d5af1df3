"""Pass keys and needles under one method's settings: which of them decide whether the answer survives.

``--method`` picks the study (``CONFIGS``: BalanceKV or Scissorhands, each with the exact cache and a
few reference methods). Each prompt (task x length x depth x seed) runs once, with every configuration
of the study in one lockstep comparison (one shared prefill), query-aware, greedy, 10 new tokens. Per
configuration it prints the hits (all prompts, and those whose answer lies wholly in the compressed
middle) and, from the compressed caches of every (layer, KV head), the share of the answer's tokens
each stream still holds, the share of its digits held by at least one copy, the share of streams
holding a whole copy, the same two shares again right after the first decode step that drops tokens
(an evictor's first decode compression), and where each copy sits (sink / middle / recent / split).
``--probes`` adds the attention error of the decode steps; ``--only`` runs a subset of the
configurations. Writes the rows as JSON with ``--json``.

    OMP_NUM_THREADS=1 python -m bench.retrieval --method scissorhands --task passkey --length 1k [--probes] [--json F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from kvlab.core.budgets import Budget
from kvlab.engine.comparison import Engine
from kvlab.engine.loader import load_model
from kvlab.engine.probe import Probe
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.measure.metrics import ProbeSettings
from kvlab.run import Comparison, compare
from kvlab.tasks import make_task, parse_length

# method studied -> {label -> (method, budget, params)}; "exact" runs with every study
CONFIGS: dict[str, dict[str, tuple[str, str | None, dict]]] = {
    "balancekv": {
        "exact": ("exact", None, {}),
        "default (T=3, b=256, gamma=4)": ("balancekv", "0.25", {}),
        "budget 0.5 (T=2)": ("balancekv", "0.5", {}),
        "budget 0.75 (T=1)": ("balancekv", "0.75", {}),
        "T=4 (recent window wider)": ("balancekv", "0.25", {"T": 4}),
        "T=2, sink 4, recent 16 @0.27": ("balancekv", "0.27", {"T": 2, "n_sink": 4, "n_recent": 16}),
        "n_sink=4 (recent window wider)": ("balancekv", "0.25", {"n_sink": 4}),
        "block_size=128": ("balancekv", "0.25", {"block_size": 128}),
        "paper step c=1": ("balancekv", "0.25", {"c": 1.0}),
        "paper step c=235": ("balancekv", "0.25", {"c": 235.0}),
        "random signs (gamma=0)": ("balancekv", "0.25", {"gamma": 0.0}),
        "random signs @0.5": ("balancekv", "0.5", {"gamma": 0.0}),
        "random signs @0.75": ("balancekv", "0.75", {"gamma": 0.0}),
        "denom_weight=0": ("balancekv", "0.25", {"denom_weight": 0.0}),
        "denom_weight=1": ("balancekv", "0.25", {"denom_weight": 1.0}),
        "center=false": ("balancekv", "0.25", {"center": False}),
        "uniform": ("uniform", "0.25", {}),
        "uniform @0.5": ("uniform", "0.5", {}),
        "uniform @0.75": ("uniform", "0.75", {}),
        "streaming": ("streaming", "0.25", {}),
    },
    "scissorhands": {
        "exact": ("exact", None, {}),
        "default (m=w=0.5B, r=0.25B)": ("scissorhands", "0.25", {}),
        "m=1 (paper's theory)": ("scissorhands", "0.25", {"m_ratio": 0.0}),
        "m=0.05B": ("scissorhands", "0.25", {"m_ratio": 0.05}),
        "w=0.25B": ("scissorhands", "0.25", {"w_ratio": 0.25}),
        "w=B": ("scissorhands", "0.25", {"w_ratio": 1.0}),
        "r=0.05B": ("scissorhands", "0.25", {"r_ratio": 0.05}),
        "r=0.5B": ("scissorhands", "0.25", {"r_ratio": 0.5}),
        "threshold=cache": ("scissorhands", "0.25", {"threshold": "cache"}),
        "m=1, threshold=cache": ("scissorhands", "0.25", {"m_ratio": 0.0, "threshold": "cache"}),
        "budget 0.5": ("scissorhands", "0.5", {}),
        "budget 0.5, m=1": ("scissorhands", "0.5", {"m_ratio": 0.0}),
        "h2o": ("h2o", "0.25", {}),
        "h2o @0.5": ("h2o", "0.5", {}),
        "streaming": ("streaming", "0.25", {}),
        "streaming @0.5": ("streaming", "0.5", {}),
    },
}


class FixedRuns(Comparison):
    """A comparison whose runs are given as ``RunSpec``s (one method may run with several parameter sets)."""

    specs: list[RunSpec] = []

    def runs(self) -> list[RunSpec]:
        return list(self.specs)


def answer_spans(lm, ids: list[int], answer: str) -> list[list[int]]:
    """Token positions of each copy of ``answer`` in the prompt ``ids``: one list per copy."""
    pieces = [lm.decode([t]) for t in ids]
    text = "".join(pieces)
    ends = list(itertools.accumulate(len(x) for x in pieces))
    spans, at = [], text.find(answer)
    while at >= 0:
        end = at + len(answer)
        spans.append([i for i, e in enumerate(ends) if e - len(pieces[i]) < end and e > at])
        at = text.find(answer, end)
    return spans


def kept_positions(comp) -> list[torch.Tensor] | None:
    """Positions each (layer, KV head) stream of a compressor holds: per layer [Hkv, m]; None
    for a compressor without per-layer stores (the exact cache)."""
    return [la.views()[2].clone() for la in comp.layers] if hasattr(comp, "layers") else None


class KeptProbe(Probe):
    """Records which positions each run's (layer, KV head) streams hold after the prefill's compression
    (``kept``) and right after the first decode step that drops a token (``evicted``; None if none did).
    Each decode step appends one token, so a step drops tokens when the cache does not grow."""

    attends = True

    def __init__(self) -> None:
        self.kept: list[list[torch.Tensor] | None] = []
        self.evicted: list[list[torch.Tensor] | None] = []
        self.comps: list = []
        self.sizes: list[int | None] = []

    def on_prefill(self, state, logits, compressors) -> None:
        self.comps = list(compressors)
        self.kept = [kept_positions(c) for c in compressors]
        self.evicted = [None] * len(compressors)
        self.sizes = [None if k is None else k[0].shape[-1] for k in self.kept]

    def on_attend(self, layer, row, q, out) -> None:
        pass

    def on_step(self, step, rows, logits) -> None:
        for i in rows:
            if step == 0 or self.sizes[i] is None or self.evicted[i] is not None:
                continue
            now = kept_positions(self.comps[i])
            if now[0].shape[-1] <= self.sizes[i]:
                self.evicted[i] = now
            self.sizes[i] = now[0].shape[-1]

    def finish(self, runs) -> None:
        pass


def coverage(kept: list[torch.Tensor] | None, spans: list[list[int]]) -> dict[str, float]:
    """Over (layer, KV head) streams: the share of the answer's tokens kept (``digits_kept``), of the
    answer's digits held by at least one copy (``digits_any``), of streams holding a whole copy
    (``streams_whole``). ``spans``: the copies' token positions (copies of equal length)."""
    if kept is None:
        return {"digits_kept": 1.0, "digits_any": 1.0, "streams_whole": 1.0}
    pos = torch.stack(kept)  # [L, Hkv, m]
    held = torch.stack([torch.stack([(pos == p).any(-1) for p in s], -1) for s in spans])  # [copies, L, Hkv, digits]
    return {
        "digits_kept": float(held.float().mean()),
        "digits_any": float(held.any(0).float().mean()),
        "streams_whole": float(held.all(-1).any(0).float().mean()),
    }


def middle_rate(knobs: dict, n: int) -> float | None:
    """Share of the compressed middle a plan keeps: BalanceKV ceil(n_middle / 2^T) / n_middle, uniform
    its sampled share, StreamingLLM 0, the score-based evictors (H2O, Scissorhands) their scored slots
    over the tokens outside the recent window; None for the exact cache."""
    span = windows(knobs, n)
    if span is None or span[1] <= span[0]:
        return None
    if "n_middle" in knobs:
        return -(-knobs["n_middle"] >> knobs["T"]) / knobs["n_middle"]
    if "first" in knobs or "window" in knobs:
        return knobs.get("sampled", 0) / (span[1] - span[0])
    return min(1.0, (evictor_capacity(knobs) - evictor_recent(knobs)) / (span[1] - span[0]))


def evictor_capacity(knobs: dict) -> int:
    """Tokens per stream of a score-based evictor: H2O's ``capacity``, Scissorhands' ``B``."""
    return knobs["capacity"] if "capacity" in knobs else knobs["B"]


def evictor_recent(knobs: dict) -> int:
    """The recent window a score-based evictor never drops: H2O's ``recent``, Scissorhands' ``r``."""
    return knobs["recent"] if "recent" in knobs else knobs["r"]


def windows(knobs: dict, n: int) -> tuple[int, int] | None:
    """[a, e): the prompt span a plan does not keep exactly (BalanceKV's halved middle, uniform's sampled
    middle, StreamingLLM's dropped middle, the scored span of H2O and Scissorhands: all but the recent
    window); None for the exact cache."""
    if "n_middle" in knobs:
        return knobs["n_sink"], knobs["n_sink"] + knobs["n_middle"]
    if "first" in knobs:
        return knobs["first"], n - knobs["last"]
    if "window" in knobs:
        return knobs["n_sink"], n - knobs["window"]
    if ("capacity" in knobs or "B" in knobs) and ("recent" in knobs or "r" in knobs):
        return 0, n - evictor_recent(knobs)
    return None


def where(knobs: dict, spans: list[list[int]], n: int) -> str:
    """Where each copy of the answer sits: sink, middle, recent, or split (across a window's edge),
    e.g. "middle+recent" for two copies."""
    span = windows(knobs, n)
    if span is None or not spans:
        return "-"
    a, e = span

    def side(p: int) -> str:
        return "sink" if p < a else "middle" if p < e else "recent"

    return "+".join(dict.fromkeys(side(s[0]) if side(s[0]) == side(s[-1]) else "split" for s in spans))


def run_prompt(
    engine: Engine, task: str, length: int, depth: float, seed: int, new: int, probes: bool, configs: dict
) -> list[dict]:
    """One prompt, every configuration of ``configs`` (label -> (method, budget, params)) in one
    lockstep comparison."""
    labels = list(configs)
    t = make_task(task, length, seed, engine.lm.encode, depth)
    measure = ProbeSettings(fidelity=False, maps=False) if probes else None
    cmp = FixedRuns(t, [], settings=GenerationSettings(max_new_tokens=new), measure=measure)
    cmp.specs = [RunSpec(m, None if b is None else Budget.parse(b), p) for m, b, p in configs.values()]
    probe = KeptProbe()
    res = compare(engine, cmp, [probe])
    spans = answer_spans(engine.lm, res.prompt_token_ids, t.answer)
    out = []
    for label, r, kept, evicted in zip(labels, res.runs, probe.kept, probe.evicted):
        out.append(
            {
                "config": label,
                "depth": depth,
                "seed": seed,
                "n": res.prompt_tokens,
                "answer": t.answer,
                "answer_at": spans[0][0] if spans else None,
                "where": where(r.params, spans, res.prompt_tokens),
                "score": r.metrics.get("task_score"),
                "attn_err": r.metrics.get("attn_rel_error_mean"),
                "text": r.text,
                **coverage(kept, spans),
                # after the first decode eviction (without one, the prefill's holdings still stand)
                **{f"{k}_decode": v for k, v in coverage(kept if evicted is None else evicted, spans).items()},
                "decode_evicts": evicted is not None,
                "middle_rate": middle_rate(r.params, res.prompt_tokens),
                "params": r.params,
                "error": r.error,
            }
        )
    return out


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summary(rows: list[dict], labels: list[str]) -> str:
    head = "hits  middle attn_err middle_rate digits_kept digits_any streams_whole kept_decode whole_decode"
    lines = [f"{'config':34s} {head} where knobs"]
    for label in labels:
        rs = [r for r in rows if r["config"] == label]
        hits = sum(1 for r in rs if r["score"] == 1.0)
        mid = [r for r in rs if r["where"] == "middle"]  # every copy of the answer outside the exact windows
        mid_hits = f"{sum(1 for r in mid if r['score'] == 1.0)}/{len(mid)}"
        # the answer's tokens are counted where the plan compresses them: prompts with the answer in the middle
        keys = ("digits_kept", "digits_any", "streams_whole", "digits_kept_decode", "streams_whole_decode")
        dk, da, sw, dkd, swd = (mean([r[k] for r in mid]) for k in keys)
        w = " ".join(f"{d:g}:{x}" for d, x in dict.fromkeys((r["depth"], r["where"]) for r in rs))
        rate = mean([r["middle_rate"] for r in rs if r["middle_rate"] is not None])
        err = mean([r["attn_err"] for r in rs if r.get("attn_err") is not None])
        cols = f"{err:8.3f} {rate:11.3f} {dk:11.3f} {da:10.3f} {sw:13.3f} {dkd:11.3f} {swd:12.3f}"
        lines.append(f"{label:34s} {hits}/{len(rs)}  {mid_hits:>6s} {cols} {w} {rs[0]['params'] if rs else ''}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="balancekv", choices=sorted(CONFIGS), help="whose settings to vary")
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--length", default="1k")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--new", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--probes", action="store_true", help="also the attention error of the decode steps")
    ap.add_argument("--only", default="", help="comma-separated parts of configuration labels (default: all)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(load_model("embedded", "cpu"))
    parts = [x.strip() for x in args.only.split(",") if x.strip()]
    configs = {k: v for k, v in CONFIGS[args.method].items() if not parts or k == "exact" or any(x in k for x in parts)}
    rows, t0 = [], time.perf_counter()
    n = parse_length(args.length)
    for depth in (float(d) for d in args.depths.split(",")):
        for seed in range(args.seeds):
            rows += run_prompt(engine, args.task, n, depth, seed, args.new, args.probes, configs)
    print(summary(rows, list(configs)))
    print(f"{time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
