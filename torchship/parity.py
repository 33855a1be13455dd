"""The one parity comparator: an output against eager's, for export verification and served checks alike."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np


def compare(out: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> dict[str, Any]:
    """Max abs / rel difference and the allclose verdict (|a - b| <= atol + rtol * |b|, and finite)."""
    diff = np.abs(out.astype(np.float64) - ref.astype(np.float64))
    rel = diff / np.maximum(np.abs(ref.astype(np.float64)), atol)
    ok = bool(np.all(diff <= atol + rtol * np.abs(ref))) and bool(np.all(np.isfinite(out)))
    return {"max_abs": float(diff.max()) if diff.size else 0.0, "max_rel": float(rel.max()) if rel.size else 0.0, "pass": ok}


def check_output(got: Optional[np.ndarray], want: np.ndarray, tol: dict[str, float], what: str, batch: int,
                 top1: bool = False) -> tuple[dict[str, Any], Optional[str]]:
    """(row, failure): names, then shape, then values of one output against eager's; with ``top1`` (real
    samples of a classifier) the predicted class must agree on every row too. ``what`` names the output
    in the failure message, which is None when it passes."""
    row: dict[str, Any] = {"batch": batch}
    if got is None:
        return {**row, "pass": False}, f"{what}: no such output"
    if got.shape != want.shape:
        return {**row, "pass": False, "shape": list(got.shape)}, f"{what} has shape {list(got.shape)}, eager {list(want.shape)}"
    row.update(compare(got, want, tol["atol"], tol["rtol"]))
    if top1:
        agree = got.argmax(-1) == want.argmax(-1)
        row["top1_agree"] = f"{int(agree.sum())}/{agree.size}"
        if not agree.all():
            row["pass"] = False
            return row, f"{what}: top-1 class differs from eager on {int((~agree).sum())} real samples"
    if not row["pass"]:
        return row, (f"{what} (batch {batch}) max abs diff {row['max_abs']:.3g} exceeds atol {tol['atol']:g} "
                     f"+ rtol {tol['rtol']:g}")
    return row, None
