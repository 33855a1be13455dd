"""run_bench: the limits, the in-process part and the served part, written as results.json and a report."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from torchship.errors import BenchError, TorchshipError
from torchship.io import atomic_write_json
from torchship.manifest import bench_inputs, check_shape, read_manifest, read_reference

from .compare import RESULTS_FORMAT
from .config import BenchConfig
from .in_process import bench_in_process
from .recommend import recommend, write_recommendation
from .served import bench_served, check_models, served_runs, start_own_server
from .stats import device_peak, flops_per_sample, machine_info


def run_bench(cfg: BenchConfig, log=print, server=None) -> dict[str, Any]:
    """Measure, then write OUT/results.json, OUT/report.md and plots. Partial results are written
    even when a part fails; the failure is raised afterwards as BenchError/ServerError/ClientError.
    The served part runs against ``server`` (a started ``bench_server``, left running) if given, else
    against ``cfg.url``, else against an embedded server of its own."""
    import torch

    from .report import write_report

    if not cfg.export_dir:
        raise BenchError("give an EXPORT_DIR (its manifest names the model, inputs and reference data)")
    export_dir = Path(cfg.export_dir)
    manifest = read_manifest(export_dir)
    check_shape(manifest, cfg.shape_values())
    if cfg.models and not cfg.skip_served:
        check_models(cfg, manifest, server)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    device = manifest.get("device", "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError(f"{export_dir} was exported for CUDA; no GPU is visible here")
    results: dict[str, Any] = {"format": RESULTS_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "export": {"dir": str(export_dir.resolve()), "name": manifest["name"],
                                          "input_shape": manifest["inputs"][0]["shape"], "dtype": manifest.get("dtype"),
                                          "inputs": manifest["inputs"]},
                               "config": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(cfg).items()
                                          if k != "serve"},
                               "machine": machine_info(), "errors": []}

    def save() -> None:
        atomic_write_json(out / "results.json", results)

    try:  # limits: FLOPs per sample and the measured device peak
        from export.source import eager_from_manifest

        from .in_process import real_inputs

        pool, results["export"]["samples"] = bench_inputs(read_reference(export_dir, manifest), manifest, cfg.shape_values())
        feeds = real_inputs(pool, 2)
        results["limits"] = {"flops_per_sample": flops_per_sample(eager_from_manifest(manifest),
                                                                  [feeds[t["name"]] for t in manifest["inputs"]]),
                             **device_peak(device, cfg.threads)}
    except TorchshipError as e:
        results["limits"] = {"error": str(e)}
    save()
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        from ..repository import model_names

        n_in = 0 if cfg.skip_in_process else len(cfg.variants) * (cfg.iters // cfg.blocks) * cfg.blocks * \
            len([b for b in cfg.batch_sizes if b <= manifest["max_batch"]])
        embedded = server is not None or not cfg.url
        expected = list(cfg.models) or list(model_names(manifest).values())  # until the server says what it serves
        n_served = 0 if cfg.skip_served else served_runs(cfg, manifest, expected, embedded, embedded)
        bar = tqdm(total=n_in + n_served, desc="bench", unit="run", dynamic_ncols=True, file=sys.stderr)
    failure: TorchshipError | None = None
    try:
        if not cfg.skip_in_process:
            log("in-process: " + ", ".join(cfg.variants) + f" at batch {', '.join(map(str, cfg.batch_sizes))}")
            results["in_process"] = bench_in_process(cfg, export_dir, manifest, device, bar)
            save()
        if not cfg.skip_served:
            own = server is None and not cfg.url
            try:
                if own:
                    server = start_own_server(cfg, export_dir, manifest, out)
                url = server.url if server is not None else cfg.url
                log(f"served: {url}")
                bench_served(cfg, export_dir, manifest, url, server, bar, results, save)
            finally:
                if own and server is not None:
                    server.stop()
                    if server.stop_note:
                        results["server_stop_note"] = server.stop_note
                        log(f"note: {server.stop_note}")
    except TorchshipError as e:
        failure = e
        results["errors"].append(str(e))
    finally:
        if bar:
            bar.close()
    rec = recommend(results, cfg.p99_budget_ms, manifest["max_batch"]) if "served" in results else {"error": "no served results"}
    results["recommendation"] = rec
    if cfg.write_config and "error" not in rec:
        rec["written"] = write_recommendation(Path(cfg.repo) if cfg.repo else out / "repo", rec)
    save()
    write_report(results, out, plots=cfg.plots)
    log(f"results: {out / 'results.json'}   report: {out / 'report.md'}")
    if failure is not None:
        raise type(failure)(f"{failure} (partial results kept in {out / 'results.json'})")
    if "error" in rec and cfg.p99_budget_ms is not None:
        raise BenchError(f"{rec['error']} (results kept in {out / 'results.json'})")
    return results
