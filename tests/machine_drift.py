"""How much this machine's own speed moves while idle, the floor under any benchmark's run-to-run spread:
a one-thread 256x256 fp32 matmul timed in windows, with the share of CPU time the hypervisor stole meanwhile
(/proc/stat). ``python -m tests.machine_drift [--windows 30] [--seconds 1.5]``."""

from __future__ import annotations

import argparse
import time


def cpu_times() -> tuple[int, int]:
    """(all CPU time, stolen CPU time) so far, in clock ticks."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return sum(ticks), ticks[7]


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--windows", type=int, default=30)
    p.add_argument("--seconds", type=float, default=1.5)
    args = p.parse_args()
    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    rates = []
    for _ in range(args.windows):
        t0, (total0, stolen0) = time.perf_counter(), cpu_times()
        n = 0
        while time.perf_counter() - t0 < args.seconds:
            for _ in range(50):
                a @ b
            n += 50
        rate = 2 * 256**3 * n / (time.perf_counter() - t0) / 1e9
        total1, stolen1 = cpu_times()
        rates.append(rate)
        print(f"{rate:6.1f} GFLOP/s   steal {100 * (stolen1 - stolen0) / max(1, total1 - total0):4.1f} %", flush=True)
    print(
        f"range {min(rates):.1f} to {max(rates):.1f} GFLOP/s ({100 * (max(rates) - min(rates)) / min(rates):.0f} % "
        "apart)"
    )


if __name__ == "__main__":
    main()
