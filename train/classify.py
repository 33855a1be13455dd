"""Training a classifier, the parts the loop asks of its task: the data (the built-in digits, synthetic images, an
ImageFolder or your own factory's datasets), the model and its normalization, the cross-entropy step, and the
validation loss and accuracy every epoch ends with."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from torchship.errors import DataError
from torchship.models import Normalize, build_model, check_arch, parse_model_args
from torchship.tasks import CLASSIFICATION

from .config import TrainConfig
from .data import (
    BUILTIN_DATA,
    DataSplit,
    check_data_source,
    collate_inputs,
    heldout_batch,
    is_factory,
    load_data,
    scan_image_folder,
)
from .distributed import Dist, rank_batches, rank_loader
from .userdata import load_user_data


class ClassifyTraining:
    """A classifier's training: cross-entropy on class scores, judged by validation accuracy (val_acc)."""

    task = CLASSIFICATION

    def check(self, cfg: TrainConfig, scan: bool = False) -> None:
        """ConfigError or DataError for data or an --arch it cannot train; ``scan``: an image folder's files too."""
        check_data_source(cfg.data)
        check_arch(cfg.arch)
        if scan and cfg.data not in BUILTIN_DATA and not is_factory(cfg.data):
            scan_image_folder(cfg.data)

    def load(self, cfg: TrainConfig) -> DataSplit:
        """--data as training and validation datasets: your own factory's, or a built-in or folder split."""
        if is_factory(cfg.data):
            data = load_user_data(cfg.data)
        else:
            data = load_data(
                cfg.data, cfg.image_size, cfg.val_fraction, cfg.seed, cfg.synthetic_samples, cfg.num_classes
            )
        if len(data.train) < cfg.batch_size:
            raise DataError(
                f"the training split has {len(data.train)} samples, fewer than --batch-size {cfg.batch_size}; "
                "lower --batch-size, or add images (or lower --val-fraction)"
            )
        return data

    def build(self, cfg: TrainConfig, data: DataSplit) -> nn.Module:
        n_classes = len(data.classes) if data.classes else None
        in_ch = data.preprocessing.channels if data.preprocessing else None
        # your own data: the factory is called with the --model-arg values alone
        return build_model(
            cfg.arch, n_classes if data.signature is None else None, in_ch, parse_model_args(cfg.model_arg)
        )

    def norm(self, data: DataSplit, device: str) -> nn.Module:
        return (
            Normalize(data.preprocessing.mean, data.preprocessing.std).to(device)
            if data.preprocessing
            else nn.Identity()
        )

    def scored(self, plain: nn.Module, data: DataSplit) -> None:
        """What validation runs besides the model itself: nothing, the model's scores are read as they are."""
        return None

    def meta(self, cfg: TrainConfig, data: DataSplit, scored) -> dict[str, Any]:
        """What every checkpoint's meta.json records of the model and its data."""
        meta = {
            "arch": cfg.arch,
            "num_classes": len(data.classes) if data.classes else None,
            "model_args": parse_model_args(cfg.model_arg),
            "classes": data.classes,
            "data": {
                "source": data.source,
                "train_samples": len(data.train),
                "val_samples": len(data.val),
                "val_fraction": cfg.val_fraction,
                "seed": cfg.seed,
            },
        }
        if data.signature is None:
            pre = data.preprocessing
            meta.update(input_shape=[pre.channels, *pre.image_size], preprocessing=pre.to_dict())
        else:  # the signature read from the samples, and how forward takes them; export needs nothing else
            meta.update(signature=data.signature.to_manifest(), inputs_by="keyword" if data.by_keyword else "position")
            meta["data"].update(factory=cfg.data, val_fraction=None)
        return meta

    def heldout(self, data: DataSplit) -> dict[str, np.ndarray]:
        """The samples every checkpoint keeps for export checks (and the files of the first, where images)."""
        if data.signature is not None:
            feeds, labels = data.heldout
            return {**{f"input/{k}": v for k, v in feeds.items()}, "labels": labels}
        images, labels = heldout_batch(data.val)
        held = {"images": images.numpy().astype(np.float32), "labels": labels.numpy()}
        if data.raw is not None:
            held.update(data.raw().arrays())
        return held

    def batch(self, batch, device: str, channels_last: bool):
        x, y = collate_inputs(batch)
        x, y = _to(x, device), y.to(device, non_blocking=True)
        if channels_last and isinstance(x, torch.Tensor) and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def loss(self, run, x, y) -> torch.Tensor:
        return nn.functional.cross_entropy(_logits(run.model, run.norm, x), y)

    def evaluate(self, run) -> dict[str, float]:
        val_loss, val_acc = evaluate(
            run.model, run.norm, run.data.val, run.d, max(1, run.per_rank), run.device, run.autocast, run.data.collate
        )
        return {"val_loss": val_loss, "val_acc": val_acc}

    def unit(self, data: DataSplit) -> str:
        return "images" if data.signature is None else "samples"

    def describe(self, run) -> str:
        data = run.data
        if data.signature is not None:
            return f"{self.unit(data)}, inputs {data.signature.to_flags()}"
        return (
            f"{self.unit(data)}, {run.meta['num_classes']} classes, input {'x'.join(map(str, run.meta['input_shape']))}"
        )

    def epoch_text(self, record: dict[str, Any], data: DataSplit) -> str:
        return f"val_loss {record['val_loss']:.4f}  val_acc {100 * record['val_acc']:.2f}%"

    def rate_unit(self, data: DataSplit) -> str:
        return "img" if data.signature is None else "samples"

    def best_text(self, best: float) -> str:
        return f"best val_acc {100 * best:.2f}%"


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
        raise DataError(
            f"the model's output for the loss must be [batch, classes] scores, got "
            f"{list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}"
        )
    return out


@torch.no_grad()
def evaluate(
    model: nn.Module, norm: nn.Module, ds, d: Dist, per_rank: int, device: str, autocast, collate=None
) -> tuple[float, float]:
    """Validation loss and accuracy, summed over all ranks (each sample counted once)."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for batch in rank_loader(ds, rank_batches(len(ds), d, per_rank, 0, 0, shuffle=False), 0, 0, collate):
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
