"""Checkpoints: a directory per save, committed atomically, with an index naming latest and best.

Layout of OUT/checkpoints/step-0000123/:
  model.pt        weights-only state_dict of the plain (unwrapped, uncompiled) model
  meta.json       how to rebuild it: arch, constructor args, classes, preprocessing, metrics, versions
  heldout.npz     a few validation images in the input contract, with labels, for export checks
  train_state.pt  optimizer, scheduler, scaler, position and every rank's RNG state (for --resume)
OUT/checkpoints/index.json names the latest and best directories; it is replaced atomically
after the directory is complete, so a crash mid-save leaves the previous checkpoint intact.
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

from torchship.errors import CheckpointError
from torchship.io import atomic_write_json, read_json, sha256_file, staging_dir

WEIGHTS = "model.pt"
META = "meta.json"
STATE = "train_state.pt"
HELDOUT = "heldout.npz"
INDEX = "index.json"
FORMAT = "torchship.checkpoint/1"


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


def save_checkpoint(ckpt_root: Path, name: str, weights: dict[str, torch.Tensor], meta: dict[str, Any],
                    state: dict[str, Any] | None, heldout: Callable[[Path], None] | None,
                    best_metric: float | None, keep_last: int) -> Path:
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


def read_index(ckpt_root: Path) -> dict[str, Any]:
    path = ckpt_root / INDEX
    if not path.exists():
        return {}
    return read_json(path, CheckpointError, fix="; remove it or point at a checkpoint directory")


def resolve_checkpoint(path: str | os.PathLike, which: str = "best") -> Path:
    """Accept a checkpoint dir, its model.pt, a checkpoints/ dir or a training output dir.

    For the last two, ``which`` ('best' or 'latest') picks through index.json.
    Raises CheckpointError when nothing usable is there.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    if p.is_file():
        if p.name != WEIGHTS:
            raise CheckpointError(f"checkpoint {p}: expected a checkpoint directory or its {WEIGHTS}")
        p = p.parent
    if (p / WEIGHTS).exists():
        return p
    for root in (p, p / "checkpoints", p / "train" / "checkpoints"):
        index = read_index(root)
        if index.get(which):
            target = root / index[which]
            if (target / WEIGHTS).exists():
                return target
            raise CheckpointError(f"{root / INDEX} names {index[which]}, which is missing")
    raise CheckpointError(f"no checkpoint found in {p} (expected {WEIGHTS} + {META}, or checkpoints/{INDEX})")


def load_meta(ckpt_dir: Path) -> dict[str, Any]:
    return read_json(ckpt_dir / META, CheckpointError, FORMAT,
                     missing=f"checkpoint {ckpt_dir} has no {META}: the model cannot be rebuilt without it")


def load_weights(ckpt_dir: Path, check_hash: bool = True) -> dict[str, torch.Tensor]:
    """Load model.pt with weights_only=True; CheckpointError if truncated or corrupt."""
    path = ckpt_dir / WEIGHTS
    if not path.exists():
        raise CheckpointError(f"checkpoint {ckpt_dir} has no {WEIGHTS}")
    if check_hash:
        meta = load_meta(ckpt_dir)
        if meta.get("weights_sha256") and sha256_file(path) != meta["weights_sha256"]:
            raise CheckpointError(f"{path} does not match the sha256 recorded in {META}: truncated or altered")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged zip/pickle
        raise CheckpointError(f"{path} is corrupt or truncated: {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
    if not isinstance(sd, dict):
        raise CheckpointError(f"{path} holds a {type(sd).__name__}, not a state_dict")
    return sd


def load_into(model: torch.nn.Module, sd: dict[str, torch.Tensor], where: str) -> None:
    """load_state_dict(strict=True) with a one-line explanation on mismatch."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [k for k in own if k in sd and tuple(own[k].shape) != tuple(sd[k].shape)]
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            k = shapes[0]
            parts.append(f"shape of {k} is {tuple(sd[k].shape)} in the checkpoint, {tuple(own[k].shape)} in the model")
        if missing:
            parts.append(f"{len(missing)} missing keys (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[0]})")
        raise CheckpointError(f"{where} does not fit this model (another architecture or class count?): " + "; ".join(parts))
    model.load_state_dict(sd, strict=True)


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
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]), float(np_state[4])],
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
