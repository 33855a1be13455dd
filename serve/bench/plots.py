"""The bench report's plots: in-process latency CDFs, served throughput against concurrency, p99 against
throughput."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def draw_plots(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    made = []
    rows = results.get("in_process", {}).get("rows", [])
    raw = results.get("in_process", {}).get("raw_ms", {})
    if rows:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        b0 = min(r["batch"] for r in rows)
        for r in rows:
            if r["batch"] != b0 or not r.get("n"):
                continue
            key = f"{r['variant']}/b{b0}"
            if key in raw:
                xs = np.sort(raw[key])
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=r["variant"])
        made.append(
            _save(
                plt,
                fig,
                ax,
                out / "latency_cdf.png",
                f"latency at batch {b0} (ms)",
                "fraction of runs",
                "In-process latency CDF per format",
            )
        )
    served = results.get("served", {})
    series = [
        (f"{m} (batching {'on' if s == 'models' else 'off'})", mm["rows"])
        for s in ("models", "batching_off")
        for m, mm in served.get(s, {}).items()
    ]
    if series:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, rs in series:
            ax.plot([r["concurrency"] for r in rs], [r["requests_per_s"] for r in rs], marker="o", label=label)
        ax.set_xscale("log", base=2)
        made.append(
            _save(
                plt,
                fig,
                ax,
                out / "throughput_vs_concurrency.png",
                "concurrency (requests in flight)",
                "throughput (requests/s)",
                "Served throughput against concurrency",
            )
        )
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, rs in series:
            rs = [r for r in rs if r.get("n")]
            ax.plot([r["requests_per_s"] for r in rs], [r["p99_ms"] for r in rs], marker="o", label=label)
        made.append(
            _save(
                plt,
                fig,
                ax,
                out / "p99_vs_throughput.png",
                "throughput (requests/s)",
                "p99 latency (ms)",
                "p99 latency against throughput",
            )
        )
    return made


def _save(plt, fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
