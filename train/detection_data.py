"""Detection data: a COCO-format folder (images and an instances JSON), or the built-in offline set, scikit-learn's
handwritten digits placed at random positions and scales on crops of its two sample photos, each with its box.

Both give a DetectionSet: 8-bit RGB pictures (uint8 HWC, as a photo is) at their own sizes, and for each its
boxes (xyxy, in the picture's pixels, torchship.boxes) and labels (1 to the number of classes; torchvision's
detectors keep 0 for the background)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torchship.errors import DataError
from torchship.images import IMAGE_SUFFIXES

DIGIT_CLASSES = [str(d) for d in range(10)]
INK = 0.25  # a digit pixel at or above this share of the darkest stroke is ink: its box is the ink's bounds


@dataclass
class DetectionSet:
    images: list[np.ndarray]  # uint8 HWC RGB, each at its own size
    boxes: list[np.ndarray]  # float32 [n, 4] xyxy in the picture's pixels
    labels: list[np.ndarray]  # int64 [n], 1 .. len(classes)
    classes: list[str]
    source: str
    names: list[str] | None = None  # the files the pictures came from (a folder's), in order

    def __len__(self) -> int:
        return len(self.images)


def compose(
    background: np.ndarray, digits: list[tuple[np.ndarray, int]], rng: np.random.Generator, sizes=(20, 48)
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``digits`` (each an 8 x 8 image in [0, 16] and its digit) drawn onto ``background`` (float32 HWC in [0, 1])
    at random places and side lengths within ``sizes``, none overlapping another, in a colour that stands out from
    what lies under it. Returns (the picture, 8-bit RGB HWC; boxes xyxy tight around each digit's ink; labels
    digit + 1); a digit that finds no free place is left out."""
    img = background.copy()
    h, w = img.shape[:2]
    taken: list[list[int]] = []
    boxes, labels = [], []
    for glyph, digit in digits:
        side = int(rng.integers(sizes[0], min(sizes[1], h, w) + 1))
        for _ in range(20):
            x, y = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
            if all(x >= t[2] or t[0] >= x + side or y >= t[3] or t[1] >= y + side for t in taken):
                break
        else:
            continue
        taken.append([x, y, x + side, y + side])
        rows = np.arange(side) * glyph.shape[0] // side
        cols = np.arange(side) * glyph.shape[1] // side
        alpha = (glyph[rows][:, cols] / 16.0).astype(np.float32)
        under = img[y : y + side, x : x + side]
        colour = (rng.random(3) * 0.25 + (0.75 if under.mean() < 0.5 else 0.0)).astype(np.float32)
        img[y : y + side, x : x + side] = under * (1 - alpha[..., None]) + colour * alpha[..., None]
        ys, xs = np.nonzero(alpha >= INK * alpha.max())
        boxes.append([x + xs.min(), y + ys.min(), x + xs.max() + 1, y + ys.max() + 1])
        labels.append(digit + 1)
    return (
        (img * 255).round().clip(0, 255).astype(np.uint8),
        np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
        np.asarray(labels, dtype=np.int64),
    )


def builtin_detection(n: int, size: int = 128, seed: int = 0, per_image: int = 3) -> DetectionSet:
    """``n`` pictures, each a random crop of one of scikit-learn's two sample photos, of a width and a height
    each from 3/4 to 3/2 of ``size`` (so that the letterbox scales most of them, as it does a user's photos), with
    1 to ``per_image`` of its handwritten digits drawn on (compose), their sides from 20 to 48 pixels once
    letterboxed into ``size``. The same ``seed`` gives the same set."""
    from .bundled import digits, sample_photos

    rng = np.random.default_rng(seed)
    images, target = digits()
    photos = [im.astype(np.float32) / 255 for im in sample_photos()]
    out = DetectionSet([], [], [], DIGIT_CLASSES, f"built-in: scikit-learn's digits on its sample photos ({n})")
    for _ in range(n):
        photo = photos[rng.integers(len(photos))]
        h, w = (int(v) for v in rng.integers(3 * size // 4, 3 * size // 2 + 1, size=2))
        y, x = int(rng.integers(photo.shape[0] - h + 1)), int(rng.integers(photo.shape[1] - w + 1))
        picks = rng.integers(len(images), size=int(rng.integers(1, per_image + 1)))
        f = max(w, h) / size  # the picture's pixels per letterboxed pixel
        img, boxes, labels = compose(
            photo[y : y + h, x : x + w],
            [(images[k], int(target[k])) for k in picks],
            rng,
            (round(20 * f), round(48 * f)),
        )
        out.images.append(img)
        out.boxes.append(boxes)
        out.labels.append(labels)
    return out


def read_coco(path: str | Path) -> DetectionSet:
    """A COCO-format detection set: ``path`` is the instances JSON, or a folder holding exactly one JSON file; its
    images' ``file_name`` are read beside it or under its ``images/`` folder. Category ids become labels 1..K in
    the order of their ids; crowd annotations are left out. DataError naming the file and the problem otherwise."""
    from PIL import Image

    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("*.json")) or sorted(path.glob("annotations/*.json"))
        if len(found) != 1:
            raise DataError(
                f"{path}: {'no' if not found else len(found)} COCO instances JSON file(s) found; "
                "give the one to read as --data PATH/instances.json"
            )
        path = found[0]
    if not path.is_file():
        raise DataError(f"{path}: no such COCO instances file; give a folder holding one, or its path")
    try:
        doc = json.loads(path.read_text())
        images, anns, cats = doc["images"], doc["annotations"], doc["categories"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"{path}: not a COCO instances file ({e}); it needs images, annotations and categories"
        ) from None
    if not images or not cats:
        raise DataError(f"{path}: {'no images' if not images else 'no categories'}; a detection set needs both")
    cat_ids = sorted(c["id"] for c in cats)
    label_of = {cid: i + 1 for i, cid in enumerate(cat_ids)}
    names = {c["id"]: str(c.get("name", c["id"])) for c in cats}
    by_image: dict = {im["id"]: [] for im in images}
    for a in anns:
        if a.get("iscrowd"):
            continue
        if a.get("image_id") not in by_image:
            raise DataError(
                f"{path}: annotation {a.get('id')} refers to image {a.get('image_id')}, which is not listed"
            )
        if a.get("category_id") not in label_of:
            raise DataError(
                f"{path}: annotation {a.get('id')} has category {a.get('category_id')}, which is not listed"
            )
        by_image[a["image_id"]].append(a)
    root = path.parent
    out = DetectionSet([], [], [], [names[c] for c in cat_ids], f"COCO: {path}", [])
    for im in images:
        name = im["file_name"]
        file = next((p for p in (root / name, root / "images" / name) if p.is_file()), None)
        if file is None or file.suffix.lower() not in IMAGE_SUFFIXES:
            raise DataError(f"{path}: image {im['id']}'s file {name!r} is not an image file beside it or under images/")
        with Image.open(file) as pic:
            pixels = np.asarray(pic.convert("RGB"))
        h, w = pixels.shape[:2]
        if (im.get("width", w), im.get("height", h)) != (w, h):
            raise DataError(f"{path}: {name} is {w} x {h} pixels, the JSON says {im.get('width')} x {im.get('height')}")
        boxes = np.asarray([a["bbox"] for a in by_image[im["id"]]], dtype=np.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]  # COCO's x, y, width, height -> xyxy
        bad = (boxes[:, 2] <= boxes[:, 0]) | (boxes[:, 3] <= boxes[:, 1]) | (boxes[:, :2] < 0).any(1)
        bad |= (boxes[:, 2] > w + 0.5) | (boxes[:, 3] > h + 0.5)
        if bad.any():
            a = by_image[im["id"]][int(np.flatnonzero(bad)[0])]
            raise DataError(
                f"{path}: annotation {a.get('id')}'s bbox {a['bbox']} (x, y, width, height) is empty or leaves "
                f"{name} ({w} x {h})"
            )
        out.images.append(pixels)
        out.boxes.append(boxes)
        out.labels.append(np.asarray([label_of[a["category_id"]] for a in by_image[im["id"]]], dtype=np.int64))
        out.names.append(name)
    return out
