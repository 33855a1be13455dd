"""Served parity (``infer --check``): the export's reference inputs through gRPC against eager's outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from torchship.errors import ClientError, ParityError, ShapeError
from torchship.manifest import Export, reference_inputs, runs_tf32
from torchship.markdown import table
from torchship.names import format_of, models_of
from torchship.parity import check_float_sets, check_quantized_sets

from .client import TritonClient


def check_served(url: str, export_dir: "str | Path | Export", models: Sequence[str] | None = None,
                 tolerances: dict[str, Any] | None = None, version: str = "") -> dict[str, Any]:
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
    models = list(models or models_of(manifest, ready) + [m for m in ready if m == manifest["name"]])
    if not models:
        raise ClientError(f"no model of {manifest['name']!r} is ready at {url} (served: {', '.join(ready) or 'none'})")
    results: dict[str, Any] = {}
    failures: list[str] = []
    outputs = [o["name"] for o in manifest["outputs"]]
    for model in models:
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

            for key, o, row, failure in check_float_sets(manifest, ref, got, tol, model, tf32, answered):
                rows[key if len(outputs) == 1 else f"{key}/{o}"] = row
                if failure:
                    failures.append(failure)
        if quantized and len(answers) == len(manifest["reference"]["sets"]):  # the gate export verification applied
            failures += check_quantized_sets(
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
    """A quantized model's gate figures on the real samples, for the top-1 column: accuracy against eager's."""
    if "accuracy" in r:
        return f"accuracy {r['accuracy']:.2f} % (eager {r['eager_accuracy']:.2f} %)"
    return f"{100 * r['top1_agreement']:.1f} % agree" if "top1_agreement" in r else ""
