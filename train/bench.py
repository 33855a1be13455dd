"""Training throughput, side by side: ``python -m torchship.train.bench [--steps N] [--rounds R]``.

Runs the real training (``python -m torchship.train``: one process, or torchrun ranks) for each configuration,
alternating their order over rounds so machine noise falls on all alike, and prints images/s
(median over rounds) with the machine it ran on. One intra-op thread per rank unless the
configuration says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = [  # (label, nproc, threads per rank, amp)
    ("1 process x 1 thread, fp32", 1, 1, "off"),
    ("1 process x 1 thread, bf16", 1, 1, "bf16"),
    ("2 DDP ranks x 1 thread, fp32", 2, 1, "off"),
    ("2 DDP ranks x 1 thread, bf16", 2, 1, "bf16"),
    ("1 process x 2 threads, fp32", 1, 2, "off"),
    ("1 process x 2 threads, bf16", 1, 2, "bf16"),
]


def one(label: str, nproc: int, threads: int, amp: str, arch: str, steps: int, batch: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        args = [
            "--arch",
            arch,
            "--amp",
            amp,
            "--batch-size",
            str(batch),
            "--epochs",
            "100",
            "--max-steps",
            str(steps),
            "--out",
            tmp,
            "--no-progress",
        ]
        launcher = (
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
            if nproc > 1
            else [sys.executable]
        )
        cmd = [*launcher, "-m", "torchship.train", *args]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            raise SystemExit(f"{label} failed:\n{p.stderr[-2000:]}")
        last = json.loads((Path(tmp) / "metrics.jsonl").read_text().splitlines()[-1])
        return last["images_per_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="resnet18")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per measurement")
    ap.add_argument("--batch-size", type=int, default=64, help="global batch size")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args()
    results: dict[str, list[float]] = {c[0]: [] for c in CONFIGS}
    for r in range(a.rounds):
        order = CONFIGS if r % 2 == 0 else list(reversed(CONFIGS))
        for label, nproc, threads, amp in order:
            ips = one(label, nproc, threads, amp, a.arch, a.steps, a.batch_size)
            results[label].append(ips)
            print(f"round {r + 1}: {label}: {ips:.0f} images/s", file=sys.stderr, flush=True)
    import torch

    from torchship.device import cpu_name
    from torchship.markdown import table

    cpu = cpu_name()
    print(
        f"\n{a.arch}, digits at 32x32, global batch {a.batch_size}, {a.steps} steps per run, median of {a.rounds} "
        f"rounds; {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}\n"
    )
    print(
        "\n".join(
            table(
                ["configuration", "images/s"], [[label, f"{statistics.median(v):.0f}"] for label, v in results.items()]
            )
        )
    )
    if a.json:
        Path(a.json).write_text(json.dumps({"arch": a.arch, "cpu": cpu, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
