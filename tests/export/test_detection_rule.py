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


def reduced(scores_up=0.0, drop_last=False):
    """The gate's verdict on four pictures, one digit each, found by float32 exactly: the reduced precision's
    detections are float32's with every score raised by ``scores_up``, and the last picture's missed with
    ``drop_last``."""
    truth_boxes = np.array([[[10 + 20 * i, 10, 50 + 20 * i, 60]] for i in range(4)], np.float32)
    ref = {
        "expected/heldout/boxes": np.pad(truth_boxes, ((0, 0), (0, 5), (0, 0))),
        "expected/heldout/scores": np.pad(np.full((4, 1), 0.8, np.float32), ((0, 0), (0, 5))),
        "expected/heldout/labels": np.pad(np.full((4, 1), 3, np.int64), ((0, 0), (0, 5))),
        "expected/heldout/count": np.ones(4, np.int64),
        f"{dp.TRUTH}/heldout/boxes": truth_boxes,
        f"{dp.TRUTH}/heldout/labels": np.full((4, 1), 3, np.int64),
        f"{dp.TRUTH}/heldout/count": np.ones(4, np.int64),
    }
    got = {o: ref[f"expected/heldout/{o}"].copy() for o in dp.OUTPUTS}
    got["scores"][:, 0] += scores_up
    if drop_last:
        got["count"][-1], got["scores"][-1], got["boxes"][-1], got["labels"][-1] = 0, 0, 0, 0
    manifest = {"reference": {"samples": "heldout", "sets": {"heldout": 4}}}
    rows = {}
    failures = dp.check_reduced_sets(manifest, ref, lambda key, o: got[o], {}, "int8", rows)
    return rows["heldout"], failures


def test_the_reduced_precision_gate_passes_float32s_detections_and_refuses_a_drop_or_a_shift():
    row, failures = reduced()
    assert failures == [] and row["map50"] == row["eager_map50"] == 1.0 and row["map50_vs_float32"] == 1.0
    row, failures = reduced(scores_up=0.02)  # every score moved one way: a wrong scale, not rounding
    assert row["map50_drop"] == 0 and len(failures) == 1 and "moved their scores by 0.0200" in failures[0]
    row, failures = reduced(drop_last=True)  # a picture's detection lost
    assert row["map50_drop"] > 0.2 and any("a drop beyond 0.01" in f for f in failures), failures
    assert any("against float32's detections, below 0.95" in f for f in failures), failures


def test_a_reduced_detector_without_ground_truth_is_refused():
    manifest = {"reference": {"samples": "examples", "sets": {"examples": 1}}}
    ref = {f"expected/examples/{o}": REF[o] for o in dp.OUTPUTS}
    failures = dp.check_reduced_sets(manifest, ref, lambda key, o: REF[o], {}, "int8", {})
    assert failures and "gated on pictures with their ground-truth boxes" in failures[0]
