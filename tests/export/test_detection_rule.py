"""The detection rule on hand-made detections: boxes with no width or height (clipped to an edge, or an
untrained model's) are paired with their copies, and one moved is not excused as an NMS tie."""

import numpy as np

from torchship import detection_parity as dp

TOL = {"outputs": {"boxes": {"atol": 1e-3}, "scores": {"atol": 1e-4}}, "k": 100, "min_map": dp.MIN_MAP}
DET = {"score_thresh": 0.05, "iou_thresh": 0.5}


def detections(boxes, scores, labels):
    """TopK's outputs for one picture, padded to K = 6."""
    n, k = len(scores), 6
    out = {
        "boxes": np.zeros((1, k, 4), np.float32),
        "scores": np.zeros((1, k), np.float32),
        "labels": np.zeros((1, k), np.int64),
        "count": np.array([n], np.int64),
    }
    out["boxes"][0, :n], out["scores"][0, :n], out["labels"][0, :n] = boxes, scores, labels
    return out


REF = detections(
    [[10, 10, 60, 80], [0, 40, 0, 90], [5, 200, 120, 200], [30, 30, 30, 30]],  # a box, then three with no area
    [0.9, 0.8, 0.7, 0.6],
    [1, 1, 1, 1],
)


def test_boxes_with_no_area_are_paired_with_their_copies():
    got = {**REF, "boxes": REF["boxes"] + np.float32(2e-4)}  # within the bound
    row, failures = dp.check_set(got, REF, TOL, DET, "art: real", 1, real=True)
    assert failures == [] and row["exceptions"] == [] and row["map"] == 1.0


def test_a_box_with_no_area_moved_is_unpaired_and_not_excused_as_an_nms_tie():
    boxes = REF["boxes"].copy()
    boxes[0, 1] += [5, 0, 5, 0]  # the edge box [0, 40, 0, 90] moved 5 pixels right
    row, failures = dp.check_set({**REF, "boxes": boxes}, REF, TOL, DET, "art: random", 1, real=False)
    assert len(failures) == 2 and all("has no match" in f for f in failures), (failures, row["exceptions"])
    assert "box [0.0, 40.0, 0.0, 90.0]" in failures[0] and "box [5.0, 40.0, 5.0, 90.0]" in failures[1]
