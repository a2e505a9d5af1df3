"""Preset prompts for the page: built-in texts, and the tasks (prompt + answer) sized for the model."""

from __future__ import annotations

from kvlab.core.model import LoadedModel
from kvlab.tasks import Task, make_task
from kvlab.tasks.exact_accuracy import able_tasks

DEFAULT_PRESET = "Document question"
TASK_PRESETS = {
    "Document question": "document",
    "Pass-key retrieval": "passkey",
    "Needle in prose": "needle",
    "Several needles": "multikey",
    "Line retrieval": "lines",
}


def _reference_text(chars: int) -> str:
    from pydoc_data.topics import topics

    keys = ("assignment", "augassign", "assert", "atom-identifiers", "attribute-access", "binary", "bitwise")
    return "\n\n".join(topics[k] for k in keys)[:chars]


def _filler(n: int) -> str:
    line = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    return line * n


def builtin_presets() -> dict[str, str]:
    """Prompts for the preset picker (~1k tokens each, except free chat)."""
    doc = _reference_text(3800)
    half = _filler(24)
    lines = "\n".join(
        f"line {w}-{i}: REGISTER_CONTENT is <{(7919 * i) % 50000}>"
        for i, w in enumerate(("amber", "brisk", "cedar", "delta", "ember", "fjord") * 10)
    )
    return {
        "Document question": f"{doc}\n\nQuestion: according to the text above, what does an augmented assignment "
        "statement do? Answer in one sentence.",
        "Pass-key retrieval": "There is an important pass key hidden in a lot of irrelevant text. Find it.\n"
        f"{half}The pass key is 71432. Remember it. 71432 is the pass key.\n{half}"
        "What is the pass key?",
        "Line retrieval": f"Below is a record of lines. Memorize them.\n{lines}\n\n"
        "What is the REGISTER_CONTENT in line cedar-26?",
        "Free chat": "Explain in three sentences why the sky is blue.",
    }


def presets(lm: LoadedModel | None = None, n_tokens: int = 1000) -> tuple[dict[str, str], dict[str, Task]]:
    """Preset prompts and, for task presets, their ``kvlab.tasks.Task`` (answer + scoring).

    Task prompts come from kvlab.tasks sized to ~``n_tokens`` for ``lm``; the built-in texts stand in
    when that is not possible. RULER's tasks are offered only where exact can do them on ``lm``
    (calibrated, ``kvlab.tasks.exact_accuracy``).
    """
    texts = builtin_presets()
    tasks: dict[str, Task] = {}
    if lm is None:
        return texts, tasks
    try:
        for label, name in {**TASK_PRESETS, **ruler_presets(lm.info.id, n_tokens)}.items():
            task = make_task(name, n_tokens, 0, lm.encode)
            texts[label], tasks[label] = task.prompt, task
    except Exception:  # noqa: BLE001 - presets must never break the page
        pass
    return texts, tasks


def ruler_presets(model: str, n_tokens: int) -> dict[str, str]:
    """Preset label -> RULER task, for the tasks exact can do on ``model`` (``kvlab.tasks.exact_accuracy``)."""

    return {f"RULER {name}": name for name in able_tasks(model, n_tokens)}
