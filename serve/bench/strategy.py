"""Serve the winner by strategy: from bench results, pick the served model (and batching) that a strategy
prefers, and serve it under the export's plain name beside (or instead of) the per-format models."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from torchship.errors import ConfigError
from torchship.io import atomic_write_text
from torchship.names import FORMAT_PARAMETER, format_of, sources
from torchship.parity import gate_words

from ..config import parse_strategy
from ..entries import retarget
from ..model_config import edit_configs, read_config, repository_models, served_config_path
from ..repo_readme import readme_with_winner
from .recommend import batching_edit, recommend, saturation
from .results import served_models


def pick(results: dict[str, Any], strategy: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """The winner of ``strategy`` among the served models of ``results`` (a bench results.json) that belong to
    this export, with the figures it won on, the runner-up (the best other model) and why, in words."""
    kind, budget = parse_strategy(strategy)
    served = served_models(results)
    mine = {m: v for m, v in served.items() if format_of(m, manifest)}
    if not mine:
        raise ConfigError(
            f"the bench results hold no served model of {manifest['name']!r} (they have "
            f"{', '.join(served) or 'none'}); bench this export's repository first"
        )
    ranked = []
    for model, m in mine.items():
        best = best_row(m["rows"], kind, budget)
        if best:
            ranked.append((best[0], model, best[1]))
    if not ranked:
        lowest = min((r["p99_ms"] for m in mine.values() for r in m["rows"] if r.get("n")), default=float("nan"))
        raise ConfigError(f"no served model meets p99 <= {budget:g} ms (the lowest p99 measured was {lowest:.2f} ms)")
    ranked.sort(key=lambda t: t[0], reverse=True)
    _, model, row = ranked[0]
    rec = (
        recommend({"served": {"models": {model: mine[model]}}}, budget, manifest["max_batch"])
        if kind != "min-latency"
        else {}
    )

    def figures(r: dict[str, Any]) -> str:
        return (
            f"{r['requests_per_s']:.0f} req/s at p99 {r['p99_ms']:.2f} ms, p50 {r['p50_ms']:.2f} ms, "
            f"{r['concurrency']} in flight"
        )

    goal = {
        "max-throughput": "the highest served throughput",
        "min-latency": "the lowest p50 with one request in flight",
        "p99-budget": f"the highest throughput with p99 <= {budget or 0:g} ms",
    }[kind]
    fmt = format_of(model, manifest)
    precision, gate = precision_of(manifest, fmt)
    words = precision + (f", {gate_words(gate)}" if gate else "")
    out = {
        "strategy": strategy,
        "model": model,
        "format": fmt,
        "precision": precision,
        "figures": figures(row),
        "row": {k: row[k] for k in ("concurrency", "requests_per_s", "p50_ms", "p99_ms")},
        "why": f"{strategy}: {goal}: {model} ({words}), {figures(row)}",
        **({"gate": gate} if gate else {}),
    }
    if rec and "error" not in rec:
        out["batching"] = {k: rec[k] for k in ("dynamic_batching", "max_batch_size", "max_queue_delay_microseconds")}
    if len(ranked) > 1:
        _, second, r2 = ranked[1]
        out["runner_up"] = {"model": second, "figures": figures(r2)}
        out["why"] += f"; runner-up {second}, {figures(r2)}"
    return out


def best_row(rows: list[dict[str, Any]], kind: str, budget: float | None) -> tuple[float, dict[str, Any]] | None:
    """(score, row): the row of a served sweep that a strategy of ``kind`` (parse_strategy) prefers, higher
    scores better: min-latency the lowest p50 at the fewest in flight, the others the highest throughput
    (p99-budget: of the rows within ``budget``), its row the fewest in flight that reach it (recommend.saturation).
    None where no row qualifies."""
    rows = [r for r in rows if r.get("n") and not r.get("failed")]
    if kind == "min-latency":
        rows = [min(rows, key=lambda r: r["concurrency"])] if rows else []

        def score(r: dict[str, Any]) -> float:
            return -r["p50_ms"]
    else:
        rows = [r for r in rows if budget is None or r["p99_ms"] <= budget]

        def score(r: dict[str, Any]) -> float:
            return r["requests_per_s"]

    if not rows:
        return None
    best = max(rows, key=score)
    return score(best), (best if kind == "min-latency" else saturation(rows))


def precision_of(manifest: dict[str, Any], fmt: str | None) -> tuple[str, dict[str, Any] | None]:
    """(what the served model of ``fmt`` computes in, its accuracy gate's figures on the real samples or None
    for a float32 artifact held to the rounding bound)."""
    from torchship.manifest import verdicts

    arts = [a for a in manifest.get("artifacts", []) if a["format"] in sources(fmt)]
    if not arts:
        return manifest.get("dtype", "float32"), None
    a = arts[0]
    precision = a.get("dtype", manifest.get("dtype", "float32"))
    if not a.get("gate"):
        return precision, None
    row = verdicts(manifest).get(a["name"], {}).get("sets", {}).get(manifest["reference"].get("samples") or "", {})
    keys = ("accuracy", "eager_accuracy", "accuracy_drop", "top1_agreement", "sqnr_db")
    return precision, {"max_accuracy_drop": a["gate"]["max_accuracy_drop"], **{k: row[k] for k in keys if k in row}}


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


def serve_winner(repo: str | Path, winner: dict[str, Any], manifest: dict[str, Any], only_winner: bool = False) -> Path:
    """Add the winner to ``repo`` as the model ``<export name>``: a copy of its model folder, its configs renamed,
    recording the format it serves and set to the batching that won, in one edit; written beside the others
    and renamed into place. ``only_winner`` removes the per-format models. Returns the new model's folder."""
    repo = Path(repo)
    name, src = manifest["name"], repo / winner["model"]
    if not (src / "config.pbtxt").exists():
        raise ConfigError(
            f"{repo} does not serve {winner['model']}, the winner (it has {', '.join(repository_models(repo))})"
        )
    staging = repo / f".{name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(src, staging, symlinks=True)
    batching = batching_edit(winner["batching"]) if winner.get("batching") else None

    def as_winner(c) -> None:
        c.name = name
        c.parameters[FORMAT_PARAMETER].string_value = winner["format"]
        if batching:
            batching(c)

    edit_configs(src, as_winner, into=staging)
    (staging / "winner.json").write_text(json.dumps(winner, indent=2) + "\n")
    dest = repo / name
    if dest.exists():
        shutil.rmtree(dest)
    staging.rename(dest)
    if only_winner:
        for m in repository_models(repo):
            if m != name and format_of(m, manifest):
                shutil.rmtree(repo / m)
    retarget(repo, manifest["name"], name)  # the image entry, where there is one, in front of the winner
    readme = repo / "README.md"
    text = readme_with_winner(readme.read_text() if readme.exists() else "", name, winner)
    atomic_write_text(readme, text)
    return dest


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
) -> tuple[dict[str, Any], Path]:
    """Pick the winner of ``strategy`` from ``results`` (a bench's results.json) or, without them, from a short
    served bench of ``repo`` written beside it as REPO-bench; with ``cores``, search its instances x threads
    within them (search, on ``server`` where given, else on an embedded server of its own); and serve
    it under the export's plain name; ``bench`` (a BenchConfig, torchship run's) says how the search measures.
    ``export_dir``: the export (a directory, or an Export held already).
    Returns (the winner, its model folder)."""
    if results is None:
        out = Path(repo).with_name(Path(repo).name + "-bench")
        log(f"--strategy {strategy} without --bench: a short served bench of {repo} first (results in {out})")
        results = short_bench(export_dir, repo, out, log=log)
    winner = pick(results, strategy, manifest)
    if not (Path(repo) / winner["model"]).is_dir():
        raise ConfigError(
            f"the winner {winner['model']} is not in this repository (it serves {', '.join(repository_models(repo))})"
        )
    if cores:
        winner["placement"] = search_placement(export_dir, repo, winner["model"], strategy, cores, server, log, bench)
        if "why" in winner["placement"]:
            winner["why"] += f"; runs as {winner['placement']['why']}"
    return winner, serve_winner(repo, winner, manifest, only_winner)


def search_placement(
    export_dir, repo: str | Path, model: str, strategy: str, cores: int, server=None, log=print, bench=None
) -> dict[str, Any]:
    """search for ``model`` on ``server``, or on an embedded server of its own that loads it alone."""
    from torchship.manifest import Export

    from ..config import ServeConfig
    from ..embedded import TritonServer

    export = Export.of(export_dir)
    if server is not None:
        return search(server, model, export, strategy, cores, log=log, bench=bench)
    with TritonServer(ServeConfig(repo=str(repo), models=(model,))).start() as own:
        return search(own, model, export, strategy, cores, log=log, bench=bench)


# what the search takes from a bench's settings: who sends, and how long and how often it measures
MEASURED_AS = ("load_generator", "perf_analyzer", "window_s", "requests", "stability", "max_windows")


def search(server, model: str, export, strategy: str, cores: int, log=print, bench=None) -> dict[str, Any]:
    """Measure ``model`` (served by ``server``, an embedded TritonServer) at each of candidates(``cores``) with
    SHORT_BENCH's levels, sent and checked as the bench's sweep does (the load generator that costs the shared
    cores least: a costlier client on the same cores narrows the gaps between points, and served in production
    the client runs elsewhere), and keep the one ``strategy`` prefers: it is written into the model's configs and
    loaded; ``bench`` (a BenchConfig), where given, sets the load generator and the windows (the levels stay
    SHORT_BENCH's). Returns {"grid": [{instances, threads, rows}], "chosen": {...}, "why": words, "load_generator":
    name}.
    A GPU model is left as it is (one instance per GPU). ParityError if a response was wrong."""
    from torchship.errors import ParityError

    from .checks import response_check
    from .config import SHORT_BENCH, BenchConfig
    from .inputs import load_inputs, single_rows
    from .placement import candidates, choose, on_gpu, placement_edit, placement_of, why
    from .served import load_generators, sweep

    path = served_config_path(server.repo / model)
    base = read_config(path)
    if on_gpu(base):
        return {"skipped": "GPU instances: one per GPU, the threads only for operators on the CPU"}
    kind, budget = parse_strategy(strategy)
    how = {k: getattr(bench, k) for k in MEASURED_AS} if bench is not None else {}
    cfg = BenchConfig(
        export_dir=str(export.dir), **{**SHORT_BENCH, **how}, cross_check=False, progress=False, plots=False
    )
    inputs = load_inputs(export, None)
    singles = single_rows(inputs.pool, 64)
    client = server.client()
    check = response_check(
        client,
        model,
        export.manifest,
        format_of(model, export.manifest, client.config(model)),
        inputs.expected,
        singles,
        len(next(iter(inputs.pool.values()))),
    )
    grid = []
    data = Path(tempfile.mkdtemp(prefix="torchship-placement-")) / "input.json"
    try:
        gen, _, _ = load_generators(cfg, inputs.pool, data)
        for instances, threads in candidates(cores):
            c = read_config(path)
            placement_edit(instances, threads)(c)
            server.load(model, client=client, override=c)
            rows = sweep(
                server.url,
                [model],
                singles,
                cfg,
                cfg.concurrency,
                None,
                client,
                gen,
                {model: check},
                server.proc.pid if server.proc is not None else None,
            )[model]
            wrong = [
                f"{model} at {instances} instance(s) x {threads} thread(s), {r['concurrency']} in flight: "
                f"{r['wrong']} of {r['checked']} checked responses wrong (first: {r.get('first_wrong')})"
                for r in rows
                if r.get("wrong")
            ]
            if wrong:
                raise ParityError(wrong, what="served outputs under load, in the instances x threads search")
            best = best_row(rows, kind, budget)
            grid.append(
                {
                    "instances": instances,
                    "threads": threads,
                    "rows": rows,
                    "score": best[0] if best else None,
                    "at": best[1]["concurrency"] if best else None,
                }
            )
            log(
                f"placement {model}: {instances} instance(s) x {threads} thread(s): "
                + ", ".join(
                    f"{r['requests_per_s']:.0f} req/s p99 {r['p99_ms']:.2f} ms at {r['concurrency']} in flight"
                    for r in rows
                )
            )
        fit = [g for g in grid if g["score"] is not None]
        kept = dict(zip(("instances", "threads"), placement_of(base)))
        chosen = choose(fit) if fit else kept  # nothing within the strategy: the repository's own stays
        edit_configs(server.repo / model, placement_edit(chosen["instances"], chosen["threads"]))
        server.load(model, client=client, override=read_config(path))
    finally:
        client.close()
        shutil.rmtree(data.parent, ignore_errors=True)
    return {
        "cores": cores,
        "grid": grid,
        "chosen": {"instances": chosen["instances"], "threads": chosen["threads"]},
        "why": why(grid, chosen, strategy, fit),
        "load_generator": gen.name,
    }
