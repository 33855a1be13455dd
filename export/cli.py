"""``torchship export`` and ``torchship verify``: thin layers over run_export and verify_export."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchship.config import add_dataclass_arguments, build, namespace_overrides
from torchship.manifest import PARITY_MD

from .config import ExportConfig


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        nargs="?",
        default="",
        help="checkpoint directory, its model.pt, or a training output directory (uses its best); "
        "or leave it out and give --model, --weights and --input",
    )
    add_dataclass_arguments(p, ExportConfig)


def main_export(ns: argparse.Namespace) -> int:
    from .pipeline import run_export

    cfg = build(ExportConfig, namespace_overrides(ns, ExportConfig), {"checkpoint": ns.checkpoint})
    m = run_export(cfg)
    if "verification" in m:
        print((Path(cfg.out) / PARITY_MD).read_text())
    print(
        f"exported {len(m['artifacts'])} artifacts to {cfg.out}"
        + (
            f"; could not export: {', '.join(f['format'] for f in m['export_failures'])}"
            if m["export_failures"]
            else ""
        )
    )
    return 0


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("export_dir", help="an export directory written by torchship export")
    p.add_argument(
        "--device", default=None, help="device to verify on (default: the one the manifest was exported for)"
    )
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per verification process")
    p.add_argument("--only", nargs="+", default=None, metavar="ARTIFACT", help="verify only these artifacts")
    p.add_argument(
        "--optional",
        nargs="+",
        default=None,
        metavar="FORMAT",
        help="formats that may fail without failing the command, besides those the export marked optional "
        "(default: none besides those); any other format failing exits 3",
    )


def main_verify(ns: argparse.Namespace) -> int:
    from .verify import verify_export

    v = verify_export(ns.export_dir, device=ns.device, threads=ns.threads, only=ns.only, optional=ns.optional)
    print((Path(ns.export_dir) / PARITY_MD).read_text())
    failed = [n for n, e in v["artifacts"].items() if not e["pass"]]
    print(
        f"verify: PASS ({ns.export_dir})" + (f"; optional formats that failed: {', '.join(failed)}" if failed else "")
    )
    return 0
