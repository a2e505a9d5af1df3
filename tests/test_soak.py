"""A short soak through the functions the page calls (bench/soak.py runs the long one).

Memory and temp files stay flat over requests that mix comparisons, exports, refusals and crafted imports.
"""

from __future__ import annotations

import pytest

pytest.importorskip("gradio")

from bench.soak import soak  # noqa: E402

pytestmark = pytest.mark.slow


def test_requests_in_a_row_leave_no_growth_and_no_files(lm):
    out = soak(lm, requests=8, ttl_s=1.0, new_tokens=2)
    assert out["outcomes"] == ["ok", "refused", "refused", "ok", "ok", "ok", "refused", "refused"]
    assert out["rss_after_last"] <= 1.10 * out["rss_after_5"], out["rss"]
    assert out["export_dirs_left"] <= 1  # the second export removed the first (older than the TTL)
