"""The dashboard's API, called by name through gradio_client on the real embedded model.

The app runs in this process (the session-scoped model fixture is shared) on a free port of 127.0.0.1 and is
closed at the end. Prompts are short and runs are a few tokens: the machine has 2 shared cores.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

gradio_client = pytest.importorskip("gradio_client")

import gradio as gr  # noqa: E402
import torch  # noqa: E402

from kvlab.core.results import CompareResult  # noqa: E402
from kvlab.report import comparison_figures as plots  # noqa: E402
from kvlab.ui import Dashboard, PageInputs, build_demo, gpu, launch_kwargs, param_rows, params_from_rows  # noqa: E402

PROMPT = "Summarize: the cat sat on the mat because the mat was warm and the sun was out. " * 6
XSS = "<img src=x onerror=alert(1)> is not markup here."


@pytest.fixture(scope="module")
def app(lm, free_port):
    demo = build_demo(lm)
    demo.queue(max_size=8)
    port = free_port()
    demo.launch(
        server_name="127.0.0.1",
        server_port=port,
        prevent_thread_lock=True,
        quiet=True,
        show_error=True,
        **launch_kwargs(),
    )
    url = f"http://127.0.0.1:{port}/"
    assert urllib.request.urlopen(url + "gradio_api/info", timeout=30).status == 200
    yield url
    demo.close()


@pytest.fixture(scope="module")
def client(app):
    return gradio_client.Client(app, verbose=False)


@pytest.fixture(scope="module")
def compared(client):
    """One real comparison: exact + streaming at 0.5 and 0.25, 6 new tokens, attention maps on."""
    out = client.predict(
        "embedded",
        PROMPT + XSS,
        [],
        ["streaming"],
        "0.5, 0.25",
        6,
        0,
        {"headers": ["method", "parameter", "value", "default", "meaning"], "data": param_rows()},
        True,
        3,
        1,
        api_name="/compare",
    )
    return out


def test_api_names_are_exposed(client):
    names = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/compare", "/load_model", "/view_errors", "/view_attention", "/export", "/load_json", "/preset"} <= names


def test_compare_returns_cards_and_figures(compared):
    status, cards, gauges, bytes_fig, err_step, *_ = compared
    assert "done: 3 runs" in status
    for label in ("exact", "streaming@0.5", "streaming@0.25"):
        assert f"<b>{label}</b>" in cards
    # prompt/model text is escaped, never markup
    assert "<img" not in cards
    gauge_fig = json.loads(gauges["plot"])
    assert [d["type"] for d in gauge_fig["data"]] == ["indicator"] * 3
    values = sorted(d["value"] for d in gauge_fig["data"])
    assert values[0] < values[1] < values[2] == pytest.approx(100.0)
    steps = json.loads(bytes_fig["plot"])["data"]
    # exact dashed + each run's line (prefill + 5 steps) and its mean over the run (dotted, the same value twice)
    assert [d["name"] for d in steps] == ["exact (all tokens seen)"] + [
        name for label in ("exact", "streaming@0.5", "streaming@0.25") for name in (label, f"{label} mean")
    ]
    for line, mean in zip(steps[1::2], steps[2::2]):
        assert len(line["y"]) == 6 and mean["y"][0] == pytest.approx(sum(line["y"]) / 6)


def test_measurements_reach_the_panels(compared, lm):
    status, cards, gauges, bytes_fig, err_step, err_layer, kl_fig, heat, qvm, strip, *_ = compared
    err = json.loads(err_step["plot"])["data"]
    assert [d["name"] for d in err] == ["streaming@0.5", "streaming@0.25"]
    # fewer kept tokens, larger attention error (mean over the decode steps)
    means = [sum(d["y"]) / len(d["y"]) for d in err]
    assert 0 < means[0] < means[1]
    layer = json.loads(err_layer["plot"])["data"][0]
    assert layer["type"] == "heatmap" and len(layer["z"]) == 2 and len(layer["z"][0]) == lm.info.n_layers
    heat_fig = json.loads(heat["plot"])
    assert "layer 3, head 1" in heat_fig["layout"]["title"]["text"]
    assert sum(d["type"] == "heatmap" for d in heat_fig["data"]) == 4  # weights + kept row for two runs
    held = [d for d in heat_fig["data"] if d.get("colorscale") and len(d.get("y", [])) == 1]
    axes = [v for k, v in heat_fig["layout"].items() if k.startswith("yaxis")]
    assert len(held) == 2 and sum("kept" in a.get("ticktext", []) for a in axes) == 2, "evicted positions are marked"
    assert "kv-evicted" in strip and "kv-kept" in strip and "<img" not in strip
    qvm_fig = json.loads(qvm["plot"])
    assert [len(d["x"]) for d in qvm_fig["data"]] == [2]  # streaming at two budgets


def test_saving_in_cards_matches_budget(compared):
    cards = compared[1]
    # StreamingLLM at 0.25 holds about a quarter of the exact bytes (positions are implicit)
    # (the saving at the peak: the exact cache's peak includes the generated tokens, so 0.25 saves ~75%)
    assert any(f"{p}% saved" in cards for p in (74, 75, 76))


def test_view_errors_rerenders_from_state(client, compared):
    fig = client.predict("3", api_name="/view_errors")
    title = json.loads(fig["plot"])["layout"]["title"]["text"]
    assert "layer 3" in title


def test_view_attention_rerenders_without_recomputing(client, compared):
    heat, strip = client.predict([], "streaming@0.25", api_name="/view_attention")
    fig = json.loads(heat["plot"])
    assert sum(d["type"] == "heatmap" for d in fig["data"]) == 4
    assert "streaming@0.25: " in strip and "streaming@0.5: " not in strip
    _, strip = client.predict([], "streaming@0.5", api_name="/view_attention")
    assert "streaming@0.5: " in strip


def test_heatmaps_filter_methods(client, compared):
    path = next(f for f in client.predict(api_name="/export") if f.endswith(".json"))
    fig = plots.attention_heatmaps(CompareResult.load(path), ["streaming@0.25"])
    assert sum(d.type == "heatmap" for d in fig.data) == 2
    assert list(fig.layout.yaxis.ticktext) == ["exact", "kept", "streaming@0.25"]


def test_export_and_load_round_trip(client, compared, tmp_path):
    files = client.predict(api_name="/export")
    paths = [Path(f) for f in files]
    by_ext = {p.suffix: p for p in paths}
    assert set(by_ext) == {".json", ".csv", ".html"}
    data = json.loads(by_ext[".json"].read_text())
    result = CompareResult.from_json(data)
    assert [r.label for r in result.runs] == ["exact", "streaming@0.5", "streaming@0.25"]
    csv_text = by_ext[".csv"].read_text()
    assert csv_text.splitlines()[0].startswith("run,method,budget,kv_bytes")
    assert len(csv_text.strip().splitlines()) >= 4
    report = by_ext[".html"].read_text()
    assert "plotly" in report.lower() and "&lt;img src=x" in report and "<img src=x" not in report
    status, cards, *_ = client.predict(
        gradio_client.handle_file(str(by_ext[".json"])), "mean", None, api_name="/load_json"
    )
    assert "loaded 3 runs" in status and "<b>streaming@0.25</b>" in cards


def test_bad_input_gives_clear_messages(client):
    table = {"headers": ["method", "parameter", "value", "default", "meaning"], "data": param_rows()}
    cases = [
        (("embedded", "   ", [], ["streaming"], "0.25", 4, 0, table, False, 3, 0), "prompt is empty"),
        (("embedded", "hi", [], [], "0.25", 4, 0, table, False, 3, 0), "no method selected"),
        (("embedded", "hi", [], ["streaming"], "1.5", 4, 0, table, False, 3, 0), "outside (0, 1]"),
        (("embedded", "hi", [], ["streaming"], "0.25", 100000, 0, table, False, 3, 0), "greater than maximum"),
        (("/no/such/model", "hi", [], ["streaming"], "0.25", 4, 0, table, False, 3, 0), "no such folder"),
    ]
    for args, needle in cases:
        with pytest.raises(Exception) as info:
            client.predict(*args, api_name="/compare")
        assert needle in str(info.value), (needle, str(info.value))


def test_params_from_rows_sends_only_changes():
    rows = [
        ["streaming", "n_sink", "8", "4", ""],
        ["streaming", "window", "auto", "auto", ""],
        ["h2o", "heavy_ratio", "0.3", "0.5", ""],
    ]
    assert params_from_rows(rows, ["exact", "streaming"]) == {"streaming": {"n_sink": "8"}}


def test_figures_say_no_data_without_metrics(lm):
    ids = [1, 2, 3]
    empty = CompareResult(lm.info.to_json(), "", len(ids), ids, settings={}, timings={}, runs=[])
    for fig in (plots.error_per_step(empty), plots.attention_heatmaps(empty), plots.quality_vs_memory(empty)):
        assert "no " in fig.layout.annotations[0].text
    assert Dashboard(lm).render(None, "mean", None)[0].count("kv-empty") == 1


def test_out_of_memory_becomes_a_message_and_the_page_keeps_serving(lm, client):
    dash = Dashboard(lm)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        yield  # a generator, like Engine.stream

    dash.engines["embedded"].stream = oom
    with pytest.raises(gr.Error, match="out of GPU memory"):
        list(
            dash.compare(
                "embedded", "hello", [], ["streaming"], "0.5", 2, 0, None, False, progress=lambda *a, **k: None
            )
        )
    # the served page still answers
    text = client.predict("Pass-key retrieval", api_name="/preset")
    assert "pass key" in text.lower() and len(text) > 2000  # the ~1k-token task prompt from kvlab.tasks


def test_gpu_wrapper_is_a_no_op_without_spaces():
    def f():
        return 1

    assert gpu(f, lambda: None) is f


def _inputs(prompt="hello there", papers=(), baselines=("streaming",), budgets="0.5", new=2, seed=0, maps=False):
    return ("embedded", prompt, list(papers), list(baselines), budgets, new, seed, None, maps, None, 0, "")


def test_duplicate_budgets_run_once_each(lm):
    dash = Dashboard(lm)
    _, comparison, _ = dash.request(PageInputs(*_inputs(budgets=",".join(["0.5"] * 200 + ["0.25", "0.50"]))))
    assert [s.label for s in comparison.check()] == ["exact", "streaming@0.5", "streaming@0.25"]


def test_over_the_memory_limit_is_refused_fast_with_the_numbers(lm):
    import time

    from kvlab.engine.admission import AdmissionLimits

    dash = Dashboard(lm)
    dash.admission = AdmissionLimits(max_request_bytes=5 * 1024**2)
    t0 = time.perf_counter()
    with pytest.raises(Exception) as info:
        dash.request(PageInputs(*_inputs(prompt=PROMPT, papers=["qjl", "balancekv"], budgets="0.5,0.25", maps=True)))
    assert time.perf_counter() - t0 < 1.0
    msg = str(info.value)
    assert "7 runs on" in msg and "exceeds the 5 MiB" in msg and "fewer runs" in msg
    assert dash.plan(*_inputs(prompt=PROMPT, papers=["qjl"])).startswith("⚠")
    dash.admission = AdmissionLimits(max_runs=3)
    assert "5 runs requested" in dash.plan(*_inputs(papers=["qjl"], budgets="0.5,0.25"))
    ok = Dashboard(lm).plan(*_inputs(papers=["qjl"], budgets="0.5,0.25"))
    assert ok.startswith("5 runs on") and "within this page's limits" in ok


def test_huge_seed_is_a_clear_message(lm):
    dash = Dashboard(lm)
    with pytest.raises(gr.Error, match=r"seed=\d+ is out of range; allowed: 0\.\."):
        list(dash.compare(*_inputs(seed=2**80), progress=lambda *a, **k: None))


def test_compare_hands_back_no_tensors(lm):
    """What the page's GPU function returns crosses a process boundary on ZeroGPU: no tensors at all."""
    from kvlab.ui.gpu_lease import tensor_paths

    dash = Dashboard(lm)
    outs = list(dash.compare(*_inputs(maps=True), progress=lambda *a, **k: None))
    assert "done: 2 runs" in outs[-1][0]
    assert tensor_paths(outs) == []


def test_crafted_import_is_refused_with_one_message(client, tmp_path):
    bad = tmp_path / "crafted.json"
    bad.write_text('{"model": {}, "prompt": "x", "prompt_tokens": NaN, "runs": []}')
    with pytest.raises(Exception, match="prompt_tokens: NaN is not a finite number"):
        client.predict(gradio_client.handle_file(str(bad)), "mean", None, api_name="/load_json")


def test_health_flags_show_on_the_cards(lm):
    from kvlab.core.results import RunResult
    from kvlab.ui.cards import health_html

    run = RunResult("snapkv", "0.25", {}, health=[{"flag": "over_budget", "detail": "holds <b>1.2x</b>"}])
    html_text = health_html(run)
    assert "over_budget" in html_text and "&lt;b&gt;1.2x" in html_text and "<b>1.2x" not in html_text
    assert health_html(RunResult("exact", None, {})) == ""
