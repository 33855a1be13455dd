"""What a training run returns to its caller."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class TrainResult:
    best: Path  # checkpoint directory with the best validation accuracy
    latest: Path  # most recent checkpoint directory (resumable)
    val_acc: float  # validation accuracy of the last evaluation, 0..1 (a detector: its mAP@50)
    best_val_acc: float
    steps: int  # optimizer steps taken in total (including before a resume)
    wall_s: float  # seconds spent in this call
    images_per_s: float  # training throughput of this call, all ranks together
    world_size: int
