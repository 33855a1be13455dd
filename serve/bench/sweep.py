"""One sweep of served models over concurrency levels, measured in windows until each level settles: who sends the
requests (the load generator), how a window is measured and checked, and the level's row built from its windows."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from torchship.procfs import cpu_used, tree_cpu

from .checks import ResponseCheck, keeper, tally
from .config import BenchConfig
from .load import closed_loop, level_row, paced
from .machine import MachineProbe
from .perf_analyzer import python_window, window_row
from .results import LevelRow
from .stats import merge_deltas, served_count, settled_stats, stats_delta, stats_of
from .windows import LAST, settle_rounds, ticker, window_figures

PA_MAX_REQUEST_BYTES = 64 << 10  # auto sends larger requests with the Python client (load_generators)
PACED_CHECKS = 12  # known requests spread over each perf_analyzer window, whose answers are checked

Feeds = dict[str, np.ndarray]


@dataclass(frozen=True)
class LoadGenerator:
    """Who sends a sweep's requests: torchship's Python client, or perf_analyzer (``binary``, fed the bench's
    samples from ``data``)."""

    name: str  # "python" or "perf_analyzer"
    binary: str = ""
    data: Optional[Path] = None


PYTHON = LoadGenerator("python")


def load_generators(
    cfg: BenchConfig, pool: dict[str, np.ndarray], data: Path
) -> tuple[LoadGenerator, Optional[LoadGenerator], str]:
    """The sweeps' load generator, the cross-check's (None: none), and why. --load-generator auto: the one that
    costs the server's cores least. perf_analyzer where it is installed, for small requests (a sixth to a half
    of the Python client's CPU a request on resnet18 at 32x32); for requests above PA_MAX_REQUEST_BYTES the
    Python client (perf_analyzer spent 4,462 us a request on resnet50's 588 KiB images, the Python client 1,123).
    torchship's Python client where perf_analyzer is not installed."""
    from .perf_analyzer import input_data_json, locate

    binary = locate(cfg.perf_analyzer)
    if not binary:
        return (
            PYTHON,
            None,
            "perf_analyzer not found (python -m torchship.serve.bench.perf_analyzer install fetches it)",
        )
    data.write_text(input_data_json(pool))
    pa = LoadGenerator("perf_analyzer", binary, data)
    size = sum(v[0].nbytes for v in pool.values())
    big = cfg.load_generator == "auto" and size > PA_MAX_REQUEST_BYTES
    first, second = (PYTHON, pa) if cfg.load_generator == "python" or big else (pa, PYTHON)
    why = f"--load-generator {cfg.load_generator}" + (
        ", perf_analyzer installed" if cfg.load_generator == "auto" else ""
    )
    if big:
        why += (
            f"; requests of {size / 1024:.0f} KiB, above {PA_MAX_REQUEST_BYTES // 1024} KiB, where perf_analyzer "
            "costs more CPU a request than the Python client"
        )
    return first, (second if cfg.cross_check else None), why if cfg.cross_check else why + "; cross-check off"


@dataclass
class Cell:
    """One (model, level) of a sweep as it is measured: its windows' results and server statistics, and what its
    responses were judged to be."""

    model: str
    concurrency: int
    first: bool = True  # before the first window: a longer warm-up
    rate: float = 0.0  # requests/s in that warm-up: perf_analyzer's windows must hold the per-window requests
    deltas: list[dict[str, Any]] = field(default_factory=list)
    judged: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sweeper:
    """What every sweep of one bench shares: the server at ``url`` (``server_pid``: the embedded one's process,
    whose CPU time each window reads), the client asking it for statistics, the settings, the load generator and
    the progress bar, and the probe of the machine's own speed."""

    url: str
    client: Any  # a TritonClient
    cfg: BenchConfig
    gen: LoadGenerator = PYTHON
    bar: Any = None
    server_pid: Optional[int] = None
    probe: Optional[MachineProbe] = None  # the machine's own speed, read between rounds

    def run(
        self,
        models: list[str],
        feeds: list[Feeds],
        levels: tuple[int, ...],
        checks: dict[str, ResponseCheck] | None = None,
        gen: LoadGenerator | None = None,
    ) -> dict[str, list[LevelRow]]:
        """Every model at every level: measure over the grid of ``models`` x ``levels``."""
        return self.measure([(m, c) for m in models for c in levels], feeds, checks, gen)

    def measure(
        self,
        cells: list[tuple[str, int]],
        feeds: list[Feeds],
        checks: dict[str, ResponseCheck] | None = None,
        gen: LoadGenerator | None = None,
    ) -> dict[str, list[LevelRow]]:
        """Each (model, level) of ``cells``, in rounds: a round runs one window (of at least --window-s seconds;
        with the Python client also of a third of --requests) of each cell not yet settled, each after a short
        untimed warm-up, until a cell's last three windows agree within --stability (or --max-windows). A cell's
        windows are thus spread over the whole sweep, so a machine that speeds up or slows down meanwhile shows as
        spread instead of as a difference between runs. A level's figures come from its last three windows; its
        failures from every window. Every response of a window (perf_analyzer's windows: PACED_CHECKS known
        requests spread over it, one at a time) is checked against ``checks[model]`` once the window is over, and
        counted in the level's checked and wrong. ``feeds``: the batch-1 requests sent in turn; ``gen``: another
        load generator than the sweeper's. Returns each model's rows, by level."""
        gen = gen or self.gen
        models = list(dict.fromkeys(m for m, _ in cells))
        sent = {m: [self.client.to_wire(m, f) for f in feeds] for m in models}  # by the names each model takes
        state = {key: Cell(*key) for key in cells}
        windows = {
            key: (lambda cell=cell: self._window(cell, sent[cell.model], (checks or {}).get(cell.model), gen))
            for key, cell in state.items()
        }
        cfg = self.cfg
        settled = settle_rounds(
            windows,
            window_figures,
            cfg.stability / 100,
            LAST,
            cfg.max_windows,
            ticker(self.bar, LAST, 1),
            self.probe.read if self.probe else None,
        )
        batch = len(next(iter(feeds[0].values())))
        rows: dict[str, list[LevelRow]] = {m: [] for m in models}
        for key, (ws, how) in settled.items():
            rows[key[0]].append(self._row(state[key], ws, how, gen, batch))
        for r in rows.values():
            r.sort(key=lambda row: row["concurrency"])
        return rows

    def warm(self, model: str, feeds: list[Feeds], levels: tuple[int, ...]) -> None:
        """A model just loaded, run untimed for a window at each of ``levels``: its new processes' first calls,
        their allocations and the batch sizes the levels form, before any window is measured."""
        sent = [self.client.to_wire(model, f) for f in feeds]
        for c in levels:
            closed_loop(self.url, model, sent, c, max(4, c * 2), self.cfg.window_s)

    def _window(self, cell: Cell, sent: list, check: ResponseCheck | None, gen: LoadGenerator) -> dict[str, Any]:
        """One measured window of ``cell``, after its warm-up; its responses judged into ``cell.judged``."""
        cfg, client, model, c = self.cfg, self.client, cell.model, cell.concurrency
        per_window = -(-cfg.requests // LAST)
        count = served_count(stats_of(client, model))
        # untimed before each window: twice the level's requests; before a cell's first, twice as many again, so
        # that the level's batch sizes, the server's threads and the client's channel all run before it is measured
        warm = closed_loop(self.url, model, sent, c, max(4, c * 2) * (2 if cell.first else 1))
        if cell.first and warm["wall_s"]:
            cell.rate = len(warm["latencies_s"]) / warm["wall_s"]
        cell.first = False
        before = settled_stats(client, model, count + len(warm["latencies_s"]))
        keep, kept = keeper()
        cpu0 = tree_cpu(self.server_pid) if self.server_pid else {}
        if gen.name == "perf_analyzer":
            from .perf_analyzer import too_short, wired_data
            from .perf_analyzer import window as pa_window

            span = max(cfg.window_s, per_window / cell.rate if cell.rate else 0.0)
            side = _beside(lambda: paced(self.url, model, sent, PACED_CHECKS, span, keep) if check else None)
            data = wired_data(gen.data, client.wire_names(model), model)
            res = pa_window(gen.binary, self.url, model, c, data, span)
            extra = side()
            done = served_count(before) + 1 + (extra["sent"] if extra else 0)
            if res["errors"] and too_short(res["errors"][0]):  # not a failed request: its window
                py = closed_loop(self.url, model, sent, c, per_window, cfg.window_s, keep if check else None)
                res, done = python_window(py, res["errors"][0]), done + len(py["latencies_s"])
            after = settled_stats(client, model, done)
        else:
            res = closed_loop(self.url, model, sent, c, per_window, cfg.window_s, keep if check else None)
            after = settled_stats(client, model, served_count(before) + len(res["latencies_s"]))
        if self.server_pid:  # read after the stats calls too: a few, beside the window's requests
            res["server_cpu_s"] = cpu_used(cpu0, tree_cpu(self.server_pid))
        tally(check, kept, cell.judged)
        delta = stats_delta(before, after)
        res["completed"] = res.get("completed", int(delta["requests"]))
        cell.deltas.append(delta)
        return res

    def _row(self, cell: Cell, windows: list[dict], how: dict, gen: LoadGenerator, batch: int) -> LevelRow:
        """The level's row: figures from its last three windows, failures from all of them."""
        last = windows[-LAST:]
        delta = merge_deltas(cell.deltas[-LAST:])
        if gen.name == "perf_analyzer":
            row = window_row(last, delta, cell.concurrency, batch)
        else:
            merged = {
                "latencies_s": [t for w in last for t in w["latencies_s"]],
                "errors": [],
                "wall_s": sum(w["wall_s"] for w in last),
                "completed": sum(w["completed"] for w in last),
            }
            row = level_row(merged, delta, cell.concurrency, batch)
        errors = [e for w in windows for e in w["errors"]]
        measured = sum(w["completed"] for w in last)
        row.update(
            sent=sum(w["completed"] for w in windows),
            failed=len(errors),
            windows=how["windows"],
            spread=how["spread"],
            drift=how["drift"],
            stable=how["stable"],
            interval=how["interval"],
            **({"machine_moved": how["machine"]} if "machine" in how else {}),
            load_generator=gen.name,
            window_requests_per_s=[round(window_figures(w)[0], 2) for w in windows],
            client_cpu_us=1e6 * sum(w["cpu_s"] for w in last) / max(1, measured),
        )
        if self.server_pid:
            row["server_cpu_us"] = 1e6 * sum(w.get("server_cpu_s", 0.0) for w in last) / max(1, delta["requests"])
        if errors:
            row["first_error"] = errors[0][:300]
        instead = sum("python_instead" in w for w in windows)
        if instead:
            row["python_windows"] = instead  # perf_analyzer could not measure them; the Python client did
        row.update(cell.judged)
        return row


def _beside(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``fn`` in a thread now; returns a callable that waits for it and gives its result."""
    out: list[Any] = [None]
    t = threading.Thread(target=lambda: out.__setitem__(0, fn()), daemon=True)
    t.start()

    def wait() -> Any:
        t.join()
        return out[0]

    return wait
