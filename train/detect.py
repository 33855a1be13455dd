"""Training a detector, the parts the loop asks of its task: pictures letterboxed to --image-size squares
(torchship.boxes), the model's own losses summed, and every epoch ending with the mAP of the detector's
deployable form (torchship.detectors.TopK) on the validation pictures, computed by pycocotools over all ranks.
Checkpoints have the classification run's layout, with the detection meta export needs."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from torchship.boxes import letterbox, letterbox_meta
from torchship.coco import coco_map
from torchship.detectors import OwnPostprocessing, TopK, build_detector, detections, has_topk
from torchship.errors import ConfigError, DataError
from torchship.imageio import decode_picture
from torchship.images import RAW_COUNT, RawSamples
from torchship.models import parse_model_args
from torchship.tasks import DETECTION

from .config import TrainConfig
from .data import DataSplit
from .detection_data import DetectionSet, builtin_detection, read_coco
from .distributed import Dist, rank_batches

DETECTION_SIZE = 128  # --image-size's default for detection: the built-in pictures' side
HELDOUT_PICTURES = 32  # validation pictures every checkpoint keeps, with their boxes, for export checks


@dataclass
class Pictures:
    """Letterboxed pictures [n, 3, S, S] and each one's boxes (in the square's pixels) and labels."""

    images: torch.Tensor
    boxes: list[torch.Tensor]
    labels: list[torch.Tensor]
    picked: np.ndarray  # each one's index in the DetectionSet it was letterboxed from

    def __len__(self) -> int:
        return len(self.images)


class PictureSet(torch.utils.data.Dataset):
    """Letterboxed pictures as the loop's dataset: item i is (picture, its boxes and labels); ``source`` is the
    DetectionSet they were letterboxed from (the held-out files are made from it)."""

    def __init__(self, pictures: Pictures, source: DetectionSet):
        self.pictures, self.source = pictures, source

    def __len__(self) -> int:
        return len(self.pictures)

    def __getitem__(self, i: int):
        p = self.pictures
        return p.images[i], {"boxes": p.boxes[i], "labels": p.labels[i]}


def collate_pictures(items: list) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    return torch.stack([x for x, _ in items]), [t for _, t in items]


def check_detection(cfg: TrainConfig) -> int:
    """The square side pictures are letterboxed to; ConfigError for options detection does not take."""
    given = [f"--{name.replace('_', '-')}" for name in DETECTION.options_unsupported if getattr(cfg, name)]
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


class DetectTraining:
    """A detector's training: the sum of the model's own losses, judged by the validation mAP@50 (map50) of what
    export will deploy, scored as it will run (a detector TopK cannot carry: as in eager)."""

    task = DETECTION

    def check(self, cfg: TrainConfig, scan: bool = False) -> None:
        check_detection(cfg)

    def load(self, cfg: TrainConfig) -> DataSplit:
        data, train_set, val = load_pictures(cfg, check_detection(cfg))
        return DataSplit(
            PictureSet(train_set, data),
            PictureSet(val, data),
            data.classes,
            None,
            data.source,
            collate=collate_pictures,
        )

    def build(self, cfg: TrainConfig, data: DataSplit) -> nn.Module:
        size = data.val.pictures.images.shape[-1]
        return build_detector(cfg.arch, len(data.classes) + 1, size, parse_model_args(cfg.model_arg))

    def norm(self, data: DataSplit, device: str) -> nn.Module:
        return nn.Identity()  # the detector normalizes inside

    def scored(self, plain: nn.Module, data: DataSplit) -> nn.Module:
        size = data.val.pictures.images.shape[-1]
        return TopK(plain, size) if has_topk(plain) else OwnPostprocessing(plain)

    def meta(self, cfg: TrainConfig, data: DataSplit, scored: nn.Module) -> dict[str, Any]:
        size = data.val.pictures.images.shape[-1]
        return {
            "task": DETECTION.name,
            "arch": cfg.arch,
            "num_classes": len(data.classes) + 1,
            "model_args": parse_model_args(cfg.model_arg),
            "classes": data.classes,
            "input_shape": [3, size, size],
            "letterbox": letterbox_meta(size),
            "detections": {
                "k": scored.k,
                "candidates": scored.candidates,
                "score_thresh": scored.score_thresh,
                "iou_thresh": scored.iou_thresh,
            }
            if isinstance(scored, TopK)
            else None,
            "data": {
                "source": data.source,
                "train_pictures": len(data.train),
                "val_pictures": len(data.val),
                "seed": cfg.seed,
            },
        }

    def heldout(self, data: DataSplit) -> dict[str, np.ndarray]:
        return _heldout(data.val.pictures, data.val.source)

    def batch(self, batch, device: str, channels_last: bool):
        images, targets = batch
        return images.to(device), [{k: v.to(device) for k, v in t.items()} for t in targets]

    def loss(self, run, x, y) -> torch.Tensor:
        return sum(run.model(list(x), y).values())

    def evaluate(self, run) -> dict[str, float]:
        return evaluate(run.scored, run.data.val.pictures, run.d, max(1, run.per_rank), run.device, run.autocast)

    def describe(self, run) -> str:
        size = run.meta["input_shape"][-1]
        return f"pictures of {size} x {size}, {len(run.data.classes)} classes"

    def epoch_text(self, record: dict[str, Any], data: DataSplit) -> str:
        return f"mAP {100 * record['map']:.1f}%  mAP@50 {100 * record['map50']:.1f}%"

    def rate_unit(self, data: DataSplit) -> str:
        return "pictures"

    def best_text(self, best: float) -> str:
        return f"best mAP@50 {100 * best:.1f}%"
