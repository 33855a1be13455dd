"""Datasets: scikit-learn's digits (default, no download), synthetic, or an ImageFolder (your own data
of any signature, from a factory, is in userdata.py).

Every dataset here yields float32 NCHW images in [0, 1] at the model's input size. Normalization
(mean/std) is applied by the model wrapper, so the exported graph and training share it.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate

from torchship.errors import DataError
from torchship.images import IMAGE_SUFFIXES, RAW_COUNT, ImageFolderDataset, Preprocessing, RawSamples

BUILTIN_DATA = ("digits", "synthetic")
RAW_BYTES = 8 << 20  # the held-out files kept as they are: at most this many bytes of them


@dataclass
class DataSplit:
    train: Dataset
    val: Dataset
    classes: Optional[list[str]]  # None: your own data that names no classes
    preprocessing: Optional[Preprocessing]  # images only
    source: str
    signature: Optional[Any] = None  # your own data: the inputs' torchship.signature.Signature
    heldout: Optional[tuple[dict[str, np.ndarray], np.ndarray]] = None  # your own data: held-out inputs, targets
    raw: Optional[Callable[[], RawSamples]] = None  # images: held-out samples as files, made on demand
    collate: Optional[Callable] = None  # your own data: the dataset's collate_fn
    by_keyword: bool = False  # your own data: inputs are a dict, passed to forward by keyword


def _stratified_split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic stratified split: same seed, same indices, on every rank and every run."""
    rng = np.random.default_rng(seed)
    train_idx, val_idx = [], []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        n_val = max(1, int(round(len(idx) * val_fraction))) if len(idx) > 1 else 0
        val_idx.append(idx[:n_val])
        train_idx.append(idx[n_val:])
    return np.sort(np.concatenate(train_idx)), np.sort(np.concatenate(val_idx))


def _resize(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    return torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)


def _channel_stats(x: torch.Tensor) -> tuple[list[float], list[float]]:
    mean = x.mean(dim=(0, 2, 3))
    std = x.std(dim=(0, 2, 3)).clamp_min(1e-3)
    return [round(float(v), 6) for v in mean], [round(float(v), 6) for v in std]


def _tensor_split(
    x: torch.Tensor,
    y: torch.Tensor,
    classes: list[str],
    val_fraction: float,
    seed: int,
    source: str,
    source_scale: str,
    split: tuple[np.ndarray, np.ndarray] | None = None,
) -> DataSplit:
    tr, va = split if split is not None else _stratified_split(y.numpy(), val_fraction, seed)
    mean, std = _channel_stats(x[tr])
    pre = Preprocessing(
        image_size=[x.shape[-2], x.shape[-1]], channels=x.shape[1], mean=mean, std=std, source_scale=source_scale
    )
    return DataSplit(TensorDataset(x[tr], y[tr]), TensorDataset(x[va], y[va]), classes, pre, source)


def digits_inputs(images: np.ndarray, image_size: int) -> torch.Tensor:
    """Digits as training feeds them: [N, 8, 8] grey levels 0..16 -> /16, bilinear to the size, RGB."""
    x = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
    return _resize(x, image_size).clamp_(0.0, 1.0).repeat(1, 3, 1, 1).contiguous()


def load_digits(image_size: int, val_fraction: float, seed: int) -> DataSplit:
    """scikit-learn's 1,797 handwritten digits (8x8, 17 grey levels), upsampled and made RGB."""
    from .bundled import digits

    images, target = digits()
    x = digits_inputs(images, image_size)
    y = torch.from_numpy(target)
    tr, va = _stratified_split(y.numpy(), val_fraction, seed)
    split = _tensor_split(x, y, [str(c) for c in range(10)], val_fraction, seed, "digits", "pixel / 16", (tr, va))
    split.raw = lambda: _digit_files(images[va[:RAW_COUNT]], target[va[:RAW_COUNT]], image_size)
    return split


def _digit_files(images: np.ndarray, labels: np.ndarray, image_size: int) -> RawSamples:
    """The held-out digits as 8-bit grey PNG files holding their levels 0..16 (the digits' own scale, which the
    preprocessing records as pixel / 16), and training's tensors of what those files decode to."""
    from PIL import Image

    files, decoded = [], []
    for a in images:
        buf = io.BytesIO()
        Image.fromarray(a.astype(np.uint8), mode="L").save(buf, format="PNG")
        files.append(buf.getvalue())
        with Image.open(io.BytesIO(files[-1])) as im:
            decoded.append(np.asarray(im))
    names = [f"digit_{i:02d}_{int(c)}.png" for i, c in enumerate(labels)]
    return RawSamples(names, files, digits_inputs(np.stack(decoded), image_size).numpy(), labels.astype(np.int64))


def make_synthetic(samples: int, num_classes: int, image_size: int, val_fraction: float, seed: int) -> DataSplit:
    """Learnable synthetic images: each class is a fixed random pattern plus noise."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.rand(num_classes, 3, image_size, image_size, generator=g)
    y = torch.arange(samples) % num_classes
    x = (0.7 * protos[y] + 0.3 * torch.rand(samples, 3, image_size, image_size, generator=g)).clamp_(0, 1)
    return _tensor_split(
        x, y, [f"class_{i}" for i in range(num_classes)], val_fraction, seed, "synthetic", "pixel / 255"
    )


def is_factory(data: str) -> bool:
    """Whether --data names a package.module:factory rather than a built-in dataset or a folder."""
    return ":" in data and not Path(data).exists()


def check_data_source(data: str) -> None:
    """Refuse a --data that names neither a built-in dataset, a folder nor an importable factory, before
    anything is written."""
    if is_factory(data):
        from torchship.models import import_factory

        import_factory(data, "--data")
    elif data not in BUILTIN_DATA:
        _check_folder(Path(data))


def _check_folder(root: Path) -> None:
    if not root.exists():
        raise DataError(
            f"--data {root}: no such directory (use {' or '.join(BUILTIN_DATA)}, an ImageFolder path, "
            "or package.module:factory)"
        )
    if not root.is_dir():
        raise DataError(f"--data {root}: not a directory (expected one sub-folder per class)")


def scan_image_folder(root: str | Path) -> tuple[list[tuple[str, int]], list[str]]:
    """List (file, class index) pairs of an ImageFolder tree; DataError if unusable."""
    root = Path(root)
    _check_folder(root)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    files: list[tuple[str, int]] = []
    for i, c in enumerate(classes):
        for p in sorted((root / c).rglob("*")):
            if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES:
                files.append((str(p), i))
    if not files:
        raise DataError(f"--data {root}: no images found (expected {root}/<class>/<image>.png ...)")
    present = sorted({label for _, label in files})
    if len(present) < 2:
        only = classes[present[0]] if present else "?"
        raise DataError(f"--data {root}: only one class with images ('{only}'); a classifier needs at least two")
    return files, classes


def load_image_folder(
    root: str, image_size: int, val_fraction: float, seed: int, stats_samples: int = 256
) -> DataSplit:
    files, classes = scan_image_folder(root)
    labels = np.array([label for _, label in files])
    tr, va = _stratified_split(labels, val_fraction, seed)
    ds = ImageFolderDataset(files, image_size)
    rng = np.random.default_rng(seed)
    sample = rng.choice(tr, size=min(stats_samples, len(tr)), replace=False)
    mean, std = _channel_stats(torch.stack([ds[int(i)][0] for i in sample]))
    pre = Preprocessing(image_size=[image_size, image_size], channels=3, mean=mean, std=std)
    split = DataSplit(Subset(ds, tr.tolist()), Subset(ds, va.tolist()), classes, pre, str(Path(root).resolve()))
    split.raw = lambda: _folder_files(ds, va)
    return split


def _folder_files(ds: ImageFolderDataset, val: np.ndarray) -> RawSamples:
    """The first held-out files of a folder as they are (at most RAW_COUNT, and RAW_BYTES in all), and what
    the training data set makes of each."""
    picked: list[int] = []
    total = 0
    for i in val[:RAW_COUNT]:
        n = Path(ds.files[int(i)][0]).stat().st_size
        if picked and total + n > RAW_BYTES:
            break
        picked.append(int(i))
        total += n
    names = [f"{k:02d}_{Path(ds.files[i][0]).name}" for k, i in enumerate(picked)]
    files = [Path(ds.files[i][0]).read_bytes() for i in picked]
    inputs = np.stack([ds[i][0].numpy() for i in picked]).astype(np.float32)
    return RawSamples(names, files, inputs, np.array([ds.files[i][1] for i in picked], np.int64))


def load_data(
    data: str,
    image_size: int | None,
    val_fraction: float,
    seed: int,
    synthetic_samples: int = 512,
    num_classes: int | None = None,
) -> DataSplit:
    """Resolve --data into a train/validation split (see module docstring)."""
    if data == "digits":
        return load_digits(image_size or 32, val_fraction, seed)
    if data == "synthetic":
        return make_synthetic(synthetic_samples, num_classes or 10, image_size or 32, val_fraction, seed)
    return load_image_folder(data, image_size or 224, val_fraction, seed)


def collate_inputs(batch: Any) -> tuple[Any, torch.Tensor]:
    """A collated (inputs, targets) batch with targets as a 1-D int64 tensor."""
    x, y = batch
    return x, torch.as_tensor(y).reshape(-1).long()


def heldout_batch(
    ds: Dataset, collate: Optional[Callable] = None, limit_bytes: int = 8 << 20, max_count: int = 64
) -> tuple[Any, torch.Tensor]:
    """The first validation samples as one batch (``collate``, else torch's default): at most ``max_count``,
    and about ``limit_bytes`` (sized by the first sample, so padding may add to it). Returns (inputs, int64
    targets); export verifies, warms up and benchmarks with them."""
    collate = collate or default_collate

    def nbytes(x) -> int:
        return sum(v.numel() * v.element_size() for v in (x.values() if isinstance(x, dict) else [x]))

    per = nbytes(collate([ds[0]])[0])
    n = max(1, min(len(ds), max_count, limit_bytes // max(1, per)))
    return collate_inputs(collate([ds[i] for i in range(n)]))


def steps_per_epoch(n_train: int, batch_size: int) -> int:
    return max(1, math.floor(n_train / batch_size))
