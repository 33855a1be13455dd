"""The box contract shared by detection training, export and serving: boxes are xyxy in pixels of the image they
belong to, and a picture reaches a detector letterboxed (scaled to fit a square, its aspect kept, padded at the
right and bottom), so that a box the model returns maps back to the original picture by one scale."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAD_VALUE = 0.5  # the letterbox's padding, mid-gray in [0, 1]


@dataclass(frozen=True)
class Letterbox:
    """How a picture of ``width`` x ``height`` was fitted into a ``size`` x ``size`` square: scaled by ``scale``,
    placed at the top left, the rest padded."""

    width: int
    height: int
    size: int

    @property
    def scale(self) -> float:
        return self.size / max(self.width, self.height)

    def to_model(self, boxes: np.ndarray) -> np.ndarray:
        """Boxes in the picture's pixels -> boxes in the square's pixels."""
        return np.asarray(boxes, dtype=np.float32).reshape(-1, 4) * np.float32(self.scale)

    def to_picture(self, boxes: np.ndarray) -> np.ndarray:
        """Boxes in the square's pixels (a model's output) -> the picture's pixels, clipped to the picture."""
        out = np.asarray(boxes, dtype=np.float32).reshape(-1, 4) / np.float32(self.scale)
        out[:, 0::2] = out[:, 0::2].clip(0, self.width)
        out[:, 1::2] = out[:, 1::2].clip(0, self.height)
        return out


def letterbox_meta(size: int) -> dict:
    """How a checkpoint and an export record the letterbox: the square's side, the picture at its top left."""
    return {"size": int(size), "pad": "bottom-right"}


def letterbox(pixels: np.ndarray, size: int) -> tuple[np.ndarray, Letterbox]:
    """``pixels`` (8-bit RGB, uint8 HWC) fitted into a ``size`` x ``size`` square by the letterbox the served image
    entry runs too (torchship.imageio.letterbox_pixels), the rest PAD_VALUE; float32 CHW in [0, 1], with the
    Letterbox that maps boxes between the two."""
    from .imageio import letterbox_pixels  # here, so that the server can carry this file alone for Letterbox

    out, (w, h) = letterbox_pixels(pixels, size, PAD_VALUE)
    return out, Letterbox(w, h, size)


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The intersection over union of every box of ``a`` [n, 4] with every box of ``b`` [m, 4], xyxy: [n, m]."""
    a = np.asarray(a, dtype=np.float64).reshape(-1, 4)
    b = np.asarray(b, dtype=np.float64).reshape(-1, 4)
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod((rb - lt).clip(0), axis=2)
    area_a = np.prod((a[:, 2:] - a[:, :2]).clip(0), axis=1)
    area_b = np.prod((b[:, 2:] - b[:, :2]).clip(0), axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)
