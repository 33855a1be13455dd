"""The data scikit-learn ships, read from its own files: its 1,797 handwritten digits and its two sample photos,
exactly as its loaders return them, without importing scikit-learn (about a second of CPU, which every training
process on the built-in data would pay). Where a scikit-learn release keeps them elsewhere, its loaders are used."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np


def _sklearn_file(*parts: str) -> Path | None:
    """A file inside the installed scikit-learn package, found without importing it; None where it is not there."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root, *parts)
        if path.is_file():
            return path
    return None


def digits() -> tuple[np.ndarray, np.ndarray]:
    """(images [1797, 8, 8] float64 grey levels 0..16, targets [1797] int64): sklearn.datasets.load_digits()'s
    images and target."""
    path = _sklearn_file("datasets", "data", "digits.csv.gz")
    if path is None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target.astype(np.int64)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


def sample_photos() -> list[np.ndarray]:
    """sklearn.datasets.load_sample_images()'s two photos (a temple in China, a flower), [H, W, 3] uint8, in its
    order (by file name)."""
    from PIL import Image

    first = _sklearn_file("datasets", "images", "china.jpg")
    if first is None:
        from sklearn.datasets import load_sample_images

        return list(load_sample_images().images)
    photos = []
    for path in sorted(first.parent.glob("*.jpg")):
        with Image.open(path) as im:
            photos.append(np.asarray(im))
    return photos
