"""One function per format: (deployable module, example input, ...) -> file(s) on disk."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

INPUT = "images"
OUTPUT = "logits"


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


def batch_dim(max_batch: int):
    return torch.export.Dim("batch", min=1, max=max_batch)


def example(shape: list[int], batch: int, device: str) -> torch.Tensor:
    # batch >= 2: an example batch of 1 silently specializes the batch dimension to a constant
    return torch.rand(batch, *shape, generator=torch.Generator().manual_seed(0)).to(device)


def torchscript(model: torch.nn.Module, ex: torch.Tensor, path: Path) -> dict[str, Any]:
    with quiet(), torch.no_grad():
        traced = torch.jit.trace(model, ex, check_trace=False)
        frozen = torch.jit.freeze(traced.eval())
        frozen.save(str(path))
    return {}


def exported_program(model: torch.nn.Module, ex: torch.Tensor, path: Path, max_batch: int) -> dict[str, Any]:
    with quiet():
        ep = torch.export.export(model, (ex,), dynamic_shapes={INPUT: {0: batch_dim(max_batch)}})
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


def aoti(model: torch.nn.Module, ex: torch.Tensor, path: Path, max_batch: int | None, threads: int) -> dict[str, Any]:
    """AOTInductor package with freezing (only effective as the global inductor flag, under no_grad).
    ``max_batch`` None compiles a static-shape package for ``ex``'s batch size.

    On CPU the generated OpenMP kernels keep the thread count of the compiling process: a package
    compiled with 2 threads and run with 1 was several times slower here. So compile with the serving
    thread count.
    """
    import torch._inductor.config as inductor_config

    dyn = {INPUT: {0: batch_dim(max_batch)}} if max_batch else None
    with quiet(), torch.no_grad(), torch_threads(threads), inductor_config.patch(freezing=True):
        ep = torch.export.export(model, (ex,), dynamic_shapes=dyn)
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs={})
    return {"freezing": True, "compile_threads": threads}


def onnx(model: torch.nn.Module, ex: torch.Tensor, path: Path, max_batch: int, opset: int | None) -> dict[str, Any]:
    import onnx as onnx_lib

    kwargs: dict[str, Any] = {"opset_version": opset} if opset else {}
    with quiet():
        prog = torch.onnx.export(model, (ex,), dynamo=True, input_names=[INPUT], output_names=[OUTPUT],
                                 dynamic_shapes={INPUT: {0: batch_dim(max_batch)}}, **kwargs)
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
