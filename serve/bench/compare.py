"""``bench --compare``: new/old ratios of every figure two results files share, and the regressions."""

from __future__ import annotations

from pathlib import Path

from torchship.errors import BenchError
from torchship.io import read_json

RESULTS_FORMAT = "torchship.bench/1"  # the "format" tag of results.json


def flatten(results: dict) -> dict[str, float]:
    """Comparable figures: latency keys end in _ms (lower is better), throughput in _per_s."""
    flat: dict[str, float] = {}
    for r in results.get("in_process", {}).get("rows", []):
        for k in ("p50_ms", "p99_ms", "images_per_s"):
            if k in r:
                flat[f"in_process/{r['variant']}/b{r['batch']}/{k}"] = r[k]
    served = results.get("served", {})
    for section in ("models", "batching_off"):
        for model, m in served.get(section, {}).items():
            for r in m.get("rows", []):
                for k in ("p50_ms", "p99_ms", "requests_per_s"):
                    if k in r:
                        flat[f"served/{section}/{model}/c{r['concurrency']}/{k}"] = r[k]
    return flat


def compare(old: dict, new: dict, threshold: float = 1.2) -> tuple[list[dict], list[dict]]:
    """Ratios new/old for every shared figure; a regression is latency x threshold or throughput / threshold."""
    a, b = flatten(old), flatten(new)
    rows, regressions = [], []
    for key in sorted(set(a) & set(b)):
        if not a[key]:
            continue
        ratio = b[key] / a[key]
        worse = ratio > threshold if key.endswith("_ms") else ratio < 1 / threshold
        row = {"key": key, "old": a[key], "new": b[key], "ratio": ratio, "regression": worse}
        rows.append(row)
        if worse:
            regressions.append(row)
    return rows, regressions


def comparable(old: dict, new: dict) -> list[str]:
    """BenchError if the two results measured different models (every ratio would read as a regression or
    a gain); otherwise notes on what else differs between them (the machine), for the reader."""
    a, b = ([r.get("export", {}).get(k) for k in ("name", "input_shape", "dtype")] for r in (old, new))
    if a != b:
        raise BenchError(f"--compare: the results are of different models ({' '.join(map(str, a))} against "
                         f"{' '.join(map(str, b))}); compare two runs of one export")
    notes = []
    for key in ("cpu", "gpu", "cores"):
        a, b = old.get("machine", {}).get(key), new.get("machine", {}).get(key)
        if a != b:
            notes.append(f"note: measured on different machines ({key}: {a} against {b})")
    return notes


def load_results(path: str | Path) -> dict:
    """A results.json that run_bench wrote; BenchError naming the file if it is not one."""
    return read_json(path, BenchError, RESULTS_FORMAT, missing=f"{path}: no such results file",
                     fix="; give the results.json that torchship bench wrote")
