"""``torchship bench``: run the benchmark, or compare two results files."""

from __future__ import annotations

import argparse

from torchship.config import add_dataclass_arguments, build, namespace_overrides

from ..access import access_from_arguments, add_access_arguments
from ..config import ServeConfig
from .config import BenchConfig

# torchship serve's options that bench passes on to its embedded server (the rest it sets itself)
SERVE_OPTIONS = ("ready_timeout", "triton_args")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("export_dir", nargs="?", default=None, help="export directory to benchmark")
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("OLD.json", "NEW.json"),
        default=None,
        help="print new/old ratios of every shared figure; exit 1 on a regression: a figure worse by more "
        "than the spread either run measured it with",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="with --compare: a fixed ratio in place of the measured spreads: latency above it (or "
        "throughput below its inverse) is a regression",
    )
    add_dataclass_arguments(p, BenchConfig)
    exclude = tuple(f for f in ServeConfig.__dataclass_fields__ if f not in SERVE_OPTIONS)
    add_dataclass_arguments(p, ServeConfig, exclude=exclude)
    add_access_arguments(p)


def main_bench(ns: argparse.Namespace) -> int:
    from .compare import comparable, compare, load_results
    from .machine import machine_ratio
    from .run import run_bench

    if ns.compare:
        old, new = load_results(ns.compare[0]), load_results(ns.compare[1])
        for note in comparable(old, new):
            print(note)
        rows, regressions = compare(old, new, ns.threshold)
        if not rows:
            print("no figures in common between the two results files")
            return 1
        machine = machine_ratio(old, new)
        if machine is not None:
            print(
                f"the machine's own speed (the probe both benches read between rounds), new/old: {machine:.2f}; "
                "a served figure that it explains is not counted as a regression"
            )
        width = max(len(r["key"]) for r in rows)
        print(f"{'figure':<{width}}  {'old':>10}  {'new':>10}  {'new/old':>8}  {'noise':>6}")
        for r in rows:
            flag = "  REGRESSION" if r["regression"] else ""
            if r.get("explained"):
                flag = f"  the machine moved {100 * (r['machine'] - 1):+.0f}%: not counted"
            print(
                f"{r['key']:<{width}}  {r['old']:>10.3f}  {r['new']:>10.3f}  {r['ratio']:>8.2f}  "
                f"{'±' + format(100 * (r['band'] - 1), '.0f') + '%':>6}{flag}"
            )
        how = f"{ns.threshold:g}x" if ns.threshold is not None else "each figure's measured spread"
        explained = sum(bool(r.get("explained")) for r in rows)
        print(
            f"{len(regressions)} regression(s) beyond {how} out of {len(rows)} figures"
            + (f"; {explained} more that the machine's own move explains" if explained else "")
        )
        return 1 if regressions else 0
    serve = {k: v for k, v in namespace_overrides(ns, ServeConfig).items() if k in SERVE_OPTIONS}
    cfg = build(BenchConfig, namespace_overrides(ns, BenchConfig), {"export_dir": ns.export_dir, "serve": serve})
    access_from_arguments(ns, cfg.url)
    run_bench(cfg)
    return 0
