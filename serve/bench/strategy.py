"""Serve the winner by strategy: from bench results, pick the served model (and batching) that a strategy
prefers, and serve it under the export's plain name beside (or instead of) the per-format models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchship.names import format_of
from torchship.parity import gate_words

from ..config import ServeConfig, parse_strategy
from .recommend import recommend
from .search import MIDDLE, TIE_RULE, Choice, contenders_of, decide, figure, precision_of, search, sweep_points
from .served_as import serve_winner

GOALS = {
    "max-throughput": "the highest served throughput",
    "min-latency": "the lowest p50 with one request in flight",
    "p99-budget": "the highest throughput with p99 <= {budget:g} ms",
}


def pick(results: dict[str, Any], strategy: str, manifest: dict[str, Any], stability: float = 0.10) -> dict[str, Any]:
    """The winner of ``strategy`` among the served models of ``results`` (a bench results.json) that belong to
    this export, each at the placement the bench measured it at (search.choose: within ``stability`` or a row's
    own spread of the best, search.TIE_RULE decides), with the figures it won on, the runner-up and why, in
    words. ConfigError where no model qualifies."""
    strategy = judged_as(strategy, results)
    kind, budget = parse_strategy(strategy)
    return winner_of(
        decide(sweep_points(results, manifest), kind, budget, stability, manifest, results), strategy, manifest
    )


def judged_as(strategy: str, results: dict[str, Any]) -> str:
    """The strategy as ``results`` (a bench's results.json) are judged by: max-throughput under the bench's own p99
    budget (--p99-budget-ms) is the highest throughput within that budget, p99-budget=MS; else ``strategy``."""
    budget = results.get("config", {}).get("p99_budget_ms")
    return f"p99-budget={budget:g}" if budget and parse_strategy(strategy)[0] == "max-throughput" else strategy


def winner_of(choice: Choice, strategy: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """The record of what serves under the export's plain name (winner.json): the chosen point's model, format,
    precision (and gate), instances x threads, its figures and batching, the runner-up (the best other model),
    and why, in words."""
    kind, budget = parse_strategy(strategy)
    p = choice.chosen
    row = choice.row(p)
    fmt = format_of(p.model, manifest)
    precision, gate = precision_of(manifest, fmt)
    words = precision + (f", {gate_words(gate)}" if gate else "")
    placed = f" at {p.instances} x {p.threads}" if p.instances else ""
    out = {
        "strategy": strategy,
        "model": p.model,
        "format": fmt,
        "precision": precision,
        **({"instances": p.instances, "threads": p.threads} if p.instances else {}),
        "figures": figure(row),
        "row": {k: row[k] for k in ("concurrency", "requests_per_s", "p50_ms", "p99_ms")},
        "why": f"{strategy}: {GOALS[kind].format(budget=budget or 0)}: {p.model} ({words}){placed}, {figure(row)}",
        **({"gate": gate} if gate else {}),
    }
    middle = next((r for r in p.rows if r["concurrency"] == MIDDLE and r.get("n")), None)
    if middle is not None and middle is not row:  # the p99 a queue of MIDDLE gives, beside the chosen level's
        out["at_middle"] = {k: middle[k] for k in ("concurrency", "requests_per_s", "p50_ms", "p99_ms")}
        out["why"] += f" (at {MIDDLE} in flight: {figure(middle)})"
    if kind != "min-latency":
        placement = {"instances": p.instances or 1, "threads": p.threads or 1}
        rec = recommend({"served": {"models": {p.model: {"rows": p.rows, **placement}}}}, budget, manifest["max_batch"])
        if "error" not in rec:
            out["batching"] = {
                k: rec[k] for k in ("dynamic_batching", "max_batch_size", "max_queue_delay_microseconds")
            }
    if len(choice.near) > 1:
        others = [q for q in choice.near if q is not p]
        out["tie"] = {
            "noise": choice.noise,
            "rule": TIE_RULE,
            "near": [f"{q.model} at {q.instances} x {q.threads}" for q in others],
        }
        out["why"] += (
            f"; within the noise of the best ({100 * choice.stability:.0f} %, or a point's own spread where wider: "
            f"{100 * choice.noise:.0f} %) with "
            + "; ".join(f"{q.model} at {q.instances} x {q.threads}, {figure(choice.row(q))}" for q in others)
            + f", chosen by {TIE_RULE}"
        )
    rivals = sorted((q for q in choice.points if q.model != p.model), key=choice.score, reverse=True)
    if rivals:
        r = rivals[0]
        gap = (choice.score(p) - choice.score(r)) / abs(choice.score(p))  # its score's shortfall, a fraction
        out["runner_up"] = {"model": r.model, "figures": figure(choice.row(r)), "gap": gap}
        out["why"] += f"; runner-up {r.model}, {figure(choice.row(r))}"
        # how far the machine's own speed moved while either was measured: a gap within it may not repeat
        moved = max(choice.row(q).get("machine_moved", 0.0) for q in (p, r))
        if gap <= max(choice.noise, moved) and not any(r is q for q in choice.near):  # near: named above
            out["runner_up"]["within_noise"] = True
            out["why"] += (
                f", {100 * abs(gap):.0f} % {'below' if gap >= 0 else 'above'} the winner, within the noise "
                f"({100 * choice.noise:.0f} %; the machine's own speed moved {100 * moved:.0f} % while they were "
                "measured): a rerun may serve either"
            )
    return out


def short_bench(export_dir, repo: str | Path, out: Path, log=print) -> dict[str, Any]:
    """A short served bench of ``repo``'s models (SHORT_BENCH's windows; no in-process part, no cross-check, no
    batching-off sweep) on an embedded server of its own, for --strategy without --bench. ``export_dir``: the
    export (a directory, or an Export held already). Its results.json and report.md go to ``out``."""
    from torchship.manifest import Export

    from .config import SHORT_BENCH, BenchConfig
    from .run import run_bench

    export = Export.of(export_dir)
    cfg = BenchConfig(
        export_dir=str(export.dir),
        repo=str(repo),
        out=str(out),
        skip_in_process=True,
        cross_check=False,
        plots=False,
        **SHORT_BENCH,
    )
    return run_bench(cfg, log=log, export=export)


def serve_by_strategy(
    export_dir,
    repo: str | Path,
    strategy: str,
    manifest: dict[str, Any],
    results: dict[str, Any] | None = None,
    only_winner: bool = False,
    log=print,
    cores: int | None = None,
    server=None,
    bench=None,
    bar=None,
) -> tuple[dict[str, Any], Path]:
    """Choose the winner of ``strategy`` from ``results`` (a bench's results.json) or, without them, from a short
    served bench of ``repo`` written beside it as REPO-bench; with ``cores``, the models that can still win are
    searched at each instances x threads within them (search.search, on ``server`` where given, else on an
    embedded server of its own); the winner is served under the export's plain name, and on ``server`` it is live
    in its final form when this returns. ``bench`` (a BenchConfig, torchship run's) says how the search measures;
    ``bar``, a progress bar it ticks. ``export_dir``: the export (a directory, or an Export held already). Returns
    (the winner, its model folder)."""
    from torchship.manifest import Export

    if results is None:
        out = Path(repo).with_name(Path(repo).name + "-bench")
        log(f"--strategy {strategy} without --bench: a short served bench of {repo} first (results in {out})")
        results = short_bench(export_dir, repo, out, log=log)
    if (judged := judged_as(strategy, results)) != strategy:
        log(f"{strategy} under the bench's p99 budget (--p99-budget-ms): judged as {judged}")
        strategy = judged
    stability = (bench.stability if bench is not None else 10.0) / 100
    winner = pick(results, strategy, manifest, stability)
    if cores:
        export = Export.of(export_dir)
        if server is not None:
            choice, record = search(server, export, repo, results, strategy, cores, bench, log, bar)
        else:
            from ..embedded import TritonServer

            contenders = contenders_of(results, strategy, manifest, stability)
            with TritonServer(ServeConfig(repo=str(repo), models=tuple(contenders))).start() as own:
                choice, record = search(own, export, repo, results, strategy, cores, bench, log, bar)
        winner = {**winner_of(choice, strategy, manifest), "placement": record}
    dest = serve_winner(repo, winner, manifest, only_winner)
    if server is not None:  # loaded again even where the search left it so: its folder is new, and a later load
        server.load(dest.name)  # that reads it (the entry in front of it) must find it loaded as written
    return winner, dest
