"""An image model exported from its weights (``export --image-files DIR``): the image preprocessing the served
image entry applies (RGB, Pillow's bilinear resize to the input's size, /255; the model normalizes itself), and
the user's sample files kept as a client sends them, beside the tensors that preprocessing makes of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from torchship.errors import ConfigError, DataError
from torchship.imageio import decode_image, decode_picture
from torchship.images import IMAGE_SUFFIXES, RAW_COUNT, RawSamples

SAMPLE_FILES = 64  # files read as real samples (calibration, gates) where --example-inputs gives none
RAW_BYTES = 8 << 20  # the kept files' total, at most


def image_preprocessing(sig) -> dict[str, Any]:
    """The preprocessing of a model that takes one float32 RGB image [B, 3, H, W] in [0, 1]; ConfigError
    naming the input otherwise."""
    t = sig.inputs[0]
    dims = t.shape[1:]
    if (
        len(sig.inputs) != 1
        or t.dtype != "float32"
        or len(dims) != 3
        or dims[0] != 3
        or not all(isinstance(d, int) for d in dims)
    ):
        raise ConfigError(
            "--image-files: the model must take one float32 RGB image input [B, 3, H, W] of a fixed "
            f"size; it takes {', '.join(f'{i.name} {i.dtype} {i.shape}' for i in sig.inputs)}"
        )
    return {
        "image_size": [int(dims[1]), int(dims[2])],
        "channels": 3,
        "layout": "NCHW",
        "dtype": "float32",
        "value_range": [0.0, 1.0],
        "resize": "bilinear",
        "source_scale": "pixel / 255",
    }


def image_files(folder: str | Path) -> list[Path]:
    """The image files under ``folder`` (any depth), sorted; ConfigError where there are none."""
    d = Path(folder)
    if not d.is_dir():
        raise ConfigError(f"--image-files {d}: no such directory")
    files = sorted(p for p in d.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ConfigError(f"--image-files {d}: no image files in it ({', '.join(IMAGE_SUFFIXES)})")
    return files


def spread(items: list, n: int) -> list:
    """``n`` of ``items`` evenly spaced (all of them where there are no more)."""
    return items if len(items) <= n else [items[i * len(items) // n] for i in range(n)]


def add_image_files(src, folder: str, log=print) -> None:
    """Give a weights export (``src``) the image preprocessing, up to RAW_COUNT of the files as they are (at most
    RAW_BYTES in all), and, where --example-inputs gave no real samples, the tensors of up to SAMPLE_FILES of
    them as its samples."""
    # a detector's pictures are letterboxed, as its served image entry does
    pre = src.task.picture_preprocessing(src.detection) or image_preprocessing(src.signature)
    files = image_files(folder)
    root = Path(folder)

    def decode(data: bytes) -> np.ndarray:
        return decode_picture(data, pre["letterbox"]["size"])[0] if "letterbox" in pre else decode_image(data, pre)

    def tensors(paths: list[Path]) -> np.ndarray:
        try:
            return np.stack([decode(p.read_bytes()) for p in paths])
        except ValueError as e:
            raise DataError(f"--image-files: {e}") from None

    kept, total = [], 0
    for p in spread(files, RAW_COUNT):
        if total + p.stat().st_size <= RAW_BYTES:
            kept.append(p)
            total += p.stat().st_size
    names = ["_".join(p.relative_to(root).parts) for p in kept]
    src.preprocessing = pre
    src.raw = RawSamples(names, [p.read_bytes() for p in kept], tensors(kept), None)
    name = src.signature.inputs[0].name
    if not src.samples:
        src.samples = {name: tensors(spread(files, SAMPLE_FILES))}
    log(
        f"image files: {len(files)} in {folder}; {len(kept)} kept as files ({total / 1024:.0f} KiB), "
        f"{len(src.samples[name])} real samples"
    )
