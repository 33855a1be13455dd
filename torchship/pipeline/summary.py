"""A run's summary.md: how it ended, each stage's time and gate, parity, and served latency and throughput
beside in-process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import TorchshipError
from ..manifest import MANIFEST, read_manifest
from ..markdown import table
from ..tasks import task_of


def outcome_line(run_dir: Path, outcome: dict[str, Any], markdown: bool = True) -> str:
    """How the run ended: every gate passed, a gate failed, or where it stopped and the command that goes
    on from there (``--overwrite`` for a training stopped after a checkpoint, else ``--from`` the stage)."""
    status, where = outcome.get("status"), outcome.get("stage")
    redo = where == "train" and (run_dir / "train" / "checkpoints").exists()
    again = f"torchship run --out {run_dir} " + ("--overwrite" if redo else f"--from {where}")
    b, q = ("**", "`") if markdown else ("", "")
    if status == "passed":
        return f"{b}all gates passed{b}"
    if status == "gate failed":
        return f"{b}a gate FAILED{b}: {outcome['error']}"
    if status == "interrupted":
        return f"{b}interrupted{b} in the {where} stage: the stages after it did not run; go on with {q}{again}{q}"
    error = outcome.get("error", "unknown error").splitlines()[0]
    return (
        f"{b}stopped by an error{b} in the {where} stage ({error}); the stages after it did not run; once fixed, "
        f"go on with {q}{again}{q}"
    )


def summarize(run_dir: Path, record: dict[str, Any], manifest: dict[str, Any] | None = None) -> str:
    """The run's summary.md; ``manifest``: the export's, where the run holds it (else it is read, if there is one)."""
    rows = []
    for name, st in record["stages"].items():
        result = record["gates"].get(name, {}).get("detail", "")
        if name == "train":
            result = f"{st['arch']}, {st['world_size']} rank(s), amp {st['amp']}: " + result
        rows.append([name, st["seconds"], result])
    rows.append(
        [
            "total",
            record.get("total_seconds", ""),
            f"peak RSS of the whole run (all processes): {record.get('peak_rss_bytes', 0) / 2**30:.2f} GiB",
        ]
    )
    lines = [
        f"# torchship run: {run_dir}",
        "",
        outcome_line(run_dir, record.get("outcome", {})),
        "",
        *table(["stage", "seconds", "result"], rows),
    ]
    # the summary is written after a failure too: a file that cannot be read is named, not raised
    manifest = manifest or _readable(lines, run_dir / "export" / MANIFEST, read_manifest, run_dir / "export")
    v = manifest.get("verification")
    if v:
        lines += task_of(manifest).summary_lines(manifest) or []
    entry = record["stages"].get("repo", {}).get("image_entry")
    if entry:
        lines += ["", entry_line(entry, record["stages"].get("bench", {}).get("winner"))]
    results = run_dir / "bench" / "results.json"
    if "bench" in record["stages"]:
        from torchship.serve.bench.beside import side_by_side
        from torchship.serve.bench.compare import load_results
        from torchship.serve.bench.report import served_lines

        b = _readable(lines, results, load_results, results)
        if b.get("served"):
            lines += [""] + served_lines(b["served"], b.get("config", {}))
            winner = record["stages"]["bench"].get("winner")
            if winner:
                from torchship.serve.bench.placement import winner_lines

                lines += winner_lines(winner)
            rec = b.get("recommendation", {})
            if "model" in rec:
                lines += [
                    f"Recommendation: `{rec['model']}` with max_batch_size {rec['max_batch_size']}: "
                    f"{rec['requests_per_s']:.0f} req/s at p99 {rec['p99_ms']:.2f} ms.",
                    "",
                ]
        if b:
            from torchship.serve.bench.entry import entry_lines

            lines += side_by_side(b, record["stages"]["bench"].get("winner")) + entry_lines(b.get("served", {}))
    lines += [
        "",
        f"Run folder: {run_dir}  ·  summary: {run_dir / 'summary.md'}  ·  bench report: "
        f"{run_dir / 'bench' / 'report.md'}",
        "",
    ]
    return "\n".join(lines)


def entry_line(entry: dict[str, Any], winner: dict[str, Any] | None) -> str:
    """The image entry in words: its name, what it runs, and the bytes a request holds beside the tensor's."""
    behind = f"`{winner['served_as']}` ({winner['model']})" if winner else "the model"
    size = ""
    if entry.get("file_bytes"):
        size = (
            f": a request holds the file, {entry['file_bytes']:,} bytes (the median of the export's held-out "
            f"files), where the float32 tensor is {entry['tensor_bytes']:,} bytes "
            f"({entry['tensor_bytes'] / entry['file_bytes']:.0f}x)"
        )
    return (
        f"Image entry: `{entry['model']}` takes an image file as it is and prepares it in the server as "
        f"training did, then runs {behind}{size}."
    )


def _readable(lines: list[str], path: Path, read, *args) -> dict[str, Any]:
    """``read(*args)`` if ``path`` exists, else {}; a TorchshipError becomes a line of the summary."""
    if not path.exists():
        return {}
    try:
        return read(*args)
    except TorchshipError as e:
        lines += ["", f"(left out: {e})"]
        return {}
