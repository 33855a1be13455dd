"""What differs between tasks, one object per task: ``task_of(record)`` picks it once from a checkpoint's meta, an
export's manifest or a served model's config, and shared code calls it without asking which task it holds.

A task owns its metric and gate, its parity rule and report lines, the bench's response check, its image entry's
extra steps and the preprocessing of a picture file; the train stage's loop calls its training step
(torchship.train.tasks). A new task is a module here beside classification.py and detection.py, listed in TASKS."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .base import Task
from .classification import Classification
from .detection import Detection

CLASSIFICATION, DETECTION = Classification(), Detection()
TASKS: tuple[Task, ...] = (DETECTION, CLASSIFICATION)  # asked in order: classification takes what none claims


def task_of(record: dict[str, Any]) -> Task:
    """The task a checkpoint's meta, an export's manifest or a served model's config (Triton's JSON form) records."""
    return next(t for t in TASKS if t.records(record))


def task_named(name: str, arch: str = "") -> Task:
    """The task a --task value names (its name or its short spelling); "auto": the one ``arch`` belongs to."""
    if name == "auto":
        return next(t for t in TASKS if t.trains_arch(arch))
    for t in TASKS:
        if name in (t.name, t.short):
            return t
    raise ConfigError(f"--task {name}: choose from auto, {', '.join(t.short for t in reversed(TASKS))}")


__all__ = ["CLASSIFICATION", "DETECTION", "TASKS", "Task", "task_named", "task_of"]
