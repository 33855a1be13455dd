"""BenchConfig: what to measure, how long, and the latency budget for the recommendation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional

from torchship.config import opt
from torchship.device import usable_cpus
from torchship.errors import ConfigError
from torchship.runtime import ARTIFACT_FORMATS

from ..config import ServeConfig, check_url, default_placement

# a bench that feeds a decision (torchship run's bench stage, repo --strategy without --bench): windows of 0.3 s, five
# at most (torchship bench alone: one second, ten), three in-process blocks; one request in flight and 64 (two
# instances forming batches of 32), where the models rank for throughput (16 ranked resnet18's onnx 13 % above
# aoti_int8, 64 ranked aoti_int8 40 % above onnx); none of the sweeps only an investigation reads (batching off, the
# no-op round trip)
SHORT_BENCH = {
    "window_s": 0.3,
    "max_windows": 5,
    "iters": 15,
    "blocks": 3,
    "concurrency": (1, 64),
    "batching_compare": (),
    "noop": False,
    "raw_entry": False,
}
SOAK_BOUND_KIB = 64.0  # growth per 1000 requests past which the soak fails (see bench_soak)
IN_PROCESS = ("eager", *ARTIFACT_FORMATS)


@dataclass
class BenchConfig:
    export_dir: Optional[str] = opt(None, "export directory to benchmark", cli=False)
    url: Optional[str] = opt(
        None, "benchmark an already-running Triton at HOST:PORT instead of starting the embedded one"
    )
    repo: Optional[str] = opt(
        None,
        "repository for the embedded server, which loads from it only the models it times "
        "(default: built from the export into OUT/repo)",
    )
    out: str = opt("runs/bench", "directory for results.json, report.md and the plots")
    variants: tuple[str, ...] = opt(
        (), "in-process variants, of " + ", ".join(IN_PROCESS) + " (default: eager and every format the export has)"
    )
    batch_sizes: tuple[int, ...] = opt((1, 32), "in-process batch sizes to sweep")
    iters: int = opt(60, "timed runs per in-process variant and batch size (split into interleaved blocks)")
    blocks: int = opt(6, "interleaved blocks: each variant runs iters/blocks times per block, in turn")
    warmup: int = opt(5, "untimed runs per variant and batch size before timing")
    cores: Optional[int] = opt(
        None,
        "CPU cores the bench's own repository gives its models, and the in-process runs' "
        "threads (default: those this process may run on, its CPU affinity)",
    )
    threads: Optional[int] = opt(
        None,
        "intra-op threads for in-process runs (default: one served instance's, as the repository's default "
        "placement gives it: 1 on up to 4 cores, every core for a model of 1 GFLOP a sample or more)",
    )
    models: tuple[str, ...] = opt((), "served models to sweep (default: every served model of the export)")
    concurrency: tuple[int, ...] = opt((1, 4, 16), "closed-loop concurrency levels (batch-1 requests in flight)")
    requests: int = opt(
        150, "the fewest requests a concurrency level's figures rest on (its last three windows together)"
    )
    window_s: float = opt(
        1.0,
        "the shortest measurement window, in seconds: each concurrency level (and each in-process "
        "block) is measured in windows until the last three agree within --stability",
    )
    stability: float = opt(10.0, "percent within which the last three windows' throughput and mean latency must agree")
    max_windows: int = opt(10, "windows after which a level that has not settled stops and is reported unstable")
    batching_compare: tuple[str, ...] = opt(
        ("onnx",), "formats whose sweep is repeated with dynamic batching off (embedded server only)"
    )
    queue_delays_us: tuple[int, ...] = opt(
        (), "extra max_queue_delay_microseconds values to sweep (embedded server only)"
    )
    noop: bool = opt(True, "also time a model that runs nothing: the round trip of the protocol and the backend alone")
    raw_entry: bool = opt(
        True,
        "also time the raw entry (<name>_image, or <name>_text) where it is served: the "
        "export's held-out files (images, or texts) sent as they are, beside the model "
        "behind it",
    )
    rate: Optional[float] = opt(None, "also run an open-loop test at this many requests/s (Poisson arrivals)")
    duration_s: float = opt(5.0, "open-loop test duration in seconds")
    p99_budget_ms: Optional[float] = opt(None, "latency budget for the recommendation (p99, milliseconds)")
    write_config: bool = opt(False, "write the recommended batching settings back into the repository's configs")
    load_generator: Literal["auto", "perf_analyzer", "python"] = opt(
        "auto",
        "who sends the served requests: perf_analyzer (Triton's C++ client), python "
        "(torchship's), or auto: perf_analyzer where it is installed",
    )
    cross_check: bool = opt(
        True, "repeat concurrency 1 and the highest level on one model with the other load generator"
    )
    perf_analyzer: Optional[str] = opt(
        None, "path to perf_analyzer (default: $TORCHSHIP_PERF_ANALYZER, the torchship cache, then PATH)"
    )
    shape: tuple[str, ...] = opt(
        (),
        "NAME=SIZE for a dynamic dim of the inputs, e.g. S=64: the size the bench runs at "
        "(default: the real samples' own; repeatable)",
        flag="--shape",
        append=True,
    )
    soak: Optional[str] = opt(
        None,
        "instead of the sweeps: hold the model served under the export's name (--models: "
        "each of those in turn) at the highest --concurrency for this long (120s, 2m, 1h), "
        "every response checked, sampling the resident memory of the server and of each "
        "backend process; fails past --soak-bound-kib",
        metavar="DURATION",
    )
    soak_bound_kib: float = opt(
        SOAK_BOUND_KIB,
        "the soak's bound: KiB a process may grow per 1000 requests, after the "
        "first quarter of them (meant for soaks of minutes: a soak of seconds "
        "can still be filling the runtimes' arenas)",
    )
    skip_in_process: bool = opt(False, "skip the in-process part")
    skip_served: bool = opt(False, "skip the served part")
    plots: bool = opt(True, "draw the matplotlib plots")
    progress: bool = opt(True, "show a live progress bar")
    serve: ServeConfig = opt(ServeConfig(), "how the embedded server runs (torchship serve's options)", cli=False)

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
        if self.window_s < 0 or self.stability <= 0:
            raise ConfigError("--window-s must be 0 or more, and --stability a positive percent")
        if self.max_windows < 3:
            raise ConfigError("--max-windows must be at least 3 (stability is judged over the last three windows)")
        if self.p99_budget_ms is not None and self.p99_budget_ms <= 0:
            raise ConfigError("--p99-budget-ms must be positive")
        if self.rate is not None and self.rate <= 0:
            raise ConfigError("--rate must be positive")
        if self.url is not None:
            check_url(self.url)
        if self.soak is not None:
            from .soak import parse_duration

            parse_duration(self.soak)
            if self.soak_bound_kib <= 0:
                raise ConfigError("--soak-bound-kib must be positive")
            if self.skip_served:
                raise ConfigError("--soak measures the served models; drop --skip-served")
        if any(v is not None and v < 1 for v in (self.cores, self.threads)):
            raise ConfigError("--cores and --threads must be at least 1")
        self.shape_values()

    def for_model(self, manifest: dict[str, Any]) -> "BenchConfig":
        """This config with its in-process threads filled in where --threads was not given: one served instance's,
        as the repository's default placement gives the model (its cost from the manifest), so that no pool spins
        against another runtime's."""
        if self.threads is not None:
            return self
        cores = self.cores or usable_cpus()
        return dataclasses.replace(self, threads=default_placement(cores, manifest.get("flops_per_sample"))[1])

    def shape_values(self) -> dict[str, int]:
        """--shape as {dim name: size}; ConfigError for a value not of the form NAME=SIZE."""
        out = {}
        for text in self.shape:
            name, sep, size = text.partition("=")
            if not sep or not name or not size.isdigit() or int(size) < 1:
                raise ConfigError(f"--shape {text!r} must look like NAME=SIZE with a positive SIZE, e.g. S=64")
            out[name] = int(size)
        return out
