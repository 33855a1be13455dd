"""One verifier for every format: hashes first, then each artifact in a fresh process against the reference."""

from __future__ import annotations

import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from torchship import parity
from torchship.device import usable_cpus
from torchship.errors import OPTIONAL_HINT, ArtifactError, ParityError
from torchship.export.fresh import HostError, crash_site, exit_text, run_fresh
from torchship.io import atomic_write_text
from torchship.manifest import (
    FAILED,
    PARITY_MD,
    REFERENCE,
    STALE,
    UNVERIFIED,
    Export,
    verdict_state,
    verdicts,
    write_manifest,
)
from torchship.markdown import size, table
from torchship.runtime import LOADER_MODULES, ONNX_FORMATS
from torchship.tasks import task_of


def _run_artifact(export_dir: Path, manifest: dict, a: dict, device: str, threads: int, tmp: Path) -> dict:
    spec = {
        "export_dir": str(export_dir),
        "artifact": a,
        "reference": REFERENCE,
        "device": device,
        "threads": threads,
        "inputs": [i["name"] for i in manifest["inputs"]],
        "outputs": [o["name"] for o in manifest["outputs"]],
        "sets": list(manifest["reference"]["sets"]),
        "max_batch": manifest["max_batch"],
        "out": str(tmp / f"{a['name']}.npz"),
        "result": str(tmp / f"{a['name']}.json"),
    }
    spec_path = tmp / f"{a['name']}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    try:
        torch_runs_it, preload = a["format"] not in ONNX_FORMATS, LOADER_MODULES.get(a["format"], ())
        code, output = run_fresh(spec_path, env, torch_runs_it, preload)
    except HostError as e:
        code, output = None, str(e)
    res = (
        json.loads(Path(spec["result"]).read_text())
        if Path(spec["result"]).exists()
        else {
            "ok": False,
            "error": _runner_failure(code, output),
        }
    )
    res["seconds"] = time.perf_counter() - t0
    if res.get("ok"):
        res["outputs"] = dict(np.load(spec["out"]))
    return res


def _runner_failure(code: int | None, output: str) -> str:
    """Why a runner wrote no result: how it ended and, for a crash, the Python frame it crashed in, else its
    last line of output."""
    site = crash_site(output) if code is not None and code < 0 else ""
    last = output.strip().splitlines()[-1] if output.strip() else ""
    head = f"runner {exit_text(code)}" if code is not None else ""
    return " ".join(p for p in (head, site) if p) if site else ": ".join(p for p in (head, last) if p)


def verify_export(
    export_dir: "str | Path | Export",
    device: str | None = None,
    threads: int = 1,
    tolerances: dict[str, Any] | None = None,
    only: list[str] | None = None,
    optional: list[str] | None = None,
    log=print,
) -> dict[str, Any]:
    """Verify every artifact of an export directory (or those in ``only``) against its reference; write the
    results into its manifest and parity.md.

    Raises ArtifactError if a file is missing or its sha256 differs from the manifest. Raises ParityError
    listing every failure (a format that could not be exported, names, shapes, values, top-1) of a format
    that is not optional (the manifest's ``optional``, plus ``optional``), or when no artifact passes.
    Failures of optional formats are reported (manifest, parity.md, one line each) and left for the
    repository to skip. ``tolerances`` (the manifest's form) replaces the recorded bounds. ``export_dir`` may be
    an Export held already (its manifest is updated in place).
    """
    export = Export.of(export_dir)
    d, manifest = export.dir, export.manifest
    export.check_files()
    device = device or manifest.get("device", "cpu")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ArtifactError(
                f"{d} was exported for {device}, but no CUDA device is visible; verify on a GPU machine"
            )
    tol = tolerances or manifest["tolerances"]
    ref = export.reference()
    names = [a["name"] for a in manifest["artifacts"]]
    unknown = [n for n in only or () if n not in names]
    if unknown:  # verifying nothing would print PASS
        raise ArtifactError(f"--only {' '.join(unknown)}: {d} has no such artifact; it has {', '.join(names)}")
    arts = [a for a in manifest["artifacts"] if not only or a["name"] in only]
    in_names = [i["name"] for i in manifest["inputs"]]
    out_names = [o["name"] for o in manifest["outputs"]]
    results: dict[str, Any] = {}
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with (
        tempfile.TemporaryDirectory(prefix="torchship-verify-") as tmp,
        ThreadPoolExecutor(max_workers=max(1, min(2, usable_cpus() // threads))) as pool,
    ):
        futures = {a["name"]: pool.submit(_run_artifact, d, manifest, a, device, threads, Path(tmp)) for a in arts}
        for a in arts:
            results[a["name"]] = _judge(
                a, futures[a["name"]].result(), manifest, ref, tol, in_names, out_names, device, now
            )
    # a verdict is never lost: --only replaces the verdicts of the artifacts it ran and keeps the others'
    earlier = verdicts(manifest)
    entries = {a["name"]: results.get(a["name"], earlier.get(a["name"])) for a in manifest["artifacts"]}
    entries = {n: e for n, e in entries.items() if e is not None}
    may_fail = set(manifest.get("optional", [])) | set(optional or ())
    failures = _failures(manifest, entries, set(results))
    required = [msg for fmt, msg in failures if fmt not in may_fail]
    passed = [n for n, e in entries.items() if e["pass"] and n not in stale_names(manifest, entries)]
    verification = {
        "verified_at": now,
        "device": device,
        "tolerances": tol,
        "pass": not required and bool(passed),
        "failures": [msg for _, msg in failures],
        "optional": sorted(may_fail),
        "artifacts": entries,
    }
    manifest["verification"] = verification
    write_manifest(d, manifest)
    atomic_write_text(d / PARITY_MD, parity_markdown(manifest))
    if required or not passed:
        raise ParityError(
            required or [msg for _, msg in failures],
            what=f"verification of {d}",
            hint=f"{d / PARITY_MD} has every figure; {OPTIONAL_HINT}",
        )
    for name, entry in results.items():
        real = entry["sets"].get(manifest["reference"].get("samples") or "", {})
        if entry.get("quantized") and "map50" in real:
            log(
                f"  {name}: {task_of(manifest).gate_words(real)} on {real['batch']} pictures: "
                + ("pass" if entry["pass"] else "FAIL")
            )
        if entry.get("quantized") and "top1_agreement" in real:
            log(
                f"  {name}: "
                + (
                    f"accuracy {real['accuracy']:.2f} % beside eager's {real['eager_accuracy']:.2f} %, "
                    if "accuracy" in real
                    else ""
                )
                + f"top-1 agreement {100 * real['top1_agreement']:.1f} % "
                f"on {real['batch']} real samples, SQNR {min(real['sqnr_db'].values()):.1f} dB: "
                + ("pass" if entry["pass"] else "FAIL")
            )
    for _, msg in failures:
        log(f"  verify FAILED (optional) {msg}")
    if failures:
        log(
            f"verify: {len(passed)} of {len(manifest['artifacts'])} artifacts pass; the optional formats that failed "
            "are "
            f"reported in {PARITY_MD} and will not be served"
        )
    return verification


def _judge(
    a: dict, res: dict, manifest: dict, ref, tol: dict, in_names: list[str], out_names: list[str], device: str, now: str
) -> dict[str, Any]:
    """One artifact's verdict from what its fresh process returned: names, then shapes, then values (or the
    accuracy gate of a quantized artifact). The entry keeps its failure messages, so that a later
    ``verify --only`` of another artifact can report them again."""
    name = a["name"]
    entry: dict[str, Any] = {
        "format": a["format"],
        "verified_at": now,
        "device": device,
        "seconds": round(res["seconds"], 2),
        "sets": {},
        "pass": True,
        "peak_rss_bytes": res.get("peak_rss_bytes"),
        "failures": [],
        "made_on": {"reference": manifest["reference"]["sha256"], "files": dict(a["files"])},
    }

    def fail(msg: str) -> None:
        entry["failures"].append(msg)
        entry["pass"] = False

    if not res.get("ok"):
        entry["error"] = res.get("error")
        fail(f"{name}: failed to load or run in a fresh process: {res.get('error')}")
        return entry
    if res.get("input_names") is not None and res["input_names"] != in_names:
        fail(f"{name}: input names {res['input_names']} != manifest {in_names}")
    if res.get("output_names") is not None and res["output_names"] != out_names:
        fail(f"{name}: output names {res['output_names']} != manifest {out_names}")
    if a.get("gate"):  # a reduced precision (INT8, bf16): held to the accuracy gate, not a rounding bound
        entry["quantized"] = True
        for msg in task_of(manifest).check_reduced_sets(
            manifest, ref, lambda key, o: res["outputs"].get(f"{key}/{o}"), a["gate"], name, entry["sets"]
        ):
            fail(msg)
        return entry
    tf32 = bool(a.get("tf32"))
    if tf32:
        entry["tf32"] = True
    check = task_of(manifest).check_sets(tf32)
    for key, o, row, failure in check(manifest, ref, lambda key, o: res["outputs"].get(f"{key}/{o}"), tol, name):
        entry["sets"][f"{key}/{o}"] = {**row, "output": o}
        if failure:
            fail(failure)
    return entry


def stale_names(manifest: dict, entries: dict[str, dict]) -> set[str]:
    with_entries = {**manifest, "verification": {"artifacts": entries}}
    return {a["name"] for a in manifest["artifacts"] if verdict_state(with_entries, a) == STALE}


def _failures(manifest: dict, entries: dict[str, dict], now: set[str]) -> list[tuple[str, str]]:
    """(format, message) for every reason the export as a whole is not verified: each failed verdict (those
    not run now marked with when they were), each artifact with no verdict, each format not exported."""
    out: list[tuple[str, str]] = []
    for a in manifest["artifacts"]:
        e = entries.get(a["name"])
        state = verdict_state({**manifest, "verification": {"artifacts": entries}}, a)
        if state in (UNVERIFIED, STALE):
            out.append((a["format"], f"{a['name']}: {state} (torchship verify EXPORT_DIR --only {a['name']})"))
        elif state == FAILED:
            msgs = e.get("failures") or [f"{a['name']}: failed verification"]
            when = "" if a["name"] in now else f" (verified {e.get('verified_at', 'earlier')})"
            out += [(a["format"], m + when) for m in msgs]
    out += [
        (f["format"], f"{f['format']}: cannot be exported: {f['error']}") for f in manifest.get("export_failures", [])
    ]
    return out


def parity_markdown(manifest: dict[str, Any]) -> str:
    v = manifest["verification"]
    tol = v["tolerances"]
    lines = [
        f"# Parity: {manifest['name']} artifacts against the reference",
        "",
        f"Verified {v['verified_at']} on {v['device']}; each artifact loaded in a fresh process. "
        f"{parity.describe(tol)} {task_of(manifest).pass_rule}",
        "",
    ]
    masks = [t["name"] for t in manifest["inputs"] if t.get("values") == "mask"]
    if masks:
        lines += [
            f"**Masks:** {', '.join(f'`{m}`' for m in masks)} {'is' if len(masks) == 1 else 'are'} drawn as a "
            "tokenizer "
            "pads: each row a run of ones, at least one, then zeros. A row with no token at all is never sent by "
            "a tokenizer and has no defined answer (attention over no key): eager and ONNX, for one, disagree "
            "on such rows, so they are left out of these checks rather than failing a format on them.",
            "",
        ]
    if manifest["reference"].get("degenerate"):
        lines += [
            f"**Blind check:** eager's output {', '.join(manifest['reference']['degenerate'])} is the same for "
            "every reference input (exported with --allow-degenerate).",
            "",
        ]
    outputs = []
    for o, t in tol["outputs"].items():
        eager = f"{t['eager_error']:.2e}" if "eager_error" in t else "-"
        limit = f"{t['atol']:.2e}" + (f" + {t['rtol']:g} x reference" if t.get("rtol") else "")
        outputs.append([o, f"{t['scale']:.3g}" if "scale" in t else "-", eager, limit])
    lines += table(["output", "largest reference value", "eager's own error", "bound"], outputs)
    artifacts, quantized, tf32_notes = [], [], []
    by_name = {a["name"]: a for a in manifest["artifacts"]}
    for name, entry in v["artifacts"].items():
        if entry.get("quantized") and not entry.get("error"):
            quantized.append(quantized_row(manifest, name, by_name[name], entry))
            continue
        if entry.get("error"):
            artifacts.append([name, "-", "-", "-", "-", f"FAIL: {entry['error']}"])
            continue
        worst, bound, multiple, agree = parity.artifact_summary(entry, tol)
        optional = " (optional)" if not entry["pass"] and entry["format"] in v["optional"] else ""
        stale = name in by_name and verdict_state(manifest, by_name[name]) == STALE
        artifacts.append(
            [
                name + (" (TF32)" if entry.get("tf32") else ""),
                f"{worst:.2e}",
                f"{bound:.2e}",
                "-" if multiple is None else f"{multiple:.2f}",
                agree,
                f"NOT CURRENT: {STALE}" if stale else ("pass" if entry["pass"] else "FAIL") + optional,
            ]
        )
        if entry.get("tf32"):
            strict = max((r["strict_bound"] for r in entry["sets"].values() if "strict_bound" in r), default=0.0)
            tf32_notes.append(
                f"`{name}` was compiled with TF32 allowed (--tf32): it is held to the TF32 bound "
                f"{bound:.2e}, derived from eager run with TF32; the strict float32 bound is {strict:.2e}, "
                f"and its largest error is {worst / strict if strict else float('inf'):.1f} times that."
            )
    for a in manifest["artifacts"]:
        if a["name"] not in v["artifacts"]:
            artifacts.append([a["name"], "-", "-", "-", "-", "NOT VERIFIED"])
    for f in manifest.get("export_failures", []):
        optional = " (optional)" if f["format"] in v["optional"] else ""
        artifacts.append([f["format"], "-", "-", "-", "-", f"NOT EXPORTED{optional}: {f['error']}"])
    lines += [
        "",
        *table(["artifact", "largest error", "its bound", "x eager's error", "top-1 agree", "result"], artifacts),
    ]
    lines += [line for note in tf32_notes for line in ("", note)]
    lines += [line for note in filter(None, map(made_by, manifest["artifacts"])) for line in ("", note)]
    lines += task_of(manifest).report_lines(v["artifacts"])
    lines += [
        "",
        "What each artifact cost (export: the seconds to make it, an AOTInductor package's compile included; "
        "verify: loading and running it in a fresh process):",
        "",
        *table(
            ["artifact", "export s", "on disk", "verify s", "verify peak RSS"],
            [
                [
                    a["name"],
                    f"{a['export_seconds']:.1f}" if "export_seconds" in a else "-",
                    size(a["bytes"]) if "bytes" in a else "-",
                    f"{v['artifacts'][a['name']]['seconds']:.1f}" if a["name"] in v["artifacts"] else "-",
                    f"{v['artifacts'][a['name']]['peak_rss_bytes'] / 2**30:.2f} GiB"
                    if (v["artifacts"].get(a["name"]) or {}).get("peak_rss_bytes")
                    else "-",
                ]
                for a in manifest["artifacts"]
            ],
        ),
    ]
    task = task_of(manifest)
    if quantized and task.needs_truth:
        lines += [
            "",
            "Reduced-precision artifacts (INT8, bfloat16) are held to a gate on the held-out pictures instead of a "
            "rounding bound: their mAP@50 against the ground truth within the allowed drop of float32's, their "
            "mAP@50 against float32's detections at its floor, and the detections paired with float32's moving "
            "their scores by no more than the allowed mean; on random inputs only their shapes and finiteness are "
            "checked.",
            "",
            *table(
                ["artifact", "method", "calibrated on", "gate figures on the held-out pictures", "result"],
                [[*row[:3], *row[-2:]] for row in quantized],
            ),
        ]
        quantized = []
    if quantized:
        lines += [
            "",
            "Reduced-precision artifacts (INT8, bfloat16) are held to an accuracy gate on the real samples "
            "instead of a rounding bound (accuracy within the allowed drop of eager's where labels exist, else "
            "top-1 agreement; an SQNR floor for other outputs); on random inputs, outside what INT8 was "
            "calibrated on, only their shapes and finiteness are checked.",
            "",
            *table(
                [
                    "artifact",
                    "method",
                    "calibrated on",
                    "accuracy (eager)",
                    "drop, points (allowed)",
                    "top-1 agree with eager",
                    "SQNR dB",
                    "result",
                ],
                [[*row[:-2], row[-1]] for row in quantized],
            ),
        ]
    sets = []
    for name, entry in v["artifacts"].items():
        if entry.get("quantized"):
            continue
        for key, row in entry["sets"].items():
            sets.append(
                [
                    name,
                    f"{key.split('/')[0]} {row['output']}",
                    row["batch"],
                    f"{row['max_abs']:.2e}" if "max_abs" in row else "-",
                    f"{row['bound']:.2e}",
                    f"{row['max_rel']:.2e}" if "max_rel" in row else "-",
                    row.get("top1_agree", ""),
                    "pass" if row["pass"] else "FAIL",
                ]
            )
    lines += [
        "",
        "Per input set:",
        "",
        *table(
            ["artifact", "inputs, output", "batch", "max abs error", "bound", "max rel error", "top-1 agree", "result"],
            sets,
        ),
    ]
    lines += [
        "",
        f"**{'PASS' if v['pass'] else 'FAIL'}**" + ("" if not v["failures"] else ": " + "; ".join(v["failures"])),
        "",
    ]
    return "\n".join(lines)


def quantized_row(manifest: dict[str, Any], name: str, a: dict[str, Any], entry: dict[str, Any]) -> list[str]:
    """parity.md's row of a reduced-precision artifact: how it computes (how it was quantized) and its gate
    figures on the real samples."""
    q, row = a.get("quantization"), entry["sets"].get(manifest["reference"].get("samples") or "", {})
    cal = (q or {}).get("calibration")
    figures = task_of(manifest).gate_words(row) if "map50" in row else "-"
    acc = f"{row['accuracy']:.2f} % ({row['eager_accuracy']:.2f} %)" if "accuracy" in row else "-"
    drop = f"{row['accuracy_drop']:.2f} ({a['gate']['max_accuracy_drop']:g})" if "accuracy_drop" in row else "-"
    agree = f"{100 * row['top1_agreement']:.1f} %" if "top1_agreement" in row else "-"
    sqnr = ", ".join(f"{v:.1f}" for v in row.get("sqnr_db", {}).values()) or "-"
    bits = {"uint8": "u8", "int8": "s8"}
    how = (
        f"{q['method']}, {bits[q['activations']]} activations, {bits[q['weights']]} weights"
        + (", per channel" if q["per_channel"] else "")
        + (f", 7-bit {q.get('narrowed', 'weights')}" if q["reduce_range"] else "")
        if q
        else f"computes in {a.get('dtype', 'bfloat16')} behind float32 inputs and outputs"
    )
    return [
        name,
        how,
        f"{cal['samples']} samples ({cal['source']})" if cal else "-",
        acc,
        drop,
        agree,
        sqnr,
        figures,
        "pass" if entry["pass"] else "FAIL",
    ]


def made_by(artifact: dict[str, Any]) -> str:
    """A line saying how ``artifact`` was made where it was not made the usual way, else ''."""
    notes = []
    if artifact.get("exporter") == "torchscript":
        notes.append(f"by the TorchScript-based ONNX exporter (dynamo=False), since {artifact['exporter_why']}")
    if artifact.get("per_picture"):
        notes.append(
            "as a loop over the batch's pictures around the model traced at one picture: traced at a batch of 2, "
            "its graph held at that size alone (the model loops over its pictures in Python)"
        )
    return f"`{artifact['name']}` was made " + "; and ".join(notes) + "." if notes else ""
