"""Build a Triton model repository from an export manifest, with protobuf configs.

Layout (one model per format, versions in numbered folders):
  REPO/<name>_onnx/config.pbtxt, labels.txt, warmup/images, 1/model.onnx [+ its external data]   onnxruntime_onnx
  REPO/<name>_torchscript/...                               1/model.pt                           pytorch_libtorch
  REPO/<name>_aoti/config.pbtxt (+ embedded.pbtxt)          1/model.pt2 [+ buckets.pt2]          torch_aoti
  REPO/<name>_onnx_int8/..., <name>_aoti_int8/..., <name>_aoti_bf16/... (reduced precisions, as _onnx and _aoti)

<name>_aoti/config.pbtxt is the official container's torch_aoti model (Triton 26.07 on batches it) over the
dynamic-batch package, its tensors named as that backend names them (ARGS[i], RESULT). Triton 2.51 inside
nvidia-pytriton does not know torch_aoti at all; the embedded server loads embedded.pbtxt instead (the
manifest's tensor names, batched over the static-batch models of the bucket archive, which share one copy
of the weights).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from torchship.device import cuda_visible, usable_cpus
from torchship.errors import ArtifactError, ConfigError
from torchship.io import check_out_dir, staging_dir
from torchship.manifest import Export, artifact, file_problem, passed_formats, reference_inputs, runs_tf32
from torchship.names import FORMATS, model_names
from torchship.runtime import ONNX_FORMATS, PROVENANCE
from torchship.tasks import task_of

from .config import (
    TRT_CACHE,
    RepoConfig,
    placement,
)
from .entries import entry_of, wants_image_entry, write_image_entry, write_text_entry
from .model_config import (
    CONFIG,
    DTYPES,
    EMBEDDED_CONFIG,
    TENSOR_NAMES,
    aoti_tensor_names,
    config_dims,
    config_text,
    served_dims,
)
from .repo_readme import render_readme
from .servable import not_served, not_served_text, servable_formats, served_artifacts  # noqa: F401 (re-exported)


def _instance_kind(cfg: RepoConfig) -> int:
    """The instance_group kind the configs get; "auto" asks torch whether CUDA is visible."""
    if cfg.instance_kind == "gpu":
        return mc.ModelInstanceGroup.KIND_GPU
    if cfg.instance_kind == "cpu":
        return mc.ModelInstanceGroup.KIND_CPU
    return mc.ModelInstanceGroup.KIND_GPU if cuda_visible() else mc.ModelInstanceGroup.KIND_CPU


def _param(config: mc.ModelConfig, key: str, value: Any) -> None:
    config.parameters[key].string_value = str(value)


def build_config(
    manifest: dict[str, Any],
    fmt: str,
    cfg: RepoConfig,
    max_batch: int,
    kind: int,
    container_aoti: bool = False,
    warmup: dict[str, np.ndarray] | None = None,
) -> mc.ModelConfig:
    """The config.pbtxt of one model, with instances of ``kind`` (_instance_kind). ``container_aoti``: the
    official container's torch_aoti model (Triton 26.07 on batches it), its tensors named as that backend names
    them (aoti_tensor_names), the manifest's names recorded beside them for clients (TENSOR_NAMES).
    ``warmup``: one sample per input, for Triton's warm-up."""
    names = model_names(manifest)
    c = mc.ModelConfig(name=names[fmt])
    c.version_policy.latest.num_versions = 1
    c.platform, c.default_model_filename = FORMATS[fmt].platform, FORMATS[fmt].file
    c.max_batch_size = max_batch
    rename = aoti_tensor_names(manifest) if container_aoti else {}
    if container_aoti:
        c.backend = "pytorch"
        _param(c, TENSOR_NAMES, json.dumps({v: k for k, v in rename.items()}))
    image = (manifest.get("preprocessing") or {}).get("layout") == "NCHW"
    for spec in manifest["inputs"]:
        inp = c.input.add(
            name=rename.get(spec["name"], spec["name"]), data_type=DTYPES[spec["dtype"]], dims=config_dims(spec)
        )
        if image:  # Triton's image clients read the layout from here (dims must be [C, H, W])
            inp.format = mc.ModelInput.FORMAT_NCHW
    task = task_of(manifest)
    for i, spec in enumerate(manifest["outputs"]):
        out = c.output.add(
            name=rename.get(spec["name"], spec["name"]), data_type=DTYPES[spec["dtype"]], dims=served_dims(spec)
        )
        if not config_dims(spec):  # one value per request (a detector's count): the model makes [batch]
            out.reshape.SetInParent()
        if manifest.get("classes") and i == 0 and task.labels_file:  # the classification extension
            out.label_filename = "labels.txt"
    for key, value in task.label_parameters(manifest).items():  # what torchship infer names the labels by
        _param(c, key, value)
    if runs_tf32(manifest, fmt):
        _param(c, "tf32", "true")  # the stand-in backends run it with TF32 allowed, as it was compiled and verified
    if manifest.get("dims"):  # the stand-in backends refuse a dynamic dim outside its range
        _param(c, "dim_ranges", json.dumps(dim_ranges(manifest)))
    c.dynamic_batching.max_queue_delay_microseconds = cfg.max_queue_delay_us
    group = c.instance_group.add(kind=kind, count=cfg.instance_count)
    if kind == mc.ModelInstanceGroup.KIND_GPU:
        group.gpus.append(0)
    if fmt in ONNX_FORMATS:  # parameter names of Triton's onnxruntime backend
        _param(c, "intra_op_thread_count", cfg.threads)
        _param(c, "inter_op_thread_count", 1)
        if cfg.ort_accelerator != "none" and kind == mc.ModelInstanceGroup.KIND_GPU:
            acc = c.optimization.execution_accelerators.gpu_execution_accelerator.add(name=cfg.ort_accelerator)
            if cfg.ort_accelerator == "tensorrt":
                acc.parameters["precision_mode"] = "FP32" if cfg.trt_fp16 is False else "FP16"
                acc.parameters["trt_engine_cache_enable"] = "1"
                acc.parameters["trt_engine_cache_path"] = cfg.trt_cache or TRT_CACHE
                acc.parameters["max_workspace_size_bytes"] = str(1 << 30)
    else:  # parameter names of Triton's pytorch backend
        _param(c, "INTRA_OP_THREAD_COUNT", cfg.threads)
        _param(c, "INTER_OP_THREAD_COUNT", 1)
        _param(c, "DISABLE_OPTIMIZED_EXECUTION", "false")
    if warmup:
        warm_batches(c, manifest, warmup, sorted({1, max_batch}), rename)
    return c


def warm_batches(
    c: mc.ModelConfig,
    manifest: dict[str, Any],
    warmup: dict[str, np.ndarray],
    sizes: Sequence[int],
    rename: dict[str, str] | None = None,
) -> None:
    """Triton's warm-up, run on every instance at load before it is ready: the real sample (``warmup``) repeated to each
    of ``sizes``, so that the first requests that batch that large do not meet a cold runtime (ONNX Runtime sizes its
    buffers, oneDNN and AOTInductor their kernels, on the first run at a shape)."""
    c.ClearField("model_warmup")
    rename = rename or {}
    for b in sizes:
        w = c.model_warmup.add(name=f"real_sample_batch_{b}", batch_size=b)
        for inp in manifest["inputs"]:
            sample = w.inputs[rename.get(inp["name"], inp["name"])]
            sample.data_type = DTYPES[inp["dtype"]]
            sample.dims.extend(list(warmup[inp["name"]].shape[1:]))
            sample.input_data_file = inp["name"]


def dim_ranges(manifest: dict[str, Any]) -> dict[str, list]:
    """input -> per non-batch dim, [name, min, max] for a dynamic one, else None."""
    dims = manifest.get("dims", {})
    return {
        t["name"]: [[d, dims[d]["min"], dims[d]["max"]] if d in dims else None for d in t["shape"][1:]]
        for t in manifest["inputs"]
    }


def warmup_sample(manifest: dict[str, Any], ref: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One real sample per input (the first of the reference's real samples, else of its first set)."""
    return {k: np.ascontiguousarray(v[:1]) for k, v in reference_inputs(ref, manifest).items()}


def provenance(export_dir: str | Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Where a version comes from: the export (its manifest's sha256) and the checkpoint's weights."""
    from torchship.io import sha256_file
    from torchship.manifest import MANIFEST

    d = Path(export_dir)
    source = manifest.get("source", {})
    return {
        "export": str(d.resolve()),
        "manifest_sha256": sha256_file(d / MANIFEST),
        "checkpoint": source.get("path"),
        "weights_sha256": source.get("weights_sha256"),
        "added": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def build_repository(export_dir: "str | Path | Export", cfg: RepoConfig) -> dict[str, Any]:
    """Write the repository for ``export_dir`` (a directory, or an Export held already) into ``cfg.out``; returns
    {"models": {format: model name}, "not_served": {format: why}, "path"}.

    Only artifacts with a passing verdict in the manifest are served, and each file is checked against the
    manifest's sha256 before it is copied (unless the Export says they were). Raises ArtifactError when no
    requested format can be served (the message says which failed verification, which were not verified and
    which were not exported), or a file was altered since export.
    """
    export = Export.of(export_dir)
    d, manifest = export.dir, export.manifest
    kind = _instance_kind(cfg)
    device = "cuda" if kind == mc.ModelInstanceGroup.KIND_GPU else "cpu"
    formats = servable_formats(manifest, cfg.formats, device)
    reasons = not_served(manifest, cfg.formats, device)
    if not formats:
        why = not_served_text(d, reasons) or f"it has none of the formats {', '.join(cfg.formats)}"
        raise ArtifactError(f"{d}: nothing to serve: {why}")
    have = passed_formats(manifest)
    problems = (
        []
        if export.files_checked
        else [
            p
            for f in formats
            for a in manifest["artifacts"]
            if a["format"] in _sources(f, have)
            for p in [file_problem(d, rel, sha) for rel, sha in a["files"].items()]
            if p
        ]
    )
    if problems:
        raise ArtifactError(
            f"{d}: " + "; ".join(problems) + "; export again (verification ran on the files the manifest lists)"
        )
    out = check_out_dir(cfg.out, cfg.overwrite, ArtifactError)
    if cfg.ort_accelerator != "none" and kind != mc.ModelInstanceGroup.KIND_GPU:
        why = (
            "--instance-kind cpu"
            if cfg.instance_kind == "cpu"
            else "--instance-kind auto, and no CUDA GPU is visible here"
        )
        raise ConfigError(
            f"--ort-accelerator {cfg.ort_accelerator} configures ONNX Runtime on a GPU, and these instances "
            f"are KIND_CPU ({why}); add --instance-kind gpu to build a repository for a GPU server"
        )
    max_batch = cfg.max_batch or manifest["max_batch"]
    if max_batch > manifest["max_batch"]:
        raise ArtifactError(f"--max-batch {max_batch} exceeds the export's max batch {manifest['max_batch']}")
    # a GPU model: one instance per GPU unless told, the cores its threads for the operators left on the CPU
    count = cfg.instance_count or 1 if kind == mc.ModelInstanceGroup.KIND_GPU else cfg.instance_count
    instances, threads = placement(
        cfg.cores or usable_cpus(), count, cfg.threads, flops=manifest.get("flops_per_sample")
    )
    cfg = dataclasses.replace(cfg, instance_count=instances, threads=threads)  # a copy: the caller's is left as it was
    warm = warmup_sample(manifest, export.reference())
    origin = provenance(d, manifest)
    names = model_names(manifest)
    with staging_dir(out, overwrite=True) as tmp:
        for fmt in formats:
            mdir = tmp / names[fmt]
            vdir = mdir / str(cfg.version)
            vdir.mkdir(parents=True)
            if manifest.get("classes"):
                (mdir / "labels.txt").write_text("\n".join(manifest["classes"]) + "\n")
            (mdir / "warmup").mkdir()
            for name, x in warm.items():
                (mdir / "warmup" / name).write_bytes(x.tobytes())
            m = ModelFolder(d, manifest, cfg, max_batch, kind, warm, mdir, vdir)
            if fmt == "aoti":
                files = _write_aoti(m, have)
            elif fmt in ("aoti_int8", "aoti_bf16"):
                files = _write_aoti_package(m, fmt)
            else:
                files = m.copy(fmt, FORMATS[fmt].file)
                (mdir / CONFIG).write_text(config_text(m.config(fmt)))
            # where the version came from (torchship repo REPO --history) and the sha256 of each of its files,
            # which the embedded server's backends and torchship serve check before loading them
            (vdir / PROVENANCE).write_text(json.dumps({**origin, "files": files}, indent=2) + "\n")
        entries = []
        # in front of the ONNX model where it is served, else the first
        target = names["onnx"] if "onnx" in formats else names[formats[0]]
        cores = (
            cfg.cores or usable_cpus() if kind == mc.ModelInstanceGroup.KIND_GPU else cfg.instance_count * cfg.threads
        )  # it prepares on the CPU, one request per instance at a time
        if wants_image_entry(manifest, cfg.image_entry):
            entries = write_image_entry(tmp, manifest, target, max_batch, cfg.version, cores)
        if manifest.get("text") if cfg.text_entry is None else cfg.text_entry:
            entries = write_text_entry(tmp, manifest, target, max_batch, cfg.version, d, cores)
        container_aoti = "aoti" not in formats or "aoti" in have
        gpu = kind == mc.ModelInstanceGroup.KIND_GPU
        raw = entry_of(manifest) if entries else None
        (tmp / "README.md").write_text(render_readme(manifest, names, formats, cfg, gpu, container_aoti, raw))
    return {
        "models": {f: names[f] for f in formats},
        "not_served": reasons,
        "path": str(out),
        **({"entry": raw.name, "entry_kind": raw.kind} if raw else {}),
    }


def _sources(fmt: str, have: set[str]) -> set[str]:
    """The artifact formats a served format's model is built from."""
    return set(FORMATS[fmt].artifacts) & have


BUCKETS_FILE = "buckets.pt2"


@dataclass(frozen=True)
class ModelFolder:
    """What one served model's folder is written from: the export (``d``, its manifest), the repository's
    settings, its batch limit, the instance kind, its warm-up sample, and the folder and version folder."""

    d: Path
    manifest: dict[str, Any]
    cfg: RepoConfig
    max_batch: int
    kind: int
    warm: dict[str, np.ndarray]
    mdir: Path
    vdir: Path

    def config(self, fmt: str, **kw) -> mc.ModelConfig:
        return build_config(self.manifest, fmt, self.cfg, self.max_batch, self.kind, warmup=self.warm, **kw)

    def embedded(self, fmt: str) -> mc.ModelConfig:
        """The config the embedded server loads an AOTInductor model with: the stand-in pytorch backend,
        batched."""
        emb = self.config(fmt)
        emb.platform = ""
        emb.backend = "pytorch"
        return emb

    def copy(self, fmt: str, filename: str) -> dict[str, str]:
        return copy_artifact(self.d, artifact(self.manifest, fmt), self.vdir, filename)


def _write_aoti_package(m: ModelFolder, fmt: str) -> dict[str, str]:
    """model.pt2, a dynamic-batch reduced-precision package (aoti_int8, aoti_bf16), batched up to the max batch
    in the official container (as _aoti) and by the embedded server (embedded.pbtxt), which runs each batch as
    it comes, without padding."""
    files = m.copy(fmt, "model.pt2")
    (m.mdir / CONFIG).write_text(config_text(m.config(fmt, container_aoti=True)))
    (m.mdir / EMBEDDED_CONFIG).write_text(config_text(m.embedded(fmt)))
    return files


def _write_aoti(m: ModelFolder, have: set[str]) -> dict[str, str]:
    """model.pt2 (the dynamic-batch package, for the official container) and, for the embedded server,
    buckets.pt2 with embedded.pbtxt batching over its static-batch models up to the max batch."""
    emb = m.embedded("aoti")
    files: dict[str, str] = {}
    if "aoti" in have:
        files.update(m.copy("aoti", "model.pt2"))
        (m.mdir / CONFIG).write_text(config_text(m.config("aoti", container_aoti=True)))
    if "aoti_buckets" in have:
        b = artifact(m.manifest, "aoti_buckets")
        sizes = sorted(int(s) for s in b["buckets"] if int(s) <= m.max_batch)
        if 1 not in sizes:
            raise ArtifactError(
                f"{m.d}: aoti_buckets has no batch-1 bucket (it has {b['buckets']}); export it with --buckets 1,..."
            )
        files.update(m.copy("aoti_buckets", BUCKETS_FILE))
        emb.default_model_filename = BUCKETS_FILE
        emb.max_batch_size = max(sizes)
        # no preferred batch sizes: with them the batcher cut what had queued down to the largest preferred size
        # that fit, and served fewer, smaller batches (measured in the commit that made this choice)
        _param(emb, "buckets", ",".join(map(str, sizes)))
        warm_batches(emb, m.manifest, m.warm, sizes)  # each bucket is a model of its own, cold until it first runs
    if "aoti" not in have:  # the embedded server only: the container's torch_aoti cannot read a bucket archive
        (m.mdir / CONFIG).write_text(config_text(emb))
    else:
        (m.mdir / EMBEDDED_CONFIG).write_text(config_text(emb))
    return files


def copy_artifact(d: Path, a: dict[str, Any], vdir: Path, filename: str) -> dict[str, str]:
    """Copy an artifact's files into a version folder, its main file as ``filename`` and the rest (ONNX
    external data) under the names the graph refers to them by; returns {name in the folder: sha256}, the
    manifest's (build_repository checked the files against it)."""
    files = {}
    for rel, sha in a["files"].items():
        dest = filename if rel == a["file"] else Path(rel).name
        shutil.copy2(d / rel, vdir / dest)
        files[dest] = sha
    return files
