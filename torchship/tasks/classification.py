"""Image (or any-input) classification: class scores out, held to their bounds and the same top-1 class."""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

import numpy as np

from .. import parity
from ..markdown import table
from .base import Task


class Classification(Task):
    name, short = "classification", "classify"
    metric, gate_setting, unit = "val_acc", "min_accuracy", "images"
    defaults = {"epochs": 3, "batch_size": 64, "lr": 2e-3}
    labels_file = True
    pass_rule = (
        "Pass: every output within its bound, and on real samples the same top-1 class, or one within the bound of "
        "it in the reference."
    )

    def records(self, record: dict[str, Any]) -> bool:
        return True  # what no other task claims

    def trains_arch(self, arch: str) -> bool:
        return True

    def build(self, meta: dict[str, Any]):
        from ..models import model_from_meta

        return model_from_meta(meta)

    def eager(self, model, meta: dict[str, Any], names: list[str], src: dict[str, Any]):
        from ..models import WithPreprocessing, named

        if "signature" in meta:
            return named(model, names, src.get("output_keys"), meta.get("inputs_by") == "keyword")
        return WithPreprocessing(model, meta["preprocessing"]["mean"], meta["preprocessing"]["std"]).eval()

    def gate_line(self, value: float, floor: float) -> str:
        return f"validation accuracy {100 * value:.2f}% (gate: >= {100 * floor:.0f}%)"

    def check_sets(self, tf32: bool):
        return partial(parity.check_float_sets, tf32=tf32)

    def summary_lines(self, manifest: dict[str, Any]) -> Optional[list[str]]:
        v = manifest["verification"]
        rows, gated = [], []
        for name, e in v["artifacts"].items():
            if e.get("quantized"):
                gated.append([name, gate_line(e, manifest), "pass" if e["pass"] else "FAIL"])
                continue
            worst, limit, multiple, top = parity.artifact_summary(e, v["tolerances"])
            rows.append(
                [
                    name,
                    f"{worst:.2e}",
                    f"{limit:.2e}",
                    "-" if multiple is None else f"{multiple:.2f}",
                    top,
                    "pass" if e["pass"] else "FAIL",
                ]
            )
        lines = [
            "",
            "## Parity against the float64 reference (worst case over held-out and random batches)",
            "",
            *table(["artifact", "largest error", "its bound", "x eager's error", "top-1 agree", "result"], rows),
        ]
        if gated:
            lines += [
                "",
                "Reduced precisions, held to the accuracy gate on the real samples instead:",
                "",
                *table(["artifact", "on the real samples", "result"], gated),
            ]
        return lines

    def decode_file(self, data: bytes, chw) -> np.ndarray:
        from ..imageio import decode_image

        return decode_image(data, {"image_size": list(chw[-2:]), "source_scale": "pixel / 255"})


def gate_line(entry: dict[str, Any], manifest: dict[str, Any]) -> str:
    """A gated artifact's figures on the real samples, in words."""
    row = entry["sets"].get((manifest.get("reference") or {}).get("samples") or "heldout", {})
    parts = []
    if "accuracy" in row:
        parts.append(f"accuracy {row['accuracy']:.2f} % beside eager's {row['eager_accuracy']:.2f} %")
    if "top1_agreement" in row:
        parts.append(f"top-1 agreement {100 * row['top1_agreement']:.1f} %")
    if row.get("sqnr_db"):
        parts.append(f"SQNR {min(row['sqnr_db'].values()):.1f} dB")
    return ", ".join(parts) or "-"
