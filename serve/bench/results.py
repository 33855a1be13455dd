"""results.json as its readers take it: the JSON on disk, typed, and the walks over it that the report, the
summary, the strategy and the run repeat."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, TypedDict


class LevelRow(TypedDict, total=False):
    """One concurrency level of a served sweep."""

    concurrency: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    n: int  # requests its figures rest on
    ok: int
    sent: int
    failed: int
    spread: float  # of its last three windows
    drift: float  # of all its windows after the first
    stable: bool
    interval: float  # the 95 % confidence interval's half-width of its last three windows' mean, a fraction
    machine_moved: float  # the spread of the machine's own speed (machine.MachineProbe) over its windows
    windows: int
    checked: int
    wrong: int
    client_cpu_us: float
    server: dict[str, Any]  # Triton's own statistics over its windows


class ServedModel(TypedDict, total=False):
    """A served model as the bench found and swept it."""

    format: str  # the format it serves
    artifact: str  # the artifact the server runs for it (aoti from aoti_buckets on the embedded server)
    instances: int
    threads: int
    max_batch_size: int
    rows: list[LevelRow]


def served_models(results: dict[str, Any]) -> dict[str, ServedModel]:
    """model -> what the bench recorded of it, for every model of the main sweep."""
    return results.get("served", {}).get("models", {})


def level_rows(results: dict[str, Any]) -> Iterator[tuple[str, LevelRow]]:
    """(model, row) for every level of the main sweep."""
    for model, mm in served_models(results).items():
        for r in mm.get("rows", []):
            yield model, r


@contextlib.contextmanager
def timed(results: dict[str, Any], part: str):
    """Add the seconds the with block takes to results["seconds"][part]: where a bench's time went."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        spent = results.setdefault("seconds", {})
        spent[part] = round(spent.get(part, 0.0) + time.perf_counter() - t0, 2)
