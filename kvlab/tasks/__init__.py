"""Tasks: prompts with answers or references, generated offline and seeded, and their scorers.

``base`` holds the task type and the helpers every task builder shares; ``builtin`` the tasks of
kvlab's own (pass key, needles, lines, documents) and ``make_task``, which builds any task by name;
``ruler`` RULER's synthetic tasks; ``datafiles`` rows of RULER or LongBench files; ``exact_accuracy``
the calibrated scores of the exact cache. This layer imports only ``kvlab.core``.
"""

from kvlab.tasks.base import (
    OWN_TASKS,
    RULER_TASKS,
    SUITES,
    TASKS,
    Task,
    TaskError,
    join_question,
    parse_length,
    prompt_ids,
    prompt_text,
    split_ids,
    turn_ids,
)
from kvlab.tasks.builtin import make_task, score_result

__all__ = [
    "OWN_TASKS",
    "RULER_TASKS",
    "SUITES",
    "TASKS",
    "Task",
    "TaskError",
    "join_question",
    "make_task",
    "parse_length",
    "prompt_ids",
    "prompt_text",
    "score_result",
    "split_ids",
    "turn_ids",
]
