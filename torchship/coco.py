"""COCO box mAP by pycocotools' own evaluator (COCOeval, with COCO's thresholds): the figure of every mAP in
torchship, the training gate and an artifact's agreement with eager alike. pycocotools is imported alone, in a
fraction of a second; a metrics framework around it would cost each process that scores a detector seconds.

A picture's truth is (boxes, labels) and its detections (boxes, scores, labels): numpy arrays, boxes [N, 4] as
x0, y0, x1, y1 in pixels. Each class is averaged over the pictures (COCO's macro average); a class with no true
box counts for nothing."""

from __future__ import annotations

import contextlib
import io
from typing import Sequence

import numpy as np

Truth = tuple[np.ndarray, np.ndarray]  # boxes [N, 4] xyxy, labels [N]
Found = tuple[np.ndarray, np.ndarray, np.ndarray]  # boxes [N, 4] xyxy, scores [N], labels [N]


def _dataset(pictures) -> dict:
    """A COCO dataset dict of ``pictures``, each (boxes, labels, scores or None): one image a picture (its index
    as id), one annotation a box (ids from 1: COCOeval takes id 0 for "unmatched"), xywh with the box's own area."""
    annotations = []
    for image, (boxes, labels, scores) in enumerate(pictures):
        labels = np.asarray(labels).reshape(-1)
        scores = None if scores is None else np.asarray(scores, np.float64).reshape(-1)
        for k, (x0, y0, x1, y1) in enumerate(np.asarray(boxes, np.float64).reshape(-1, 4).tolist()):
            w, h = x1 - x0, y1 - y0
            a = {"id": len(annotations) + 1, "image_id": image, "bbox": [x0, y0, w, h], "area": w * h, "iscrowd": 0}
            a["category_id"] = int(labels[k])
            if scores is not None:
                a["score"] = float(scores[k])
            annotations.append(a)
    return {"info": {}, "images": [{"id": i} for i in range(len(pictures))], "annotations": annotations}


ALL_AREAS = [[0.0, 1e10]]  # COCO's "all" area range, the one these figures are of


def coco_map(truths: Sequence[Truth], found: Sequence[Found], at50_only: bool = False) -> dict[str, float]:
    """{"map", "map50", "mar100"} of ``found`` against ``truths`` (one entry a picture, in the same order): COCO's
    mAP over IoU 0.50:0.95, its mAP at IoU 0.50 and its mean recall with up to 100 detections a picture. Each is
    -1 where no picture has a true box. ``at50_only``: {"map50"} alone, matched at IoU 0.50 alone.

    COCOeval matches every picture once per area range it is given, and once per IoU threshold within each: it
    is given the "all" range alone (COCO's small, medium and large figures are not read here), and for
    ``at50_only`` the 0.50 threshold alone. The figures are those of its default ranges and thresholds."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    if len(truths) != len(found):
        raise ValueError(f"{len(found)} pictures' detections against {len(truths)} pictures' truth")
    gt = _dataset([(boxes, labels, None) for boxes, labels in truths])
    if not gt["annotations"]:
        return {"map50": -1.0} if at50_only else {"map": -1.0, "map50": -1.0, "mar100": -1.0}
    dt = _dataset([(boxes, labels, scores) for boxes, scores, labels in found])
    classes = sorted({a["category_id"] for a in gt["annotations"] + dt["annotations"]})
    gt["categories"] = dt["categories"] = [{"id": c, "name": str(c)} for c in classes]
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools reports each step on stdout
        coco_gt, coco_dt = COCO(), COCO()
        coco_gt.dataset, coco_dt.dataset = gt, dt
        coco_gt.createIndex()
        coco_dt.createIndex()
        e = COCOeval(coco_gt, coco_dt, iouType="bbox")
        e.params.areaRng, e.params.areaRngLbl = ALL_AREAS, ["all"]
        if at50_only:
            e.params.iouThrs = np.array([0.5])
        e.evaluate()
        e.accumulate()
        e.summarize()
    if at50_only:
        return {"map50": float(e.stats[1])}
    return {"map": float(e.stats[0]), "map50": float(e.stats[1]), "mar100": float(e.stats[8])}
