"""run_bench: the limits, the in-process part and the served part, written as results.json and a report."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from torchship.eager import flops_per_sample
from torchship.errors import BenchError, TorchshipError
from torchship.io import atomic_write_json
from torchship.manifest import Export, check_shape

from .checks import wrong_in
from .compare import RESULTS_FORMAT
from .config import BenchConfig
from .in_process import bench_in_process, in_process_runs, load_variants
from .inputs import BenchInputs, load_inputs, real_inputs
from .recommend import recommend, write_recommendation
from .results import timed
from .stats import device_peak, machine_info


def run_bench(cfg: BenchConfig, log=print, server=None, export: Export | None = None) -> dict[str, Any]:
    """Measure, then write OUT/results.json, OUT/report.md and plots. Partial results are written
    even when a part fails; the failure is raised afterwards as BenchError/ServerError/ClientError.
    The served part runs against ``server`` (a started ``bench_server``, left running) if given, else
    against ``cfg.url``, else against an embedded server of its own. The manifest, the reference inputs
    and eager are read once, here (or come with ``export``, an Export held already), and handed to every part."""
    import torch

    from .report import write_report

    if not cfg.export_dir and export is None:
        raise BenchError("give an EXPORT_DIR (its manifest names the model, inputs and reference data)")
    export = export or Export(cfg.export_dir)
    export_dir, manifest = export.dir, export.manifest
    cfg = cfg.for_model(manifest)
    check_shape(manifest, cfg.shape_values())
    device = manifest.get("device", "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError(f"{export_dir} was exported for CUDA; no GPU is visible here")
    plan = None
    if not cfg.skip_served:
        from . import served  # tritonclient, which only the served part needs: --skip-served runs without it

        plan = served.served_plan(cfg, manifest, server)
    in_process = not (cfg.skip_in_process or cfg.soak)  # a soak measures the served models alone
    inputs = load_inputs(export, cfg.shape_values(), eager=in_process)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "format": RESULTS_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "export": {
            "dir": str(export_dir.resolve()),
            "name": manifest["name"],
            "input_shape": manifest["inputs"][0]["shape"],
            "dtype": manifest.get("dtype"),
            "inputs": manifest["inputs"],
            "samples": inputs.samples,
        },
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(cfg).items() if k != "serve"},
        "machine": machine_info(),
        "errors": [],
    }

    def save() -> None:
        atomic_write_json(out / "results.json", results)

    # the in-process rows are read against these; without that part the probe's seconds buy nothing
    with timed(results, "limits"):
        results["limits"] = limits(inputs, device, cfg.threads) if in_process else {}
    save()
    with timed(results, "loading"):
        runners, notes = load_variants(cfg, inputs, device) if in_process else ({}, {})
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        from .soak import soak_windows

        total = in_process_runs(cfg, runners, manifest) if in_process else 0
        if plan is not None and plan.error is None:
            total += soak_windows(cfg, plan.models) if cfg.soak else plan.windows()
        bar = tqdm(total=total, desc="bench", unit="run", dynamic_ncols=True, file=sys.stderr)
    failure: TorchshipError | None = None
    try:
        if in_process:
            log(
                "in-process: "
                + (", ".join(runners) or "nothing to run")
                + f" at batch {', '.join(map(str, cfg.batch_sizes))}"
            )
            with timed(results, "in_process"):
                results["in_process"] = bench_in_process(cfg, inputs, runners, notes, device, bar)
            save()
        if plan is not None:
            if plan.error is not None:
                raise plan.error
            own = server is None and not cfg.url
            try:
                if own:
                    server = served.start_own_server(cfg, export, out, plan)
                url = server.url if server is not None else cfg.url
                log(f"served: {url}")
                if cfg.soak:
                    from .soak import bench_soak

                    bench_soak(cfg, inputs, plan, url, server, bar, results, save, log)
                else:
                    served.bench_served(cfg, inputs, plan, url, server, bar, results, save)
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
    rec = (
        recommend(results, cfg.p99_budget_ms, manifest["max_batch"])
        if "served" in results
        else {"error": "no served results"}
    )
    if cfg.soak:
        rec = {}  # a soak holds one level: nothing to recommend from
    results["recommendation"] = rec
    if cfg.write_config and rec and "error" not in rec:
        rec["written"] = write_recommendation(Path(cfg.repo) if cfg.repo else out / "repo", rec)
    save()
    write_report(results, out, plots=cfg.plots)
    log(f"results: {out / 'results.json'}   report: {out / 'report.md'}")
    wrong = wrong_in(results.get("served", {}))
    if wrong is not None:  # a wrong answer outweighs every figure measured
        raise wrong
    from .soak import soak_failure

    soaked = [e for e in map(soak_failure, results.get("soak", {}).values()) if e]
    if soaked:
        raise BenchError("; ".join(map(str, soaked)) + f" (results kept in {out / 'results.json'})")
    if failure is not None:
        raise type(failure)(f"{failure} (partial results kept in {out / 'results.json'})")
    if "error" in rec and cfg.p99_budget_ms is not None:
        raise BenchError(f"{rec['error']} (results kept in {out / 'results.json'})")
    return results


def limits(inputs: BenchInputs, device: str, threads: int) -> dict[str, Any]:
    """FLOPs per sample (eager on two real samples) and the measured device peak."""
    if inputs.eager is None:
        return {"error": inputs.eager_error}
    import torch

    try:
        feeds = real_inputs(inputs.pool, 2)
        flops = flops_per_sample(inputs.eager, [torch.from_numpy(feeds[t["name"]]) for t in inputs.manifest["inputs"]])
        return {"flops_per_sample": flops, **device_peak(device, threads)}
    except TorchshipError as e:
        return {"error": str(e)}
