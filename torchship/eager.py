"""The eager model, rebuilt: from a torchship checkpoint, or from a model factory and a plain weights file,
behind a forward whose inputs carry the signature's names and whose outputs are flat. Export makes its
artifacts from it; the bench rebuilds it from an export's manifest to time eager beside them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .checkpoint import load_into, load_meta, load_weights
from .errors import CheckpointError, first_line
from .models import make_model, named
from .tasks import task_of

PREFIXES = ("module.", "_orig_mod.")  # DDP's wrapper and torch.compile's


def strip_prefixes(sd: dict[str, torch.Tensor], log=print) -> dict[str, torch.Tensor]:
    """Remove DDP's ``module.`` and torch.compile's ``_orig_mod.`` prefixes, saying so once."""
    stripped = set()
    out = {}
    for k, v in sd.items():
        changed = True
        while changed:
            changed = False
            for p in PREFIXES:
                if k.startswith(p):
                    k, changed = k[len(p) :], True
                    stripped.add(p)
        out[k] = v
    if stripped:
        log(f"weights: stripped the prefix {' and '.join(sorted(stripped))} from the parameter names")
    return out


def load_weights_file(path: str | Path, log=print) -> dict[str, torch.Tensor]:
    """A plain state_dict from a .pt/.pth file (weights_only) or a .safetensors file."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"--weights {p} does not exist")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(p))
        else:
            sd = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"--weights {p} cannot be read as a state_dict: {first_line(e, 200)}") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        log(f"weights: using the 'state_dict' entry of {p.name}")
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(
            f"--weights {p} holds a {type(sd).__name__} that is not a state_dict of tensors "
            "(save it with torch.save(model.state_dict(), PATH))"
        )
    return strip_prefixes(sd, log)


def checkpoint_model(ckdir: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The plain eval-mode model of a checkpoint directory with its weights loaded, and its metadata."""
    meta = load_meta(ckdir)
    model = task_of(meta).build(meta)
    load_into(model, load_weights(ckdir), f"checkpoint {ckdir}")
    return model.eval(), meta


def eager_from_manifest(manifest: dict[str, Any]) -> torch.nn.Module:
    """The eager model an export was made from, rebuilt from what its manifest records."""
    src = manifest.get("source") or {}
    names = [t["name"] for t in manifest["inputs"]]
    if src.get("kind") == "checkpoint":
        model, meta = checkpoint_model(Path(src["path"]))
        return task_of(meta).eager(model, meta, names, src)
    if src.get("kind") == "weights":
        model = make_model(src["model"], "the manifest's model", src.get("model_args", {}))
        load_into(model, load_weights_file(src["weights"], lambda *a: None), f"weights {src['weights']}")
        if src.get("wrapped") == "TopK":  # a torchvision detector, exported with its postprocessing inside
            from .detectors import TopK

            det = manifest["detection"]
            model = TopK(model.eval(), det["letterbox"]["size"], det["k"], det["candidates"])
        return named(model.eval(), names, src.get("output_keys"))
    raise CheckpointError("the manifest records no model source (export again)")


def flops_per_sample(model: torch.nn.Module, inputs: tuple | list) -> float:
    """FLOPs of one forward pass per sample on ``inputs`` (tensors of equal batch), counted by torch's
    FlopCounterMode (2 per multiply-add; operators it does not know, such as torchvision's NMS, count 0)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(*inputs)
    return fc.get_total_flops() / len(inputs[0])
