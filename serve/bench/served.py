"""The served part of the benchmark: its plan, its server, and the plan's sweeps run in order (every model over the
levels, the raw entry, dynamic batching off, other queue delays, the no-op round trip, the cross-check) and an
open loop, each recorded where results.json keeps it."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from torchship.device import usable_cpus
from torchship.errors import BenchError, TorchshipError
from torchship.manifest import RAW_SET
from torchship.names import format_of, model_names, models_of

from ..client import TritonClient
from ..entries import entry_of
from ..model_config import read_config, repository_models, served_config_path
from ..repository import servable_formats
from .checks import check_of
from .config import BenchConfig
from .entry import EntryRun
from .inputs import BenchInputs
from .load import open_loop
from .machine import MachineProbe
from .noop import NOOP_MODEL, noop_repo
from .placement import placement_of
from .results import timed
from .sweep import PYTHON, Sweeper, load_generators
from .sweeps import ServedPlan, Sweep, SweepKind, left_out, plan_sweeps

READY_WAIT_S = 15.0  # how long the bench waits for the server at --url to say it is ready


def bench_server(serve_cfg, manifest: dict, out: Path):
    """An embedded TritonServer (not started) on serve_cfg's repository, with the no-op model beside it.
    Give it, started, to run_bench's ``server``; ``torchship run`` does."""
    from ..embedded import TritonServer

    return TritonServer(serve_cfg, extra_repos=[noop_repo(out, manifest)])


def start_own_server(cfg: BenchConfig, export, out: Path, plan: ServedPlan):
    """The bench's own embedded server: on --repo, else on a repository built from ``export`` (an Export) into
    OUT/repo, with the models ``plan`` times loaded (the raw entry's steps with it), not the repository's others:
    each would start a backend process of its own."""
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
    models = cfg.serve.models or (*plan.models, *([plan.entry] if plan.entry else []))
    serve_cfg = dataclasses.replace(cfg.serve, repo=str(repo), log=str(out / "tritonserver.log"), models=models)
    return bench_server(serve_cfg, export.manifest, out).start()


def served_plan(cfg: BenchConfig, manifest: dict, server=None) -> ServedPlan:
    """What the served part will sweep: --models, else the export's models on the given server, else on the
    server at --url, else in the repository the bench serves itself (--repo, or the one it builds from the
    export). --models naming a model that will not be served is refused here, before anything is measured
    or written."""
    from .perf_analyzer import locate

    if cfg.load_generator == "perf_analyzer" and not locate(cfg.perf_analyzer):
        raise BenchError(
            "--load-generator perf_analyzer: perf_analyzer not found; python -m torchship.serve.bench.perf_analyzer "
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
    if cfg.soak and not cfg.models:  # a soak holds one model for a long while: the one that serves
        if manifest["name"] not in known:
            raise BenchError(
                f"--soak without --models soaks {manifest['name']}, the model served under the export's name, and "
                f"{where} has none; name the models to soak with --models, or serve a winner (torchship repo "
                "--strategy) and soak its repository with --repo"
            )
        models = [manifest["name"]]
    if not models and not timed_entry and error is None:
        raise BenchError(
            f"no model of {manifest['name']!r} is served in {where} (served: {', '.join(known) or 'none'})"
        )
    plan = ServedPlan(
        models,
        embedded,
        cfg.noop and (embedded or NOOP_MODEL in known),
        error,
        entry if timed_entry else None,
        entry_of(manifest).kind if timed_entry else None,
    )
    cross_check = bool(cfg.cross_check and locate(cfg.perf_analyzer))
    plan.sweeps, plan.left_out = plan_sweeps(cfg, manifest, plan, cross_check), left_out(cfg, plan, cross_check)
    return plan


def model_record(client, model: str, manifest: dict) -> dict[str, Any]:
    """What the bench records of a served model before sweeping it, as its config reads."""
    c = client.config(model)
    buckets = c.get("parameters", {}).get("buckets", {}).get("string_value", "")
    instances, threads = placement_of(c)
    fmt = format_of(model, manifest, c)
    return {
        "format": fmt,
        "artifact": "aoti_buckets" if buckets else fmt,  # as its config reads
        "max_batch_size": client.max_batch(model),
        "dynamic_batching": "dynamic_batching" in c,
        "instances": instances,
        "threads": threads,
        "max_queue_delay_us": int(c.get("dynamic_batching", {}).get("max_queue_delay_microseconds", 0) or 0),
        **({"buckets": [int(b) for b in buckets.split(",")]} if buckets else {}),
    }


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
    """Fill results["served"]: the plan's sweeps in order (every model over cfg.concurrency, the raw entry, then
    on the embedded ``server`` the same with dynamic batching off and at other queue delays, the no-op model and
    the cross-check), saving after each."""
    manifest, models = inputs.manifest, plan.models
    client = TritonClient(url)
    client.wait_ready(15)
    client.require_models(models)
    served: dict[str, Any] = {
        "url": url,
        "embedded": plan.embedded,
        "models": {},
        "batching_off": {},
        "delays": {},
        "client_cores": usable_cpus(),
        **plan.as_json(),
    }
    results["served"] = served
    data = Path(tempfile.mkdtemp(prefix="torchship-bench-")) / "input.json"
    gen, other, why = load_generators(cfg, inputs.pool, data)
    served["load_generator"] = {"name": gen.name, "why": why}
    pid = server.proc.pid if server is not None and server.proc is not None else None
    sweeper = Sweeper(url, client, cfg, gen, bar, pid, MachineProbe())
    with timed(results, "checks"):  # a quantized model's: its answers on the idle server
        checks = {m: check_of(client, m, inputs) for m in models}
    for model in models:
        served["models"][model] = model_record(client, model, manifest)

    def config(model: str):
        return read_config(served_config_path(server.repo / model))

    reconfigured: set[str] = set()
    try:
        for sw in plan.sweeps:
            with timed(results, sw.kind):
                if sw.kind.on_repository_config and reconfigured:
                    for model in reconfigured:
                        server.load(model, override=config(model))  # back to the repository's config
                    reconfigured.clear()
                if sw.kind.reconfigures:
                    for model in sw.models:
                        c = config(model)
                        sw.edit(c)
                        server.load(model, override=c)
                    reconfigured.update(sw.models)
                if sw.kind is SweepKind.ENTRY:
                    served["entry"] = entry_sweep(sweeper, inputs, plan.entry, sw.levels)
                elif sw.kind is SweepKind.NOOP:
                    served["noop"] = noop_sweep(sweeper, inputs, server if plan.embedded else None, sw)
                else:
                    cross = other if sw.kind is SweepKind.CROSS_CHECK else None
                    swept = sweeper.run(list(sw.models), inputs.singles, sw.levels, checks, cross)
                    for model, rows in swept.items():
                        sw.record(served, model, rows, cross.name if cross else None)
                    if sw.kind is SweepKind.MODELS and plan.embedded:  # each instance's memory once it served all
                        for model, rss in server.instance_memory().items():
                            if model in served["models"]:
                                served["models"][model]["instance_rss_bytes"] = rss
            served["machine_probe"] = sweeper.probe.as_json()
            save()
        for model in reconfigured:
            server.load(model, override=config(model))
    finally:
        shutil.rmtree(data.parent, ignore_errors=True)
    if not plan.embedded and (cfg.batching_compare or cfg.queue_delays_us):
        served["reconfigured"] = {
            "skipped": "the sweeps with dynamic batching off and other queue delays reload models with changed "
            f"configs, which only the embedded server allows; not done against {url}"
        }
    if other is None:
        served["cross_check"] = {"skipped": why}
    if cfg.rate:
        served["open_loop"] = {
            m: open_loop(url, m, [client.to_wire(m, f) for f in inputs.singles], cfg.rate, cfg.duration_s)
            for m in models
        }
    client.close()


def entry_sweep(sweeper: Sweeper, inputs: BenchInputs, entry: str, levels: tuple[int, ...]) -> dict[str, Any]:
    """The raw entry swept with the export's held-out files (and a text entry's model with their token tensors),
    sent by torchship's Python client: the files differ in size, which perf_analyzer's fixed inputs do not carry."""
    try:
        er = EntryRun.prepare(inputs, sweeper.client)
        rows = sweeper.run([er.model], er.feeds, levels, {er.model: er.check}, PYTHON)[er.model]
        tensor_rows = None
        if er.tensor_feeds is not None:
            checks = {er.target: er.tensor_check}
            tensor_rows = sweeper.run([er.target], er.tensor_feeds, levels, checks, PYTHON)[er.target]
        return er.finish(sweeper.client, rows, inputs, tensor_rows)
    except TorchshipError as e:
        return {"model": entry, "error": str(e)}


def noop_sweep(sweeper: Sweeper, inputs: BenchInputs, server, sw: Sweep) -> dict[str, Any]:
    """The no-op model's round trip (loaded first on the embedded ``server``), in the sweep's windows at most."""
    try:
        if server is not None:
            server.load(NOOP_MODEL)
        capped = dataclasses.replace(
            sweeper, cfg=dataclasses.replace(sweeper.cfg, max_windows=sw.max_windows or sweeper.cfg.max_windows)
        )
        return {"rows": capped.run([NOOP_MODEL], inputs.singles, sw.levels)[NOOP_MODEL]}
    except TorchshipError as e:
        return {"error": str(e)}
