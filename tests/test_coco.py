"""torchship's COCO mAP (pycocotools' evaluator, called directly) is torchmetrics' MeanAveragePrecision, given
COCO's own thresholds, on detections of every kind: near and far misses, wrong labels, empty pictures, classes
found and never there; matched at IoU 0.50 alone, its mAP@50."""

import numpy as np
import pytest

from torchship.coco import coco_map


def case(seed: int):
    """Twelve pictures of up to six true boxes of four classes; the detections are the true boxes moved by up to
    an eighth of their size, some relabelled or dropped, and false boxes, with random scores."""
    rng = np.random.default_rng(seed)
    truths, found = [], []
    for p in range(12):
        n = 0 if p % 5 == 0 else int(rng.integers(1, 7))
        xy = rng.uniform(0, 200, (n, 2))
        boxes = np.concatenate([xy, xy + rng.uniform(4, 80, (n, 2))], 1)
        labels = rng.integers(1, 5, n)
        keep = rng.random(n) > 0.2
        moved = boxes + rng.uniform(-1, 1, (n, 4)) * np.tile(boxes[:, 2:] - boxes[:, :2], 2) / 8
        relabelled = np.where(rng.random(n) < 0.15, rng.integers(1, 6, n), labels)
        m = int(rng.integers(0, 4))
        xy = rng.uniform(0, 200, (m, 2))
        false = np.concatenate([xy, xy + rng.uniform(4, 80, (m, 2))], 1)
        det = np.concatenate([moved[keep], false]).astype(np.float32)
        truths.append((boxes.astype(np.float32), labels))
        found.append(
            (det, rng.random(len(det)).astype(np.float32), np.concatenate([relabelled[keep], rng.integers(1, 6, m)]))
        )
    return truths, found


def by_torchmetrics(truths, found) -> dict[str, float]:
    import torch
    from torchmetrics.detection import MeanAveragePrecision

    metric = MeanAveragePrecision(
        box_format="xyxy",
        backend="pycocotools",
        iou_thresholds=np.linspace(0.5, 0.95, 10).tolist(),  # COCO's, where torchmetrics' own are float32's
        rec_thresholds=np.linspace(0.0, 1.0, 101).tolist(),
    )
    t = torch.as_tensor
    metric.update(
        [{"boxes": t(b), "scores": t(s), "labels": t(lab)} for b, s, lab in found],
        [{"boxes": t(b), "labels": t(lab)} for b, lab in truths],
    )
    got = metric.compute()
    return {"map": float(got["map"]), "map50": float(got["map_50"]), "mar100": float(got["mar_100"])}


@pytest.mark.parametrize("seed", range(6))
def test_the_map_is_torchmetrics_on_detections_of_every_kind(seed):
    truths, found = case(seed)
    ours = coco_map(truths, found)
    assert 0.05 < ours["map"] < 0.95 and ours["map"] < ours["map50"]  # neither all nor nothing found
    theirs = by_torchmetrics(truths, found)
    assert ours == pytest.approx(theirs, abs=1e-6)
    assert coco_map(truths, found, at50_only=True) == pytest.approx({"map50": theirs["map50"]}, abs=1e-6)


def test_exact_detections_score_one_and_no_truth_scores_minus_one():
    truths, _ = case(0)
    found = [(b, np.linspace(1, 0.5, len(b)), lab) for b, lab in truths]
    assert coco_map(truths, found) == {"map": 1.0, "map50": 1.0, "mar100": 1.0}
    empty = [(np.zeros((0, 4)), np.zeros(0, np.int64))] * 2
    assert coco_map(empty, [(np.ones((1, 4)), np.ones(1), np.ones(1))] * 2)["map"] == -1.0
    assert coco_map(empty, [(np.ones((1, 4)), np.ones(1), np.ones(1))] * 2, at50_only=True) == {"map50": -1.0}
    with pytest.raises(ValueError, match="2 pictures' detections against 12 pictures' truth"):
        coco_map(truths, found[:2])
