"""What an AOTInductor compile imports (torch, inductor, the exporters and the INT8 path), imported once by the
fork server that the CPU compile workers are forked from (compile.PRELOAD): each worker then starts with them
instead of spending about 5 s of CPU importing them again. Their import-time warnings (no CUDA runtime on a CPU
machine, a deprecation inside torchao) are left out: they say nothing about the export."""

from __future__ import annotations

import importlib
import logging

MODULES = (
    "torch",
    "torch._inductor.compile_fx",
    "torch._inductor.codecache",
    "torch._inductor.cpp_builder",
    "torch._inductor.codegen.cpp_wrapper_cpu",
    "torch._inductor.package",
    "torch.export._trace",
    "torch.utils.cpp_extension",
    "setuptools",
    "sympy.combinatorics",
    "sympy.physics",
    "torchao.quantization.pt2e",
    "torchship.export.exporters",
    "torchship.export.quantize",
    "torchship.export.source",
)
QUIET = ("torch.utils.cpp_extension", "torch.utils._pytree")


def _import_all() -> None:
    loggers = [logging.getLogger(name) for name in QUIET]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        for name in MODULES:
            try:
                importlib.import_module(name)
            except ImportError:  # an optional one (torchao's INT8 path): its compile imports what it needs
                pass
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


_import_all()
