"""The checkpoint contract: where a checkpoint's files are and how they are read. Training writes them
(train/checkpoint.py); export and the pipeline read them here.

Layout of OUT/checkpoints/step-0000123/:
  model.pt        weights-only state_dict of the plain (unwrapped, uncompiled) model
  meta.json       how to rebuild it: arch, constructor args, classes, preprocessing, metrics, versions
  heldout.npz     a few validation images in the input contract, with labels, for export checks
  train_state.pt  optimizer, scheduler, scaler, position and every rank's RNG state (for --resume)
OUT/checkpoints/index.json names the latest and best directories; it is replaced atomically
after the directory is complete, so a crash mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError, first_line
from .io import read_json, sha256_file

WEIGHTS = "model.pt"
META = "meta.json"
STATE = "train_state.pt"
HELDOUT = "heldout.npz"
INDEX = "index.json"
FORMAT = "torchship.checkpoint/1"


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
    return read_json(
        ckpt_dir / META,
        CheckpointError,
        FORMAT,
        missing=f"checkpoint {ckpt_dir} has no {META}: the model cannot be rebuilt without it",
    )


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
        raise CheckpointError(f"{path} is corrupt or truncated: {first_line(e, 160)}") from None
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
        raise CheckpointError(
            f"{where} does not fit this model (another architecture or class count?): " + "; ".join(parts)
        )
    model.load_state_dict(sd, strict=True)
