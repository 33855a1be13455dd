"""In-process latency per exported format: each artifact loaded as serving loads it, timed in this process."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from torchship.errors import TorchshipError, first_line
from torchship.manifest import artifact

from .config import BenchConfig
from .inputs import BenchInputs, real_inputs
from .stats import summarize
from .windows import LAST, settle, ticker


def load_variants(cfg: BenchConfig, inputs: BenchInputs, device: str) -> tuple[dict[str, Callable], dict]:
    """{variant: function of a batch}, and a note per variant that could not be loaded (or its providers)."""
    from torchship import runtime

    runners: dict[str, Callable] = {}
    notes: dict[str, str] = {}
    manifest = inputs.manifest
    ins, outs = [i["name"] for i in manifest["inputs"]], [o["name"] for o in manifest["outputs"]]
    have = [a["name"] for a in manifest["artifacts"]]
    for v in cfg.variants or ("eager", *have):
        if v not in have and v != "eager":
            notes[v] = "skipped: the export has no such artifact"
            continue
        try:
            if v == "eager":
                if inputs.eager is None:
                    notes[v] = f"skipped: {inputs.eager_error}"
                    continue
                fn = runtime.torch_fn(inputs.eager.to(device), device)
                runners[v] = lambda feeds, fn=fn: fn([feeds[n] for n in ins])
                continue
            r = runtime.load_artifact(
                str(inputs.export_dir), artifact(manifest, v), ins, outs, device=device, threads=cfg.threads
            )
            runners[v] = r.run
            if v in runtime.ONNX_FORMATS:
                notes[v] = f"ONNX Runtime providers: {', '.join(r.session.get_providers())}"
        except TorchshipError as e:
            notes[v] = f"skipped: {e}"
        except Exception as e:
            notes[v] = f"skipped: {first_line(e, 200)}"
    return runners, notes


def batch_sizes(cfg: BenchConfig, manifest: dict) -> list[int]:
    return [b for b in cfg.batch_sizes if b <= manifest["max_batch"]]


def in_process_runs(cfg: BenchConfig, runners: dict, manifest: dict) -> int:
    """How many measurement windows (one variant's block of calls) bench_in_process plans with ``runners``:
    the progress bar's share, grown as a batch size needs more blocks to settle."""
    return len(runners) * len(batch_sizes(cfg, manifest)) * max(cfg.blocks, LAST)


def time_blocks(
    paths: dict[str, Callable[[], Any]], cfg: BenchConfig, bar
) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """Seconds per call of each path, run in turn in blocks, so that machine drift falls on every path alike.
    In a block each path makes iters/blocks calls and takes at least its share of --window-s. At least
    --blocks blocks (and three) run, then more until every path's last three block means agree within
    --stability, or --max-windows blocks. Also, per path, the spread of those three means and whether
    they settled."""
    per_block = max(1, cfg.iters // cfg.blocks)
    share = cfg.window_s / max(1, len(paths))

    def block() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {}
        for name, fn in paths.items():
            times[name] = []
            start = time.perf_counter()
            while len(times[name]) < per_block or time.perf_counter() - start < share:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        return times

    def means(w: dict[str, list[float]]) -> list[float]:
        return [sum(w[k]) / len(w[k]) for k in paths]

    blocks, how = settle(
        block,
        means,
        cfg.stability / 100,
        max(cfg.blocks, LAST),
        max(cfg.max_windows, cfg.blocks),
        ticker(bar, max(cfg.blocks, LAST), len(paths)),
    )
    lat = {k: [t for w in blocks for t in w[k]] for k in paths}
    return lat, {
        k: {"windows": how["windows"], "spread": sp, "stable": len(blocks) >= LAST and sp <= cfg.stability / 100}
        for k, sp in zip(paths, how["spreads"])
    }


def bench_in_process(
    cfg: BenchConfig, inputs: BenchInputs, runners: dict[str, Callable], notes: dict[str, str], device: str, bar
) -> dict[str, Any]:
    """Latency and samples/s per loaded variant and batch size, on the export's real samples (or --shape's)."""
    import torch

    torch.set_num_threads(cfg.threads)
    rows = []
    raw: dict[str, list[float]] = {}
    fits = batch_sizes(cfg, inputs.manifest)
    for b in cfg.batch_sizes:
        if b not in fits:
            notes[f"batch {b}"] = f"skipped: above the export's max batch {inputs.manifest['max_batch']}"
            continue
        x = real_inputs(inputs.pool, b)
        for fn in runners.values():
            for _ in range(cfg.warmup):
                fn(x)
        lat, how = time_blocks({v: (lambda fn=fn, x=x: fn(x)) for v, fn in runners.items()}, cfg, bar)
        for v, ls in lat.items():
            raw[f"{v}/b{b}"] = [round(t * 1e3, 4) for t in ls]
            s = summarize(ls)
            rows.append({"variant": v, "batch": b, **s, "images_per_s": b / (s["mean_ms"] / 1e3), **how[v]})
    out = {"device": device, "threads": cfg.threads, "rows": rows, "notes": notes, "raw_ms": raw}
    if inputs.labels is not None:  # accuracy beside speed: each variant's top-1 on the labelled samples
        out["accuracy"] = {v: accuracy(fn, inputs, max(fits, default=1)) for v, fn in runners.items()}
    return out


def accuracy(fn: Callable, inputs: BenchInputs, batch: int) -> float:
    """Percent of the labelled real samples whose top class (of the first output) is their label."""
    n = len(inputs.labels)
    right = 0
    for i in range(0, n, batch):
        out = fn({k: v[i : i + batch] for k, v in inputs.pool.items()})
        first = next(iter(out.values())) if isinstance(out, dict) else out[0]
        right += int((np.asarray(first).argmax(-1) == inputs.labels[i : i + batch]).sum())
    return round(100 * right / n, 2)
