"""Latency statistics, Triton's server-side breakdown, and the machine and limits figures are read against."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
import time
import warnings
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable

import numpy as np

from torchship.device import cpu_name, torch_threads
from torchship.io import git_revision


def summarize(lat_s: list[float] | np.ndarray) -> dict[str, float]:
    """Latency percentiles, mean and standard deviation in milliseconds."""
    a = np.asarray(lat_s, dtype=np.float64) * 1e3
    if a.size == 0:
        return {"n": 0}
    p = np.percentile(a, [50, 90, 95, 99])
    return {
        "n": int(a.size),
        "p50_ms": p[0],
        "p90_ms": p[1],
        "p95_ms": p[2],
        "p99_ms": p[3],
        "mean_ms": float(a.mean()),
        "std_ms": float(a.std()),
        "min_ms": float(a.min()),
        "max_ms": float(a.max()),
    }


# the report's software versions: module -> the distributions that install it, the first one installed wins
VERSIONED = {
    "torch": ("torch",),
    "torchvision": ("torchvision",),
    "onnx": ("onnx",),
    "onnxruntime": ("onnxruntime-gpu", "onnxruntime"),
    "tritonclient": ("tritonclient",),
    "numpy": ("numpy",),
    "grpc": ("grpcio",),
}


def _installed(dist: str) -> str | None:

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """The machine, its accelerator and the software versions, for the report's first line."""
    import torch

    info: dict[str, Any] = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "git_revision": git_revision(),
        "versions": {},
    }
    for (
        mod,
        dists,
    ) in VERSIONED.items():  # one not imported yet is read from its metadata: importing torchvision takes seconds
        found = getattr(sys.modules.get(mod), "__version__", None) or next(
            (v for v in map(_installed, dists) if v), None
        )
        if found:
            info["versions"][mod] = found
    info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if info["gpu"]:
        try:
            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    return info


def device_peak(device: str, threads: int, seconds: float = 0.2) -> dict[str, Any]:
    """The roofline each precision's results are read against: per precision, the fastest of the matrix-multiply
    kernels at hand on this device (``fp32_flops``, ``bf16_flops``, and on a CPU ``int8_flops`` in ops/s), and
    which kernel that was (``fp32_kernel``...). On a CPU the candidates are torch's (oneDNN/MKL) and ONNX Runtime's
    (MLAS), so that neither runtime's formats read against the other's slower kernel, at 1024 and, for more than one
    thread, 2048 (one thread reached its peak at 1024: 162 against 165 GFLOP/s fp32 at 2048, on a Xeon with AMX).
    Measured once per process for each device and thread count: a second bench in the same process reads the
    first one's figures."""
    return dict(_device_peak(device, threads, seconds))


@functools.lru_cache(maxsize=None)
def _device_peak(device: str, threads: int, seconds: float) -> dict[str, Any]:
    import torch

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    candidates: dict[str, list[tuple[str, Callable[[], Any] | None, int]]] = {"fp32": [], "bf16": [], "int8": []}
    with torch_threads(threads):
        sizes = (8192,) if cuda else (1024, 2048) if threads > 1 else (1024,)
        for n in sizes:
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                a, b = (torch.rand(n, n, device=device, dtype=dtype) for _ in range(2))
                candidates[name].append((f"torch matmul {n}^3", lambda a=a, b=b: a @ b, n))
        if not cuda:
            for n in sizes:
                candidates["fp32"].append((f"onnxruntime MatMul {n}^3", _ort_matmul(n, threads, False), n))
            candidates["int8"].append(("oneDNN quantized linear u8 x s8 2048^3", _int8_linear(2048), 2048))
            candidates["int8"].append(
                ("onnxruntime MatMulInteger u8 x s8 2048^3", _ort_matmul(2048, threads, True), 2048)
            )
        out: dict[str, Any] = {}
        for name, kernels in candidates.items():
            measured = [(_best(fn, 2 * n**3, seconds, sync), label) for label, fn, n in kernels if fn is not None]
            if measured:
                out[f"{name}_flops"], out[f"{name}_kernel"] = max(measured)
    return out


def _ort_matmul(n: int, threads: int, int8: bool) -> Callable[[], Any] | None:
    """An n x n x n matrix product on ONNX Runtime's CPU kernels (MLAS): float32 MatMul, or MatMulInteger over u8
    activations and s8 weights (the kernel its INT8 models' convolutions and matmuls reach). None without
    onnxruntime."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return None
    rng = np.random.default_rng(0)
    if int8:
        x, w, op, a_type, w_type, c_type = (
            rng.integers(0, 255, (n, n), dtype=np.uint8),
            rng.integers(-127, 127, (n, n), dtype=np.int8),
            "MatMulInteger",
            TensorProto.UINT8,
            TensorProto.INT8,
            TensorProto.INT32,
        )
    else:
        x, w, op, a_type, w_type, c_type = (
            rng.random((n, n), dtype=np.float32),
            rng.random((n, n), dtype=np.float32),
            "MatMul",
            TensorProto.FLOAT,
            TensorProto.FLOAT,
            TensorProto.FLOAT,
        )
    graph = helper.make_graph(
        [helper.make_node(op, ["A", "B"], ["C"])],
        "probe",
        [helper.make_tensor_value_info("A", a_type, [n, n])],
        [helper.make_tensor_value_info("C", c_type, [n, n])],
        [helper.make_tensor("B", w_type, [n, n], w.tobytes(), raw=True)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = max(1, threads), 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return lambda: sess.run(None, {"A": x})


def _best(fn, ops: float, seconds: float, sync=lambda: None) -> float:
    """Operations per second of ``fn``: the best of five windows (the peak, not the average under noise)."""
    for _ in range(3):
        fn()
    sync()
    best = 0.0
    for _ in range(5):
        t0, k = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds / 5:
            fn()
            sync()  # each product waited for: a GPU queue holds many seconds of unstarted products
            k += 1
        best = max(best, ops * k / (time.perf_counter() - t0))
    return best


def _int8_linear(n: int):
    """An n x n x n quantized linear (u8 activations, s8 weights) on oneDNN, the library aoti_int8's kernels call
    (it ran faster here than ONNX Runtime's MatMulInteger, so it is the higher roof). None where this torch has no
    oneDNN quantized engine, or no longer has torch's quantized tensors (deprecated in 2.14; the bench's tests
    say so if they go)."""
    import torch

    if "onednn" not in torch.backends.quantized.supported_engines:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.backends.quantized.engine = "onednn"
            w = torch.ops.quantized.linear_prepack(
                torch.quantize_per_tensor(torch.randn(n, n), 0.02, 0, torch.qint8), None
            )
            x = torch.quantize_per_tensor(torch.rand(n, n), 0.01, 0, torch.quint8)
    except (RuntimeError, AttributeError):
        return None
    return lambda: torch.ops.quantized.linear(x, w, 0.1, 0)


def stats_of(client, model: str) -> dict[str, Any]:
    s = client.statistics(model)["model_stats"]
    s = [m for m in s if m.get("name") == model] or s
    return s[0] if s else {}


def served_count(stats: dict) -> int:
    return int(stats.get("inference_stats", {}).get("success", {}).get("count", 0) or 0)


def settled_stats(client, model: str, count: int, timeout_s: float = 2.0) -> dict[str, Any]:
    """Statistics once ``count`` successful requests are on the books, in the batch statistics too (where the
    model keeps them; an ensemble does not). Triton records a request when it releases it, which can be just
    after the client has its response, and its batch's execution a moment apart from that."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = stats_of(client, model)
        done = served_count(s)  # failed requests never count
        if done >= count and (not s.get("batch_stats") or batched_count(s) >= done) or time.monotonic() > deadline:
            return s
        time.sleep(0.005)


def batched_count(stats: dict[str, Any]) -> int:
    """The requests a model's batch statistics hold: each execution's batch size, added up."""
    return sum(
        int(b["batch_size"]) * int(b.get("compute_infer", {}).get("count", 0) or 0)
        for b in stats.get("batch_stats", [])
    )


def stats_delta(before: dict, after: dict) -> dict[str, float]:
    """Triton's server-side time per request (µs) between two statistics snapshots: queue, compute
    input, compute infer, compute output, the average batch the dynamic batcher formed, and how many
    executions it ran at each batch size."""

    def get(d, *path):
        for p in path:
            d = d.get(p, {}) if isinstance(d, dict) else {}
        return float(d) if not isinstance(d, dict) else 0.0

    out: dict[str, float] = {}
    ok = get(after, "inference_stats", "success", "count") - get(before, "inference_stats", "success", "count")
    for part in ("queue", "compute_input", "compute_infer", "compute_output"):
        ns = get(after, "inference_stats", part, "ns") - get(before, "inference_stats", part, "ns")
        out[f"{part}_us"] = ns / 1e3 / ok if ok else 0.0
    inf = get(after, "inference_count") - get(before, "inference_count")
    exe = get(after, "execution_count") - get(before, "execution_count")
    out["requests"] = ok
    out["executions"] = exe
    out["avg_batch"] = inf / exe if exe else 0.0

    def executions(d):  # batch size -> executions at that size
        return {int(b["batch_size"]): int(get(b, "compute_infer", "count")) for b in d.get("batch_stats", [])}

    was = executions(before)
    out["batch_executions"] = {
        str(k): n - was.get(k, 0) for k, n in sorted(executions(after).items()) if n > was.get(k, 0)
    }
    out["server_us"] = sum(out[f"{p}_us"] for p in ("queue", "compute_input", "compute_infer", "compute_output"))

    def busy(d):  # the model's compute, each execution counted once (a request's figure holds its batch-mates')
        return sum(get(b, "compute_infer", "ns") for b in d.get("batch_stats", []))

    out["busy_us"] = (busy(after) - busy(before)) / 1e3 / ok if ok else 0.0
    return out


def merge_deltas(deltas: list[dict]) -> dict[str, Any]:
    """stats_delta over several windows as one: per-request times weighted by each window's requests, the
    average batch over all executions, executions per batch size added up."""
    ok = sum(d["requests"] for d in deltas)
    exe = sum(d["executions"] for d in deltas)
    out: dict[str, Any] = {
        f"{p}_us": sum(d[f"{p}_us"] * d["requests"] for d in deltas) / ok if ok else 0.0
        for p in ("queue", "compute_input", "compute_infer", "compute_output", "server")
    }
    counts: dict[str, int] = {}
    for d in deltas:
        for b, n in d["batch_executions"].items():
            counts[b] = counts.get(b, 0) + n
    out.update(
        requests=ok,
        executions=exe,
        avg_batch=sum(d["avg_batch"] * d["executions"] for d in deltas) / exe if exe else 0.0,
        batch_executions={b: counts[b] for b in sorted(counts, key=int)},
    )
    return out
