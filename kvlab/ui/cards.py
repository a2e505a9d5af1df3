"""HTML pieces of the page: progress bar, one card per run, the kept-token strip.

Every text that comes from a prompt or a model goes through ``html.escape``: it is shown as text,
never as markup.
"""

from __future__ import annotations

import html

import numpy as np

from kvlab.core.model import LoadedModel
from kvlab.core.results import QUERY_AGNOSTIC, CompareResult, RunResult
from kvlab.measure.health import budget_overrun
from kvlab.measure.metrics import token_diff
from kvlab.methods import UnknownMethodError, get, methods
from kvlab.report import comparison_figures as plots
from kvlab.report.charts import finite
from kvlab.report.leaderboard import protocol_text
from kvlab.ui.config import GROUP_TITLES


def progress_html(frac: float, message: str) -> str:
    pct = max(0.0, min(1.0, frac)) * 100
    return (
        f"<div class='kv-progress' role='progressbar' aria-valuenow='{pct:.0f}'>"
        f"<div class='kv-progress-bar' style='width:{pct:.1f}%'></div></div>"
        f"<div class='kv-progress-msg'>{html.escape(message)}</div>"
    )


def source_html(result: CompareResult | None) -> str:
    """Where the numbers below come from: the model, the protocol, the prompt and the generation settings."""
    if result is None:
        return "<div id='kv-source-line' class='kv-source'></div>"
    model = str((result.model or {}).get("id", "?"))
    s = result.settings or {}
    gen = "sampled" if s.get("do_sample") else "greedy"
    new = s.get("max_new_tokens")
    prompt = (
        f"{result.context_tokens} context tokens, the question fed after"
        if result.protocol == QUERY_AGNOSTIC
        else f"{result.prompt_tokens} prompt tokens"
    )
    return (
        f"<div id='kv-source-line' class='kv-source' style='font-size:.86em;color:#374151'><b>Model:</b> "
        f"{html.escape(model)} · <b>protocol:</b> {html.escape(protocol_text(result.protocol))} · "
        f"{html.escape(prompt)} · {html.escape(str(new))} new tokens, {gen}</div>"
    )


def _pieces(ids: list[int], lm: LoadedModel | None) -> list[str]:
    if lm is None:
        return [f"⟨{i}⟩" for i in ids]
    return [lm.decode([i]) for i in ids]


def diff_opcodes(run: RunResult, exact: RunResult | None) -> list:
    """The stored token diff against exact, else computed (a result saved without text metrics)."""
    ops = plots.metric(run, "diff")
    if ops or exact is None:
        return ops or []
    return token_diff(exact.token_ids, run.token_ids).opcodes


def first_divergence(run: RunResult, exact: RunResult | None) -> int | None:
    fd = plots.metric(run, "first_divergence")
    if fd is not None or exact is None:
        return fd
    return token_diff(exact.token_ids, run.token_ids).first_divergence


def diff_text_html(run: RunResult, exact: RunResult | None, lm: LoadedModel | None) -> str:
    """The run's text, with the tokens that differ from the exact run highlighted."""
    if exact is None or run is exact or not run.token_ids:
        return html.escape(run.text)
    pieces = _pieces(run.token_ids, lm) if lm is not None else None
    if pieces is None or "".join(pieces).strip() != run.text.strip():
        pieces = None
    if pieces is None:  # no tokenizer for this result: show plain text
        return html.escape(run.text)
    out = []
    for tag, _i1, _i2, j1, j2 in diff_opcodes(run, exact):
        seg = html.escape("".join(pieces[j1:j2]))
        if not seg:
            if tag == "delete":
                out.append("<span class='kv-del' title='exact had more here'>⌫</span>")
            continue
        out.append(seg if tag == "equal" else f"<mark class='kv-diff'>{seg}</mark>")
    return "".join(out)


def _card(
    run: RunResult,
    exact: RunResult | None,
    lm: LoadedModel | None,
    group: str,
    color: str,
    live: bool = False,
    overrun: str = "",
) -> str:
    if run.finish_reason == "refused":
        return _refused_card(run, group, color)
    mem = run.memory
    if run is exact or exact is None:
        div = "reference" if run is exact else "no exact run to compare"
    elif live:
        div = "running…"
    else:
        fd = first_divergence(run, exact)
        sim = plots.metric(run, "text_similarity")
        div = "identical to exact" if fd is None else f"differs from token {fd}"
        if finite(sim):
            div += f" · similarity {sim:.2f}"
    score = plots.metric(run, "task_score")
    extra = f"<span class='kv-chip'>task {score:.2f}</span>" if finite(score) else ""
    tps = f"{run.timings.tokens_per_s:.1f} tok/s" if run.timings.tokens_per_s else "—"
    return (
        f"<div class='kv-card kv-{html.escape(group)}' style='border-top-color:{color}'>"
        f"<div class='kv-card-head'><b>{html.escape(run.label)}</b>"
        f"<span class='kv-chip'>{html.escape(GROUP_TITLES.get(group, group))}</span>{extra}</div>"
        f"{memory_html(mem)}{overrun}<span>{tps}</span></div>{shared_html(run)}"
        f"<div class='kv-div'>{html.escape(div)}</div>{error_html(run)}{health_html(run)}"
        f"<pre class='kv-text'>{diff_text_html(run, exact, lm)}</pre></div>"
    )


LOW_BUDGET_USE = 0.75  # a run holding less than this share of its budget on average says so on its card


def memory_html(mem: dict) -> str:
    """The opening of a card's stats line: peak and mean KiB held over the run (``RunResult.memory``) against
    the exact cache's peak, the saving at the peak, and a chip when the run holds much less than its budget
    for most of the run."""
    saved = 100 * (1 - mem["peak_fraction"]) if mem["peak_fraction"] is not None else 0.0
    use = mem.get("budget_use")
    low = (
        f"<span class='kv-chip kv-underfill' title='mean over the run of bytes held / bytes the budget allows'>"
        f"holds {100 * use:.0f}% of its budget on average</span>"
        if use is not None and use < LOW_BUDGET_USE
        else ""
    )
    return (
        f"<div class='kv-stats'><span title='most held at any point (what the budget caps) / mean over the run'>"
        f"peak {mem['peak_bytes'] / 1024:,.0f} · mean {mem['mean_bytes'] / 1024:,.0f} / "
        f"{mem['exact_peak_bytes'] / 1024:,.0f} KiB</span><span>{saved:.0f}% saved</span>{low}"
    )


def overrun_html(run: RunResult, result: CompareResult) -> str:
    """A chip when the run's peak passes its budget by more than 5%: the factor and why
    (``health.budget_overrun``); nothing otherwise (and for a run of a method this kvlab does not know)."""
    try:
        streaming = bool(get(run.method).streaming)
    except UnknownMethodError:
        return ""
    agnostic = result.protocol == QUERY_AGNOSTIC and result.context_tokens
    n = result.context_tokens if agnostic else result.prompt_tokens
    over = budget_overrun(run, n, streaming, result.prompt_tokens - n if agnostic else 0)
    if over is None:
        return ""
    factor, reason = over
    return (
        "<span class='kv-chip kv-overrun' title='most bytes held / the budget&#39;s share of the exact cache&#39;s "
        f"most'>peak {factor:.1f}x budget: {html.escape(reason)}</span>"
    )


def shared_html(run: RunResult) -> str:
    """Per-model state shared across sequences (QJL's sketches), not counted in the bytes above; nothing if none."""
    shared = run.shared_bytes or {}
    total = sum(shared.values())
    if not total:
        return ""
    kinds = ", ".join(html.escape(str(k)) for k in shared)
    return (
        f"<div class='kv-shared'>shared across sequences: {total / 1024:,.0f} KiB ({kinds}; "
        "not counted above, count_sketch=true counts it per sequence)</div>"
    )


def _refused_card(run: RunResult, group: str, color: str) -> str:
    """A run whose method cannot hold its budget on this prompt: why, and the budget it can hold; no text."""
    return (
        f"<div class='kv-card kv-{html.escape(group)} kv-refused' style='border-top-color:{color}'>"
        f"<div class='kv-card-head'><b>{html.escape(run.label)}</b>"
        f"<span class='kv-chip'>{html.escape(GROUP_TITLES.get(group, group))}</span>"
        "<span class='kv-chip kv-refused-chip'>refused</span></div>"
        f"<div class='kv-flag'>⛔ <b>budget refused</b>: {html.escape(run.error)}</div></div>"
    )


def error_html(run: RunResult) -> str:
    """Why the run ended early (its method raised, or the time limit), as text; nothing when it ran to the end."""
    if not run.error:
        return ""
    what = "stopped" if run.finish_reason == "time_limit" else "ended on an error"
    return f"<div class='kv-flag kv-error'>✖ <b>{what}</b>: {html.escape(str(run.error))}</div>"


def health_html(run: RunResult) -> str:
    """The run's health flags (kvlab.measure.health), one warning line each; nothing when it has none."""
    flags = [f for f in (run.health or []) if isinstance(f, dict)]
    esc = lambda key, f: html.escape(str(f.get(key, "")))  # noqa: E731
    return "".join(f"<div class='kv-flag'>⚠ <b>{esc('flag', f)}</b>: {esc('detail', f)}</div>" for f in flags)


def cards_html(result: CompareResult | None, lm: LoadedModel | None, live: bool = False) -> str:
    if result is None or not result.runs:
        return (
            "<div class='kv-empty'>Run a comparison (or load a JSON export) to see one card per method × budget.</div>"
        )
    exact = next((r for r in result.runs if r.method == "exact"), None)
    groups = {n: c.group for n, c in methods().items()}
    for r in result.runs:  # names made on demand (``decoding-keydiff``, ``ada-knorm``): their own group
        if r.method not in groups:
            try:
                groups[r.method] = get(r.method).group
            except UnknownMethodError:
                pass
    return (
        prompt_head_html(result)
        + "<div class='kv-cards'>"
        + "".join(
            _card(
                r,
                exact,
                lm,
                groups.get(r.method, "baseline"),
                plots.color_of(result, r.label),
                live and r is not exact,
                "" if live else overrun_html(r, result),
            )
            for r in result.runs
        )
        + "</div>"
    )


PROMPT_SHOWN = 160  # characters of the prompt shown above the cards


def prompt_head_html(result: CompareResult) -> str:
    """What the runs ran on, above the cards: the prompt's token count and its first words."""
    text = " ".join(result.prompt.split())
    shown = text if len(text) <= PROMPT_SHOWN else text[: PROMPT_SHOWN - 1] + "…"
    what = f"{result.prompt_tokens:,} prompt tokens"
    if result.protocol == QUERY_AGNOSTIC and result.context_tokens:
        what += f" ({result.context_tokens:,} of context compressed, then the question)"
    quote = f": <q class='kv-prompt-text'>{html.escape(shown)}</q>" if shown else ""
    return f"<div class='kv-prompt-head'>Ran on <b class='kv-prompt-tokens'>{what}</b>{quote}</div>"


def kept_strip_html(result: CompareResult | None, label: str | None, lm: LoadedModel | None) -> str:
    """The prompt's text, token by token; tokens the chosen run evicted are struck through and faded.

    Below it, one thin strip per run: each cell a prompt position, dark where kept (at the map's
    layer/KV head) or shaded by the fraction of (layer, KV head) pairs keeping it.
    """
    if result is None or not result.runs:
        return "<div class='kv-empty'>no result yet</div>"
    runs = plots.compressed_runs(result)
    bars = [_density_bar(r, result.prompt_tokens) for r in runs]
    bars = [b for b in bars if b]
    run = next((r for r in runs if r.label == label), runs[0] if runs else None)
    kept = plots.kept_of(run) if run is not None else None
    if run is not None and kept is None and plots.attn_map(run) is not None:
        parts_note = (
            f"<div class='kv-strip-title'>{html.escape(run.label)} keeps every prompt position "
            "(compressed), so no token is evicted</div>"
        )
    else:
        parts_note = ""
    if run is None or (kept is None and not bars):
        return (
            "<div class='kv-empty'>no kept positions in this result (turn the measurements on; sketched or "
            "clustered caches keep no token positions)</div>"
        )
    parts = [parts_note] if parts_note else []
    if kept is not None:
        keep = set(kept)
        pieces = _pieces(result.prompt_token_ids, lm)
        toks = "".join(
            f"<span class='{'kv-kept' if i in keep else 'kv-evicted'}'>{html.escape(p)}</span>"
            for i, p in enumerate(pieces)
        )
        site = plots.map_site(result)
        where = f" (layer {site[0]}, KV head of query head {site[1]})" if site else ""
        parts.append(
            f"<div class='kv-strip-title'>{html.escape(run.label)}: {len(keep)} of "
            f"{result.prompt_tokens} prompt tokens kept{html.escape(where)}</div>"
            f"<div class='kv-strip-text'>{toks}</div>"
        )
    if bars:
        parts.append("<div class='kv-strip-title'>Kept density over all layers and KV heads</div>" + "".join(bars))
    return "<div class='kv-strip'>" + "".join(parts) + "</div>"


BAR_STOPS = 400  # colour stops of a density bar at most


def _density_bar(run: RunResult, n: int) -> str:
    dens = (run.extras or {}).get("kept_density")
    if not dens:
        return ""
    if len(dens) > BAR_STOPS:  # a long prompt: the mean of each stretch of positions (the bar is ~1,000 px)
        pooling = plots.Pooling.of(len(dens), BAR_STOPS)
        dens = pooling.pool(np.array([[float(d or 0.0) for d in dens]]), "mean")[0].tolist()
    grad = ",".join(
        f"rgba(31,119,180,{0.08 + 0.92 * float(d):.2f}) {100 * i / len(dens):.2f}% {100 * (i + 1) / len(dens):.2f}%"
        for i, d in enumerate(dens)
    )
    return (
        f"<div class='kv-bar-row'><span class='kv-bar-label'>{html.escape(run.label)}</span>"
        f"<span class='kv-bar' style='background:linear-gradient(90deg,{grad})'></span></div>"
    )
