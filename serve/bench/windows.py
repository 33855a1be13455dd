"""Measuring in windows until the figures hold still, as perf_analyzer does: a level is measured window
after window until the last three agree within the stability threshold, or until a cap, when the level
is reported unstable. A figure's spread is how far apart those last three windows are."""

from __future__ import annotations

from typing import Any, Callable, Sequence

LAST = 3  # windows that must agree


def spread(values: Sequence[float]) -> float:
    """(max - min) / mean of ``values``, as a fraction; 0 for fewer than two values or a zero mean."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return (max(values) - min(values)) / mean if mean else 0.0


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


def settle(window: Callable[[], dict[str, Any]], figures: Callable[[dict[str, Any]], Sequence[float]], stability: float,
           min_windows: int = LAST, max_windows: int = 10, on_window: Callable[[int], None] | None = None,
           ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Call ``window()`` until at least ``min_windows`` ran and the last LAST agree: for each of the
    figures ``figures(w)`` gives a window (a throughput, a mean latency), their spread is within
    ``stability`` (a fraction). Stop at ``max_windows`` regardless. Returns the windows and
    {"windows": n, "spreads": each figure's spread over the last LAST, "spread": the largest, "stable": bool}."""
    windows: list[dict[str, Any]] = []
    while True:
        windows.append(window())
        if on_window:
            on_window(len(windows))
        last = [figures(w) for w in windows[-LAST:]]
        spreads = [spread(column) for column in zip(*last)]
        worst = max(spreads, default=0.0)
        stable = len(last) == LAST and worst <= stability
        if (stable and len(windows) >= min_windows) or len(windows) >= max_windows:
            return windows, {"windows": len(windows), "spreads": spreads, "spread": worst, "stable": stable}
