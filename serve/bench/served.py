"""The served part of the benchmark: closed-loop sweeps per model and concurrency, dynamic batching on
and off, other queue delays, the no-op round trip, an open loop, and the perf_analyzer cross-check."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from torchship.device import usable_cpus
from torchship.errors import BenchError, TorchshipError
from torchship.manifest import RAW_SET
from torchship.names import format_of, model_names, models_of
from torchship.procfs import cpu_used, tree_cpu

from ..client import TritonClient
from ..entries import entry_of
from ..model_config import read_config, repository_models, served_config_path
from ..repository import servable_formats
from .checks import ResponseCheck, keeper, response_check, tally
from .config import BenchConfig
from .entry import EntryRun
from .inputs import BenchInputs, single_rows
from .load import closed_loop, level_row, open_loop, paced
from .noop import NOOP_MODEL, noop_repo
from .perf_analyzer import python_window, window_row
from .placement import served_placement
from .stats import merge_deltas, served_count, settled_stats, stats_delta, stats_of
from .sweeps import ServedPlan, plan_sweeps
from .windows import LAST, settle_rounds, ticker, window_figures

READY_WAIT_S = 15.0  # how long the bench waits for the server at --url to say it is ready
PA_MAX_REQUEST_BYTES = 64 << 10  # auto sends larger requests with the Python client (load_generators)
PACED_CHECKS = 12  # known requests spread over each perf_analyzer window, whose answers are checked


def bench_server(serve_cfg, manifest: dict, out: Path):
    """An embedded TritonServer (not started) on serve_cfg's repository, with the no-op model beside it.
    Give it, started, to run_bench's ``server``; ``torchship run`` does."""
    from ..embedded import TritonServer

    return TritonServer(serve_cfg, extra_repos=[noop_repo(out, manifest)])


def start_own_server(cfg: BenchConfig, export, out: Path):
    """The bench's own embedded server: on --repo, else on a repository built from ``export`` (an Export) into
    OUT/repo."""
    from ..config import RepoConfig
    from ..repository import build_repository

    repo = Path(cfg.repo) if cfg.repo else out / "repo"
    if not cfg.repo:
        build_repository(
            export,
            RepoConfig(
                out=str(repo),
                overwrite=True,
                cores=cfg.cores,
                image_entry=None if cfg.raw_entry else False,
                text_entry=None if cfg.raw_entry else False,
            ),
        )
    server = bench_server(
        dataclasses.replace(cfg.serve, repo=str(repo), log=str(out / "tritonserver.log")), export.manifest, out
    )
    return server.start()


def served_plan(cfg: BenchConfig, manifest: dict, server=None) -> ServedPlan:
    """What the served part will sweep: --models, else the export's models on the given server, else on the
    server at --url, else in the repository the bench serves itself (--repo, or the one it builds from the
    export). --models naming a model that will not be served is refused here, before anything is measured
    or written."""
    from .perf_analyzer import locate

    if cfg.load_generator == "perf_analyzer" and not locate(cfg.perf_analyzer):
        raise BenchError(
            "--load-generator perf_analyzer: perf_analyzer not found; python -m serve.bench.perf_analyzer "
            "install fetches it, or give --perf-analyzer PATH"
        )
    error = None
    if server is not None:
        where, known, embedded = f"the server at {server.url}", list(server.loaded), True
    elif cfg.url:
        where, known, embedded = f"the server at {cfg.url}", [], False
        client = TritonClient(cfg.url)
        try:
            client.wait_ready(READY_WAIT_S)
            known = client.ready_models()
        except TorchshipError as e:
            if cfg.models:
                raise
            error = e
        finally:
            client.close()
    elif cfg.repo:
        repo = Path(cfg.repo)
        if not repo.is_dir():
            raise BenchError(f"--repo {repo}: no such directory (build one with torchship repo)")
        where, known, embedded = f"repository {repo}", repository_models(repo), True
    else:
        where, embedded = f"the repository built from {cfg.export_dir}", True
        known = sorted(model_names(manifest, servable_formats(manifest)).values())
        known += [entry_of(manifest).name] if cfg.raw_entry and entry_of(manifest) else []
    missing = [m for m in cfg.models if m not in known]
    if missing:
        raise BenchError(f"--models {' '.join(missing)}: not in {where}; choose from {', '.join(known) or 'none'}")
    entry = entry_of(manifest).name if entry_of(manifest) else None
    timed_entry = (
        entry in known and RAW_SET in manifest["reference"] and (entry in cfg.models if cfg.models else cfg.raw_entry)
    )
    models = [m for m in cfg.models if m != entry] if cfg.models else models_of(manifest, known)
    if not models and not timed_entry and error is None:
        raise BenchError(
            f"no model of {manifest['name']!r} is served in {where} (served: {', '.join(known) or 'none'})"
        )
    return ServedPlan(
        models, embedded, cfg.noop and (embedded or NOOP_MODEL in known), error, entry if timed_entry else None
    )


@dataclass
class LoadGenerator:
    """Who sends a sweep's requests: torchship's Python client, or perf_analyzer (``binary``, fed the bench's
    samples from ``data``)."""

    name: str  # "python" or "perf_analyzer"
    binary: str = ""
    data: Optional[Path] = None


def sweep(
    url: str,
    models: list[str],
    inputs: list[dict[str, np.ndarray]],
    cfg: BenchConfig,
    levels,
    bar,
    client,
    gen: LoadGenerator,
    checks: dict[str, ResponseCheck] | None = None,
    server_pid: int | None = None,
) -> dict[str, list[dict]]:
    """Every model at every concurrency level, in rounds: a round runs one window (of at least --window-s
    seconds; with the Python client also of a third of --requests) of each (model, level) not yet settled,
    each after a short untimed warm-up, until a cell's last three windows agree within --stability (or
    --max-windows). A cell's windows are thus spread over the whole sweep, so a machine that speeds up or
    slows down meanwhile shows as spread instead of as a difference between runs. A level's figures come
    from its last three windows; its failures from every window. Every response of a window (perf_analyzer's
    windows: PACED_CHECKS known requests spread over it, one at a time) is checked against
    ``checks[model]`` once the window is over (checks.py), and counted in the level's checked and wrong.
    ``server_pid``: the server's process (the embedded one), whose CPU time, its backends' included, each
    window reads, as µs a request served. Returns each model's rows, by level."""
    batch = len(next(iter(inputs[0].values())))
    per_window = -(-cfg.requests // LAST)
    sent = {m: [client.to_wire(m, f) for f in inputs] for m in models}  # by the names each served model takes
    deltas: dict[tuple[str, int], list[dict]] = {}
    judged: dict[tuple[str, int], dict[str, Any]] = {}

    def cell(model: str, c: int) -> Callable[[], dict[str, Any]]:
        first, rate = [True], [0.0]

        def window() -> dict[str, Any]:
            warm = min(cfg.requests, max(4, c * 2))
            count = served_count(stats_of(client, model))
            # untimed before each window; before a cell's first, for a whole window: the level's batch sizes, the
            # server's threads and the client's channel all run once before anything is measured
            warmed = closed_loop(url, model, sent[model], c, warm, cfg.window_s if first[0] else 0.0)
            if first[0] and warmed["wall_s"]:  # the level's rate: perf_analyzer's windows must hold per_window requests
                rate[0] = len(warmed["latencies_s"]) / warmed["wall_s"]
            first[0] = False
            before = settled_stats(client, model, count + len(warmed["latencies_s"]))
            check = (checks or {}).get(model)
            keep, kept = keeper()
            cpu0 = tree_cpu(server_pid) if server_pid else {}
            if gen.name == "perf_analyzer":
                from .perf_analyzer import too_short, wired_data
                from .perf_analyzer import window as pa_window

                span = max(cfg.window_s, per_window / rate[0] if rate[0] else 0.0)
                side = _beside(lambda: paced(url, model, sent[model], PACED_CHECKS, span, keep) if check else None)
                res = pa_window(gen.binary, url, model, c, wired_data(gen.data, client.wire_names(model), model), span)
                extra = side()
                done = served_count(before) + 1 + (extra["sent"] if extra else 0)
                if res["errors"] and too_short(res["errors"][0]):  # not a failed request: its window
                    py = closed_loop(url, model, sent[model], c, per_window, cfg.window_s, keep if check else None)
                    res, done = python_window(py, res["errors"][0]), done + len(py["latencies_s"])
                after = settled_stats(client, model, done)
            else:
                res = closed_loop(url, model, sent[model], c, per_window, cfg.window_s, keep if check else None)
                after = settled_stats(client, model, served_count(before) + len(res["latencies_s"]))
            if server_pid:  # read after the stats calls too: a few, beside the window's requests
                res["server_cpu_s"] = cpu_used(cpu0, tree_cpu(server_pid))
            tally(check, kept, judged.setdefault((model, c), {}))
            delta = stats_delta(before, after)
            res["completed"] = res.get("completed", int(delta["requests"]))
            deltas.setdefault((model, c), []).append(delta)
            return res

        return window

    cells = {(m, c): cell(m, c) for m in models for c in levels}
    settled = settle_rounds(cells, window_figures, cfg.stability / 100, LAST, cfg.max_windows, ticker(bar, LAST, 1))
    rows: dict[str, list[dict]] = {m: [] for m in models}
    for (model, c), (windows, how) in settled.items():
        last = windows[-LAST:]
        delta = merge_deltas(deltas[model, c][-LAST:])
        if gen.name == "perf_analyzer":
            row = window_row(last, delta, c, batch)
        else:
            merged = {
                "latencies_s": [t for w in last for t in w["latencies_s"]],
                "errors": [],
                "wall_s": sum(w["wall_s"] for w in last),
                "completed": sum(w["completed"] for w in last),
            }
            row = level_row(merged, delta, c, batch)
        errors = [e for w in windows for e in w["errors"]]
        measured = sum(w["completed"] for w in last)
        row.update(
            sent=sum(w["completed"] for w in windows),
            failed=len(errors),
            windows=how["windows"],
            spread=how["spread"],
            drift=how["drift"],
            stable=how["stable"],
            load_generator=gen.name,
            window_requests_per_s=[round(window_figures(w)[0], 2) for w in windows],
            client_cpu_us=1e6 * sum(w["cpu_s"] for w in last) / max(1, measured),
        )
        if server_pid:
            row["server_cpu_us"] = 1e6 * sum(w.get("server_cpu_s", 0.0) for w in last) / max(1, delta["requests"])
        if errors:
            row["first_error"] = errors[0][:300]
        instead = sum("python_instead" in w for w in windows)
        if instead:
            row["python_windows"] = instead  # perf_analyzer could not measure them; the Python client did
        row.update(judged.get((model, c), {}))
        rows[model].append(row)
    return rows


def _beside(fn):
    """Run ``fn`` in a thread now; returns a callable that waits for it and gives its result."""
    out: list[Any] = [None]
    t = threading.Thread(target=lambda: out.__setitem__(0, fn()), daemon=True)
    t.start()

    def wait():
        t.join()
        return out[0]

    return wait


def bench_served(
    cfg: BenchConfig,
    inputs: BenchInputs,
    plan: ServedPlan,
    url: str,
    server,
    bar,
    results: dict,
    save: Callable[[], None],
) -> None:
    """Fill results["served"]: every model of the plan swept over cfg.concurrency, then (on the embedded
    ``server``) again with dynamic batching off and at other queue delays."""
    manifest, models, embedded = inputs.manifest, plan.models, plan.embedded
    client = TritonClient(url)
    client.wait_ready(15)
    client.require_models(models)
    served: dict[str, Any] = {
        "url": url,
        "embedded": embedded,
        "models": {},
        "batching_off": {},
        "delays": {},
        "client_cores": usable_cpus(),
    }
    results["served"] = served
    singles = single_rows(inputs.pool, 64)  # batch-1 requests
    data = Path(tempfile.mkdtemp(prefix="torchship-bench-")) / "input.json"
    gen, other, why = load_generators(cfg, inputs.pool, data)
    served["load_generator"] = {"name": gen.name, "why": why}

    pid = server.proc.pid if server is not None and server.proc is not None else None
    checks = {
        m: response_check(
            client,
            m,
            manifest,
            format_of(m, manifest, client.config(m)),
            inputs.expected,
            singles,
            len(next(iter(inputs.pool.values()))),
        )
        for m in models
    }

    def run(these: list[str], levels=cfg.concurrency, by: LoadGenerator = gen) -> dict[str, list[dict]]:
        return sweep(url, these, singles, cfg, levels, bar, client, by, checks, pid)

    for model in models:
        cfgm = client.config(model)
        buckets = cfgm.get("parameters", {}).get("buckets", {}).get("string_value", "")
        instances, threads = served_placement(cfgm)
        fmt = format_of(model, manifest, cfgm)
        served["models"][model] = {
            "format": fmt,
            "artifact": "aoti_buckets" if buckets else fmt,  # as its config reads
            "max_batch_size": client.max_batch(model),
            "dynamic_batching": "dynamic_batching" in cfgm,
            "instances": instances,
            "threads": threads,
            "max_queue_delay_us": int(cfgm.get("dynamic_batching", {}).get("max_queue_delay_microseconds", 0) or 0),
            **({"buckets": [int(b) for b in buckets.split(",")]} if buckets else {}),
        }

    def config(model: str):
        return read_config(served_config_path(server.repo / model))

    reconfigured: set[str] = set()
    for sw in plan_sweeps(cfg, manifest, plan, other is not None):
        if sw.kind in ("noop", "cross_check") and reconfigured:
            for model in reconfigured:
                server.load(model, override=config(model))  # back to the repository's config
            reconfigured.clear()
        if sw.kind in ("batching_off", "delay"):
            for model in sw.models:
                c = config(model)
                if sw.kind == "batching_off":
                    c.ClearField("dynamic_batching")
                else:
                    c.dynamic_batching.max_queue_delay_microseconds = sw.delay_us
                server.load(model, override=c)
            reconfigured.update(sw.models)
        if sw.kind == "entry":
            try:
                er = EntryRun.prepare(inputs, client)
                rows = sweep(
                    url,
                    [er.model],
                    er.feeds,
                    cfg,
                    sw.levels,
                    bar,
                    client,
                    LoadGenerator("python"),
                    {er.model: er.check},
                    pid,
                )[er.model]
                tensor_rows = (
                    None
                    if er.tensor_feeds is None
                    else sweep(
                        url,
                        [er.target],
                        er.tensor_feeds,
                        cfg,
                        sw.levels,
                        bar,
                        client,
                        LoadGenerator("python"),
                        {er.target: er.tensor_check},
                        pid,
                    )[er.target]
                )
                served["entry"] = er.finish(client, rows, inputs, tensor_rows)
            except TorchshipError as e:
                served["entry"] = {"model": plan.entry, "error": str(e)}
            save()
            continue
        if sw.kind == "noop":
            try:
                if embedded:
                    server.load(NOOP_MODEL)
                served["noop"] = {"rows": run(list(sw.models), sw.levels)[NOOP_MODEL]}
            except TorchshipError as e:
                served["noop"] = {"error": str(e)}
            continue
        swept = run(list(sw.models), sw.levels, other if sw.kind == "cross_check" and other else gen)
        for model, rows in swept.items():
            if sw.kind == "models":
                served["models"][model]["rows"] = rows
            elif sw.kind == "batching_off":
                served["batching_off"][model] = {"rows": rows}
            elif sw.kind == "delay":
                served["delays"].setdefault(model, {})[str(sw.delay_us)] = {"rows": rows}
            else:
                served["cross_check"] = {"load_generator": other.name, "model": model, "rows": rows}
        if sw.kind == "models" and embedded:  # what each model's instance holds once it has served every batch size
            for model, rss in server.instance_memory().items():
                if model in served["models"]:
                    served["models"][model]["instance_rss_bytes"] = rss
        save()
    for model in reconfigured:
        server.load(model, override=config(model))
    if not embedded and (cfg.batching_compare or cfg.queue_delays_us):
        served["reconfigured"] = {
            "skipped": "the sweeps with dynamic batching off and other queue delays reload "
            f"models with changed configs, which only the embedded server allows; "
            f"not done against {url}"
        }
    if other is None:
        served["cross_check"] = {"skipped": why}
    if cfg.rate:
        served["open_loop"] = {
            m: open_loop(url, m, [client.to_wire(m, f) for f in singles], cfg.rate, cfg.duration_s) for m in models
        }
    shutil.rmtree(data.parent, ignore_errors=True)
    client.close()


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
    python = LoadGenerator("python")
    if not binary:
        return python, None, "perf_analyzer not found (python -m serve.bench.perf_analyzer install fetches it)"
    data.write_text(input_data_json(pool))
    pa = LoadGenerator("perf_analyzer", binary, data)
    size = sum(v[0].nbytes for v in pool.values())
    big = cfg.load_generator == "auto" and size > PA_MAX_REQUEST_BYTES
    first, second = (python, pa) if cfg.load_generator == "python" or big else (pa, python)
    why = f"--load-generator {cfg.load_generator}" + (
        ", perf_analyzer installed" if cfg.load_generator == "auto" else ""
    )
    if big:
        why += (
            f"; requests of {size / 1024:.0f} KiB, above {PA_MAX_REQUEST_BYTES // 1024} KiB, where perf_analyzer "
            "costs more CPU a request than the Python client"
        )
    return first, (second if cfg.cross_check else None), why if cfg.cross_check else why + "; cross-check off"
