"""Measuring in windows until the figures hold still, as perf_analyzer does: a level is measured window
after window until the last three agree within the stability threshold, or until a cap, when the level
is reported unstable. A figure's spread is how far apart those last three windows are; its drift, how far apart
all of them are but the first (a level that moved between two states over the sweep can settle in either)."""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Sequence, TypeVar

K = TypeVar("K")

LAST = 3  # windows that must agree
T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23)  # Student's t, two-sided 95 %, 1 to 10 d.o.f.


def spread(values: Sequence[float]) -> float:
    """(max - min) / mean of ``values``, as a fraction; 0 for fewer than two values or a zero mean."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return (max(values) - min(values)) / mean if mean else 0.0


def sustained(readings: Sequence[float]) -> float:
    """The spread of ``readings`` (the machine probe's, in order) that lasted: of the medians of each three in a
    row, so that one reading taken while a neighbour burst on the other core does not count as the machine
    moving; the plain spread of fewer than three."""
    if len(readings) < 3:
        return spread(readings)
    return spread([sorted(readings[i : i + 3])[1] for i in range(len(readings) - 2)])


def interval(values: Sequence[float]) -> float:
    """The half-width of the 95 % confidence interval of ``values``' mean (Student's t, the windows taken as
    independent draws), as a fraction of the mean; 0 for fewer than two values or a zero mean."""
    n = len(values)
    mean = sum(values) / n if n else 0.0
    if n < 2 or not mean:
        return 0.0
    t = T95[n - 2] if n - 1 <= len(T95) else 1.96
    return t * statistics.stdev(values) / math.sqrt(n) / abs(mean)


def ticker(bar, planned: int, per_window: int) -> Callable[[int], None]:
    """settle's on_window for a progress bar (or None): ``per_window`` ticks a window, and the bar's total
    grows by as much for each window beyond the ``planned`` ones."""

    def tick(k: int) -> None:
        if bar is not None:
            if k > planned:
                bar.total += per_window
                bar.refresh()
            bar.update(per_window)

    return tick


def settle(
    window: Callable[[], dict[str, Any]],
    figures: Callable[[dict[str, Any]], Sequence[float]],
    stability: float,
    min_windows: int = LAST,
    max_windows: int = 10,
    on_window: Callable[[int], None] | None = None,
    probe: Callable[[], float] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One source measured window after window: settle_rounds with a single cell."""
    return settle_rounds({0: window}, figures, stability, min_windows, max_windows, on_window, probe)[0]


def settle_rounds(
    cells: dict[K, Callable[[], dict[str, Any]]],
    figures: Callable[[dict[str, Any]], Sequence[float]],
    stability: float,
    min_windows: int = LAST,
    max_windows: int = 10,
    on_window: Callable[[int], None] | None = None,
    probe: Callable[[], float] | None = None,
) -> dict[K, tuple[list[dict[str, Any]], dict[str, Any]]]:
    """Measure every cell in rounds: each round runs one window of every cell not yet settled, in order.
    A cell settles once at least ``min_windows`` ran and its last LAST agree: for each of the figures
    ``figures(w)`` gives a window (a throughput, a mean latency), their spread is within ``stability``
    (a fraction). A cell stops at ``max_windows`` regardless. Because a cell's windows are a round apart,
    its spread also covers the machine drifting over the rounds, not only over a few seconds.
    ``probe``, where given, reads the machine's own speed before the first round and after each: a cell's
    ``machine`` is the sustained spread of the readings from just before its first window to just after its
    last.
    Returns, per cell, its windows and {"windows": n, "spreads": each figure's spread over the last LAST,
    "spread": the largest, "drift": the largest spread over all its windows after the first, "stable": bool,
    "interval": the widest 95 % confidence interval of a figure's mean over the last LAST (a fraction), and
    "machine" with a probe}."""
    windows: dict[K, list[dict[str, Any]]] = {k: [] for k in cells}
    done: dict[K, tuple[list[dict[str, Any]], dict[str, Any]]] = {}
    speeds = [probe()] if probe else []
    began: dict[K, int] = {}  # the reading just before a cell's first window
    while len(done) < len(cells):
        for key, window in cells.items():
            if key in done:
                continue
            ws = windows[key]
            began.setdefault(key, len(speeds) - 1)
            ws.append(window())
            if on_window:
                on_window(len(ws))
            last = [figures(w) for w in ws[-LAST:]]
            spreads = [spread(column) for column in zip(*last)]
            worst = max(spreads, default=0.0)
            stable = len(last) == LAST and worst <= stability
            if (stable and len(ws) >= min_windows) or len(ws) >= max_windows:
                warmed = ws[1:] if len(ws) > LAST else ws  # a level's first window may still be warming
                drift = max((spread(column) for column in zip(*map(figures, warmed))), default=0.0)
                done[key] = (
                    ws,
                    {
                        "windows": len(ws),
                        "spreads": spreads,
                        "spread": worst,
                        "drift": drift,
                        "stable": stable,
                        "interval": max((interval(column) for column in zip(*last)), default=0.0),
                    },
                )
        if probe:
            speeds.append(probe())
            for key, (_, how) in done.items():
                if "machine" not in how:  # settled in this round: the readings around its windows
                    how["machine"] = sustained(speeds[began[key] :])
    return {k: done[k] for k in cells}


def window_figures(w: dict[str, Any]) -> tuple[float, float]:
    """A window's requests/s and mean latency: the figures that must hold still."""
    if "requests_per_s" in w:  # perf_analyzer's
        return w["requests_per_s"], w["mean_s"]
    lat = w["latencies_s"]
    return (len(lat) / w["wall_s"] if w["wall_s"] else 0.0), (sum(lat) / len(lat) if lat else 0.0)
