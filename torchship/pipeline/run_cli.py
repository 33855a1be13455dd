"""The ``torchship run`` command: its arguments, and the settings and run folder it hands to run_pipeline."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from torchship.serve.access import access_from_arguments, add_access_arguments

from ..config import load_config_file
from ..errors import ConfigError
from . import run
from .settings import SECTIONS, resolve_settings


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="run folder (default: runs/<timestamp>; with --from: the newest run)")
    p.add_argument("--config", default=None, help=f"TOML or YAML file with [{'] ['.join(SECTIONS)}] sections")
    p.add_argument(
        "--from",
        dest="start",
        default="train",
        metavar="STAGE",
        help=f"start at this stage, reusing the run folder's earlier outputs: {', '.join(run.STAGE_NAMES)} "
        f"({'; '.join(f'{a} means {s}' for a, s in run.ALIASES.items())})",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="redo a run folder whose training wrote checkpoints from training, replacing them",
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override any stage option, e.g. --set train.epochs=3 --set bench.requests=50 (repeatable)",
    )
    p.add_argument(
        "--into",
        default=None,
        metavar="REPO",
        help="with --url: roll the export out into the repository a "
        "running server serves (as the next version of its models, "
        "switched to once served parity passes) instead of serving "
        "a repository of the run's own",
    )
    p.add_argument("--url", default=None, metavar="HOST:PORT", help="with --into: the running server's gRPC address")
    add_access_arguments(p)
    p.add_argument("--arch", default=None, help="shortcut for --set train.arch=...")
    p.add_argument(
        "--data",
        default=None,
        help="shortcut for --set train.data=... (digits, synthetic, an ImageFolder path or package.module:factory)",
    )
    p.add_argument("--epochs", type=int, default=None, help="shortcut for --set train.epochs=...")
    p.add_argument("--nproc", type=int, default=None, help="shortcut for --set train.nproc=... (0: auto)")
    p.add_argument(
        "--amp", choices=["auto", "off", "bf16", "fp16"], default=None, help="shortcut for --set train.amp=..."
    )


def main_run(ns: argparse.Namespace) -> int:
    file_cfg = load_config_file(ns.config) if ns.config else {}
    shortcuts = {"arch": ns.arch, "data": ns.data, "epochs": ns.epochs, "nproc": ns.nproc, "amp": ns.amp}
    settings = resolve_settings(file_cfg, ns.sets, shortcuts)
    if ns.out:
        run_dir = Path(ns.out)
    elif ns.start != "train":
        runs = sorted((p for p in Path("runs").glob("*") if (p / "run.json").exists()), key=lambda p: p.stat().st_mtime)
        if not runs:
            raise ConfigError(f"--from {ns.start}: no earlier run under runs/; pass --out RUN_DIR")
        run_dir = runs[-1]
        print(f"--from {ns.start}: continuing {run_dir}")
    else:
        run_dir = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    configs = run.stage_configs(settings, run.layout(run_dir))  # every section checked before any work starts
    access_from_arguments(ns, ns.url)
    train_cfg = configs["train"]
    if ns.start == "train":  # and where training would run (fp16 needs CUDA), before the run folder is made
        from torchship.train.loop import resolve_device

        try:
            resolve_device(train_cfg)
        except ConfigError as e:
            raise run.in_run_terms("train", type(train_cfg), e) from None
    run.run_pipeline(run_dir, settings, ns.start, overwrite=ns.overwrite, into=ns.into, url=ns.url, configs=configs)
    return 0
