"""Which of an export's formats a repository serves, the artifact each runs from, and why the others are left out."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from torchship.manifest import PARITY_MD, artifact_of, passed_formats, why_not_passed
from torchship.names import FORMATS, SERVED_FORMATS, served_artifact


def servable_formats(
    manifest: dict[str, Any], formats: Sequence[str] = SERVED_FORMATS, device: str | None = None
) -> list[str]:
    """Those of ``formats`` a repository built from this export serves: the ones with an artifact exported with a
    passing verdict recorded (``aoti`` also from the ``aoti_buckets`` archive alone). An artifact that failed
    verification, or was never verified, is not served. ``device`` ("cpu" or "cuda"): where the repository's
    instances run; an artifact compiled or quantized for another device is not served there."""
    have = passed_formats(manifest)
    return [f for f in formats if served_artifact(have, f) and not made_elsewhere(manifest, f, device)]


def made_elsewhere(manifest: dict[str, Any], fmt: str, device: str | None) -> str:
    """Why the artifact that serves ``fmt`` cannot run on ``device`` ("cpu" or "cuda"; None: any), in a few words
    ("compiled for the CPU"), or "" where it can."""
    made_for = FORMATS[fmt].made_for
    source = served_artifact(passed_formats(manifest), fmt)
    a = artifact_of(manifest, source) if source else None
    if device is None or not made_for or a is None:
        return ""
    made_on = "cuda" if str(a.get("device", "cpu")).startswith("cuda") else "cpu"
    if made_on == device:
        return ""
    name = {"cuda": "GPU", "cpu": "CPU"}
    return f"{made_for} for the {name[made_on]} it was exported on, not for a {name[device]}"


def served_artifacts(manifest: dict[str, Any]) -> dict[str, str]:
    """format -> the artifact the embedded server runs for it: ``aoti`` from the bucket archive where it verified."""
    have = passed_formats(manifest)
    return {f: served_artifact(have, f) for f in servable_formats(manifest)}


def not_served(
    manifest: dict[str, Any], formats: Sequence[str] = SERVED_FORMATS, device: str | None = None
) -> dict[str, str]:
    """format -> why a repository built from this export (for ``device``) leaves it out ("failed verification",
    "not verified", "not exported", "compiled for the CPU ...", ...), for each of ``formats`` that the export was
    asked for or has."""
    served = servable_formats(manifest, formats, device)
    asked = set(manifest.get("formats") or ()) | {a["format"] for a in manifest["artifacts"]}
    out = {}
    for f in formats:
        sources = [a for a in FORMATS[f].artifacts if a in asked]
        if f in served or not sources:
            continue
        out[f] = made_elsewhere(manifest, f, device) or "; ".join(
            [why_not_passed(manifest, f)] + [f"{a} {why_not_passed(manifest, a)}" for a in sources if a != f]
        )
    return out


def not_served_text(export_dir: str | Path, reasons: dict[str, str]) -> str:
    """One line naming each format left out and why, grouped by reason, with what to do."""
    groups: dict[str, list[str]] = {}
    for f, why in reasons.items():
        groups.setdefault(why, []).append(f)
    fix = {
        "failed verification": f"see {Path(export_dir) / PARITY_MD}",
        "not verified": f"torchship verify {export_dir}",
    }
    for why in groups:
        if "exported on" in why:
            fix[why] = "export them on a machine with the device they are to serve on"
    return "; ".join(f"{', '.join(fs)}: {why}" + (f" ({fix[why]})" if why in fix else "") for why, fs in groups.items())
