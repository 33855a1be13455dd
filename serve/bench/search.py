"""What serves under the export's plain name: the served models that can still win a strategy, each measured at
every instances x threads within the cores and at the levels that decide the strategy (the sweep's figures reused
for the placement the sweep measured), and one rule for the points within the noise of the best."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from torchship.errors import ConfigError, ParityError
from torchship.names import format_of, sources

from ..config import parse_strategy
from ..model_config import read_config, served_config_path
from .placement import candidates, grid_of, on_gpu, placement_edit, placement_of
from .recommend import saturation
from .results import LevelRow, served_models

# the order among points within the noise of the best: what is known to be better without a faster window
TIE_RULE = "the higher precision, then the lower p99, then the fewer instances"
PRECISION_RANK = {"float32": 0, "float64": 0, "bfloat16": 1, "float16": 1, "int8": 2}
# the level between one request and a deep queue: a p99 budget's search measures it for every point, and
# max-throughput's for the point it chooses, so that the winner's p99 at the level it was chosen at stands beside it
MIDDLE = 16
# what the search takes from a bench's settings: who sends, and how long and how often it measures
MEASURED_AS = ("load_generator", "perf_analyzer", "window_s", "requests", "stability", "max_windows")


@dataclass
class Point:
    """A served model at one instances x threads, with the levels measured there (``source``: by the bench's
    sweep, or by the search)."""

    model: str
    precision: str
    instances: int
    threads: int
    rows: list[LevelRow] = field(default_factory=list)
    source: str = "sweep"

    @property
    def placement(self) -> tuple[int, int]:
        return self.instances, self.threads

    def levels(self) -> set[int]:
        return {r["concurrency"] for r in self.rows}


def best_row(rows: list[LevelRow], kind: str, budget: float | None) -> tuple[float, LevelRow] | None:
    """(score, row): the row of a served sweep that a strategy of ``kind`` (parse_strategy) prefers, higher
    scores better: min-latency the lowest p50 at the fewest in flight, the others the highest throughput
    (p99-budget: of the rows within ``budget``), its row the fewest in flight that reach it (recommend.saturation).
    None where no row qualifies."""
    rows = [r for r in rows if r.get("n") and not r.get("failed")]
    if kind == "min-latency":
        rows = [min(rows, key=lambda r: r["concurrency"])] if rows else []
        return (-rows[0]["p50_ms"], rows[0]) if rows else None
    rows = [r for r in rows if budget is None or r["p99_ms"] <= budget]
    if not rows:
        return None
    return max(r["requests_per_s"] for r in rows), saturation(rows)


@dataclass
class Choice:
    """The point a strategy serves, the points within the noise of the best (``near``: the contenders), each
    point's score and row, and the noise the comparison allowed (a fraction)."""

    chosen: Point
    best: Point
    near: list[Point]
    scored: dict[int, tuple[float, LevelRow]]  # by id() of each point that qualified
    noise: float
    points: list[Point] = field(default_factory=list)  # every point that qualified
    stability: float = 0.10  # the noise floor: the windows' agreement

    def score(self, p: Point) -> float:
        return self.scored[id(p)][0]

    def row(self, p: Point) -> LevelRow:
        return self.scored[id(p)][1]


def choose(points: list[Point], kind: str, budget: float | None, stability: float) -> Optional[Choice]:
    """The point to serve: the best score, unless other points lie within the noise of it, when TIE_RULE picks
    among them. The noise is the larger of ``stability`` (the windows' agreement, a fraction) and each row's own
    measured spread: a gap within it is not known to be real, and the choice must repeat from run to run. None
    where no point qualifies (a budget nothing meets)."""
    scored = {id(p): s for p in points if (s := best_row(p.rows, kind, budget))}
    fit = [p for p in points if id(p) in scored]
    if not fit:
        return None
    best = max(fit, key=lambda p: scored[id(p)][0])
    top, top_row = scored[id(best)]

    def noise(p: Point) -> float:
        return max(stability, top_row.get("spread", 0.0), scored[id(p)][1].get("spread", 0.0))

    near = [p for p in fit if top - scored[id(p)][0] <= noise(p) * abs(top)]
    chosen = min(
        near, key=lambda p: (PRECISION_RANK.get(p.precision, 0), scored[id(p)][1].get("p99_ms", 0.0), p.instances)
    )
    return Choice(chosen, best, near, scored, max(map(noise, near)), fit, stability)


def sweep_points(results: dict[str, Any], manifest: dict[str, Any]) -> list[Point]:
    """The bench's served models of this export, each at the placement it was swept at."""
    return [
        Point(
            m,
            precision_of(manifest, format_of(m, manifest))[0],
            mm.get("instances", 0),
            mm.get("threads", 0),
            list(mm.get("rows", [])),
        )
        for m, mm in served_models(results).items()
        if format_of(m, manifest)
    ]


def precision_of(manifest: dict[str, Any], fmt: str | None) -> tuple[str, dict[str, Any] | None]:
    """(what the served model of ``fmt`` computes in, its accuracy gate's figures on the real samples or None
    for a float32 artifact held to the rounding bound)."""
    from torchship.manifest import gate_row

    arts = [a for a in manifest.get("artifacts", []) if a["format"] in sources(fmt)]
    if not arts:
        return manifest.get("dtype", "float32"), None
    a = arts[0]
    precision = a.get("dtype", manifest.get("dtype", "float32"))
    if not a.get("gate"):
        return precision, None
    row = gate_row(manifest, a)
    keys = ("accuracy", "eager_accuracy", "accuracy_drop", "top1_agreement", "sqnr_db")
    keys += ("map50", "eager_map50", "map50_drop", "map50_vs_float32", "score_shift")  # a detector's
    return precision, {**a["gate"], **{k: row[k] for k in keys if k in row}}


def search_levels(kind: str, swept: tuple[int, ...], deep: int) -> tuple[int, ...]:
    """The levels that decide ``kind``: min-latency one request in flight; max-throughput the sweep's highest level
    and ``deep``, where batches can fill on every instance; a p99 budget those, MIDDLE and every level of the
    sweep."""
    if kind == "min-latency":
        return (1,)
    return tuple(sorted({max(swept), deep} | ({MIDDLE, *swept} if kind == "p99-budget" else set())))


def deep_level(max_batch: int, cores: int) -> int:
    """Requests in flight that let every instance of the grid's most instances form batches of ``max_batch``."""
    return max_batch * max(n for n, _ in candidates(cores))


def search(
    server, export, repo, results: dict[str, Any], strategy: str, cores: int, bench=None, log=print, bar=None
) -> tuple[Choice, dict[str, Any]]:
    """Choose what ``strategy`` serves from the bench ``results`` and measurements on ``server`` (an embedded
    TritonServer on ``repo``): the contenders (the sweep's points within the noise of the best) are measured at the
    levels that decide the strategy at each instances x threads within ``cores`` the sweep did not measure them at,
    sent and checked as the bench's sweep does. Each is measured under the export's plain name, the folder that will
    serve the winner (strategy.copy_as), so that the per-format models serve on untouched; for max-throughput the
    chosen point is then measured at MIDDLE too.
    ``bench`` (a BenchConfig), where given, sets the load generator and
    the windows. Returns (the choice, the search's record).
    A GPU model is not searched (one instance per GPU). ConfigError where no model qualifies; ParityError if a
    response was wrong."""
    from .checks import check_of
    from .config import SHORT_BENCH, BenchConfig
    from .inputs import load_inputs
    from .machine import MachineProbe
    from .served_as import copy_as
    from .sweep import Sweeper, load_generators
    from .windows import LAST

    t0 = time.perf_counter()
    kind, budget = parse_strategy(strategy)
    manifest, name, repo = export.manifest, export.manifest["name"], Path(repo)
    how = {k: getattr(bench, k) for k in MEASURED_AS} if bench is not None else {}
    cfg = BenchConfig(
        export_dir=str(export.dir), **{**SHORT_BENCH, **how}, cross_check=False, progress=False, plots=False
    )
    swept = sweep_points(results, manifest)
    first = decide(swept, kind, budget, cfg.stability / 100, manifest, results)
    record: dict[str, Any] = {
        "cores": cores,
        "contenders": [p.model for p in first.near],
        "noise": first.noise,
        "skipped": not_searched(first, swept),
    }
    if on_gpu(read_config(served_config_path(repo / first.chosen.model))):
        record["skipped"].append("instances x threads: GPU instances, one per GPU")
        return first, record
    swept_levels = tuple(sorted({r["concurrency"] for p in swept for r in p.rows}))
    levels = search_levels(kind, swept_levels, deep_level(manifest["max_batch"], cores))
    grid = grid_of(cores)
    # the contenders as the sweep measured them, copied: the search's levels join them where the sweep's placement
    # is one of the grid's
    copies = {p.model: dataclasses.replace(p, rows=list(p.rows)) for p in first.near}
    points = [p for p in copies.values() if p.placement in grid]
    inputs = load_inputs(export, None, eager=False)
    client = server.client()
    data = Path(tempfile.mkdtemp(prefix="torchship-search-")) / "input.json"
    live = None
    try:
        gen, _, _ = load_generators(cfg, inputs.pool, data)
        pid = server.proc.pid if server.proc is not None else None
        sweeper = Sweeper(server.url, client, cfg, gen, bar, pid, MachineProbe())

        def measure(served: str, point: Point, todo: tuple[int, ...]) -> None:
            """``todo``'s levels of ``point``, sent to the model ``served``; its rows join the point's."""
            if bar is not None:
                bar.total += LAST * len(todo)
            rows = sweeper.run([served], inputs.singles, todo, {served: check_of(client, served, inputs)})[served]
            for r in rows:
                r["measured_by"] = "search"
            point.rows = sorted(point.rows + rows, key=lambda r: r["concurrency"])
            log(f"search: {point.model} at {point.instances} x {point.threads}: " + "; ".join(map(figure, rows)))
            wrong = [
                f"{point.model} at {point.instances} instance(s) x {point.threads} thread(s), {r['concurrency']} in "
                f"flight: {r['wrong']} of {r['checked']} checked responses wrong (first: {r.get('first_wrong')})"
                for r in rows
                if r.get("wrong")
            ]
            if wrong:
                raise ParityError(wrong, what="served outputs under load, in the instances x threads search")

        for contender in first.near:
            if contender.placement in grid:  # as the sweep served it, at the levels it lacks: nothing to load
                missing = tuple(c for c in levels if c not in contender.levels())
                if missing:
                    measure(contender.model, copies[contender.model], missing)
            todo = [pl for pl in grid if pl != contender.placement]
            if todo:
                copy_as(repo, contender.model, format_of(contender.model, manifest), name)
            for instances, threads in todo:
                live = read_config(served_config_path(repo / name))
                placement_edit(instances, threads)(live)
                server.load(name, client=client, override=live)
                sweeper.warm(name, inputs.singles, levels)
                point = Point(contender.model, contender.precision, instances, threads, source="search")
                points.append(point)
                measure(name, point, levels)
        others = [p for p in swept if p not in first.near and p.placement in grid]
        final = settle(points, others, kind, budget, cfg.stability / 100, manifest, results)
        chosen = final.chosen
        if kind == "max-throughput" and MIDDLE not in chosen.levels() and any(chosen is p for p in points):
            # the winner at MIDDLE too, where it is served: its p99 there beside that of the level it won at
            served = chosen.model if chosen.source == "sweep" else name
            if served == name and (live is None or placement_of(live) != chosen.placement):
                live = read_config(served_config_path(repo / name))
                placement_edit(*chosen.placement)(live)
                server.load(name, client=client, override=live)
                sweeper.warm(name, inputs.singles, (MIDDLE,))
            measure(served, chosen, (MIDDLE,))
            final.scored[id(chosen)] = best_row(chosen.rows, kind, budget) or final.scored[id(chosen)]
        record["load_generator"] = gen.name
        record["machine_probe"] = sweeper.probe.as_json()
    finally:
        client.close()
        shutil.rmtree(data.parent, ignore_errors=True)
    record["levels"] = list(levels)
    record["seconds"] = round(time.perf_counter() - t0, 1)
    record["grid"] = [
        {
            **asdict(p),
            "score": final.scored.get(id(p), (None,))[0],
            "at": final.scored[id(p)][1]["concurrency"] if id(p) in final.scored else None,
        }
        for p in points
    ]
    return final, record


def settle(
    searched: list[Point], others: list[Point], kind: str, budget, stability: float, manifest, results
) -> Choice:
    """The search's choice among the points it measured; the sweep's other models (further than the noise below
    the best before the search, at a placement of the grid) are runners-up at most. A later window of a contender
    that reads lower, on a busy machine, must not hand the plain name to a model the search never placed. Where
    no searched point qualifies (a p99 budget), every point is considered."""
    choice = choose(searched, kind, budget, stability)
    if choice is None:
        return decide(searched + others, kind, budget, stability, manifest, results)
    for p in others:
        if s := best_row(p.rows, kind, budget):
            choice.scored[id(p)] = s
            choice.points.append(p)
    return choice


def decide(points: list[Point], kind: str, budget, stability: float, manifest, results) -> Choice:
    """choose, or the ConfigError that says why nothing qualifies."""
    if not points:
        served = served_models(results)
        raise ConfigError(
            f"the bench results hold no served model of {manifest['name']!r} (they have "
            f"{', '.join(served) or 'none'}); bench this export's repository first"
        )
    choice = choose(points, kind, budget, stability)
    if choice is None:
        lowest = min((r["p99_ms"] for p in points for r in p.rows if r.get("n")), default=float("nan"))
        raise ConfigError(f"no served model meets p99 <= {budget:g} ms (the lowest p99 measured was {lowest:.2f} ms)")
    return choice


def contenders_of(results: dict[str, Any], strategy: str, manifest: dict[str, Any], stability: float) -> list[str]:
    """The models the search measures: the sweep's within the noise of the best."""
    kind, budget = parse_strategy(strategy)
    return [p.model for p in decide(sweep_points(results, manifest), kind, budget, stability, manifest, results).near]


def not_searched(first: Choice, swept: list[Point]) -> list[str]:
    """The sweep's models the search leaves out, in words: more than the noise below the best."""
    out = [p.model for p in swept if p not in first.near and id(p) in first.scored]
    if not out:
        return []
    return [
        f"{', '.join(out)}: not searched, further than the noise ({100 * first.noise:.0f} %) from "
        f"{first.best.model}'s {figure(first.row(first.best))}"
    ]


def figure(r: LevelRow) -> str:
    """A row's figures in words."""
    return (
        f"{r['requests_per_s']:.0f} req/s at p99 {r['p99_ms']:.2f} ms, p50 {r['p50_ms']:.2f} ms, "
        f"{r['concurrency']} in flight"
    )
