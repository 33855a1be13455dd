"""One function per format: (deployable module, example input, ...) -> file(s) on disk."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchship.signature import BATCH, Signature


@contextlib.contextmanager
def quiet():
    """Silence the exporters' deprecation chatter and progress prints; errors still raise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        levels = {n: logging.getLogger(n).level for n in ("torch", "torch.onnx", "onnxscript", "torch._inductor")}
        for n in levels:
            logging.getLogger(n).setLevel(logging.ERROR)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
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
    with quiet(), torch.no_grad():
        traced = torch.jit.trace(model, ex, check_trace=False)
        frozen = torch.jit.freeze(traced.eval())
        frozen.save(str(path))
    return {}


def exported_program(model: torch.nn.Module, ex: tuple, path: Path, sig: Signature, max_batch: int) -> dict[str, Any]:
    with quiet():
        ep = torch.export.export(model, ex, dynamic_shapes=dynamic_shapes(sig, max_batch))
        torch.export.save(ep, str(path))
    return {}


@contextlib.contextmanager
def torch_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def aoti(model: torch.nn.Module, ex: tuple, path: Path, sig: Signature, max_batch: int | None, threads: int) -> dict[str, Any]:
    """AOTInductor package with freezing (only effective as the global inductor flag, under no_grad).
    ``max_batch`` None compiles a package for ``ex``'s batch size (other named dims stay dynamic).

    On CPU the generated OpenMP kernels keep the thread count of the compiling process: a package
    compiled with 2 threads and run with 1 was several times slower here. So compile with the serving
    thread count.
    """
    import torch._inductor.config as inductor_config

    with quiet(), torch.no_grad(), torch_threads(threads), inductor_config.patch(freezing=True):
        ep = torch.export.export(model, ex, dynamic_shapes=dynamic_shapes(sig, max_batch))
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs={})
    return {"freezing": True, "compile_threads": threads}


def onnx(model: torch.nn.Module, ex: tuple, path: Path, sig: Signature, max_batch: int, opset: int | None) -> dict[str, Any]:
    import onnx as onnx_lib

    kwargs: dict[str, Any] = {"opset_version": opset} if opset else {}
    with quiet():
        prog = torch.onnx.export(model, ex, dynamo=True, input_names=[t.name for t in sig.inputs],
                                 output_names=[t.name for t in sig.outputs],
                                 dynamic_shapes=dynamic_shapes(sig, max_batch), **kwargs)
        prog.optimize()
        # one self-contained file below protobuf's 2 GB limit; external data beside it above
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        prog.save(str(path), external_data=nbytes >= (2 << 30) - (64 << 20))
    onnx_lib.checker.check_model(str(path), full_check=True)
    m = onnx_lib.load(str(path), load_external_data=False)
    opset_used = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), None)
    batch = m.graph.input[0].type.tensor_type.shape.dim[0]
    return {"opset": opset_used, "ir_version": m.ir_version, "batch_dim_param": batch.dim_param or None,
            "external_data": nbytes >= (2 << 30) - (64 << 20)}
