"""The model zoo, end to end: each model's realistic weights through export, verify, repo, a real Triton,
``infer --check`` and a short bench, every step the command a user runs. Records per model and format
whether it passed (or why not), the seconds, the peak memory and the bytes on disk.

    python -m tests.zoo.run --out runs/zoo                    # every model (about an hour on 2 cores)
    python -m tests.zoo.run --out runs/zoo --models resnet50 bert_tiny
    python -m tests.zoo.run --out runs/zoo --docs docs/zoo.md # and write the table there

Needs the ``zoo`` extra (transformers) for the BERT and GPT-2 models; they are skipped without it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.zoo import models as zoo
from torchship.io import atomic_write_json, atomic_write_text
from torchship.procfs import RssSampler
from torchship.runtime import FP32_FORMATS  # the zoo takes every model through every fp32 format, opt-in ones too

ROOT = Path(__file__).resolve().parents[2]


def model_args(entry: zoo.Entry) -> list[str]:
    """The entry's factory arguments as --model-arg KEY=JSON values."""
    return [f"{k}={json.dumps(v)}" for k, v in entry.args.items()]


def weights_for(entry: zoo.Entry, path: Path, seed: int = 0) -> Path:
    """The entry's realistic weights (zoo.realistic) saved as a plain state_dict at ``path``."""
    import torch

    from torchship.signature import parse_signature

    flags = dict(inputs=[], dims=[], ranges=[])
    for flag, value in zip(entry.flags[::2], entry.flags[1::2]):
        flags[{"--input": "inputs", "--dim": "dims", "--input-range": "ranges"}[flag]].append(value)
    sig = parse_signature(flags["inputs"], flags["dims"], flags["ranges"])
    torch.manual_seed(seed)
    model = getattr(zoo, entry.factory)(**entry.args)
    values = {k: min(hi, max(lo, 32)) for k, (lo, hi) in sig.dims.items()}
    example = {k: torch.from_numpy(v) for k, v in sig.random_inputs(np.random.default_rng(seed), 8, values).items()}
    zoo.realistic(model, example, seed)
    torch.save(model.state_dict(), path)
    return path


def _command(argv: list[str], log: Path) -> dict[str, Any]:
    """Run a torchship command; its exit code, wall seconds and the peak RSS of its whole process tree."""
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        with RssSampler(root=proc.pid) as rss:
            code = proc.wait()
    return {"code": code, "seconds": round(time.perf_counter() - t0, 1), "peak_rss_bytes": rss.peak}


def _last_error(log: Path) -> str:
    lines = [ln for ln in log.read_text().splitlines() if "error:" in ln]
    return lines[-1].split("error:", 1)[1].strip()[:400] if lines else ""


def run_model(entry: zoo.Entry, out: Path, serve: bool = True, keep: bool = False) -> dict[str, Any]:
    """One zoo model through every stage; returns its record (also written to OUT/NAME/record.json). Its
    weights, export and repository (25 GB for mlp_2gb) are removed once it passed, unless ``keep``."""
    from torchship.manifest import read_manifest

    d = out / entry.name
    d.mkdir(parents=True, exist_ok=True)
    log = d / "commands.log"
    log.write_text("")
    rec: dict[str, Any] = {"model": entry.name, "factory": f"tests.zoo.models:{entry.factory}", "args": entry.args}
    if entry.needs and importlib.util.find_spec(entry.needs) is None:
        return {**rec, "skipped": f"needs {entry.needs} (pip install -e '.[zoo]')"}
    t0 = time.perf_counter()
    weights = weights_for(entry, d / "weights.pt")
    rec["weights_seconds"] = round(time.perf_counter() - t0, 1)
    rec["weights_bytes"] = weights.stat().st_size
    ts = [sys.executable, "-m", "torchship.pipeline.cli"]
    export = [
        *ts,
        "export",
        "--model",
        rec["factory"],
        *[a for arg in model_args(entry) for a in ("--model-arg", arg)],
        "--weights",
        str(weights),
        *entry.flags,
        *entry.export,
        "--formats",
        *(entry.formats or FP32_FORMATS),
        "--name",
        entry.name,
        "--out",
        str(d / "export"),
        "--overwrite",
    ]
    rec["export"] = _command([*export, "--no-verify"], log)
    if not (d / "export" / "manifest.json").exists():
        return {**rec, "error": f"export failed: {_last_error(log)}"}
    rec["verify"] = _command([*ts, "verify", str(d / "export")], log)
    m = read_manifest(d / "export")
    v = m.get("verification", {})
    rec["reference"] = {
        "rule": m["tolerances"]["rule"],
        "fp64": m["tolerances"]["rule"] == "fp64" or bool(m["tolerances"].get("fp64")),  # a detector's rule says
        "why": m["tolerances"].get("why", ""),
        "outputs": m["tolerances"]["outputs"],
    }
    rec["formats"] = {}
    for a in m["artifacts"]:
        e = v.get("artifacts", {}).get(a["name"], {})
        from torchship.parity import artifact_summary

        worst, bound, multiple, _ = artifact_summary(e, m["tolerances"]) if e.get("sets") else (None, None, None, "")
        rec["formats"][a["name"]] = {
            "exported": True,
            "pass": bool(e.get("pass")),
            "bytes": a["bytes"],
            "export_seconds": a["export_seconds"],
            "verify_seconds": e.get("seconds"),
            "verify_peak_rss_bytes": e.get("peak_rss_bytes"),
            "error": worst,
            "bound": bound,
            "x_eager": multiple,
            "reason": "" if e.get("pass") else _reason(v, a["name"], e),
        }
    for f in m.get("export_failures", []):
        rec["formats"][f["format"]] = {"exported": False, "pass": False, "reason": f["error"]}
    if serve and any(f["pass"] for f in rec["formats"].values()):
        rec["served"] = _serve(entry, d, ts, log)
    (d / "record.json").write_text(json.dumps(rec, indent=2))
    if not keep and not failed([rec]):
        shutil.rmtree(d / "export", ignore_errors=True)
        shutil.rmtree(d / "repo", ignore_errors=True)
        (d / "weights.pt").unlink(missing_ok=True)
    return rec


def failed(records: list[dict[str, Any]]) -> list[str]:
    """The models that failed: an error, or a format that exported and did not verify. A format the
    exporter cannot produce is reported with its reason, not counted."""
    return [
        r["model"]
        for r in records
        if r.get("error")
        or any(f["exported"] and not f["pass"] for f in r.get("formats", {}).values())
        or any(c.get("code") for c in (r.get("served", {}).get(k, {}) for k in ("repo", "check", "bench")))
    ]


def _reason(v: dict, name: str, entry: dict) -> str:
    if entry.get("error"):
        return entry["error"]
    return next((f for f in v.get("failures", []) if f.startswith(f"{name}:")), "failed")


def _serve(entry: zoo.Entry, d: Path, ts: list[str], log: Path) -> dict[str, Any]:
    """repo, a real embedded Triton, infer --check and a short bench against it."""
    from torchship.serve.config import ServeConfig
    from torchship.serve.embedded import TritonServer

    served: dict[str, Any] = {
        "repo": _command([*ts, "repo", str(d / "export"), "--out", str(d / "repo"), "--overwrite"], log)
    }
    if served["repo"]["code"]:
        return {**served, "error": _last_error(log)}
    server = TritonServer(ServeConfig(repo=str(d / "repo"), log=str(d / "tritonserver.log")))
    t0 = time.perf_counter()
    try:
        server.start()
        served["start_seconds"] = round(time.perf_counter() - t0, 1)
        served["check"] = _command([*ts, "infer", "--url", server.url, "--check", str(d / "export"), "--json"], log)
        shape = [a for s in entry.bench_shape for a in ("--shape", s)]
        served["bench"] = _command(
            [
                *ts,
                "bench",
                str(d / "export"),
                "--url",
                server.url,
                "--out",
                str(d / "bench"),
                "--skip-in-process",
                "--concurrency",
                "1",
                "4",
                "--requests",
                "40",
                "--no-plots",
                "--no-progress",
                "--no-cross-check",
                *shape,
            ],
            log,
        )
    except Exception as e:  # the record says what failed; the next model goes on
        served["error"] = f"{type(e).__name__}: {e}"
    finally:
        server.stop()
    results = d / "bench" / "results.json"
    if results.exists():
        b = json.loads(results.read_text())
        served["bench_rows"] = {
            name: [
                {k: r.get(k) for k in ("concurrency", "p50_ms", "p99_ms", "requests_per_s", "failed")}
                for r in mdl["rows"]
            ]
            for name, mdl in b.get("served", {}).get("models", {}).items()
        }
    return served


def machine() -> str:
    """The CPU with the vector extensions that decide its speed, cores, memory, GPU and versions."""
    import torch

    from torchship.device import cpu_flags, cpu_name, usable_cpus

    flags = cpu_flags()
    isa = [f for f in ("avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in flags] or [
        "avx2, no AVX-512" if "avx2" in flags else "no AVX2"
    ]
    gib = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20 if Path("/proc/meminfo").exists() else 0
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu_name()} ({', '.join(isa)}), {usable_cpus()} CPUs, {gib:.0f} GiB, {gpu}; torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


def markdown(records: list[dict[str, Any]], where: str, command: str) -> str:
    """The zoo table: one row per model and format."""
    lines = [
        "| model | format | verified | error / bound | x eager's error | served check | export s | verify s | "
        "verify peak RSS | on disk |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rec in records:
        if rec.get("skipped") or rec.get("error"):
            lines.append(f"| {rec['model']} | - | {rec.get('skipped') or rec.get('error')} | | | | | | | |")
            continue
        check = _served_models(rec)
        for fmt, f in rec["formats"].items():
            if not f["exported"]:
                lines.append(f"| {rec['model']} | {fmt} | cannot be exported: {f['reason']} | | | | | | | |")
                continue
            verdict = "pass" if f["pass"] else f"FAIL: {f['reason']}"
            ratio = f"{f['error']:.2e} / {f['bound']:.2e}" if f.get("bound") is not None else "-"
            x = f"{f['x_eager']:.2f}" if f.get("x_eager") is not None else "-"
            rss = f"{f['verify_peak_rss_bytes'] / 2**30:.2f} GiB" if f.get("verify_peak_rss_bytes") else "-"
            lines.append(
                f"| {rec['model']} | {fmt} | {verdict} | {ratio} | {x} | {check.get(fmt, '-')} | "
                f"{f['export_seconds']:.1f} | {f['verify_seconds'] or 0:.1f} | {rss} | {f['bytes'] / 1e6:,.0f} MB |"
            )
    lines += [
        "",
        "| model | weights | reference | largest output, bound | export + verify (wall) | export peak RSS | "
        "served p50 / p99 at 1 in flight (ms, fastest format) |",
        "|---|---|---|---|---|---|---|",
    ]
    for rec in records:
        if rec.get("skipped") or rec.get("error"):
            continue
        ref = "float64" if rec["reference"].get("fp64") else f"float32 ({rec['reference']['why']})"
        wall = rec["export"]["seconds"] + rec["verify"]["seconds"]
        best = _fastest(rec)
        bounds = "; ".join(
            f"{t['scale']:.3g}, {t['atol']:.2e}" if "scale" in t else f"{name} within {t['atol']:.2e}"
            for name, t in rec["reference"]["outputs"].items()
            if not t.get("exact")  # a detector's labels and count: matched exactly
        )
        lines.append(
            f"| {rec['model']} | {rec['weights_bytes'] / 1e6:,.0f} MB | {ref} | {bounds} | {wall:.0f} s | "
            f"{max(rec['export']['peak_rss_bytes'], rec['verify']['peak_rss_bytes']) / 2**30:.2f} GiB | {best} |"
        )
    return "\n".join([f"Measured with `{command}` on {where}.", "", *lines, ""])


def _served_models(rec: dict[str, Any]) -> dict[str, str]:
    """format -> the served check's verdict for the model serving it (aoti serves aoti_buckets' packages)."""
    served = rec.get("served", {})
    check = served.get("check")
    if not check:
        return {}
    verdict = "pass" if check["code"] == 0 else "FAIL"
    names = {"onnx": "onnx", "torchscript": "torchscript", "aoti_buckets": "aoti"}
    return {fmt: verdict for fmt in names}


def _fastest(rec: dict[str, Any]) -> str:
    rows = [
        (m, r)
        for m, rs in rec.get("served", {}).get("bench_rows", {}).items()
        for r in rs
        if r["concurrency"] == 1 and r.get("p50_ms") and not m.endswith("noop")
    ]
    if not rows:
        return "-"
    m, r = min(rows, key=lambda mr: mr[1]["p50_ms"])
    return f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f} ({m.rsplit('_', 1)[-1]})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.zoo.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/zoo", help="folder for each model's weights, export, repository and logs")
    p.add_argument("--models", nargs="+", default=[e.name for e in zoo.ZOO], choices=[e.name for e in zoo.ZOO])
    p.add_argument("--no-serve", dest="serve", action="store_false", help="stop after verification")
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep every model's weights, export and repository (about 60 GB "
        "in all); by default only a failed model's are kept",
    )
    p.add_argument(
        "--docs", default=None, help="also write the table into this markdown file, below its '<!-- zoo -->' line"
    )
    ns = p.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for name in ns.models:
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        rec = run_model(zoo.BY_NAME[name], out, serve=ns.serve, keep=ns.keep)
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        records.append(rec)
        atomic_write_json(out / "zoo.json", {"machine": machine(), "records": records})
        verdicts = {f: ("pass" if v["pass"] else "FAIL") for f, v in rec.get("formats", {}).items()}
        print(f"   {rec.get('skipped') or rec.get('error') or verdicts} ({rec['seconds']:.0f}s)", flush=True)
    command = "python -m tests.zoo.run" + (
        "" if ns.models == [e.name for e in zoo.ZOO] else " --models " + " ".join(ns.models)
    )
    table = markdown(records, machine(), command)
    atomic_write_text(out / "zoo.md", table)
    print(table)
    if ns.docs:
        doc = Path(ns.docs)
        head = doc.read_text().split("<!-- zoo -->")[0] if doc.exists() else ""
        atomic_write_text(doc, head + "<!-- zoo -->\n" + table)
    return 1 if failed(records) else 0


if __name__ == "__main__":
    sys.exit(main())
