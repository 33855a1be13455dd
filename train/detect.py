"""Training a detector: ``train_detector(cfg)``, alone or as one torchrun rank. Pictures are letterboxed to
--image-size squares (torchship.boxes), the model's own losses are summed, and every epoch ends with the mAP of
the detector's deployable form (torchship.detectors.TopK) on the validation pictures, computed by pycocotools
over all ranks. Checkpoints have the classification run's layout, with the detection meta export needs."""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from torchship.boxes import letterbox, letterbox_meta
from torchship.coco import coco_map
from torchship.detectors import OwnPostprocessing, TopK, build_detector, detections, has_topk
from torchship.device import resolve_amp
from torchship.errors import ConfigError, DataError
from torchship.imageio import decode_picture
from torchship.images import RAW_COUNT, RawSamples

from . import checkpoint as ck
from .config import TrainConfig
from .detection_data import DetectionSet, builtin_detection, read_coco
from .distributed import Dist, rank_batches
from .result import TrainResult
from .setup import _lr_lambda, run_record

DETECTION_SIZE = 128  # --image-size's default for detection: the built-in pictures' side
HELDOUT_PICTURES = 32  # validation pictures every checkpoint keeps, with their boxes, for export checks
UNSUPPORTED = ("resume", "compile", "profile", "channels_last", "save_every")


@dataclass
class Pictures:
    """Letterboxed pictures [n, 3, S, S] and each one's boxes (in the square's pixels) and labels."""

    images: torch.Tensor
    boxes: list[torch.Tensor]
    labels: list[torch.Tensor]
    picked: np.ndarray  # each one's index in the DetectionSet it was letterboxed from

    def __len__(self) -> int:
        return len(self.images)

    def targets(self, idx: list[int], device: str) -> list[dict[str, torch.Tensor]]:
        return [{"boxes": self.boxes[i].to(device), "labels": self.labels[i].to(device)} for i in idx]


def check_detection(cfg: TrainConfig) -> int:
    """The square side pictures are letterboxed to; ConfigError for options detection does not take."""
    given = [f"--{name.replace('_', '-')}" for name in UNSUPPORTED if getattr(cfg, name)]
    if given:
        raise ConfigError(f"{', '.join(given)}: not supported for detection; train without")
    size = cfg.image_size or DETECTION_SIZE
    if size % 32:
        raise ConfigError(f"--image-size {size}: a detector takes squares whose side is a multiple of 32")
    return size


def load_pictures(cfg: TrainConfig, size: int) -> tuple[DetectionSet, Pictures, Pictures]:
    """--data as training and validation pictures, letterboxed: the built-in set (digits) or a COCO set."""
    if cfg.data == "digits":
        data = builtin_detection(cfg.pictures, size, cfg.seed)
    elif cfg.data in ("synthetic",) or ":" in cfg.data:
        raise DataError(f"--data {cfg.data}: detection reads 'digits' (built in) or a COCO instances JSON or folder")
    else:
        data = read_coco(cfg.data)
    order = np.random.default_rng(cfg.seed).permutation(len(data))
    n_val = max(1, round(len(data) * cfg.val_fraction))
    if len(data) - n_val < cfg.batch_size:
        raise DataError(
            f"{data.source}: {len(data) - n_val} training pictures, fewer than --batch-size {cfg.batch_size}; "
            "lower --batch-size or add pictures"
        )

    def part(idx: np.ndarray) -> Pictures:
        images, boxes, labels = [], [], []
        for i in idx:
            img, lb = letterbox(data.images[i], size)
            images.append(torch.from_numpy(img))
            boxes.append(torch.from_numpy(lb.to_model(data.boxes[i])))
            labels.append(torch.from_numpy(data.labels[i]))
        return Pictures(torch.stack(images), boxes, labels, idx)

    return data, part(order[n_val:]), part(order[:n_val])


@torch.no_grad()
def evaluate(deployable: nn.Module, val: Pictures, d: Dist, per_rank: int, device: str, autocast) -> dict:
    """mAP, mAP@50 and mAR@100 of ``deployable`` (a TopK, or OwnPostprocessing) on the validation pictures, over
    all ranks."""
    truths, found = [], []
    deployable.eval()
    for idx in rank_batches(len(val), d, per_rank, 0, 0, shuffle=False):
        with autocast():
            out = deployable(val.images[idx].to(device))
        for p in detections(out):
            boxes, scores, labels = (p[k].cpu() for k in ("boxes", "scores", "labels"))
            found.append((boxes.float().numpy(), scores.float().numpy(), labels.numpy()))
        truths += [(val.boxes[i].numpy(), val.labels[i].numpy()) for i in idx]
    deployable.train()
    if d.world > 1:  # each rank scored its share: every rank computes the mAP of all of them
        shares = [None] * d.world
        torch.distributed.all_gather_object(shares, (truths, found))
        truths, found = [t for s in shares for t in s[0]], [f for s in shares for f in s[1]]
    return coco_map(truths, found)


def _heldout(val: Pictures, data: DetectionSet) -> dict[str, np.ndarray]:
    """The first validation pictures with their boxes padded to the most any of them has, and the first
    RAW_COUNT of them as files (raw_pictures)."""
    n = min(HELDOUT_PICTURES, len(val))
    most = max(1, max(len(val.boxes[i]) for i in range(n)))
    boxes = np.zeros((n, most, 4), np.float32)
    labels = np.zeros((n, most), np.int64)
    for i in range(n):
        boxes[i, : len(val.boxes[i])] = val.boxes[i].numpy()
        labels[i, : len(val.labels[i])] = val.labels[i].numpy()
    count = np.asarray([len(val.boxes[i]) for i in range(n)], np.int64)
    raw = raw_pictures(data, val.picked[: min(RAW_COUNT, n)], val.images.shape[-1])
    return {"images": val.images[:n].numpy(), "boxes": boxes, "labels": labels, "count": count, **raw.arrays()}


def raw_pictures(data: DetectionSet, picked: np.ndarray, size: int) -> RawSamples:
    """Pictures as a client sends them: each as a PNG file at its own size (8-bit, as a photo is), beside the
    tensor training's letterbox makes of that file (what the served image entry is checked against)."""
    from PIL import Image

    names, files, tensors = [], [], []
    for i in picked:
        buf = io.BytesIO()
        Image.fromarray(data.images[i]).save(buf, format="PNG")
        names.append(f"picture-{int(i):05d}.png")
        files.append(buf.getvalue())
        tensors.append(decode_picture(files[-1], size)[0])
    return RawSamples(names, files, np.stack(tensors), None)


def train_detector(cfg: TrainConfig, d: Dist, device: str, out: Path, log, on_step: Optional[Callable] = None):
    """Train ``cfg.arch`` as a detector on ``cfg.data``; checkpoints under ``out``. Returns the TrainResult
    (its val_acc fields hold the mAP@50). ConfigError or DataError for what does not fit."""
    t_start = time.perf_counter()
    size = check_detection(cfg)
    data, train_set, val = load_pictures(cfg, size)
    per_rank = cfg.batch_size // d.world
    plain = build_detector(cfg.arch, len(data.classes) + 1, size, _model_args(cfg)).to(device)
    # what export will deploy, scored as it will run; a detector TopK cannot carry is scored as in eager
    deployable = (TopK(plain, size) if has_topk(plain) else OwnPostprocessing(plain)).to(device)
    model = plain
    if d.initialized:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[d.local_rank] if device == "cuda" else None)
    opt = torch.optim.AdamW(plain.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = len(rank_batches(len(train_set), d, per_rank, 0, cfg.seed, True))
    total = steps_per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(total, max(1, min(100, total // 10))))
    amp, amp_reason = resolve_amp(cfg.amp, device)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == "fp16")

    def autocast():
        return torch.autocast(device_type=device, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None)

    meta = {
        "task": "detection",
        "arch": cfg.arch,
        "num_classes": len(data.classes) + 1,
        "model_args": _model_args(cfg),
        "classes": data.classes,
        "input_shape": [3, size, size],
        "letterbox": letterbox_meta(size),
        "detections": {
            "k": deployable.k,
            "candidates": deployable.candidates,
            "score_thresh": deployable.score_thresh,
            "iou_thresh": deployable.iou_thresh,
        }
        if isinstance(deployable, TopK)
        else None,
        "data": {"source": data.source, "train_pictures": len(train_set), "val_pictures": len(val), "seed": cfg.seed},
        **run_record(cfg, d, device, amp, amp_reason),
    }
    heldout = _heldout(val, data) if d.main else {}
    log(f"amp {amp}: {amp_reason}")
    log(
        f"training detector {cfg.arch} on {data.source}: {len(train_set)} train / {len(val)} val pictures of "
        f"{size} x {size}, {len(data.classes)} classes, world size {d.world}, device {device}, "
        f"{steps_per_epoch} steps/epoch"
    )
    step, best, last, pictures, t_loop = 0, -1.0, {"map50": 0.0}, 0, time.perf_counter()
    model.train()
    for epoch in range(cfg.epochs):
        batches = rank_batches(len(train_set), d, per_rank, epoch, cfg.seed, True)
        bar = _bar(cfg, d, len(batches), epoch)
        loss_sum = 0.0
        for idx in batches:
            with autocast():
                losses = model(list(train_set.images[idx].to(device)), train_set.targets(idx, device))
            loss = sum(losses.values())
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.grad_clip)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            pictures += len(idx) * d.world
            loss_sum += loss.item()
            if bar is not None:
                bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{sched.get_last_lr()[0]:.2e}")
                bar.update(1)
            if on_step is not None:
                on_step({"rank": d.rank, "epoch": epoch, "step": step, "indices": idx, "model": plain})
            if cfg.max_steps is not None and step >= cfg.max_steps:
                break
        if bar is not None:
            bar.close()
        last = evaluate(deployable, val, d, max(1, per_rank), device, autocast)
        elapsed = time.perf_counter() - t_loop
        record = {"epoch": epoch + 1, "step": step, "train_loss": loss_sum / max(1, len(batches)), **last}
        record.update(lr=sched.get_last_lr()[0], pictures_per_s=pictures / max(elapsed, 1e-9), elapsed_s=elapsed)
        log.metrics(out, record)
        log(
            f"epoch {epoch + 1}/{cfg.epochs}  step {step}  train_loss {record['train_loss']:.4f}  mAP "
            f"{100 * last['map']:.1f}%  mAP@50 {100 * last['map50']:.1f}%  {record['pictures_per_s']:.0f} pictures/s"
        )
        best = max(best, last["map50"])
        _save(out, plain, dict(meta, epoch=epoch + 1, step=step, metrics=last), heldout, last["map50"], cfg, d)
        if cfg.max_steps is not None and step >= cfg.max_steps:
            break
    wall = time.perf_counter() - t_start
    weights = _index_path(out, "best") / "model.pt"
    log(f"done in {wall:.1f}s: best mAP@50 {100 * max(best, 0.0):.1f}%; weights: {weights}")
    return TrainResult(
        best=_index_path(out, "best"),
        latest=_index_path(out, "latest"),
        val_acc=last["map50"],
        best_val_acc=max(best, 0.0),
        steps=step,
        wall_s=wall,
        images_per_s=pictures / max(time.perf_counter() - t_loop, 1e-9),
        world_size=d.world,
    )


def _model_args(cfg: TrainConfig) -> dict[str, Any]:
    from torchship.models import parse_model_args

    return parse_model_args(cfg.model_arg)


def _bar(cfg: TrainConfig, d: Dist, total: int, epoch: int):
    if not (d.main and cfg.progress):
        return None
    import sys

    from tqdm import tqdm

    desc = f"epoch {epoch + 1}/{cfg.epochs}"
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)


def _save(out: Path, plain: nn.Module, meta: dict, heldout: dict, metric: float, cfg: TrainConfig, d: Dist) -> None:
    """A checkpoint (rank 0 writes; the others wait): weights, meta and the held-out pictures with their boxes."""
    if d.main:

        def write_heldout(p: Path) -> None:
            with open(p, "wb") as f:
                np.savez(f, **heldout)

        ck.save_checkpoint(
            out / "checkpoints",
            f"step-{meta['step']:07d}",
            ck.clean_state_dict(plain),
            meta,
            None,
            write_heldout,
            metric,
            cfg.keep_last,
        )
    if d.initialized:
        import torch.distributed as dist

        dist.barrier()


def _index_path(out: Path, which: str) -> Path:
    from torchship.checkpoint import read_index

    return out / "checkpoints" / read_index(out / "checkpoints").get(which, "")
