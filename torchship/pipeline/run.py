"""``torchship run``: train -> export (+verify) -> repository -> serve + served parity -> bench, in one run
folder, each stage reading only what the earlier ones wrote to disk."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import build, flag_name, opt
from ..errors import ConfigError, GateError, Interrupted
from ..io import atomic_write_json, atomic_write_text, read_json
from ..procfs import RssSampler
from ..tasks import task_of
from .summary import outcome_line, summarize

ALIASES = {"serve": "check", "verify": "export"}


@dataclass
class RunConfig:
    min_accuracy: float = opt(0.9, "the train stage's gate: the best checkpoint's validation accuracy, 0..1")
    min_map50: float = opt(0.5, "a detector's train gate: the best checkpoint's validation mAP@50, 0..1")


def layout(run_dir: Path) -> dict[str, Path]:
    return {
        "train": run_dir / "train",
        "export": run_dir / "export",
        "repo": run_dir / "model_repository",
        "bench": run_dir / "bench",
        "logs": run_dir / "logs",
        "check": run_dir / "served_parity.json",
    }


def has_checkpoints(run_dir: Path) -> bool:
    """Whether training in ``run_dir`` has written checkpoints, which a run from its first stage replaces."""
    return (layout(run_dir)["train"] / "checkpoints").exists()


DEFAULT_STRATEGY = "max-throughput"  # what torchship run serves under the plain name, unless repo.strategy says


def stage_configs(settings: dict[str, dict[str, Any]], dirs: dict[str, Path]) -> dict[str, Any]:
    """Every section as its stage's typed config, with the run folder's paths filled in."""
    from torchship.export.config import ExportConfig
    from torchship.serve.bench.config import SHORT_BENCH, BenchConfig
    from torchship.serve.config import RepoConfig, ServeConfig
    from torchship.train.config import TrainConfig

    serve = _build_section(
        "serve", ServeConfig, settings, {"repo": str(dirs["repo"]), "log": str(dirs["logs"] / "tritonserver.log")}
    )
    return {
        "train": _build_section("train", TrainConfig, settings, {"out": str(dirs["train"])}),
        "export": _build_section(
            "export", ExportConfig, settings, {"out": str(dirs["export"]), "checkpoint": str(dirs["train"])}
        ),
        "repo": _build_section("repo", RepoConfig, settings, {"out": str(dirs["repo"])}),
        "serve": serve,
        "bench": _build_section(
            "bench",
            BenchConfig,
            {**settings, "bench": {**SHORT_BENCH, "raw_entry": True, **settings.get("bench", {})}},
            {"out": str(dirs["bench"]), "repo": str(dirs["repo"]), "export_dir": str(dirs["export"]), "serve": serve},
        ),
        "run": _build_section("run", RunConfig, settings, {}),
    }


def _build_section(section: str, cls: type, settings: dict[str, dict[str, Any]], fixed: dict[str, Any]) -> Any:
    """build() for one section. The configs' errors name the stage commands' flags (--requests); here the
    user wrote SECTION.KEY (in --set or a config file), so the message says that."""
    try:
        return build(cls, settings[section], fixed, section=section)
    except ConfigError as e:
        raise in_run_terms(section, cls, e) from None


def in_run_terms(section: str, cls: type, e: ConfigError) -> ConfigError:
    """``e`` with each of the section's flags (--requests, --no-plots) written as run takes it
    (bench.requests, bench.plots=false)."""
    keys = {}
    for f in dataclasses.fields(cls):
        keys[flag_name(f)] = f"{section}.{f.name}"
        keys[flag_name(f).replace("--", "--no-", 1)] = f"{section}.{f.name}=false"
    return ConfigError(re.sub(r"--[a-z0-9][a-z0-9-]*", lambda m: keys.get(m.group(0), m.group(0)), str(e)))


class Run:
    """One run of the pipeline: its folder, configs and record, and the embedded server once it is up."""

    def __init__(
        self,
        run_dir: Path,
        settings: dict[str, dict[str, Any]],
        log: Callable[[str], None],
        configs: dict[str, Any] | None = None,
    ):
        self.dir, self.dirs, self.log = run_dir, layout(run_dir), log
        self.settings = settings
        self.cfg = configs or stage_configs(settings, self.dirs)  # built once: main_run builds them to check them
        self.record: dict[str, Any] = {
            "run_dir": str(run_dir),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "settings": settings,
            "stages": {},
            "gates": {},
        }
        self.server = None
        self.into, self.url = None, None  # --into REPO --url URL: roll out into a running server instead
        self._export = None  # the export as the stages hand it on: its manifest and reference read once per run

    def save(self) -> None:
        atomic_write_json(self.dir / "run.json", self.record)

    def done(self, name: str, t0: float, **info) -> None:
        self.record["stages"][name] = {"seconds": round(time.perf_counter() - t0, 1), **info}
        self.save()

    def gate(self, name: str, ok: bool, detail: str) -> None:
        self.record["gates"][name] = {"pass": ok, "detail": detail}
        self.save()
        if not ok:
            raise GateError(f"stage {name}: {detail}")

    def export(self):
        """The run's export (an Export): the one the export stage wrote, or, in a run that starts after it, the
        export folder read, its files checked once."""
        if self._export is None:
            from torchship.manifest import Export

            self._export = Export(self.dirs["export"])
            self._export.check_files()
        return self._export

    def served(self):
        """The embedded server on the run's repository, with the bench's no-op model beside it; started on
        first use, so that the check and the bench measure the same server."""
        if self.server is None:
            from torchship.serve.bench.served import bench_server

            self.server = bench_server(self.cfg["serve"], self.export().manifest, self.dirs["bench"])
            self.server.start()
            self.log(f"Triton ready at {self.server.url} with {', '.join(self.server.loaded)}")
        return self.server


def stage_train(run: Run, t0: float) -> None:
    from torchship import checkpoint as ck
    from torchship.train.launch import run_train

    # an existing train/ holds no checkpoint yet, or --overwrite said to replace them
    run_train(dataclasses.replace(run.cfg["train"], overwrite=True))
    meta = ck.load_meta(ck.resolve_checkpoint(run.dirs["train"], "best"))
    about = {"arch": meta["arch"], "world_size": meta["world_size"], "amp": meta["amp"]}
    task = task_of(meta)
    got, floor = float(meta.get("metrics", {}).get(task.metric, 0.0)), getattr(run.cfg["run"], task.gate_setting)
    run.done("train", t0, **{task.metric: got}, **about)
    run.gate("train", got >= floor, task.gate_line(got, floor))


def stage_export(run: Run, t0: float) -> None:
    from torchship.errors import ParityError
    from torchship.export.compile import stop_fork_server
    from torchship.export.fresh import close_all
    from torchship.export.pipeline import export_model

    cfg = dataclasses.replace(run.cfg["export"], overwrite=True)
    with open(run.dirs["logs"] / "export.log", "w") as elog:

        def both(msg: str) -> None:
            run.log(msg)
            elog.write(msg + "\n")

        try:
            run._export = export_model(cfg, log=both)  # handed on: its manifest and reference read once per run
        except ParityError as e:
            run.done("export", t0, error=str(e))
            run.gate("export", False, str(e))
        finally:
            close_all()  # the verifier's hosts and the compiles' fork server are not needed by the stages that serve
            stop_fork_server()  # and measure
    m = run._export.manifest
    failed = [n for n, e in m.get("verification", {}).get("artifacts", {}).items() if not e["pass"]]
    failed += [f["format"] for f in m["export_failures"]]
    run.done(
        "export",
        t0,
        artifacts=[a["name"] for a in m["artifacts"]],
        failures=m["export_failures"],
        export_seconds={a["name"]: a["export_seconds"] for a in m["artifacts"]},
    )
    run.gate(
        "export",
        True,
        ("verification PASS" if "verification" in m else "exported, not verified")
        + (f"; optional formats that failed: {', '.join(failed)}" if failed else ""),
    )


def stage_repo(run: Run, t0: float) -> None:
    from torchship.serve.repository import build_repository

    res = build_repository(run.export(), dataclasses.replace(run.cfg["repo"], overwrite=True))
    entry = res.get("entry")
    run.log(
        f"repository {res['path']}: {', '.join(res['models'].values())}"
        + (f"; {entry} takes image files as they are" if entry else "")
    )
    run.done("repo", t0, models=res["models"], **({"image_entry": entry_sizes(run.export(), entry)} if entry else {}))


def entry_sizes(export, entry: str) -> dict[str, Any]:
    """The image entry's name and what a request to it holds: the median of the export's held-out files, beside
    the float32 tensor the model's own entry takes."""
    from torchship.manifest import raw_files

    sizes = sorted(len(data) for _, data in raw_files(export.dir, export.manifest))
    tensor = 4 * math.prod(int(d) for d in export.manifest["inputs"][0]["shape"][1:])
    return {"model": entry, "file_bytes": sizes[len(sizes) // 2] if sizes else None, "tensor_bytes": tensor}


def stage_check(run: Run, t0: float) -> None:
    from torchship.errors import ParityError
    from torchship.serve.parity import check_served, served_markdown

    try:
        report = check_served(run.served().url, run.export())
    except ParityError as e:
        atomic_write_json(run.dirs["check"], getattr(e, "report", {"failures": e.failures}))
        run.done("check", t0, error=str(e))
        run.gate("check", False, str(e))
    atomic_write_json(run.dirs["check"], report)
    run.log(served_markdown(report))
    run.done("check", t0, models=list(report["models"]))
    run.gate("check", True, f"served parity PASS ({len(report['models'])} models over gRPC)")


def stage_bench(run: Run, t0: float) -> None:
    from torchship.errors import ParityError
    from torchship.serve.bench.results import level_rows
    from torchship.serve.bench.run import run_bench
    from torchship.serve.repository import served_artifacts

    cfg = run.cfg["bench"]
    if not run.settings["bench"].get("variants"):  # in-process, what the summary sets beside each served model
        cfg = dataclasses.replace(cfg, variants=tuple(served_artifacts(run.export().manifest).values()))
    plots, cfg = cfg.plots, dataclasses.replace(cfg, plots=False)  # drawn once, into the report that names the winner
    try:
        results = run_bench(cfg, log=run.log, server=run.served(), export=run.export())
    except ParityError as e:  # a wrong answer under load: the results and report are written
        run.done("bench", t0, report=str(run.dirs["bench"] / "report.md"), error=str(e))
        run.gate("bench", False, str(e))
    rows = [r for _, r in level_rows(results)]
    failed, checked = sum(r["failed"] for r in rows), sum(r.get("checked", 0) for r in rows)
    winner = serve_the_winner(run, results) if failed == 0 else None
    if winner:  # the bench's results and report name what serves, with the figures that chose it
        results["winner"] = winner
        atomic_write_json(run.dirs["bench"] / "results.json", results)
    from torchship.serve.bench.report import write_report

    write_report(results, run.dirs["bench"], plots=plots)
    run.done("bench", t0, report=str(run.dirs["bench"] / "report.md"), **({"winner": winner} if winner else {}))
    run.gate(
        "bench",
        failed == 0,
        f"{failed} failed requests, {checked} responses checked under load, 0 wrong"
        + (f"; serves {winner['model']} as {winner['served_as']} ({winner['strategy']})" if winner else ""),
    )


def serve_the_winner(run: Run, results: dict[str, Any]) -> dict[str, Any]:
    """The repo stage's --strategy (max-throughput by default) judged on the bench just measured: the winner
    is added to the repository under the export's plain name, loaded into the live server, and must pass
    served parity there before the run goes on."""
    from torchship.serve.bench.strategy import serve_by_strategy
    from torchship.serve.parity import check_served

    export = run.export()
    server = run.served()
    winner, dest = serve_by_strategy(
        export,
        run.dirs["repo"],
        run.cfg["repo"].strategy or DEFAULT_STRATEGY,
        export.manifest,
        results,
        run.cfg["repo"].only_winner,
        log=run.log,
        cores=run.cfg["repo"].search_cores(),
        server=server,
        bench=run.cfg["bench"],
    )
    # live on the server: serve_by_strategy loaded it in its final form; the raw entry in front of it is reloaded
    checked = [dest.name, *reload_entry(server, run.dirs["repo"], export.manifest)]
    check_served(server.url, export, models=checked)
    run.log(
        f"serving {winner['model']} as {dest.name}: {winner['why']} (served parity PASS under {' and '.join(checked)})"
    )
    return {**winner, "served_as": dest.name}


def reload_entry(server, repo: Path, manifest: dict[str, Any]) -> list[str]:
    """The export's raw entry (image or text), where the repository has one: reloaded on ``server``, so that it
    runs the model now behind it; returns its name for the check ([] without one)."""
    from torchship.serve.entries import entry_of

    entry = entry_of(manifest)
    if entry is None or not (repo / entry.name).is_dir():
        return []
    server.load(entry.name)
    return [entry.name]


@dataclass(frozen=True)
class Stage:
    """One stage of the run: its name, what it needs on disk from the stages before it (a path in the run
    folder) and which stage writes that, and the function that runs it."""

    name: str
    needs: str | None
    made_by: str | None
    fn: Callable[[Run, float], None]


STAGES = (
    Stage("train", None, None, stage_train),
    Stage("export", "train/checkpoints/index.json", "train", stage_export),
    Stage("repo", "export/manifest.json", "export", stage_repo),
    Stage("check", "model_repository", "repo", stage_check),
    Stage("bench", "model_repository", "repo", stage_bench),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


def stage_rollout(run: Run, t0: float) -> None:
    """--into REPO --url URL: the export becomes the next version of its models in the live server's repository,
    switched to once its served outputs pass the parity check; the live version serves on otherwise."""
    from torchship.serve.rollout import switch
    from torchship.serve.versions import add_version

    added = add_version(run.export(), run.into, run.cfg["repo"], log=run.log)
    switched = {m: switch(run.url, run.into, m, v, run.export(), log=run.log)["live"] for m, v in added.items()}
    run.done("rollout", t0, into=str(run.into), url=run.url, live=switched)
    run.gate("rollout", True, f"{', '.join(f'{m} version {v}' for m, v in switched.items())} live at {run.url}")


# the second-model workflow: train and export, then roll out into a running server instead of a fresh repository
ROLLOUT_STAGES = STAGES[:2] + (Stage("rollout", "export/manifest.json", "export", stage_rollout),)


def run_pipeline(
    run_dir: Path,
    settings: dict[str, dict[str, Any]],
    start: str = "train",
    log=print,
    overwrite: bool = False,
    into: str | None = None,
    url: str | None = None,
    configs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the stages from ``start`` on, in ``run_dir``. Returns the run record (also in run.json).
    Starting from training in a folder whose training wrote checkpoints needs ``overwrite``: it replaces
    them. Raises GateError naming the stage whose gate failed, and Interrupted (saying where and how to go
    on) for Ctrl-C or SIGTERM. With ``into`` (a served repository) and ``url`` (its server), the export is
    rolled out there instead of served from a repository of the run's own. ``configs``: the stage configs
    (stage_configs of ``settings``) where the caller built them already."""
    if bool(into) != bool(url):
        raise ConfigError(
            "--into REPO and --url HOST:PORT go together: the repository the running server serves, and it"
        )
    stages = ROLLOUT_STAGES if into else STAGES
    names = tuple(s.name for s in stages)
    start = ALIASES.get(start, start)
    if start not in names:
        raise ConfigError(
            f"--from {start}: choose one of {', '.join(names)} "
            f"({'; '.join(f'{a} means {s}' for a, s in ALIASES.items())})"
        )
    first = names.index(start)
    if first == 0 and not overwrite and has_checkpoints(run_dir):
        raise ConfigError(
            f"--out {run_dir} already holds a trained run; pass --from STAGE ({', '.join(names[1:])}) "
            "to go on from a finished stage, --overwrite to redo it from training (its checkpoints are "
            "replaced), or another --out"
        )
    needs, producer = stages[first].needs, stages[first].made_by
    if needs and not (run_dir / needs).exists():
        raise ConfigError(
            f"--from {start}: {run_dir / needs} is missing; run the '{producer}' stage first "
            f"(or start --from {producer})"
        )
    run = Run(run_dir, settings, log, configs)
    run.into, run.url = (Path(into) if into else None), url
    run.dirs["logs"].mkdir(parents=True, exist_ok=True)
    run.record["from"] = start
    prev = run_dir / "run.json"
    if first > 0 and prev.exists():  # keep what earlier stages recorded
        old = read_json(
            prev,
            ConfigError,
            fix=f"; remove it and go on --from {start}: the stages' outputs stay, "
            "only the record of the earlier stages is lost",
        )
        for key in ("stages", "gates"):
            run.record[key] = {k: v for k, v in old.get(key, {}).items() if k in names[:first]}
    t_all = time.perf_counter()
    current = start
    try:
        with RssSampler() as sampler:
            try:
                for stage in stages[first:]:
                    current = stage.name
                    log(f"\n== {stage.name} " + "=" * (60 - len(stage.name)))
                    stage.fn(run, time.perf_counter())
            finally:
                run.record["peak_rss_bytes"] = sampler.peak
        run.record["outcome"] = {"status": "passed"}
    except GateError as e:
        run.record["outcome"] = {"status": "gate failed", "stage": current, "error": str(e)}
        raise
    except KeyboardInterrupt:
        run.record["outcome"] = {"status": "interrupted", "stage": current}
        raise Interrupted(outcome_line(run_dir, run.record["outcome"], markdown=False)) from None
    except Exception as e:
        run.record["outcome"] = {"status": "failed", "stage": current, "error": f"{type(e).__name__}: {e}"}
        raise
    finally:
        if run.server is not None:
            t0 = time.perf_counter()
            run.record["server_exit_code"] = run.server.stop()
            if run.server.stop_note:
                run.record["server_stop_note"] = run.server.stop_note
                log(f"note: {run.server.stop_note}")
            run.record["stages"].setdefault("stop", {"seconds": round(time.perf_counter() - t0, 1)})
        run.record["total_seconds"] = round(time.perf_counter() - t_all, 1)
        run.save()
        summary = summarize(run_dir, run.record, run._export.manifest if run._export else None)
        atomic_write_text(run_dir / "summary.md", summary)
        log("\n" + summary)
    return run.record
