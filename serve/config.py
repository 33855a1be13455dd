"""RepoConfig, ServeConfig and InferConfig: how the Triton repository is written, how the server runs and
what a client sends it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from torchship.config import opt
from torchship.errors import ConfigError
from torchship.names import SERVED_FORMATS

from .access import check_files

DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT = 8001, 8000, 8002
# The official container the repository targets: 26.07+ batches torch_aoti models; see deploy/README.md.
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:26.11-py3"
REPOSITORY_DIR = "model_repository"


def check_url(url: str, flag: str = "--url") -> None:
    """A gRPC address as grpc takes it, HOST:PORT ([::1]:8001 for IPv6); ConfigError naming what is off, so
    that a slip is refused at once instead of after the readiness deadline."""
    fix = "give Triton's gRPC address as HOST:PORT, as in 127.0.0.1:8001"
    if "://" in url:
        raise ConfigError(f"{flag} {url}: drop the scheme ({url.split('://')[0]}://); {fix}")
    host, sep, port = url.rpartition(":")
    if not sep:
        raise ConfigError(f"{flag} {url}: no port; {fix}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ConfigError(f"{flag} {url}: write an IPv6 address in brackets, as in [::1]:8001")
    if not host:
        raise ConfigError(f"{flag} {url}: no host; {fix}")
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"{flag} {url}: {port!r} is not a port number (1-65535); {fix}")


STRATEGIES = ("max-throughput", "min-latency", "p99-budget=MS")


def parse_strategy(text: str) -> tuple[str, float | None]:
    """--strategy as ("max-throughput" | "min-latency" | "p99-budget", the budget in ms or None); ConfigError
    otherwise."""
    if text in ("max-throughput", "min-latency"):
        return text, None
    kind, _, ms = text.partition("=")
    try:
        if kind == "p99-budget" and float(ms) > 0:
            return kind, float(ms)
    except ValueError:
        pass
    raise ConfigError(
        f"--strategy {text!r}: choose max-throughput, min-latency or p99-budget=MS (MS a positive number)"
    )


TRT_CACHE = "/tmp/trt_cache"  # TensorRT engine cache inside the server, unless --trt-cache says


@dataclass
class RepoConfig:
    out: str = opt(REPOSITORY_DIR, "repository directory to write")
    formats: tuple[str, ...] = opt(SERVED_FORMATS, "which exported formats become Triton models (those the export has)")
    max_queue_delay_us: int = opt(
        0,
        "dynamic batching: longest a request waits for others, in microseconds (0: batch only "
        "what queued while the model was busy; measured best here at low and high load)",
    )
    instance_kind: Literal["auto", "cpu", "gpu"] = opt(
        "auto", "instance_group kind: KIND_GPU when serving on GPU (auto: if CUDA is visible)"
    )
    cores: Optional[int] = opt(
        None, "CPU cores the served models may use (default: those this process may run on, its CPU affinity)"
    )
    instance_count: Optional[int] = opt(
        None,
        "CPU model instances (default: one per core but one, left to the server and a client, up to 4; with "
        "--threads, as many as the cores hold; a GPU model has one per GPU)",
    )
    threads: Optional[int] = opt(
        None, "intra-op threads per CPU instance (default: 1, or the cores but one shared out among 4 instances)"
    )
    version: int = opt(1, "version folder to write the artifacts into")
    ort_accelerator: Literal["none", "cuda", "tensorrt"] = opt(
        "none", "ONNX Runtime GPU execution accelerator to configure"
    )
    trt_fp16: Optional[bool] = opt(None, "with --ort-accelerator tensorrt: allow FP16 engines (default: allowed)")
    trt_cache: Optional[str] = opt(
        None, f"with --ort-accelerator tensorrt: engine cache directory inside the server (default: {TRT_CACHE})"
    )
    max_batch: Optional[int] = opt(None, "max_batch_size (default: the export's max batch)")
    overwrite: bool = opt(False, "replace an existing repository directory")
    strategy: Optional[str] = opt(
        None,
        "also serve the winner under the export's plain name: max-throughput, min-latency "
        "or p99-budget=MS, judged on --bench's served figures (without --bench: a short "
        "served bench of the new repository, written beside it as OUT-bench)",
    )
    bench: Optional[str] = opt(
        None, "with --strategy: the results.json of a torchship bench of this export (default: run a short one)"
    )
    only_winner: bool = opt(False, "with --strategy: serve the winner alone, without the per-format models")
    image_entry: Optional[bool] = opt(
        None,
        "also serve <name>_image, which takes an encoded image file (JPEG, PNG, "
        "WebP, ...) as its bytes and prepares it in the server as training did "
        "(default: for an image model, one whose export records its preprocessing)",
    )
    text_entry: Optional[bool] = opt(
        None,
        "also serve <name>_text, which takes a text as its UTF-8 bytes and "
        "tokenizes it in the server with the export's tokenizer (default: for an "
        "export made with --tokenizer)",
    )

    def __post_init__(self) -> None:
        if self.strategy is not None:
            parse_strategy(self.strategy)
        if (self.bench or self.only_winner) and not self.strategy:
            raise ConfigError("--bench and --only-winner go with --strategy")
        bad = [f for f in self.formats if f not in SERVED_FORMATS]
        if bad:
            raise ConfigError(f"--formats: {', '.join(bad)} cannot be served; choose from {', '.join(SERVED_FORMATS)}")
        if self.max_queue_delay_us < 0:
            raise ConfigError("--max-queue-delay-us must be 0 or more")
        if any(v is not None and v < 1 for v in (self.cores, self.instance_count, self.threads)):
            raise ConfigError("--cores, --instance-count and --threads must be at least 1")
        if self.version < 1:
            raise ConfigError("--version must be at least 1")
        if self.max_batch is not None and self.max_batch < 1:
            raise ConfigError("--max-batch must be at least 1 (leave it out for the export's max batch)")
        if self.cores is not None and self.instance_count is not None and self.threads is not None:
            placement(self.cores, self.instance_count, self.threads)
        trt = [
            flag
            for flag, v in (
                (f"--{'' if self.trt_fp16 else 'no-'}trt-fp16", self.trt_fp16),
                ("--trt-cache", self.trt_cache),
            )
            if v is not None
        ]
        if trt and self.ort_accelerator != "tensorrt":
            one = len(trt) == 1
            raise ConfigError(
                f"{' and '.join(trt)} {'applies' if one else 'apply'} to TensorRT engines only; add "
                f"--ort-accelerator tensorrt, or leave {'it' if one else 'them'} out"
            )

    def search_cores(self) -> Optional[int]:
        """The cores --strategy searches the winner's instances x threads within: --cores or this machine's, or
        None where --instance-count or --threads fixed them, or --cores names more cores than this machine has
        (a repository built for a larger one cannot be measured here)."""
        from torchship.device import usable_cpus

        if self.instance_count is not None or self.threads is not None:
            return None
        here = usable_cpus()
        return None if self.cores and self.cores > here else (self.cores or here)


# the default's instances of a CPU model stop here: each is a process with its own runtime and weights
MAX_INSTANCES = 4
# a model of this many FLOPs a sample or more is compute-bound: tens of milliseconds of a core a sample (resnet50 at
# 224 costs 8.2 GFLOP), against about a millisecond of CPU a request's round trip costs the server and client
COMPUTE_BOUND_FLOPS = 1e9


def default_placement(cores: int, flops: float | None = None) -> tuple[int, int]:
    """(instances, intra-op threads per instance) a CPU model gets on ``cores`` cores unless told otherwise: one
    core left to the server's own threads and a client beside it (none on a single core), the rest to instances of
    one thread each, up to MAX_INSTANCES instances, which share out any more cores. An instance of one thread has no
    intra-op pool whose idle threads spin. Measured on 2 cores with the load generator on them (docs/benchmarks.md,
    "The default placement"): 1 x 1 spent the least server CPU a request and its levels settled, where 1 x 2's second
    thread spun against the client and the server; 2 x 1 served more at 64 in flight, which the search
    (serve/bench/search.py) gives the model that serves. A model of ``flops`` a sample at or above
    COMPUTE_BOUND_FLOPS gets every core as one instance: its own compute dwarfs the round trip, and the spare core
    cost resnet50 at 224 about 40 % of what the machine served."""
    if flops is not None and flops >= COMPUTE_BOUND_FLOPS:
        return 1, cores
    spare = max(1, cores - 1)
    instances = min(spare, MAX_INSTANCES)
    return instances, max(1, spare // instances)


def placement(
    cores: int,
    instances: Optional[int] = None,
    threads: Optional[int] = None,
    flags: str = "--instance-count and --threads",
    flops: float | None = None,
) -> tuple[int, int]:
    """(instances, intra-op threads per instance) for CPU instances on ``cores`` cores: what is given, the rest
    filled in so that together they use every core (default_placement, for a model of ``flops`` a sample, when
    neither is given). ConfigError where the instances' threads together exceed the cores: they would take turns
    on them."""
    if instances is None and threads is None:
        return default_placement(cores, flops)
    if instances is None:
        instances = max(1, cores // threads)
    if threads is None:
        threads = max(1, cores // instances)
    if instances * threads > cores:
        raise ConfigError(
            f"{flags}: {instances} instance(s) x {threads} thread(s) = {instances * threads} threads on "
            f"{cores} core(s) would take turns on the cores; give fewer, or --cores N for a larger machine"
        )
    return instances, threads


@dataclass
class ServeConfig:
    repo: str = opt("model_repository", "Triton model repository to serve", cli=False)
    host: str = opt("127.0.0.1", "address to bind (loopback by default)")
    grpc_port: int = opt(0, "gRPC port (0: pick a free one)")
    http_port: int = opt(0, "HTTP port (0: pick a free one)")
    metrics_port: int = opt(0, "Prometheus metrics port (0: pick a free one)")
    ready_timeout: float = opt(120.0, "seconds to wait for the server and every model to become ready")
    log: Optional[str] = opt(
        None, "server log file (default: a temp file, removed after a clean stop and kept after a failure)"
    )
    models: tuple[str, ...] = opt((), "load only these models (default: every model in the repository)")
    heal: bool = opt(
        True,
        "reload a model whose backend process died (it reports not ready meanwhile); one line per heal, "
        "counted in LOG.heals.json",
    )
    triton_args: tuple[str, ...] = opt(
        (),
        "extra tritonserver arguments, passed on as they are (repeatable: "
        "--triton-arg=--host-policy=cpu,cpu-cores=1-1 --triton-arg=--log-verbose=1)",
        flag="--triton-arg",
        append=True,
    )
    tls_cert: Optional[str] = opt(
        None,
        "serve gRPC over TLS with this certificate (PEM; for a client at 127.0.0.1 its "
        "subjectAltName must name IP:127.0.0.1); with --tls-key",
        metavar="PEM",
    )
    tls_key: Optional[str] = opt(None, "the private key of --tls-cert (PEM)", metavar="PEM")
    tls_client_ca: Optional[str] = opt(
        None,
        "with --tls-cert: mutual TLS, accepting only clients whose certificate this CA signed (PEM)",
        metavar="PEM",
    )
    tls_ca: Optional[str] = opt(
        None,
        "with --tls-cert: the CA that signed it, for torchship's own calls to the server "
        "(default: --tls-cert itself, as for a self-signed certificate)",
        metavar="PEM",
    )
    tls_own_cert: Optional[str] = opt(
        None,
        "with --tls-client-ca: a client certificate that CA signed, which torchship's "
        "own calls present (start-up checks, model loads, healing); with "
        "--tls-own-key",
        metavar="PEM",
    )
    tls_own_key: Optional[str] = opt(None, "the private key of --tls-own-cert (PEM)", metavar="PEM")
    key_on_command_line: bool = opt(
        False,
        "start even where no C compiler can build the helper that keeps the control key off tritonserver's "
        "command line: every user of this machine can then read the key in /proc (docs/serving.md)",
    )

    def __post_init__(self) -> None:
        for name in ("grpc_port", "http_port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"--{name.replace('_', '-')} must be a port number")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together (the server's certificate and its private key)")
        if (self.tls_client_ca or self.tls_ca) and not self.tls_cert:
            raise ConfigError("--tls-client-ca and --tls-ca go with --tls-cert and --tls-key")
        if bool(self.tls_client_ca) != bool(self.tls_own_cert and self.tls_own_key):
            raise ConfigError(
                "mutual TLS needs --tls-client-ca with --tls-own-cert and --tls-own-key (a certificate "
                "that CA signed, for torchship's own calls to the server), and these need it"
            )
        check_files(
            {
                f"--{f.replace('_', '-')}": getattr(self, f)
                for f in ("tls_cert", "tls_key", "tls_client_ca", "tls_ca", "tls_own_cert", "tls_own_key")
            }
        )

    def tls_flags(self) -> list[str]:
        """tritonserver's options for gRPC over TLS (none without --tls-cert). Triton's HTTP endpoint has no TLS."""
        if not self.tls_cert:
            return []
        flags = [
            "--grpc-use-ssl=true",
            f"--grpc-server-cert={Path(self.tls_cert).resolve()}",
            f"--grpc-server-key={Path(self.tls_key).resolve()}",
        ]
        if self.tls_client_ca:
            flags += ["--grpc-use-ssl-mutual=true", f"--grpc-root-cert={Path(self.tls_client_ca).resolve()}"]
        return flags


@dataclass
class InferConfig:
    files: tuple[str, ...] = opt((), "image files, .npy or .npz arrays to send", cli=False)
    url: str = opt("127.0.0.1:8001", "Triton gRPC address HOST:PORT")
    model: Optional[str] = opt(None, "model name (default: every served model with --check, else the first)")
    version: str = opt("", "model version (default: the server's latest)")
    top_k: int = opt(3, "classes to print per input, for a classifier (Triton's classification extension)")
    check: Optional[str] = opt(
        None,
        "send the export's reference inputs to every served model (and its held-out "
        "files, as they are, to the image entry) and compare the answers with eager; "
        "exit 3 on a mismatch",
        metavar="EXPORT_DIR",
    )
    heldout: Optional[str] = opt(None, "send -n held-out samples of this export", metavar="EXPORT_DIR")
    n: int = opt(4, "with --heldout: how many samples", flag="-n")
    concurrency: int = opt(1, "requests in flight at once (async gRPC)")
    stream: bool = opt(False, "send the requests one at a time over one bidirectional gRPC stream (ModelStreamInfer)")
    json: bool = opt(False, "print results as JSON")
    raw: bool = opt(
        True,
        "send image files as they are to the image entry in front of the model where the server "
        "has one, and --text to the text entry (--no-raw: prepare them here and send the tensors)",
    )
    text: tuple[str, ...] = opt(
        (),
        "a text to send, one request each (repeatable): to the text entry in front of the "
        "model where the server has one, else tokenized here with --export's tokenizer",
        append=True,
    )
    export: Optional[str] = opt(
        None,
        "with --text: the export whose tokenizer makes the token tensors here, where the "
        "server has no text entry (or with --no-raw)",
        metavar="EXPORT_DIR",
    )

    def __post_init__(self) -> None:
        check_url(self.url)
        if self.top_k < 1 or self.n < 1 or self.concurrency < 1:
            raise ConfigError("--top-k, -n and --concurrency must be at least 1")
        if self.stream and self.concurrency > 1:
            raise ConfigError("--stream sends one request at a time; leave out --concurrency, or --stream")
        if self.text and (self.files or self.heldout or self.check):
            raise ConfigError("--text sends texts; give FILES, --heldout or --check in another call")
        if self.export and not self.text:
            raise ConfigError("--export goes with --text (its tokenizer makes the tensors)")
