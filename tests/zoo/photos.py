"""Real photographs for the zoo's image models where no data set can be downloaded: crops of the two photos
scikit-learn ships (a temple and a flower, 640x427), at random positions and scales, resized to the model's
size, as float32 NCHW in [0, 1], saved as an npz keyed by input name (``--example-inputs`` and
``--calibration`` take it).

    python -m tests.zoo.photos --out runs/zoo/photos.npz [--count 64] [--size 224]
"""

from __future__ import annotations

import argparse

import numpy as np


def crops(count: int = 64, size: int = 224, seed: int = 0) -> np.ndarray:
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_sample_images

    photos = [torch.from_numpy(i).permute(2, 0, 1).float() / 255 for i in load_sample_images().images]
    g = np.random.default_rng(seed)
    out = np.empty((count, 3, size, size), np.float32)
    for k in range(count):
        p = photos[k % len(photos)]
        h, w = p.shape[1:]
        side = int(g.integers(min(h, w) // 3, min(h, w) + 1))
        y, x = int(g.integers(0, h - side + 1)), int(g.integers(0, w - side + 1))
        crop = p[:, y:y + side, x:x + side][None]
        out[k] = (
            F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
            .clamp(0, 1)
            .numpy()
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.zoo.photos", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="npz file to write")
    p.add_argument("--count", type=int, default=64, help="how many crops (default: 64)")
    p.add_argument("--size", type=int, default=224, help="their height and width (default: 224)")
    p.add_argument("--name", default="images", help="the input name to key them by (default: images)")
    a = p.parse_args(argv)
    np.savez(a.out, **{a.name: crops(a.count, a.size)})
    print(f"{a.out}: {a.count} crops of {a.size}x{a.size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
