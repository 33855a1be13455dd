"""The eager model, rebuilt: from a torchship checkpoint, or from a model factory and a plain weights file,
behind a forward whose inputs carry the signature's names and whose outputs are flat. Export makes its
artifacts from it; the bench rebuilds it from an export's manifest to time eager beside them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from .checkpoint import load_into, load_meta, load_weights
from .errors import CheckpointError, first_line
from .models import WithPreprocessing, make_model, model_from_meta

PREFIXES = ("module.", "_orig_mod.")  # DDP's wrapper and torch.compile's


class Flat(torch.nn.Module):
    """Calls ``inner`` with its positional inputs and returns its outputs as one tensor or a flat tuple:
    dict outputs (and dict subclasses) in the order of ``keys`` (else their own), tuples and lists as they are."""

    def __init__(self, inner: torch.nn.Module, keys: Optional[list] = None):
        super().__init__()
        self.inner = inner
        self.keys = keys

    def flat(self, out):
        if isinstance(out, dict):
            out = tuple(out[k] for k in (self.keys or out))
        if isinstance(out, (list, tuple)):
            return out[0] if len(out) == 1 else tuple(out)
        return out


def named(
    inner: torch.nn.Module, input_names: list[str], keys: Optional[list] = None, by_keyword: bool = False
) -> torch.nn.Module:
    """``inner`` behind a forward whose parameters carry the input names, so that every exporter names
    the graph inputs after them (TorchScript's schema, ExportedProgram's signature, ONNX's inputs).
    ``by_keyword``: pass them on as keyword arguments (a model trained on dict samples), else in order."""
    args = ", ".join(input_names)
    call = ", ".join(f"{n}={n}" for n in input_names) if by_keyword else args
    ns: dict[str, Any] = {}
    exec(f"def forward(self, {args}):\n    return self.flat(self.inner({call}))\n", ns)  # names checked by the parser
    cls = type("Deployable", (Flat,), {"forward": ns["forward"]})
    return cls(inner, keys).eval()


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
    if meta.get("task") == "detection":
        from .detectors import build_detector

        model = build_detector(meta["arch"], meta["num_classes"], meta["input_shape"][-1], meta.get("model_args"))
    else:
        model = model_from_meta(meta)
    load_into(model, load_weights(ckdir), f"checkpoint {ckdir}")
    return model.eval(), meta


def eager_from_manifest(manifest: dict[str, Any]) -> torch.nn.Module:
    """The eager model an export was made from, rebuilt from what its manifest records."""
    src = manifest.get("source") or {}
    names = [t["name"] for t in manifest["inputs"]]
    if src.get("kind") == "checkpoint":
        model, meta = checkpoint_model(Path(src["path"]))
        if meta.get("task") == "detection":
            from .detectors import deployable

            return deployable(model, meta)
        if "signature" in meta:
            return named(model, names, src.get("output_keys"), meta.get("inputs_by") == "keyword")
        return WithPreprocessing(model, meta["preprocessing"]["mean"], meta["preprocessing"]["std"]).eval()
    if src.get("kind") == "weights":
        model = make_model(src["model"], "the manifest's model", src.get("model_args", {}))
        load_into(model, load_weights_file(src["weights"], lambda *a: None), f"weights {src['weights']}")
        if src.get("wrapped") == "TopK":  # a torchvision detector, exported with its postprocessing inside
            from .detectors import TopK

            det = manifest["detection"]
            model = TopK(model.eval(), det["letterbox"]["size"], det["k"], det["candidates"])
        return named(model.eval(), names, src.get("output_keys"))
    raise CheckpointError("the manifest records no model source (export again)")
