"""Load an exported artifact and run it on numpy batches: the one loader per format that the
verifier (in a fresh process) and the Triton Python backends both use.

Kept free of torchship imports so the serving backends can carry a copy of this file.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Sequence

import numpy as np

FORMATS = ("torchscript", "exported_program", "aoti", "aoti_buckets", "onnx")


class Runner:
    """A loaded artifact. ``run({input_name: array}) -> {output_name: array}``.

    ``input_names``/``output_names`` are what the artifact itself exposes where the format
    records names (ONNX graph, TorchScript schema, ExportedProgram signature); otherwise None.
    """

    input_names: list[str] | None = None
    output_names: list[str] | None = None

    def __init__(self, fn: Callable[[np.ndarray], list[np.ndarray]], inputs: Sequence[str], outputs: Sequence[str]):
        self._fn = fn
        self.contract_inputs = list(inputs)
        self.contract_outputs = list(outputs)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = feeds[self.contract_inputs[0]]
        return dict(zip(self.contract_outputs, self._fn(x)))


def _torch_setup(threads: int):
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass  # already set in this process
    return torch


def torch_fn(module, device: str, threads: int = 0):
    """``module`` as a function of one numpy batch, under inference mode, returning float32 numpy arrays.
    A served model runs it right after its previous run swept the caches, where every torch call costs
    several microseconds, so it makes no call it can skip: no .to() on the CPU, and outputs that are
    already float32 on the CPU become arrays as they are."""
    import threading

    import torch

    set_here = threading.local()
    on_cpu, sync = device == "cpu", device.startswith("cuda")
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)

    def fn(x: np.ndarray) -> list[np.ndarray]:
        if threads > 0 and not getattr(set_here, "done", False):
            # torch.set_num_threads sets OpenMP's thread count for the calling thread only. ATen's own ops
            # re-apply it in each new thread, but AOTInductor's compiled code and oneDNN read the calling
            # thread's OpenMP setting as it is (OMP_NUM_THREADS, else one per core). A served model runs on
            # a thread other than the one that loaded it (Triton's instance thread), so each thread sets
            # it on its first call.
            torch.set_num_threads(threads)
            set_here.done = True
        # A request's input is a read-only view of its buffer, taken as it is rather than copied, as
        # Triton's own libtorch backend wraps request buffers; torch warns once about such a view.
        t = torch.from_numpy(x if x.flags.c_contiguous else np.ascontiguousarray(x))
        with torch._C._InferenceMode(True):  # what torch.inference_mode() enters, without its Python layer
            out = module(t if on_cpu else t.to(device))
            if sync:
                torch.cuda.synchronize()
        outs = out if isinstance(out, (list, tuple)) else [out]
        return [o.numpy() if on_cpu and o.dtype == torch.float32 else o.detach().float().cpu().numpy() for o in outs]
    return fn


def script_call(m):
    """A loaded TorchScript module's callable: its forward method itself, which skips nn.Module.__call__'s
    Python, unless the module has forward hooks compiled in, which only the full
    call runs."""
    return m if m._c._get_forward_pre_hooks() or m._c._get_forward_hooks() else m.forward


def aoti_model(path: str):
    """An AOTInductor package, loaded: a function of the input tensor that returns the outputs as a flat list.
    torch's own callable (AOTICompiledModel) parses the package's input and output tree specs from JSON on
    every call, in Python that runs on the caches the model has just swept (README: "What was lowered"). For
    a model that takes one positional tensor, as every model torchship exports does, the loader's flat run is
    the same call without that; any other signature keeps torch's callable."""
    import torch
    from torch.utils import _pytree as pytree

    compiled = torch._inductor.aoti_load_package(path)
    loader = compiled.loader
    if pytree.treespec_loads(loader.get_call_spec()[0]) != pytree.tree_structure(((None,), {})):
        return compiled
    return lambda t: loader.run([t])


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``n`` rows (ValueError if none does)."""
    for b in sorted(buckets):
        if b >= n:
            return b
    raise ValueError(f"batch {n} exceeds the largest bucket {max(buckets)}")


def padded_call(fns: dict[int, Callable[[np.ndarray], list[np.ndarray]]], x: np.ndarray) -> list[np.ndarray]:
    """Run ``x`` through static-batch functions keyed by batch size: pad up to the next bucket
    with copies of the last row, run, and return only the real rows. Batches above the
    largest bucket are split into chunks."""
    largest = max(fns)
    n = x.shape[0]
    if n > largest:
        parts = [padded_call(fns, x[i:i + largest]) for i in range(0, n, largest)]
        return [np.concatenate([p[k] for p in parts]) for k in range(len(parts[0]))]
    b = bucket_for(n, fns)
    if b != n:
        x = np.concatenate([x, np.repeat(x[-1:], b - n, axis=0)])
    return [o[:n] for o in fns[b](x)]


def load(fmt: str, path: str, inputs: Sequence[str], outputs: Sequence[str], device: str = "cpu",
         threads: int = 1, buckets: dict[int, str] | None = None, ort_providers: Sequence[str] | None = None) -> Runner:
    """Load ``path`` (a file, or for aoti_buckets a dict of batch size -> file in ``buckets``)."""
    if fmt == "onnx":
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = max(1, threads)
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        providers = list(ort_providers or (["CUDAExecutionProvider", "CPUExecutionProvider"]
                                           if device.startswith("cuda") else ["CPUExecutionProvider"]))
        sess = ort.InferenceSession(path, so, providers=providers)
        out_names = [o.name for o in sess.get_outputs()]
        in_name = sess.get_inputs()[0].name

        def fn(x: np.ndarray) -> list[np.ndarray]:
            return sess.run(out_names, {in_name: x})
        r = Runner(fn, inputs, outputs)
        r.input_names = [i.name for i in sess.get_inputs()]
        r.output_names = out_names
        r.session = sess
        return r

    torch = _torch_setup(threads)
    if fmt == "torchscript":
        m = torch.jit.load(path, map_location=device).eval()
        r = Runner(torch_fn(script_call(m), device, threads), inputs, outputs)
        r.input_names = [a.name for a in m.forward.schema.arguments[1:]]
        return r
    if fmt == "exported_program":
        ep = torch.export.load(path)
        m = ep.module().to(device)
        r = Runner(torch_fn(m, device, threads), inputs, outputs)
        r.input_names = list(ep.graph_signature.user_inputs)
        return r
    if fmt == "aoti":
        return Runner(torch_fn(aoti_model(path), device, threads), inputs, outputs)
    if fmt == "aoti_buckets":
        if not buckets:
            raise ValueError("aoti_buckets needs the bucket files")
        fns = {int(b): torch_fn(aoti_model(f), device, threads) for b, f in buckets.items()}
        return Runner(lambda x: padded_call(fns, x), inputs, outputs)
    raise ValueError(f"unknown artifact format {fmt!r}; known: {', '.join(FORMATS)}")


def load_artifact(export_dir: str, artifact: dict, inputs: Sequence[str], outputs: Sequence[str], device: str = "cpu",
                  threads: int = 1) -> Runner:
    """Load one manifest artifact entry (its file, and its bucket files if it has them) from ``export_dir``."""
    buckets = {int(b): os.path.join(export_dir, f) for b, f in artifact.get("buckets", {}).items()} or None
    return load(artifact["format"], os.path.join(export_dir, artifact["file"]), inputs, outputs, device=device,
                threads=threads, buckets=buckets)


def default_threads() -> int:
    return int(os.environ.get("TORCHSHIP_THREADS", "1"))
