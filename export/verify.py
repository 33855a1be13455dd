"""One verifier for every format: hashes first, then each artifact in a fresh process against the reference."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from torchship import parity
from torchship.errors import OPTIONAL_HINT, ArtifactError, ParityError
from torchship.device import usable_cpus
from torchship.io import atomic_write_text
from torchship.parity import check_output
from torchship.manifest import PARITY_MD, REFERENCE, check_hashes, read_manifest, write_manifest
from torchship.markdown import table


def exit_text(code: int) -> str:
    """A child's return code in words: "exited 3", or "was killed by SIGSEGV" for a signal (a crash in native code)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (a crash inside the runtime)"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited {code}"


def _run_artifact(export_dir: Path, manifest: dict, a: dict, device: str, threads: int, tmp: Path) -> dict:
    spec = {"export_dir": str(export_dir), "artifact": a, "reference": REFERENCE, "device": device, "threads": threads,
            "inputs": [i["name"] for i in manifest["inputs"]], "outputs": [o["name"] for o in manifest["outputs"]],
            "sets": list(manifest["reference"]["sets"]), "max_batch": manifest["max_batch"],
            "out": str(tmp / f"{a['name']}.npz"), "result": str(tmp / f"{a['name']}.json")}
    spec_path = tmp / f"{a['name']}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "export.runner", str(spec_path)], capture_output=True, text=True, env=env)
    res = json.loads(Path(spec["result"]).read_text()) if Path(spec["result"]).exists() else {
        "ok": False, "error": f"runner {exit_text(proc.returncode)}: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}"}
    res["seconds"] = time.perf_counter() - t0
    if res.get("ok"):
        res["outputs"] = dict(np.load(spec["out"]))
    return res


def verify_export(export_dir: str | Path, device: str | None = None, threads: int = 1,
                  tolerances: dict[str, Any] | None = None, only: list[str] | None = None,
                  optional: list[str] | None = None, log=print) -> dict[str, Any]:
    """Verify every artifact of an export directory (or those in ``only``) against its reference; write the
    results into its manifest and parity.md.

    Raises ArtifactError if a file is missing or its sha256 differs from the manifest. Raises ParityError
    listing every failure (a format that could not be exported, names, shapes, values, top-1) of a format
    that is not optional (the manifest's ``optional``, plus ``optional``), or when no artifact passes.
    Failures of optional formats are reported (manifest, parity.md, one line each) and left for the
    repository to skip. ``tolerances`` (the manifest's form) replaces the recorded bounds.
    """
    d = Path(export_dir)
    manifest = read_manifest(d)
    problems = check_hashes(d, manifest)
    if problems:
        raise ArtifactError(f"{d}: " + "; ".join(problems))
    device = device or manifest.get("device", "cpu")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ArtifactError(f"{d} was exported for {device}, but no CUDA device is visible; verify on a GPU machine")
    tol = tolerances or manifest["tolerances"]
    ref = np.load(d / REFERENCE)
    names = [a["name"] for a in manifest["artifacts"]]
    unknown = [n for n in only or () if n not in names]
    if unknown:  # verifying nothing would print PASS
        raise ArtifactError(f"--only {' '.join(unknown)}: {d} has no such artifact; it has {', '.join(names)}")
    arts = [a for a in manifest["artifacts"] if not only or a["name"] in only]
    in_names = [i["name"] for i in manifest["inputs"]]
    out_names = [o["name"] for o in manifest["outputs"]]
    failures: list[tuple[str, str]] = []  # (format, message)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="torchship-verify-") as tmp, \
            ThreadPoolExecutor(max_workers=max(1, min(2, usable_cpus() // threads))) as pool:
        futures = {a["name"]: pool.submit(_run_artifact, d, manifest, a, device, threads, Path(tmp)) for a in arts}
        for a in arts:
            name = a["name"]
            res = futures[name].result()
            entry: dict[str, Any] = {"format": a["format"], "seconds": round(res["seconds"], 2), "sets": {}, "pass": True,
                                     "peak_rss_bytes": res.get("peak_rss_bytes")}
            results[name] = entry

            def fail(msg: str) -> None:
                failures.append((a["format"], msg))
                entry["pass"] = False
            if not res.get("ok"):
                entry["error"] = res.get("error")
                fail(f"{name}: failed to load or run in a fresh process: {res.get('error')}")
                continue
            # names first
            if res.get("input_names") is not None and res["input_names"] != in_names:
                fail(f"{name}: input names {res['input_names']} != manifest {in_names}")
            if res.get("output_names") is not None and res["output_names"] != out_names:
                fail(f"{name}: output names {res['output_names']} != manifest {out_names}")
            if a.get("quantization"):
                entry["quantized"] = True
                for msg in parity.check_quantized_sets(manifest, ref, lambda key, o: res["outputs"].get(f"{key}/{o}"),
                                                a["gate"], name, entry["sets"]):
                    fail(msg)
                continue
            for key, batch in manifest["reference"]["sets"].items():
                for o in out_names:
                    row, failure = check_output(res["outputs"].get(f"{key}/{o}"), ref[f"expected/{key}/{o}"],
                                                parity.bound(tol, o), f"{name}: {key} output {o!r}", batch,
                                                top1=key == "heldout" and o == out_names[0])
                    entry["sets"][f"{key}/{o}"] = {**row, "output": o}
                    if failure:
                        fail(failure)
    if not only:
        failures += [(f["format"], f"{f['format']}: cannot be exported: {f['error']}") for f in manifest.get("export_failures", [])]
    may_fail = set(manifest.get("optional", [])) | set(optional or ())
    required = [msg for fmt, msg in failures if fmt not in may_fail]
    passed = [n for n, e in results.items() if e["pass"]]
    verification = {"verified_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": device, "tolerances": tol,
                    "pass": not required and bool(passed), "failures": [msg for _, msg in failures],
                    "optional": sorted(may_fail), "artifacts": results}
    manifest["verification"] = verification
    write_manifest(d, manifest)
    atomic_write_text(d / PARITY_MD, parity_markdown(manifest))
    if required or not passed:
        raise ParityError(required or [msg for _, msg in failures], what=f"verification of {d}",
                          hint=f"{d / PARITY_MD} has every figure; {OPTIONAL_HINT}")
    for name, entry in results.items():
        real = entry["sets"].get(manifest["reference"].get("samples") or "", {})
        if entry.get("quantized") and "top1_agreement" in real:
            log(f"  {name}: " + (f"accuracy {real['accuracy']:.2f} % beside eager's {real['eager_accuracy']:.2f} %, "
                                 if "accuracy" in real else "") + f"top-1 agreement {100 * real['top1_agreement']:.1f} % "
                f"on {real['batch']} real samples, SQNR {min(real['sqnr_db'].values()):.1f} dB: "
                + ("pass" if entry["pass"] else "FAIL"))
    for _, msg in failures:
        log(f"  verify FAILED (optional) {msg}")
    if failures:
        log(f"verify: {len(passed)} of {len(results)} artifacts pass; the optional formats that failed are reported "
            f"in {PARITY_MD} and will not be served")
    return verification


def parity_markdown(manifest: dict[str, Any]) -> str:
    v = manifest["verification"]
    tol = v["tolerances"]
    lines = [f"# Parity: {manifest['name']} artifacts against the reference", "",
             f"Verified {v['verified_at']} on {v['device']}; each artifact loaded in a fresh process. "
             f"{parity.describe(tol)} Pass: every output within its bound, and on real samples the same top-1 "
             "class, or one within the bound of it in the reference.", ""]
    if manifest["reference"].get("degenerate"):
        lines += [f"**Blind check:** eager's output {', '.join(manifest['reference']['degenerate'])} is the same for "
                  "every reference input (exported with --allow-degenerate).", ""]
    outputs = []
    for o, t in tol["outputs"].items():
        eager = f"{t['eager_error']:.2e}" if "eager_error" in t else "-"
        limit = f"{t['atol']:.2e}" + (f" + {t['rtol']:g} x reference" if t.get("rtol") else "")
        outputs.append([o, f"{t['scale']:.3g}" if "scale" in t else "-", eager, limit])
    lines += table(["output", "largest reference value", "eager's own error", "bound"], outputs)
    artifacts, quantized = [], []
    by_name = {a["name"]: a for a in manifest["artifacts"]}
    for name, entry in v["artifacts"].items():
        if entry.get("quantized") and not entry.get("error"):
            quantized.append(quantized_row(name, by_name[name], entry, manifest["reference"].get("samples")))
            continue
        if entry.get("error"):
            artifacts.append([name, "-", "-", "-", "-", f"FAIL: {entry['error']}"])
            continue
        worst, bound, multiple, agree = parity.artifact_summary(entry, tol)
        optional = " (optional)" if not entry["pass"] and entry["format"] in v["optional"] else ""
        artifacts.append([name, f"{worst:.2e}", f"{bound:.2e}", "-" if multiple is None else f"{multiple:.2f}", agree,
                          ("pass" if entry["pass"] else "FAIL") + optional])
    for f in manifest.get("export_failures", []):
        optional = " (optional)" if f["format"] in v["optional"] else ""
        artifacts.append([f["format"], "-", "-", "-", "-", f"NOT EXPORTED{optional}: {f['error']}"])
    lines += ["", *table(["artifact", "largest error", "its bound", "x eager's error", "top-1 agree", "result"], artifacts)]
    if quantized:
        lines += ["", "Quantized artifacts are held to an accuracy gate on the real samples instead of a rounding bound "
                  "(accuracy within the allowed drop of eager's where labels exist, else top-1 agreement; an SQNR "
                  "floor for other outputs); on random inputs, outside what they were calibrated on, only their "
                  "shapes and finiteness are checked.", "",
                  *table(["artifact", "method", "calibrated on", "accuracy (eager)", "drop, points (allowed)",
                          "top-1 agree with eager", "SQNR dB", "result"], quantized)]
    sets = []
    for name, entry in v["artifacts"].items():
        if entry.get("quantized"):
            continue
        for key, row in entry["sets"].items():
            sets.append([name, f"{key.split('/')[0]} {row['output']}", row["batch"],
                         f"{row['max_abs']:.2e}" if "max_abs" in row else "-", f"{row['bound']:.2e}",
                         f"{row['max_rel']:.2e}" if "max_rel" in row else "-", row.get("top1_agree", ""),
                         "pass" if row["pass"] else "FAIL"])
    lines += ["", "Per input set:", "", *table(["artifact", "inputs, output", "batch", "max abs error", "bound", "max rel error",
                                                 "top-1 agree", "result"], sets)]
    lines += ["", f"**{'PASS' if v['pass'] else 'FAIL'}**" + ("" if not v["failures"] else ": " + "; ".join(v["failures"])), ""]
    return "\n".join(lines)


def quantized_row(name: str, a: dict[str, Any], entry: dict[str, Any], real: str | None) -> list[str]:
    """parity.md's row of a quantized artifact: how it was quantized and its gate figures on the real samples."""
    q, row = a["quantization"], entry["sets"].get(real or "", {})
    cal = q.get("calibration")
    acc = f"{row['accuracy']:.2f} % ({row['eager_accuracy']:.2f} %)" if "accuracy" in row else "-"
    drop = f"{row['accuracy_drop']:.2f} ({a['gate']['max_accuracy_drop']:g})" if "accuracy_drop" in row else "-"
    agree = f"{100 * row['top1_agreement']:.1f} %" if "top1_agreement" in row else "-"
    sqnr = ", ".join(f"{v:.1f}" for v in row.get("sqnr_db", {}).values()) or "-"
    bits = {"uint8": "u8", "int8": "s8"}
    return [name, f"{q['method']}, {bits[q['activations']]} activations, {bits[q['weights']]} weights"
                  + (", per channel" if q["per_channel"] else "") + (f", 7-bit {q.get('narrowed', 'weights')}" if q["reduce_range"] else ""),
            f"{cal['samples']} samples ({cal['source']})" if cal else "-", acc, drop, agree, sqnr,
            "pass" if entry["pass"] else "FAIL"]
