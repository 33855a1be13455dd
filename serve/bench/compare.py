"""``bench --compare``: new/old ratios of every figure two results files share, and the regressions."""

from __future__ import annotations

from pathlib import Path

from torchship.errors import BenchError
from torchship.io import read_json

from .machine import machine_ratio

RESULTS_FORMAT = "torchship.bench/1"  # the "format" tag of results.json


FALLBACK = 1.2  # the ratio that counts as a change where neither run measured a figure's spread


def flatten(results: dict) -> dict[str, tuple[float, float | None]]:
    """Comparable figures and the spread each was measured with (None in results that predate windows):
    latency keys end in _ms (lower is better), throughput in _per_s."""
    flat: dict[str, tuple[float, float | None]] = {}
    for r in results.get("in_process", {}).get("rows", []):
        for k in ("p50_ms", "p99_ms", "images_per_s"):
            if k in r:
                flat[f"in_process/{r['variant']}/b{r['batch']}/{k}"] = (r[k], r.get("spread"))
    served = results.get("served", {})
    for section in ("models", "batching_off"):
        for model, m in served.get(section, {}).items():
            for r in m.get("rows", []):
                for k in ("p50_ms", "p99_ms", "requests_per_s"):
                    if k in r:
                        flat[f"served/{section}/{model}/c{r['concurrency']}/{k}"] = (r[k], r.get("spread"))
    return flat


def compare(old: dict, new: dict, threshold: float | None = None) -> tuple[list[dict], list[dict]]:
    """Ratios new/old for every shared figure. A change is noise while it stays within the larger of the
    two runs' measured spreads for that figure; beyond it, a worse figure is a regression, unless the machine's
    own speed (machine.machine_ratio: the probe both benches read between their rounds) moved enough to explain
    it: the figure scaled by the machine's ratio is within the band. Such a row is marked ``explained``, with the
    ratio as ``machine``. ``threshold`` (a ratio, e.g. 1.2) replaces the spreads; figures measured without a
    spread use FALLBACK."""
    a, b = flatten(old), flatten(new)
    machine = machine_ratio(old, new)
    rows, regressions = [], []
    for key in sorted(set(a) & set(b)):
        (va, sa), (vb, sb) = a[key], b[key]
        if not va:
            continue
        spreads = [x for x in (sa, sb) if x is not None]
        band = threshold if threshold is not None else (1 + max(spreads) if spreads else FALLBACK)
        ratio = vb / va
        latency = key.endswith("_ms")
        worse = ratio > band if latency else ratio < 1 / band
        row = {"key": key, "old": va, "new": vb, "ratio": ratio, "band": band, "regression": worse}
        if worse and machine and key.startswith("served/"):
            on_same = ratio * machine if latency else ratio / machine  # as if the machine had not moved
            if (on_same <= band) if latency else (on_same >= 1 / band):
                row.update(regression=False, explained=True, machine=machine)
        rows.append(row)
        if row["regression"]:
            regressions.append(row)
    return rows, regressions


def comparable(old: dict, new: dict) -> list[str]:
    """BenchError if the two results measured different models (every ratio would read as a regression or
    a gain); otherwise notes on what else differs between them (the machine), for the reader."""
    a, b = ([r.get("export", {}).get(k) for k in ("name", "input_shape", "dtype")] for r in (old, new))
    if a != b:
        raise BenchError(
            f"--compare: the results are of different models ({' '.join(map(str, a))} against "
            f"{' '.join(map(str, b))}); compare two runs of one export"
        )
    notes = []
    for key in ("cpu", "gpu", "cores"):
        a, b = old.get("machine", {}).get(key), new.get("machine", {}).get(key)
        if a != b:
            notes.append(f"note: measured on different machines ({key}: {a} against {b})")
    return notes


def load_results(path: str | Path) -> dict:
    """A results.json that run_bench wrote; BenchError naming the file if it is not one."""
    return read_json(
        path,
        BenchError,
        RESULTS_FORMAT,
        missing=f"{path}: no such results file",
        fix="; give the results.json that torchship bench wrote",
    )
