"""The image input contract shared by training, export and serving: how a picture becomes the float32 NCHW
tensor in [0, 1] a model sees (normalization is inside the model, see torchship.models.WithPreprocessing)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from .errors import DataError
from .imageio import decode_image

RAW_COUNT = 16  # held-out files kept as they are, for checks that start from the file a user sends
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


@dataclass
class Preprocessing:
    """How images were prepared for the model, recorded in its checkpoint and export manifest."""

    image_size: list[int]  # [height, width] after resizing, pixels
    channels: int  # channels fed to the model (grayscale is replicated to 3)
    mean: list[float]  # per-channel mean subtracted from [0, 1] pixels
    std: list[float]  # per-channel std the result is divided by
    layout: str = "NCHW"
    dtype: str = "float32"
    value_range: list[float] = field(default_factory=lambda: [0.0, 1.0])
    resize: str = "bilinear"  # interpolation used to reach image_size
    source_scale: str = "pixel / 255"  # how raw pixels become [0, 1]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RawSamples:
    """Held-out samples as files (the bytes a client sends), beside the tensors the training pipeline made
    of those same files: serving is checked from the file to the answer against them."""

    names: list[str]
    files: list[bytes]
    inputs: np.ndarray  # float32 NCHW: each file through training's own preprocessing
    labels: Optional[np.ndarray]  # a classifier's; None for a detector's pictures

    def arrays(self) -> dict[str, np.ndarray]:
        """The samples as heldout.npz keeps them."""
        return {
            "raw/names": np.array(self.names),
            "raw/images": self.inputs,
            **({"raw/labels": self.labels} if self.labels is not None else {}),
            **{f"raw/file/{i}": np.frombuffer(f, np.uint8) for i, f in enumerate(self.files)},
        }

    @classmethod
    def from_arrays(cls, z) -> Optional["RawSamples"]:
        if "raw/names" not in z:
            return None
        names = [str(n) for n in z["raw/names"]]
        return cls(
            names,
            [z[f"raw/file/{i}"].tobytes() for i in range(len(names))],
            z["raw/images"].astype(np.float32),
            z["raw/labels"] if "raw/labels" in z else None,
        )


class ImageFolderDataset(Dataset):
    """Images from an ImageFolder tree, resized to a square and scaled to [0, 1] RGB."""

    def __init__(self, files: list[tuple[str, int]], image_size: int):
        self.files = files
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.files[i]
        pre = {"image_size": [self.image_size, self.image_size], "source_scale": "pixel / 255"}
        try:  # the decoder the served image entry runs, limits included
            chw = decode_image(Path(path).read_bytes(), pre)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read image {path}: {getattr(e, 'strerror', None) or e}") from None
        return torch.from_numpy(chw), label
