"""One verifier for every format: hashes first, then each artifact in a fresh process against eager."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from torchship.errors import ArtifactError, ParityError
from torchship.device import usable_cpus
from torchship.io import atomic_write_text
from torchship.parity import check_output
from torchship.manifest import PARITY_MD, REFERENCE, check_hashes, read_manifest, write_manifest


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
        "ok": False, "error": f"runner exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}"}
    res["seconds"] = time.perf_counter() - t0
    if res.get("ok"):
        res["outputs"] = dict(np.load(spec["out"]))
    return res


def verify_export(export_dir: str | Path, device: str | None = None, threads: int = 1,
                  tolerances: dict[str, float] | None = None, only: list[str] | None = None,
                  strict: bool = True, log=print) -> dict[str, Any]:
    """Verify every artifact of an export directory; write the results into its manifest and parity.md.

    Raises ArtifactError if a file is missing or its sha256 differs from the manifest, and
    ParityError listing every failure (names, shapes, values, top-1) otherwise. With ``strict`` False,
    artifacts that fail are reported (manifest, parity.md, one line each) and left for the repository to
    skip, and ParityError is raised only when none passes.
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
    failures: list[str] = []
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="torchship-verify-") as tmp, \
            ThreadPoolExecutor(max_workers=max(1, min(2, usable_cpus() // threads))) as pool:
        futures = {a["name"]: pool.submit(_run_artifact, d, manifest, a, device, threads, Path(tmp)) for a in arts}
        for a in arts:
            name = a["name"]
            res = futures[name].result()
            entry: dict[str, Any] = {"format": a["format"], "seconds": round(res["seconds"], 2), "sets": {}, "pass": True}
            results[name] = entry
            if not res.get("ok"):
                entry["pass"] = False
                entry["error"] = res.get("error")
                failures.append(f"{name}: failed to load or run in a fresh process: {res.get('error')}")
                continue
            # names first
            if res.get("input_names") is not None and res["input_names"] != in_names:
                failures.append(f"{name}: input names {res['input_names']} != manifest {in_names}")
                entry["pass"] = False
            if res.get("output_names") is not None and res["output_names"] != out_names:
                failures.append(f"{name}: output names {res['output_names']} != manifest {out_names}")
                entry["pass"] = False
            for key, batch in manifest["reference"]["sets"].items():
                for o in out_names:
                    row, failure = check_output(res["outputs"].get(f"{key}/{o}"), ref[f"expected/{key}/{o}"], tol,
                                                f"{name}: {key} output {o!r}", batch,
                                                top1=key == "heldout" and o == out_names[0])
                    entry["sets"][f"{key}/{o}"] = {**row, "output": o}
                    if failure:
                        failures.append(failure)
                    entry["pass"] = entry["pass"] and row["pass"]
    verification = {"verified_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": device, "tolerances": tol,
                    "pass": not failures, "failures": failures, "artifacts": results}
    manifest["verification"] = verification
    write_manifest(d, manifest)
    atomic_write_text(d / PARITY_MD, parity_markdown(manifest))
    passed = [n for n, e in results.items() if e["pass"]]
    if failures and (strict or not passed):
        raise ParityError(failures, what=f"verification of {d}")
    for f in failures:
        log(f"  verify FAILED {f}")
    if failures:
        log(f"verify: {len(passed)} of {len(results)} artifacts pass; the others are reported in {PARITY_MD} and "
            "will not be served (--strict fails on them)")
    return verification


def parity_markdown(manifest: dict[str, Any]) -> str:
    v = manifest["verification"]
    tol = v["tolerances"]
    lines = [f"# Parity: {manifest['name']} artifacts against eager", "",
             f"Verified {v['verified_at']} on {v['device']}; each artifact loaded in a fresh process. "
             f"Pass: |artifact - eager| <= {tol['atol']:g} + {tol['rtol']:g} * |eager| and equal top-1 on real samples.", "",
             "| artifact | inputs, output | batch | max abs diff | max rel diff | top-1 agree | result |",
             "|---|---|---|---|---|---|---|"]
    for name, entry in v["artifacts"].items():
        if entry.get("error"):
            lines.append(f"| {name} | - | - | - | - | - | FAIL: {entry['error']} |")
            continue
        for key, row in entry["sets"].items():
            abs_ = f"{row['max_abs']:.2e}" if "max_abs" in row else "-"
            rel = f"{row['max_rel']:.2e}" if "max_rel" in row else "-"
            lines.append(f"| {name} | {key.split('/')[0]} {row['output']} | {row['batch']} | {abs_} | {rel} | {row.get('top1_agree', '')} | "
                         f"{'pass' if row['pass'] else 'FAIL'} |")
    for f in manifest.get("export_failures", []):
        lines.append(f"| {f['format']} | - | - | - | - | - | NOT EXPORTED: {f['error']} |")
    lines += ["", f"**{'PASS' if v['pass'] else 'FAIL'}**" + ("" if v["pass"] else ": " + "; ".join(v["failures"])), ""]
    return "\n".join(lines)
