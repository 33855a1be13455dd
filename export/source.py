"""What an export starts from: a torchship checkpoint (its metadata says everything), or a user's model
factory, a plain weights file and the signature given on the command line."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from torchship import checkpoint as ck
from torchship.detection_parity import OUTPUTS
from torchship.detectors import has_topk
from torchship.eager import checkpoint_model, load_weights_file
from torchship.errors import CheckpointError, ConfigError, first_line
from torchship.images import RawSamples
from torchship.models import WithPreprocessing, make_model, named, parse_model_args
from torchship.names import export_name
from torchship.signature import BATCH, DYNAMIC, Signature, TensorSpec, dtype_name, parse_dims, parse_signature
from torchship.tasks import DETECTION, Task, task_of
from torchship.tasks.detection import letterbox_preprocessing

from .detection_source import own_topk, topk_outputs, wrap_torchvision


@dataclass
class Source:
    model: torch.nn.Module  # eval mode; positional inputs named as the signature's; a tensor or a tuple out
    signature: Signature  # outputs included
    name: str
    description: dict[str, Any]  # where the model came from, for the manifest
    classes: Optional[list[str]] = None
    preprocessing: Optional[dict[str, Any]] = None
    samples: dict[str, np.ndarray] = field(default_factory=dict)  # real inputs, by input name
    labels: Optional[np.ndarray] = None
    sample_set: str = "heldout"
    raw: Optional[RawSamples] = None  # held-out files as a client sends them, and training's tensors of them
    detection: Optional[dict[str, Any]] = None  # a detector's: what its fixed-shape outputs keep, and its letterbox
    truth: Optional[dict[str, np.ndarray]] = None  # the samples' ground truth where a task gates on it (boxes)

    @property
    def task(self) -> Task:
        """Its task, by the rule its manifest will be read with."""
        return task_of({"detection": self.detection} if self.detection else {})


def from_checkpoint(checkpoint: str | Path, dims: list[str] | tuple[str, ...] = ()) -> Source:
    """The eval-mode model with preprocessing baked in, rebuilt from the checkpoint's files alone.
    ``dims`` (NAME=MIN..MAX) replace the ranges of dynamic dims a checkpoint trained on your own data records."""
    ckdir = ck.resolve_checkpoint(checkpoint, which="best")
    model, meta = checkpoint_model(ckdir)
    if task_of(meta) is DETECTION:
        return _from_detection_checkpoint(ckdir, meta, model, dims)
    if "signature" in meta:
        return _from_data_checkpoint(ckdir, meta, model, dims)
    if dims:
        raise ConfigError(f"--dim: checkpoint {ckdir} takes images of a fixed size; it has no dynamic dims")
    pre = meta.get("preprocessing")
    if not pre or "mean" not in pre:
        raise CheckpointError(f"{ckdir / ck.META} records no preprocessing (mean/std); cannot build the input contract")
    shape = list(meta["input_shape"])
    sig = Signature(
        [TensorSpec("images", "float32", [BATCH, *shape])],
        [TensorSpec("logits", "float32", [BATCH, meta["num_classes"]])],
    )
    src = Source(
        WithPreprocessing(model, pre["mean"], pre["std"]).eval(),
        sig,
        export_name(meta["arch"]),
        _description(ckdir, meta),
        classes=meta["classes"],
        preprocessing=pre,
    )
    if (ckdir / ck.HELDOUT).exists():
        with np.load(ckdir / ck.HELDOUT) as held:
            src.samples, src.labels = {"images": held["images"].astype(np.float32)}, held["labels"]
            src.raw = RawSamples.from_arrays(held)
    return src


def _description(ckdir: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Where a checkpoint's model came from, for the manifest."""
    return {
        "kind": "checkpoint",
        "path": str(ckdir.resolve()),
        "weights_sha256": meta.get("weights_sha256"),
        "arch": meta["arch"],
        "model_args": meta.get("model_args", {}),
        "metrics": meta.get("metrics", {}),
        "git_revision": meta.get("git_revision"),
    }


def _from_detection_checkpoint(ckdir: Path, meta: dict[str, Any], model: torch.nn.Module, dims) -> Source:
    """A detector: its deployable form (torchship.detectors.TopK), letterboxed pictures in, K detections out."""
    from torchship.detectors import deployable

    if dims:
        raise ConfigError(f"--dim: checkpoint {ckdir} is a detector of fixed-size pictures; it has no dynamic dims")
    top = deployable(model, meta)
    sig = Signature([TensorSpec("images", "float32", [BATCH, *meta["input_shape"]])], topk_outputs(top.k))
    src = Source(
        top,
        sig,
        export_name(meta["arch"]),
        _description(ckdir, meta),
        classes=meta["classes"],
        preprocessing=letterbox_preprocessing(meta["letterbox"]["size"]),
        detection={**meta["detections"], "letterbox": meta["letterbox"]},
    )
    if (ckdir / ck.HELDOUT).exists():
        with np.load(ckdir / ck.HELDOUT) as held:
            src.samples = {"images": held["images"].astype(np.float32)}
            src.truth = {o: held[o] for o in ("boxes", "labels", "count")}  # what a reduced precision is gated on
            src.raw = RawSamples.from_arrays(held)  # pictures as files, for the served image entry's check
    return src


def _from_data_checkpoint(ckdir: Path, meta: dict[str, Any], model: torch.nn.Module, dims) -> Source:
    """A model trained on your own data: the signature and the held-out inputs come from the checkpoint."""
    sig = Signature.from_manifest({**meta["signature"], "outputs": []})
    for name, span in parse_dims(dims).items():
        if name not in sig.dims:
            raise ConfigError(
                f"--dim {name}: the checkpoint's inputs have "
                f"{'dims ' + ', '.join(sig.dims) if sig.dims else 'no dynamic dims'}"
            )
        sig.dims[name] = span
    by_keyword = meta.get("inputs_by") == "keyword"
    deployable, keys = _deployable(model.eval(), sig, (), by_keyword)
    src = Source(
        deployable,
        sig,
        export_name(meta["arch"]),
        {**_description(ckdir, meta), "data": meta.get("data", {}).get("factory"), "output_keys": keys},
        classes=meta.get("classes"),
    )
    if (ckdir / ck.HELDOUT).exists():
        with np.load(ckdir / ck.HELDOUT) as held:
            src.samples = {t.name: held[f"input/{t.name}"] for t in sig.inputs}
            src.labels = held["labels"]
        for name, size in sig.dims_of(src.samples).items():
            lo, hi = sig.dims[name]
            if not lo <= size <= hi:
                raise ConfigError(
                    f"--dim {name}={lo}..{hi} leaves out the checkpoint's held-out samples ({name}={size}); "
                    "give a range that holds them"
                )
    return src


def _deployable(model: torch.nn.Module, sig: Signature, outputs, by_keyword: bool = False):
    """(the model behind named inputs and flat outputs, its dict output keys or None); fills sig.outputs
    from a probe of the model, named from ``outputs``, else the dict keys, else output0, output1, ..."""
    probe = _probe_outputs(model, sig, by_keyword)
    keys = list(probe[0][0]) if isinstance(probe[0][0], dict) else None
    names = list(outputs) or ([str(k) for k in keys] if keys else None)
    sig.outputs = _output_specs(probe, names)
    return named(model, [t.name for t in sig.inputs], keys, by_keyword), keys


def from_weights(
    factory: str,
    model_args: list[str] | tuple[str, ...],
    weights: str,
    inputs,
    dims,
    ranges,
    outputs,
    example_inputs: Optional[str],
    log=print,
) -> Source:
    """A user's model: ``factory(**model_args)`` with ``weights`` loaded strictly, and the signature given."""
    sig = parse_signature(inputs, dims, ranges)
    for note in sig.notes:
        log(note)
    args = parse_model_args(model_args)
    model = make_model(factory, "--model", args)
    ck.load_into(model, load_weights_file(weights, log), f"--weights {weights}")
    model.eval()
    samples = _examples(example_inputs, sig) if example_inputs else {}
    detection, wrapped = None, None
    if has_topk(model):  # a torchvision one-stage detector: exported with its postprocessing inside
        if outputs and tuple(outputs) != OUTPUTS:
            raise ConfigError(f"--output: a torchvision detector's outputs are {', '.join(OUTPUTS)}; drop --output")
        model, detection = wrap_torchvision(model, sig, log)
        outputs, wrapped = OUTPUTS, "TopK"
    deployable, keys = _deployable(model, sig, outputs)
    detection = detection or own_topk(model, sig)  # a user's module that returns the top-K form itself
    from torchship.io import sha256_file

    return Source(
        deployable,
        sig,
        export_name(factory),
        {
            "kind": "weights",
            "model": factory,
            "model_args": args,
            "weights": str(Path(weights).resolve()),
            "weights_sha256": sha256_file(weights),
            "output_keys": keys,
            **({"wrapped": wrapped} if wrapped else {}),
        },
        samples=samples,
        sample_set="examples",
        detection=detection,
    )


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


def load_source(cfg, log=print) -> Source:
    """The model to export and its signature (``cfg``: an ExportConfig): from a torchship checkpoint, or from
    --model and --weights."""
    if cfg.model:
        return from_weights(
            cfg.model,
            cfg.model_args,
            cfg.weights,
            cfg.inputs,
            cfg.dims,
            cfg.input_ranges,
            cfg.outputs,
            cfg.example_inputs,
            log,
        )
    return from_checkpoint(cfg.checkpoint, cfg.dims)


def artifact_model(src: Source, dtype: str, device: str) -> torch.nn.Module:
    """The module the artifacts are made from: the eval model itself in float32, else a copy computing in
    ``dtype`` behind float32 inputs and outputs."""
    if dtype == "float32":
        return src.model.to(device)

    return (
        named(CastWrapper(copy.deepcopy(src.model), DTYPES[dtype]), [t.name for t in src.signature.inputs])
        .to(device)
        .eval()
    )


def _examples(path: str, sig: Signature) -> dict[str, np.ndarray]:
    """--example-inputs: an npz keyed by input name, each array of the input's dtype and dims."""
    p = Path(path)
    try:
        with np.load(p) as z:
            data = {k: z[k] for k in z.files}
    except Exception as e:
        raise ConfigError(f"--example-inputs {p} cannot be read as an npz: {type(e).__name__}: {e}") from None
    missing = [t.name for t in sig.inputs if t.name not in data]
    if missing:
        raise ConfigError(f"--example-inputs {p} has no array {missing[0]!r} (it has {', '.join(data) or 'none'})")
    n = {len(data[t.name]) for t in sig.inputs}
    if len(n) != 1:
        raise ConfigError(f"--example-inputs {p}: the arrays hold different numbers of samples")
    out = {}
    for t in sig.inputs:
        a = data[t.name]
        if dtype_name(a.dtype) != t.dtype:
            raise ConfigError(f"--example-inputs {p}: {t.name} is {a.dtype}, the signature says {t.dtype}")
        if a.ndim != len(t.shape) or any(isinstance(d, int) and d != s for d, s in zip(t.shape[1:], a.shape[1:])):
            raise ConfigError(f"--example-inputs {p}: {t.name} has shape {list(a.shape)}, the signature says {t.shape}")
        for d, s in zip(t.shape[1:], a.shape[1:]):
            if isinstance(d, str) and not sig.dims[d][0] <= s <= sig.dims[d][1]:
                raise ConfigError(
                    f"--example-inputs {p}: {t.name} has {d}={s}, outside --dim {d}={sig.dims[d][0]}..{sig.dims[d][1]}"
                )
        out[t.name] = a
    return out


def _call(model, sig: Signature, feeds: dict[str, np.ndarray], by_keyword: bool):
    args = {t.name: torch.from_numpy(np.ascontiguousarray(feeds[t.name])) for t in sig.inputs}
    with torch.no_grad():
        return model(**args) if by_keyword else model(*args.values())


def _probe_outputs(model, sig: Signature, by_keyword: bool) -> list:
    """The model's outputs on two sets of inputs of different batch and dynamic-dim sizes (what tells the
    fixed output dims from the varying ones)."""
    g = np.random.default_rng(0)
    first = sig.example_values()
    second = {k: (v + 1 if v + 1 <= sig.dims[k][1] else max(sig.dims[k][0], v - 1)) for k, v in first.items()}
    outs = []
    for batch, values in ((2, first), (3, second)):
        feeds = sig.random_inputs(g, batch, values)
        try:
            outs.append(_call(model, sig, feeds, by_keyword))
        except Exception as e:
            shapes = ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in feeds.items())
            raise ConfigError(
                f"the model fails on inputs of the given signature ({shapes}): {first_line(e, 200)}; check --input"
            ) from None
    return [(o, values) for o, values in zip(outs, (first, second))]


def _flat_outputs(out) -> list:
    if isinstance(out, dict):
        return list(out.values())
    if isinstance(out, (list, tuple)):
        return list(out)
    return [out]


def _output_specs(probe: list, names: Optional[list[str]]) -> list[TensorSpec]:
    (a, va), (b, vb) = probe
    ta, tb = _flat_outputs(a), _flat_outputs(b)
    bad = [type(t).__name__ for t in ta if not isinstance(t, torch.Tensor)]
    if bad:
        raise ConfigError(
            f"forward returns a {bad[0]} among its outputs; it must return tensors (a tensor, a tuple "
            "or list of them, or a dict of them)"
        )
    names = names or [f"output{i}" for i in range(len(ta))]
    if len(names) != len(ta):
        raise ConfigError(f"--output names {len(names)} outputs, the model returns {len(ta)}")
    specs = []
    for name, x, y in zip(names, ta, tb):
        if x.dim() == 0 or x.shape[0] != 2 or y.shape[0] != 3:
            raise ConfigError(f"output {name!r} has no batch dim first (shape {list(x.shape)} for a batch of 2)")
        shape: list = [BATCH]
        for sx, sy in zip(x.shape[1:], y.shape[1:]):
            if sx == sy:
                shape.append(int(sx))
            else:
                shape.append(next((k for k in va if va[k] == sx and vb.get(k) == sy), DYNAMIC))
        dt = "float32" if x.is_floating_point() else dtype_name(x.dtype)
        specs.append(TensorSpec(name, dt, shape))
    return specs
