"""The one parity rule: the bound each output is held to, and the comparator that applies it, for export
verification and served checks alike.

The reference is eager computed in float64. Eager's own error against it (fp32, or the artifact's reduced
dtype) measures how much rounding this model produces on these inputs; an artifact may round up to
``MULTIPLE`` times as much, plus a floor of ``FLOOR_EPS`` machine epsilons of the output's scale.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import numpy as np

from .signature import looks_like_mask

MULTIPLE = 10.0  # an artifact may round this many times as much as eager itself
FLOOR_EPS = 8.0  # the bound never drops below this many machine epsilons of the output's largest value
EPS = {"float32": float(np.finfo(np.float32).eps), "float16": float(np.finfo(np.float16).eps), "bfloat16": 2.0**-7}
# without a float64 reference: the bound as a fraction of the output's largest value
FALLBACK_REL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def derive(
    reference: dict[str, list[np.ndarray]], eager: dict[str, list[np.ndarray]], dtype: str, fp64: bool, why: str = ""
) -> dict[str, Any]:
    """The tolerances an export records: for each output, the bound ``atol`` (rtol 0) derived from the
    reference outputs and eager's outputs on the same inputs (lists over the reference sets).

    ``fp64``: the reference is eager in float64, so the bound is MULTIPLE x eager's own error plus the floor;
    otherwise (``why`` says why) it is FALLBACK_REL of the output's scale."""
    outputs = {}
    for name, refs in reference.items():
        scale = max((float(np.abs(r).max()) for r in refs if r.size), default=0.0)
        if not np.issubdtype(refs[0].dtype, np.floating):
            outputs[name] = {"atol": 0.0, "rtol": 0.0, "scale": scale, "exact": True}
            continue
        if fp64:
            err = max(
                (float(np.abs(e.astype(np.float64) - r).max()) for e, r in zip(eager[name], refs) if r.size),
                default=0.0,
            )
            floor = FLOOR_EPS * EPS[dtype] * scale
            outputs[name] = {
                "atol": MULTIPLE * err + floor,
                "rtol": 0.0,
                "eager_error": err,
                "scale": scale,
                "floor": floor,
            }
        else:
            outputs[name] = {"atol": FALLBACK_REL[dtype] * scale, "rtol": 0.0, "scale": scale}
    rule = (
        {"rule": "fp64", "multiple": MULTIPLE, "floor_eps": FLOOR_EPS}
        if fp64
        else {"rule": "scale", "fraction": FALLBACK_REL[dtype], "why": why}
    )
    return {**rule, "dtype": dtype, "outputs": outputs}


def given(
    outputs: Iterable[str], atol: Optional[float], rtol: Optional[float], base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Tolerances from --atol/--rtol (a flag left out counts as 0), in place of the derived bound."""
    a, r = float(atol or 0.0), float(rtol or 0.0)
    return {**(base or {}), "rule": "given", "outputs": {o: {"atol": a, "rtol": r} for o in outputs}}


def with_tf32(strict: dict[str, Any], tf32: dict[str, Any]) -> dict[str, Any]:
    """``strict`` (derive's tolerances from eager in IEEE float32) with each output's TF32 bound beside its own:
    the bound of an artifact compiled with TF32 allowed on CUDA, derived the same way from eager run with TF32."""
    out = {**strict, "outputs": {o: dict(t) for o, t in strict["outputs"].items()}}
    for o, t in tf32["outputs"].items():
        out["outputs"][o]["tf32"] = {k: t[k] for k in ("atol", "rtol", "eager_error") if k in t}
    return out


def bound(tolerances: dict[str, Any], output: str, tf32: bool = False) -> dict[str, float]:
    """{"atol", "rtol"} that ``output`` is held to: its TF32 bound for an artifact that runs with TF32
    (with_tf32; the strict bound where none was derived), else its float32 bound."""
    t = tolerances["outputs"][output]
    return t.get("tf32", t) if tf32 else t


def describe(tolerances: dict[str, Any]) -> str:
    """One sentence saying how the bounds were set, for parity.md and the README of a run."""
    rule, dt = tolerances.get("rule"), tolerances.get("dtype", "float32")
    if rule == "detection":
        eager = "eager fp32's" if tolerances.get("fp64") else "no"
        return (
            f"Reference: eager in {'float64' if tolerances.get('fp64') else 'float32'}. Bounds for boxes and scores: "
            f"{tolerances['multiple']:g} x {eager} own error against it on the detections the two share, plus "
            f"{tolerances['floor_eps']:g} {dt} epsilons of their scale; labels exact; minimum mAP "
            f"{tolerances['min_map']:g}."
        )
    if rule == "fp64":
        eager = "eager fp32" if dt == "float32" else f"eager in {dt}"
        return (
            f"Reference: eager in float64. Bound per output: {tolerances['multiple']:g} x {eager}'s own error "
            f"against it, plus {tolerances['floor_eps']:g} {dt} epsilons of the output's largest value."
        )
    if rule == "scale":
        return (
            f"Reference: eager in float32, because {tolerances.get('why') or 'the model cannot run in float64'}. "
            f"Bound per output: {tolerances['fraction']:g} of the output's largest value."
        )
    return (
        "Reference: eager in float64 where the model runs in it. Bound: |artifact - reference| <= atol + rtol * "
        "|reference|, as given."
    )


def degenerate_outputs(outputs: dict[str, list[np.ndarray]]) -> list[str]:
    """The outputs whose every sample is the same (all zeros included) on every reference set: against them
    verification cannot tell a right artifact from a wrong one."""
    bad = []
    for name, sets in outputs.items():
        multi = [o for o in sets if o.ndim and o.shape[0] > 1]
        if multi and all(np.array_equal(o, np.broadcast_to(o[:1], o.shape)) for o in multi):
            bad.append(name)
    return bad


def compare(out: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> dict[str, Any]:
    """Max abs / rel difference and the verdict (|a - b| <= atol + rtol * |b| everywhere, and finite)."""
    ref64 = ref.astype(np.float64)
    diff = np.abs(out.astype(np.float64) - ref64)
    rel = diff / np.maximum(np.abs(ref64), max(atol, np.finfo(np.float64).tiny))
    ok = bool(np.all(diff <= atol + rtol * np.abs(ref64))) and bool(np.all(np.isfinite(out)))
    return {
        "max_abs": float(diff.max()) if diff.size else 0.0,
        "max_rel": float(rel.max()) if rel.size else 0.0,
        "pass": ok,
    }


def top1_agreement(got: np.ndarray, want: np.ndarray, atol: float) -> np.ndarray:
    """Per row, whether the artifact's top class is the reference's, or within ``atol`` of it in the
    reference (a near-tie that rounding may break either way)."""
    picked = np.take_along_axis(want, got.argmax(-1)[..., None], -1)[..., 0]
    return (got.argmax(-1) == want.argmax(-1)) | (want.max(-1) - picked <= atol)


def check_output(
    got: Optional[np.ndarray], want: np.ndarray, tol: dict[str, float], what: str, batch: int, top1: bool = False
) -> tuple[dict[str, Any], Optional[str]]:
    """(row, failure): names, then shape, then values of one output against the reference; with ``top1``
    (real samples of a classifier) the predicted class must agree on every row too, near-ties counted as
    agreement. ``tol`` is the output's bound; ``what`` names the output in the failure message, which is
    None when it passes."""
    row: dict[str, Any] = {"batch": batch, "bound": tol["atol"]}
    if got is None:
        return {**row, "pass": False}, f"{what}: no such output"
    if got.shape != want.shape:
        return {
            **row,
            "pass": False,
            "shape": list(got.shape),
        }, f"{what} has shape {list(got.shape)}, eager {list(want.shape)}"
    row.update(compare(got, want, tol["atol"], tol["rtol"]))
    if top1 and got.ndim >= 2 and np.issubdtype(want.dtype, np.floating):
        agree = top1_agreement(got, want, tol["atol"] + tol["rtol"] * float(np.abs(want).max()))
        row["top1_agree"] = f"{int(agree.sum())}/{agree.size}"
        if not agree.all():
            row["pass"] = False
            return row, f"{what}: top-1 class differs from the reference on {int((~agree).sum())} real samples"
    if not row["pass"]:
        limit = f"the bound {tol['atol']:.3g}" + (f" + {tol['rtol']:g} x |reference|" if tol["rtol"] else "")
        return row, f"{what} (batch {batch}) max abs error {row['max_abs']:.3g} exceeds {limit}"
    return row, None


def artifact_summary(entry: dict[str, Any], tol: dict[str, Any]) -> tuple[float, float, Optional[float], str]:
    """(largest error, its bound, that error as a multiple of eager's own error or None, top-1 "agree/n")
    over the sets of one verified artifact (a manifest's verification entry)."""
    worst, limit, multiple, agree, total = 0.0, 0.0, None, 0, 0
    for row in entry["sets"].values():
        if "max_abs" not in row:
            continue
        out = tol["outputs"].get(row["output"], {}) if "output" in row else {}
        if row["max_abs"] >= worst:
            worst, limit = row["max_abs"], row.get("bound", 0.0)
            multiple = row["max_abs"] / out["eager_error"] if out.get("eager_error") else None
        if row.get("top1_agree"):
            a, n = row["top1_agree"].split("/")
            agree, total = agree + int(a), total + int(n)
    return worst, limit, multiple, f"{agree}/{total}" if total else ""


# The gate a quantized artifact is held to instead of a rounding bound (its error is quantization, not rounding)
GATE = {"max_accuracy_drop": 0.5, "min_top1_agreement": 0.99, "min_sqnr_db": 20.0}


def sqnr_db(got: np.ndarray, want: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio of ``got`` against ``want``, in dB (inf when they are equal)."""
    want64 = want.astype(np.float64)
    noise = float(np.sum((got.astype(np.float64) - want64) ** 2))
    signal = float(np.sum(want64**2))
    return float("inf") if noise == 0 else 10.0 * float(np.log10(max(signal, 1e-300) / noise))


def sqnr_floor(gate: dict[str, float]) -> float:
    """The SQNR a reduced-precision output must reach under ``gate``, in dB (GATE's where the gate names none)."""
    return gate.get("min_sqnr_db", GATE["min_sqnr_db"])


def sqnr_failures(
    got: dict[str, np.ndarray], want: dict[str, np.ndarray], outputs, floor: float, what: str, against: str
) -> list[str]:
    """Each float output of ``outputs`` whose SQNR against ``want`` is below ``floor`` dB, in words."""
    found = []
    for o in outputs:
        if np.issubdtype(want[o].dtype, np.floating):
            s = sqnr_db(got[o], want[o])
            if s < floor:
                found.append(f"{what} output {o!r}: SQNR {s:.1f} dB against {against}, below {floor:g} dB")
    return found


def check_quantized(
    got: dict[str, Optional[np.ndarray]],
    want: dict[str, np.ndarray],
    labels: Optional[np.ndarray],
    gate: dict[str, float],
    what: str,
    batch: int,
    real: bool,
    against: str = "eager",
) -> tuple[dict[str, Any], list[str]]:
    """(row, failures) of a reduced-precision model's outputs on one input set, against ``want`` (eager's, or
    what ``against`` names). Every output must have want's shape and be finite. On the real samples (``real``)
    it must also pass the gate: with ``labels``, accuracy within ``max_accuracy_drop`` points of eager's;
    without, top-1 agreement of at least ``min_top1_agreement`` for a classifier's first output, and for every
    other float output an SQNR of at least ``sqnr_floor(gate)``. Random inputs lie outside what the artifact was
    calibrated on: only reported there."""
    row: dict[str, Any] = {"batch": batch, "gate": dict(gate), "sqnr_db": {}}
    failures: list[str] = []
    names = list(want)
    for o in names:
        g = got.get(o)
        if g is None or g.shape != want[o].shape:
            failures.append(
                f"{what} output {o!r}: "
                + ("no such output" if g is None else f"shape {list(g.shape)}, eager {list(want[o].shape)}")
            )
        elif np.issubdtype(want[o].dtype, np.floating):
            if not np.all(np.isfinite(g)):
                failures.append(f"{what} output {o!r}: not finite")
            row["sqnr_db"][o] = round(sqnr_db(g, want[o]), 2)
    if failures or not real:
        row["pass"] = not failures
        return row, failures
    first, rest = names[0], names[1:]
    g, w = got[first], want[first]
    classifier = g.ndim == 2 and g.shape[-1] > 1 and np.issubdtype(w.dtype, np.floating)
    if classifier:
        agree = float(np.mean(g.argmax(-1) == w.argmax(-1)))
        row["top1_agreement"] = round(agree, 4)
        if labels is not None:
            acc, eager = float(np.mean(g.argmax(-1) == labels)), float(np.mean(w.argmax(-1) == labels))
            row.update(
                accuracy=round(100 * acc, 2),
                eager_accuracy=round(100 * eager, 2),
                accuracy_drop=round(100 * (eager - acc), 2),
            )
            if round(100 * (eager - acc), 6) > gate["max_accuracy_drop"]:  # 1.0 - 0.995 is not exactly 0.005
                failures.append(
                    f"{what}: accuracy {100 * acc:.2f} % against eager's {100 * eager:.2f} % on "
                    f"{len(labels)} labelled samples, a drop beyond {gate['max_accuracy_drop']:g} points"
                )
        elif agree < gate["min_top1_agreement"]:
            failures.append(
                f"{what}: top-1 agrees with {against} on {100 * agree:.1f} % of {len(g)} real samples "
                f"(at least {100 * gate['min_top1_agreement']:g} % needed)"
            )
    failures += sqnr_failures(got, want, rest if classifier else names, sqnr_floor(gate), what, against)
    row["pass"] = not failures
    return row, failures


def check_quantized_sets(
    manifest: dict[str, Any], ref, got, gate: dict[str, float], name: str, rows: dict[str, Any]
) -> list[str]:
    """A quantized artifact's outputs (``got(set, output)``) on every reference set under the gate
    (parity.check_quantized): the real samples gated, the random sets only checked for shape and finiteness.
    Fills ``rows`` by set; returns the failures. With no real samples there is nothing to gate on: a failure."""
    real = manifest["reference"].get("samples")
    labels = ref[f"labels/{real}"] if real and f"labels/{real}" in ref else None
    outputs = [o["name"] for o in manifest["outputs"]]
    failures = (
        []
        if real
        else [
            f"{name}: a quantized artifact is gated on real samples, and this export has none (give --example-inputs)"
        ]
    )
    for key, batch in manifest["reference"]["sets"].items():
        row, problems = check_quantized(
            {o: got(key, o) for o in outputs},
            {o: ref[f"expected/{key}/{o}"] for o in outputs},
            labels if key == real else None,
            gate,
            f"{name}: {key}",
            batch,
            key == real,
        )
        rows[key] = {**row, "output": outputs[0]}
        failures += problems
    return failures


def check_float_sets(
    manifest: dict[str, Any],
    ref,
    got,
    tol: dict[str, Any],
    name: str,
    tf32: bool = False,
    sets: dict[str, int] | None = None,
) -> list[tuple[str, str, dict[str, Any], str | None]]:
    """A float artifact's outputs (``got(set, output)``) on each reference set (``sets``, default all of them)
    under the manifest's bounds (the TF32 one for a package compiled with TF32, the strict bound kept beside it),
    top-1 agreement on the held-out set. Returns (set, output, row, failure or None) for each; a failure only on
    rows with an empty attention mask says so."""
    outputs = [o["name"] for o in manifest["outputs"]]
    out = []
    for key, batch in (manifest["reference"]["sets"] if sets is None else sets).items():
        for o in outputs:
            have, want, b = got(key, o), ref[f"expected/{key}/{o}"], bound(tol, o, tf32)
            row, failure = check_output(
                have, want, b, f"{name}: {key} output {o!r}", batch, top1=key in ("heldout", "raw") and o == outputs[0]
            )
            if tf32 and "max_abs" in row:  # the strict float32 bound beside the TF32 one it is held to
                row["strict_bound"] = bound(tol, o)["atol"]
            out.append((key, o, row, failure and failure + empty_mask_hint(manifest, ref, key, have, want, b)))
    return out


def empty_mask_hint(manifest: dict[str, Any], ref, key: str, got, want, tol: dict) -> str:
    """Where an artifact differs from eager only on rows whose mask-named input holds no 1 at all (a row no
    tokenizer sends, which attention has no defined answer for), the words that say so; else ""."""
    if got is None or got.shape != want.shape or not got.ndim:
        return ""
    err = np.abs(got.astype(np.float64) - want).reshape(len(want), -1).max(1)
    bad = err > tol["atol"] + tol.get("rtol", 0.0) * np.abs(want).reshape(len(want), -1).max(1)
    for t in manifest["inputs"]:
        if not looks_like_mask(t["name"]) or t.get("values") == "mask" or t["dtype"].startswith("float"):
            continue
        empty = ~ref[f"input/{key}/{t['name']}"].reshape(len(want), -1).any(1)
        if bad.any() and not (bad & ~empty).any():
            return (
                f" (only on rows whose {t['name']} holds no 1: no tokenizer sends such a row; --input-range "
                f"{t['name']}=mask draws masks as a tokenizer makes them)"
            )
    return ""


def gate_words(gate: dict[str, Any]) -> str:
    """The accuracy gate's figures in a few words."""
    if "map50" in gate:  # a detector's (torchship.detection_parity's gate)
        return (
            f"mAP@50 {gate['map50']:.4f} beside float32's {gate['eager_map50']:.4f} (allowed drop "
            f"{gate['max_map50_drop']:g}), {gate['map50_vs_float32']:.4f} against float32's detections, mean score "
            f"change {gate['score_shift']:.4f}"
        )
    if "accuracy_drop" in gate:
        return (
            f"accuracy {gate['accuracy']:.2f} % beside float32's {gate['eager_accuracy']:.2f} % "
            f"(allowed drop {gate['max_accuracy_drop']:g} points)"
        )
    if "top1_agreement" in gate:
        return f"top-1 agreement with float32 {100 * gate['top1_agreement']:.1f} %"
    return "passed its accuracy gate"
