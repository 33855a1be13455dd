"""The training loop: one function, ``train(cfg)``, that runs alone or as one torchrun rank, for every task: DDP,
AMP, checkpoints and resume are the loop's; the data, the step's loss, the evaluation and the log's words are
the task's training (torchship.train.tasks)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from torchship.checkpoint import INDEX, WEIGHTS, read_index, resolve_checkpoint
from torchship.device import check_amp
from torchship.device import resolve_device as _resolve_device
from torchship.errors import ConfigError

from . import checkpoint as ck
from .config import TrainConfig
from .data import DataSplit
from .distributed import Dist, init_distributed, rank_batches, rank_loader
from .result import TrainResult
from .setup import Run, set_up
from .tasks import training_for


def resolve_device(cfg: TrainConfig) -> str:
    """Where training runs; ConfigError for --device cuda without CUDA or --amp fp16 off CUDA."""
    device = _resolve_device(cfg.device)
    check_amp(cfg.amp, device)
    return device


class _Log:
    def __init__(self, out: Path, main: bool):
        self.main = main
        self.file = open(out / "train.log", "a", encoding="utf-8") if main else None

    def __call__(self, msg: str) -> None:
        if self.main:
            print(msg, flush=True)
            self.file.write(msg + "\n")
            self.file.flush()

    def metrics(self, out: Path, record: dict[str, Any]) -> None:
        if self.main:
            with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def prepare_out(cfg: TrainConfig) -> Path:
    """Refuse to mix a new run into an existing one unless --overwrite or --resume says so."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file")
    if (out / "checkpoints" / INDEX).exists() and not cfg.overwrite and not cfg.resolved_resume():
        raise ConfigError(
            f"--out {out} already holds checkpoints; pass --resume {out} to continue, "
            "--overwrite to start over, or another --out"
        )
    return out


def train(cfg: TrainConfig, on_step: Optional[Callable[[dict[str, Any]], None]] = None) -> TrainResult:
    """Train ``cfg.arch`` on ``cfg.data`` and write checkpoints under ``cfg.out``.

    Runs as a single process, or as one rank when started by torchrun. ``on_step`` is called
    on every rank after each optimizer step with {rank, epoch, step, indices, model} (tests use it).
    Raises ConfigError, DataError or CheckpointError for user mistakes.
    """
    t_start = time.perf_counter()
    device = resolve_device(cfg)
    training = training_for(cfg)
    training.check(cfg)  # before the run's folder and log exist
    out = prepare_out(cfg)
    resume = cfg.resolved_resume()  # before this run writes a checkpoint of its own
    resume_dir = resolve_checkpoint(resume, which="latest") if resume else None
    ck.seed_everything(cfg.seed)
    data = training.load(cfg)  # a factory's mistakes surface before anything is written
    joining = not dist.is_initialized()
    d = init_distributed(device)
    log = None
    try:
        cfg.check_world(d.world)
        if d.main:
            out.mkdir(parents=True, exist_ok=True)
            if cfg.overwrite and not resume:
                for name in ("metrics.jsonl", "train.log"):
                    (out / name).unlink(missing_ok=True)
        if d.initialized:
            dist.barrier()
        log = _Log(out, d.main)
        return _train(cfg, training, data, d, device, out, resume_dir, log, on_step, t_start)
    finally:
        if log is not None and log.file:
            log.file.close()
        # The group this call joined is left here, in whatever script called train(): one left to
        # interpreter shutdown can abort a rank that has finished its work, and torchrun fails the job.
        if joining and d.initialized:
            dist.destroy_process_group()


def _save(run: Run, epoch: int, step_in_epoch: int, metrics: dict[str, Any], is_eval: bool) -> Path | None:
    """A checkpoint of where the run stands (every rank's RNG state gathered; rank 0 writes)."""
    d = run.d
    rngs = [None] * d.world
    if d.initialized:
        dist.all_gather_object(rngs, ck.rng_state())
    else:
        rngs = [ck.rng_state()]
    path = None
    if d.main:
        state = {
            "optimizer": run.opt.state_dict(),
            "scheduler": run.sched.state_dict(),
            "scaler": run.scaler.state_dict(),
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "global_step": run.global_step,
            "rng": rngs,
            "world_size": d.world,
            "best": run.best,
            "last": run.last,
        }

        def write_heldout(p: Path) -> None:
            with open(p, "wb") as f:
                np.savez(f, **run.heldout)

        path = ck.save_checkpoint(
            run.out / "checkpoints",
            f"step-{run.global_step:07d}",
            ck.clean_state_dict(run.plain),
            dict(run.meta, epoch=epoch, step=run.global_step, metrics=metrics),
            None if "resume" in run.training.task.options_unsupported else state,
            write_heldout,
            metrics.get(run.training.task.metric) if is_eval else None,
            run.cfg.keep_last,
        )
    if d.initialized:
        dist.barrier()
    return path


def _profiler(run: Run):
    """A started torch profiler over a few steps of the first epoch (--profile, rank 0), else None."""
    if not (run.cfg.profile and run.d.main):
        return None
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.device == "cuda" else [])
    prof = profile(
        activities=acts,
        schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(run.out / "profile")),
        record_shapes=True,
    )
    prof.start()
    return prof


def _epoch(run: Run, epoch: int, on_step, prof) -> tuple[float, float, bool, int]:
    """One epoch of optimizer steps from where the run stands (a resumed epoch skips the batches it did).
    Returns (mean training loss, the last gradient norm, whether --max-steps stopped it, batches in the epoch)."""
    cfg, d = run.cfg, run.d
    batches = rank_batches(len(run.data.train), d, run.per_rank, epoch, cfg.seed, True)
    skip = run.step_in_epoch if epoch == run.epoch else 0
    run.epoch, run.step_in_epoch = epoch, skip
    bar = None
    if d.main and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(
            total=len(batches),
            initial=skip,
            desc=f"epoch {epoch + 1}/{cfg.epochs}",
            leave=False,
            dynamic_ncols=True,
            file=sys.stderr,
        )
    loss_sum, loss_n, gnorm, stopped = 0.0, 0, float("nan"), False
    for idx, batch in zip(
        batches[skip:], rank_loader(run.data.train, batches[skip:], cfg.workers, cfg.seed + epoch, run.data.collate)
    ):
        x, y = run.training.batch(batch, run.device, cfg.channels_last)
        with run.autocast():
            loss = run.training.loss(run, x, y)
        run.opt.zero_grad(set_to_none=True)
        run.scaler.scale(loss).backward()
        run.scaler.unscale_(run.opt)  # so the norm (and the clip) see true gradients
        gnorm = float(torch.nn.utils.clip_grad_norm_(run.plain.parameters(), cfg.grad_clip or float("inf")))
        run.scaler.step(run.opt)
        run.scaler.update()
        run.sched.step()
        run.global_step += 1
        run.step_in_epoch += 1
        run.images_done += len(y) * d.world
        loss_sum += loss.item()
        loss_n += 1
        if prof is not None:
            prof.step()
        if bar is not None:
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{run.sched.get_last_lr()[0]:.2e}", gnorm=f"{gnorm:.2f}")
            bar.update(1)
        if on_step is not None:
            on_step({"rank": d.rank, "epoch": epoch, "step": run.global_step, "indices": idx, "model": run.plain})
        if cfg.max_steps is not None and run.global_step >= cfg.max_steps:
            stopped = True
            break
        if cfg.save_every and run.global_step % cfg.save_every == 0 and run.step_in_epoch < len(batches):
            _save(run, epoch, run.step_in_epoch, {"train_loss": loss_sum / loss_n}, False)
    if bar is not None:
        bar.close()
    return loss_sum / max(1, loss_n), gnorm, stopped, len(batches)


def _end_of_epoch(
    run: Run, epoch: int, train_loss: float, gnorm: float, stopped: bool, n_batches: int, steps_rate: float
) -> None:
    """Evaluate, log the epoch's metrics and save a checkpoint: mid-epoch when --max-steps stopped it there.
    ``steps_rate``: this epoch's samples/s over its training steps alone (no evaluation, no checkpoint)."""
    task = run.training.task
    metrics = run.training.evaluate(run)
    run.last = metrics[task.metric]
    run.best = max(run.best, run.last)
    elapsed = time.perf_counter() - run.t_loop
    record = {
        "epoch": epoch + 1,
        "step": run.global_step,
        "train_loss": train_loss,
        **metrics,
        "lr": run.sched.get_last_lr()[0],
        "grad_norm": gnorm,
        f"{task.unit}_per_s": run.images_done / max(elapsed, 1e-9),
        f"epoch_{task.unit}_per_s": steps_rate,
        "elapsed_s": elapsed,
    }
    run.log.metrics(run.out, record)
    run.log(
        f"epoch {epoch + 1}/{run.cfg.epochs}  step {run.global_step}  train_loss {train_loss:.4f}  "
        f"{run.training.epoch_text(record, run.data)}  grad_norm {gnorm:.3f}  "
        f"{record[f'{task.unit}_per_s']:.0f} {run.training.rate_unit(run.data)}/s"
    )
    if stopped and run.step_in_epoch < n_batches:
        _save(run, epoch, run.step_in_epoch, metrics, True)
    else:
        _save(run, epoch + 1, 0, metrics, True)


def _train(
    cfg, training, data: DataSplit, d: Dist, device: str, out: Path, resume_dir: Optional[Path], log: _Log, on_step,
    t_start,
) -> TrainResult:  # fmt: skip
    run = set_up(cfg, training, data, d, device, out, resume_dir, log)
    if d.main:
        log(
            f"training {cfg.arch} on {data.source}: {len(data.train)} train / {len(data.val)} val "
            f"{training.describe(run)}, world size {d.world}, device {device}, amp {run.amp}, "
            f"{run.steps_per_epoch} steps/epoch"
        )
    prof = _profiler(run)
    run.t_loop = time.perf_counter()
    run.model.train()
    for epoch in range(run.epoch, cfg.epochs):
        t0, done0 = time.perf_counter(), run.images_done
        train_loss, gnorm, stopped, n_batches = _epoch(run, epoch, on_step, prof)
        steps_rate = (run.images_done - done0) / max(time.perf_counter() - t0, 1e-9)
        if prof is not None:
            prof.stop()
            prof = None
            log(f"profiler trace written to {out / 'profile'} (open in https://ui.perfetto.dev or TensorBoard)")
        _end_of_epoch(run, epoch, train_loss, gnorm, stopped, n_batches, steps_rate)
        if stopped:
            break
    wall = time.perf_counter() - t_start
    index = read_index(out / "checkpoints")
    result = TrainResult(
        best=out / "checkpoints" / index.get("best", ""),
        latest=out / "checkpoints" / index.get("latest", ""),
        metric=training.task.metric,
        value=run.last,
        best_value=max(run.best, 0.0),
        steps=run.global_step,
        wall_s=wall,
        images_per_s=run.images_done / max(time.perf_counter() - run.t_loop, 1e-9),
        world_size=d.world,
    )
    if d.main:
        log(f"done in {wall:.1f}s: {training.best_text(result.best_value)}; weights: {result.best / WEIGHTS}")
    return result
