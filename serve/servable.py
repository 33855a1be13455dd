"""Which of an export's formats a repository serves, the artifact each runs from, and why the others are left out."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from torchship.manifest import PARITY_MD, passed_formats, why_not_passed
from torchship.names import SERVED_FORMATS


def servable_formats(manifest: dict[str, Any], formats: Sequence[str] = SERVED_FORMATS) -> list[str]:
    """Those of ``formats`` a repository built from this export serves: the ones exported with a passing
    verdict recorded (``aoti`` also from the ``aoti_buckets`` archive alone). An artifact that failed
    verification, or was never verified, is not served."""
    have = passed_formats(manifest)
    return [f for f in formats if f in have or (f == "aoti" and "aoti_buckets" in have)]


def served_artifacts(manifest: dict[str, Any]) -> dict[str, str]:
    """format -> the artifact the embedded server runs for it: ``aoti`` from the bucket archive where it verified."""
    have = passed_formats(manifest)
    return {f: "aoti_buckets" if f == "aoti" and "aoti_buckets" in have else f for f in servable_formats(manifest)}


def not_served(manifest: dict[str, Any], formats: Sequence[str] = SERVED_FORMATS) -> dict[str, str]:
    """format -> why a repository built from this export leaves it out ("failed verification", "not
    verified", "not exported", ...), for each of ``formats`` that the export was asked for or has."""
    served = servable_formats(manifest, formats)
    asked = set(manifest.get("formats") or ()) | {a["format"] for a in manifest["artifacts"]}
    out = {}
    for f in formats:
        if f in served or not ({f} | ({"aoti_buckets"} if f == "aoti" else set())) & asked:
            continue
        out[f] = why_not_passed(manifest, f)
        if f == "aoti" and "aoti_buckets" in asked:
            out[f] = f"{out[f]}; aoti_buckets {why_not_passed(manifest, 'aoti_buckets')}"
    return out


def not_served_text(export_dir: str | Path, reasons: dict[str, str]) -> str:
    """One line naming each format left out and why, grouped by reason, with what to do."""
    groups: dict[str, list[str]] = {}
    for f, why in reasons.items():
        groups.setdefault(why, []).append(f)
    fix = {"failed verification": f"see {Path(export_dir) / PARITY_MD}", "not verified": f"torchship verify {export_dir}"}
    return "; ".join(f"{', '.join(fs)}: {why}" + (f" ({fix[why]})" if why in fix else "") for why, fs in groups.items())
