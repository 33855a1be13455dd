"""Served parity (``infer --check``): the export's reference inputs through gRPC against eager's outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from torchship.errors import ClientError, ParityError, ShapeError
from torchship.manifest import RAW_SET, Export, gate_row, raw_files, reference_inputs, runs_tf32
from torchship.markdown import table
from torchship.names import format_of, models_of
from torchship.tasks import task_of

from .client import TritonClient
from .entries import Entry, entry_of, entry_target


def check_served(
    url: str,
    export_dir: "str | Path | Export",
    models: Sequence[str] | None = None,
    tolerances: dict[str, Any] | None = None,
    version: str = "",
) -> dict[str, Any]:
    """Send the export's reference inputs to every served model of this export (or ``models``) and compare
    with the reference outputs under the bounds the manifest records (or ``tolerances``, in its form), as
    verify does in-process. ``version``: that version of each model (default: the one unversioned requests reach).

    Returns per-model results; raises ParityError listing every mismatch (its ``report`` holds them)."""
    export = Export.of(export_dir)
    d, manifest = export.dir, export.manifest
    tol = tolerances or manifest["tolerances"]
    ref = export.reference()
    client = TritonClient(url)
    client.wait_ready()
    ready = client.require_models(models or ())
    raw_entry = entry_of(manifest)
    entry = raw_entry.name if raw_entry else None
    raw = raw_files(d, manifest) if RAW_SET in manifest["reference"] and entry in ready else []
    models = list(
        models
        or models_of(manifest, ready)
        + [m for m in ready if m == manifest["name"]]
        + [m for m in ready if m == entry and raw]
    )
    if not models:
        raise ClientError(f"no model of {manifest['name']!r} is ready at {url} (served: {', '.join(ready) or 'none'})")
    results: dict[str, Any] = {}
    failures: list[str] = []
    outputs = [o["name"] for o in manifest["outputs"]]
    for model in models:
        if model == entry:
            results[model] = {}
            failures += check_entry(client, raw_entry, export, raw, tol, version, results[model])
            continue
        rows = {}
        fmt = format_of(model, manifest, client.config(model))
        quantized = next((a for a in manifest["artifacts"] if a["format"] == fmt and a.get("gate")), None)
        tf32 = runs_tf32(manifest, fmt)
        answers = {}
        answered = {}
        for key, batch in manifest["reference"]["sets"].items():
            try:
                answers[key] = client.infer_batches(model, reference_inputs(ref, manifest, key), version)
                answered[key] = batch
            except (ClientError, ShapeError) as e:
                failures.append(f"{model}: {key}: {e}")
                rows[key] = {"batch": batch, "pass": False, "error": str(e)}
        if not quantized:

            def got(key: str, o: str, answers: dict = answers):
                return answers[key].get(o)

            check = task_of(manifest).check_sets(tf32)
            for key, o, row, failure in check(manifest, ref, got, tol, model, sets=answered):
                rows[key if len(outputs) == 1 else f"{key}/{o}"] = row
                if failure:
                    failures.append(failure)
        if quantized and len(answers) == len(manifest["reference"]["sets"]):  # the gate export verification applied
            failures += task_of(manifest).check_reduced_sets(
                manifest, ref, lambda key, o, answers=answers: answers[key].get(o), quantized["gate"], model, rows
            )
        results[model] = rows
    client.close()
    report = {
        "url": url,
        "export_dir": str(d),
        "tolerances": tol,
        "models": results,
        "pass": not failures,
        "failures": failures,
    }
    if failures:
        err = ParityError(failures, what=f"served parity at {url}")
        err.report = report
        raise err
    return report


def check_entry(
    client: TritonClient,
    raw_entry: Entry,
    export: Export,
    raw: list[tuple[str, bytes]],
    tol: dict[str, Any],
    version: str,
    rows: dict[str, Any],
) -> list[str]:
    """A raw entry from the file to the answer: each held-out file (image, or text) sent as it is, the answers
    held to the bound (or the gate) of the model behind the entry against eager on the tensors training (the
    tokenizer) made of those same files. Fills ``rows``; returns the failures."""
    manifest, ref, entry = export.manifest, export.reference(), raw_entry.name
    if not raw:
        return [
            f"{entry}: {export.dir} keeps no held-out files to send it ("
            + ("export with --text-samples)" if raw_entry.kind == "text" else "export from a checkpoint of images)")
        ]
    target = entry_target(client.config(entry))
    fmt = format_of(target, manifest, client.config(target))
    quantized = next((a for a in manifest["artifacts"] if a["format"] == fmt and a.get("gate")), None)
    outputs = [o["name"] for o in manifest["outputs"]]
    try:
        got = [
            client.infer_all(entry, {raw_entry.input: np.frombuffer(data, np.uint8)[None]}, version) for _, data in raw
        ]
    except (ClientError, ShapeError) as e:
        rows[RAW_SET] = {"batch": len(raw), "pass": False, "error": str(e)}
        return [f"{entry}: {RAW_SET}: {e}"]
    answers = {o: np.concatenate([g[o] for g in got]) for o in outputs}
    if quantized:  # a reduced precision: against its own answers on training's tensors, under its gate's floors
        files = [data for _, data in raw]
        return check_against_target(client, entry, target, export, answers, quantized, files, version, rows)
    failures, task = [], task_of(manifest)
    trained = raw_entry.kind == "image" and manifest["source"].get("kind") == "checkpoint"
    files = [data for _, data in raw]
    for o, row, failure in task.check_files(manifest, ref, answers, files, tol, entry, runs_tf32(manifest, fmt)):
        rows[RAW_SET if o is None or len(outputs) == 1 else f"{RAW_SET}/{o}"] = row
        if failure:
            failures.append(
                failure + f" (from the files in {export.dir / RAW_SET}, through the server's "
                f"{'tokenizer' if raw_entry.kind == 'text' else task.entry_step}, against "
                f"{'training' if trained else 'the export'}'s)"
            )
    return failures


def check_against_target(
    client: TritonClient,
    entry: str,
    target: str,
    export: Export,
    answers: dict[str, np.ndarray],
    artifact: dict[str, Any],
    files: list[bytes],
    version: str,
    rows: dict[str, Any],
) -> list[str]:
    """A reduced-precision model behind the entry: the entry's answers on the files against the model's own on
    the tensors training made of them (the gate held it to eager already), under the same gate, with every top-1
    the same (a detector's: matched within twice what its gate measured against float32's)."""
    ref, manifest = export.reference(), export.manifest
    mine = client.infer_batches(target, reference_inputs(ref, manifest, RAW_SET), version)
    first = manifest["outputs"][0]["name"]
    against = f"{target}'s answers on training's tensors of the same files"
    row, failures = task_of(manifest).check_own_files(
        manifest, answers, mine, files, gate_row(manifest, artifact), f"{entry}: {RAW_SET}", against
    )
    rows[RAW_SET] = {**row, "output": first}
    return failures


def served_markdown(report: dict[str, Any]) -> str:
    cells = []
    for model, rows in report["models"].items():
        for key, r in rows.items():
            cells.append(
                [
                    model,
                    key,
                    r["batch"],
                    f"{r['max_abs']:.2e}" if "max_abs" in r else "-",
                    f"{r['bound']:.2e}" if "bound" in r else "-",
                    r.get("top1_agree") or gate_text(r),
                    "pass" if r["pass"] else "FAIL",
                ]
            )
    lines = table(["model", "inputs", "batch", "max abs error", "bound", "top-1 agree", "result"], cells)
    return "\n".join(lines)


def gate_text(r: dict[str, Any]) -> str:
    """A quantized model's gate figures on the real samples, for the top-1 column: accuracy against eager's (a
    detector's mAP@50)."""
    if "map50" in r:
        return f"mAP@50 {r['map50']:.4f} (float32 {r['eager_map50']:.4f})"
    if "accuracy" in r:
        return f"accuracy {r['accuracy']:.2f} % (eager {r['eager_accuracy']:.2f} %)"
    return f"{100 * r['top1_agreement']:.1f} % agree" if "top1_agreement" in r else ""
