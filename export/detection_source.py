"""A detector as an export's source: a torchship detection checkpoint or a torchvision one-stage detector from
one's own weights, each behind torchship.detectors.TopK, or a user's own module that already returns the top-K
form (boxes [B, K, 4], scores [B, K], labels [B, K], count [B]). Each gives the ``detection`` block the verifier
matches detections by."""

from __future__ import annotations

from typing import Any, Optional

import torch

from torchship.boxes import letterbox_meta
from torchship.detection_parity import OUTPUTS
from torchship.detectors import TopK
from torchship.errors import ConfigError
from torchship.signature import BATCH, Signature, TensorSpec


def topk_outputs(k: int) -> list[TensorSpec]:
    """The top-K form's outputs, K detections a picture."""
    return [
        TensorSpec("boxes", "float32", [BATCH, k, 4]),
        TensorSpec("scores", "float32", [BATCH, k]),
        TensorSpec("labels", "int64", [BATCH, k]),
        TensorSpec("count", "int64", [BATCH]),
    ]


def square_side(sig: Signature, what: str) -> int:
    """S of a detector's one input, float32 [B, 3, S, S]; ConfigError naming the input otherwise."""
    t = sig.inputs[0]
    dims = t.shape[1:]
    if len(sig.inputs) != 1 or t.dtype != "float32" or len(dims) != 3 or dims[0] != 3 or dims[1] != dims[2]:
        raise ConfigError(
            f"{what} takes one picture input, --input NAME:float32:B,3,S,S (letterboxed into a square of a fixed "
            f"side S); it was given {', '.join(f'{i.name} {i.dtype} {i.shape}' for i in sig.inputs)}"
        )
    if not isinstance(dims[1], int):
        raise ConfigError(f"{what} takes pictures of one fixed size; --input {t.name} gives {dims[1]} a range")
    return int(dims[1])


def wrap_torchvision(model: torch.nn.Module, sig: Signature, log=print) -> tuple[TopK, dict[str, Any]]:
    """A torchvision FCOS or RetinaNet from one's own weights as TopK, and its detection block. Its own
    transform's resize is not in the graph: pictures come letterboxed to the input's side."""
    size = square_side(sig, f"{type(model).__name__} (a torchvision detector)")
    t = model.transform
    if tuple(t.min_size) != (size,) or t.max_size != size:
        log(
            f"note: the detector's own transform resizes pictures to min_size {t.min_size[0]} / max_size "
            f"{t.max_size}; the export takes them at {size} x {size} as they come (letterboxed), so its answers "
            f"are those of a detector built with min_size={size}, max_size={size}"
        )
    top = TopK(model, size).eval()
    return top, detection_block(top.k, top.score_thresh, top.iou_thresh, size, candidates=top.candidates)


def own_topk(model: torch.nn.Module, sig: Signature) -> Optional[dict[str, Any]]:
    """The detection block of a user's module that returns the top-K form (its outputs named boxes, scores,
    labels, count, by --output or as its dict's keys), or None for any other model. The thresholds the verifier's
    exceptions use are read from the module's ``score_thresh`` and ``iou_thresh`` (or ``nms_thresh``), where it
    has them. ConfigError for outputs so named that do not have the form's shapes."""
    names = [t.name for t in sig.outputs]
    if names != list(OUTPUTS):
        return None
    size = square_side(sig, "a detector's top-K wrapper")
    k = sig.outputs[0].shape[1]
    want = topk_outputs(k) if isinstance(k, int) else []
    got = [(t.name, t.dtype, t.shape) for t in sig.outputs]
    if got != [(t.name, t.dtype, t.shape) for t in want]:
        raise ConfigError(
            "outputs named boxes, scores, labels, count must have the top-K form, boxes float32 [B, K, 4], scores "
            "float32 [B, K], labels int64 [B, K], count int64 [B] with one fixed K; the model returns "
            + ", ".join(f"{n} {d} {s}" for n, d, s in got)
        )

    holder = thresholds_of(model)

    def attr(*names: str) -> Optional[float]:
        return next((float(getattr(holder, n)) for n in names if hasattr(holder, n)), None)

    return detection_block(k, attr("score_thresh"), attr("iou_thresh", "nms_thresh"), size)


def thresholds_of(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose ``score_thresh`` and ``iou_thresh`` (or ``nms_thresh``) are the final detections':
    ``model`` itself where it has them, else the first module inside it that keeps ``detections_per_img``
    beside them (a torchvision SSD, RetinaNet or FCOS, or a two-stage detector's RoI heads, not its region
    proposals' thresholds); ``model`` where none has."""
    if hasattr(model, "score_thresh"):
        return model
    return next(
        (
            m
            for m in model.modules()
            if all(hasattr(m, a) for a in ("score_thresh", "nms_thresh", "detections_per_img"))
        ),
        model,
    )


def detection_block(k: int, score_thresh, iou_thresh, size: int, candidates: Optional[int] = None) -> dict[str, Any]:
    """What the manifest records of a detector's fixed-shape outputs and the pictures it takes."""
    return {
        "k": int(k),
        "candidates": candidates,
        "score_thresh": score_thresh,
        "iou_thresh": iou_thresh,
        "letterbox": letterbox_meta(size),
    }
