"""BenchConfig: what to measure, how long, and the latency budget for the recommendation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from torchship.config import opt
from torchship.errors import ConfigError

from .config import check_url, parse_cpu_range, parse_cpus

IN_PROCESS = ("eager", "torchscript", "exported_program", "aoti", "aoti_buckets", "onnx")


@dataclass
class BenchConfig:
    export_dir: Optional[str] = opt(None, "export directory to benchmark", cli=False)
    url: Optional[str] = opt(None, "benchmark an already-running Triton at HOST:PORT instead of starting the embedded one")
    repo: Optional[str] = opt(None, "repository for the embedded server (default: built from the export into OUT/repo)")
    out: str = opt("runs/bench", "directory for results.json, report.md and the plots")
    variants: tuple[str, ...] = opt(IN_PROCESS, "in-process variants: " + ", ".join(IN_PROCESS))
    batch_sizes: tuple[int, ...] = opt((1, 8, 32), "in-process batch sizes to sweep")
    iters: int = opt(200, "timed runs per in-process variant and batch size (split into interleaved blocks)")
    blocks: int = opt(10, "interleaved blocks: each variant runs iters/blocks times per block, in turn")
    warmup: int = opt(10, "untimed runs per variant and batch size before timing")
    threads: int = opt(1, "intra-op threads for in-process runs (match the served instances)")
    models: tuple[str, ...] = opt((), "served models to sweep (default: every served model of the export)")
    concurrency: tuple[int, ...] = opt((1, 2, 4, 8, 16, 32), "closed-loop concurrency levels (requests in flight)")
    requests: int = opt(200, "requests per concurrency level")
    batching_compare: tuple[str, ...] = opt(("onnx",), "formats whose sweep is repeated with dynamic batching off (embedded server only)")
    queue_delays_us: tuple[int, ...] = opt((), "extra max_queue_delay_microseconds values to sweep (embedded server only)")
    rate: Optional[float] = opt(None, "also run an open-loop test at this many requests/s (Poisson arrivals)")
    duration_s: float = opt(5.0, "open-loop test duration in seconds")
    p99_budget_ms: Optional[float] = opt(None, "latency budget for the recommendation (p99, milliseconds)")
    write_config: bool = opt(False, "write the recommended batching settings back into the repository's configs")
    cross_check: bool = opt(True, "cross-check the served sweep with Triton's perf_analyzer where it is installed")
    perf_analyzer: Optional[str] = opt(None, "path to perf_analyzer (default: $TORCHSHIP_PERF_ANALYZER, the torchship cache, then PATH)")
    overhead: bool = opt(True, "at batch 1, measure every served model, its artifact in-process and the no-op floor "
                               "side by side, with Triton's and the backend's breakdown of the difference")
    hold_memory: bool = opt(True, "the hold model (the floor for a model that runs as long as each one) reads through "
                                  "a buffer as large as the model's artifact while it waits, as the model streams its "
                                  "weights; --no-hold-memory: it only spins")
    trace: bool = opt(False, "embedded server: while the overhead is measured, record Triton's timestamps for every "
                             "request (OUT/triton_trace.json) and split each path's round trip into request leg, to "
                             "the model, backend, after the model and response leg (tracing adds a little time)")
    cpu_latency_us: Optional[int] = opt(None, "hold a /dev/cpu_dma_latency request at this many microseconds for the "
                                              "whole run (0: idle CPUs keep polling; see torchship serve --help); needs root")
    spin_cpus: Optional[str] = opt(None, "keep these CPUs from going idle for the whole run with lowest-priority "
                                         "spinners (see torchship serve --spin-cpus); no root needed")
    transport: Literal["unary", "stream"] = opt("unary", "how requests are sent one at a time (the batch-1 overhead "
                                               "and concurrency 1): one unary ModelInfer call each, as "
                                               "perf_analyzer sends them, or over one bidirectional gRPC "
                                               "stream (ModelStreamInfer)")
    python_host: Literal["auto", "server", "stub"] = opt("auto", "embedded server: where torchship's Python-based "
                                                          "backends run (see torchship serve --help)")
    server_cpus: Optional[str] = opt(None, "embedded server: run it on these CPUs only (see torchship serve --cpus); "
                                           "pin the bench itself, client and in-process runs, with taskset -c")
    server_model_cpus: Optional[str] = opt(None, "embedded server: run its model instances on these CPUs, one CPU or one "
                                                 "range (see torchship serve --model-cpus)")
    skip_in_process: bool = opt(False, "skip the in-process part")
    skip_served: bool = opt(False, "skip the served part")
    plots: bool = opt(True, "draw the matplotlib plots")
    progress: bool = opt(True, "show a live progress bar")

    def __post_init__(self) -> None:
        bad = [v for v in self.variants if v not in IN_PROCESS]
        if bad:
            raise ConfigError(f"--variants: unknown {', '.join(bad)}; choose from {', '.join(IN_PROCESS)}")
        if self.iters < self.blocks or self.blocks < 1:
            raise ConfigError("--iters must be at least --blocks, and --blocks at least 1")
        if any(b < 1 for b in self.batch_sizes) or any(c < 1 for c in self.concurrency):
            raise ConfigError("--batch-sizes and --concurrency must be positive")
        if self.requests < 1:
            raise ConfigError("--requests must be at least 1")
        if self.p99_budget_ms is not None and self.p99_budget_ms <= 0:
            raise ConfigError("--p99-budget-ms must be positive")
        if self.cpu_latency_us is not None and self.cpu_latency_us < 0:
            raise ConfigError("--cpu-latency-us must be 0 or more")
        if self.spin_cpus is not None:
            parse_cpus(self.spin_cpus, "--spin-cpus")
        if self.rate is not None and self.rate <= 0:
            raise ConfigError("--rate must be positive")
        if self.url is not None:
            check_url(self.url)
        if self.server_cpus is not None:
            if self.url:
                raise ConfigError("--server-cpus pins the embedded server; an external one (--url) is pinned where it runs")
            parse_cpus(self.server_cpus, "--server-cpus")
        if self.server_model_cpus is not None:
            if self.url:
                raise ConfigError("--server-model-cpus pins the embedded server's models; an external server is "
                                  "pinned where it runs (Triton's --host-policy=cpu,cpu-cores=LO-HI)")
            parse_cpu_range(self.server_model_cpus, "--server-model-cpus")
        if self.trace and (self.url or self.skip_served or not self.overhead):
            raise ConfigError("--trace needs the overhead measurement on the embedded server (no --url, --skip-served "
                              "or --no-overhead)")
