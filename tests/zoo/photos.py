"""Real photographs for the zoo's image models where no data set can be downloaded: crops of the two photos
scikit-learn ships (a temple and a flower, 640x427), at random positions and scales, resized to the model's
size, as float32 NCHW in [0, 1], saved as an npz keyed by input name (``--example-inputs`` and
``--calibration`` take it).

    python -m tests.zoo.photos --out runs/zoo/photos.npz [--count 64] [--size 224]
    python -m tests.zoo.photos --files runs/zoo/photos [--count 64]   # the crops as JPEG/PNG/WebP files
"""

from __future__ import annotations

import argparse

import numpy as np


def crops(count: int = 64, size: int = 224, seed: int = 0) -> np.ndarray:
    import torch
    import torch.nn.functional as F

    from torchship.train.bundled import sample_photos

    photos = [torch.from_numpy(i).permute(2, 0, 1).float() / 255 for i in sample_photos()]
    g = np.random.default_rng(seed)
    out = np.empty((count, 3, size, size), np.float32)
    for k in range(count):
        p = photos[k % len(photos)]
        h, w = p.shape[1:]
        side = int(g.integers(min(h, w) // 3, min(h, w) + 1))
        y, x = int(g.integers(0, h - side + 1)), int(g.integers(0, w - side + 1))
        crop = p[:, y : y + side, x : x + side][None]
        out[k] = (
            F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
            .clamp(0, 1)
            .numpy()
        )
    return out


FILE_KINDS = (
    ("jpg", "RGB", "JPEG"),
    ("png", "RGB", "PNG"),
    ("webp", "RGB", "WEBP"),
    ("gray.jpg", "L", "JPEG"),
    ("rgba.png", "RGBA", "PNG"),
)


def crop_files(out, count: int = 64, seed: int = 0) -> list:
    """``count`` crops of the same photos as image files at their own sizes (sides of 142 to 427 pixels), as a
    client sends them for the server to resize: JPEG (quality 90), PNG, WebP, grayscale and RGBA in turn."""
    from pathlib import Path

    from PIL import Image

    from torchship.train.bundled import sample_photos

    photos = sample_photos()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(seed)
    paths = []
    for k in range(count):
        photo = photos[k % len(photos)]
        h, w = photo.shape[:2]
        side = int(g.integers(min(h, w) // 3, min(h, w) + 1))
        y, x = int(g.integers(0, h - side + 1)), int(g.integers(0, w - side + 1))
        suffix, mode, fmt = FILE_KINDS[k % len(FILE_KINDS)]
        path = out / f"{k:03d}.{suffix}"
        Image.fromarray(photo[y : y + side, x : x + side]).convert(mode).save(path, format=fmt, quality=90)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.zoo.photos", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="npz file to write")
    p.add_argument("--count", type=int, default=64, help="how many crops (default: 64)")
    p.add_argument("--size", type=int, default=224, help="their height and width (default: 224)")
    p.add_argument("--name", default="images", help="the input name to key them by (default: images)")
    p.add_argument(
        "--files",
        metavar="DIR",
        help="instead: write the crops as image files at their own sizes into DIR (export --image-files takes it)",
    )
    a = p.parse_args(argv)
    if a.files:
        crop_files(a.files, a.count)
        print(f"{a.files}: {a.count} image files")
        return 0
    if not a.out:
        p.error("give --out FILE.npz or --files DIR")
    np.savez(a.out, **{a.name: crops(a.count, a.size)})
    print(f"{a.out}: {a.count} crops of {a.size}x{a.size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
