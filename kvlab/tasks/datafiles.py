"""RULER's and LongBench's own files as tasks: rows of JSON Lines from a local folder or a hub dataset.

Nothing is downloaded: ``file:PATH`` reads a ``.jsonl``/``.json`` file, or every one under a folder
(sorted); ``hub:OWNER/NAME`` reads the files of a Hugging Face dataset that is already in the local
hub cache (``huggingface_hub.snapshot_download(..., local_files_only=True)``), and says so when it
is not. ``#TASK`` after either keeps the rows of one task (``file:ruler/4096#vt``). The task's
``seed`` is the row number among those rows. Three row shapes are read:

* RULER's generated files (``scripts/data/prepare.py``: ``input``, ``outputs``, ``answer_prefix``,
  ``index``): the task is the folder the file is in (RULER writes ``<task>/validation.jsonl``) or
  the file's name; the question is the input's last line (every RULER template ends with it);
* kvpress's RULER rows (the ``simonjegou/ruler`` dataset: ``context``, ``question``,
  ``answer_prefix``, ``answer``, ``task``, ``max_new_tokens``);
* LongBench's (``context``, ``input`` (the question), ``answers``, ``dataset``).

Scoring is RULER's string match (``kvlab.tasks.ruler``): "all" for its synthetic tasks, "part" for its
QA tasks and for LongBench's rows (LongBench's own metrics, F1 and ROUGE, are not computed here).
A row's length is its own: ``--length`` does not apply.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from kvlab.tasks.base import Task, TaskError

SUFFIXES = (".jsonl", ".json")


def _rows_of(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not all(isinstance(r, dict) for r in rows):
        raise TaskError(f"{path}: every row must be a JSON object")
    default = path.parent.name if path.stem in ("validation", "test", "train", "data") else path.stem
    return [r | {"_task": str(r.get("task") or r.get("dataset") or default), "_file": str(path)} for r in rows]


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix in SUFFIXES and p.is_file())


def hub_folder(repo: str) -> Path:
    """The local snapshot of hub dataset ``repo`` (``OWNER/NAME``); ``TaskError`` when it was never downloaded."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise TaskError("hub:REPO needs huggingface_hub installed; or give file:PATH") from None
    try:
        return Path(snapshot_download(repo, repo_type="dataset", local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise TaskError(
            f"hub dataset {repo!r} is not in the local hub cache and nothing is downloaded here; "
            "download it yourself (huggingface-cli download --repo-type dataset ...) or give file:PATH"
        ) from None


@lru_cache(maxsize=8)
def _load(spec: str, stamp: float) -> tuple[dict, ...]:
    kind, _, rest = spec.partition(":")
    where, _, task = rest.partition("#")
    path = hub_folder(where) if kind == "hub" else Path(where).expanduser()
    if not path.exists():
        raise TaskError(f"{spec}: {path} does not exist; give a .jsonl file or a folder of them")
    files = _files(path) if path.is_dir() else [path]
    if not files:
        raise TaskError(f"{spec}: no .jsonl or .json files under {path}")
    try:
        rows = [r for f in files for r in _rows_of(f)]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TaskError(f"{spec}: cannot read rows: {exc}") from None
    if task:
        rows = [r for r in rows if r["_task"] == task]
        if not rows:
            raise TaskError(f"{spec}: no rows of task {task!r}")
    return tuple(rows)


def load_rows(spec: str) -> list[dict]:
    """Every row of ``file:PATH[#TASK]`` or ``hub:OWNER/NAME[#TASK]``, each with ``_task`` and ``_file``."""
    where = spec.partition(":")[2].partition("#")[0]
    p = Path(where).expanduser()
    stamp = p.stat().st_mtime if spec.startswith("file:") and p.exists() else 0.0
    return list(_load(spec, stamp))


def row_task(row: dict, index: int) -> Task:
    """One row as a ``Task``: prompt = context + question, answered after ``answer_prefix``."""
    name = row["_task"]
    if "outputs" in row and "input" in row:  # RULER's own generated file
        text, refs = str(row["input"]), row["outputs"]
        cut = text.rstrip("\n").rfind("\n") + 1
        context, question = text[:cut], text[cut:]
    elif "answers" in row and "context" in row:  # LongBench
        context, question, refs = str(row["context"]), "\n\n" + str(row.get("input", "")).strip(), row["answers"]
    elif "context" in row and "question" in row:  # kvpress's RULER rows
        context, question = str(row["context"]), str(row["question"])
        refs = row.get("answer", row.get("answers", row.get("outputs")))
    else:
        raise TaskError(
            f"{row['_file']}: row {index} is neither RULER's (input, outputs), kvpress's (context, question, "
            "answer) nor LongBench's (context, input, answers)"
        )
    refs = [str(r) for r in (refs if isinstance(refs, list) else [refs])]
    if not refs:
        raise TaskError(f"{row['_file']}: row {index} has no answer")
    qa = name.startswith("qa") or "answers" in row
    tokens = row.get("max_new_tokens")
    meta = {"source": row["_file"], "row": index, "references": refs, "length": row.get("length")}
    return Task(
        name,
        context + question,
        ", ".join(refs),
        meta,
        question,
        str(row.get("answer_prefix") or "").strip(),
        references=refs,
        metric="part" if qa else "all",
        max_new_tokens=int(tokens) if tokens else None,
    )


def file_task(spec: str, seed: int) -> Task:
    """Row ``seed`` of ``spec`` (``file:PATH[#TASK]`` or ``hub:OWNER/NAME[#TASK]``) as a task."""
    rows = load_rows(spec)
    if not 0 <= seed < len(rows):
        raise TaskError(f"{spec} has {len(rows)} rows; the seed picks one: 0..{len(rows) - 1}, not {seed}")
    return row_task(rows[seed], seed)
