"""Detection: pictures letterboxed into a square, a fixed number of detections out (torchship.detectors.TopK),
matched to eager's by label and IoU, gated on mAP@50, and mapped back to each picture's pixels by its image
entry."""

from __future__ import annotations

import json
from functools import partial
from typing import Any, Optional

import numpy as np

from .. import detection_parity
from ..boxes import letterbox_meta
from ..errors import ConfigError
from ..markdown import table
from .base import Task

FORMATS = ("torchscript", "exported_program", "aoti", "onnx", "onnx_int8", "aoti_int8", "aoti_bf16")  # carry TopK
SHOWN_BOXES = 10  # detections torchship infer prints a picture (--json gives them all)


class Detection(Task):
    name, short = "detection", "detect"
    metric, gate_setting, unit = "map50", "min_map50", "pictures"
    options_unsupported = ("resume", "compile", "profile", "channels_last", "save_every")
    defaults = {"epochs": 10, "batch_size": 16, "lr": 3e-3}
    maps_back, tops_k = True, False
    pass_rule = detection_parity.PASS_RULE

    def records(self, record: dict[str, Any]) -> bool:
        served = {o.get("name") for o in record.get("output", []) if isinstance(o, dict)}
        return record.get("task") == self.name or "detection" in record or served == set(detection_parity.OUTPUTS)

    def trains_arch(self, arch: str) -> bool:
        from ..detectors import is_detector

        return is_detector(arch)

    def build(self, meta: dict[str, Any]):
        from ..detectors import build_detector

        return build_detector(meta["arch"], meta["num_classes"], meta["input_shape"][-1], meta.get("model_args"))

    def eager(self, model, meta: dict[str, Any], names: list[str], src: dict[str, Any]):
        from ..detectors import deployable

        return deployable(model, meta)

    def gate_line(self, value: float, floor: float) -> str:
        return f"mAP@50 {100 * value:.1f}% on the validation pictures (gate: >= {100 * floor:.0f}%)"

    needs_truth = True

    def check_formats(self, formats, dtype: str) -> None:
        other = [f for f in formats if f not in FORMATS]
        if other:
            raise ConfigError(
                f"--formats {' '.join(other)}: a detector exports to {', '.join(FORMATS)} (aoti_buckets has no "
                "batching of its fixed-size outputs)"
            )
        if dtype != "float32":
            raise ConfigError(f"--dtype {dtype}: a detector exports in float32")

    def derive(self, block: Optional[dict[str, Any]], sets: list[str]):
        return partial(detection_parity.derive, k=block["k"], sets=sets)

    def check_sets(self, tf32: bool):
        return detection_parity.check_sets

    def report_lines(self, artifacts: dict[str, Any]) -> list[str]:
        return detection_parity.report_lines(artifacts)

    def summary_lines(self, manifest: dict[str, Any]) -> Optional[list[str]]:
        header, rows = detection_parity.summary_rows(manifest["verification"]["artifacts"])
        title = "## Detections against eager's (worst case over held-out and random batches)"
        return ["", title, "", *table(header, rows)]

    def blind(self, degenerate: list[str]) -> list[str]:
        # a detector's count is the same for every picture when each fills its K: not a blind check
        return [o for o in degenerate if o == "boxes"]

    def label_parameters(self, manifest: dict[str, Any]) -> dict[str, str]:
        return {"classes": json.dumps(manifest["classes"])} if manifest.get("classes") else {}

    def response_rule(self, manifest: dict[str, Any], tol: dict[str, Any]) -> Optional[dict[str, Any]]:
        return {"tolerances": tol, "rule": manifest["detection"]}

    def reduced_gate(self, max_accuracy_drop: float) -> dict[str, Any]:
        return dict(detection_parity.REDUCED_GATE)

    def check_reduced_sets(self, manifest, ref, got, gate: dict[str, Any], name: str, rows) -> list[str]:
        return detection_parity.check_reduced_sets(manifest, ref, got, gate, name, rows)

    def gate_words(self, row: dict[str, Any]) -> str:
        return detection_parity.gate_words(row)

    def check_own_files(self, manifest, answers, mine, files: list[bytes], row, what: str, against: str):
        """The entry's detections, in each picture's pixels, against the model's own on training's tensors of the
        same files mapped back by the same letterbox, within twice the largest changes its gate measured against
        float32's (two answers, each within them of float32's)."""
        rule = self.reduced_response_rule(manifest, row)
        mapped, tol = self.for_picture_files(manifest, mine, files, rule["tolerances"])
        return detection_parity.check_set(answers, mapped, tol, manifest["detection"], what, len(files), False)

    def reduced_response_rule(self, manifest: dict[str, Any], row: dict[str, Any]) -> Optional[dict[str, Any]]:
        tol = manifest["tolerances"]
        changes = {"boxes": row.get("max_box_change", 0.0), "scores": row.get("max_score_change", 0.0)}
        outputs = {
            o: {**t, "atol": 2 * max(changes[o], t["atol"])} if o in changes else t for o, t in tol["outputs"].items()
        }
        return self.response_rule(manifest, {**tol, "outputs": outputs})

    def picture_preprocessing(self, block: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        return letterbox_preprocessing(block["letterbox"]["size"])

    def for_picture_files(self, manifest, outs, files: list[bytes], tol):
        return detection_parity.for_picture_files(outs, files, tol, manifest["detection"]["letterbox"]["size"])

    entry_step = "letterbox"

    def check_files(self, manifest, ref, answers, files: list[bytes], tol, what: str, tf32: bool) -> list[tuple]:
        """Its detections on each file, in the picture's pixels, matched to eager's on training's tensors of the
        same files mapped back by the same letterbox, under the box bound stretched by that mapping; and their mAP
        against eager's."""
        from ..manifest import RAW_SET

        want = {o: ref[f"expected/{RAW_SET}/{o}"] for o in detection_parity.OUTPUTS}
        want, bound = self.for_picture_files(manifest, want, files, tol)
        row, failures = detection_parity.check_set(
            answers, want, bound, manifest["detection"], f"{what}: {RAW_SET}", len(files), True
        )
        return [(None, row, "; ".join(failures) or None)]

    def decode_file(self, data: bytes, chw) -> np.ndarray:
        from ..imageio import decode_picture

        return decode_picture(data, chw[-1])[0]

    def answer_rows(self, outputs: dict[str, np.ndarray], cfg: dict[str, Any]) -> Optional[dict[str, Any]]:
        text = cfg.get("parameters", {}).get("classes", {}).get("string_value")
        return {"detections": detections_of(outputs, json.loads(text) if text else [])}

    def answer_lines(self, name: str, row: dict[str, Any]) -> Optional[list[str]]:
        return detections_lines(name, row["detections"]) if "detections" in row else None


def letterbox_preprocessing(size: int) -> dict[str, Any]:
    """What the served image entry does to a picture file for a detector (torchship.imageio.decode_picture): RGB,
    pixel / 255, letterboxed into a ``size`` square."""
    return {
        "image_size": [size, size],
        "channels": 3,
        "layout": "NCHW",
        "dtype": "float32",
        "value_range": [0.0, 1.0],
        "resize": "letterbox: scaled bilinearly to fit, aspect kept, at the top left, the rest 0.5",
        "source_scale": "pixel / 255",
        "letterbox": letterbox_meta(size),
    }


def detections_of(outputs: dict[str, np.ndarray], names: list[str]) -> list[dict[str, Any]]:
    """One picture's detections (its first ``count`` rows), highest score first, with their class names (label i
    is names[i - 1])."""
    n = int(np.asarray(outputs["count"]).reshape(-1)[0])
    return [
        {
            "label": int(label),
            "name": names[int(label) - 1] if 0 < int(label) <= len(names) else "",
            "score": round(float(score), 4),
            "box": [round(float(v), 1) for v in box],
        }
        for box, score, label in zip(outputs["boxes"][0, :n], outputs["scores"][0, :n], outputs["labels"][0, :n])
    ]


def detections_lines(name: str, found: list[dict[str, Any]]) -> list[str]:
    """A picture's detections: a line saying how many, then "class (score) [x0, y0, x1, y1]" for each (SHOWN_BOXES
    of them at most; --json gives them all), boxes in the picture's pixels where it came through the image entry."""
    head = f"{name}: " + (f"{len(found)} detection(s)" if found else "no detections")
    lines = [
        f"  {d['name'] or d['label']} ({d['score']:.3f}) [{', '.join(f'{v:g}' for v in d['box'])}]"
        for d in found[:SHOWN_BOXES]
    ]
    more = len(found) - SHOWN_BOXES
    return [head, *lines] + ([f"  ... {more} more (--json lists them all)"] if more > 0 else [])
