"""Command line: ``python -m kvlab compare|sweep|methods|reproduce``.

Bad arguments exit with status 2 and one line that says what was wrong and what is allowed; so
does a model that cannot be loaded or that kvlab refuses (no such folder, an unsupported
architecture, a failed self-check).

The one module of kvlab whose kvlab imports wait inside functions: each subcommand imports what it
runs when it runs, so that ``kvlab --help``, ``kvlab methods`` and a bad argument answer without
loading torch and transformers (seconds). ``tests/test_layers.py`` allows this module alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.core.budgets import BudgetError, parse_budgets
from kvlab.core.cancel import TimeLimit
from kvlab.engine.embedded import MODELS as CARRIED
from kvlab.reproduce.registry import ALSO as REPRODUCE_ALSO
from kvlab.reproduce.registry import APART, REPRODUCTIONS

if TYPE_CHECKING:  # for annotations only; the results module is imported where a comparison runs
    from kvlab.core.results import CompareResult


class CliError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, status 2
        raise CliError(message)


MODEL_HELP = (
    f"an embedded model ({', '.join('/'.join(m.names) for m in CARRIED)}), a Hugging Face id, or a local folder"
)


def _parse_params(items: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for item in items or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise CliError(f"--param {item!r} must look like METHOD.NAME=VALUE, e.g. streaming.n_sink=8")
        key, value = item.split("=", 1)
        method, name = key.split(".", 1)
        out.setdefault(method.strip(), {})[name.strip()] = value.strip()
    return out


_CACHE_DTYPE_HELP = (
    "dtype the caches store keys and values in, counted by the budgets: auto (float16 on the CPU, the "
    "model's 16-bit dtype on a GPU), float32, float16 or bfloat16"
)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m kvlab", description="Compare KV-cache compression methods on a real model.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    c = sub.add_parser("compare", help="run methods side by side on one prompt")
    src = c.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    src.add_argument("--context-file", help="read a context from this file; ask it each --question")
    src.add_argument(
        "--task",
        help="a built-in task instead of a prompt: passkey, needle, multikey, lines, document, a RULER task "
        "(niah_single_1, niah_single_2, niah_multikey_1, niah_multivalue, niah_multiquery, vt, cwe, fwe), "
        "or file:PATH / hub:REPO (a RULER or LongBench row; --seed picks it)",
    )
    c.add_argument(
        "--question",
        action="append",
        default=[],
        help="a question asked of the context (--context-file, --prompt or --prompt-file), repeatable; by "
        "default asked after compression (query-agnostic): the context is compressed once for all questions",
    )
    proto = c.add_mutually_exclusive_group()
    proto.add_argument(
        "--query-aware",
        dest="protocol",
        action="store_const",
        const="query-aware",
        help="compress each question inside its prompt (the default without --question, and for tasks)",
    )
    proto.add_argument(
        "--query-agnostic",
        dest="protocol",
        action="store_const",
        const="query-agnostic",
        help="compress the context alone and feed the question afterwards (the default with --question)",
    )
    c.add_argument("--length", default="1k", help="task prompt length in tokens (e.g. 1500, 2k)")
    c.add_argument(
        "--probes",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="measure attention error, teacher-forced KL/agreement/perplexity and attention maps",
    )
    c.add_argument(
        "--methods", default="exact,streaming", help="method names, or all, paper, baselines, recent, quantizers"
    )
    c.add_argument("--budget", default="0.25", help="fractions in (0,1] or token counts like 512t, comma-separated")
    c.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's own (RULER), else 32")
    c.add_argument("--model", default="embedded", help=MODEL_HELP)
    c.add_argument("--device", default="auto")
    c.add_argument("--dtype", default="auto")
    c.add_argument(
        "--cache-dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"), help=_CACHE_DTYPE_HELP
    )
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--sample", action="store_true", help="seeded sampling instead of greedy decoding")
    c.add_argument("--temperature", type=float, default=1.0)
    c.add_argument("--no-chat", action="store_true", help="feed the raw text, without the chat template")
    c.add_argument("--param", action="append", default=[], help="METHOD.NAME=VALUE, repeatable")
    c.add_argument("--trust-remote-code", action="store_true")
    c.add_argument("--json", help="write the full results as JSON here")
    c.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    sub.add_parser("methods", help="list the methods and their parameters")
    s = sub.add_parser("sweep", help="run a task over lengths x seeds x methods x budgets; JSON, CSV, HTML report")
    s.add_argument(
        "--task",
        default="passkey",
        help="passkey, needle, multikey, lines, document, a RULER task (niah_single_1, ..., vt, cwe, fwe), "
        "several comma-separated, or file:PATH / hub:REPO rows (docs/tasks.md)",
    )
    s.add_argument(
        "--suite",
        choices=("ruler", "able"),
        help="a task suite instead of --task: ruler (RULER's eight tasks), or able (those RULER tasks that exact "
        "does right on the model at every length asked, by its calibration: kvlab/tasks/exact_accuracy.py)",
    )
    s.add_argument("--lengths", default="1k", help="comma-separated prompt lengths in tokens, e.g. 1k,2k")
    s.add_argument(
        "--methods", default="all", help="comma-separated method names, or all, paper, baselines, recent, quantizers"
    )
    s.add_argument("--budgets", default=None, help="comma-separated budgets: fractions kept or 512t (default 0.5,0.25)")
    s.add_argument(
        "--ratios",
        default=None,
        help="instead of --budgets: compression ratios, the fraction of the cache removed (kvpress's "
        "leaderboard convention), e.g. 0.25,0.5,0.75 (budget = 1 - ratio); exact runs too, as ratio 0",
    )
    s.add_argument("--seeds", type=int, default=1, help="seeds per length (0..N-1)")
    s.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's own (RULER), else 16")
    s.add_argument("--depth", type=float, default=0.5, help="needle depth in [0, 1] (passkey, needle, multikey)")
    s.add_argument("--depths", default="", help="needle depths, e.g. 0,0.5,1: a depth x length grid")
    s.add_argument("--probes", action=argparse.BooleanOptionalAction, default=True, help="costly metrics (default on)")
    s.add_argument(
        "--fidelity",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="teacher-forced log-probability of exact's answer, also with --no-probes (default on)",
    )
    s.add_argument(
        "--protocol",
        default="query-agnostic",
        choices=("query-agnostic", "query-aware"),
        help="the task's question asked after compressing its context alone (default: kvpress's leaderboard), "
        "or inside the compressed prompt",
    )
    s.add_argument("--model", default="embedded", help=MODEL_HELP)
    s.add_argument("--device", default="auto")
    s.add_argument(
        "--cache-dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"), help=_CACHE_DTYPE_HELP
    )
    s.add_argument("--out", default="sweep-out", help="output folder (cells/, results.json, results.csv, report.html)")
    s.add_argument("--quiet", action="store_true")
    t = sub.add_parser("tasks", help="built-in tasks: `tasks calibrate` measures exact's accuracy per length")
    tsub = t.add_subparsers(dest="tasks_command", parser_class=_Parser)
    cal = tsub.add_parser("calibrate", help="exact's accuracy on a task per length (greedy, full cache); JSON")
    cal.add_argument(
        "--task", default="passkey", help="passkey, needle, multikey, lines or a RULER task (vt, cwe, ...)"
    )
    cal.add_argument("--lengths", default="1k,2k,4k", help="comma-separated prompt lengths in tokens")
    cal.add_argument("--seeds", type=int, default=20, help="prompts per length (seeds F..F+N-1)")
    cal.add_argument("--first-seed", type=int, default=0, help="F, the first seed (to extend an earlier run)")
    cal.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths, cycled over the seeds")
    cal.add_argument("--max-new-tokens", type=int, default=10)
    cal.add_argument("--model", default="embedded", help=MODEL_HELP)
    cal.add_argument("--device", default="auto")
    cal.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    cal.add_argument("--out", help="write the results and every sample as JSON here")
    cal.add_argument("--quiet", action="store_true", help="no per-sample lines on stderr")
    r = sub.add_parser("reproduce", help="measure the papers' claims on the model: one reproduction by name, or all")
    r.add_argument(
        "name", nargs="?", help=", ".join(REPRODUCTIONS) + ", or all; by name only (hours): " + ", ".join(APART)
    )
    r.add_argument("--out", default="reproduce-out", help="output folder (NAME.json, NAME.html, summary.json)")
    r.add_argument("--quick", action="store_true", help="small settings (short prompts, few seeds): a smoke run")
    r.add_argument("--model", default="embedded", help=MODEL_HELP)
    r.add_argument(
        "--also",
        default=",".join(REPRODUCE_ALSO),
        help="models the task claims also run on, comma-separated, or none (default: %(default)s)",
    )
    r.add_argument("--device", default="auto")
    r.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    r.add_argument(
        "--docs", action="store_true", help="after the run, regenerate docs/reproductions.md and the README tally"
    )
    r.add_argument(
        "--docs-from",
        metavar="SUMMARY",
        help="regenerate the docs from this summary.json (the engines' one: their section alone); run nothing",
    )
    r.add_argument(
        "--rejudge",
        nargs="+",
        metavar="NAME.json[=MODEL]",
        help="decide the rows again from these stored results, measuring nothing (=MODEL: the model of a one-model "
        "file whose command does not name it); writes to --out",
    )
    r.add_argument("--quiet", action="store_true")
    return p


def _read_prompt(args) -> str:
    path, flag = (args.prompt_file, "--prompt-file") if args.prompt_file else (args.context_file, "--context-file")
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise CliError(f"cannot read {flag} {path!r}: {reason}; give a readable UTF-8 text file") from None
    else:
        text = args.prompt if args.prompt is not None else ""
    if not text.strip():
        raise CliError("the prompt is empty; give --prompt TEXT or --prompt-file PATH with some text")
    return text


def _check_questions(args) -> None:
    questions = [q for q in args.question if q.strip()]
    if len(questions) != len(args.question):
        raise CliError("--question is empty; give each question some text")
    if args.task and questions:
        raise CliError("--question goes with a context (--context-file, --prompt or --prompt-file), not --task")
    if args.context_file and not questions:
        raise CliError("--context-file needs at least one --question to ask of it")
    if args.protocol == "query-agnostic" and not (questions or args.task):
        raise CliError("--query-agnostic needs a --question (or a --task, whose question is asked after compression)")


def format_table(result) -> str:
    """One line per run: peak and mean KiB held over the run (after prefill and every step), each as a fraction
    of the exact cache's peak / mean, shared per-model KiB (QJL's sketches), speed and the text's opening."""
    rows = [("run", "peak KiB", "mean KiB", "peak/exact", "mean/exact", "shared KiB", "tok/s", "compress s", "text")]
    for r in result.runs:
        if not r.exact_kv_bytes_per_step:  # refused its budget, or its plan raised: it never ran; say why
            rows.append((r.label, "—", "—", r.finish_reason, "—", "—", "—", "—", r.error))
            continue
        mem = r.memory
        text = r.text.replace("\n", " ")
        rows.append(
            (
                r.label,
                f"{mem['peak_bytes'] / 1024:.0f}",
                f"{mem['mean_bytes'] / 1024:.0f}",
                f"{mem['peak_fraction']:.3f}",
                f"{mem['mean_fraction']:.3f}",
                f"{mem['shared_bytes'] / 1024:.0f}" if mem["shared_bytes"] else "—",
                f"{r.timings.tokens_per_s:.1f}",
                f"{r.timings.compress_s:.3f}",
                text[:60] + ("…" if len(text) > 60 else ""),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    return "\n".join(lines)


def method_names(spec: str) -> list[str]:
    """Comma-separated names; ``all``, ``paper``, ``baselines``, ``recent`` and ``quantizers`` stand for the
    registered groups."""
    from kvlab.methods import methods

    groups = {"all": None, "paper": "paper", "baselines": "baseline", "recent": "recent", "quantizers": "quantizer"}
    out: list[str] = []
    for name in (m.strip() for m in spec.split(",") if m.strip()):
        out += [n for n, c in methods().items() if groups[name] in (None, c.group)] if name in groups else [name]
    return list(dict.fromkeys(out))


def ratio_budgets(text: str) -> str:
    """Compression ratios (fractions removed, kvpress) as budgets (fractions kept): "0.25,0.75" -> "0.75,0.25"."""
    out = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        try:
            r = float(x)
        except ValueError:
            r = -1.0
        if not 0 <= r < 1:
            raise BudgetError(f"ratio {x!r} is not valid; a ratio is the fraction of the cache removed, in [0, 1)")
        out.append(f"{round(1 - r, 6):g}")
    if not out:
        raise BudgetError("--ratios names no ratio; give e.g. 0.25,0.5,0.75")
    return ",".join(out)


def cmd_methods() -> int:
    from kvlab.methods import methods

    for name, cls in methods().items():
        print(f"{name:16s} [{cls.group}] {cls.summary}")
        for p in cls.params:
            print(f"    {p.name}={p.default!r}: {p.help}")
    from kvlab.methods.paper_presets import PRESETS

    for name, preset in PRESETS.items():  # each paper's operating point (its settings, cited)
        print(f"{name:16s} [preset of {preset.method}] {preset.summary}")
        for s in preset.settings:
            print(f"    {s.param}={s.value!r}: {s.where}")
    return 0


def cmd_compare(args) -> int:
    from kvlab.core.model import ModelLoadError
    from kvlab.engine.loader import load_model
    from kvlab.engine.specs import GenerationSettings, InputError
    from kvlab.measure.metrics import ProbeSettings
    from kvlab.run import Comparison, stream

    _check_questions(args)
    text = "" if args.task else _read_prompt(args)
    try:
        budgets = parse_budgets(args.budget)
    except BudgetError as exc:
        raise CliError(str(exc)) from None
    comparison = Comparison(
        text,
        method_names(args.methods),
        budgets,
        params=_parse_params(args.param),
        settings=GenerationSettings(
            max_new_tokens=32 if args.max_new_tokens is None else args.max_new_tokens,
            do_sample=args.sample,
            temperature=args.temperature,
            seed=args.seed,
        ),
        measure=ProbeSettings() if args.probes else None,
        chat=not args.no_chat,
        questions=args.question,
        protocol=None if args.task else args.protocol,  # a task's protocol is checked once the task exists
    )
    try:
        comparison.check()
    except InputError as exc:
        raise CliError(str(exc)) from None
    t0 = time.perf_counter()
    try:
        lm = load_model(args.model, args.device, args.dtype, args.trust_remote_code, cache_dtype=args.cache_dtype)
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None
    load_s = time.perf_counter() - t0
    if args.task:
        from kvlab.tasks import TaskError, make_task

        try:
            comparison.source = make_task(args.task, args.length, args.seed, comparison.encoder(lm))
        except TaskError as exc:
            raise CliError(str(exc)) from None
        if args.max_new_tokens is None and comparison.source.max_new_tokens:
            comparison.settings.max_new_tokens = comparison.source.max_new_tokens
        comparison.protocol = args.protocol
        try:
            comparison.check()
        except InputError as exc:
            raise CliError(str(exc)) from None
    results: list[CompareResult] = []
    try:
        for ev in stream(lm, comparison):
            if not args.quiet and _shown(ev):
                print(f"[kvlab] {ev.message}", file=sys.stderr)
            if ev.kind == "done":
                results = ev.results or []
    except InputError as exc:
        raise CliError(str(exc)) from None
    paths = json_paths(args.json, len(results)) if args.json else []
    for j, result in enumerate(results):
        result.timings["load_s"] = load_s
        if j == 0:
            print(
                f"model {result.model['id']} on {result.model['device']} ({result.model['dtype']}, "
                f"cache {result.model.get('cache_dtype', result.model['dtype'])}); load {load_s:.1f} s"
            )
        print(_header(result, j, len(results)))
        print(format_table(result))
        if paths:
            Path(paths[j]).write_text(json.dumps(result.to_json(), indent=1))
    if len(paths) > 1:
        print("JSON: " + ", ".join(paths))
    return 0


def _header(result, j: int, n: int) -> str:
    """One line per result: its protocol, question and token counts, its time."""
    where = f"question {j + 1} of {n} " if n > 1 else ""
    asked = f"{result.question.strip()!r}, " if result.question else ""
    ctx = f" (context {result.context_tokens})" if result.context_tokens else ""
    return (
        f"{where}[{result.protocol}] {asked}prompt {result.prompt_tokens} tokens{ctx}; "
        f"compare {result.timings['compare_s']:.1f} s"
    )


def json_paths(path: str, n: int) -> list[str]:
    """Where ``--json PATH`` writes n results: PATH, then PATH with -q2, -q3 ... before its suffix."""
    p = Path(path)
    return [path] + [str(p.with_name(f"{p.stem}-q{j + 1}{p.suffix}")) for j in range(1, n)]


def _shown(ev) -> bool:
    """Progress lines on stderr: prefill, each compression, each finished run, every 8th decode step."""
    if ev.kind in ("prefill", "compress", "run_done"):
        return True
    return ev.kind == "step" and (ev.step % 8 == 0 or ev.step == ev.total)


def able_suite(model: str, lengths: list[int]) -> list[str]:
    """RULER's tasks that exact does right (calibrated mean >= ``exact_accuracy.ABLE``) on ``model`` at every
    length of ``lengths``; ``CliError`` when there are none, naming the calibration to run."""
    from kvlab.engine.embedded import embedded
    from kvlab.tasks import RULER_TASKS
    from kvlab.tasks.exact_accuracy import ABLE, able

    carried = embedded(model)
    model_id = carried.display if carried else model
    tasks = [t for t in RULER_TASKS if all(able(model_id, t, n) for n in lengths)]
    if not tasks:
        at = ", ".join(str(n) for n in lengths)
        raise CliError(
            f"no RULER task is calibrated as one exact does right (>= {ABLE}) on {model!r} at {at} tokens; "
            f"calibrate it (python -m bench.ruler_calibrate --model {model}) or name tasks with --task"
        )
    return tasks


def cmd_sweep(args) -> int:
    from kvlab.engine.comparison import Engine
    from kvlab.engine.specs import InputError, expand_runs
    from kvlab.sweep import SweepConfig, budget_labels, run_sweep
    from kvlab.tasks import OWN_TASKS, SUITES, TASKS, TaskError, parse_length

    if args.suite == "able":
        task = ",".join(able_suite(args.model, [parse_length(x) for x in args.lengths.split(",") if x.strip()]))
    else:
        task = ",".join(SUITES[args.suite]) if args.suite else args.task
    for name in task.split(","):
        if name not in TASKS and not name.startswith(("file:", "hub:")):
            raise CliError(f"unknown task {name!r}; allowed: {', '.join(TASKS)}, file:PATH or hub:REPO")
    if args.ratios is not None and args.budgets is not None:
        raise CliError("give --budgets (fractions kept) or --ratios (fractions removed), not both")
    try:
        lengths = [parse_length(x) for x in args.lengths.split(",") if x.strip()]
        budgets = budget_labels(ratio_budgets(args.ratios) if args.ratios is not None else args.budgets or "0.5,0.25")
    except (TaskError, BudgetError) as exc:
        raise CliError(str(exc)) from None
    methods = method_names(args.methods)
    if args.ratios is not None and "exact" not in methods:
        methods = ["exact", *methods]  # the leaderboard's ratio-0 row, the reference every ratio is read against
    try:
        expand_runs(methods, [])
    except InputError as exc:
        raise CliError(str(exc)) from None
    if args.seeds < 1 or not lengths:
        raise CliError("--seeds must be >= 1 and --lengths must name at least one length")
    try:
        depths = [float(x) for x in args.depths.split(",") if x.strip()]
    except ValueError:
        depths = [-1.0]
    if not all(0 <= d <= 1 for d in [*depths, args.depth]):
        raise CliError(f"--depth/--depths {args.depths or args.depth!r}: numbers in [0, 1], e.g. 0,0.25,0.5,0.75,1")
    own = all(t in OWN_TASKS for t in task.split(","))  # kvlab's own tasks keep 16 (and their cells' keys)
    cfg = SweepConfig(
        task,
        lengths,
        methods,
        budgets,
        args.seeds,
        args.max_new_tokens if args.max_new_tokens is not None else (16 if own else None),
        args.probes,
        args.depth,
        args.model,
        args.out,
        depths=sorted(set(depths)),
        protocol=args.protocol,
        fidelity=args.fidelity,
    )

    def engine_factory():
        import os

        from kvlab.engine.loader import load_model

        device = args.device
        if device == "auto" and int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("LOCAL_RANK"):
            import torch

            if torch.cuda.is_available():
                device = f"cuda:{int(os.environ['LOCAL_RANK']) % torch.cuda.device_count()}"
        return Engine(load_model(args.model, device, cache_dtype=args.cache_dtype))

    log = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr))
    report = run_sweep(cfg, engine_factory, log)
    if report is not None:
        print(f"report: {report}")
    return 0


def cmd_reproduce(args) -> int:
    from kvlab.reproduce.docs import write_docs
    from kvlab.reproduce.registry import UnknownReproduction
    from kvlab.reproduce.runner import RejudgeError, expand, rejudge_reproductions, run_reproductions
    from kvlab.reproduce.setup import ReproductionSetup

    root = Path(__file__).resolve().parents[1]
    if args.docs_from:
        if not Path(args.docs_from).is_file():
            raise CliError(f"--docs-from: no such file {args.docs_from!r} (a summary.json written by reproduce all)")
        try:
            written = write_docs(args.docs_from, root)
        except ValueError as exc:
            raise CliError(f"--docs-from: {exc}") from None
        for path in written:
            print(f"wrote {path}")
        return 0
    if args.rejudge:
        try:
            rejudge_reproductions(args.rejudge, args.out)
        except (RejudgeError, UnknownReproduction) as exc:
            raise CliError(str(exc)) from None
        return 0
    if not args.name:
        raise CliError("reproduce: give a reproduction's name or all (or --docs-from SUMMARY, --rejudge NAME.json); "
                       "allowed: " + ", ".join((*REPRODUCTIONS, *APART)) + ", all")  # fmt: skip
    also = tuple(m for m in args.also.split(",") if m.strip() and m.strip() != "none")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    ctx = ReproductionSetup(quick=args.quick, model=args.model, device=args.device, models=also)
    if args.quiet:
        ctx.log = lambda m: None
    try:
        run_reproductions(expand(args.name), ctx, args.out)
    except UnknownReproduction as exc:
        raise CliError(str(exc)) from None
    if args.docs:
        for path in write_docs(Path(args.out) / "summary.json", root):
            print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "compare":
            return cmd_compare(args)
        if args.command == "methods":
            return cmd_methods()
        if args.command == "sweep":
            return cmd_sweep(args)
        if args.command == "tasks" and args.tasks_command == "calibrate":
            from kvlab.calibrate import main as calibrate_main

            return calibrate_main(args, CliError, argv)
        if args.command == "reproduce":
            return cmd_reproduce(args)
        parser.print_help()
        return 2
    except CliError as exc:
        print(f"kvlab: error: {exc}", file=sys.stderr)
        return 2
    except TimeLimit as exc:  # KVLAB_TIME_LIMIT_S met before the first token
        print(f"kvlab: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if not _refused_model(exc):
            raise
        print(f"kvlab: error: {exc}", file=sys.stderr)  # a sweep's, a calibration's or a reproduction's model
        return 2


def _refused_model(exc: Exception) -> bool:
    """Whether ``exc`` is a ``ModelLoadError`` (its module is imported only once a command loaded a model)."""
    model = sys.modules.get("kvlab.core.model")
    return model is not None and isinstance(exc, model.ModelLoadError)
