"""Measuring in windows until stable: a source that settles is measured until it does; one that never
settles stops at the cap and is marked unstable."""

import pytest

from serve.bench.windows import settle, spread


def source(values):
    """A fake measurement: each window's throughput is the next of ``values``."""
    it = iter(values)
    return lambda: {"rate": next(it)}


def test_spread_is_the_range_over_the_mean():
    assert spread([90.0, 100.0, 110.0]) == pytest.approx(0.2)
    assert spread([5.0]) == 0.0 and spread([0.0, 0.0]) == 0.0


def test_a_source_that_settles_after_some_windows_is_stable_there():
    # wild for three windows, then within 2 %: stops at the third settled window
    windows, how = settle(source([50, 150, 80, 100, 101, 99, 100, 100]), lambda w: [w["rate"]], 0.10, max_windows=10)
    assert [w["rate"] for w in windows] == [50, 150, 80, 100, 101, 99]
    assert how["stable"] and how["windows"] == 6 and how["spread"] == pytest.approx(0.02)


def test_a_source_that_never_settles_stops_at_the_cap_and_is_marked_unstable():
    windows, how = settle(source([100, 130] * 10), lambda w: [w["rate"]], 0.10, max_windows=7)
    assert len(windows) == 7 and not how["stable"] and how["spread"] > 0.10


def test_every_figure_must_hold_still():
    # throughput steady, latency not: unstable
    it = iter([(100, 1.0), (100, 2.0), (100, 1.0), (100, 2.0)])
    windows, how = settle(lambda: next(it), lambda w: list(w), 0.10, max_windows=4)
    assert not how["stable"] and len(windows) == 4


def test_the_minimum_holds_even_when_the_first_windows_agree():
    windows, how = settle(source([100] * 9), lambda w: [w["rate"]], 0.10, min_windows=5, max_windows=9)
    assert len(windows) == 5 and how["stable"]


def test_a_window_beyond_the_plan_grows_the_progress_total():
    from serve.bench.windows import ticker

    class Bar:
        total, n = 3, 0

        def update(self, k):
            self.n += k

        def refresh(self):
            pass

    bar = Bar()
    settle(source([50, 150, 80, 100, 100, 100]), lambda w: [w["rate"]], 0.10, on_window=ticker(bar, 3, 1))
    assert bar.n == bar.total == 6
