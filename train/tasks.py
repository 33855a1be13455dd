"""Each task's training, chosen once from the run's config: what the loop (torchship.train.loop) asks of it."""

from __future__ import annotations

from .classify import ClassifyTraining
from .config import TrainConfig
from .detect import DetectTraining

TRAINING = {t.task.name: t for t in (ClassifyTraining(), DetectTraining())}


def training_for(cfg: TrainConfig):
    """The training of the task ``cfg`` trains (--task, or for auto the one --arch belongs to)."""
    return TRAINING[cfg.resolved_task().name]
