"""The one parity rule: the bound each output is held to, and the comparator that applies it, for export
verification and served checks alike.

The reference is eager computed in float64. Eager's own error against it (fp32, or the artifact's reduced
dtype) measures how much rounding this model produces on these inputs; an artifact may round up to
``MULTIPLE`` times as much, plus a floor of ``FLOOR_EPS`` machine epsilons of the output's scale.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import numpy as np

MULTIPLE = 10.0  # an artifact may round this many times as much as eager itself
FLOOR_EPS = 8.0  # the bound never drops below this many machine epsilons of the output's largest value
EPS = {"float32": float(np.finfo(np.float32).eps), "float16": float(np.finfo(np.float16).eps), "bfloat16": 2.0 ** -7}
# without a float64 reference: the bound as a fraction of the output's largest value
FALLBACK_REL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def derive(reference: dict[str, list[np.ndarray]], eager: dict[str, list[np.ndarray]], dtype: str,
           fp64: bool, why: str = "") -> dict[str, Any]:
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
            err = max((float(np.abs(e.astype(np.float64) - r).max()) for e, r in zip(eager[name], refs) if r.size),
                      default=0.0)
            floor = FLOOR_EPS * EPS[dtype] * scale
            outputs[name] = {"atol": MULTIPLE * err + floor, "rtol": 0.0, "eager_error": err, "scale": scale,
                             "floor": floor}
        else:
            outputs[name] = {"atol": FALLBACK_REL[dtype] * scale, "rtol": 0.0, "scale": scale}
    rule = {"rule": "fp64", "multiple": MULTIPLE, "floor_eps": FLOOR_EPS} if fp64 else \
        {"rule": "scale", "fraction": FALLBACK_REL[dtype], "why": why}
    return {**rule, "dtype": dtype, "outputs": outputs}


def given(outputs: Iterable[str], atol: Optional[float], rtol: Optional[float], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """Tolerances from --atol/--rtol (a flag left out counts as 0), in place of the derived bound."""
    a, r = float(atol or 0.0), float(rtol or 0.0)
    return {**(base or {}), "rule": "given", "outputs": {o: {"atol": a, "rtol": r} for o in outputs}}


def bound(tolerances: dict[str, Any], output: str) -> dict[str, float]:
    """{"atol", "rtol"} that ``output`` is held to."""
    return tolerances["outputs"][output]


def describe(tolerances: dict[str, Any]) -> str:
    """One sentence saying how the bounds were set, for parity.md and the README of a run."""
    rule, dt = tolerances.get("rule"), tolerances.get("dtype", "float32")
    if rule == "fp64":
        eager = "eager fp32" if dt == "float32" else f"eager in {dt}"
        return (f"Reference: eager in float64. Bound per output: {tolerances['multiple']:g} x {eager}'s own error "
                f"against it, plus {tolerances['floor_eps']:g} {dt} epsilons of the output's largest value.")
    if rule == "scale":
        return (f"Reference: eager in float32, because {tolerances.get('why') or 'the model cannot run in float64'}. "
                f"Bound per output: {tolerances['fraction']:g} of the output's largest value.")
    return "Reference: eager in float64 where the model runs in it. Bound: |artifact - reference| <= atol + rtol * |reference|, as given."


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
    return {"max_abs": float(diff.max()) if diff.size else 0.0, "max_rel": float(rel.max()) if rel.size else 0.0, "pass": ok}


def top1_agreement(got: np.ndarray, want: np.ndarray, atol: float) -> np.ndarray:
    """Per row, whether the artifact's top class is the reference's, or within ``atol`` of it in the
    reference (a near-tie that rounding may break either way)."""
    picked = np.take_along_axis(want, got.argmax(-1)[..., None], -1)[..., 0]
    return (got.argmax(-1) == want.argmax(-1)) | (want.max(-1) - picked <= atol)


def check_output(got: Optional[np.ndarray], want: np.ndarray, tol: dict[str, float], what: str, batch: int,
                 top1: bool = False) -> tuple[dict[str, Any], Optional[str]]:
    """(row, failure): names, then shape, then values of one output against the reference; with ``top1``
    (real samples of a classifier) the predicted class must agree on every row too, near-ties counted as
    agreement. ``tol`` is the output's bound; ``what`` names the output in the failure message, which is
    None when it passes."""
    row: dict[str, Any] = {"batch": batch, "bound": tol["atol"]}
    if got is None:
        return {**row, "pass": False}, f"{what}: no such output"
    if got.shape != want.shape:
        return {**row, "pass": False, "shape": list(got.shape)}, f"{what} has shape {list(got.shape)}, eager {list(want.shape)}"
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
