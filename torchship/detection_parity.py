"""Parity for detectors (torchship.detectors.TopK's outputs): an artifact's detections are matched to the
reference's by label and IoU, not element by element, because between two correct runs two boxes of nearly
equal score may swap places, and a box near the score threshold, an NMS tie or the K-th place may appear or
disappear.

The bounds are derived as parity.derive's are: a matched box's coordinates and score may differ from the
reference by MULTIPLE x eager float32's own error on the same detections, plus a floor. Every detection left
unmatched must be such an exception (within the score bound of the threshold or of the K-th score, or in an NMS
tie: a box of its label whose IoU with it lies within reach of the NMS threshold); each is named in the report.
On the real samples, the artifact's mAP against the reference's detections must reach MIN_MAP."""

from __future__ import annotations

from typing import Any

import numpy as np

from .boxes import Letterbox, iou
from .manifest import RANDOM_SETS
from .parity import EPS, FLOOR_EPS, MULTIPLE
from .parity import gate_words as parity_gate_words

OUTPUTS = ("boxes", "scores", "labels", "count")
PASS_RULE = (
    "Detections, not elements: each of the artifact's detections is paired with the reference's of its label that "
    "it overlaps most (IoU above 0.5, each box taken as at least one pixel wide and high); a pair's box coordinates "
    "and score must lie within their bounds, every detection left unpaired must sit within the score bound of the "
    "threshold or of the K-th score, or in an NMS tie (each such exception is named below), and on the real samples "
    "the artifact's mAP against the reference's detections must reach the minimum."
)
MATCH_IOU = 0.5  # a detection is paired with the reference's of its label that it overlaps most, above this
MIN_SIDE = 1.0  # pixels: for pairing and mAP a box is at least this wide and high (one clipped to an edge has none)
MIN_MAP = 0.99  # the artifact's mAP against the reference's detections, on the real samples


def pictures(outs: dict[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each picture's detections (boxes [n, 4], scores [n], labels [n]) from TopK's outputs."""
    out = []
    for i, n in enumerate(np.asarray(outs["count"]).reshape(-1).astype(int)):
        out.append((outs["boxes"][i, :n], outs["scores"][i, :n], outs["labels"][i, :n]))
    return out


def solid(boxes: np.ndarray) -> np.ndarray:
    """``boxes`` [n, 4] xyxy with each side shorter than MIN_SIDE widened to it about its centre: a box of no
    width or height (clipped to the picture's edge, or an untrained model's) overlaps nothing, not even its own
    copy, so without this two runs that agree on it could never be paired."""
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    centre, side = (b[:, :2] + b[:, 2:]) / 2, b[:, 2:] - b[:, :2]
    short = side < MIN_SIDE
    return np.concatenate(
        [np.where(short, centre - MIN_SIDE / 2, b[:, :2]), np.where(short, centre + MIN_SIDE / 2, b[:, 2:])], axis=1
    )


def match(ref, got) -> list[tuple[int, int]]:
    """(reference index, artifact index) pairs: each reference detection, highest score first, with the unpaired
    artifact detection of its label that overlaps it most (IoU of their solid boxes above MATCH_IOU)."""
    (rb, _, rl), (gb, _, gl) = ref, got
    if not len(rb) or not len(gb):
        return []
    overlap = iou(solid(rb), solid(gb))
    pairs, used = [], set()
    for i in range(len(rb)):
        best, j_best = MATCH_IOU, None
        for j in np.flatnonzero(gl == rl[i]):
            if j not in used and overlap[i, j] > best:
                best, j_best = overlap[i, j], int(j)
        if j_best is not None:
            used.add(j_best)
            pairs.append((i, j_best))
    return pairs


def pair_errors(ref, got, pairs) -> tuple[float, float]:
    """The largest box-coordinate and score differences over ``pairs`` (match's) of two pictures' detections."""
    box = max((float(np.abs(ref[0][i].astype(np.float64) - got[0][j]).max()) for i, j in pairs), default=0.0)
    score = max((abs(float(ref[1][i]) - float(got[1][j])) for i, j in pairs), default=0.0)
    return box, score


def derive(reference, eager, dtype: str, fp64: bool, why: str = "", k: int = 100, sets=None) -> dict[str, Any]:
    """The tolerances of a detector's export (parity.derive's counterpart): the boxes' and the scores' bounds
    from eager float32's error against the reference on the detections the two share, set by set (``sets``
    names them). On noise a detector's near-tied proposals and boxes move with rounding far more than on
    pictures, so each random set is held to its own bound, and the export's bound (what the real samples, the
    served checks and the picture files are held to) comes from the sets of real inputs alone where it has any."""
    multiple = MULTIPLE if fp64 else 1.0
    names = list(sets or [f"set{s}" for s in range(len(reference["count"]))])
    per_set = {}
    for s, key in enumerate(names):
        box_err = score_err = box_scale = 0.0
        refs = pictures({o: reference[o][s] for o in OUTPUTS})
        lows = pictures({o: eager[o][s] for o in OUTPUTS})
        for r, g in zip(refs, lows):
            box_scale = max(box_scale, float(np.abs(r[0]).max(initial=0.0)))
            b, s_ = pair_errors(r, g, match(r, g))
            box_err, score_err = max(box_err, b), max(score_err, s_)
        per_set[key] = (box_err, score_err, box_scale)
    real = [key for key in names if not key.startswith(RANDOM_SETS)] or names
    box_err, score_err, box_scale = (max(per_set[key][i] for key in real) for i in range(3))

    def bounds(box_err: float, score_err: float, box_scale: float) -> dict[str, float]:
        return {
            "boxes": multiple * box_err + FLOOR_EPS * EPS[dtype] * max(box_scale, 1.0),
            "scores": multiple * score_err + FLOOR_EPS * EPS[dtype],
        }

    export = bounds(box_err, score_err, box_scale)
    outputs = {
        "boxes": {"atol": export["boxes"], "rtol": 0.0, "eager_error": box_err},
        "scores": {"atol": export["scores"], "rtol": 0.0, "eager_error": score_err},
        "labels": {"atol": 0.0, "rtol": 0.0, "exact": True},
        "count": {"atol": 0.0, "rtol": 0.0, "exact": True},
    }
    rule = {"rule": "detection", "multiple": multiple, "floor_eps": FLOOR_EPS, "fp64": fp64, "why": why}
    tol = {**rule, "dtype": dtype, "outputs": outputs, "min_map": MIN_MAP, "k": k}
    own = {key: bounds(*per_set[key]) for key in names if key not in real}
    return {**tol, "set_bounds": own} if own else tol


def for_set(tol: dict[str, Any], key: str) -> dict[str, Any]:
    """``tol`` with the boxes' and scores' bounds of the input set ``key`` where it has its own (derive's)."""
    own = tol.get("set_bounds", {}).get(key)
    if not own:
        return tol
    outputs = {o: {**t, "atol": own[o]} if o in own else t for o, t in tol["outputs"].items()}
    return {**tol, "outputs": outputs}


def exception(d: int, mine, other, tol: dict[str, Any], det: dict[str, Any]) -> str | None:
    """Why detection ``d`` of ``mine`` (a picture's detections) may be missing from ``other``, or None: its score
    within the bound of the threshold or of a full picture's K-th score, or an NMS tie with a box of its label."""
    box_tol, score_tol = tol["outputs"]["boxes"]["atol"], tol["outputs"]["scores"]["atol"]
    boxes, scores, labels = mine
    s = float(scores[d])
    if det.get("score_thresh") is not None and abs(s - det["score_thresh"]) <= score_tol:
        return f"score {s:.4f} within {score_tol:.2g} of the threshold {det['score_thresh']:g}"
    for sc in (scores, other[1]):
        if len(sc) >= tol["k"] and abs(s - float(sc[-1])) <= score_tol:
            return f"score {s:.4f} within {score_tol:.2g} of the K-th score {float(sc[-1]):.4f}"
    if det.get("iou_thresh") is None:  # a wrapper of the user's that did not say its NMS threshold
        return None
    side = max(float(np.min(boxes[d, 2:] - boxes[d, :2])), MIN_SIDE)
    reach = 4 * box_tol / side + 1e-6  # how far a box error within the bound moves an IoU (NMS's own, of the boxes)
    others = np.arange(len(scores)) != d
    for b, sc, lab in ((boxes[others], scores[others], labels[others]), other):
        same = np.flatnonzero(lab == labels[d])
        if not len(same):
            continue
        overlap = iou(boxes[d : d + 1], b[same])[0]
        near = np.abs(overlap - det["iou_thresh"]) <= reach
        if near.any():
            return (
                f"an NMS tie: IoU {float(overlap[near][0]):.4f} with a box of its label (NMS at {det['iou_thresh']:g})"
            )
        tied = (overlap > det["iou_thresh"] - reach) & (np.abs(sc[same] - s) <= 2 * score_tol)
        if tied.any():
            return f"an NMS tie: a box of its label overlapping it, its score within {2 * score_tol:.2g}"
    return None


def check_set(got: dict[str, np.ndarray], want: dict[str, np.ndarray], tol, det, what: str, batch: int, real: bool):
    """(row, failures) of one input set: every detection matched within the bounds or named as an exception; on
    the real samples (``real``) the mAP against the reference too."""
    row: dict[str, Any] = {"batch": batch, "bound": tol["outputs"]["boxes"]["atol"], "exceptions": []}
    if got.get("count") is not None and got["count"].size == want["count"].size:  # served: [batch, 1]
        got = {**got, "count": got["count"].reshape(want["count"].shape)}
    missing = [o for o in OUTPUTS if got.get(o) is None or got[o].shape != want[o].shape]
    if missing:
        o = missing[0]
        shape = "no such output" if got.get(o) is None else f"shape {list(got[o].shape)}, eager {list(want[o].shape)}"
        return {**row, "pass": False}, [f"{what} output {o!r}: {shape}"]
    failures: list[str] = []
    box_err = score_err = 0.0
    box_tol, score_tol = tol["outputs"]["boxes"]["atol"], tol["outputs"]["scores"]["atol"]
    refs, gots = pictures(want), pictures(got)
    for p, (r, g) in enumerate(zip(refs, gots)):
        pairs = match(r, g)
        b, s = pair_errors(r, g, pairs)
        box_err, score_err = max(box_err, b), max(score_err, s)
        for side, mine, other, idx in (
            ("eager", r, g, {i for i, _ in pairs}),
            ("artifact", g, r, {j for _, j in pairs}),
        ):
            for d in sorted(set(range(len(mine[1]))) - idx):
                label, box = int(mine[2][d]), np.round(mine[0][d], 1).tolist()
                why = exception(d, mine, other, tol, det)
                if why is None:
                    failures.append(
                        f"{what}: picture {p}: {side}'s label {label} box {box} score {float(mine[1][d]):.4f} has no "
                        f"match in the {'artifact' if side == 'eager' else 'reference'}"
                    )
                else:
                    row["exceptions"].append(f"picture {p}: {side}'s label {label} box {box}: {why}")
    row.update(max_abs=box_err, score_error=score_err, score_bound=score_tol)
    if box_err > box_tol:
        failures.append(f"{what}: a matched box is {box_err:.3g} pixels off, beyond the bound {box_tol:.3g}")
    if score_err > score_tol:
        failures.append(f"{what}: a matched score is {score_err:.3g} off, beyond the bound {score_tol:.3g}")
    if real:
        row["map"] = mean_ap(refs, gots)
        if row["map"] < tol["min_map"]:
            failures.append(f"{what}: mAP {row['map']:.4f} against eager's detections, below {tol['min_map']:g}")
    row["pass"] = not failures
    return row, failures[:5] + ([f"... and {len(failures) - 5} more"] if len(failures) > 5 else [])


def mean_ap(refs, gots, key: str = "map") -> float:
    """COCO mAP (IoU 0.5 to 0.95; ``key`` "map50": at 0.5) of ``gots`` against ``refs`` taken as the truth
    (torchship.coco)."""
    from .coco import coco_map

    truths, found = [(solid(b), lab) for b, _, lab in refs], [(solid(b), s, lab) for b, s, lab in gots]
    got = coco_map(truths, found, at50_only=key == "map50")[key]
    return 1.0 if got < 0 and not any(len(r[0]) for r in refs) else got  # -1: no detection to find at all


def check_sets(manifest: dict[str, Any], ref, got, tol: dict[str, Any], name: str, sets=None) -> list[tuple]:
    """parity.check_float_sets' counterpart for a detector: (set, "boxes", row, failure or None) per set."""
    det, real = manifest["detection"], manifest["reference"].get("samples")
    out = []
    for key, batch in (manifest["reference"]["sets"] if sets is None else sets).items():
        have = {o: got(key, o) for o in OUTPUTS}
        want = {o: ref[f"expected/{key}/{o}"] for o in OUTPUTS}
        row, failures = check_set(have, want, for_set(tol, key), det, f"{name}: {key}", batch, key == real)
        out.append((key, "boxes", row, "; ".join(failures) or None))
    return out


def picture_sizes(files: list[bytes]) -> list[tuple[int, int]]:
    """Each encoded picture's (width, height), read from its header."""
    import io

    from PIL import Image

    sizes = []
    for data in files:
        with Image.open(io.BytesIO(data)) as im:
            sizes.append(im.size)
    return sizes


def in_pictures(outs: dict[str, np.ndarray], sizes: list[tuple[int, int]], size: int):
    """(``outs`` with each picture's boxes mapped from the ``size`` square to the picture's own pixels, as the
    served image entry answers; the factor by which that stretches a box error, the largest over the pictures)."""
    boxes = np.array(outs["boxes"], dtype=np.float32)
    for i, ((w, h), n) in enumerate(zip(sizes, np.asarray(outs["count"]).reshape(-1).astype(int))):
        boxes[i, :n] = Letterbox(w, h, size).to_picture(boxes[i, :n])
    return {**outs, "boxes": boxes}, max((max(w, h) / size for w, h in sizes), default=1.0)


def stretched(tol: dict[str, Any], factor: float) -> dict[str, Any]:
    """A detector's tolerances with the box bound multiplied by ``factor`` (boxes in a picture's pixels)."""
    boxes = {**tol["outputs"]["boxes"], "atol": tol["outputs"]["boxes"]["atol"] * factor}
    return {**tol, "outputs": {**tol["outputs"], "boxes": boxes}}


def for_picture_files(outs: dict[str, np.ndarray], files: list[bytes], tol: dict[str, Any], size: int):
    """What the image entry must answer for ``files``: the reference's detections on training's tensors of them
    (``outs``) mapped into each picture's pixels, and ``tol`` with the box bound stretched by that mapping."""
    mapped, factor = in_pictures(outs, picture_sizes(files), size)
    return mapped, stretched(tol, factor)


def summary_rows(entries: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of a detector's verification in one table: per artifact, its worst box and score errors
    over the sets beside their bounds, its mAP against eager on the real samples, and its unpaired detections."""
    header = ["artifact", "box error px", "its bound", "score error", "its bound", "mAP vs eager", "unpaired", "result"]
    rows = []
    for name, entry in entries.items():
        sets = list(entry.get("sets", {}).values())
        gated = next((r for r in sets if "map50" in r), None)
        if entry.get("quantized"):  # a reduced precision: its gate's figures, not a bound
            figures = f"mAP@50 {gated['map50']:.4f} (float32 {gated['eager_map50']:.4f})" if gated else "-"
            rows.append([name, "-", "gate", "-", "gate", figures, "-", "pass" if entry["pass"] else "FAIL"])
            continue
        worst = {k: max((r.get(k, 0.0) for r in sets), default=0.0) for k in ("max_abs", "bound", "score_error")}
        maps = [r["map"] for r in sets if "map" in r]
        rows.append(
            [
                name,
                f"{worst['max_abs']:.2e}",
                f"{worst['bound']:.2e}",
                f"{worst['score_error']:.2e}",
                f"{max((r.get('score_bound', 0.0) for r in sets), default=0.0):.2e}",
                f"{min(maps):.4f}" if maps else "-",
                str(sum(len(r.get("exceptions", [])) for r in sets)),
                "pass" if entry["pass"] else "FAIL",
            ]
        )
    return header, rows


def report_lines(entries: dict[str, Any]) -> list[str]:
    """parity.md's detection section: each artifact's mAP against eager on the real samples, and its exceptions."""
    lines = ["", "Detections, per artifact:", ""]
    for name, entry in entries.items():
        rows = entry.get("sets", {}).values()
        maps = [r["map"] for r in rows if "map" in r]
        excepted = [e for r in rows for e in r.get("exceptions", [])]
        lines.append(
            f"- `{name}`: "
            + (f"mAP {maps[0]:.4f} against eager's detections on the real samples; " if maps else "")
            + (f"{len(excepted)} unpaired detection(s), each an exception:" if excepted else "every detection paired")
        )
        lines += [f"  - {e}" for e in excepted[:20]] + (
            [f"  - ... {len(excepted) - 20} more"] if len(excepted) > 20 else []
        )
    return lines


# A detector's reduced precisions (INT8, bf16) are gated on its held-out pictures, float32's detections (eager's,
# the reference's) beside them: the mAP@50 against the ground truth may fall by at most max_map50_drop from
# float32's (Ultralytics' figure between its formats is 0.001); the mAP@50 against float32's detections, taken as
# the truth, must reach min_map50_vs_float32; and the mean score change of the detections paired with float32's
# must stay within max_score_shift (quantization moves scores both ways; a wrong scale moves them all one way).
REDUCED_GATE = {"max_map50_drop": 0.01, "min_map50_vs_float32": 0.95, "max_score_shift": 0.01}
TRUTH = "truth"  # the reference's ground truth of the real pictures: truth/<set>/boxes, labels, count


def truths(ref, real: str) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Each real picture's ground-truth (boxes, labels), from the reference, or None where it records none."""
    if f"{TRUTH}/{real}/count" not in ref:
        return None
    boxes, labels = ref[f"{TRUTH}/{real}/boxes"], ref[f"{TRUTH}/{real}/labels"]
    return [(boxes[i, :n], labels[i, :n]) for i, n in enumerate(ref[f"{TRUTH}/{real}/count"].astype(int))]


def reduced_row(got: dict[str, np.ndarray], want: dict[str, np.ndarray], truth) -> dict[str, Any]:
    """The gate's figures of a reduced precision's detections ``got`` against float32's ``want`` on the real
    pictures, whose ground truth is ``truth``; with the largest box and score changes of the paired detections."""
    from .coco import coco_map

    gots, refs = pictures(got), pictures(want)
    truths = [(solid(b), lab) for b, lab in truth]
    mine = coco_map(truths, [(solid(b), s, lab) for b, s, lab in gots], at50_only=True)["map50"]
    eager = coco_map(truths, [(solid(b), s, lab) for b, s, lab in refs], at50_only=True)["map50"]
    agree = mean_ap(refs, gots, "map50")
    shifts, boxes = [], []
    for r, g in zip(refs, gots):
        for i, j in match(r, g):
            shifts.append(float(g[1][j]) - float(r[1][i]))
            boxes.append(float(np.abs(g[0][j].astype(np.float64) - r[0][i]).max()))
    return {
        "map50": round(mine, 4),
        "eager_map50": round(eager, 4),
        "map50_drop": round(eager - mine, 4),
        "map50_vs_float32": round(agree, 4),
        "score_shift": round(float(np.mean(np.abs(shifts))) if shifts else 0.0, 4),
        "max_score_change": max(np.abs(shifts), default=0.0),
        "max_box_change": max(boxes, default=0.0),
        "paired": len(shifts),
    }


def check_reduced_sets(manifest: dict[str, Any], ref, got, gate: dict[str, float], name: str, rows) -> list[str]:
    """parity.check_quantized_sets' counterpart for a detector: every set's outputs of float32's shapes and
    finite; on the real pictures the gate (REDUCED_GATE's figures, ``gate``'s where it names them). Fills ``rows``
    by set; returns the failures."""
    real = manifest["reference"].get("samples")
    truth = truths(ref, real) if real else None
    failures = (
        []
        if truth is not None
        else [
            f"{name}: a reduced-precision detector is gated on pictures with their ground-truth boxes, and this export "
            "has none (export a detection checkpoint: its held-out pictures carry them)"
        ]
    )
    for key, batch in manifest["reference"]["sets"].items():
        have = {o: got(key, o) for o in OUTPUTS}
        want = {o: ref[f"expected/{key}/{o}"] for o in OUTPUTS}
        what = f"{name}: {key}"
        problems = [
            f"{what} output {o!r}: "
            + ("no such output" if have[o] is None else f"shape {list(have[o].shape)}, eager {list(want[o].shape)}")
            for o in OUTPUTS
            if have[o] is None or have[o].size != want[o].size
        ]
        problems += [
            f"{what} output {o!r}: not finite"
            for o in ("boxes", "scores")
            if not problems and not np.all(np.isfinite(have[o]))
        ]
        row: dict[str, Any] = {"batch": batch, "gate": {**REDUCED_GATE, **gate}}
        if not problems and key == real and truth is not None:
            have["count"] = have["count"].reshape(want["count"].shape)
            row.update(reduced_row(have, want, truth))
            problems += reduced_failures(row, row["gate"], what)
        row["pass"] = not problems
        rows[key] = row
        failures += problems
    return failures


def reduced_failures(row: dict[str, Any], gate: dict[str, float], what: str) -> list[str]:
    """Where the figures of reduced_row break the gate, in words."""
    out = []
    if round(row["map50_drop"], 6) > gate["max_map50_drop"]:
        out.append(
            f"{what}: mAP@50 {row['map50']:.4f} against the ground truth, float32's {row['eager_map50']:.4f}: a "
            f"drop beyond {gate['max_map50_drop']:g}"
        )
    if row["map50_vs_float32"] < gate["min_map50_vs_float32"]:
        out.append(
            f"{what}: mAP@50 {row['map50_vs_float32']:.4f} against float32's detections, below "
            f"{gate['min_map50_vs_float32']:g}"
        )
    if row["score_shift"] > gate["max_score_shift"]:
        out.append(
            f"{what}: the {row['paired']} detections paired with float32's moved their scores by "
            f"{row['score_shift']:.4f} on average, beyond {gate['max_score_shift']:g}"
        )
    return out


def gate_words(row: dict[str, Any]) -> str:
    """A detector's reduced-precision gate figures in a few words (``row``: check_reduced_sets' on the real
    pictures, its gate in it or beside its figures)."""
    return parity_gate_words({**REDUCED_GATE, **row.get("gate", {}), **row})
