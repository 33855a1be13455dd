"""run_export: rebuild the model from a checkpoint alone, write every artifact, manifest and reference."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import torchship
from torchship.device import resolve_device
from torchship.errors import ArtifactError, CheckpointError, ConfigError
from torchship.io import check_out_dir, sha256_file, staging_dir
from torchship.manifest import FORMAT, MANIFEST, REFERENCE, read_manifest, write_manifest
from torchship.runtime import in_chunks
from train import checkpoint as ck
from torchship.models import WithPreprocessing, model_from_meta

from . import exporters
from .config import ExportConfig
from .verify import verify_export

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CastWrapper(torch.nn.Module):
    """float32 in and out, ``dtype`` inside: the tensor contract stays the same for every variant."""

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner = inner.to(dtype)
        self.dtype = dtype

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.inner(images.to(self.dtype)).float()


def load_deployable(checkpoint: str | Path) -> tuple[torch.nn.Module, dict[str, Any], Path]:
    """The eval-mode model with preprocessing baked in, rebuilt from the checkpoint's files alone."""
    ckdir = ck.resolve_checkpoint(checkpoint, which="best")
    meta = ck.load_meta(ckdir)
    model = model_from_meta(meta)
    ck.load_into(model, ck.load_weights(ckdir), f"checkpoint {ckdir}")
    pre = meta.get("preprocessing")
    if not pre or "mean" not in pre:
        raise CheckpointError(f"{ckdir / ck.META} records no preprocessing (mean/std); cannot build the input contract")
    return WithPreprocessing(model, pre["mean"], pre["std"]).eval(), meta, ckdir


def _reference(model: torch.nn.Module, ckdir: Path, shape: list[int], cfg: ExportConfig, device: str) -> dict[str, np.ndarray]:
    """Reference inputs (held-out real images + random batches 1, odd, max) and eager fp32 outputs."""
    sets: dict[str, np.ndarray] = {}
    labels = None
    if (ckdir / ck.HELDOUT).exists():
        held = np.load(ckdir / ck.HELDOUT)
        sets["heldout"], labels = held["images"].astype(np.float32), held["labels"]
    g = np.random.default_rng(cfg.seed)
    for b in sorted({1, cfg.odd_batch, cfg.max_batch}):
        sets[f"random_b{b}"] = g.random((b, *shape), dtype=np.float32)
    ref: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for key, x in sets.items():
            ref[f"input/{key}"] = x
            (out,) = in_chunks(lambda b: [model(torch.from_numpy(b).to(device)).float().cpu().numpy()], x, cfg.max_batch)
            ref[f"expected/{key}/{exporters.OUTPUT}"] = out
    if labels is not None:
        ref["labels/heldout"] = labels
    return ref


def run_export(cfg: ExportConfig, log=print) -> dict[str, Any]:
    """Export ``cfg.checkpoint`` to every format in ``cfg.formats`` under ``cfg.out``; verify unless told not to.

    Returns the manifest. Raises CheckpointError (bad checkpoint), ArtifactError (existing
    output without --overwrite, or a format failing under --strict) and ParityError (verification).
    Artifacts are written into a staging directory that is renamed into place when complete.
    """
    out = check_out_dir(cfg.out, cfg.overwrite, ArtifactError)
    deploy, meta, ckdir = load_deployable(cfg.checkpoint)
    device = resolve_device(cfg.device)
    shape = list(meta["input_shape"])
    eager = deploy.to(device)
    model = eager if cfg.dtype == "float32" else CastWrapper(_clone(deploy), DTYPES[cfg.dtype]).to(device).eval()
    name = cfg.name or meta["arch"].replace(":", "_").replace(".", "_")
    ex = exporters.example(shape, 2, device)
    n_classes = meta["num_classes"]
    io_spec = {
        "inputs": [{"name": exporters.INPUT, "dtype": "float32", "shape": ["batch", *shape]}],
        "outputs": [{"name": exporters.OUTPUT, "dtype": "float32", "shape": ["batch", n_classes]}],
    }
    artifacts: list[dict[str, Any]] = []
    failures: list[dict[str, str]] = []
    with staging_dir(out, overwrite=cfg.overwrite) as tmp:
        ref = _reference(eager, ckdir, shape, cfg, device)
        with open(tmp / REFERENCE, "wb") as f:
            np.savez(f, **ref)
        for fmt in cfg.formats:
            t0 = time.perf_counter()
            (tmp / fmt).mkdir()
            log(f"export {fmt} ...")
            try:
                files, extra = _export_one(fmt, model, ex, tmp, cfg, shape, device)
            except Exception as e:  # one format failing must not lose the others
                reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                if cfg.strict:
                    raise ArtifactError(f"format {fmt} cannot be exported ({reason}); nothing was written (--strict)") from None
                shutil.rmtree(tmp / fmt, ignore_errors=True)
                failures.append({"format": fmt, "error": reason})
                log(f"  {fmt} FAILED: {reason} (other formats continue)")
                continue
            secs = time.perf_counter() - t0
            entry = {"name": fmt, "format": fmt, "file": files[0], "files": {f: sha256_file(tmp / f) for f in files},
                     "bytes": sum((tmp / f).stat().st_size for f in files), **io_spec, "dtype": cfg.dtype,
                     "device": device, "torch_version": torch.__version__, "export_seconds": round(secs, 2),
                     "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra}
            artifacts.append(entry)
            log(f"  {fmt}: {', '.join(files)} ({entry['bytes'] / 1e6:.1f} MB, {secs:.1f}s)")
        if not artifacts:
            raise ArtifactError("no format could be exported: " + "; ".join(f"{f['format']}: {f['error']}" for f in failures))
        pre = meta["preprocessing"]
        manifest = {
            "format": FORMAT, "name": name, "torchship_version": torchship.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": device, "dtype": cfg.dtype,
            "python": sys.version.split()[0], "torch_version": torch.__version__,
            "source_checkpoint": {"path": str(ckdir.resolve()), "weights_sha256": meta.get("weights_sha256"),
                                  "arch": meta["arch"], "model_args": meta.get("model_args", {}),
                                  "metrics": meta.get("metrics", {}), "git_revision": meta.get("git_revision")},
            **io_spec,
            "preprocessing": {**pre, "normalization": "in_graph",
                              "contract": f"float32 NCHW images in [0, 1] at {shape[1]}x{shape[2]}, {shape[0]} channels; "
                                          "the graph subtracts mean and divides by std itself"},
            "classes": meta["classes"], "max_batch": cfg.max_batch, "tolerances": cfg.tolerances(),
            "reference": {"file": REFERENCE, "sha256": sha256_file(tmp / REFERENCE),
                          "sets": {k.split("/")[1]: int(v.shape[0]) for k, v in ref.items() if k.startswith("input/")}},
            "artifacts": artifacts, "export_failures": failures,
        }
        write_manifest(tmp, manifest)
    log(f"manifest: {out / MANIFEST}")
    if cfg.verify:
        log("verify: each artifact in a fresh process against eager ...")
        verify_export(out, device=device, threads=cfg.threads)  # writes its results into manifest.json
        manifest = read_manifest(out)
    return manifest


def _clone(m: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(m)


def _export_one(fmt: str, model, ex, tmp: Path, cfg: ExportConfig, shape, device) -> tuple[list[str], dict[str, Any]]:
    if fmt == "torchscript":
        return [f"{fmt}/model.pt"], exporters.torchscript(model, ex, tmp / fmt / "model.pt")
    if fmt == "exported_program":
        return [f"{fmt}/model.pt2"], exporters.exported_program(model, ex, tmp / fmt / "model.pt2", cfg.max_batch)
    if fmt == "aoti":
        extra = exporters.aoti(model, ex, tmp / fmt / "model.pt2", cfg.max_batch, cfg.threads)
        return [f"{fmt}/model.pt2"], {**extra, "batch": {"min": 1, "max": cfg.max_batch}}
    if fmt == "aoti_buckets":
        files = {}
        for b in cfg.buckets:
            rel = f"{fmt}/bs{b}.pt2"
            extra = exporters.aoti(model, exporters.example(shape, b, device), tmp / rel, None, cfg.threads)
            files[str(b)] = rel
        return list(files.values()), {**extra, "buckets": files, "batch": {"buckets": list(cfg.buckets)}}
    if fmt == "onnx":
        extra = exporters.onnx(model, ex, tmp / fmt / "model.onnx", cfg.max_batch, cfg.opset)
        return [f"{fmt}/model.onnx"], {**extra, "batch": {"min": 1, "max": cfg.max_batch}}
    raise ConfigError(f"unknown format {fmt}")
