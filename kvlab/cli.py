"""Command line: ``python -m kvlab compare|methods``.

Bad arguments exit with status 2 and one line that says what was wrong and what is allowed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvlab.budgets import BudgetError, parse_budgets


class CliError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, status 2
        raise CliError(message)


def _parse_params(items: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for item in items or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise CliError(f"--param {item!r} must look like METHOD.NAME=VALUE, e.g. streaming.n_sink=8")
        key, value = item.split("=", 1)
        method, name = key.split(".", 1)
        out.setdefault(method.strip(), {})[name.strip()] = value.strip()
    return out


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m kvlab", description="Compare KV-cache compression methods on a real model.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    c = sub.add_parser("compare", help="run methods side by side on one prompt")
    src = c.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    c.add_argument("--methods", default="exact,streaming", help="comma-separated method names (see `methods`)")
    c.add_argument("--budget", default="0.25", help="fractions in (0,1] or token counts like 512t, comma-separated")
    c.add_argument("--max-new-tokens", type=int, default=32)
    c.add_argument("--model", default="embedded", help="'embedded', a Hugging Face id, or a local folder")
    c.add_argument("--device", default="auto")
    c.add_argument("--dtype", default="auto")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--sample", action="store_true", help="seeded sampling instead of greedy decoding")
    c.add_argument("--temperature", type=float, default=1.0)
    c.add_argument("--no-chat", action="store_true", help="feed the raw text, without the chat template")
    c.add_argument("--param", action="append", default=[], help="METHOD.NAME=VALUE, repeatable")
    c.add_argument("--trust-remote-code", action="store_true")
    c.add_argument("--json", help="write the full results as JSON here")
    c.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    sub.add_parser("methods", help="list the methods and their parameters")
    return p


def _read_prompt(args) -> str:
    if args.prompt_file:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"cannot read --prompt-file {args.prompt_file!r}: {exc.strerror or exc}; give a readable UTF-8 text file") from None
    else:
        text = args.prompt if args.prompt is not None else ""
    if not text.strip():
        raise CliError("the prompt is empty; give --prompt TEXT or --prompt-file PATH with some text")
    return text


def format_table(result) -> str:
    rows = [("run", "KiB", "of exact", "tok/s", "compress s", "text")]
    for r in result.runs:
        exact = r.exact_kv_bytes_per_step[0]
        text = r.text.replace("\n", " ")
        rows.append(
            (
                r.label,
                f"{r.kv_bytes / 1024:.0f}",
                f"{r.kv_bytes / exact:.3f}",
                f"{r.timings.tokens_per_s:.1f}",
                f"{r.timings.compress_s:.3f}",
                text[:60] + ("…" if len(text) > 60 else ""),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    return "\n".join(lines)


def cmd_methods() -> int:
    from kvlab.compressors import methods

    for name, cls in methods().items():
        print(f"{name:16s} [{cls.group}] {cls.summary}")
        for p in cls.params:
            print(f"    {p.name}={p.default!r}: {p.help}")
    return 0


def cmd_compare(args) -> int:
    from kvlab.engine import Engine, GenerationSettings, InputError, expand_runs
    from kvlab.models import ModelLoadError, load_model

    text = _read_prompt(args)
    try:
        budgets = parse_budgets(args.budget)
    except BudgetError as exc:
        raise CliError(str(exc)) from None
    params = _parse_params(args.param)
    gen = GenerationSettings(
        max_new_tokens=args.max_new_tokens, do_sample=args.sample, temperature=args.temperature, seed=args.seed
    )
    try:
        gen.validate()
        runs = expand_runs(args.methods.split(","), budgets, params)
    except InputError as exc:
        raise CliError(str(exc)) from None
    t0 = time.perf_counter()
    try:
        lm = load_model(args.model, args.device, args.dtype, args.trust_remote_code)
    except ModelLoadError as exc:
        print(f"kvlab: error: {exc}", file=sys.stderr)
        return 1
    load_s = time.perf_counter() - t0
    ids = lm.encode(text, chat=not args.no_chat)
    engine = Engine(lm)
    result = None
    try:
        for ev in engine.stream(ids, runs, gen, prompt_text=text):
            if not args.quiet and ev.kind in ("prefill", "compress", "run_done"):
                print(f"[kvlab] {ev.message}", file=sys.stderr)
            elif not args.quiet and ev.kind == "step" and (ev.step % 8 == 0 or ev.step == ev.total):
                print(f"[kvlab] {ev.message}", file=sys.stderr)
            if ev.kind == "done":
                result = ev.result
    except InputError as exc:
        raise CliError(str(exc)) from None
    result.timings["load_s"] = load_s
    print(f"model {result.model['id']} on {result.model['device']} ({result.model['dtype']}); "
          f"prompt {result.prompt_tokens} tokens; load {load_s:.1f} s, compare {result.timings['compare_s']:.1f} s")
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "compare":
            return cmd_compare(args)
        if args.command == "methods":
            return cmd_methods()
        parser.print_help()
        return 2
    except CliError as exc:
        print(f"kvlab: error: {exc}", file=sys.stderr)
        return 2
