"""Setting up one training run: the model (resumed from a checkpoint if asked), its DDP and compile
wrappers, optimizer, schedule, AMP, and what every checkpoint of the run records."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from torchship.checkpoint import load_into, load_meta, load_weights
from torchship.config import as_dict
from torchship.device import resolve_amp
from torchship.errors import CheckpointError
from torchship.io import git_revision

from . import checkpoint as ck
from .config import TrainConfig
from .data import DataSplit
from .distributed import Dist, rank_batches


@dataclass
class Run:
    """What the steps of one training run share: its inputs, the model and optimizer state, and where
    it stands."""

    cfg: TrainConfig
    training: Any  # the task's training (torchship.train.tasks): its data, step, evaluation and log lines
    data: DataSplit
    d: Dist
    device: str
    out: Path
    log: Callable[[str], None]
    per_rank: int
    steps_per_epoch: int
    model: nn.Module  # what the steps call: the plain model, wrapped by DDP and torch.compile when asked
    plain: nn.Module  # the model whose weights are saved
    norm: nn.Module
    scored: Optional[nn.Module]  # what validation runs, where not the model itself (a detector's deployable form)
    opt: torch.optim.Optimizer
    sched: Any
    scaler: Any
    amp: str
    amp_dtype: Optional[torch.dtype]
    meta: dict[str, Any]  # what every checkpoint's meta.json records
    heldout: dict[str, np.ndarray]  # the samples every checkpoint keeps for export checks
    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    best: float = -1.0  # the best value of the task's metric so far (validation accuracy, mAP@50)
    last: float = 0.0  # its value at the last evaluation
    images_done: int = 0
    t_loop: float = 0.0

    def autocast(self):
        return torch.autocast(
            device_type=self.device, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None
        )


def set_up(
    cfg: TrainConfig,
    training,
    data: DataSplit,
    d: Dist,
    device: str,
    out: Path,
    resume_dir: Optional[Path],
    log: Callable[[str], None],
) -> Run:
    """The task's model (resumed from ``resume_dir`` if given), its DDP and compile wrappers, optimizer, schedule,
    AMP and the checkpoints' metadata; DataError/CheckpointError for data or a checkpoint that do not fit."""
    per_rank = cfg.batch_size // d.world
    steps_per_epoch = len(rank_batches(len(data.train), d, per_rank, 0, cfg.seed, True))
    plain = training.build(cfg, data)
    if resume_dir is not None:
        meta = load_meta(resume_dir)
        n_classes = len(data.classes) if data.classes else None
        if meta.get("arch") != cfg.arch or meta.get("num_classes") != n_classes:
            raise CheckpointError(
                f"--resume {resume_dir} holds {meta.get('arch')} with {meta.get('num_classes')} classes, "
                f"but this run trains {cfg.arch} with {n_classes} classes"
            )
        load_into(plain, load_weights(resume_dir), f"--resume {resume_dir}")
    plain.to(device)
    if cfg.channels_last:
        plain = plain.to(memory_format=torch.channels_last)
    scored = training.scored(plain, data)
    if scored is not None:
        scored.to(device)
    model = plain
    if d.initialized:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[d.local_rank] if device == "cuda" else None)
    if cfg.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW(plain.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    total_steps = steps_per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(total_steps, max(1, min(100, total_steps // 10))))
    amp, amp_reason = resolve_amp(cfg.amp, device)
    if d.main:
        log(f"amp {amp}" + ("" if cfg.amp == amp else f" (--amp {cfg.amp})") + f": {amp_reason}")
    meta = {**training.meta(cfg, data, scored), **run_record(cfg, d, device, amp, amp_reason)}
    run = Run(
        cfg,
        training,
        data,
        d,
        device,
        out,
        log,
        per_rank,
        steps_per_epoch,
        model,
        plain,
        training.norm(data, device),
        scored,
        opt,
        sched,
        torch.amp.GradScaler("cuda", enabled=amp == "fp16"),
        amp,
        {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp),
        meta,
        training.heldout(data) if d.main else {},
    )
    if resume_dir is not None:
        restore(run, ck.load_train_state(resume_dir), resume_dir)
    return run


def run_record(cfg: TrainConfig, d: Dist, device: str, amp: str, amp_reason: str) -> dict[str, Any]:
    """What every checkpoint's meta.json says of the run that wrote it, whatever the task."""
    return {
        "train_config": as_dict(cfg),
        "world_size": d.world,
        "device": device,
        "amp": amp,
        "amp_reason": amp_reason,
        "torch_version": torch.__version__,
        "git_revision": git_revision(),
    }


def restore(run: Run, state: dict[str, Any], resume_dir: Path) -> None:
    """Where a resumed run stands: optimizer, schedule, scaler, position and this rank's RNG state."""
    if state.get("world_size") != run.d.world:
        run.log(
            f"warning: resuming with world size {run.d.world}, saved with {state.get('world_size')}: "
            "training continues but is not bit-identical to an uninterrupted run"
        )
    run.opt.load_state_dict(state["optimizer"])
    run.sched.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    run.epoch, run.step_in_epoch, run.global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
    run.best = state.get("best", state.get("best_acc", -1.0))  # older checkpoints: best_acc and val_acc
    run.last = state.get("last", state.get("val_acc", 0.0))
    rngs = state["rng"]
    ck.set_rng_state(rngs[run.d.rank % len(rngs)])
    run.log(f"resumed from {resume_dir} at epoch {run.epoch + 1}, step {run.global_step}")


def _lr_lambda(total_steps: int, warmup: int) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f
