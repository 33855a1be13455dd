"""run_export: rebuild the model from a checkpoint alone, write every artifact, manifest and reference."""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch

import torchship
from torchship import parity
from torchship.detection_parity import TRUTH
from torchship.device import resolve_device, torch_threads, usable_cpus
from torchship.errors import OPTIONAL_HINT, ArtifactError, ConfigError, DegenerateError, ParityError, first_line
from torchship.io import check_out_dir, sha256_file, staging_dir
from torchship.manifest import FORMAT, MANIFEST, RAW_SET, REFERENCE, Export, write_manifest
from torchship.markdown import size
from torchship.signature import Signature

from . import exporters, quantize
from .compile import Compiler, bucket_files, bucket_weights, tf32_field, workers_for
from .config import ExportConfig
from .images import add_image_files
from .reference import build_reference, input_sets
from .source import artifact_model, load_source
from .text import load_text, write_text
from .verify import verify_export


def run_export(cfg: ExportConfig, log=print) -> dict[str, Any]:
    """export_model, returning the manifest."""
    return export_model(cfg, log).manifest


def export_model(cfg: ExportConfig, log=print) -> Export:
    """Export the model (``cfg.checkpoint``, or ``cfg.model`` with ``cfg.weights``) to every format in
    ``cfg.formats`` under ``cfg.out``; verify unless told not to.

    Returns the export as the next stage takes it: its manifest and reference arrays in memory, its files
    hashed as they were written. Raises CheckpointError (bad checkpoint or weights), ConfigError (a bad
    signature), ArtifactError (existing output without --overwrite, or no format exported), DegenerateError
    (eager's outputs do not depend on the inputs) and ParityError (a format not in ``cfg.optional`` cannot be
    exported or fails verification; the export directory is still written, and serves the formats that
    passed). Artifacts are written into a staging directory that is renamed into place when complete.
    """
    out = check_out_dir(cfg.out, cfg.overwrite, ArtifactError)
    src = load_source(cfg, log)
    sig = src.signature
    if cfg.image_files:
        add_image_files(src, cfg.image_files, log)
    text = load_text(sig, cfg.tokenizer, cfg.text_samples, log) if cfg.tokenizer else None
    device = resolve_device(cfg.device)
    if not cfg.formats:
        no_reduced = src.task.reduced_left_out(src.truth is not None)
        cfg, why = cfg.for_device(device, real_samples=bool(src.samples), no_reduced=no_reduced)
        log(f"formats: {', '.join(cfg.formats)} (the default here: {why}; --formats chooses)")
    src.task.check_formats(cfg.formats, cfg.dtype)
    eager = src.model.to(device)
    model = artifact_model(src, cfg.dtype, device)
    name = cfg.name or src.name
    ex = exporters.example(sig, 2, device)
    nbytes = _nbytes(model)
    if "aoti_buckets" in cfg.formats:
        choice, why = bucket_weights(cfg.bucket_weights, device, nbytes, cfg.buckets)
        cfg = dataclasses.replace(cfg, bucket_weights=choice)
        log(f"aoti_buckets: {choice} weights ({why})")
    with (
        staging_dir(out, overwrite=cfg.overwrite) as tmp,
        Compiler(cfg, device, workers_for(nbytes), tmp / ".compile") as compiler,
        ExitStack() as stack,
    ):
        for fmt in cfg.formats:
            (tmp / fmt).mkdir()
        arts = Artifacts(tmp, cfg, device, log)
        gate = src.task.reduced_gate(cfg.max_accuracy_drop)  # what a reduced precision is verified under
        background = _start_compiles(compiler, cfg, tmp, log)  # they run while the reference is computed

        def pace() -> None:  # a running compile holds a core: this process takes what is left (OpenMP slows badly
            torch.set_num_threads(max(1, usable_cpus() - compiler.busy()))  # when oversubscribed), more once done

        stack.enter_context(torch_threads(torch.get_num_threads()))  # put back afterwards
        pace()
        t0 = time.perf_counter()
        inputs, info = input_sets(sig, src.samples, src.sample_set, cfg.odd_batch, cfg.max_batch, cfg.seed)
        raw = _raw_set(src, sig, log)
        if raw is not None:  # its tensors join the reference (eager's answers, the bounds); not a set every model runs
            inputs[RAW_SET] = {sig.inputs[0].name: raw.inputs}
        if text is not None and text.texts:  # the same, for the texts the tokenizer makes tensors of
            inputs[RAW_SET] = text.inputs
        ref = build_reference(
            eager,
            model,
            sig,
            inputs,
            info,
            cfg.dtype,
            cfg.max_batch,
            device,
            src.labels,
            src.sample_set,
            tf32="tf32" in tf32_field(cfg, device),
            pace=pace,
            derive=src.task.derive(src.detection, list(inputs)),
        )
        ref.degenerate = src.task.blind(ref.degenerate)
        _check_degenerate(ref.degenerate, cfg.allow_degenerate, log)
        tolerances = (
            ref.tolerances
            if cfg.atol is None and cfg.rtol is None
            else parity.given([t.name for t in sig.outputs], cfg.atol, cfg.rtol, ref.tolerances)
        )
        fp64 = ref.tolerances["rule"] == "fp64" or ref.tolerances.get("fp64")  # a detector's rule says it apart
        log(
            f"reference: {len(inputs)} input sets, eager in "
            f"{'float64' if fp64 else 'float32 (' + ref.tolerances['why'] + ')'} ({time.perf_counter() - t0:.1f}s)"
        )
        for o, a in (src.truth or {}).items():  # what reduced precisions are gated on
            ref.arrays[f"{TRUTH}/{src.sample_set}/{o}"] = a
        if raw is not None:
            if raw.labels is not None:
                ref.arrays[f"labels/{RAW_SET}"] = raw.labels
            raw_files = _write_raw(tmp, raw)
        if text is not None:
            text_spec, raw_files = write_text(tmp, text)
        with open(tmp / REFERENCE, "wb") as f:
            np.savez(f, **ref.arrays)
        for fmt in (f for f in cfg.formats if f not in background):
            pace()
            t0 = time.perf_counter()
            log(f"export {fmt} ...")
            try:
                loops = any(a.get("per_picture") for a in arts.artifacts)  # found by the TorchScript export
                files, extra = _export_one(fmt, model, ex, tmp, cfg, sig, src.samples, gate, loops, log)
            except Exception as e:  # one format failing must not lose the others
                arts.fail(fmt, first_line(e))
                continue
            arts.record(fmt, files, extra, time.perf_counter() - t0)
        for fmt, jobs in background.items():
            log(f"export {fmt}: waiting for its compile ...")
            results = {b: job.result() for b, job in jobs.items()}
            error = next((r["error"] for r in results.values() if "error" in r), None)
            if error:
                arts.fail(fmt, error)
                continue
            arts.record(
                fmt,
                [f"{fmt}/model.pt2"],
                _compiled(fmt, results, tmp, cfg, device, gate),
                sum(r["seconds"] for r in results.values()),
            )
            if fmt == "aoti_int8":
                log(quantize.log_line(fmt, arts.artifacts[-1]))
        arts.artifacts.sort(key=lambda a: cfg.formats.index(a["format"]))
        if not arts.artifacts:
            raise ArtifactError(
                "no format could be exported: " + "; ".join(f"{f['format']}: {f['error']}" for f in arts.failures)
            )
        manifest = build_manifest(name, cfg, device, src, tolerances, ref, info, arts, sha256_file(tmp / REFERENCE))
        cost = model_cost(eager, ex)
        if cost:  # what the repository's default placement weighs against a request's round trip
            manifest["flops_per_sample"] = cost
        if raw is not None or (text is not None and text.texts):
            manifest["reference"][RAW_SET] = {"batch": len(raw_files), "files": raw_files}
        if text is not None:
            manifest["text"] = text_spec
        write_manifest(tmp, manifest)
    log(f"manifest: {out / MANIFEST}")
    export = Export(out, manifest, ref.arrays, files_checked=True)  # hashed as written; the reference in memory
    if cfg.verify:
        log("verify: each artifact in a fresh process against the reference ...")
        verify_export(export, device=device, threads=cfg.threads, log=log)  # writes its verdicts into the manifest
        return export
    required = [f for f in manifest["export_failures"] if f["format"] not in cfg.optional]
    if required:
        raise ParityError(
            [f"{f['format']}: cannot be exported: {f['error']}" for f in required],
            what=f"export to {out}",
            hint=OPTIONAL_HINT,
        )
    return export


class Artifacts:
    """The artifacts written into the staging folder ``tmp`` and the formats that failed, each logged as it lands."""

    def __init__(self, tmp: Path, cfg: ExportConfig, device: str, log) -> None:
        self.tmp, self.cfg, self.device, self.log = tmp, cfg, device, log
        self.artifacts: list[dict[str, Any]] = []
        self.failures: list[dict[str, str]] = []

    def record(self, fmt: str, files: list[str], extra: dict[str, Any], secs: float) -> None:
        entry = {
            "name": fmt,
            "format": fmt,
            "file": files[0],
            "files": {f: sha256_file(self.tmp / f) for f in files},
            "bytes": sum((self.tmp / f).stat().st_size for f in files),
            "dtype": self.cfg.dtype,
            "device": self.device,
            "torch_version": torch.__version__,
            "export_seconds": round(secs, 2),
            "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **extra,
        }
        self.artifacts.append(entry)
        self.log(f"  {fmt}: {', '.join(files)} ({size(entry['bytes'])}, {secs:.1f}s)")

    def fail(self, fmt: str, reason: str) -> None:
        shutil.rmtree(self.tmp / fmt, ignore_errors=True)
        self.failures.append({"format": fmt, "error": reason})
        self.log(f"  {fmt} FAILED: {reason} (other formats continue)")


def build_manifest(
    name: str,
    cfg: ExportConfig,
    device: str,
    src,
    tolerances: dict[str, Any],
    ref,
    info: dict,
    arts: Artifacts,
    reference_sha256: str,
) -> dict[str, Any]:
    """manifest.json's contents: what was exported from what, its signature, the reference and its bounds, and
    each artifact (or why its format failed)."""
    manifest = {
        "format": FORMAT,
        "name": name,
        "torchship_version": torchship.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device,
        "dtype": cfg.dtype,
        "python": sys.version.split()[0],
        "torch_version": torch.__version__,
        "source": src.description,
        **src.signature.to_manifest(),
        "classes": src.classes,
        "max_batch": cfg.max_batch,
        "tolerances": tolerances,
        "reference": {
            "file": REFERENCE,
            "sha256": reference_sha256,
            "samples": src.sample_set if src.samples else None,
            "sets": {k: v["batch"] for k, v in info.items()},
            "dims": {k: v["dims"] for k, v in info.items() if v["dims"]},
            "degenerate": ref.degenerate,
        },
        "formats": list(cfg.formats),
        "optional": list(cfg.optional),
        "artifacts": arts.artifacts,
        "export_failures": arts.failures,
    }
    manifest["task"] = src.task.name
    if src.detection is not None:  # what its fixed-shape outputs keep, and the letterbox of its pictures
        manifest["detection"] = src.detection
    if src.preprocessing:
        pre, shape = src.preprocessing, src.signature.inputs[0].shape[1:]
        manifest["preprocessing"] = {
            **pre,
            "normalization": "in_graph",
            "contract": f"float32 NCHW images in [0, 1] at {shape[1]}x{shape[2]}, {shape[0]} channels; "
            + (
                "the graph subtracts mean and divides by std itself"
                if "mean" in pre
                else "the model normalizes them itself"
            ),
        }
    return manifest


def model_cost(eager, ex) -> float | None:
    """FLOPs a sample of ``eager`` on the example inputs, or None where they cannot be counted (the count is
    advice for the repository's placement: nothing fails for want of it)."""
    from torchship.eager import flops_per_sample

    try:
        return flops_per_sample(eager, ex) or None
    except Exception:
        return None


def _raw_set(src, sig, log):
    """The held-out files the checkpoint keeps (RawSamples), where the model takes one image tensor of their shape."""
    raw = src.raw
    if raw is None or len(sig.inputs) != 1 or not src.preprocessing:
        return None
    want = list(sig.inputs[0].shape[1:])
    if list(raw.inputs.shape[1:]) != want:
        log(f"held-out files: left out (the checkpoint's are {list(raw.inputs.shape[1:])}, the model takes {want})")
        return None
    return raw


def _write_raw(tmp: Path, raw) -> dict[str, str]:
    """The held-out files under raw/, as a client would send them; relative path -> sha256."""
    (tmp / RAW_SET).mkdir()
    files = {}
    for name, data in zip(raw.names, raw.files):
        (tmp / RAW_SET / name).write_bytes(data)
        files[f"{RAW_SET}/{name}"] = sha256_file(tmp / RAW_SET / name)
    return files


def _check_degenerate(outputs: list[str], allowed: bool, log) -> None:
    """Refuse a reference against which any artifact would pass, unless --allow-degenerate."""
    if not outputs:
        return
    what = (
        f"eager's output {', '.join(repr(o) for o in outputs)} is the same for every reference input "
        "(constant or all zero), so verification cannot tell a right artifact from a wrong one"
    )
    if not allowed:
        raise DegenerateError(
            f"{what}; export real weights, give real inputs with --example-inputs, or pass "
            "--allow-degenerate to go on with a blind check"
        )
    log(f"warning: {what} (--allow-degenerate)")


def _nbytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _start_compiles(compiler: Compiler, cfg: ExportConfig, tmp: Path, log) -> dict[str, dict[int, Any]]:
    """Submit the AOTInductor compiles; returns format -> {batch (0 for aoti): its pending result}."""
    jobs: dict[str, dict[int, Any]] = {}
    for fmt in ("aoti", "aoti_int8", "aoti_bf16"):
        if fmt in cfg.formats:
            jobs[fmt] = {0: compiler.submit(fmt, out=tmp / fmt / "model.pt2")}
    if "aoti_buckets" in cfg.formats:
        jobs["aoti_buckets"] = {b: compiler.submit("bucket", b) for b in cfg.buckets}
    if jobs:
        log(f"compiling {', '.join(jobs)} in {compiler.workers} worker process(es) meanwhile")
    return jobs


def _compiled(
    fmt: str, results: dict[int, dict[str, Any]], tmp: Path, cfg: ExportConfig, device: str, gate: dict[str, Any]
) -> dict[str, Any]:
    """The manifest's extra fields of a compiled format; packages the aoti_buckets archive first."""
    if fmt == "aoti":
        return {**results[0]["extra"], "batch": {"min": 1, "max": cfg.max_batch}}
    if fmt in ("aoti_int8", "aoti_bf16"):
        return {**results[0]["extra"], **_gated(cfg, "int8" if fmt == "aoti_int8" else "bfloat16", gate)}
    shared = exporters.package_buckets({b: bucket_files(r) for b, r in results.items()}, tmp / fmt / "model.pt2")
    return {
        "freezing": True,
        "compile_threads": cfg.threads,
        "weights": cfg.bucket_weights,
        "shared_constants": shared,
        "buckets": list(cfg.buckets),
        "batch": {"buckets": list(cfg.buckets)},
        **tf32_field(cfg, device),
    }


def _export_one(
    fmt: str,
    model,
    ex,
    tmp: Path,
    cfg: ExportConfig,
    sig: Signature,
    samples: dict[str, np.ndarray],
    gate: dict[str, Any],
    per_picture: bool,
    log=print,
) -> tuple[list[str], dict[str, Any]]:
    """``fmt``'s files under ``tmp`` and its manifest fields. ``per_picture``: an earlier format's trace found that
    the model loops over its pictures (the ONNX formats then skip torch.export)."""
    if fmt == "torchscript":
        return [f"{fmt}/model.pt"], exporters.torchscript(model, ex, tmp / fmt / "model.pt")
    if fmt == "exported_program":
        return [f"{fmt}/model.pt2"], exporters.exported_program(model, ex, tmp / fmt / "model.pt2", sig, cfg.max_batch)
    if fmt == "onnx":
        extra = exporters.onnx(model, ex, tmp / fmt / "model.onnx", sig, cfg.max_batch, cfg.opset, per_picture)
        return [f"{fmt}/model.onnx", *(f"{fmt}/{f}" for f in extra["external_data"])], {
            **extra,
            "batch": {"min": 1, "max": cfg.max_batch},
        }
    if fmt == "onnx_int8":
        return _onnx_int8(model, ex, tmp, cfg, sig, samples, gate, per_picture, log)
    raise ConfigError(f"unknown format {fmt}")


def _onnx_int8(
    model, ex, tmp: Path, cfg: ExportConfig, sig: Signature, samples: dict[str, np.ndarray], gate, per_picture, log
) -> tuple[list[str], dict[str, Any]]:
    """onnx_int8/model.onnx: the fp32 ONNX model (the onnx artifact's file where it was exported already)
    quantized for this CPU; the gate it will be verified under goes into its manifest entry."""
    names = [t.name for t in sig.inputs]
    calibration, source = quantize.calibration_samples(cfg.calibration, samples, names)
    scheme = quantize.int8_scheme()
    fp32 = tmp / "onnx" / "model.onnx"
    if not fp32.exists():
        fp32 = tmp / "onnx_int8" / "fp32" / "model.onnx"
        fp32.parent.mkdir()
        exporters.onnx(model, ex, fp32, sig, cfg.max_batch, cfg.opset, per_picture)
    external = _nbytes(model) >= exporters.ONNX_EXTERNAL_BYTES
    try:
        extra = quantize.onnx_int8(fp32, tmp / "onnx_int8" / "model.onnx", calibration, source, scheme, external)
    finally:
        shutil.rmtree(tmp / "onnx_int8" / "fp32", ignore_errors=True)
    log(quantize.log_line("onnx_int8", extra))
    files = [
        "onnx_int8/model.onnx",
        *(f"onnx_int8/{f.name}" for f in (tmp / "onnx_int8").iterdir() if f.name != "model.onnx"),
    ]
    return files, {**extra, **_gated(cfg, "int8", gate)}


def _gated(cfg: ExportConfig, dtype: str, gate: dict[str, Any]) -> dict[str, Any]:
    """The manifest fields every reduced-precision artifact (INT8, bf16) carries: what it computes in, the gate it is
    verified under instead of a rounding bound (its task's), and its batch range."""
    return {
        "dtype": dtype,
        "gate": gate,
        "batch": {"min": 1, "max": cfg.max_batch},
    }
