"""One function per format: (deployable module, example input, ...) -> file(s) on disk."""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchship.device import torch_threads
from torchship.errors import ArtifactError, root_cause
from torchship.runtime import BUCKET_PREFIX, tf32_allowed
from torchship.signature import BATCH, Signature

from . import tracing


@contextlib.contextmanager
def quiet():
    """Silence the exporters' deprecation chatter, progress prints and the graphs torch.export prints on
    stderr when it cannot capture a model; errors still raise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        levels = {n: logging.getLogger(n).level for n in ("torch", "torch.onnx", "onnxscript", "torch._inductor")}
        for n in levels:
            logging.getLogger(n).setLevel(logging.ERROR)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                yield
        finally:
            for n, lvl in levels.items():
                logging.getLogger(n).setLevel(lvl)


def dynamic_shapes(sig: Signature, max_batch: int | None) -> dict[str, dict[int, Any]] | None:
    """torch.export's dynamic_shapes for ``sig``: the batch dim (unless ``max_batch`` is None: a static
    batch) and every named dim, one Dim object per name so that inputs sharing a dim share it."""
    dims = {k: torch.export.Dim(k, min=lo, max=hi) for k, (lo, hi) in sig.dims.items()}
    if max_batch:
        dims[BATCH] = torch.export.Dim(BATCH, min=1, max=max_batch)
    spec = {t.name: {i: dims[d] for i, d in enumerate(t.shape) if isinstance(d, str) and d in dims} for t in sig.inputs}
    return spec if any(spec.values()) else None


def example(sig: Signature, batch: int, device: str) -> tuple[torch.Tensor, ...]:
    """Example inputs for tracing. ``batch`` >= 2 and dynamic dims >= 2: a size of 1 would silently be
    specialized to a constant."""
    feeds = sig.random_inputs(np.random.default_rng(0), batch, sig.example_values())
    return tuple(torch.from_numpy(feeds[t.name]).to(device) for t in sig.inputs)


def torchscript(model: torch.nn.Module, ex: tuple, path: Path) -> dict[str, Any]:
    """A traced convolution records cuDNN's TF32 switch as a constant of the graph (the last argument of
    aten::_convolution), and torch allows TF32 by default: traced so, the file would compute in TF32 on any
    GPU whatever the loading process sets. Traced with TF32 off, it computes IEEE float32 as verified."""
    with tf32_allowed(False), quiet(), torch.no_grad():
        graph, per_picture = tracing.trace(model, ex)
        frozen = torch.jit.freeze(graph.eval())
        frozen.save(str(path))
    called = torchvision_ops(frozen.graph)
    return {**({"per_picture": True} if per_picture else {}), **({"torchvision_ops": called} if called else {})}


def torchvision_ops(graph) -> list[str]:
    """The torchvision operators (``torchvision::nms``, ``roi_align``, ...) a TorchScript graph calls, loops'
    bodies included: what a server must have loaded to run it."""
    found, todo = set(), [graph]
    while todo:
        for node in todo.pop().nodes():
            if node.kind().startswith("torchvision::"):
                found.add(node.kind())
            todo.extend(node.blocks())
    return sorted(found)


def exported_program(model: torch.nn.Module, ex: tuple, path: Path, sig: Signature, max_batch: int) -> dict[str, Any]:
    with quiet():
        ep = torch.export.export(model, ex, dynamic_shapes=dynamic_shapes(sig, max_batch))
        torch.export.save(ep, str(path))
    return {}


# Inductor's freezing folds BatchNorm and other constants into the weights (only as the global flag, under
# no_grad); on CPU it also prepacks convolution and linear weights for oneDNN. Prepacked weights are opaque
# tensors that live only inside a model's shared library, so bucket models that share one copy of their
# weights are compiled without prepacking. Whichever a process compiles first decides for every later
# compile in it (inductor registers its rewrite patterns once), so each compile runs in a fresh process.
FREEZE = {"freezing": True}
FREEZE_SHAREABLE = {"freezing": True, "cpp.weight_prepack": False}


def compile_config(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for inductor's config patch, with the C++ compiler's line tables off where this torch has the
    switch (-g1, kept for sampling profilers): a package runs the same without them, compiles sooner and is
    smaller on disk."""
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config.aot_inductor, "enable_line_tables"):
        return {**options, "aot_inductor.enable_line_tables": False}
    return dict(options)


def aoti(
    model: torch.nn.Module, ex: tuple, path: Path, sig: Signature, max_batch: int | None, threads: int
) -> dict[str, Any]:
    """AOTInductor package with freezing (FREEZE). ``max_batch`` None compiles a package for ``ex``'s batch
    size (other named dims stay dynamic).

    On CPU the generated OpenMP kernels keep the thread count of the compiling process: a package
    compiled with 2 threads and run with 1 was several times slower here. So compile with the serving
    thread count.
    """
    with quiet(), torch.no_grad(), torch_threads(threads):
        compile_package(torch.export.export(model, ex, dynamic_shapes=dynamic_shapes(sig, max_batch)), path)
    return {"freezing": True, "compile_threads": threads}


def compile_package(ep, path: Path) -> None:
    """``ep`` (an ExportedProgram) compiled into one AOTInductor package at ``path``, with freezing (FREEZE);
    the caller holds the threads and no_grad the package is compiled under."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_config(FREEZE)):
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs={})


SHARED_OPTIONS = {
    "aot_inductor.package": True,
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
}


def compile_bucket(model: torch.nn.Module, sig: Signature, batch: int, threads: int, device: str, shared: bool) -> list:
    """The AOTInductor files of a static-batch model for ``batch`` (other named dims stay dynamic), compiled
    with freezing: a list of file paths, and with ``shared`` one Weights (the constants, kept out of the
    shared library and not prepacked); else the constants, prepacked on CPU, are inside the library."""
    import torch._inductor.config as inductor_config

    ex = example(sig, batch, device)
    options = SHARED_OPTIONS if shared else {"aot_inductor.package": True}
    with (
        quiet(),
        torch.no_grad(),
        torch_threads(threads),
        inductor_config.patch(compile_config(FREEZE_SHAREABLE if shared else FREEZE)),
    ):
        ep = torch.export.export(model, ex, dynamic_shapes=dynamic_shapes(sig, None))
        return torch._inductor.aot_compile(ep.module(), ex, options=dict(options))


def package_buckets(compiled: dict[int, list], path: Path) -> int:
    """One aoti_buckets archive at ``path`` holding each bucket's model (compile_bucket's files, by batch
    size) as ``bs<N>``, with constants kept out of the models' libraries and equal across buckets stored
    once. Returns how many were shared."""
    from torch._inductor.package import package_aoti

    shared = _share_constants(compiled)
    with quiet():
        package_aoti(str(path), {f"{BUCKET_PREFIX}{b}": files for b, files in sorted(compiled.items())})
    return shared


def _share_constants(compiled: dict[int, list]) -> int:
    """Make each bucket's constants that equal an earlier bucket's the very same tensors, so that packaging
    (which stores tensors sharing storage once) writes them once. Returns how many were shared.

    Weights is torch's private packaging type; tests/export checks the archive's size, which fails loudly
    if this stops sharing."""
    from torch.export.pt2_archive._package_weights import TensorProperties, Weights

    seen: dict[str, torch.Tensor] = {}
    shared = 0
    for files in compiled.values():
        for i, f in enumerate(files):
            if not isinstance(f, Weights):
                continue
            kept = {}
            for name, (t, _) in f.items():
                first = seen.setdefault(name, t)
                same = (
                    first is not t
                    and first.dtype == t.dtype
                    and first.shape == t.shape
                    and first.stride() == t.stride()
                    and first.device == t.device
                    and torch.equal(first, t)
                )
                kept[name] = (first if same else t, TensorProperties(first if same else t))
                shared += same
            files[i] = Weights(kept)
    return shared


ONNX_EXTERNAL_BYTES = (2 << 30) - (64 << 20)  # weights from this size on go to external data (protobuf's limit: 2 GiB)


PER_PICTURE_WHY = "it loops over its batch's pictures in Python, so torch.export would fix the batch size"


def onnx(
    model: torch.nn.Module,
    ex: tuple,
    path: Path,
    sig: Signature,
    max_batch: int,
    opset: int | None,
    per_picture: bool = False,
) -> dict[str, Any]:
    """One self-contained ``path`` below protobuf's 2 GB limit; above it the weights go to external data
    files beside it (named in the extra's ``external_data``), which must travel with it under their names.
    Made by torch.export's exporter, or where torch.export cannot capture the model (a torchvision detector's
    postprocessing branches on its data), by the TorchScript-based one (onnx_from_trace); the extra says which
    made it and why. ``per_picture``: the model's TorchScript export found that it loops over its pictures, so
    torch.export is not tried (on torchvision's detectors it spends several seconds before it fails)."""
    import onnx as onnx_lib

    nbytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    external = nbytes >= ONNX_EXTERNAL_BYTES
    how: dict[str, Any] = {"exporter": "dynamo"}
    if per_picture:
        how = onnx_from_trace(model, ex, path, sig, max_batch, opset, PER_PICTURE_WHY)
    else:
        try:
            _onnx_dynamo(model, ex, path, sig, max_batch, opset, external)
        except Exception as e:
            for f in path.parent.iterdir():  # whatever the failed exporter left
                if f.is_file():
                    f.unlink()
            how = onnx_from_trace(model, ex, path, sig, max_batch, opset, root_cause(e))
    onnx_lib.checker.check_model(str(path), full_check=True)
    m = onnx_lib.load(str(path), load_external_data=False)
    opset_used = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), None)
    batch = m.graph.input[0].type.tensor_type.shape.dim[0]
    data = sorted({e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"})
    return {
        **how,
        "opset": opset_used,
        "ir_version": m.ir_version,
        "batch_dim_param": batch.dim_param or None,
        "external_data": data,
    }


def torchlib_ops_once() -> None:
    """Make torch.onnx's exporter read onnxscript's list of torchlib's ops once a process, not once an export.
    Building it parses the source of each of some 500 functions (0.5 to 0.8 s of CPU an export); the list is
    read, not changed, and its ops are all registered when onnxscript's torchlib is imported, before the first
    build. Each export still makes its own registry from it. A torch laid out otherwise is left as it is."""
    try:
        from torch.onnx._internal.exporter import _registration

        apis = _registration.onnxscript_apis  # torch's own handle on onnxscript's API for it
        build = apis.get_torchlib_ops
    except (ImportError, AttributeError):
        return
    if getattr(build, "once", False):
        return
    ops: list = []
    lock = threading.Lock()

    def get_torchlib_ops() -> list:
        with lock:
            if not ops:
                ops.extend(build())
            return list(ops)

    get_torchlib_ops.once = True  # type: ignore[attr-defined]
    apis.get_torchlib_ops = get_torchlib_ops


def _onnx_dynamo(
    model: torch.nn.Module, ex: tuple, path: Path, sig: Signature, max_batch: int, opset: int | None, external: bool
) -> None:
    """``path`` written by torch.export's ONNX exporter, optimized, the weights external where ``external``."""
    torchlib_ops_once()
    kwargs: dict[str, Any] = {"opset_version": opset} if opset else {}
    with quiet():
        prog = torch.onnx.export(
            model,
            ex,
            dynamo=True,
            input_names=[t.name for t in sig.inputs],
            output_names=[t.name for t in sig.outputs],
            dynamic_shapes=dynamic_shapes(sig, max_batch),
            **kwargs,
        )
        prog.optimize()
        if max_batch and isinstance(prog.model.graph.inputs[0].shape[0], int):  # captured at the example's batch
            raise ArtifactError(
                f"its graph came out fixed at the example's batch size of {ex[0].shape[0]} (the model loops over "
                "its batch in Python, or reads the batch size as a number)"
            )
        prog.save(str(path), external_data=external)


TRACE_OPSET = 17  # the least opset the TorchScript-based exporter is asked for: torchvision's NMS and RoIAlign need 11+


def onnx_from_trace(
    model: torch.nn.Module, ex: tuple, path: Path, sig: Signature, max_batch: int, opset: int | None, why: str
) -> dict[str, Any]:
    """``path`` written by the TorchScript-based exporter (dynamo=False) from the graph tracing.trace makes (a
    per-picture loop becomes an ONNX Loop), the batch and every named dim dynamic; the manifest fields saying so."""
    axes = {
        t.name: {
            i: d if d in sig.dims or d == BATCH else f"{t.name}_{i}"
            for i, d in enumerate(t.shape)
            if isinstance(d, str)
        }
        for t in (*sig.inputs, *sig.outputs)
    }
    if not max_batch:
        axes = {n: {i: d for i, d in a.items() if i} for n, a in axes.items()}
    with tf32_allowed(False), quiet(), torch.no_grad():
        graph, per_picture = tracing.trace(model, ex)
        torch.onnx.export(
            graph,
            ex,
            str(path),
            dynamo=False,
            opset_version=max(opset or TRACE_OPSET, TRACE_OPSET),
            input_names=[t.name for t in sig.inputs],
            output_names=[t.name for t in sig.outputs],
            dynamic_axes={n: a for n, a in axes.items() if a},
        )
    return {
        "exporter": "torchscript",
        "exporter_why": f"torch.export cannot capture the model: {why}",
        **({"per_picture": True} if per_picture else {}),
    }
