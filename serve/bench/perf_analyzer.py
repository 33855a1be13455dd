"""Triton's perf_analyzer as the served load generator (torchship's Python client is then the cross-check).

The binary ships inside the ``tritonclient==2.51.0`` manylinux1 wheel (the PyPI package
``perf-analyzer`` is a placeholder). ``python -m torchship.serve.bench.perf_analyzer install`` fetches that wheel
with pip, unpacks the binary into a cache folder and links the two libraries it needs from the
nvidia-pytriton wheel under their plain names.
"""

from __future__ import annotations

import csv
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torchship" / "perf_analyzer"
NEEDED = {"libb64.so.0d": "libb64-", "libcudart.so.12": "libcudart-"}


def locate(explicit: str | None = None) -> str | None:
    for cand in (
        explicit,
        os.environ.get("TORCHSHIP_PERF_ANALYZER"),
        str(CACHE / "bin" / "perf_analyzer"),
        shutil.which("perf_analyzer"),
    ):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def install() -> Path:
    """Fetch perf_analyzer into the cache folder; returns the binary's path."""
    from ..embedded.wheel import triton_home

    (CACHE / "bin").mkdir(parents=True, exist_ok=True)
    (CACHE / "lib").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--platform",
                "manylinux1_x86_64",
                "tritonclient==2.51.0",
                "-d",
                tmp,
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("tritonclient-2.51.0-*.whl"))
        with (
            zipfile.ZipFile(wheel) as z,
            z.open("tritonclient-2.51.0.data/data/bin/perf_analyzer") as src,
            open(CACHE / "bin" / "perf_analyzer", "wb") as dst,
        ):
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


def window(binary: str, url: str, model: str, concurrency: int, data: Path, window_s: float) -> dict[str, Any]:
    """One measurement window of perf_analyzer at ``concurrency``: one run of three back-to-back windows of a
    third of ``window_s`` each (its shortest legal run), with stabilization off, so the bench's own rule
    decides when a level holds still. Returns its throughput, mean latency and percentiles over those
    three, its own CPU time (the load generator's cost) and wall time; "errors" holds its message if it
    failed."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(CACHE / "lib"), env.get("LD_LIBRARY_PATH", "")) if p)
    report = data.with_name(f"{model}-c{concurrency}.csv")
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    for stretch in (1, 3):  # a window too short for a slow model can hold no completed request: once more, longer
        interval = max(100, int(stretch * window_s * 1000 / 3))
        cmd = [
            binary,
            "-m",
            model,
            "-u",
            url,
            "-i",
            "grpc",
            "-b",
            "1",
            f"--concurrency-range={concurrency}:{concurrency}",
            "--measurement-mode=time_windows",
            f"--measurement-interval={interval}",
            "--stability-percentage=1000",
            "--max-trials=3",
            "-f",
            str(report),
            f"--input-data={data}",
            "--percentile=99",
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120 + 10 * stretch * window_s)
        if p.returncode == 0 or not too_short(p.stderr + p.stdout):
            break
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if p.returncode != 0 or not report.exists():
        return {
            "errors": [f"perf_analyzer exited {p.returncode}: {(p.stderr or p.stdout).strip()[-300:]}"],
            "requests_per_s": 0.0,
            "mean_s": 0.0,
            "cpu_s": cpu,
            "wall_s": wall,
        }
    row = next(csv.DictReader(report.open()))
    report.unlink()
    parts = (
        "Client Send",
        "Network+Server Send/Recv",
        "Server Queue",
        "Server Compute Input",
        "Server Compute Infer",
        "Server Compute Output",
        "Client Recv",
    )
    return {
        "errors": [],
        "requests_per_s": float(row["Inferences/Second"]),
        "mean_s": sum(float(row[k]) for k in parts) / 1e6,
        **{f"p{q}_ms": float(row[f"p{q} latency"]) / 1e3 for q in (50, 90, 95, 99)},
        "cpu_s": cpu,
        "wall_s": wall,
    }


TOO_SHORT = ("stable measurement", "larger time window")  # what perf_analyzer says of a window too short to measure


def too_short(message: str) -> bool:
    """Whether perf_analyzer failed because its window was too short for the load (on a busy machine: no request
    completed in it, or its windows disagreed past any bound), not because a request failed."""
    return any(t in message for t in TOO_SHORT)


def input_data_json(pool: dict[str, np.ndarray], count: int = 16) -> str:
    """The bench's samples of every input (``pool``, by input name) in perf_analyzer's JSON input format
    (random bytes would include NaNs, and integers out of range)."""
    n = min(count, len(next(iter(pool.values()))))

    def content(x):
        return x.ravel().round(6).tolist() if x.dtype.kind == "f" else x.ravel().tolist()

    rows = [{k: {"content": content(v[i]), "shape": list(v[i].shape)} for k, v in pool.items()} for i in range(n)]
    return json.dumps({"data": rows})


def wired_data(data: Path, wire: dict[str, str], model: str) -> Path:
    """``data`` (input_data_json) with its inputs renamed by ``wire`` (manifest name: served name), written
    once beside it for ``model``; ``data`` itself where nothing is renamed."""
    if not wire:
        return data
    out = data.with_name(f"{model}-inputs.json")
    if not out.exists():
        rows = json.loads(data.read_text())["data"]
        out.write_text(json.dumps({"data": [{wire.get(k, k): v for k, v in r.items()} for r in rows]}))
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["install"]:
        print(install())
    else:
        print(locate() or "perf_analyzer not installed; run: python -m torchship.serve.bench.perf_analyzer install")


def python_window(res: dict[str, Any], why: str) -> dict[str, Any]:
    """A Python client's window in perf_analyzer's figures, for a window perf_analyzer could not measure (on a
    loaded machine its three short windows can disagree past any stability bound)."""
    lat = sorted(res["latencies_s"])
    q = {p: 1e3 * lat[min(len(lat) - 1, int(p / 100 * len(lat)))] if lat else 0.0 for p in (50, 90, 95, 99)}
    return {
        "errors": res["errors"],
        "requests_per_s": len(lat) / res["wall_s"] if res["wall_s"] else 0.0,
        "mean_s": sum(lat) / len(lat) if lat else 0.0,
        **{f"p{p}_ms": v for p, v in q.items()},
        "cpu_s": res["cpu_s"],
        "wall_s": res["wall_s"],
        "completed": res["completed"],
        "python_instead": why[:200],
    }


def window_row(last: list[dict[str, Any]], delta: dict, concurrency: int, batch: int) -> dict[str, Any]:
    """A level's row from perf_analyzer windows: throughput, mean latency and each percentile averaged over
    the windows (perf_analyzer reports percentiles per run, not the latencies behind them)."""

    def mean(key: str) -> float:
        return sum(w.get(key, 0.0) for w in last) / len(last)

    rps = mean("requests_per_s")
    row = {
        "concurrency": concurrency,
        "ok": sum(w["completed"] for w in last),
        "requests_per_s": rps,
        "images_per_s": batch * rps,
        "mean_ms": 1e3 * mean("mean_s"),
        "n": sum(w["completed"] for w in last),
        **{f"p{q}_ms": mean(f"p{q}_ms") for q in (50, 90, 95, 99)},
        "server": delta,
    }
    row["client_side_us"] = row["mean_ms"] * 1e3 - delta.get("server_us", 0.0)
    return row
