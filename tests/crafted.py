"""Hostile result files for the import control: HTML and script in every string field, huge arrays, NaN."""

from __future__ import annotations

import json

XSS = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script><b id=kv-injected>x</b>'
LINK = "<a href='javascript:window.__pwned=3'>link</a>"


def _run(method: str, budget: str | None, text: str) -> dict:
    return {
        "method": method,
        "budget": budget,
        "params": {XSS: XSS, "window": LINK},
        "text": text,
        "token_ids": [1, 2, 3],
        "kv_bytes": 1000,
        "kv_bytes_breakdown": {XSS: 1000},
        "kv_bytes_per_step": [1000, 1100, 1200],
        "exact_kv_bytes_per_step": [4000, 4100, 4200],
        "finish_reason": XSS,
        "timings": {"prefill_s": 0.1, "compress_s": 0.0, "decode_s": 0.2, "tokens_per_s": 10.0},
        "metrics": {XSS: XSS, "attn_rel_error": [[0.1, 0.2], [0.2, 0.3]], "diff": [[XSS, 0, 1, 0, 1]]},
        "extras": {XSS: [XSS], "kept_positions": [0, 1]},
        "health": [{"flag": XSS, "detail": LINK}],
        "error": XSS,
    }


def hostile_strings() -> dict:
    """A file that passes the schema (valid numbers and budgets, bounded sizes) with HTML and script in every
    other string."""
    return {
        "model": {"id": XSS, "device": XSS, "n_layers": 2},
        "prompt": XSS + LINK,
        "prompt_tokens": 3,
        "prompt_token_ids": [1, 2, 3],
        "settings": {XSS: XSS},
        "timings": {XSS: 1.0},
        "runs": [_run("exact", None, XSS), _run(XSS, "0.5", XSS + LINK), _run(LINK, "0.25", LINK)],
    }


def hostile_invalid(n_huge: int = 70_000) -> str:
    """``hostile_strings`` with NaN and infinity in numbers and a huge token list: the schema refuses it."""
    data = hostile_strings()
    data["prompt_token_ids"] = list(range(n_huge))
    data["runs"][1]["kv_bytes"] = float("nan")
    data["runs"][2]["metrics"]["kl_mean"] = float("inf")
    return json.dumps(data)
