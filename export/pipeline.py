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
from torchship import runtime
from torchship.errors import ArtifactError, ConfigError
from torchship.io import check_out_dir, sha256_file, staging_dir
from torchship.manifest import FORMAT, MANIFEST, REFERENCE, read_manifest, write_manifest
from torchship.signature import Signature

from . import exporters
from .config import ExportConfig
from .source import Source, from_checkpoint, from_weights, named
from .verify import verify_export

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CastWrapper(torch.nn.Module):
    """Floating inputs and outputs stay float32, ``dtype`` inside: the tensor contract is the same for every
    variant. Integer and bool inputs pass as they are."""

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner = inner.to(dtype)
        self.dtype = dtype

    def forward(self, *args: torch.Tensor):
        out = self.inner(*[a.to(self.dtype) if a.is_floating_point() else a for a in args])
        if isinstance(out, tuple):
            return tuple(o.float() if o.is_floating_point() else o for o in out)
        return out.float() if out.is_floating_point() else out


def load_source(cfg: ExportConfig, log=print) -> Source:
    """The model to export and its signature: from a torchship checkpoint, or from --model and --weights."""
    if cfg.model:
        return from_weights(cfg.model, cfg.model_args, cfg.weights, cfg.inputs, cfg.dims, cfg.input_ranges,
                            cfg.outputs, cfg.example_inputs, log)
    return from_checkpoint(cfg.checkpoint, cfg.dims)


def _reference(model: torch.nn.Module, src: Source, cfg: ExportConfig, device: str) -> tuple[dict[str, np.ndarray], dict]:
    """Reference inputs (the real samples, then random batches of 1, odd and max at each dynamic-dim case)
    and eager's outputs on them; returns (arrays, {set: {"batch": n, "dims": {...}}})."""
    sig = src.signature
    sets: dict[str, dict[str, np.ndarray]] = {}
    info: dict[str, dict[str, Any]] = {}
    if src.samples:
        sets[src.sample_set] = src.samples
        info[src.sample_set] = {"batch": len(next(iter(src.samples.values()))), "dims": sig.dims_of(src.samples)}
    g = np.random.default_rng(cfg.seed)
    for values in sig.dim_cases():
        for b in sorted({1, cfg.odd_batch, cfg.max_batch}):
            key = f"random_b{b}" + "".join(f"_{k}={v}" for k, v in values.items())
            sets[key] = sig.random_inputs(g, b, values)
            info[key] = {"batch": b, "dims": values}
    ref: dict[str, np.ndarray] = {}
    names = [t.name for t in sig.inputs]
    fn = runtime.torch_fn(model, device)
    for key, feeds in sets.items():
        xs = [feeds[n] for n in names]
        for n, x in zip(names, xs):
            ref[f"input/{key}/{n}"] = x
        outs = runtime.in_chunks(fn, xs, cfg.max_batch)
        for t, out in zip(sig.outputs, outs):
            ref[f"expected/{key}/{t.name}"] = out
    if src.labels is not None:
        ref[f"labels/{src.sample_set}"] = src.labels
    return ref, info


def run_export(cfg: ExportConfig, log=print) -> dict[str, Any]:
    """Export the model (``cfg.checkpoint``, or ``cfg.model`` with ``cfg.weights``) to every format in
    ``cfg.formats`` under ``cfg.out``; verify unless told not to.

    Returns the manifest. Raises CheckpointError (bad checkpoint or weights), ConfigError (a bad
    signature), ArtifactError (existing output without --overwrite, or a format failing under --strict)
    and ParityError (verification). Artifacts are written into a staging directory that is renamed into
    place when complete.
    """
    out = check_out_dir(cfg.out, cfg.overwrite, ArtifactError)
    src = load_source(cfg, log)
    sig = src.signature
    device = resolve_device(cfg.device)
    eager = src.model.to(device)
    model = eager if cfg.dtype == "float32" else named(CastWrapper(_clone(src.model), DTYPES[cfg.dtype]),
                                                       [t.name for t in sig.inputs]).to(device).eval()
    name = cfg.name or src.name
    ex = exporters.example(sig, 2, device)
    io_spec = sig.to_manifest()
    artifacts: list[dict[str, Any]] = []
    failures: list[dict[str, str]] = []
    with staging_dir(out, overwrite=cfg.overwrite) as tmp:
        ref, sets = _reference(eager, src, cfg, device)
        with open(tmp / REFERENCE, "wb") as f:
            np.savez(f, **ref)
        for fmt in cfg.formats:
            t0 = time.perf_counter()
            (tmp / fmt).mkdir()
            log(f"export {fmt} ...")
            try:
                files, extra = _export_one(fmt, model, ex, tmp, cfg, sig, device)
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
                     "bytes": sum((tmp / f).stat().st_size for f in files), "dtype": cfg.dtype,
                     "device": device, "torch_version": torch.__version__, "export_seconds": round(secs, 2),
                     "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra}
            artifacts.append(entry)
            log(f"  {fmt}: {', '.join(files)} ({entry['bytes'] / 1e6:.1f} MB, {secs:.1f}s)")
        if not artifacts:
            raise ArtifactError("no format could be exported: " + "; ".join(f"{f['format']}: {f['error']}" for f in failures))
        manifest = {
            "format": FORMAT, "name": name, "torchship_version": torchship.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": device, "dtype": cfg.dtype,
            "python": sys.version.split()[0], "torch_version": torch.__version__,
            "source": src.description, **io_spec,
            "classes": src.classes, "max_batch": cfg.max_batch, "tolerances": cfg.tolerances(),
            "reference": {"file": REFERENCE, "sha256": sha256_file(tmp / REFERENCE), "samples": src.sample_set if src.samples else None,
                          "sets": {k: v["batch"] for k, v in sets.items()},
                          "dims": {k: v["dims"] for k, v in sets.items() if v["dims"]}},
            "artifacts": artifacts, "export_failures": failures,
        }
        if src.preprocessing:
            pre, shape = src.preprocessing, sig.inputs[0].shape[1:]
            manifest["preprocessing"] = {
                **pre, "normalization": "in_graph",
                "contract": f"float32 NCHW images in [0, 1] at {shape[1]}x{shape[2]}, {shape[0]} channels; "
                            "the graph subtracts mean and divides by std itself"}
        write_manifest(tmp, manifest)
    log(f"manifest: {out / MANIFEST}")
    if cfg.verify:
        log("verify: each artifact in a fresh process against eager ...")
        verify_export(out, device=device, threads=cfg.threads, strict=cfg.strict)  # writes its results into manifest.json
        manifest = read_manifest(out)
    return manifest


def _clone(m: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(m)


def _export_one(fmt: str, model, ex, tmp: Path, cfg: ExportConfig, sig: Signature, device) -> tuple[list[str], dict[str, Any]]:
    if fmt == "torchscript":
        return [f"{fmt}/model.pt"], exporters.torchscript(model, ex, tmp / fmt / "model.pt")
    if fmt == "exported_program":
        return [f"{fmt}/model.pt2"], exporters.exported_program(model, ex, tmp / fmt / "model.pt2", sig, cfg.max_batch)
    if fmt == "aoti":
        extra = exporters.aoti(model, ex, tmp / fmt / "model.pt2", sig, cfg.max_batch, cfg.threads)
        return [f"{fmt}/model.pt2"], {**extra, "batch": {"min": 1, "max": cfg.max_batch}}
    if fmt == "aoti_buckets":
        files = {}
        for b in cfg.buckets:
            rel = f"{fmt}/bs{b}.pt2"
            extra = exporters.aoti(model, exporters.example(sig, b, device), tmp / rel, sig, None, cfg.threads)
            files[str(b)] = rel
        return list(files.values()), {**extra, "buckets": files, "batch": {"buckets": list(cfg.buckets)}}
    if fmt == "onnx":
        extra = exporters.onnx(model, ex, tmp / fmt / "model.onnx", sig, cfg.max_batch, cfg.opset)
        return [f"{fmt}/model.onnx"], {**extra, "batch": {"min": 1, "max": cfg.max_batch}}
    raise ConfigError(f"unknown format {fmt}")
