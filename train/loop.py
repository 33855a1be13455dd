"""The training loop: one function, ``train(cfg)``, that runs alone or as one torchrun rank."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from torchship.checkpoint import INDEX, WEIGHTS, load_into, load_meta, load_weights, read_index, resolve_checkpoint
from torchship.config import as_dict
from torchship.device import check_amp, resolve_amp
from torchship.device import resolve_device as _resolve_device
from torchship.errors import CheckpointError, ConfigError, DataError
from torchship.io import git_revision
from torchship.models import Normalize, build_model, check_arch, parse_model_args

from . import checkpoint as ck
from .config import TrainConfig
from .data import DataSplit, check_data_source, collate_inputs, heldout_batch, is_factory, load_data
from .distributed import Dist, _batches, _loader, init_distributed
from .userdata import load_user_data


@dataclass
class TrainResult:
    best: Path              # checkpoint directory with the best validation accuracy
    latest: Path            # most recent checkpoint directory (resumable)
    val_acc: float          # validation accuracy of the last evaluation, 0..1
    best_val_acc: float
    steps: int              # optimizer steps taken in total (including before a resume)
    wall_s: float           # seconds spent in this call
    images_per_s: float     # training throughput of this call, all ranks together
    world_size: int


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


def _to(x, device: str):
    """A batch's inputs (a tensor, or a dict of them) on ``device``."""
    if isinstance(x, dict):
        return {k: v.to(device, non_blocking=True) for k, v in x.items()}
    return x.to(device, non_blocking=True)


def _logits(model: nn.Module, norm: nn.Module, x) -> torch.Tensor:
    """The class scores the loss is taken on: dict inputs go to forward by keyword; of a tuple or list of
    outputs the first, of a dict its 'logits' entry (else its first)."""
    out = model(**x) if isinstance(x, dict) else model(norm(x))
    if isinstance(out, dict):
        out = out["logits"] if "logits" in out else next(iter(out.values()))
    elif isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise DataError(f"the model's output for the loss must be [batch, classes] scores, got "
                        f"{list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
    return out


@torch.no_grad()
def evaluate(model: nn.Module, norm: nn.Module, ds, d: Dist, per_rank: int, device: str, autocast,
             collate=None) -> tuple[float, float]:
    """Validation loss and accuracy, summed over all ranks (each sample counted once)."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for batch in _loader(ds, _batches(len(ds), d, per_rank, 0, 0, shuffle=False), 0, 0, collate):
        x, y = collate_inputs(batch)
        x, y = _to(x, device), y.to(device)
        with autocast():
            logits = _logits(model, norm, x)
        totals[0] += nn.functional.cross_entropy(logits.float(), y, reduction="sum").double()
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += y.numel()
    if d.initialized:
        dist.all_reduce(totals)
    model.train()
    n = max(1.0, totals[2].item())
    return totals[0].item() / n, totals[1].item() / n


def _lr_lambda(total_steps: int, warmup: int) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return f


def prepare_out(cfg: TrainConfig) -> Path:
    """Refuse to mix a new run into an existing one unless --overwrite or --resume says so."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file")
    if (out / "checkpoints" / INDEX).exists() and not cfg.overwrite and not cfg.resolved_resume():
        raise ConfigError(f"--out {out} already holds checkpoints; pass --resume {out} to continue, "
                          "--overwrite to start over, or another --out")
    return out


def train(cfg: TrainConfig, on_step: Optional[Callable[[dict[str, Any]], None]] = None) -> TrainResult:
    """Train ``cfg.arch`` on ``cfg.data`` and write checkpoints under ``cfg.out``.

    Runs as a single process, or as one rank when started by torchrun. ``on_step`` is called
    on every rank after each optimizer step with {rank, epoch, step, indices, model} (tests use it).
    Raises ConfigError, DataError or CheckpointError for user mistakes.
    """
    t_start = time.perf_counter()
    device = resolve_device(cfg)
    check_data_source(cfg.data)  # before the run's folder and log exist
    check_arch(cfg.arch)
    out = prepare_out(cfg)
    resume = cfg.resolved_resume()  # before this run writes a checkpoint of its own
    resume_dir = resolve_checkpoint(resume, which="latest") if resume else None
    ck.seed_everything(cfg.seed)
    data = load_split(cfg)  # a data factory's mistakes too surface before anything is written
    d = init_distributed(device)
    cfg.check_world(d.world)
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        if cfg.overwrite and not resume:
            for name in ("metrics.jsonl", "train.log"):
                (out / name).unlink(missing_ok=True)
    if d.initialized:
        dist.barrier()
    log = _Log(out, d.main)
    try:
        return _train(cfg, data, d, device, out, resume_dir, log, on_step, t_start)
    finally:
        if log.file:
            log.file.close()


def load_split(cfg: TrainConfig) -> DataSplit:
    """--data as training and validation datasets: your own factory's, or a built-in or folder split."""
    if is_factory(cfg.data):
        return load_user_data(cfg.data)
    return load_data(cfg.data, cfg.image_size, cfg.val_fraction, cfg.seed, cfg.synthetic_samples, cfg.num_classes)


def _train(cfg, data: DataSplit, d: Dist, device: str, out: Path, resume_dir: Optional[Path], log: _Log, on_step,
           t_start) -> TrainResult:
    per_rank = cfg.batch_size // d.world
    n_classes = len(data.classes) if data.classes else None
    if len(data.train) < cfg.batch_size:
        raise DataError(f"the training split has {len(data.train)} samples, fewer than --batch-size {cfg.batch_size}; "
                        "lower --batch-size, or add images (or lower --val-fraction)")
    steps_per_epoch = len(_batches(len(data.train), d, per_rank, 0, cfg.seed, True))
    total_steps = steps_per_epoch * cfg.epochs
    in_ch = data.preprocessing.channels if data.preprocessing else None
    model_args = parse_model_args(cfg.model_arg)
    # your own data: the factory is called with the --model-arg values alone
    model = build_model(cfg.arch, n_classes if data.signature is None else None, in_ch, model_args)

    state = None
    if resume_dir is not None:
        meta = load_meta(resume_dir)
        if meta.get("arch") != cfg.arch or meta.get("num_classes") != n_classes:
            raise CheckpointError(
                f"--resume {resume_dir} holds {meta.get('arch')} with {meta.get('num_classes')} classes, "
                f"but this run trains {cfg.arch} with {n_classes} classes")
        load_into(model, load_weights(resume_dir), f"--resume {resume_dir}")
        state = ck.load_train_state(resume_dir)
    model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    norm = Normalize(data.preprocessing.mean, data.preprocessing.std).to(device) if data.preprocessing else nn.Identity()
    plain = model
    if d.initialized:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[d.local_rank] if device == "cuda" else None)
    if cfg.compile:
        model = torch.compile(model)

    opt = torch.optim.AdamW(plain.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(total_steps, max(1, min(100, total_steps // 10))))
    amp, amp_reason = resolve_amp(cfg.amp, device)
    if d.main:
        log(f"amp {amp}" + ("" if cfg.amp == amp else f" (--amp {cfg.amp})") + f": {amp_reason}")
    scaler = torch.amp.GradScaler("cuda", enabled=amp == "fp16")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)

    def autocast():
        return torch.autocast(device_type=device, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None)

    start_epoch, start_step, global_step, best_acc = 0, 0, 0, -1.0
    val_loss, val_acc = float("nan"), 0.0
    if state is not None:
        if state.get("world_size") != d.world:
            log(f"warning: resuming with world size {d.world}, saved with {state.get('world_size')}: "
                "training continues but is not bit-identical to an uninterrupted run")
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        start_epoch, start_step, global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        best_acc = state.get("best_acc", -1.0)
        val_acc = state.get("val_acc", 0.0)
        rngs = state["rng"]
        ck.set_rng_state(rngs[d.rank % len(rngs)])
        log(f"resumed from {resume_dir} at epoch {start_epoch + 1}, step {global_step}")

    base_meta = {
        "arch": cfg.arch, "num_classes": n_classes, "model_args": model_args, "classes": data.classes,
        "data": {"source": data.source, "train_samples": len(data.train), "val_samples": len(data.val),
                 "val_fraction": cfg.val_fraction, "seed": cfg.seed},
        "train_config": as_dict(cfg), "world_size": d.world, "device": device, "amp": amp, "amp_reason": amp_reason,
        "torch_version": torch.__version__, "git_revision": git_revision(),
    }

    if data.signature is None:
        base_meta.update(input_shape=[in_ch, *data.preprocessing.image_size], preprocessing=data.preprocessing.to_dict())
        if d.main:
            images, labels = heldout_batch(data.val)
            held_arrays = {"images": images.numpy().astype(np.float32), "labels": labels.numpy()}
    else:  # the signature read from the samples, and how forward takes them; export needs nothing else
        base_meta.update(signature=data.signature.to_manifest(), inputs_by="keyword" if data.by_keyword else "position")
        base_meta["data"].update(factory=cfg.data, val_fraction=None)
        feeds, labels = data.heldout
        held_arrays = {**{f"input/{k}": v for k, v in feeds.items()}, "labels": labels}

    def save(epoch: int, step_in_epoch: int, metrics: dict[str, Any], is_eval: bool) -> Path | None:
        rngs = [None] * d.world
        if d.initialized:
            dist.all_gather_object(rngs, ck.rng_state())
        else:
            rngs = [ck.rng_state()]
        path = None
        if d.main:
            st = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
                  "epoch": epoch, "step_in_epoch": step_in_epoch, "global_step": global_step, "rng": rngs,
                  "world_size": d.world, "best_acc": best_acc, "val_acc": val_acc}
            meta = dict(base_meta, epoch=epoch, step=global_step, metrics=metrics)

            def write_heldout(p: Path) -> None:
                with open(p, "wb") as f:
                    np.savez(f, **held_arrays)
            path = ck.save_checkpoint(out / "checkpoints", f"step-{global_step:07d}", ck.clean_state_dict(plain), meta, st,
                                      write_heldout, metrics.get("val_acc") if is_eval else None, cfg.keep_last)
        if d.initialized:
            dist.barrier()
        return path

    unit = "images" if data.signature is None else "samples"
    if d.main:
        what = (f"{n_classes} classes, input {in_ch}x{data.preprocessing.image_size[0]}x{data.preprocessing.image_size[1]}"
                if data.signature is None else f"inputs {data.signature.to_flags()}")
        log(f"training {cfg.arch} on {data.source}: {len(data.train)} train / {len(data.val)} val {unit}, {what}, "
            f"world size {d.world}, device {device}, amp {amp}, {steps_per_epoch} steps/epoch")

    prof = None
    if cfg.profile and d.main:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        prof = profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                       on_trace_ready=tensorboard_trace_handler(str(out / "profile")), record_shapes=True)
        prof.start()

    images_done, t_loop = 0, time.perf_counter()
    stopped = False
    model.train()
    for epoch in range(start_epoch, cfg.epochs):
        batches = _batches(len(data.train), d, per_rank, epoch, cfg.seed, True)
        skip = start_step if epoch == start_epoch else 0
        bar = None
        if d.main and cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(batches), initial=skip, desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False,
                       dynamic_ncols=True, file=sys.stderr)
        loss_sum, loss_n, gnorm = 0.0, 0, float("nan")
        step_in_epoch = skip
        for idx, batch in zip(batches[skip:], _loader(data.train, batches[skip:], cfg.workers, cfg.seed + epoch,
                                                      data.collate)):
            x, y = collate_inputs(batch)
            x, y = _to(x, device), y.to(device, non_blocking=True)
            if cfg.channels_last and isinstance(x, torch.Tensor) and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            with autocast():
                loss = nn.functional.cross_entropy(_logits(model, norm, x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)  # so the norm (and the clip) see true gradients
            gnorm = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.grad_clip or float("inf")))
            scaler.step(opt)
            scaler.update()
            sched.step()
            global_step += 1
            step_in_epoch += 1
            images_done += y.shape[0] * d.world
            loss_sum += loss.item()
            loss_n += 1
            if prof is not None:
                prof.step()
            if bar is not None:
                bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{sched.get_last_lr()[0]:.2e}", gnorm=f"{gnorm:.2f}")
                bar.update(1)
            if on_step is not None:
                on_step({"rank": d.rank, "epoch": epoch, "step": global_step, "indices": idx, "model": plain})
            if cfg.max_steps is not None and global_step >= cfg.max_steps:
                stopped = True
                break
            if cfg.save_every and global_step % cfg.save_every == 0 and step_in_epoch < len(batches):
                save(epoch, step_in_epoch, {"train_loss": loss_sum / loss_n}, False)
        if bar is not None:
            bar.close()
        if prof is not None:
            prof.stop()
            prof = None
            log(f"profiler trace written to {out / 'profile'} (open in https://ui.perfetto.dev or TensorBoard)")
        val_loss, val_acc = evaluate(model, norm, data.val, d, max(1, per_rank), device, autocast, data.collate)
        best_acc = max(best_acc, val_acc)
        elapsed = time.perf_counter() - t_loop
        record = {"epoch": epoch + 1, "step": global_step, "train_loss": loss_sum / max(1, loss_n),
                  "val_loss": val_loss, "val_acc": val_acc, "lr": sched.get_last_lr()[0], "grad_norm": gnorm,
                  "images_per_s": images_done / max(elapsed, 1e-9), "elapsed_s": elapsed}
        log.metrics(out, record)
        log(f"epoch {epoch + 1}/{cfg.epochs}  step {global_step}  train_loss {record['train_loss']:.4f}  "
            f"val_loss {val_loss:.4f}  val_acc {100 * val_acc:.2f}%  grad_norm {gnorm:.3f}  "
            f"{record['images_per_s']:.0f} {'img' if unit == 'images' else unit}/s")
        if stopped and step_in_epoch < len(batches):
            save(epoch, step_in_epoch, {"val_loss": val_loss, "val_acc": val_acc}, True)
        else:
            save(epoch + 1, 0, {"val_loss": val_loss, "val_acc": val_acc}, True)
        if stopped:
            break
    wall = time.perf_counter() - t_start
    index = read_index(out / "checkpoints")
    result = TrainResult(best=out / "checkpoints" / index.get("best", ""), latest=out / "checkpoints" / index.get("latest", ""),
                         val_acc=val_acc, best_val_acc=max(best_acc, 0.0), steps=global_step, wall_s=wall,
                         images_per_s=images_done / max(time.perf_counter() - t_loop, 1e-9), world_size=d.world)
    if d.main:
        log(f"done in {wall:.1f}s: best val_acc {100 * result.best_val_acc:.2f}%; weights: {result.best / WEIGHTS}")
    return result
