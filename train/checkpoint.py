"""Writing checkpoints: a directory per save, committed atomically, with an index naming latest and best
(the layout and the read side: torchship/checkpoint.py). Also the training state --resume restores.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from torchship.checkpoint import FORMAT, HELDOUT, INDEX, META, STATE, WEIGHTS, read_index
from torchship.errors import CheckpointError
from torchship.io import atomic_write_json, sha256_file, staging_dir


def clean_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict of the plain module: no DDP ``module.`` nor torch.compile ``_orig_mod.`` prefix."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod  # torch.compile wrapper
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            break
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def save_checkpoint(
    ckpt_root: Path,
    name: str,
    weights: dict[str, torch.Tensor],
    meta: dict[str, Any],
    state: dict[str, Any] | None,
    heldout: Callable[[Path], None] | None,
    best_metric: float | None,
    keep_last: int,
) -> Path:
    """Write one checkpoint directory atomically, then update the index and prune old ones.

    ``best_metric`` (higher is better) decides whether this becomes the best checkpoint.
    Returns the final directory.
    """
    final = ckpt_root / name
    with staging_dir(final, overwrite=True) as tmp:
        torch.save(weights, tmp / WEIGHTS)
        meta = dict(meta, format=FORMAT, weights_sha256=sha256_file(tmp / WEIGHTS))
        (tmp / META).write_text(json.dumps(meta, indent=2, default=str) + "\n")
        if heldout is not None:
            heldout(tmp / HELDOUT)
        if state is not None:
            torch.save(state, tmp / STATE)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    index = read_index(ckpt_root)
    history = [h for h in index.get("history", []) if h != name] + [name]
    index["latest"] = name
    if best_metric is not None and (index.get("best_metric") is None or best_metric > index["best_metric"]):
        index["best"], index["best_metric"] = name, best_metric
    index.setdefault("best", name)
    keep = set(history[-keep_last:]) | {index["best"]}
    for old in history:
        if old not in keep:
            shutil.rmtree(ckpt_root / old, ignore_errors=True)
    index["history"] = [h for h in history if h in keep]
    atomic_write_json(ckpt_root / INDEX, index)
    return final


def load_train_state(ckpt_dir: Path) -> dict[str, Any]:
    path = ckpt_dir / STATE
    if not path.exists():
        raise CheckpointError(f"--resume {ckpt_dir}: no {STATE} (a weights-only checkpoint cannot resume training)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"--resume {path} is corrupt or truncated: {type(e).__name__}") from None


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "python": random.getstate(),
    }


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    if s.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    n = s["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    py = s["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
