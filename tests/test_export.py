"""Export folders are removed once older than the TTL; newer ones stay."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("gradio")

from kvlab.ui.export import PREFIX, export_ttl_s, remove_old_exports  # noqa: E402


def test_old_export_folders_are_removed_and_new_ones_kept(tmp_path, monkeypatch):
    old, new, other = tmp_path / f"{PREFIX}old", tmp_path / f"{PREFIX}new", tmp_path / "not-an-export"
    for d in (old, new, other):
        d.mkdir()
        (d / "kvlab.json").write_text("{}")
    past = time.time() - 7200
    for d in (old, other):
        os.utime(d, (past, past))
    assert remove_old_exports(ttl_s=3600, root=tmp_path) == 1
    assert not old.exists() and new.exists() and other.exists()
    monkeypatch.setenv("KVLAB_EXPORT_TTL_S", "90")
    assert export_ttl_s() == 90
