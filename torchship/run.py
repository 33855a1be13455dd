"""``torchship run``: train -> export (+verify) -> repository -> serve -> served parity -> bench -> stop,
all in one run folder, each stage reading only what the previous ones wrote to disk."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from .config import build, flag_name, load_config_file
from .errors import ConfigError, GateError, TorchshipError
from .io import atomic_write_json, atomic_write_text, read_json
from .manifest import MANIFEST, read_manifest

STAGES = ("train", "export", "repo", "check", "bench")
ALIASES = {"serve": "check", "verify": "export"}

# What `torchship run` uses when neither the config file nor the flags say otherwise.
DEFAULTS: dict[str, dict[str, Any]] = {
    "train": {"arch": "resnet18", "data": "digits", "epochs": 10, "nproc": 0, "amp": "bf16", "progress": True},
    "export": {"max_batch": 32, "buckets": [1, 8, 32]},
    "repo": {},
    "serve": {},
    "bench": {"batch_sizes": [1, 32], "iters": 60, "blocks": 6, "warmup": 5, "concurrency": [1, 4, 16],
              "requests": 150, "batching_compare": ["onnx"]},
    "run": {"min_accuracy": 0.9},
}


def layout(run_dir: Path) -> dict[str, Path]:
    return {"train": run_dir / "train", "export": run_dir / "export", "repo": run_dir / "model_repository",
            "bench": run_dir / "bench", "logs": run_dir / "logs", "check": run_dir / "served_parity.json"}


def has_checkpoints(run_dir: Path) -> bool:
    """Whether training in ``run_dir`` has written checkpoints, which a run from its first stage replaces."""
    return (layout(run_dir)["train"] / "checkpoints").exists()


class RssSampler:
    """Peak resident memory of this process and all its descendants together, sampled from /proc."""

    def __init__(self, interval: float = 0.25):
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, args=(interval,), daemon=True)

    @staticmethod
    def tree_rss(root: int) -> int:
        children: dict[int, list[int]] = {}
        rss: dict[int, int] = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(d))
                rss[int(d)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError, ValueError):
                continue
        total, stack = 0, [root]
        while stack:
            p = stack.pop()
            total += rss.get(p, 0)
            stack.extend(children.get(p, []))
        return total

    def _loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.peak = max(self.peak, self.tree_rss(os.getpid()))
            except OSError:
                return

    def __enter__(self) -> "RssSampler":
        if os.path.isdir("/proc"):
            self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


def resolve_settings(file_cfg: dict[str, Any], sets: list[str], shortcuts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """DEFAULTS < config file < --set SECTION.KEY=VALUE < shortcut flags."""
    out = {k: dict(v) for k, v in DEFAULTS.items()}
    for section, values in file_cfg.items():
        if section not in out:
            raise ConfigError(f"--config: unknown section [{section}]; use {', '.join(out)}")
        if not isinstance(values, dict):
            raise ConfigError(f"--config: [{section}] must be a table of options")
        out[section].update(values)
    for item in sets:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set {item!r} must look like SECTION.KEY=VALUE (e.g. train.epochs=3)")
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        if section not in out:
            raise ConfigError(f"--set {item}: unknown section {section!r}; use {', '.join(out)}")
        out[section][name.replace("-", "_")] = _parse_value(value)
    for section, name, value in (("train", k, v) for k, v in shortcuts.items() if v is not None):
        out[section][name] = value
    return out


def _parse_value(v: str) -> Any:
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def _stage_configs(settings: dict[str, dict[str, Any]], dirs: dict[str, Path]):
    from export.config import ExportConfig
    from serve.bench_config import BenchConfig
    from serve.config import RepoConfig, ServeConfig
    from train.config import TrainConfig

    train = _build_section("train", TrainConfig, settings, {"out": str(dirs["train"])})
    export = _build_section("export", ExportConfig, settings, {"out": str(dirs["export"]), "checkpoint": str(dirs["train"])})
    repo = _build_section("repo", RepoConfig, settings, {"out": str(dirs["repo"])})
    serve = _build_section("serve", ServeConfig, settings, {"repo": str(dirs["repo"]),
                                                            "log": str(dirs["logs"] / "tritonserver.log")})
    bench = _build_section("bench", BenchConfig, settings, {"out": str(dirs["bench"]), "export_dir": str(dirs["export"])})
    return train, export, repo, serve, bench


def _build_section(section: str, cls: type, settings: dict[str, dict[str, Any]], fixed: dict[str, Any]) -> Any:
    """build() for one section of run's settings. The configs' errors name the stage commands' flags
    (--requests); here the user wrote SECTION.KEY (in --set or a config file), so the message says that."""
    try:
        return build(cls, settings[section], fixed, section=section)
    except ConfigError as e:
        raise _in_run_terms(section, cls, e) from None


def _in_run_terms(section: str, cls: type, e: ConfigError) -> ConfigError:
    """``e`` with each of the section's flags (--requests, --no-overhead) written as run takes it
    (bench.requests, bench.overhead=false)."""
    keys = {}
    for f in dataclasses.fields(cls):
        keys[flag_name(f)] = f"{section}.{f.name}"
        keys[flag_name(f).replace("--", "--no-", 1)] = f"{section}.{f.name}=false"
    return ConfigError(re.sub(r"--[a-z0-9][a-z0-9-]*", lambda m: keys.get(m.group(0), m.group(0)), str(e)))


def _require(stage: str, dirs: dict[str, Path], start: str) -> None:
    """--from X: everything before X must be on disk already."""
    need = {"export": (dirs["train"] / "checkpoints" / "index.json", "train"),
            "repo": (dirs["export"] / "manifest.json", "export"),
            "check": (dirs["repo"], "repo"),
            "bench": (dirs["repo"], "repo")}
    if stage in need:
        path, producer = need[stage]
        if not path.exists():
            raise ConfigError(f"--from {start}: {path} is missing; run the '{producer}' stage first (or start --from {producer})")


def run_pipeline(run_dir: Path, settings: dict[str, dict[str, Any]], start: str = "train", log=print,
                 overwrite: bool = False) -> dict[str, Any]:
    """Run the stages from ``start`` on, in ``run_dir``. Returns the run record (also in run.json).
    Starting from training in a folder whose training wrote checkpoints needs ``overwrite``: it replaces
    them. Raises GateError naming the stage whose gate failed."""
    start = ALIASES.get(start, start)
    if start not in STAGES:
        raise ConfigError(f"--from {start}: choose one of {', '.join(STAGES)}")
    dirs = layout(run_dir)
    if start == STAGES[0] and not overwrite and has_checkpoints(run_dir):
        raise ConfigError(f"--out {run_dir} already holds a trained run; pass --from STAGE ({', '.join(STAGES[1:])}) to go on "
                          "from a finished stage, --overwrite to redo it from training (its checkpoints are replaced), "
                          "or another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    dirs["logs"].mkdir(exist_ok=True)
    first = STAGES.index(start)
    if first > 0:
        _require(start, dirs, start)
    train_cfg, export_cfg, repo_cfg, serve_cfg, bench_cfg = _stage_configs(settings, dirs)
    if first == 0:  # an existing train/ holds no checkpoint yet, or --overwrite said to replace them
        train_cfg.overwrite = True
    record: dict[str, Any] = {"run_dir": str(run_dir), "from": start, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "settings": settings, "stages": {}, "gates": {}}
    prev = run_dir / "run.json"
    if first > 0 and prev.exists():  # keep what earlier stages recorded
        old = read_json(prev, ConfigError, fix=f"; remove it and go on --from {start}: the stages' outputs stay, "
                                               "only the record of the earlier stages is lost")
        earlier = set(STAGES[:first])
        record["stages"] = {k: v for k, v in old.get("stages", {}).items() if k in earlier}
        record["gates"] = {k: v for k, v in old.get("gates", {}).items() if k in earlier}
    min_acc = float(settings["run"].get("min_accuracy", 0.0))
    t_all = time.perf_counter()
    sampler = RssSampler()
    server = None
    current = start  # the stage running, as --from names it

    def stage(name: str):
        nonlocal current
        current = ALIASES.get(name.split()[0], name)
        log(f"\n== {name} " + "=" * (60 - len(name)))
        return time.perf_counter()

    def done(name: str, t0: float, **info) -> None:
        record["stages"][name] = {"seconds": round(time.perf_counter() - t0, 1), **info}
        atomic_write_json(prev, record)

    def gate(name: str, ok: bool, detail: str) -> None:
        record["gates"][name] = {"pass": ok, "detail": detail}
        atomic_write_json(prev, record)
        if not ok:
            raise GateError(f"stage {name}: {detail}")

    try:
        with sampler:
            if first <= 0:
                from train import checkpoint as ck
                from train.launch import run_train

                t0 = stage("train")
                run_train(train_cfg)
                best = ck.resolve_checkpoint(dirs["train"], "best")
                meta = ck.load_meta(best)
                acc = float(meta.get("metrics", {}).get("val_acc", 0.0))
                done("train", t0, val_acc=acc, checkpoint=str(best), arch=meta["arch"], world_size=meta["world_size"],
                     amp=meta["amp"])
                gate("train", acc >= min_acc, f"validation accuracy {100 * acc:.2f}% (gate: >= {100 * min_acc:.0f}%)")
            if first <= 1:
                from export.pipeline import run_export
                from torchship.errors import ParityError

                t0 = stage("export")
                export_cfg.overwrite = True
                with open(dirs["logs"] / "export.log", "w") as elog:
                    def both(msg: str) -> None:
                        log(msg)
                        elog.write(msg + "\n")
                    try:
                        m = run_export(export_cfg, log=both)
                    except ParityError as e:
                        done("export", t0, error=str(e))
                        gate("export", False, str(e))
                v = m.get("verification", {})
                done("export", t0, artifacts=[a["name"] for a in m["artifacts"]],
                     export_seconds={a["name"]: a["export_seconds"] for a in m["artifacts"]},
                     failures=m["export_failures"], bytes={a["name"]: a["bytes"] for a in m["artifacts"]})
                gate("export", bool(v.get("pass")) and not m["export_failures"],
                     "verification " + ("PASS" if v.get("pass") else "FAIL") +
                     (f"; could not export {', '.join(f['format'] for f in m['export_failures'])}" if m["export_failures"] else ""))
            if first <= 2:
                from serve.repository import build_repository

                t0 = stage("repo")
                repo_cfg.overwrite = True
                res = build_repository(dirs["export"], repo_cfg)
                log(f"repository {res['path']}: {', '.join(res['models'].values())}")
                done("repo", t0, models=res["models"])
            from serve.bench import bench_server, run_bench
            from serve.client import check_served, served_markdown
            from serve.config import cpu_list
            from torchship.errors import ParityError
            from torchship.manifest import read_manifest

            t0 = stage("serve + check")
            # bench's embedded server from the start, so that the bench stage measures the floor and
            # batching off on the server that the check used
            server = bench_server(serve_cfg, bench_cfg, read_manifest(dirs["export"]), dirs["bench"])
            server.start()
            log(f"Triton ready at {server.url} with {', '.join(server.loaded)} (backends hosted: {server.python_host})"
                + (f"; {server.python_host_note}" if server.python_host_note else "")
                + (f"; pinned to CPUs {cpu_list(server.cpus)}" if server.cpus else "")
                + (f"; model instances on CPUs {cpu_list(server.model_cpus)}" if server.model_cpus else "")
                + (f"; spinners on CPUs {cpu_list(server.spin_cpus)}" if server.spin_cpus else ""))
            if first <= 3:
                try:
                    report = check_served(server.url, dirs["export"])
                except ParityError as e:
                    atomic_write_json(dirs["check"], getattr(e, "report", {"failures": e.failures}))
                    done("check", t0, error=str(e))
                    gate("check", False, str(e))
                atomic_write_json(dirs["check"], report)
                log(served_markdown(report))
                done("check", t0, models=list(report["models"]))
                gate("check", True, f"served parity PASS ({len(report['models'])} models over gRPC)")
            t0 = stage("bench")
            bench_cfg.repo = str(dirs["repo"])
            results = run_bench(bench_cfg, log=log, server=server)
            failed = sum(r["failed"] for m in results.get("served", {}).get("models", {}).values() for r in m["rows"])
            done("bench", t0, report=str(dirs["bench"] / "report.md"))
            gate("bench", failed == 0, f"{failed} failed requests")
        record["outcome"] = {"status": "passed"}
    except GateError as e:
        record["outcome"] = {"status": "gate failed", "stage": current, "error": str(e)}
        raise
    except KeyboardInterrupt:
        record["outcome"] = {"status": "interrupted", "stage": current}
        raise
    except Exception as e:
        record["outcome"] = {"status": "failed", "stage": current, "error": f"{type(e).__name__}: {e}"}
        raise
    finally:
        if server is not None:
            t0 = time.perf_counter()
            code = server.stop()
            record["server_exit_code"] = code
            if server.stop_note:
                record["server_stop_note"] = server.stop_note
                log(f"note: {server.stop_note}")
            record["stages"].setdefault("stop", {"seconds": round(time.perf_counter() - t0, 1)})
        record["total_seconds"] = round(time.perf_counter() - t_all, 1)
        record["peak_rss_bytes"] = sampler.peak
        atomic_write_json(prev, record)
        summary = summarize(run_dir, record)
        atomic_write_text(run_dir / "summary.md", summary)
        log("\n" + summary)
    return record


def outcome_line(run_dir: Path, outcome: dict[str, Any]) -> str:
    """The summary's headline: whether every stage ran and passed, and if not, where the run stopped and
    how to go on from there."""
    status, where = outcome.get("status"), outcome.get("stage")
    redo = where == STAGES[0] and has_checkpoints(run_dir)  # a training stopped after a checkpoint
    again = f"`torchship run --out {run_dir} " + ("--overwrite`" if redo else f"--from {where}`")
    if status == "passed":
        return "**all gates passed**"
    if status == "gate failed":
        return f"**a gate FAILED**: {outcome['error']}"
    if status == "interrupted":
        return f"**interrupted** in the {where} stage: the stages after it did not run; go on with {again}"
    error = outcome.get("error", "unknown error").splitlines()[0]
    return f"**stopped by an error** in the {where} stage ({error}); the stages after it did not run; once fixed, go on with {again}"


def summarize(run_dir: Path, record: dict[str, Any]) -> str:
    dirs = layout(run_dir)
    lines = [f"# torchship run: {run_dir}", "", outcome_line(run_dir, record.get("outcome", {})), "",
             "| stage | seconds | result |", "|---|---|---|"]
    for name, st in record["stages"].items():
        g = record["gates"].get(name, {})
        result = g.get("detail", "")
        if name == "train":
            result = f"{st['arch']}, {st['world_size']} rank(s), amp {st['amp']}: " + result
        lines.append(f"| {name} | {st['seconds']} | {result} |")
    lines.append(f"| total | {record.get('total_seconds', '')} | peak RSS of the whole run (all processes): "
                 f"{record.get('peak_rss_bytes', 0) / 2**30:.2f} GiB |")
    # the summary is written after a failure too: a file that cannot be read is named, not raised
    v = _readable(lines, dirs["export"] / MANIFEST, read_manifest, dirs["export"]).get("verification")
    if v:
        lines += ["", "## Parity against eager (worst case over held-out and random batches)", "",
                  "| artifact | max abs diff | max rel diff | top-1 agree | result |", "|---|---|---|---|---|"]
        for name, e in v["artifacts"].items():
            rows = e["sets"].values()
            mx = max((r.get("max_abs", 0) for r in rows), default=0)
            mr = max((r.get("max_rel", 0) for r in rows), default=0)
            top = next((r.get("top1_agree") for r in rows if r.get("top1_agree")), "")
            lines.append(f"| {name} | {mx:.2e} | {mr:.2e} | {top} | {'pass' if e['pass'] else 'FAIL'} |")
    if "bench" in record["stages"]:
        from serve.bench import load_results

        b = _readable(lines, dirs["bench"] / "results.json", load_results, dirs["bench"] / "results.json")
        if b:
            lines += served_latency_lines(b)
    lines += ["", f"Run folder: {run_dir}  ·  summary: {run_dir / 'summary.md'}  ·  bench report: {dirs['bench'] / 'report.md'}", ""]
    return "\n".join(lines)


def _readable(lines: list[str], path: Path, read, *args) -> dict[str, Any]:
    """``read(*args)`` if ``path`` exists, else {}; a TorchshipError becomes a line of the summary."""
    if not path.exists():
        return {}
    try:
        return read(*args)
    except TorchshipError as e:
        lines += ["", f"(left out: {e})"]
        return {}


def served_latency_lines(b: dict) -> list[str]:
    """The summary's batch-1 table: from bench's side-by-side overhead measurement (each served model, its
    artifact in-process and the no-op floor in rotating blocks) where it ran, else from the sweeps."""
    head = ["", "## Served latency (gRPC, batch 1, one request in flight)", ""]
    rows = [r for r in b.get("served", {}).get("overhead", {}).get("rows", []) if r.get("floor")]
    if rows:
        lines = head + ["In-process, served and the no-op floor measured side by side; "
                        "excess = served − in-process − floor (p50).", "",
                        "| model | in-process p50 ms | served p50 ms | served p99 ms | floor p50 ms | excess ms |",
                        "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['model']} | {r['in_process']['p50_ms']:.2f} | {r['served']['p50_ms']:.2f} | "
                         f"{r['served']['p99_ms']:.2f} | {r['floor']['p50_ms']:.2f} | {r['excess_p50_ms']:+.2f} |")
        return lines
    lines = head + ["| model | p50 ms | p99 ms | in-process p50 ms |", "|---|---|---|---|"]
    inproc = {r["variant"]: r for r in b.get("in_process", {}).get("rows", []) if r["batch"] == 1}
    for model, mm in b.get("served", {}).get("models", {}).items():
        r = mm["rows"][0]
        fmt = model.rsplit("_", 1)[-1]
        ip = inproc.get("aoti_buckets" if fmt == "aoti" else fmt, {})
        lines.append(f"| {model} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {ip.get('p50_ms', float('nan')):.2f} |")
    noop = (b.get("served", {}).get("noop", {}).get("rows") or [{}])[0]
    if noop.get("n"):
        lines.append(f"| (no-op floor) | {noop['p50_ms']:.2f} | {noop['p99_ms']:.2f} | |")
    return lines


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="run folder (default: runs/<timestamp>; with --from: the newest run)")
    p.add_argument("--config", default=None, help="TOML or YAML file with [train] [export] [repo] [serve] [bench] [run] sections")
    p.add_argument("--from", dest="start", default="train", metavar="STAGE",
                   help=f"start at this stage, reusing the run folder's earlier outputs: {', '.join(STAGES)}")
    p.add_argument("--overwrite", action="store_true",
                   help="redo a run folder whose training wrote checkpoints from training, replacing them")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any stage option, e.g. --set train.epochs=3 --set bench.requests=50 (repeatable)")
    p.add_argument("--arch", default=None, help="shortcut for --set train.arch=...")
    p.add_argument("--data", default=None, help="shortcut for --set train.data=... (digits, synthetic or an ImageFolder path)")
    p.add_argument("--epochs", type=int, default=None, help="shortcut for --set train.epochs=...")
    p.add_argument("--nproc", type=int, default=None, help="shortcut for --set train.nproc=... (0: auto)")
    p.add_argument("--amp", choices=["off", "bf16", "fp16"], default=None, help="shortcut for --set train.amp=...")


def main_run(ns: argparse.Namespace) -> int:
    file_cfg = load_config_file(ns.config) if ns.config else {}
    shortcuts = {"arch": ns.arch, "data": ns.data, "epochs": ns.epochs, "nproc": ns.nproc, "amp": ns.amp}
    settings = resolve_settings(file_cfg, ns.sets, shortcuts)
    if ns.out:
        run_dir = Path(ns.out)
    elif ns.start != "train":
        runs = sorted((p for p in Path("runs").glob("*") if (p / "run.json").exists()), key=lambda p: p.stat().st_mtime)
        if not runs:
            raise ConfigError(f"--from {ns.start}: no earlier run under runs/; pass --out RUN_DIR")
        run_dir = runs[-1]
        print(f"--from {ns.start}: continuing {run_dir}")
    else:
        run_dir = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    train_cfg = _stage_configs(settings, layout(run_dir))[0]  # validate every section before any work starts
    if ns.start == "train":  # and where training would run (fp16 needs CUDA), before the run folder is made
        from train.loop import resolve_device

        try:
            resolve_device(train_cfg)
        except ConfigError as e:
            raise _in_run_terms("train", type(train_cfg), e) from None
    run_pipeline(run_dir, settings, ns.start, overwrite=ns.overwrite)
    return 0



