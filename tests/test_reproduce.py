"""``kvlab reproduce``: each reproduction on a small setting, the claim registry (one verdict per id, claims
apart from implementation checks and controls, the papers' quotes checked against their text), the
decisions at the papers' operating points, the one-invocation runner and the docs generated from it."""

from __future__ import annotations

import json

import pytest

from kvlab.reproduce import REPRODUCTIONS, ReproductionSetup, get_reproduction, names, papers_dir
from kvlab.reproduce.claims import KVLAB, PAPER, decide
from kvlab.reproduce.common import CLAIM_VERDICTS, VERDICTS, Row
from kvlab.reproduce.registry import APART, declared

TINY = {
    "balancekv-fig2": {"n": 320, "sink": 32, "recent": 32, "queries": 16, "rounds": [1, 2], "prompts": 2, "layers": 5},
    "qjl-estimator": {"n": 96, "ms": [16, 64], "sketches": 64, "keys": 16, "queries": 2, "layers": "ends"},
    "qjl-3bit": {
        "length": 224,
        "documents": 1,
        "max_new_tokens": 4,
        "tasks": ["passkey"],
        "task_seeds": 1,
        "task_new_tokens": 8,
    },
    "qjl-kivi-rd": {"length": 224, "max_new_tokens": 4, "prompts": 2, "m_factors": [1, 2]},
    "clustergen-lines": {"length": 192, "questions": 2, "tuning": 2, "budgets": ["0.65"], "max_new_tokens": 8},
    "scissorhands-persistence": {"length": 128, "prompts": 2},
    "scissorhands-ppl": {
        "documents": 2,
        "prefix": 64,
        "continuation": 6,
        "ratios": [2],
        "method": "scissorhands@paper",
    },
    "balancekv-table1": {"tasks": ["passkey"], "length": 256, "seeds": 1, "rates": ["0.25"], "max_new_tokens": 8},
    "subgen-theorem1": {
        "n": 160,
        "queries": 8,
        "s": [16, 256],
        "t": [1, 16],
        "rel": 0.5,
        "layer_step": 15,
        "seeds": 1,
    },
    "subgen-sublinear": {"lengths": [64, 256], "rel": [1.0], "layer_step": 15, "prompts": 2},
    "scissorhands-fig3": {
        "documents": 2,
        "prefix": 64,
        "continuation": 6,
        "ratios": [2],
        "method": "scissorhands@paper",
    },
    "scissorhands-table4": {"length": 192, "max_new_tokens": 4},  # one token of 192 is within 5% of the bytes
    "turboquant-bounds": {
        "n": 96,
        "bits": [1, 3],
        "vectors": 128,
        "per_draw": 4,
        "pairs_keys": 6,
        "pairs_queries": 2,
        "draws": 48,
        "queries": 4,
        "layer_step": 15,
        "seed": 0,
    },
    "polarquant-distortion": {"n": 96, "seeds": 2, "layer_step": 15},
    "kv-asymmetric-bits": {"tasks": ["passkey"], "length": 160, "seeds": 1, "new_tokens": 3},
    "turboquant-qjl-residual": {"tasks": ["passkey"], "length": 160, "seeds": 1, "new_tokens": 3, "bits": [2, 4]},
    "quantizers-matched": {
        "doc_length": 160,
        "documents": 1,
        "doc_new_tokens": 2,
        "length": 160,
        "tasks": ("passkey",),
        "seeds": 1,
        "task_new_tokens": 6,
        "b": False,
    },
}


@pytest.fixture(scope="module")
def ctx(lm):
    return ReproductionSetup(quick=True, lm=lm, overrides=TINY, log=lambda m: None)


@pytest.fixture(scope="module")
def reports(ctx):
    return {}


def _run(name, ctx, reports):
    if name not in reports:
        reports[name] = get_reproduction(name).run(ctx)
    return reports[name]


@pytest.mark.parametrize("name", names())
def test_each_reproduction_runs_and_writes_json_and_html(name, ctx, reports, tmp_path):
    rep = _run(name, ctx, reports)
    assert rep.rows and all(r.setting and r.kvlab for r in rep.rows)
    assert (
        rep.declared and any(e.kind == "claim" for e in rep.declared) or name in ("qjl-estimator", "turboquant-bounds")
    )
    assert rep.table().splitlines()[0].split()[:4] == ["setting", "paper", "kvlab", "n,"]
    ids = {e.id for e in rep.declared}
    for r in rep.rows:  # the verdicts, or context; "not testable here" always says why; every verdict names its id
        assert (r.kind == "context") == (r.verdict is None), r
        assert r.verdict in (None, *VERDICTS) and (r.verdict != "not testable here" or r.note)
        assert r.kind == "context" or r.claim in ids, r
        if r.kind == "claim" and r.n is not None and r.interval is None:
            assert r.note, f"a claim row with n and no interval says why: {r}"
    paths = rep.write(tmp_path)
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["name"] == name and data["rows"] and data["claims"] and data["declared"]
    assert set(data["verdicts"]) == ids and all(v["verdict"] in CLAIM_VERDICTS for v in data["verdicts"].values())
    tally = data["tally"]
    assert sum(tally["claims"].values()) == sum(e.kind == "claim" for e in rep.declared)  # one per id, not per row
    assert sum(tally["implementation_verified"].values()) == sum(e.kind == "check" for e in rep.declared)
    assert (tmp_path / f"{name}.html").read_text().count("plotly") > 0
    assert len(paths) == 2


def test_the_registry_declares_each_claim_once_with_its_point_and_threshold():
    entries = declared()  # raises on an id declared twice
    claims = [e for _, e in entries.values() if e.kind == "claim"]
    assert len(claims) >= 15 and {e.kind for _, e in entries.values()} == {"claim", "check", "control"}
    for e in claims:
        assert e.quote is not None and e.point is not None and e.kvlab_point
        assert all([e.point.model, e.point.length, e.point.setting, e.point.metric])
    for _, e in entries.values():
        assert e.threshold.source in (PAPER, KVLAB) and e.threshold.rule and e.threshold.why
    # kvlab's own checks are not the papers' claims
    checks = {i for i, (_, e) in entries.items() if e.kind == "check"}
    assert {"turboquant:theorem1-mse-bounds", "qjl:lemma3.2-unbiased", "polarquant:no-per-block-constants"} <= checks
    # Scissorhands' perplexity claims are tied to a scale the embedded models are not
    scaled = {i for i, (_, e) in entries.items() if e.scale}
    assert {"scissorhands:table3-comparable-to-full", "scissorhands:fig3-maintained-at-50pct-opt6b"} <= scaled


def test_paper_numbers_are_quoted_from_the_papers():
    if papers_dir() is None:
        pytest.skip("the papers' text (shared/papers beside the repository) is not available here")
    checked = 0
    for name in names():
        mod = get_reproduction(name)
        quotes = list(mod.CLAIMS) + [e.quote for e in mod.DECLARED if e.quote is not None]
        for claim in quotes:
            found = claim.found_in_paper()
            if found is None:  # this paper's text is not in the folder (TurboQuant, PolarQuant): not checked here
                continue
            assert found, f"{name}: {claim.quote!r} not in papers/{claim.paper}.txt"
            checked += 1
    assert checked > 0


def test_one_verdict_per_claim_id_by_the_declared_rule():
    entries = declared()
    _, table3 = entries["balancekv:table1-highest-average"]
    rows = [
        Row("vs snapkv", "p", "k", True, claim=table3.id, model="A"),
        Row("vs uniform", "p", "k", verdict="inconclusive", claim=table3.id, model="A"),
        Row("vs snapkv", "p", "k", True, claim=table3.id, model="B"),
        Row("rate 0.75", "p", "k", kind="context", claim=table3.id),
    ]
    got = decide(table3, rows)
    assert got["verdict"] == "inconclusive" and got["by_model"] == {"A": "inconclusive", "B": "holds"}
    assert (got["evidence"], got["context"]) == (3, 1)
    assert decide(table3, rows[:1])["verdict"] == "holds"
    assert decide(table3, [*rows, Row("vs pyramidkv", "p", "k", False, claim=table3.id)])["verdict"] == "does not hold"
    assert decide(table3, [])["verdict"] == "not testable here"
    _, scaled = entries["scissorhands:table3-comparable-to-full"]
    assert decide(scaled, [Row("2x", "p", "k", True, claim=scaled.id)])["verdict"] == "not testable at this scale"


def test_a_row_says_when_its_test_cannot_pass_at_its_n():
    row = Row("a", "p", "k", verdict="inconclusive", n=10, min_n=17, interval=(-0.3, 0.3))
    assert row.note.startswith("inconclusive by design") and "n = 17" in row.note
    assert row.spread == "n = 10, [-0.3, 0.3]; passes from n = 17"
    with pytest.raises(ValueError, match="below"):
        Row("b", "p", "k", verdict="holds", n=5, min_n=6)
    with pytest.raises(ValueError, match="needs its reason"):
        Row("c", "p", "k", verdict="not testable here")


def test_balancekv_table1_judges_rate_025_only_by_mcnemar():
    from kvlab.reproduce.balancekv_table1 import BASELINES, HIGHEST, comparison_rows

    six = {"balancekv@paper": [1.0] * 6, **{b: [0.0] * 6 for b in BASELINES}}
    rows = comparison_rows("balancekv@paper", six, ["passkey"], {})
    assert [r.verdict for r in rows] == ["holds"] * 4  # 6 of 6 differing, all one way: McNemar p = 0.031
    assert all(r.claim == HIGHEST and r.min_n == 6 and "McNemar" in r.note for r in rows)
    five = {m: v[:5] for m, v in six.items()}
    assert {r.verdict for r in comparison_rows("balancekv@paper", five, ["passkey"], {})} == {"inconclusive"}
    elsewhere = comparison_rows("balancekv@paper", six, ["passkey"], {}, rate="0.75")
    assert all(r.kind == "context" and "the paper's rate is 0.25" in r.note for r in elsewhere)
    behind = {"balancekv@paper": [0.0] * 12, **{b: [0.0] * 12 for b in BASELINES}, "streaming": [1.0] * 12}
    assert "does not hold" in {r.verdict for r in comparison_rows("balancekv@paper", behind, ["passkey"], {})}
    none = comparison_rows("balancekv@paper", six, [], {})
    assert {r.verdict for r in none} == {"not testable here"}
    refused = comparison_rows("balancekv@paper", six, ["passkey"], {"balancekv@paper": "cannot fit budget 0.25"})
    assert {r.verdict for r in refused} == {"not testable here"} and "cannot fit" in refused[0].note


def test_balancekv_table1_runs_the_papers_rate_on_the_calibrated_task(ctx, reports):
    from kvlab.reproduce.balancekv_table1 import FULL

    assert FULL["rates"][0] == "0.25"
    rep = _run("balancekv-table1", ctx, reports)
    (label,) = rep.data["models"]
    p = rep.data["models"][label]["prompts"][0]
    assert p["depth"] == 0.1 and p["runs"]["exact"]["score"] == 1.0  # the calibrated task: exact answers
    claims = [r for r in rep.rows if r.kind == "claim"]
    assert len(claims) == 4 and all(r.setting.startswith("rate 0.25") and r.model == label for r in claims)


def test_qjl_3bit_comparable_needs_seventeen_agreeing_prompts():
    from kvlab.reproduce.qjl_3bit import COMPARABLE, LABELS, task_rows

    def prompts(n, qjl=1.0, kivi=0.0):
        runs = {x: {"score": 1.0, "error": ""} for x in LABELS} | {"qjl": {"score": qjl, "error": ""}}
        runs["kivi-2"] = {"score": kivi, "error": ""}
        return [{"task": "passkey", "runs": runs} for _ in range(n)]

    ten = {r.claim: r for r in task_rows(prompts(10), ["passkey"], "m") if r.kind != "context"}
    assert ten[COMPARABLE].verdict == "inconclusive" and "inconclusive by design" in ten[COMPARABLE].note
    assert ten[COMPARABLE].min_n == 17
    twenty = {r.claim: r for r in task_rows(prompts(20), ["passkey"], "m") if r.kind != "context"}
    assert twenty[COMPARABLE].verdict == "holds" and twenty[COMPARABLE].interval[1] < 0.2
    assert twenty["qjl:table1-above-kivi"].verdict == "holds"  # QJL right on 20 where KIVI-2 is wrong
    wrong = {"task": "passkey", "runs": {x: {"score": 0.0, "error": ""} for x in LABELS}}
    fails = task_rows(prompts(4, qjl=0.0) + [wrong] * 4, ["passkey"])
    assert {r.verdict for r in fails if r.kind != "context"} == {"not testable here"}  # exact answers 4 of 8


def test_qjl_3bit_uses_the_papers_configuration(ctx, reports):
    rep = _run("qjl-3bit", ctx, reports)
    prompts = rep.data["prompts"]
    assert [p["task"] for p in prompts] == ["document", "passkey"]
    for p in prompts:
        runs = p["runs"]
        q = runs["qjl"]["params"]
        assert q["m"] == 2 * ctx.info.head_dim and q["value_bits"] == 2 and q["residual"] == 128
        peaks = [runs[x]["peak_bytes"] for x in ("qjl", "qjl-no-outliers", "kivi-2", "kivi-3", "kivi-4") if x in runs]
        peaks = [b for b in peaks if b]
        assert max(peaks) <= 1.002 * runs["qjl"]["peak_bytes"] and min(peaks) >= 0.85 * max(peaks)
        window, outside = runs["qjl"]["window_bits"], runs["qjl"]["bits_outside_window"]
        assert 16 * 96 / p["tokens"] - 0.01 <= window <= 16 * 128 / p["tokens"] + 0.01 and 0 < outside
    assert all(r.kind == "context" for r in rep.rows if "KL" in r.setting)  # not the paper's metric


def test_qjl_kivi_rd_runs_the_papers_qjl_against_kivi_at_its_bytes(ctx, reports):
    rep = _run("qjl-kivi-rd", ctx, reports)
    for p in rep.data["prompts"]:
        at_paper = next(x for x in p["points"] if x["factor"] == 2)
        assert at_paper["qjl"]["params"]["m"] == 2 * ctx.info.head_dim and at_paper["qjl"]["params"]["residual"] == 128
    claim = next(r for r in rep.rows if r.kind == "claim")
    assert claim.claim == "qjl:sec1-no-loss-against-kivi-at-equal-bytes" and claim.n == len(rep.data["prompts"])
    check = next(r for r in rep.rows if r.claim == "qjl:sec1-kivi-constants-1-2-bits")
    assert check.kind == "check" and check.verdict == "holds"  # fp16 scale + min per 32 numbers: 1 bit


def test_clustergen_asks_lines_at_uniform_depths_and_gates_on_exact(ctx, reports):
    from kvlab.reproduce.clustergen_lines import ABOVE, depths, recent_shares

    assert depths(4) == [0.125, 0.375, 0.625, 0.875]
    assert recent_shares("0.65") == [0.63, 0.945]  # 2048 and 3072 of 5k tokens, over the budget
    rep = _run("clustergen-lines", ctx, reports)
    (got,) = rep.data["models"].values()
    assert [q["seed"] for q in got["tuning"]] == [1000, 1001] and len(got["tuning"][0]["runs"]) == 3
    evidence = [r for r in rep.rows if r.kind != "context" and r.claim == ABOVE]
    if got["exact_tuning"] < 0.8:  # the gate: no compressed run where exact cannot do the task
        assert not got["scored"] and {r.verdict for r in evidence} == {"not testable here"}
    else:
        assert len(evidence) == 2 and all(r.n == 2 for r in evidence)


def test_persistence_and_sublinear_are_judged_over_prompts(ctx, reports):
    rep = _run("scissorhands-persistence", ctx, reports)
    assert len(rep.data["prompts"]) == 2 and len(rep.data["persistence_ratio"]) == ctx.info.n_layers
    assert all(r.n == 2 for r in rep.rows if r.kind != "context")
    small = next(r for r in rep.rows if r.claim == "scissorhands:sec3.2-pivotal-sets-small")
    assert "0.75" in small.note or small.verdict == "inconclusive"
    sub = _run("subgen-sublinear", ctx, reports)
    keys, values = sub.data["clusters"]["keys"][1.0], sub.data["clusters"]["values"][1.0]
    assert keys[0] <= keys[-1] and keys[-1] < values[-1]
    sublinear = next(r for r in sub.rows if r.claim == "subgen:sec2.1-sublinear-clusters" and r.kind == "claim")
    assert sublinear.verdict == "not testable here" and sublinear.n == 2 and sublinear.interval is not None


def test_scissorhands_is_matched_on_the_mean_bytes_as_well_as_the_peak(ctx, reports):
    from kvlab.reproduce.matched import mean_matched_tokens

    b = mean_matched_tokens(ctx.info, "scissorhands@paper", {}, 512, 127, 0.5)
    assert b > 256  # it drops half its cap at once: holding half of full on average takes a larger cap
    rep = _run("scissorhands-fig3", ctx, reports)
    peak, mean = rep.data["runs"]["scissorhands@paper@2x"], rep.data["runs"]["scissorhands@paper@2x mean"]
    for p, m in zip(peak, mean):
        assert p["mean"] < m["mean"] and abs(m["mean"] - 0.5) < 0.1 and p["peak"] <= 0.5 * 1.05
    assert rep.verdict == "not testable at this scale"
    rows = [r for r in rep.rows if r.kind == "claim"]
    assert len(rows) == 2 and all(r.n == 2 for r in rows)


def test_reference_scoring_of_the_exact_cache_is_the_models_own_likelihood(ctx):
    """Teacher forcing the reference through the exact cache gives the NLL of one plain forward pass."""
    import torch

    from kvlab.engine.specs import RunSpec
    from kvlab.reproduce.scissorhands_fig3 import documents, score_reference

    (_, ids), *_ = documents(ctx, 1, 40)
    prefix, ref = ids[:32], ids[32:]
    (got,) = score_reference(ctx, prefix, ref, [RunSpec("exact")])
    with torch.inference_mode():
        logits = ctx.loaded.model(input_ids=torch.tensor([ids])).logits[0].double()
    nll = -torch.log_softmax(logits[31:-1], dim=-1)[torch.arange(len(ref)), torch.tensor(ref)]
    assert abs(got["nll"] - float(nll.mean())) < 0.02 * float(nll.mean())
    assert got["peak"] == got["mean"] == 1.0


def test_progress_keeps_units_under_the_settings_key(monkeypatch, tmp_path):
    from kvlab.reproduce.common import Progress

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    a = Progress("demo", {"settings": {"n": 1}})
    a.put("doc-1", {"nll": 1.25})
    assert Progress("demo", {"settings": {"n": 1}}).get("doc-1") == {"nll": 1.25}
    assert Progress("demo", {"settings": {"n": 2}}).get("doc-1") is None  # other settings: measured afresh
    calls = []
    assert a.value("doc-1", calls.append, 1) == {"nll": 1.25} and not calls  # read back, not measured
    assert a.value("doc-2", lambda x: x * 2, 21) == 42 and Progress("demo", {"settings": {"n": 1}}).get("doc-2") == 42
    a.path.write_text("{cut sho")  # a file cut short reads as nothing measured
    assert Progress("demo", {"settings": {"n": 1}}).get("doc-1") is None
    a.clear()
    assert not a.path.exists()


def test_turboquant_bounds_are_implementation_checks(ctx, reports):
    rep = _run("turboquant-bounds", ctx, reports)
    checks = [r for r in rep.rows if r.kind == "check"]
    assert checks and all(r.verdict == "holds" for r in checks), [r.kvlab for r in checks]
    assert not [r for r in rep.rows if r.kind == "claim"]
    assert all(r.kind == "context" for r in rep.rows if "real keys" in r.setting and r.kind != "control")
    control = next(r for r in rep.rows if r.kind == "control")
    assert control.verdict == "holds"  # 1-bit mse: the 2/pi bias is found


def test_polarquant_constants_and_rate_are_checks_its_compression_a_claim(ctx, reports):
    rep = _run("polarquant-distortion", ctx, reports)
    assert rep.data["bits_per_number"] == 3.875 and rep.data["radius_bits_per_number"] == 1.0
    kinds = {r.claim: r.kind for r in rep.rows if r.kind != "context"}
    assert kinds["polarquant:no-per-block-constants"] == "check" and kinds["polarquant:abstract-over-4.2x"] == "claim"
    assert rep.verdicts()["polarquant:abstract-over-4.2x"]["verdict"] == "does not hold"  # 16 / 3.875 = 4.13


def test_quantizers_matched_judges_the_claims_on_the_tasks(ctx, reports):
    rep = _run("quantizers-matched", ctx, reports)
    for prompt in rep.data["prompts"].values():
        runs = prompt["runs"]
        assert not runs["fp8@A"]["ran"] and "cannot fit budget" in runs["fp8@A"]["error"]  # e4m3: half the cache
        assert runs["turboquant@A"]["params"]["bits"] == 3.5 and runs["turboquant@A"]["params"]["residual"] == 0
    claims = [r for r in rep.rows if r.kind == "claim"]
    ids = {"turboquant:abstract-neutral-at-3.5-bits", "turboquant:abstract-marginal-at-2.5-bits"}
    assert {r.claim for r in claims} == ids
    assert all(r.min_n == 17 and r.verdict != "holds" for r in claims)  # one task prompt cannot pass a 0.2 margin


def test_reproduce_all_writes_one_summary_that_resumes(ctx, monkeypatch, tmp_path):
    """Two reproductions in one invocation: the summary counts ids, not rows; an interrupted run is read back."""
    from kvlab.reproduce import runner

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "cache"))
    which = ["subgen-theorem1", "scissorhands-table4"]
    real = get_reproduction("scissorhands-table4").run

    def interrupted(c):
        raise KeyboardInterrupt

    monkeypatch.setattr(get_reproduction("scissorhands-table4"), "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run_reproductions(which, ctx, tmp_path / "out", echo=lambda *a: None)
    monkeypatch.setattr(get_reproduction("scissorhands-table4"), "run", real)
    runner.run_reproductions(which, ctx, tmp_path / "out", echo=lambda *a: None)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    inv = summary["invocation"]
    assert inv["resumed"] == ["subgen-theorem1"] and inv["seconds"] > 0 and inv["threads"] >= 1
    assert sum(summary["tally"]["claims"].values()) == len(summary["claims"]) == 2
    assert {c["id"]: c["verdict"] for c in summary["claims"]} == {
        "subgen:theorem1-error-bound": "not testable here",
        "scissorhands:table4-no-compounded-error": "not testable at this scale",
    }
    assert summary["reproductions"]["subgen-theorem1"]["resumed"]
    assert (tmp_path / "out" / "tables.md").read_text().startswith("The papers' claims: 2")


def test_a_reproduction_resumes_under_the_digest_of_its_own_code():
    from kvlab.reproduce.runner import HERE, _source_digest

    ppl, fig3, rd = (
        _source_digest(str(HERE / f"{m}.py")) for m in ("scissorhands_ppl", "scissorhands_fig3", "qjl_kivi_rd")
    )
    assert len({ppl, fig3, rd}) == 3  # each its own code (ppl's includes fig3's, which it imports)
    assert _source_digest(str(HERE / "scissorhands_ppl.py")) == ppl


def test_the_docs_are_generated_from_the_summary(ctx, monkeypatch, tmp_path):
    from pathlib import Path

    from kvlab.reproduce import docs, runner

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "cache"))
    runner.run_reproductions(["subgen-theorem1"], ctx, tmp_path / "out", echo=lambda *a: None)
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(f"# x\n\n{docs.README_START}\nOLD BLOCK\n{docs.README_END}\n\nafter\n")
    engines = tmp_path / docs.ENGINES_SUMMARY
    engines.parent.mkdir(parents=True)
    engines.write_text((Path(__file__).resolve().parents[1] / docs.ENGINES_SUMMARY).read_text())
    docs.write_docs(tmp_path / "out" / "summary.json", tmp_path)
    assert (tmp_path / docs.PAGE).read_text().endswith(docs.engines_section(json.loads(engines.read_text())) + "\n")
    readme = (tmp_path / "README.md").read_text()
    assert "OLD BLOCK" not in readme and readme.endswith("after\n") and "`subgen:theorem1-error-bound`" in readme
    page = (tmp_path / "docs" / "reproductions.md").read_text()
    for section in ("## The papers' claims", "## Implementation verified", "## Controls", "## Every threshold"):
        assert section in page
    assert "*the paper*" in page and "The papers' claims" not in page.split("## Summary")[0][-5:]


def test_committed_docs_match_the_committed_summary():
    """docs/reproductions.md and the README's block are what the committed summary.json generates."""
    from pathlib import Path

    from kvlab.reproduce import docs

    root = Path(__file__).resolve().parents[1]
    summary_path = root / docs.SUMMARY
    summary = json.loads(summary_path.read_text())
    if "invocation" not in summary:
        pytest.skip("the committed summary predates the claim registry")
    engines = json.loads((root / docs.ENGINES_SUMMARY).read_text())
    assert (root / "docs" / "reproductions.md").read_text() == docs.reproductions_md(summary, engines)
    assert docs.readme_block(summary) in (root / "README.md").read_text()


def test_committed_docs_carry_the_engines_section_their_summary_generates():
    """The engines' section of docs/reproductions.md is what bench/results/reproduce-engines/summary.json
    generates, once, at the end of the page; the README's tally leaves the engines' claims out."""
    from pathlib import Path

    from kvlab.reproduce import docs

    root = Path(__file__).resolve().parents[1]
    engines = json.loads((root / docs.ENGINES_SUMMARY).read_text())
    page = (root / docs.PAGE).read_text()
    section = docs.engines_section(engines)
    assert page.count(docs.ENGINES_START) == 1 and page.endswith(section + "\n"), (
        f"{docs.PAGE}: the engines' section is out of date; "
        f"run `python -m kvlab reproduce --docs-from {docs.ENGINES_SUMMARY}`"
    )
    for e in engines["claims"]:  # every claim with its verdict per model, its threshold and its source
        assert f"`{e['id']}`" in section and e["threshold"]["source"] in section
        assert all(f"{m}: {v}" in section for m, v in e["by_model"].items())
    assert "not counted in the papers' tally" in section and "bench/results/reproduce-engines/" in section
    readme = (root / "README.md").read_text()
    assert not any(e["id"] in readme.split(docs.README_START)[-1].split(docs.README_END)[0] for e in engines["claims"])


def test_docs_from_the_engines_summary_rewrites_their_section_alone(tmp_path, capsys):
    from pathlib import Path

    from kvlab.cli import main
    from kvlab.reproduce import docs

    src = Path(__file__).resolve().parents[1] / docs.ENGINES_SUMMARY
    (tmp_path / "docs").mkdir()
    page = tmp_path / docs.PAGE
    page.write_text("# Reproductions\n\nthe papers' part\n")
    assert docs.write_docs(src, tmp_path) == [page]  # no README touched (there is none)
    once = page.read_text()
    assert once.startswith("# Reproductions\n\nthe papers' part\n\n" + docs.ENGINES_START)
    page.write_text(once.replace("## The engines' cache types", "## stale"))
    docs.write_docs(src, tmp_path)
    assert page.read_text() == once  # replaced between the markers, not appended again
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"claims": [], "reproductions": {}}))
    assert main(["reproduce", "--docs-from", str(old)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "predates the claim registry" in err


def test_cli_rejects_unknown_reproduction_and_a_missing_summary(capsys):
    from kvlab.cli import main

    assert main(["reproduce", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "allowed" in err and "qjl-3bit" in err
    assert main(["reproduce"]) == 2 and "all" in capsys.readouterr().err
    assert main(["reproduce", "--docs-from", "no/such/summary.json"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_kv_asymmetric_bits_splits_hold_the_same_bytes_and_judge_the_stated_split(ctx, reports):
    from kvlab.reproduce.kv_asymmetric_bits import FAMILIES, KEYS_MORE, label

    rep = _run("kv-asymmetric-bits", ctx, reports)
    (prompts,) = rep.data["models"].values()
    prompt = next(iter(prompts.values()))
    for family, (_, _, splits) in FAMILIES.items():
        peaks = {prompt["runs"][label(family, s)]["peak_bytes"] for s in splits}
        assert len(peaks) == 1, (family, peaks)  # every split of a quantizer: the same bytes
    claims = [r for r in rep.rows if r.kind == "claim"]
    assert [r.setting for r in claims] == ["ggml-rot: teacher-forced KL, k4v8 - k8v4 (paired)"]  # q8_0/q4_0 only
    assert all(r.claim == KEYS_MORE for r in rep.rows)  # every other split, metric and equal split: context
    assert "kv-asymmetric-bits" in APART and "kv-asymmetric-bits" not in REPRODUCTIONS  # hours: not in ``all``


def test_turboquant_qjl_residual_matches_bytes_and_judges_vllms_widths_only(ctx, reports):
    from kvlab.reproduce.turboquant_qjl_residual import QUALITY, VARIANCE

    rep = _run("turboquant-qjl-residual", ctx, reports)
    (prompts,) = rep.data["models"].values()
    prompt = next(iter(prompts.values()))
    for b in (2, 4):
        prod, mse = prompt["runs"][f"prod-{b}"], prompt["runs"][f"mse-{b}"]
        assert prod["params"]["residual"] == 0 and mse["params"]["residual"] > 0  # mse's spare bytes: a window
        assert abs(prod["peak_bytes"] / mse["peak_bytes"] - 1) <= 0.02
        logits = prompt["logits"][str(b)]
        assert abs(logits["prod"]["slope"] - 1) < 0.02 < 1 - logits["mse"]["slope"] or b == 4
    assert prompt["logits"]["2"]["mse"]["slope"] < 0.95  # 2-bit mse shrinks inner products, prod does not
    claims = [(r.setting.split(":")[0], r.claim) for r in rep.rows if r.kind == "claim"]
    assert claims == [("4 bits", VARIANCE), ("4 bits", QUALITY)]  # 2 bits (no vLLM preset), KL, agreement: context


def test_rejudge_decides_the_committed_engine_results_again(tmp_path):
    """The committed summary of the engines' reproductions is what their stored measurements decide today."""
    from pathlib import Path

    from kvlab.reproduce.runner import rejudge_reproductions

    here = Path(__file__).resolve().parents[1] / "bench" / "results" / "reproduce-engines"
    committed = json.loads((here / "summary.json").read_text())
    stored = [f"{here / m / n}.json={spec}" for m, spec in (("smollm2", "embedded"), ("gemma3-270m", "gemma3-270m"))
              for n in ("kv-asymmetric-bits", "turboquant-qjl-residual")]  # fmt: skip
    reports = rejudge_reproductions(stored, tmp_path, echo=lambda *a: None)
    got = json.loads((tmp_path / "summary.json").read_text())
    assert got["tally"] == committed["tally"] and got["claims"] == committed["claims"]
    assert {r.name: sorted(r.data["models"]) for r in reports} == {
        n: ["Gemma 3 270M", "SmolLM2-135M-Instruct"] for n in ("kv-asymmetric-bits", "turboquant-qjl-residual")
    }
    with pytest.raises(ValueError, match="stored twice"):
        rejudge_reproductions([stored[0], stored[0]], tmp_path, echo=lambda *a: None)
