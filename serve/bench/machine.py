"""The machine's own speed beside the bench: a short fixed probe between the sweeps' rounds. On a shared machine a
neighbour, or a clock that drops, moves every figure at once; the probe says by how much, so that a level whose
windows spread because the machine moved is marked so, and ``--compare`` can tell a slower machine from a slower
model."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .windows import sustained

PROBE_VALUES = 1 << 15  # float32 values sorted by each repetition: about a millisecond of one core
PROBE_WARM_S = 0.02  # the same work first: a core that sat idle through a window reads slow for a while
PROBE_REPS = 5  # the reading is the fastest of them, so that one preemption does not make it
PROBE_WHAT = f"sorting {PROBE_VALUES:,} float32 values on one core, the fastest of {PROBE_REPS} after a warm-up"


@dataclass
class MachineProbe:
    """Readings of the probe (sorts a second), each with the seconds since the first; ``read`` takes one."""

    readings: list[tuple[float, float]] = field(default_factory=list)
    t0: float = 0.0
    values: np.ndarray = field(
        default_factory=lambda: np.random.default_rng(0).random(PROBE_VALUES, dtype=np.float32), repr=False
    )

    def read(self) -> float:
        """One reading now: sorts a second. Runs in the bench's process while no request is in flight."""
        start = time.perf_counter()
        while time.perf_counter() - start < PROBE_WARM_S:
            np.sort(self.values)
        times = []
        for _ in range(PROBE_REPS):
            t0 = time.perf_counter()
            np.sort(self.values)
            times.append(time.perf_counter() - t0)
        speed = 1.0 / min(times)
        if not self.readings:
            self.t0 = time.monotonic()
        self.readings.append((time.monotonic() - self.t0, speed))
        return speed

    def as_json(self) -> dict[str, Any]:
        """results.json's record: what the probe is, its readings, their median and sustained spread
        (windows.sustained)."""
        speeds = [s for _, s in self.readings]
        return {
            "probe": PROBE_WHAT,
            "readings": [[round(t, 2), round(s, 1)] for t, s in self.readings],
            "median": statistics.median(speeds) if speeds else None,
            "spread": sustained(speeds),
        }


def machine_ratio(old: dict[str, Any], new: dict[str, Any]) -> float | None:
    """The machine's speed in ``new`` over its speed in ``old`` (results.json's), by the probe's medians; None
    where either run has none."""
    a, b = (r.get("served", {}).get("machine_probe", {}).get("median") for r in (old, new))
    return b / a if a and b else None
