"""Needle grids: a tiny depth x length sweep on the embedded model, counted into one grid per run label."""

import csv
import json

import pytest

from kvlab.cli import main
from kvlab.report.needle_grids import GridError, grid_figure, grids, grids_from_results
from kvlab.report.sweep_report import figures

TINY = [
    "sweep",
    "--task",
    "needle",
    "--lengths",
    "128,256",
    "--depths",
    "1,0",
    "--seeds",
    "1",
    "--methods",
    "exact,streaming",
    "--budgets",
    "0.5",
    "--max-new-tokens",
    "8",
    "--no-probes",
    "--protocol",
    "query-aware",
    "--quiet",
]


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory, lm):
    out = tmp_path_factory.mktemp("grid")
    assert main([*TINY, "--out", str(out)]) == 0
    return out


def test_grid_shape_and_values(tiny_sweep):
    data = json.loads((tiny_sweep / "results.json").read_text())
    assert data["protocol"] == "query-aware" and data["config"]["depths"] == [0.0, 1.0]
    assert sorted((c["cell"]["length"], c["cell"]["depth"]) for c in data["cells"]) == [
        (128, 0.0),
        (128, 1.0),
        (256, 0.0),
        (256, 1.0),
    ]
    protocol, items = grids_from_results(data)
    assert protocol == "query-aware" and [g.label for g in items] == ["exact", "streaming@0.5"]
    with open(tiny_sweep / "results.csv") as f:
        score = {(r["label"], float(r["depth"]), int(r["length"])): float(r["task_score"]) for r in csv.DictReader(f)}
    for g in items:
        assert g.depths == [0.0, 1.0] and g.lengths == [128, 256]
        assert g.seeds == [[1, 1], [1, 1]]
        assert g.hits == [[int(score[g.label, d, n]) for n in g.lengths] for d in g.depths]
    exact, streaming = items
    assert exact.accuracy == [[1.0, 1.0], [1.0, 1.0]]  # the reference finds every needle
    # a recency window at half the cache keeps the needle at the end, and loses the one at the
    # start of the 256-token prompt
    assert streaming.accuracy[1] == [1.0, 1.0] and streaming.accuracy[0][1] == 0.0


def test_grid_figure_annotates_hits_over_seeds(tiny_sweep):
    recs = json.loads((tiny_sweep / "results.json").read_text())["cells"]
    items = grids(recs)
    fig = grid_figure(items)
    assert [t.type for t in fig.data] == ["heatmap", "heatmap"]
    heat = fig.data[1]
    assert list(heat.x) == ["128", "256"] and list(heat.y) == ["0", "1"]
    assert [list(r) for r in heat.text] == [[f"{h}/1" for h in row] for row in items[1].hits]
    assert fig.layout.coloraxis.cmin == 0 and fig.layout.coloraxis.cmax == 1
    # the HTML report draws the grid when the sweep covers several depths, and not otherwise
    assert "grid" in figures(recs)
    assert "grid" not in figures([r for r in recs if r["cell"]["depth"] == 1.0])
    assert "id='fig-grid'" in (tiny_sweep / "report.html").read_text()


def test_grid_from_older_cells_and_bad_files():
    run = {"label": "exact", "method": "exact", "budget": None, "metrics": {"task_score": 1.0}}
    old = {"cell": {"task": "passkey", "length": 512, "seed": 0}, "meta": {"depth": 0.25}, "runs": [run]}
    (g,) = grids([old])
    assert g.depths == [0.25] and g.hits == [[1]]
    with pytest.raises(GridError, match="no 'cells'"):
        grids_from_results({"runs": []})
    doc = {"cell": {"task": "document", "length": 512, "seed": 0}, "runs": [run | {"metrics": {}}]}
    with pytest.raises(GridError, match="no task scores"):
        grids_from_results({"config": {}, "cells": [doc]})


def test_grid_tab_loads_a_sweep_and_refuses_other_files(tiny_sweep, tmp_path):
    import gradio as gr

    from kvlab.ui.grid_tab import grid_view

    summary, fig = grid_view(tiny_sweep / "results.json", "grid0/results.json")
    assert "query-aware" in summary and "2 runs" in summary and len(fig.data) == 2
    assert "<code>grid0/results.json</code>" in summary
    for text, why in (("{not json", "not JSON"), ('{"runs": []}', "no 'cells'")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(gr.Error, match=why):
            grid_view(bad, bad.name)
    with pytest.raises(gr.Error, match="cannot read the file"):
        grid_view(tmp_path / "missing.json", "missing.json")


def test_sweep_rejects_depths_outside_0_1(capsys):
    assert main(["sweep", "--task", "needle", "--depths", "0,2", "--methods", "exact"]) == 2
    assert "--depths" in capsys.readouterr().err
