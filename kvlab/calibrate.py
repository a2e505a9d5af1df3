"""Calibrating a task on a model: exact's accuracy per prompt length, with the full cache.

``python -m kvlab tasks calibrate --task passkey --lengths 1k,2k,4k --seeds 20 --out cal.json``
prints one line per length and writes every sample to JSON. Decoding is transformers' own greedy
``generate`` with its full cache, which kvlab's ``exact`` run reproduces token for token, so the
numbers are exact's task scores without the cost of the comparison engine. A task is only worth
sweeping where these numbers are high: a method cannot be told apart from a reference that fails.

Seed ``s`` places the needle at ``depths[s % len(depths)]``, so 20 seeds over 5 depths give 4
prompts per depth.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvlab.core.model import ModelLoadError
from kvlab.core.statistics import score_interval
from kvlab.engine.loader import load_model
from kvlab.tasks import TASKS, TaskError, make_task, parse_length, prompt_ids

DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def generate_greedy(lm, ids: list[int], max_new_tokens: int) -> str:
    """The greedy continuation of ``ids`` with the full cache (what ``exact`` produces)."""
    import torch

    x = torch.tensor([ids], device=lm.device)
    eos = sorted(lm.eos_ids) or None
    with torch.no_grad():
        out = lm.model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else None,
        )
    return lm.decode(out[0, len(ids) :].tolist())


def calibrate(
    lm,
    task: str,
    lengths: list[int],
    seeds: int,
    depths: tuple[float, ...] = DEFAULT_DEPTHS,
    max_new_tokens: int = 10,
    log: Callable[[str], None] = lambda m: None,
    partial: Callable[[dict], None] = lambda d: None,
    first_seed: int = 0,
) -> dict:
    """Exact's accuracy on ``task`` for every length over seeds first_seed..first_seed+seeds-1; every sample kept.

    Seeds are the outer loop (seed 0 at every length, then seed 1, ...), so a run cut short has
    about as many seeds at every length. ``partial`` is called with the results so far after every
    sample; their ``results`` rows count the samples done (``seeds`` is how many ran).
    """

    samples: list[dict] = []
    seconds = dict.fromkeys(lengths, 0.0)
    data = {
        "task": task,
        "model": lm.info.id,
        "decoding": "greedy, full cache (transformers generate)",
        "max_new_tokens": max_new_tokens,
        "depths": list(depths),
        "results": [],
        "samples": samples,
    }
    for seed in range(first_seed, first_seed + seeds):
        depth = depths[seed % len(depths)]
        for n in lengths:
            t0 = time.perf_counter()
            t = make_task(task, n, seed, lm.encode, depth)
            ids = prompt_ids(lm, t)
            text = generate_greedy(lm, ids, max(max_new_tokens, t.max_new_tokens or 0))
            hit = t.score(text) if t.answer is not None else None
            seconds[n] += time.perf_counter() - t0
            samples.append(
                {"length": n, "seed": seed, "depth": depth, "prompt_tokens": len(ids), "answer": t.answer}
                | {"text": text, "hit": hit}
            )
            data["results"] = summarize(samples, lengths, seconds)
            log(f"[calibrate] {task} {n} seed {seed} depth {depth:g}: {'ok ' if hit else 'miss'} {text!r}")
            partial(data)
    return data


def summarize(samples: list[dict], lengths: list[int], seconds: dict[int, float] | None = None) -> list[dict]:
    """One row per length with samples: accuracy, its 95% interval over the seeds (``interval``: the exact
    binomial interval when every score is 0 or 1, else ``statistics.score_interval``'s mean interval: Student t
    below 15 seeds, the bootstrap from 15, cut to [0, 1]), hits, seeds run, mean prompt
    tokens, hits by depth.

    ``hits`` sums the scores (1.0 per exact match; RULER's string match adds the share of the
    references found), so ``accuracy`` is the mean score.
    """
    out = []
    for n in lengths:
        mine = [s for s in samples if s["length"] == n]
        if not mine:
            continue
        hits = sum(float(s["hit"] or 0) for s in mine)  # RULER's string match can score a share
        by_depth: dict[str, dict] = {}
        for s in sorted(mine, key=lambda s: s["depth"]):
            d = by_depth.setdefault(f"{s['depth']:g}", {"hits": 0, "seeds": 0})
            d["hits"] += float(s["hit"] or 0)
            d["seeds"] += 1
        interval = score_interval([float(s["hit"] or 0) for s in mine])
        out.append(
            {
                "length": n,
                "accuracy": hits / len(mine),
                "interval": None if interval is None else interval.as_dict(),
                "hits": hits,
                "seeds": len(mine),
                "prompt_tokens_mean": sum(s["prompt_tokens"] for s in mine) / len(mine),
                "by_depth": by_depth,
                "seconds": round((seconds or {}).get(n, 0.0), 1),
            }
        )
    return out


def format_calibration(data: dict) -> str:
    rows = [f"task {data['task']} on {data['model']}: exact's accuracy (greedy, full cache)"]
    rows.append(f"{'length':>7}  {'tokens':>6}  {'accuracy':>8}  {'95% interval':>12}  hits/seeds  by depth")
    for r in data["results"]:
        depth = " ".join(f"{d}:{round(v['hits'], 2):g}/{v['seeds']}" for d, v in r["by_depth"].items())
        ci = r.get("interval") or {}
        span = f"[{ci['low']:.2f}, {ci['high']:.2f}]" if ci.get("low") is not None else "—"
        rows.append(
            f"{r['length']:>7}  {r['prompt_tokens_mean']:>6.0f}  {r['accuracy']:>8.2f}  {span:>12}  "
            f"{round(r['hits'], 2):>4g}/{r['seeds']:<5}  {depth}"
        )
    return "\n".join(rows)


def main(args, error: Callable[[str], Exception], argv: list[str] | None = None) -> int:
    """``tasks calibrate`` from the CLI (``error`` builds the CLI's one-line error; ``argv`` is recorded)."""

    if args.task not in TASKS or args.task == "document":
        raise error(
            f"--task {args.task!r} cannot be calibrated; allowed: {', '.join(t for t in TASKS if t != 'document')}"
        )
    try:
        lengths = [parse_length(x) for x in args.lengths.split(",") if x.strip()]
        depths = tuple(float(x) for x in args.depths.split(",") if x.strip())
    except (TaskError, ValueError) as exc:
        raise error(
            str(exc) if isinstance(exc, TaskError) else f"--depths {args.depths!r}: numbers in [0, 1]"
        ) from None
    if args.first_seed < 0:
        raise error(f"--first-seed {args.first_seed} must be >= 0")
    if not lengths or args.seeds < 1 or not depths or not all(0 <= d <= 1 for d in depths):
        raise error("--lengths must name a length, --seeds must be >= 1 and --depths must be numbers in [0, 1]")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        lm = load_model(args.model, args.device)
    except ModelLoadError as exc:
        raise error(str(exc)) from None
    log = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    command = "python -m kvlab " + " ".join(sys.argv[1:] if argv is None else argv)

    def write(data: dict) -> None:
        if args.out:
            Path(args.out).write_text(json.dumps({"command": command} | data, indent=1))

    data = calibrate(lm, args.task, lengths, args.seeds, depths, args.max_new_tokens, log, write, args.first_seed)
    write(data)
    data["command"] = command
    print(format_calibration(data))
    if args.out:
        print(f"written: {args.out}")
    return 0
