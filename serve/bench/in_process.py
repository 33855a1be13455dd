"""In-process latency per exported format: each artifact loaded as serving loads it, timed in this process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from torchship.errors import TorchshipError
from torchship.manifest import artifact, bench_inputs, read_reference

from .config import BenchConfig
from .stats import summarize


def reference_pool(export_dir: Path, manifest: dict, shape: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """The inputs a benchmark draws from, by input name (torchship.manifest.bench_inputs), read and checked
    once per stage."""
    return bench_inputs(read_reference(export_dir, manifest), manifest, shape)[0]


def real_inputs(pool: dict[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
    """A batch of every input drawn from ``pool`` (tiled if it holds fewer rows)."""
    reps = -(-batch // len(next(iter(pool.values()))))
    return {k: np.ascontiguousarray(np.concatenate([v] * reps)[:batch]) for k, v in pool.items()}


def single_rows(pool: dict[str, np.ndarray], n: int) -> list[dict[str, np.ndarray]]:
    """``n`` batch-1 requests (feeds by input name) drawn from ``pool``."""
    batch = real_inputs(pool, n)
    return [{k: v[i:i + 1] for k, v in batch.items()} for i in range(n)]


def load_variants(cfg: BenchConfig, export_dir: Path, manifest: dict, device: str) -> tuple[dict[str, Callable], dict]:
    """{variant: function of a batch}, and a note per variant that could not be loaded (or its providers)."""
    from torchship import runtime

    runners: dict[str, Callable] = {}
    notes: dict[str, str] = {}
    ins, outs = [i["name"] for i in manifest["inputs"]], [o["name"] for o in manifest["outputs"]]
    for v in cfg.variants:
        try:
            if v == "eager":
                from export.source import eager_from_manifest

                fn = runtime.torch_fn(eager_from_manifest(manifest).to(device), device)
                runners[v] = lambda feeds, fn=fn: fn([feeds[n] for n in ins])
                continue
            r = runtime.load_artifact(str(export_dir), artifact(manifest, v), ins, outs, device=device, threads=cfg.threads)
            runners[v] = r.run
            if v == "onnx":
                notes[v] = f"ONNX Runtime providers: {', '.join(r.session.get_providers())}"
        except TorchshipError as e:
            notes[v] = f"skipped: {e}"
        except Exception as e:
            notes[v] = f"skipped: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return runners, notes


def time_blocks(paths: dict[str, Callable[[], Any]], blocks: int, per_block: int, bar) -> dict[str, list[float]]:
    """Seconds per call of each path, run in turn in ``blocks`` blocks of ``per_block`` calls, so that
    machine drift falls on every path alike."""
    lat: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(blocks):
        for name, fn in paths.items():
            for _ in range(per_block):
                t0 = time.perf_counter()
                fn()
                lat[name].append(time.perf_counter() - t0)
            if bar:
                bar.update(per_block)
    return lat


def bench_in_process(cfg: BenchConfig, export_dir: Path, manifest: dict, device: str, bar) -> dict[str, Any]:
    """Latency and samples/s per variant and batch size, on the export's real samples (or --shape's)."""
    import torch

    torch.set_num_threads(cfg.threads)
    runners, notes = load_variants(cfg, export_dir, manifest, device)
    rows = []
    raw: dict[str, list[float]] = {}
    pool = reference_pool(export_dir, manifest, cfg.shape_values())
    for b in cfg.batch_sizes:
        if b > manifest["max_batch"]:
            notes[f"batch {b}"] = f"skipped: above the export's max batch {manifest['max_batch']}"
            continue
        x = real_inputs(pool, b)
        for fn in runners.values():
            for _ in range(cfg.warmup):
                fn(x)
        lat = time_blocks({v: (lambda fn=fn: fn(x)) for v, fn in runners.items()}, cfg.blocks,
                          max(1, cfg.iters // cfg.blocks), bar)
        for v, ls in lat.items():
            raw[f"{v}/b{b}"] = [round(t * 1e3, 4) for t in ls]
            s = summarize(ls)
            rows.append({"variant": v, "batch": b, **s, "images_per_s": b / (s["mean_ms"] / 1e3)})
    return {"device": device, "threads": cfg.threads, "rows": rows, "notes": notes, "raw_ms": raw}
