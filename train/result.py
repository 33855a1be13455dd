"""What a training run returns to its caller."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class TrainResult:
    best: Path  # checkpoint directory with the best value of the task's metric
    latest: Path  # most recent checkpoint directory (resumable where the task allows it)
    metric: str  # the task's metric, as checkpoints record it: val_acc (validation accuracy), map50 (mAP@50)
    value: float  # its value at the last evaluation, 0..1
    best_value: float
    steps: int  # optimizer steps taken in total (including before a resume)
    wall_s: float  # seconds spent in this call
    images_per_s: float  # training throughput of this call, all ranks together
    world_size: int
