"""Triton's perf_analyzer, for cross-checking torchship's own load generator.

The binary ships inside the ``tritonclient==2.51.0`` manylinux1 wheel (the PyPI package
``perf-analyzer`` is a placeholder). ``python -m serve.bench.perf_analyzer install`` fetches that wheel
with pip, unpacks the binary into a cache folder and links the two libraries it needs from the
nvidia-pytriton wheel under their plain names.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np


CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torchship" / "perf_analyzer"
NEEDED = {"libb64.so.0d": "libb64-", "libcudart.so.12": "libcudart-"}


def locate(explicit: str | None = None) -> str | None:
    for cand in (explicit, os.environ.get("TORCHSHIP_PERF_ANALYZER"), str(CACHE / "bin" / "perf_analyzer"),
                 shutil.which("perf_analyzer")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def install() -> Path:
    """Fetch perf_analyzer into the cache folder; returns the binary's path."""
    from ..embedded.wheel import triton_home

    (CACHE / "bin").mkdir(parents=True, exist_ok=True)
    (CACHE / "lib").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--platform", "manylinux1_x86_64", "tritonclient==2.51.0", "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("tritonclient-2.51.0-*.whl"))
        with zipfile.ZipFile(wheel) as z, z.open("tritonclient-2.51.0.data/data/bin/perf_analyzer") as src, \
                open(CACHE / "bin" / "perf_analyzer", "wb") as dst:
            shutil.copyfileobj(src, dst)
    os.chmod(CACHE / "bin" / "perf_analyzer", 0o755)
    _, libs = triton_home()
    for plain, prefix in NEEDED.items():
        target = next(libs.glob(prefix + "*"))
        link = CACHE / "lib" / plain
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return CACHE / "bin" / "perf_analyzer"


def run(binary: str, url: str, model: str, levels: list[int], pool: dict[str, np.ndarray], window_s: float = 1.0,
        stability: float = 10.0, max_windows: int = 10) -> list[dict]:
    """perf_analyzer at each concurrency level, under the bench's own rule: time windows of ``window_s``
    until three agree within ``stability`` percent, at most ``max_windows``. A level that never settles
    is measured again with a 50 % threshold and marked unstable. Returns per level: throughput and
    latency percentiles in ms, server breakdown in µs."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(CACHE / "lib"), env.get("LD_LIBRARY_PATH", "")) if p)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "input.json"
        data.write_text(input_data_json(pool))
        for c in levels:
            report = Path(tmp) / f"c{c}.csv"
            for threshold in (stability, 50.0):
                cmd = [binary, "-m", model, "-u", url, "-i", "grpc", "-b", "1", f"--concurrency-range={c}:{c}",
                       "--measurement-mode=time_windows", f"--measurement-interval={max(100, int(window_s * 1000))}",
                       "-f", str(report), f"--input-data={data}", f"--stability-percentage={threshold:g}",
                       f"--max-trials={max_windows}", "--percentile=99"]
                p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
                if p.returncode == 0 and report.exists():
                    break
                if "stable" not in (p.stderr + p.stdout).lower() or threshold == 50.0:
                    raise RuntimeError(f"perf_analyzer exited {p.returncode}: {(p.stderr or p.stdout).strip()[-300:]}")
            row = next(csv.DictReader(report.open()))
            rows.append({"concurrency": c, "stable": threshold == stability, "requests_per_s": float(row["Inferences/Second"]),
                         "p50_ms": float(row["p50 latency"]) / 1e3, "p90_ms": float(row["p90 latency"]) / 1e3,
                         "p95_ms": float(row["p95 latency"]) / 1e3, "p99_ms": float(row["p99 latency"]) / 1e3,
                         "server_queue_us": float(row["Server Queue"]), "server_infer_us": float(row["Server Compute Infer"])})
    return rows


def input_data_json(pool: dict[str, np.ndarray], count: int = 16) -> str:
    """The bench's samples of every input (``pool``, by input name) in perf_analyzer's JSON input format
    (random bytes would include NaNs, and integers out of range)."""
    import json

    n = min(count, len(next(iter(pool.values()))))

    def content(x):
        return x.ravel().round(6).tolist() if x.dtype.kind == "f" else x.ravel().tolist()
    rows = [{k: {"content": content(v[i]), "shape": list(v[i].shape)} for k, v in pool.items()} for i in range(n)]
    return json.dumps({"data": rows})


def cross_check(cfg, url: str, models: list[str], pool: dict[str, np.ndarray]) -> dict[str, Any]:
    """perf_analyzer at concurrency 1 and the highest level, on the ONNX model where one is served (else the
    first): {model: {"levels": [...], "dynamic_batching": bool}} or {"skipped": why}."""
    if not cfg.cross_check:
        return {"skipped": "disabled (--no-cross-check)"}
    binary = locate(cfg.perf_analyzer)
    if not binary:
        return {"skipped": "perf_analyzer not found (python -m serve.bench.perf_analyzer install fetches it)"}
    from ..client import TritonClient

    model = sorted(models, key=lambda m: not m.endswith("_onnx"))[0]
    try:
        batching = "dynamic_batching" in TritonClient(url).config(model)  # the config perf_analyzer meets
        levels = run(binary, url, model, [1, max(cfg.concurrency)], pool, cfg.window_s, cfg.stability, cfg.max_windows)
        return {model: {"levels": levels, "dynamic_batching": batching}}
    except Exception as e:
        return {model: {"error": f"{type(e).__name__}: {e}"}}


if __name__ == "__main__":
    if sys.argv[1:] == ["install"]:
        print(install())
    else:
        print(locate() or "perf_analyzer not installed; run: python -m serve.bench.perf_analyzer install")
