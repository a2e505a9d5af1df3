"""kvlab's methods against NVIDIA kvpress's presses: the same model, the same token ids, the same tokens kept.

For every method both libraries have (``PAIRINGS``: one entry each), kvlab runs the method and kvpress
its press on the same prompt ids, with aligned parameters, each keeping the same number of tokens per
layer and KV head. Reported per pairing:

* the per-layer Jaccard similarity of the kept (KV head, position) pairs the first decode step's query
  attends (the prefill's choice, and the first token) and, for methods that evict while decoding, the
  last step's query (the set they re-chose): the smallest over the layers and the mean;
* whether the greedy generations are equal, else the first new token where they part.

Jaccard 1.000 is expected wherever the algorithm is the same; every other value is explained by the
pairing's ``note`` (and in the method's doc page). Both sides run the embedded SmolLM2-135M-Instruct in
float32 with a float32 cache (kvlab: ``--cache-dtype float32``), the whole prompt compressed (no
question split), greedy. kvpress pins transformers < 5.3, so its side runs in a throwaway virtual
environment made by ``bench/kvpress_env.sh`` (kvpress 0.5.5 from the package index, torch 2.13.0 CPU)
and ``bench/kvpress_parity_worker.py`` (how it reads what a press kept).

    python -m bench.kvpress_parity                      # makes /tmp/kvlab-kvpress-venv on first use
    python -m bench.kvpress_parity --only knorm,snapkv --tokens 400 --new 48

Adding a pairing: one ``Pairing`` in ``PAIRINGS`` (kvlab's name and parameters, the press as JSON, the
tokens kept), with a ``note`` when the algorithms differ, e.g. ``Pairing("capkv", press("CapKVPress",
compression_ratio=RATIO))``; a wrapper wraps its inner press the same way (``press("CriticalKVPress",
press=press("SnapKVPress", ...))``). Writes ``bench/results/kvpress_parity.json``
and prints the markdown table that docs/methods/README.md and bench/README.md show.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RATIO = "$ratio"  # the worker's placeholder: the compression ratio keeping exactly ``keep`` prompt tokens


def press(name: str, **kwargs) -> dict:
    """A press as the worker builds it: ``{"press": name, "kwargs": {...}}`` (a kwarg may be a press)."""
    return {"press": name, "kwargs": kwargs}


@dataclass(frozen=True)
class Pairing:
    """kvlab's ``method`` with ``params`` against kvpress's press ``spec``; both keep ``keep(n)`` tokens per
    layer and KV head of an n-token prompt (kvlab: a token budget, unless ``budget`` gives another, for
    methods whose kept count is a parameter). ``note``: why a Jaccard below 1 or different generations are
    expected (empty: the same algorithm)."""

    method: str
    spec: dict
    params: dict = field(default_factory=dict)
    note: str = ""
    budget: str = ""  # "": "{keep}t"; "all": a token budget of every token (the kept count is a parameter)
    decoding: bool = False  # the set the last query attends is re-chosen while decoding

    def keep(self, n: int, share: float) -> int:
        return max(8, int(share * n))


INTERVAL = 16  # decode steps between two compressions of the decoding pairings
TOPK_ORDER = (
    "kvpress's ScorerPress keeps rows in top-k order, not in position order (the top-k of tied scores), and "
    "StreamingLLMPress prunes by row index: re-applied while decoding, it no longer drops the oldest token"
)
SNAP = {"window": 64, "kernel": 5, "pooling": "avg"}  # kvpress SnapKVPress's defaults in kvlab's names
SNAP_PRESS = {"window_size": 64, "kernel_size": 5}


def _decoding(scorer: str, **kwargs) -> dict:
    """kvpress's prompt press and DecodingPress over the same scorer (the target filled in by ``specs``)."""
    return press(
        "PrefillDecodingPress",
        prefilling_press=press(scorer, compression_ratio=RATIO, **kwargs),
        decoding_press=press("DecodingPress", base_press=press(scorer, **kwargs), compression_interval=INTERVAL),
    )


def _stepwise(scorer: str, **kwargs) -> dict:
    """kvpress's prompt press, then the same press re-applied after every decode step (interval 1)."""
    return press(
        "PrefillDecodingPress",
        prefilling_press=press(scorer, compression_ratio=RATIO, **kwargs),
        decoding_press=press("DecodingPress", base_press=press(scorer, **kwargs), compression_interval=1),
    )


PAIRINGS: tuple[Pairing, ...] = (
    Pairing("knorm", press("KnormPress", compression_ratio=RATIO)),
    Pairing(
        "streaming",
        _stepwise("StreamingLLMPress", n_sink=4),
        {"n_sink": 4},
        "kvlab's StreamingLLM evicts while decoding; kvpress's press is re-applied after every step to match. "
        + TOPK_ORDER,
        decoding=True,
    ),
    Pairing("snapkv", press("SnapKVPress", compression_ratio=RATIO, **SNAP_PRESS), SNAP),
    Pairing(
        "tova",
        _stepwise("TOVAPress"),
        note="TOVA evicts while decoding (kvpress: re-applied after every step); kvpress always keeps the newest "
        "token, the TOVA reference (and kvlab) may evict it",
        decoding=True,
    ),
    Pairing("keydiff", press("KeyDiffPress", compression_ratio=RATIO)),
    Pairing("expected-attention", press("ExpectedAttentionPress", compression_ratio=RATIO)),
    Pairing(
        "pyramidkv",
        press("PyramidKVPress", compression_ratio=RATIO, beta=20, **SNAP_PRESS),
        {**SNAP, "beta": 20.0},
        "per-layer budgets differ: kvpress's pyramid counts the window inside each layer's budget and falls back "
        "to SnapKV's uniform budget while its smallest layer would keep fewer than the window (n (1 - ratio) / "
        "beta < window); kvlab keeps the window on every layer and spreads the rest as a pyramid",
    ),
    Pairing(
        "ada-snapkv",
        press("AdaKVPress", press=press("SnapKVPress", compression_ratio=RATIO, **SNAP_PRESS), alpha_safeguard=0.2),
        {**SNAP, "alpha": 0.2},
        "the safeguard differs: kvpress guarantees each head its own int(alpha B) best tokens, then prunes the "
        "lowest scores of all heads jointly; kvlab (the authors' code) gives head i alpha B + (1 - alpha) f_i "
        "tokens, f_i its share of the joint top",
    ),
    Pairing(
        "ada-expected-attention",
        press(
            "AdaKVPress",
            press=press("ExpectedAttentionPress", compression_ratio=RATIO, epsilon=1e-2),
            alpha_safeguard=0.2,
        ),
        {"epsilon": 1e-2, "alpha": 0.2},
        "the safeguard differs, as ada-snapkv's",
    ),
    Pairing(
        "decoding-knorm",
        _decoding("KnormPress"),
        {"compression_interval": INTERVAL},
        "the generated tokens' keys come from each library's own decode forward (kvlab's runs every method in "
        "one batch, its linears as W x^T): equal to float32 rounding, enough to swap two near-equal norms",
        budget="all",
        decoding=True,
    ),
    Pairing(
        "decoding-snapkv",
        _decoding("SnapKVPress", window_size=8, kernel_size=5),
        {"window": 8, "kernel": 5, "pooling": "avg", "compression_interval": INTERVAL},
        "while decoding kvpress rebuilds the window's queries from the buffered hidden states and rotates every "
        "one by the current token's position (its position embeddings in a decode step); kvlab holds each "
        "query as it was rotated, at its own position",
        budget="all",
        decoding=True,
    ),
    Pairing(
        "cam",
        press(
            "PrefillDecodingPress",
            prefilling_press=press("StreamingLLMPress", compression_ratio=RATIO, n_sink=4),
            decoding_press=press(
                "CAMPress", base_press=press("StreamingLLMPress", n_sink=4), compression_interval=1, merge_budget=32
            ),
        ),
        {"merge_budget": 32},
        "the merged values differ: kvpress's merge probability uses the attention accumulated since decoding "
        "began and torch's global random draws, kvlab (the paper) the current query's attention and the run's "
        "seeded generator. The kept tokens part as streaming's do: " + TOPK_ORDER,
        decoding=True,
    ),
)


# ----- kvlab's side --------------------------------------------------------------------------------
def kvlab_side(ids: list[int], new: int, share: float, pairings: list[Pairing], threads: int) -> dict:
    """Each pairing's kvlab run (one lockstep comparison): kept positions after compression and as the last
    step's query attends, and the generated tokens."""
    import torch

    from kvlab.core.budgets import Budget
    from kvlab.engine.comparison import Engine
    from kvlab.engine.loader import load_model
    from kvlab.engine.probe import Probe
    from kvlab.engine.specs import GenerationSettings, RunSpec

    torch.set_num_threads(threads)
    lm = load_model("embedded").with_cache_dtype("float32")
    n = len(ids)

    class Kept(Probe):
        """Each run's kept positions after compression, after the first decode step and at the end (what the
        first and the last query attended)."""

        def on_prefill(self, state, logits, compressors) -> None:
            self.comps, self.prefill = compressors, [self.read(c) for c in compressors]
            self.first = list(self.prefill)

        def on_step(self, step, rows, logits) -> None:
            if step == 1:
                for i in rows:
                    self.first[i] = self.read(self.comps[i])

        def finish(self, runs) -> None:
            self.last = [self.read(c) for c in self.comps]

        @staticmethod
        def read(comp) -> list:
            out = []
            for layer in range(comp.info.n_layers):
                pos = comp.kept_positions(layer)
                out.append(None if pos is None else [sorted(set(row)) for row in pos.long().tolist()])
            return out

    specs = []
    for p in pairings:
        keep = p.keep(n, share)
        params = dict(p.params)
        if p.method == "streaming":
            params["window"] = keep - params.get("n_sink", 4)
        if p.method == "cam":
            params["start_share"] = 4.5 / keep  # its start: 4 tokens, as the press's n_sink
        if p.budget == "all":
            params["target_size"] = keep
        budget = f"{n + new}t" if p.budget == "all" else f"{keep}t"
        specs.append(RunSpec(p.method, Budget.parse(budget), params))
    probe = Kept()
    result = Engine(lm, time_limit_s=None).compare(ids, specs, GenerationSettings(max_new_tokens=new), probes=[probe])
    return {
        p.method: {
            "tokens": r.token_ids,
            "kept_prefill": probe.prefill[i],
            "kept_first": probe.first[i],
            "kept_last": probe.last[i],
            "error": r.error,
            "params": {k: v for k, v in r.params.items() if not isinstance(v, (list, dict))},
        }
        for i, (p, r) in enumerate(zip(pairings, result.runs))
    }


# ----- kvpress's side ------------------------------------------------------------------------------
def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        log(f"making kvpress's environment in {venv} (bench/kvpress_env.sh)")
        env = {**os.environ, "KVPRESS_VENV": str(venv)}
        subprocess.run(["bash", str(ROOT / "bench" / "kvpress_env.sh")], cwd=ROOT, env=env, check=True)
    return python


def specs(pairings: list[Pairing], n: int, share: float) -> list[dict]:
    """The worker's request entries: each press spec with the decoding press's target filled in. A press
    re-applied after every step compresses after the step's attention, where kvlab's streaming methods evict
    when the next token comes: it keeps one token fewer, so that every query attends as many as kvlab's."""
    out = []
    for p in pairings:
        keep = p.keep(n, share)
        spec = json.loads(json.dumps(p.spec))
        dec = spec["kwargs"].get("decoding_press")
        if isinstance(dec, dict):
            stepwise = dec["kwargs"].get("compression_interval") == 1
            keep = keep - 1 if stepwise else keep
            dec["kwargs"]["target_size"] = keep
        out.append({"name": p.method, "press": spec, "keep": keep})
    return out


def kvpress_side(python: Path, ids: list[int], new: int, entries: list[dict], threads: int) -> tuple[dict, dict]:
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(
        [str(python), str(ROOT / "bench" / "kvpress_parity_worker.py"), str(threads)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"ids": ids, "new": new, "pairings": entries}) + "\n")
    proc.stdin.flush()
    meta, out = {}, {}
    for line in proc.stdout:
        msg = json.loads(line)
        if "ready" in msg:
            meta = msg["ready"]
        elif msg.get("done"):
            break
        else:
            out[msg["name"]] = msg
            log(f"kvpress: {msg['name']} {'error: ' + msg['error'] if 'error' in msg else 'done'}")
    proc.wait(timeout=60)
    return meta, out


# ----- the comparison ------------------------------------------------------------------------------
def jaccard(a: list, b: list) -> list[float]:
    """Per layer: |A ∩ B| / |A ∪ B| of the (KV head, position) pairs kept."""
    out = []
    for la, lb in zip(a, b):
        sa = {(h, p) for h, row in enumerate(la) for p in row}
        sb = {(h, p) for h, row in enumerate(lb) for p in row}
        out.append(len(sa & sb) / max(1, len(sa | sb)))
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(pairings: list[Pairing], ours: dict, theirs: dict) -> list[dict]:
    rows = []
    for p in pairings:
        a, b = ours[p.method], theirs.get(p.method, {"error": "no answer from the worker"})
        row: dict = {"method": p.method, "press": describe(p.spec), "note": p.note}
        if a["error"] or "error" in b:
            row["error"] = a["error"] or b["error"]
            rows.append(row)
            continue
        first = jaccard(a["kept_first"], b["kept_first"])
        row["jaccard_first"] = {
            "min": round(min(first), 4),
            "mean": round(sum(first) / len(first), 4),
            "per_layer": [round(x, 4) for x in first],
        }
        if p.decoding:
            last = jaccard(a["kept_last"], b["kept_last"])
            row["jaccard_last"] = {"min": round(min(last), 4), "mean": round(sum(last) / len(last), 4)}
        diff = first_difference(a["tokens"], b["tokens"])
        row["generations_equal"] = diff is None
        row["first_difference"] = diff
        row["new_tokens"] = [len(a["tokens"]), len(b["tokens"])]
        row["kept_per_head"] = [len(a["kept_prefill"][0][0]), len(b["kept_prefill"][0][0])]
        rows.append(row)
    return rows


def describe(spec) -> str:
    """A press spec as kvpress code (``"$ratio"`` as ``r``)."""
    if isinstance(spec, dict) and "press" in spec:
        args = ", ".join(f"{k}={describe(v)}" for k, v in spec["kwargs"].items())
        return f"{spec['press']}({args})"
    return "r" if spec == RATIO else repr(spec)


def table(rows: list[dict]) -> str:
    lines = [
        "| kvlab | kvpress | Jaccard, first decode step (min / mean over layers) | Jaccard, last decode step | "
        "generations | why not 1.000 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| `{r['method']}` | `{r['press']}` | error: {r['error']} | | | |")
            continue
        pre = r["jaccard_first"]
        last = r.get("jaccard_last")
        gen = "equal" if r["generations_equal"] else f"differ from new token {r['first_difference']}"
        last_text = f"{last['min']:.3f} / {last['mean']:.3f}" if last else "—"
        lines.append(
            f"| `{r['method']}` | `{r['press']}` | {pre['min']:.3f} / {pre['mean']:.3f} | {last_text} | {gen} "
            f"| {r['note'] or '—'} |"
        )
    return "\n".join(lines)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=400, help="prompt length (CPython's reference manual)")
    ap.add_argument("--new", type=int, default=48, help="new tokens (greedy)")
    ap.add_argument("--share", type=float, default=0.25, help="share of the prompt each layer and KV head keeps")
    ap.add_argument("--only", default="", help="comma list of kvlab methods (default: every pairing)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--venv", default=os.environ.get("KVPRESS_VENV", "/tmp/kvlab-kvpress-venv"))
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "kvpress_parity.json"))
    args = ap.parse_args()
    chosen = [p for p in PAIRINGS if not args.only or p.method in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {p.method for p in PAIRINGS}
    if unknown:
        raise SystemExit(f"no pairing for {sorted(unknown)}; pairings: {', '.join(p.method for p in PAIRINGS)}")
    python = ensure_venv(Path(args.venv))

    from bench.compare_lockstep import long_prompt
    from bench.scaling import machine
    from kvlab.engine.loader import load_model

    start = machine()
    ids = long_prompt(load_model("embedded"), args.tokens)
    log(f"kvlab: {len(chosen)} methods on {len(ids)} prompt tokens, {args.new} new")
    ours = kvlab_side(ids, args.new, args.share, chosen, args.threads)
    log("kvpress: the same, one press at a time")
    meta, theirs = kvpress_side(python, ids, args.new, specs(chosen, len(ids), args.share), args.threads)
    rows = compare(chosen, ours, theirs)
    out = {
        "machine": {**start, "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "prompt_tokens": len(ids),
        "new_tokens": args.new,
        "share_kept": args.share,
        "kvpress_versions": meta.get("versions"),
        "rows": rows,
        "table": table(rows),
    }
    print(out["table"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        existing = json.loads(Path(args.json).read_text()) if args.only and Path(args.json).exists() else None
        if existing and existing.get("prompt_tokens") == len(ids) and existing.get("new_tokens") == args.new:
            merged = {r["method"]: r for r in existing["rows"]}  # --only: rows of the other pairings kept
            merged.update({r["method"]: r for r in rows})
            out["rows"] = [merged[p.method] for p in PAIRINGS if p.method in merged]
            out["table"] = table(out["rows"])
        Path(args.json).write_text(json.dumps(out, indent=1))
        log(f"written to {args.json}")


if __name__ == "__main__":
    main()
