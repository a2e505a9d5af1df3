"""The papers' claims, as the committed reproduction summary judged them, in HTML for the page.

Reads ``summary.json`` as ``python -m kvlab reproduce all`` writes it (``kvlab.reproduce.runner``): the
invocation, the tally, and three lists of registry entries, ``claims`` (the papers' claims),
``implementation_verified`` (kvlab's own code checked against a proved statement) and ``controls``; each
entry carries its id, statement, quote (paper, where, the quoted text), the paper's operating point, where
kvlab measures it, its threshold, its verdict (overall and per model), its reproduction and the indices
of its rows in that reproduction's ``rows`` (the evidence: kvlab's number, n and the 95% interval).
Nothing is recomputed: every number shown is the file's.

Verdicts are shown as one of four chips: holds, does not hold, inconclusive, not testable (the words the
file gives, "not testable here" or "not testable at this scale", are kept on the chip).
"""

from __future__ import annotations

import html
from dataclasses import dataclass

CHIPS = {  # chip class -> (label, colours)
    "holds": ("holds", "#166534", "#dcfce7"),
    "does-not-hold": ("does not hold", "#991b1b", "#fee2e2"),
    "inconclusive": ("inconclusive", "#92400e", "#fef3c7"),
    "not-testable": ("not testable", "#374151", "#e5e7eb"),
}
VERDICT_CHIP = {
    "holds": "holds",
    "does not hold": "does-not-hold",
    "inconclusive": "inconclusive",
    "not testable here": "not-testable",
    "not testable at this scale": "not-testable",
}
FILTERS = ("holds", "does not hold", "inconclusive", "not testable")  # the verdict filter's choices
GROUPS = {"claims": "The papers' claims", "implementation_verified": "Implementation verified", "controls": "Controls"}


class SummaryError(ValueError):
    """A summary file this view cannot read (an older format, or not a summary)."""


def chip_of(verdict: str) -> str:
    """The chip class of a verdict ("not testable at this scale" -> "not-testable")."""
    return VERDICT_CHIP.get(verdict, "inconclusive")


def filter_of(verdict: str) -> str:
    """The verdict filter's word for a verdict."""
    return CHIPS[chip_of(verdict)][0]


def chip(verdict: str, model: str = "") -> str:
    """A verdict chip (HTML): the file's words, coloured by which of the four it is."""
    label, fg, bg = CHIPS[chip_of(verdict)]
    words = verdict if verdict else label
    who = f"{html.escape(model)}: " if model else ""
    return (
        f"<span class='kv-chip kv-chip-{chip_of(verdict)}' style='color:{fg};background:{bg};border:1px solid {fg}33;"
        f"border-radius:999px;padding:1px 9px;font-size:.85em;white-space:nowrap'>{who}{html.escape(words)}</span>"
    )


def paper_of(entry: dict) -> str:
    """The paper an entry belongs to: its quote's paper, else its id's prefix ("scissorhands:..." -> scissorhands)."""
    quote = entry.get("quote") or {}
    return str(quote.get("paper") or str(entry.get("id", "")).split(":")[0])


@dataclass
class Summary:
    """The parts of a reproduction summary the page shows."""

    data: dict

    @classmethod
    def of(cls, data: object) -> Summary:
        """Check the format: the invocation, the tally and the three lists (``SummaryError`` otherwise)."""
        if not isinstance(data, dict) or not isinstance(data.get("reproductions"), dict):
            raise SummaryError("not a reproduction summary: it has no 'reproductions'")
        if not all(isinstance(data.get(g), list) for g in GROUPS):
            raise SummaryError(
                "the summary predates claim ids (no 'claims', 'implementation_verified' and 'controls' lists): "
                "regenerate it with `python -m kvlab reproduce all`"
            )
        return cls(data)

    def entries(self, group: str = "claims") -> list[dict]:
        return list(self.data.get(group) or [])

    def papers(self) -> list[str]:
        return sorted({paper_of(e) for g in GROUPS for e in self.entries(g)})

    def rows_of(self, entry: dict) -> list[dict]:
        """The entry's rows (evidence first, then context), as its reproduction stored them."""
        rows = (self.data["reproductions"].get(entry.get("reproduction"), {}) or {}).get("rows") or []
        mine = [rows[i] for i in entry.get("rows", []) if isinstance(i, int) and 0 <= i < len(rows)]
        return sorted(mine, key=lambda r: r.get("kind") == "context")

    def command_of(self, entry: dict) -> str:
        return str((self.data["reproductions"].get(entry.get("reproduction"), {}) or {}).get("command", ""))

    def tally_text(self) -> str:
        """The tally in one sentence, claims first, the implementation checks and the controls apart."""
        t = self.data.get("tally") or {}

        def words(counts: dict) -> str:
            n = sum(counts.values())
            parts = [f"{c} {v}" for v, c in counts.items() if c]
            return f"{n}" + (f" ({', '.join(parts)})" if parts else "")

        return (
            f"The papers' claims: {words(t.get('claims', {}))}. Implementation verified, apart: "
            f"{words(t.get('implementation_verified', {}))}. Controls, apart: {words(t.get('controls', {}))}."
        )

    def run_text(self) -> str:
        inv = self.data.get("invocation") or {}
        models = ", ".join(inv.get("models") or []) or "?"
        return (
            f"<code>{html.escape(str(inv.get('command', '?')))}</code> on {html.escape(models)}, "
            f"{float(inv.get('seconds') or 0):,.0f} s, started {html.escape(str(inv.get('started', '?')))}"
        )


def _interval(row: dict) -> str:
    """ "n = 12, [0.31, 0.55]" from a row (its own numbers), or "n = 1", or ""."""
    n, iv = row.get("n"), row.get("interval")
    if n is None:
        return ""
    out = f"n = {n}"
    if iv:
        out += f", 95% interval [{iv[0]:.4g}, {iv[1]:.4g}]"
    if row.get("min_n") is not None and row.get("kind") != "context":
        out += f"; passes from n = {row['min_n']}"
    return out


def evidence_html(rows: list[dict]) -> str:
    """The rows under an entry: setting (model), the paper's number, kvlab's, n and interval, the row's verdict."""
    if not rows:
        return "<p class='kv-claim-none'>no rows measured</p>"
    head = "<tr><th>setting</th><th>paper</th><th>kvlab</th><th>n, 95% interval</th><th>row</th></tr>"
    body = []
    for r in rows:
        setting = str(r.get("setting", "")) + (f" [{r['model']}]" if r.get("model") else "")
        verdict = "context" if r.get("kind") == "context" else str(r.get("verdict") or "")
        note = f"<br><small>{html.escape(str(r['note']))}</small>" if r.get("note") else ""
        shown_verdict = (chip(verdict) if verdict != "context" else "(context)") + note
        cells = [html.escape(setting), html.escape(str(r.get("paper", ""))), html.escape(str(r.get("kvlab", ""))),
                 html.escape(_interval(r)), shown_verdict]  # fmt: skip
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table class='kv-claim-rows'>{head}{''.join(body)}</table>"


def claim_card(s: Summary, e: dict) -> str:
    """One claim: paper and quote, operating point, verdict chip (and per model), effect rows, the command."""
    quote = e.get("quote") or {}
    point = e.get("point") or {}
    by_model = e.get("by_model") or {}
    models = " ".join(chip(v, m) for m, v in by_model.items()) if len(by_model) > 1 else ""
    quoted = " ".join(str(quote.get("quote", "")).split())
    point_text = "; ".join(str(point.get(k, "")) for k in ("model", "length", "setting", "metric") if point.get(k))
    scale = f"<p><b>Scale:</b> the paper ties it to {html.escape(str(e['scale']))}.</p>" if e.get("scale") else ""
    threshold = e.get("threshold") or {}
    return (
        f"<div class='kv-claim' style='border:1px solid #d1d5db;border-radius:8px;padding:8px 12px;margin:10px 0' "
        f"data-id='{html.escape(str(e.get('id', '')))}' "
        f"data-verdict='{html.escape(str(e.get('verdict', '')))}' data-paper='{html.escape(paper_of(e))}'>"
        f"<div class='kv-claim-head'>{chip(str(e.get('verdict', '')))} <b>{html.escape(paper_of(e))}</b> · "
        f"<code>{html.escape(str(e.get('id', '')))}</code> {models}</div>"
        f"<p class='kv-claim-statement'>{html.escape(str(e.get('statement', '')))}</p>"
        + (
            f"<blockquote class='kv-claim-quote'>“{html.escape(quoted)}” "
            f"<small>({html.escape(str(quote.get('where', '')))}; the paper's number: "
            f"{html.escape(str(quote.get('value', '')))})</small></blockquote>"
            if quoted
            else ""
        )
        + f"<p><b>The paper's operating point:</b> {html.escape(point_text) or '—'}</p>"
        + (f"<p><b>kvlab measures:</b> {html.escape(str(e['kvlab_point']))}</p>" if e.get("kvlab_point") else "")
        + scale
        + f"<p><b>Decided by:</b> {html.escape(str(threshold.get('rule', '')))} "
        f"<small>({html.escape(str(threshold.get('source', '')))})</small></p>"
        + f"<p><b>Effect</b> (kvlab's number, n, 95% interval):</p>{evidence_html(s.rows_of(e))}"
        + f"<p class='kv-claim-command'><b>Reproduce:</b> <code>{html.escape(s.command_of(e))}</code></p></div>"
    )


def entries_table(s: Summary, entries: list[dict], group: str) -> str:
    """The implementation checks or the controls: id, what, the verdict, the rows' numbers, the command."""
    if not entries:
        return f"<p id='kv-{group}-none'>none in this summary</p>"
    head = "<tr><th>id</th><th>what</th><th>verdict</th><th>kvlab (n, 95% interval)</th><th>reproduce</th></tr>"
    body = []
    for e in entries:
        rows = [r for r in s.rows_of(e) if r.get("kind") != "context"]
        nums = "; ".join(
            f"{r.get('kvlab', '')} ({_interval(r)})" if _interval(r) else str(r.get("kvlab", "")) for r in rows
        )
        command = f"<code>{html.escape(s.command_of(e))}</code>"
        cells = [f"<code>{html.escape(str(e.get('id', '')))}</code>", html.escape(str(e.get("statement", ""))),
                 chip(str(e.get("verdict", ""))), html.escape(nums), command]  # fmt: skip
        body.append(
            f"<tr class='kv-entry' data-verdict='{html.escape(str(e.get('verdict', '')))}' "
            f"data-paper='{html.escape(paper_of(e))}'>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"
        )
    return f"<table class='kv-entries' id='kv-{group}'>{head}{''.join(body)}</table>"


def shown(entries: list[dict], papers: list[str] | None, verdicts: list[str] | None) -> list[dict]:
    """The entries the filters keep (an empty filter keeps everything)."""
    return [
        e
        for e in entries
        if (not papers or paper_of(e) in papers) and (not verdicts or filter_of(str(e.get("verdict", ""))) in verdicts)
    ]


def claims_html(s: Summary, papers: list[str] | None = None, verdicts: list[str] | None = None) -> str:
    """The claims section: one card per claim the filters keep, with the count shown of the count in the file."""
    every = s.entries("claims")
    keep = shown(every, papers, verdicts)
    head = f"<p id='kv-claims-count'>{len(keep)} of {len(every)} claims shown</p>"
    return head + "".join(claim_card(s, e) for e in keep)


def apart_html(s: Summary, papers: list[str] | None = None, verdicts: list[str] | None = None) -> str:
    """The implementation checks and the controls, apart from the claims, filtered the same way."""
    out = []
    for group in ("implementation_verified", "controls"):
        every = s.entries(group)
        keep = shown(every, papers, verdicts)
        out.append(f"<h4>{GROUPS[group]} ({len(keep)} of {len(every)})</h4>{entries_table(s, keep, group)}")
    return "".join(out)


__all__ = [
    "CHIPS",
    "FILTERS",
    "Summary",
    "SummaryError",
    "apart_html",
    "chip",
    "claims_html",
    "filter_of",
    "paper_of",
    "shown",
]
