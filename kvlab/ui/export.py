"""Export of a stored result: the JSON itself, a CSV of the metrics and a static HTML report.

Exports are written to temporary folders (``kvlab-export-*``); each export removes the folders
older than ``KVLAB_EXPORT_TTL_S`` seconds (default 3600), and the page asks Gradio to clear its
own file cache at the same age, so a long-running page does not pile up files.
"""

from __future__ import annotations

import csv
import html
import io
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from kvlab.core.model import LoadedModel
from kvlab.core.results import CompareResult
from kvlab.report import comparison_figures as plots
from kvlab.ui.cards import cards_html
from kvlab.ui.config import CSS

SUMMARY_METRICS = (
    "attn_rel_error_mean",
    "kl_mean",
    "top1_agreement",
    "perplexity",
    "first_divergence",
    "text_similarity",
    "task_score",
)


def metrics_csv(result: CompareResult) -> str:
    """One row per run: bytes (after compression; the peak and mean over the run with their fractions of the
    exact cache's; budget use; shared per-model bytes), timings and the scalar metrics."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(
        [
            "run",
            "method",
            "budget",
            "kv_bytes",
            "exact_bytes",
            "fraction_held",
            "peak_bytes",
            "mean_bytes",
            "peak_fraction",
            "mean_fraction",
            "budget_use",
            "shared_bytes",
            "tokens_per_s",
            "prefill_s",
            "compress_s",
            "decode_s",
            *SUMMARY_METRICS,
            "text",
        ]
    )
    for r in result.runs:
        ex = plots.exact_bytes_at_prefill(r)
        mem = r.memory
        w.writerow(
            [
                r.label,
                r.method,
                r.budget or "",
                r.kv_bytes,
                ex,
                f"{r.kv_bytes / ex:.4f}" if ex else "",
                *(
                    "" if mem[k] is None else mem[k]
                    for k in (
                        "peak_bytes",
                        "mean_bytes",
                        "peak_fraction",
                        "mean_fraction",
                        "budget_use",
                        "shared_bytes",
                    )
                ),
                f"{r.timings.tokens_per_s:.2f}",
                f"{r.timings.prefill_s:.3f}",
                f"{r.timings.compress_s:.3f}",
                f"{r.timings.decode_s:.3f}",
                *["" if plots.metric(r, k) is None else plots.metric(r, k) for k in SUMMARY_METRICS],
                r.text,
            ]
        )
    return buf.getvalue()


def report_html(result: CompareResult, lm: LoadedModel | None = None) -> str:
    """A self-contained static HTML page of the run: settings, cards and every overview figure."""
    figs = plots.overview_figures(result)
    figs["attention"] = plots.attention_heatmaps(result)
    body = []
    for i, fig in enumerate(figs.values()):
        body.append(
            fig.to_html(
                full_html=False, include_plotlyjs="inline" if i == 0 else False, default_height=fig.layout.height
            )
        )
    settings = html.escape(json.dumps(result.settings))
    prompt = html.escape(result.prompt[:4000] + ("…" if len(result.prompt) > 4000 else ""))
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvlab report</title>"
        f"<style>{CSS} body{{font-family:system-ui,sans-serif;max-width:1200px;margin:auto;padding:16px}}</style>"
        "</head><body><h1>kvlab report</h1>"
        f"<p>Model <b>{html.escape(str(result.model.get('id', '')))}</b> on "
        f"{html.escape(str(result.model.get('device', '')))}"
        f" · prompt {result.prompt_tokens} tokens · settings <code>{settings}</code></p>"
        f"<details><summary>Prompt</summary><pre class='kv-text'>{prompt}</pre></details>"
        f"{cards_html(result, lm)}{''.join(body)}</body></html>"
    )


PREFIX = "kvlab-export-"


def export_ttl_s() -> int:
    """How long an export's files are kept, in seconds (``KVLAB_EXPORT_TTL_S``, default 3600)."""
    return max(1, int(float(os.environ.get("KVLAB_EXPORT_TTL_S", 3600))))


def remove_old_exports(ttl_s: float | None = None, root: str | Path | None = None) -> int:
    """Remove the export folders older than ``ttl_s`` seconds from the temp folder; returns how many."""
    ttl = export_ttl_s() if ttl_s is None else ttl_s
    now, removed = time.time(), 0
    for d in Path(root or tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            if d.is_dir() and now - d.stat().st_mtime > ttl:
                shutil.rmtree(d, ignore_errors=True)
                removed += 1
        except OSError:
            continue
    return removed


def export_files(result: CompareResult, lm: LoadedModel | None) -> list[str]:
    remove_old_exports()
    out = Path(tempfile.mkdtemp(prefix=PREFIX))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    paths = {
        out / f"kvlab-{stamp}.json": result.dumps(),
        out / f"kvlab-{stamp}-metrics.csv": metrics_csv(result),
        out / f"kvlab-{stamp}-report.html": report_html(result, lm),
    }
    for p, text in paths.items():
        p.write_text(text, encoding="utf-8")
    return [str(p) for p in paths]
