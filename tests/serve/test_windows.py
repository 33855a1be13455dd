"""Measuring in windows until stable: a source that settles is measured until it does; one that never
settles stops at the cap and is marked unstable."""

import pytest

from torchship.serve.bench.stats import merge_deltas
from torchship.serve.bench.windows import interval, settle, settle_rounds, spread


def source(values):
    """A fake measurement: each window's throughput is the next of ``values``."""
    it = iter(values)
    return lambda: {"rate": next(it)}


def test_spread_is_the_range_over_the_mean():
    assert spread([90.0, 100.0, 110.0]) == pytest.approx(0.2)
    assert spread([5.0]) == 0.0 and spread([0.0, 0.0]) == 0.0


def test_the_confidence_interval_is_students_t_over_the_windows():
    assert interval([90.0, 100.0, 110.0]) == pytest.approx(4.303 * 10 / 3**0.5 / 100, rel=1e-3)
    assert interval([100.0] * 3) == 0.0 and interval([5.0]) == 0.0 and interval([0.0, 0.0]) == 0.0
    assert interval([99.0, 101.0] * 20) == pytest.approx(1.96 * 1.0127 / 40**0.5 / 100, rel=1e-3)  # past the table
    _, how = settle(source([50, 150, 90, 100, 110]), lambda w: [w["rate"]], 0.25, max_windows=10)
    assert how["stable"] and how["interval"] == pytest.approx(interval([90.0, 100.0, 110.0]))  # the last three


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
    from torchship.serve.bench.windows import ticker

    class Bar:
        total, n = 3, 0

        def update(self, k):
            self.n += k

        def refresh(self):
            pass

    bar = Bar()
    settle(source([50, 150, 80, 100, 100, 100]), lambda w: [w["rate"]], 0.10, on_window=ticker(bar, 3, 1))
    assert bar.n == bar.total == 6


def test_rounds_visit_every_unsettled_cell_in_turn():
    calls = []

    def cell(name, values):
        it = iter(values)
        return lambda: calls.append(name) or {"rate": next(it)}

    out = settle_rounds(
        {"a": cell("a", [100] * 9), "b": cell("b", [50, 150, 80, 100, 100, 100])},
        lambda w: [w["rate"]],
        0.10,
        max_windows=9,
    )
    assert calls == ["a", "b"] * 3 + ["b"] * 3  # a settled after round 3; b went on alone
    assert out["a"][1]["windows"] == 3 and out["b"][1]["windows"] == 6 and out["b"][1]["stable"]
    assert out["a"][1]["drift"] == 0 and out["b"][1]["drift"] == pytest.approx(
        70 / (530 / 5)
    )  # b's after its first: 80..150


def test_a_level_that_settles_in_one_of_two_states_is_marked_moved():
    # the last three windows agree, but the level ran at 1300 before settling at 1140: another run may settle at either
    from torchship.serve.bench.report import served_lines

    it = iter(
        [900, 1300, 1290, 1140, 1300, 1145, 1150, 1138]
    )  # the first window, still warming, is not held against it
    windows, how = settle(lambda: {"rate": next(it)}, lambda w: [w["rate"]], 0.10)
    assert how["stable"] and how["windows"] == 8 and how["spread"] < 0.02 and 0.10 < how["drift"] < 0.15
    steady = {**how, "drift": how["spread"]}
    row = {"concurrency": 4, "requests_per_s": 1145, "server": {"avg_batch": 1.0}, "ok": 10, "sent": 20}
    served = {
        "url": "u",
        "embedded": True,
        "models": {"m": {"rows": [{**row, **how}, {**row, **steady, "concurrency": 1}]}},
    }
    report = "\n".join(served_lines(served, {"stability": 10, "window_s": 1}))
    assert "MOVED ±13% over 8 windows" in report and "**1 level(s) MOVED**" in report
    assert report.count("MOVED ±") == 1  # the steady level is not marked


def test_a_machine_that_slows_down_over_the_rounds_is_caught():
    # every window anywhere runs 4 % slower than the one before: three in a row agree (8 %), but a cell's
    # windows three cells apart do not (24 %); cells measured one after another would all look stable
    speed = [1.0]

    def cell(rate):
        def window():
            speed[0] *= 0.96
            return {"rate": rate * speed[0]}

        return window

    out = settle_rounds(
        {k: cell(r) for k, r in zip("abc", (100, 200, 300))}, lambda w: [w["rate"]], 0.10, max_windows=6
    )
    assert not any(how["stable"] for _, how in out.values())
    speed[0] = 1.0
    alone = [settle(cell(r), lambda w: [w["rate"]], 0.10, max_windows=6)[1] for r in (100, 200, 300)]
    assert all(how["stable"] for how in alone)


def test_window_statistics_merge_weighted_by_requests():
    one = {
        "queue_us": 10.0,
        "compute_input_us": 0.0,
        "compute_infer_us": 100.0,
        "compute_output_us": 0.0,
        "server_us": 110.0,
        "requests": 10,
        "executions": 10,
        "avg_batch": 1.0,
        "batch_executions": {"1": 10},
    }
    two = {
        "queue_us": 40.0,
        "compute_input_us": 0.0,
        "compute_infer_us": 400.0,
        "compute_output_us": 0.0,
        "server_us": 440.0,
        "requests": 30,
        "executions": 10,
        "avg_batch": 3.0,
        "batch_executions": {"2": 5, "4": 5},
    }
    m = merge_deltas([one, two])
    assert m["requests"] == 40 and m["executions"] == 20 and m["avg_batch"] == pytest.approx(2.0)
    assert m["compute_infer_us"] == pytest.approx((100 * 10 + 400 * 30) / 40) and m["server_us"] == pytest.approx(357.5)
    assert m["batch_executions"] == {"1": 10, "2": 5, "4": 5}


def test_a_level_is_marked_with_the_machines_own_move_or_as_rough():
    """The probe read between rounds: a level whose windows spread while the probe moved as much is marked
    "the machine moved"; the same spread beside a steady probe is the level's own, marked rough. A level that
    settled while the machine moved is marked too, never silently settled; one slow reading alone is not a move.
    (Planted: a probe that reads what the windows did.)"""
    from torchship.serve.bench.report import spread_text

    def run(rates, speeds):
        it, probe = iter(rates), iter(speeds)
        return settle(lambda: {"rate": next(it)}, lambda w: [w["rate"]], 0.10, max_windows=4, probe=lambda: next(probe))

    swinging = [100, 130, 100, 130]
    _, with_machine = run(swinging, [1.0, 1.0, 1.3, 1.0, 1.3])  # before the first round and after each
    _, steady = run(swinging, [1.0, 1.01, 1.0, 1.01, 1.0])
    assert not with_machine["stable"] and with_machine["machine"] == pytest.approx(0.3 / 1.1, rel=1e-3)
    assert not steady["stable"] and steady["machine"] < 0.02
    row = {"windows": 4}
    moved_text = spread_text({**row, **with_machine, "machine_moved": with_machine["machine"]}, 10)
    assert moved_text.endswith("UNSTABLE after 4 windows: the machine moved ±27%"), moved_text
    rough = spread_text({**row, **steady, "machine_moved": steady["machine"]}, 10)
    assert rough.endswith("UNSTABLE after 4 windows: rough"), rough
    _, settled = run([100, 101, 100], [1.0, 1.0, 0.8, 0.8])
    assert settled["stable"] and spread_text({**settled, "machine_moved": settled["machine"]}, 10).endswith(
        "; the machine moved ±22%"
    )
    _, blip = run([100, 101, 100], [1.0, 1.0, 0.8, 1.0])  # one reading alone (a neighbour's burst): no move
    assert blip["machine"] == 0.0 and spread_text({**blip, "machine_moved": blip["machine"]}, 10) == "±1%, CI ±1%"
    assert spread_text({**settled, "machine_moved": 0.05}, 10) == "±1%, CI ±1%"  # within the stability: no mark


def test_each_cell_reads_the_probe_over_its_own_rounds():
    # a settles in rounds 1-3 while the machine holds still; the machine drops after round 4, while b goes on
    readings = iter([1.0, 1.0, 1.0, 1.0, 0.7, 0.7, 0.7])
    out = settle_rounds(
        {"a": source([100] * 9), "b": source([50, 150, 80, 100, 100, 100])},
        lambda w: [w["rate"]],
        0.10,
        max_windows=9,
        probe=lambda: next(readings),
    )
    # b's readings, each three in a row taken by their median: 1, 1, 1, 0.7, 0.7
    assert out["a"][1]["machine"] == 0.0 and out["b"][1]["machine"] == pytest.approx(0.3 / 0.88, rel=1e-3)
