"""The benchmark: in-process latency per format, served latency/throughput through gRPC, and the limits
(FLOPs, device peak, the no-op round trip) to read them against. Results are JSON plus a report."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from torchship.errors import BenchError, ClientError, TorchshipError
from torchship.io import atomic_write_json, cpu_name, git_revision, read_json
from torchship.manifest import artifact, read_manifest, read_reference

from .bench_config import BenchConfig

NOOP_MODEL = "_torchship_noop"
HOLD_MODEL = "_torchship_hold"
RESULTS_FORMAT = "torchship.bench/1"  # the "format" tag of results.json
# The first calls of each path in each block of the side-by-side overhead run on caches the path before
# it has just used (the same model's weights in this process, the hold's buffer). Left out of its
# percentiles, at most this many per block (a fifth of a short block); the means keep every call, as
# Triton's statistics do.
SETTLING_CALLS = 5


# ---------------------------------------------------------------- statistics and machine
def summarize(lat_s: list[float] | np.ndarray) -> dict[str, float]:
    """Latency percentiles, mean and standard deviation in milliseconds."""
    a = np.asarray(lat_s, dtype=np.float64) * 1e3
    if a.size == 0:
        return {"n": 0}
    p = np.percentile(a, [50, 90, 95, 99])
    return {"n": int(a.size), "p50_ms": p[0], "p90_ms": p[1], "p95_ms": p[2], "p99_ms": p[3],
            "mean_ms": float(a.mean()), "std_ms": float(a.std()), "min_ms": float(a.min()), "max_ms": float(a.max())}


def settling_calls(per_block: int) -> int:
    """How many calls at the start of each block the overhead percentiles leave out."""
    return min(SETTLING_CALLS, per_block // 5)


def split_block_starts(values: Sequence[Any], per_block: int, settle: int) -> tuple[list[Any], list[Any]]:
    """A path's calls in time order, ``per_block`` per block: (the first ``settle`` of each block, the rest)."""
    first = [v for j, v in enumerate(values) if j % per_block < settle]
    return first, [v for j, v in enumerate(values) if j % per_block >= settle]


def machine_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform(),
                            "python": sys.version.split()[0], "git_revision": git_revision(), "versions": {},
                            "bench_cpus": sorted(os.sched_getaffinity(0))}  # the client's and in-process runs' CPUs
    for mod in ("torch", "torchvision", "onnx", "onnxruntime", "tritonclient", "numpy", "grpc"):
        try:
            info["versions"][mod] = __import__(mod).__version__
        except Exception:
            pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
            info["nvidia_smi"] = out
        except (OSError, subprocess.TimeoutExpired):
            pass
    else:
        info["gpu"] = None
    return info


def flops_per_sample(model, shape: list[int]) -> float:
    """FLOPs of one forward pass per sample, counted by torch's FlopCounterMode (2 per multiply-add)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.rand(2, *shape)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(x)
    return fc.get_total_flops() / 2


def device_peak(device: str, threads: int, seconds: float = 1.0) -> dict[str, float]:
    """Measured matmul throughput (FLOP/s) in fp32 and bf16: the roofline to read results against."""
    import torch

    torch.set_num_threads(threads)
    out = {}
    n = 8192 if device.startswith("cuda") else 1024
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.rand(n, n, device=device, dtype=dtype)
        b = torch.rand(n, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        sync()
        best = 0.0
        for _ in range(5):  # best of five windows: the peak, not the average under noise
            t0, k = time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds / 5:
                a @ b
                k += 1
            sync()
            best = max(best, 2 * n ** 3 * k / (time.perf_counter() - t0))
        out[f"{name}_flops"] = best
    return out


def reference_pool(export_dir: Path, manifest: dict) -> np.ndarray:
    """The export's held-out real images (else its largest random batch), read and checked once per stage."""
    ref = read_reference(export_dir, manifest)
    return ref["input/heldout"] if "input/heldout" in ref else ref[f"input/random_b{manifest['max_batch']}"]


def real_inputs(pool: np.ndarray, batch: int) -> np.ndarray:
    """A batch drawn from ``pool`` (tiled if it holds fewer rows)."""
    reps = -(-batch // len(pool))
    return np.ascontiguousarray(np.concatenate([pool] * reps)[:batch])


# ---------------------------------------------------------------- in-process
def load_variants(cfg: BenchConfig, export_dir: Path, manifest: dict, device: str) -> tuple[dict[str, Callable], dict]:
    from torchship import runtime

    runners: dict[str, Callable] = {}
    notes: dict[str, str] = {}
    ins, outs = [i["name"] for i in manifest["inputs"]], [o["name"] for o in manifest["outputs"]]
    for v in cfg.variants:
        try:
            if v == "eager":
                from export.pipeline import load_deployable

                model, _, _ = load_deployable(manifest["source_checkpoint"]["path"])
                fn = runtime.torch_fn(model.to(device), device)
                runners[v] = lambda x, fn=fn: fn(x)
                continue
            a = artifact(manifest, v)
            r = runtime.load_artifact(str(export_dir), a, ins, outs, device=device, threads=cfg.threads)
            runners[v] = lambda x, r=r, n=ins[0]: r.run({n: x})
            if v == "onnx":
                providers = r.session.get_providers()
                notes[v] = f"ONNX Runtime providers: {', '.join(providers)}"
        except TorchshipError as e:
            notes[v] = f"skipped: {e}"
        except Exception as e:
            notes[v] = f"skipped: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return runners, notes


def time_blocks(paths: dict[str, Callable[[int], Any]], blocks: int, per_block: int, bar,
                rotate: bool = False, stamps: dict[str, list[tuple[int, int]]] | None = None,
                pauses: dict[str, float] | None = None,
                before_block: Callable[[int, dict[str, list[float]]], None] | None = None) -> dict[str, list[float]]:
    """Seconds per call of each path, run in turn in ``blocks`` blocks of ``per_block`` calls (the call
    gets its index), so machine drift falls on every path alike; ``rotate`` changes who goes first.
    With ``stamps``, each call's start and end on CLOCK_MONOTONIC (ns, Triton's trace clock) are kept too;
    ``pauses`` (seconds per path) sleeps before each of that path's calls, untimed; ``before_block`` is
    called with the block's index and the times so far before each block."""
    names = list(paths)
    lat: dict[str, list[float]] = {k: [] for k in names}
    for b in range(blocks):
        if before_block:
            before_block(b, lat)
        order = names[b % len(names):] + names[:b % len(names)] if rotate else names
        for name in order:
            fn, pause = paths[name], (pauses or {}).get(name, 0.0)
            for i in range(per_block):
                if pause:
                    time.sleep(pause)
                t0 = time.monotonic_ns()
                fn(i)
                t1 = time.monotonic_ns()
                lat[name].append((t1 - t0) / 1e9)
                if stamps is not None:
                    stamps.setdefault(name, []).append((t0, t1))
            if bar:
                bar.update(per_block)
    return lat


def bench_in_process(cfg: BenchConfig, export_dir: Path, manifest: dict, device: str, bar) -> dict[str, Any]:
    """Latency per variant and batch size. Variants run in interleaved blocks so machine noise
    falls on all of them alike."""
    import torch

    torch.set_num_threads(cfg.threads)
    runners, notes = load_variants(cfg, export_dir, manifest, device)
    rows = []
    raw: dict[str, list[float]] = {}
    per_block = max(1, cfg.iters // cfg.blocks)
    pool = reference_pool(export_dir, manifest)
    for b in cfg.batch_sizes:
        if b > manifest["max_batch"]:
            notes[f"batch {b}"] = f"skipped: above the export's max batch {manifest['max_batch']}"
            continue
        x = real_inputs(pool, b)
        for v, fn in runners.items():
            for _ in range(cfg.warmup):
                fn(x)
        lat = time_blocks({v: (lambda i, fn=fn: fn(x)) for v, fn in runners.items()}, cfg.blocks, per_block, bar)
        for v, ls in lat.items():
            raw[f"{v}/b{b}"] = [round(t * 1e3, 4) for t in ls]
            s = summarize(ls)
            rows.append({"variant": v, "batch": b, **s, "images_per_s": b / (s["mean_ms"] / 1e3)})
    return {"device": device, "threads": cfg.threads, "rows": rows, "notes": notes, "raw_ms": raw}


# ---------------------------------------------------------------- served
def stats_of(client, model: str) -> dict[str, Any]:
    s = client.statistics(model)["model_stats"]
    s = [m for m in s if m.get("name") == model] or s
    return s[0] if s else {}


def _served_count(stats: dict) -> int:
    return int(stats.get("inference_stats", {}).get("success", {}).get("count", 0) or 0)


def settled_stats(client, model: str, count: int, timeout_s: float = 2.0) -> dict[str, Any]:
    """Statistics once ``count`` successful requests are on the books. Triton records a request when
    it releases it, which can be just after the client has its response; a snapshot taken at once
    would leave the last requests out of one window and put them into the next."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = stats_of(client, model)
        if _served_count(s) >= count or time.monotonic() > deadline:  # failed requests never count
            return s
        time.sleep(0.005)


def stats_delta(before: dict, after: dict) -> dict[str, float]:
    """Triton's server-side time per request (µs) between two statistics snapshots."""
    def get(d, *path):
        for p in path:
            d = d.get(p, {}) if isinstance(d, dict) else {}
        return float(d) if not isinstance(d, dict) else 0.0

    out: dict[str, float] = {}
    ok = get(after, "inference_stats", "success", "count") - get(before, "inference_stats", "success", "count")
    for part in ("queue", "compute_input", "compute_infer", "compute_output"):
        ns = get(after, "inference_stats", part, "ns") - get(before, "inference_stats", part, "ns")
        out[f"{part}_us"] = ns / 1e3 / ok if ok else 0.0
    inf = get(after, "inference_count") - get(before, "inference_count")
    exe = get(after, "execution_count") - get(before, "execution_count")
    out["requests"] = ok
    out["executions"] = exe
    out["avg_batch"] = inf / exe if exe else 0.0
    out["server_us"] = sum(out[f"{p}_us"] for p in ("queue", "compute_input", "compute_infer", "compute_output"))
    return out


def one_at_a_time(channel, unary, transport: str):
    """The callable that sends one request and waits for its response: ``unary`` (a blocking call each),
    or an InferStream on ``channel``. Close it (when it has close()) before the channel."""
    from .client import InferStream

    return InferStream(channel) if transport == "stream" else unary


@contextlib.contextmanager
def sending(url: str, transport: str):
    """one_at_a_time() on a channel of its own to ``url``; the stream, if any, and the channel are closed on exit."""
    from .client import infer_channel

    channel, unary = infer_channel(url)
    send = one_at_a_time(channel, unary, transport)
    try:
        yield send
    finally:
        if send is not unary:
            send.close()
        channel.close()


def closed_loop(url: str, model: str, inputs: list[np.ndarray], concurrency: int, n: int, input_name: str,
                transport: str = "unary") -> dict[str, Any]:
    """Keep ``concurrency`` requests in flight until ``n`` complete; per-request latency in seconds.
    Requests are built before timing and sent on tritonclient's generated gRPC stub; at concurrency 1
    one at a time in this thread (over one stream, or as blocking unary calls: ``transport``), so no
    callback thread is in the measured path."""
    import grpc

    from .client import infer_channel, request

    prepared = [request(model, x, input_name) for x in inputs]
    lat: list[float] = []
    errors: list[str] = []
    if concurrency == 1:
        with sending(url, transport) as send:
            t_start = time.perf_counter()
            for i in range(n):
                t0 = time.perf_counter()
                try:
                    send(prepared[i % len(prepared)], timeout=60)
                    lat.append(time.perf_counter() - t0)
                except grpc.RpcError as e:
                    errors.append(e.details() or str(e.code()))
                    if transport == "stream":  # the stream itself failed: the rest cannot be sent on it
                        break
                except ClientError as e:  # refused on the stream, which stays open
                    errors.append(str(e))
        return {"latencies_s": lat, "errors": errors, "wall_s": time.perf_counter() - t_start, "completed": n}
    channel, call = infer_channel(url)
    t_start = time.perf_counter()
    lock = threading.Lock()
    done = threading.Event()
    issued = [0]
    finished = [0]

    def issue():
        with lock:
            if issued[0] >= n:
                return
            i = issued[0]
            issued[0] += 1
        t0 = time.perf_counter()
        call.future(prepared[i % len(prepared)], timeout=60).add_done_callback(lambda f, t0=t0: complete(f, t0))

    def complete(fut, t0):
        dt = time.perf_counter() - t0
        err = fut.exception()
        with lock:
            if err is not None:
                errors.append(err.details() if hasattr(err, "details") else str(err))
            else:
                lat.append(dt)
            finished[0] += 1
            last = finished[0] >= n
        if last:
            done.set()
        else:
            issue()

    for _ in range(min(concurrency, n)):
        issue()
    done.wait(timeout=max(60.0, n * 2.0))
    wall = time.perf_counter() - t_start
    channel.close()
    return {"latencies_s": lat, "errors": errors, "wall_s": wall, "completed": finished[0]}


def open_loop(url: str, model: str, inputs: list[np.ndarray], rate: float, duration: float, input_name: str) -> dict:
    """Poisson arrivals at ``rate`` requests/s for ``duration`` seconds (latency includes queueing)."""
    from .client import infer_channel, request

    channel, call = infer_channel(url)
    prepared = [request(model, x, input_name) for x in inputs]
    rng = np.random.default_rng(0)
    lat, errors, pending = [], [], threading.Semaphore(0)
    sent = 0
    t_start = time.perf_counter()
    next_t = t_start
    while next_t - t_start < duration:
        now = time.perf_counter()
        if now < next_t:
            time.sleep(next_t - now)
        t0 = time.perf_counter()

        def cb(fut, t0=t0):
            (errors.append(str(fut.exception())) if fut.exception() else lat.append(time.perf_counter() - t0))
            pending.release()
        call.future(prepared[sent % len(prepared)], timeout=60).add_done_callback(cb)
        sent += 1
        next_t += rng.exponential(1.0 / rate)
    for _ in range(sent):
        pending.acquire(timeout=60)
    wall = time.perf_counter() - t_start
    channel.close()
    return {"rate_target": rate, "sent": sent, "achieved_rps": len(lat) / wall, **summarize(lat), "errors": len(errors)}


def level_row(res: dict, delta: dict, concurrency: int, batch: int) -> dict[str, Any]:
    s = summarize(res["latencies_s"])
    row = {"concurrency": concurrency, "sent": res["completed"], "ok": len(res["latencies_s"]), "failed": len(res["errors"]),
           **s, "requests_per_s": len(res["latencies_s"]) / res["wall_s"] if res["wall_s"] else 0.0,
           "images_per_s": batch * len(res["latencies_s"]) / res["wall_s"] if res["wall_s"] else 0.0, "server": delta}
    if s.get("n"):
        row["client_side_us"] = s["mean_ms"] * 1e3 - delta.get("server_us", 0.0)
    if res["errors"]:
        row["first_error"] = res["errors"][0][:300]
    return row


def sweep(url: str, model: str, inputs: list[np.ndarray], cfg: BenchConfig, input_name: str, bar, client) -> list[dict]:
    rows = []
    for c in cfg.concurrency:
        # warm the connection and the model at this level, untimed
        start = _served_count(stats_of(client, model))
        warm = min(cfg.requests, max(4, c * 2))
        closed_loop(url, model, inputs, c, warm, input_name, cfg.transport)
        before = settled_stats(client, model, start + warm)
        res = closed_loop(url, model, inputs, c, cfg.requests, input_name, cfg.transport)
        after = settled_stats(client, model, _served_count(before) + cfg.requests)
        rows.append(level_row(res, stats_delta(before, after), c, inputs[0].shape[0]))
        if bar:
            bar.update(cfg.requests)
    return rows


def noop_repo(out: Path, manifest: dict) -> Path:
    """A repository of two floor models with the export's tensors that answer zeros, served by torchship's
    'torchship' backend through the same host (in-server or stub) as the real models: the no-op (the
    protocol floor) and the hold, which first busy-waits as many microseconds as the first input value
    says, reading through a buffer of as many bytes as the second value says meanwhile (the floor for a
    model that takes that long and streams that much memory, without the model)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    root = out / "noop_repo"
    inp, outp = manifest["inputs"][0], manifest["outputs"][0]
    for name, hold in ((NOOP_MODEL, "false"), (HOLD_MODEL, "true")):
        mdir = root / name
        if mdir.exists():
            shutil.rmtree(mdir)
        (mdir / "1").mkdir(parents=True)
        c = mc.ModelConfig(name=name, backend="torchship", max_batch_size=manifest["max_batch"])
        c.input.add(name=inp["name"], data_type=mc.TYPE_FP32, dims=[int(d) for d in inp["shape"][1:]])
        c.output.add(name=outp["name"], data_type=mc.TYPE_FP32, dims=[int(d) for d in outp["shape"][1:]])
        c.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
        c.parameters["hold"].string_value = hold
        (mdir / "config.pbtxt").write_text(text_format.MessageToString(c))
    return root


def served_variant(client, model: str, manifest: dict) -> str | None:
    """The exported artifact a served model runs (its in-process twin), or None if it is not one of ours."""
    fmt = _format_of(model, manifest) if model.startswith(manifest["name"] + "_") else None
    if fmt == "aoti":
        return "aoti_buckets" if "buckets" in client.config(model).get("parameters", {}) else "aoti"
    return fmt if fmt in ("onnx", "torchscript") else None


def read_profile(profile_dir: str | None, model: str) -> dict[str, float]:
    """A model's backend profile: the cumulative totals of every instance that served it (one file each)."""
    total: dict[str, float] = {}
    for f in sorted(Path(profile_dir).glob(f"{model}--*.json")) if profile_dir else ():
        try:
            for k, v in json.loads(f.read_text()).items():
                total[k] = total.get(k, 0) + v
        except (OSError, ValueError):
            continue
    return total


def settled_profile(profile_dir: str | None, model: str, timeout: float = 2.0) -> dict[str, float]:
    """read_profile once it has stopped changing: the backends write every 0.2 s, so a read taken right
    after a request can still miss the last ones (and then a delta mixes in earlier requests)."""
    last = read_profile(profile_dir, model)
    deadline = time.monotonic() + timeout
    while profile_dir and time.monotonic() < deadline:
        time.sleep(0.25)
        now = read_profile(profile_dir, model)
        if now == last:
            break
        last = now
    return last


def profile_delta(before: dict, after: dict) -> dict[str, float]:
    """Per-request time inside the backend's execute() (µs): before the model, the model, after it."""
    n = after.get("requests", 0) - before.get("requests", 0)
    if n <= 0:
        return {}
    return {f"{k}_us": (after[f"{k}_ns"] - before.get(f"{k}_ns", 0)) / 1e3 / n for k in ("pre", "run", "post")}


# A round trip as Triton's trace splits it: (leg, from, to); c_send/c_recv are the client's own stamps.
TRACE_LEGS = (("request", "c_send", "GRPC_WAITREAD_END"),       # client, gRPC, loopback, until the server has read it
              ("to_model", "GRPC_WAITREAD_END", "COMPUTE_START"),  # request parsing, queue, batcher, instance wake-up
              ("backend", "COMPUTE_START", "COMPUTE_END"),        # the backend's execute (the model and its wrapping)
              ("after_model", "COMPUTE_END", "GRPC_SEND_START"),  # response hand-over to the gRPC frontend
              ("response", "GRPC_SEND_START", "c_recv"))          # serialize, send, client wake-up and parse


def read_trace(path: str | Path) -> dict[str, list[dict[str, int]]]:
    """Triton's trace file (level TIMESTAMPS) as {model: [{event: ns}, ...]}, sorted by REQUEST_START."""
    text = Path(path).read_text().strip()
    if text and not text.endswith("]"):  # written when tracing was switched off; the server closes it on exit
        text += "]"
    by_id: dict[int, dict[str, Any]] = {}
    for e in json.loads(text or "[]"):
        d = by_id.setdefault(e["id"], {})
        if "model_name" in e:
            d["model"] = e["model_name"]
        for t in e.get("timestamps", ()):
            d[t["name"]] = t["ns"]
    out: dict[str, list[dict[str, int]]] = {}
    for d in by_id.values():
        if "model" in d and "REQUEST_START" in d:
            out.setdefault(d.pop("model"), []).append(d)
    for v in out.values():
        v.sort(key=lambda d: d["REQUEST_START"])
    return out


def trace_legs(trace: dict[str, list[dict[str, int]]], stamps: dict[str, list[tuple[int, int]]],
               model_of: dict[str, str]) -> dict[str, dict[str, float]]:
    """Median µs of each TRACE_LEGS leg per path: each client call (one in flight) is matched with the
    trace of its model that started inside it; calls without a complete trace are left out."""
    import bisect

    legs: dict[str, dict[str, float]] = {}
    for path, model in model_of.items():
        traces = trace.get(model, [])
        starts = [t["REQUEST_START"] for t in traces]
        rows = []
        for t0, t1 in stamps.get(path, ()):
            k = bisect.bisect_left(starts, t0)
            if k == len(starts) or starts[k] > t1:
                continue
            ev = {**traces[k], "c_send": t0, "c_recv": t1}
            if all(a in ev and b in ev for _, a, b in TRACE_LEGS):
                rows.append([(ev[b] - ev[a]) / 1e3 for _, a, b in TRACE_LEGS])
        if rows:
            med = np.median(np.array(rows), axis=0)
            legs[path] = {"requests": len(rows), **{f"{name}_us": float(m) for (name, _, _), m in zip(TRACE_LEGS, med)}}
    return legs


def set_trace(client, on: bool) -> None:
    """Switch Triton's timestamp tracing on or off; switching it off writes what was traced to the file."""
    client._call("trace settings", client.client.update_trace_settings,
                 settings={"trace_level": ["TIMESTAMPS" if on else "OFF"]})


def after_wait(req, waits_us: Sequence[float], reps: int = 100) -> dict[str, dict[str, float]]:
    """The same small piece of client work (serialize and parse one request) timed right after this
    thread spun or slept for each wait, interleaved: how much slower code runs after a model-length
    pause on this machine. Median µs per mode and wait."""
    from tritonclient.grpc import service_pb2

    times: dict[tuple[str, float], list[float]] = {(m, w): [] for m in ("spin", "sleep") for w in waits_us}
    for _ in range(reps):
        for (mode, w), t in times.items():
            if mode == "spin":
                end = time.perf_counter() + w * 1e-6
                while time.perf_counter() < end:
                    pass
            elif w:
                time.sleep(w * 1e-6)
            t0 = time.perf_counter()
            service_pb2.ModelInferRequest.FromString(req.SerializeToString())
            t.append(time.perf_counter() - t0)
    out: dict[str, dict[str, float]] = {"spin": {}, "sleep": {}}
    for (mode, w), t in times.items():
        out[mode][str(int(w))] = float(np.median(t)) * 1e6
    return out


def bench_overhead(cfg: BenchConfig, export_dir: Path, manifest: dict, xs: list[np.ndarray], url: str, models: list[str],
                   client, profile_dir: str | None, bar, trace_file: str | None = None) -> dict[str, Any]:
    """Batch 1, measured side by side in rotating blocks: each served model through gRPC, the same
    artifact in this process (back to back, and again after a floor-long pause before each call, as a
    served model runs), and the no-op floor. The excess is served − in-process − floor; Triton's
    statistics and the backend's own profile say where it goes, and with ``trace_file`` (the embedded
    server's trace file) Triton's per-request timestamps split each round trip into TRACE_LEGS. Percentiles
    and the trace leave out each block's settling calls (SETTLING_CALLS); means keep them. ``xs``: the
    batch-1 inputs, sent in turn."""
    from torchship import runtime

    from .client import request

    ins, outs = [i["name"] for i in manifest["inputs"]], [o["name"] for o in manifest["outputs"]]
    with sending(url, cfg.transport) as call:  # closed once the timed blocks are done, or on an error before
        paths: dict[str, Callable[[int], Any]] = {}
        twins: dict[str, str] = {}
        holds: dict[str, list[float]] = {}  # µs the hold model waits, set per block
        hold_bytes: dict[str, int] = {}  # the buffer it reads meanwhile: as large as the artifact's (first) file
        hold_resps: dict[str, list[Any]] = {}  # its responses, which say how many bytes it read
        hold_reqs: dict[str, Any] = {}

        def hold_request(model: str, us: float) -> Any:
            hx = xs[0].copy()
            hx.flat[0] = us
            if hx.size > 1:
                hx.flat[1] = hold_bytes[model]
            return request(HOLD_MODEL, hx, ins[0])
        notes: dict[str, str] = {}
        ready = client.ready_models()
        for model in models:
            v = served_variant(client, model, manifest)
            if v is None:
                notes[model] = "no in-process twin (not an artifact of this export)"
                continue
            art = artifact(manifest, v)
            r = runtime.load_artifact(str(export_dir), art, ins, outs, threads=cfg.threads)
            twins[model] = v
            paths[f"{model}/in-process"] = lambda i, r=r: r.run({ins[0]: xs[i % len(xs)]})
            reqs = [request(model, x, ins[0]) for x in xs]
            paths[f"{model}/served"] = lambda i, reqs=reqs: call(reqs[i % len(reqs)], timeout=60)
            if HOLD_MODEL in ready:  # the floor for a model that takes as long as this one in-process
                holds[model] = []
                hold_bytes[model] = (export_dir / art["file"]).stat().st_size if cfg.hold_memory else 0
                hold_reqs[model] = hold_request(model, 0.0)  # no wait while warming up; the buffer is made then
                hold_resps[model] = []
                paths[f"{model}/hold"] = lambda i, model=model: hold_resps[model].append(call(hold_reqs[model], timeout=60))
        have_noop = NOOP_MODEL in ready
        if have_noop:
            reqs = [request(NOOP_MODEL, x, ins[0]) for x in xs]
            paths["floor"] = lambda i, reqs=reqs: call(reqs[i % len(reqs)], timeout=60)
        else:
            notes["floor"] = f"the no-op model {NOOP_MODEL} is not served at {url}"
        per_block = max(1, cfg.requests // cfg.blocks)
        watched = list(twins) + ([NOOP_MODEL] if have_noop else [])
        start = {m: _served_count(stats_of(client, m)) for m in watched}
        warm = max(cfg.warmup, 5)
        warm_lat = time_blocks(paths, 1, warm, None)
        for v in hold_resps.values():
            v.clear()

        def set_holds(block: int, lat: dict[str, list[float]]) -> None:
            """Before each block: hold as long as the model's in-process median so far."""
            for model in holds:
                us = float(np.median(lat.get(f"{model}/in-process") or warm_lat[f"{model}/in-process"])) * 1e6
                hold_reqs[model] = hold_request(model, us)
                holds[model].append(us)
        pauses: dict[str, float] = {}
        if have_noop:  # the model in this process again, after a pause as long as a round trip with no model in it
            gap = float(np.median(warm_lat["floor"]))
            for model in twins:
                paths[f"{model}/in-process-paused"] = paths[f"{model}/in-process"]
                pauses[f"{model}/in-process-paused"] = gap
        before = {m: settled_stats(client, m, start[m] + warm) for m in watched}
        prof_before = {m: settled_profile(profile_dir, m) for m in twins}
        stamps: dict[str, list[tuple[int, int]]] | None = {} if trace_file else None
        if trace_file:
            set_trace(client, True)
        try:
            lat = time_blocks(paths, cfg.blocks, per_block, bar, rotate=True, stamps=stamps, pauses=pauses,
                              before_block=set_holds)
        finally:
            if trace_file:
                time.sleep(0.2)  # the last response's send-end stamp comes after the client has it
                with contextlib.suppress(TorchshipError):  # a failed run reports its own error
                    set_trace(client, False)
    after = {m: settled_stats(client, m, _served_count(before[m]) + per_block * cfg.blocks) for m in watched}
    # percentiles from each block's steady calls; means (beside Triton's statistics, which count every call) from all
    settle = settling_calls(per_block)
    starts, steady = {}, {}
    for name, v in lat.items():
        starts[name], steady[name] = split_block_starts(v, per_block, settle)
    if stamps:
        stamps = {name: split_block_starts(v, per_block, settle)[1] for name, v in stamps.items()}

    def mean_ms(name: str) -> float:
        return float(np.mean(lat[name])) * 1e3
    floor = summarize(steady["floor"]) if have_noop else {}
    rows = []
    for model, v in twins.items():
        inp, srv = summarize(steady[f"{model}/in-process"]), summarize(steady[f"{model}/served"])
        row = {"model": model, "variant": v, "in_process": inp, "served": srv, "floor": floor,
               "server": stats_delta(before[model], after[model]),
               "backend": profile_delta(prof_before[model], settled_profile(profile_dir, model)),
               "all_calls": {"in_process_mean_ms": mean_ms(f"{model}/in-process"),
                             "served_mean_ms": mean_ms(f"{model}/served")},
               "block_starts": {"in_process": summarize(starts[f"{model}/in-process"]),
                                "served": summarize(starts[f"{model}/served"])}}
        row["client_side_us"] = row["all_calls"]["served_mean_ms"] * 1e3 - row["server"]["server_us"]
        if floor:
            row["excess_p50_ms"] = srv["p50_ms"] - inp["p50_ms"] - floor["p50_ms"]
            paused = summarize(steady[f"{model}/in-process-paused"])
            row["in_process_paused"] = {"pause_ms": pauses[f"{model}/in-process-paused"] * 1e3, **paused}
            row["excess_vs_paused_p50_ms"] = srv["p50_ms"] - paused["p50_ms"] - floor["p50_ms"]
        if holds.get(model):
            h, held = summarize(steady[f"{model}/hold"]), float(np.mean(holds[model]))
            read = [float(np.frombuffer(r.raw_output_contents[0], np.float32)[0]) for r in hold_resps[model]
                    if r.raw_output_contents and r.raw_output_contents[0]]
            row["hold"] = {"hold_us": held, "hold_us_per_block": holds[model], "memory_bytes": hold_bytes[model],
                           "read_bytes_mean": float(np.mean(read)) if read else 0.0, **h}
            row["floor_at_duration_p50_ms"] = h["p50_ms"] - held / 1e3
            row["served_minus_hold_p50_ms"] = srv["p50_ms"] - h["p50_ms"]
        rows.append(row)
    waits = [0.0, *sorted(float(np.mean(v)) for v in holds.values() if v)]
    res = {"batch": 1, "requests_per_path": per_block * cfg.blocks, "blocks": cfg.blocks, "threads": cfg.threads,
           "settling_per_block": settle, "timed_per_path": (per_block - settle) * cfg.blocks,
           "rows": rows, "notes": notes, "after_wait_us": after_wait(request(NOOP_MODEL, xs[0], ins[0]), waits)}
    if trace_file:
        model_of = {p: (HOLD_MODEL if p.endswith("/hold") else NOOP_MODEL if p == "floor" else p.split("/")[0])
                    for p in paths if "/in-process" not in p}
        try:
            res["trace"] = {"file": str(trace_file), "legs": trace_legs(read_trace(trace_file), stamps or {}, model_of)}
        except (OSError, ValueError, KeyError) as e:
            res["trace"] = {"file": str(trace_file), "error": f"cannot read Triton's trace: {e}"}
    if have_noop:
        res["floor_server"] = stats_delta(before[NOOP_MODEL], after[NOOP_MODEL])
        res["floor_client_side_us"] = mean_ms("floor") * 1e3 - res["floor_server"]["server_us"]
    return res


def served_models(client, manifest: dict, cfg: BenchConfig) -> list[str]:
    ready = client.require_models(cfg.models)
    if cfg.models:
        return list(cfg.models)
    mine = [m for m in ready if m.startswith(manifest["name"] + "_")]
    if not mine:
        raise ClientError(f"no model of {manifest['name']!r} is served at {client.url} (served: {', '.join(ready) or 'none'})")
    return mine


def _format_of(model: str, manifest: dict) -> str:
    return model[len(manifest["name"]) + 1:]


def check_models(cfg: BenchConfig, manifest: dict, server=None) -> None:
    """Refuse --models naming a model that will not be served, before anything is measured or written:
    the models of the given server, else of the server at --url, else of the repository the bench
    serves itself (--repo, or the one it builds from the export)."""
    if server is not None:
        where, known = f"the server at {server.url}", list(server.loaded)
    elif cfg.url:
        from .client import TritonClient

        client = TritonClient(cfg.url)
        try:
            client.wait_ready(15)
            where, known = f"the server at {cfg.url}", client.ready_models()
        finally:
            client.close()
    elif cfg.repo:
        from .repository import repository_models

        repo = Path(cfg.repo)
        if not repo.is_dir():
            raise BenchError(f"--repo {repo}: no such directory (build one with torchship repo)")
        where, known = f"repository {repo}", repository_models(repo)
    else:
        from .repository import model_names

        where, known = f"the repository built from {cfg.export_dir}", sorted(model_names(manifest).values())
    missing = [m for m in cfg.models if m not in known]
    if missing:
        raise BenchError(f"--models {' '.join(missing)}: not in {where}; choose from {', '.join(known) or 'none'}")


def bench_served(cfg: BenchConfig, export_dir: Path, manifest: dict, url: str, server, bar, results: dict,
                 save: Callable[[], None]) -> None:
    from .client import TritonClient
    from .repository import read_config, served_config_path

    client = TritonClient(url)
    client.wait_ready(15)
    if server is not None and server.cfg.trace_file:  # traced only while the overhead is measured
        set_trace(client, False)
    models = served_models(client, manifest, cfg)
    embedded, ready = server is not None, client.ready_models()  # an embedded server loads both floor models itself
    if bar is not None:  # the start-up count assumed the export's three formats
        floors = (embedded or NOOP_MODEL in ready, embedded or HOLD_MODEL in ready)
        bar.total = bar.n + served_runs(cfg, manifest, models, embedded, floors)
        bar.refresh()
    input_name = manifest["inputs"][0]["name"]
    served: dict[str, Any] = {"url": url, "embedded": embedded, "models": {}, "batching_off": {}, "delays": {}}
    results["served"] = served
    # batch-1 requests fit batching and batch-1 models alike
    singles = [x[None] for x in real_inputs(reference_pool(export_dir, manifest), 64)]
    for model in models:
        cfgm = client.config(model)
        served["models"][model] = {"max_batch_size": client.max_batch(model), "dynamic_batching": "dynamic_batching" in cfgm,
                                   "max_queue_delay_us": int(cfgm.get("dynamic_batching", {}).get("max_queue_delay_microseconds", 0) or 0),
                                   "rows": sweep(url, model, singles, cfg, input_name, bar, client)}
        save()
    if server is not None:
        for model in models:
            fmt = _format_of(model, manifest)
            base_path = served_config_path(server.repo / model)
            if fmt in cfg.batching_compare:
                off = read_config(base_path)
                off.ClearField("dynamic_batching")
                server.load(model, override=off)
                served["batching_off"][model] = {"rows": sweep(url, model, singles, cfg, input_name, bar, client)}
            for delay in cfg.queue_delays_us:
                c = read_config(base_path)
                c.dynamic_batching.max_queue_delay_microseconds = delay
                server.load(model, override=c)
                served["delays"].setdefault(model, {})[str(delay)] = {"rows": sweep(url, model, singles, cfg, input_name, bar, client)}
            if fmt in cfg.batching_compare or cfg.queue_delays_us:
                # back to the repository's config; a plain reload keeps the last override
                server.load(model, override=read_config(base_path))
            save()
        # the floor: a no-op model with the same tensors, on the same backend host as the models
        try:
            server.load(NOOP_MODEL)
            if cfg.overhead:
                server.load(HOLD_MODEL)
            served["noop"] = {"rows": sweep(url, NOOP_MODEL, singles, _one_level(cfg), input_name, bar, client)}
        except TorchshipError as e:
            served["noop"] = {"error": str(e)}
    else:
        if cfg.batching_compare or cfg.queue_delays_us:
            served["reconfigured"] = {"skipped": "the sweeps with dynamic batching off and other queue delays reload "
                                                 f"models with changed configs, which only the embedded server allows; "
                                                 f"not done against {url}"}
        if NOOP_MODEL in ready:
            served["noop"] = {"rows": sweep(url, NOOP_MODEL, singles, _one_level(cfg), input_name, bar, client)}
    if cfg.overhead:
        profile_dir = server.cfg.backend_profile if server is not None else None
        trace_file = server.cfg.trace_file if server is not None else None
        served["overhead"] = bench_overhead(cfg, export_dir, manifest, singles, url, models, client, profile_dir, bar, trace_file)
        save()
    if cfg.rate:
        served["open_loop"] = {m: open_loop(url, m, singles, cfg.rate, cfg.duration_s, input_name) for m in models}
    pa = find_perf_analyzer(cfg.perf_analyzer) if cfg.cross_check else None
    if not cfg.cross_check:
        served["perf_analyzer"] = {"skipped": "disabled (--no-cross-check)"}
    elif pa:
        first = sorted(models, key=lambda m: not m.endswith("_onnx"))[0]
        served["perf_analyzer"] = {first: run_perf_analyzer(pa, url, first, [1, max(cfg.concurrency)],
                                                            {**manifest, "_dir": str(export_dir)})}
    else:
        served["perf_analyzer"] = {"skipped": "perf_analyzer not found (python -m serve.perf_analyzer install fetches it)"}
    client.close()


def served_runs(cfg: BenchConfig, manifest: dict, models: list[str], embedded: bool, floors: tuple[bool, bool]) -> int:
    """How many timed calls bench_served makes for ``models``, with ``floors`` saying whether the no-op
    and the hold model are served (an embedded server serves both): the progress bar's total."""
    noop, hold = floors
    per_sweep = cfg.requests * len(cfg.concurrency)
    n = len(models) * per_sweep
    if embedded:  # the batching-off sweeps and the delays
        n += sum(_format_of(m, manifest) in cfg.batching_compare for m in models) * per_sweep
        n += len(models) * len(cfg.queue_delays_us) * per_sweep
    n += noop * cfg.requests  # the floor's own sweep
    if cfg.overhead:  # per model: in-process, served, after a pause (needs the floor), hold; and the floor
        n += (len(models) * (2 + noop + hold) + noop) * max(1, cfg.requests // cfg.blocks) * cfg.blocks
    return n


def _one_level(cfg: BenchConfig) -> BenchConfig:
    import dataclasses

    return dataclasses.replace(cfg, concurrency=(1,))


# ---------------------------------------------------------------- perf_analyzer
def find_perf_analyzer(explicit: str | None) -> str | None:
    from .perf_analyzer import locate

    return locate(explicit)


def run_perf_analyzer(binary: str, url: str, model: str, levels: list[int], manifest: dict) -> dict[str, Any]:
    from .client import TritonClient
    from .perf_analyzer import run

    try:
        batching = "dynamic_batching" in TritonClient(url).config(model)  # the config perf_analyzer meets
        return {"levels": run(binary, url, model, levels, manifest), "dynamic_batching": batching}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


# ---------------------------------------------------------------- recommendation
def recommend(results: dict, budget_ms: float | None, max_batch: int) -> dict[str, Any]:
    """The served configuration with the highest throughput whose p99 meets the budget."""
    cands = []
    served = results.get("served", {})
    for model, m in served.get("models", {}).items():
        for r in m["rows"]:
            cands.append((model, "on", m.get("max_queue_delay_us", 0), r))
    for model, m in served.get("batching_off", {}).items():
        for r in m["rows"]:
            cands.append((model, "off", 0, r))
    for model, d in served.get("delays", {}).items():
        for delay, m in d.items():
            for r in m["rows"]:
                cands.append((model, "on", int(delay), r))
    cands = [c for c in cands if c[3].get("n") and not c[3]["failed"]]
    if not cands:
        return {"error": "no served measurements to recommend from"}
    ok = [c for c in cands if budget_ms is None or c[3]["p99_ms"] <= budget_ms]
    if not ok:
        best = min(cands, key=lambda c: c[3]["p99_ms"])
        return {"error": f"no configuration meets p99 <= {budget_ms:g} ms; the lowest p99 measured was "
                         f"{best[3]['p99_ms']:.2f} ms ({best[0]}, concurrency {best[3]['concurrency']})",
                "budget_ms": budget_ms}
    model, batching, delay, r = max(ok, key=lambda c: c[3]["requests_per_s"])
    c = r["concurrency"]
    mbs = min(max_batch, 1 << max(0, (c - 1).bit_length())) if batching == "on" else max_batch
    if batching == "on":
        why_batch = (f"{c} requests in flight form batches of at most {c}, so max_batch_size {mbs}"
                     f"{' (the export caps it at ' + str(max_batch) + ')' if mbs < c else ''}")
    else:
        why_batch = "requests ran one by one faster than the dynamic batcher merged them at this load"
    return {"budget_ms": budget_ms, "model": model, "dynamic_batching": batching == "on",
            "max_batch_size": mbs, "max_queue_delay_microseconds": delay, "instance_count": 1,
            "at_concurrency": c, "p99_ms": r["p99_ms"], "requests_per_s": r["requests_per_s"],
            "why": (f"highest throughput with p99 {'<= ' + format(budget_ms, 'g') + ' ms' if budget_ms else '(no budget given)'}; "
                    f"{why_batch}; "
                    "one instance: instance counts were not swept (on a 2-core CPU a second instance only competes for cores)")}


def write_recommendation(repo: Path, rec: dict) -> list[str]:
    """Apply the recommended batching to the model's configs in the repository (atomic writes)."""
    from .repository import EMBEDDED_CONFIG, config_text, read_config
    from torchship.io import atomic_write_text

    written = []
    for name in ("config.pbtxt", EMBEDDED_CONFIG):
        p = repo / rec["model"] / name
        if not p.exists():
            continue
        c = read_config(p)
        if c.max_batch_size == 0:  # a batch-1 config stays batch-1
            continue
        c.max_batch_size = max(1, min(c.max_batch_size, rec["max_batch_size"] or c.max_batch_size))
        if rec["dynamic_batching"]:
            c.dynamic_batching.max_queue_delay_microseconds = rec["max_queue_delay_microseconds"]
        else:
            c.ClearField("dynamic_batching")
        atomic_write_text(p, config_text(c))
        written.append(str(p))
    return written


# ---------------------------------------------------------------- the whole run
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
    if cfg.models and not cfg.skip_served:
        check_models(cfg, manifest, server)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    device = manifest.get("device", "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError(f"{export_dir} was exported for CUDA; no GPU is visible here")
    results: dict[str, Any] = {"format": RESULTS_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "export": {"dir": str(export_dir.resolve()), "name": manifest["name"],
                                          "input_shape": manifest["inputs"][0]["shape"], "dtype": manifest.get("dtype")},
                               "config": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(cfg).items()},
                               "machine": machine_info(), "errors": []}

    def save() -> None:
        atomic_write_json(out / "results.json", results)

    # limits: FLOPs per sample and the measured device peak
    try:
        from export.pipeline import load_deployable

        model, _, _ = load_deployable(manifest["source_checkpoint"]["path"])
        results["limits"] = {"flops_per_sample": flops_per_sample(model, manifest["inputs"][0]["shape"][1:]),
                             **device_peak(device, cfg.threads)}
    except TorchshipError as e:
        results["limits"] = {"error": str(e)}
    save()
    n_in = 0 if cfg.skip_in_process else len(cfg.variants) * len([b for b in cfg.batch_sizes if b <= manifest["max_batch"]]) * \
        (cfg.iters // cfg.blocks) * cfg.blocks
    from .repository import model_names

    # until the server says which models it serves: --models, else the export's three formats
    expected = list(cfg.models) or list(model_names(manifest).values())
    embedded = server is not None or not cfg.url
    n_served = 0 if cfg.skip_served else served_runs(cfg, manifest, expected, embedded, floors=(True, True))
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=n_in + n_served, desc="bench", unit="run", dynamic_ncols=True, file=sys.stderr)
    failure: TorchshipError | None = None
    awake = None
    try:
        from .config import parse_cpus
        from .server import KeepAwake

        spin = parse_cpus(cfg.spin_cpus, "--spin-cpus") if cfg.spin_cpus else []
        # held for the whole run, so every path is measured alike; a CPU the given server spins already
        # (run's serve.spin_cpus) gets no second spinner
        awake = KeepAwake(cfg.cpu_latency_us, [c for c in spin if server is None or c not in server.spin_cpus])
        if cfg.cpu_latency_us is not None:
            results["machine"]["cpu_latency_us"] = cfg.cpu_latency_us
        if spin:
            results["machine"]["spin_cpus"] = spin
        if not cfg.skip_in_process:
            log("in-process: " + ", ".join(cfg.variants) + f" at batch {', '.join(map(str, cfg.batch_sizes))}")
            results["in_process"] = bench_in_process(cfg, export_dir, manifest, device, bar)
            save()
        if not cfg.skip_served:
            own = server is None and not cfg.url
            try:
                if own:
                    server = _start_embedded(cfg, export_dir, manifest, out)
                    if server.python_host_note:
                        log(server.python_host_note)
                if server is not None:
                    from .server import server_cpus

                    results["machine"]["python_host"] = server.python_host
                    results["machine"]["server_cpus"] = server_cpus(server)
                    results["machine"]["server_model_cpus"] = server.model_cpus
                    if server.spin_cpus:  # run's serve.spin_cpus: the server holds spinners of its own
                        spun = set(results["machine"].get("spin_cpus", [])) | set(server.spin_cpus)
                        results["machine"]["spin_cpus"] = sorted(spun)
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
        if awake is not None:
            awake.close()
    rec = recommend(results, cfg.p99_budget_ms, manifest["max_batch"]) if "served" in results else {"error": "no served results"}
    results["recommendation"] = rec
    if cfg.write_config and "error" not in rec:
        repo = Path(cfg.repo) if cfg.repo else out / "repo"
        rec["written"] = write_recommendation(repo, rec)
    save()
    write_report(results, out, plots=cfg.plots)
    log(f"results: {out / 'results.json'}   report: {out / 'report.md'}")
    if failure is not None:
        raise type(failure)(f"{failure} (partial results kept in {out / 'results.json'})")
    if "error" in rec and cfg.p99_budget_ms is not None:
        raise BenchError(f"{rec['error']} (results kept in {out / 'results.json'})")
    return results


def bench_server(serve_cfg, cfg: BenchConfig, manifest: dict, out: Path):
    """An embedded TritonServer (not started) set up as bench measures one: serve_cfg's repository with
    the floor models' beside it, the backends' profile written (under ``out`` unless serve_cfg names a
    directory), Triton's tracing when ``cfg.trace`` (into OUT/triton_trace.json unless serve_cfg
    names a file), cfg.server_cpus and cfg.server_model_cpus unless serve_cfg pins the server or its
    models itself, and cfg.python_host unless serve_cfg names a host other than auto. Give it, started,
    to run_bench's ``server``; ``torchship run`` does."""
    import dataclasses

    from .server import TritonServer

    trace = out / "triton_trace.json"
    trace.unlink(missing_ok=True)  # an earlier run's traces must not mix with this one's
    serve_cfg = dataclasses.replace(serve_cfg, backend_profile=serve_cfg.backend_profile or str(out / "backend_profile"),
                                    trace_file=serve_cfg.trace_file or (str(trace) if cfg.trace else None),
                                    cpus=serve_cfg.cpus or cfg.server_cpus,
                                    model_cpus=serve_cfg.model_cpus or cfg.server_model_cpus,
                                    python_host=cfg.python_host if serve_cfg.python_host == "auto" else serve_cfg.python_host)
    return TritonServer(serve_cfg, extra_repos=[noop_repo(out, manifest)])


def _start_embedded(cfg: BenchConfig, export_dir: Path, manifest: dict, out: Path):
    from .config import RepoConfig, ServeConfig
    from .repository import build_repository

    repo = Path(cfg.repo) if cfg.repo else out / "repo"
    if not cfg.repo:
        build_repository(export_dir, RepoConfig(out=str(repo), overwrite=True, threads=cfg.threads))
    serve_cfg = ServeConfig(repo=str(repo), log=str(out / "tritonserver.log"))
    server = bench_server(serve_cfg, cfg, manifest, out)
    server.start()
    return server


# ---------------------------------------------------------------- compare
def flatten(results: dict) -> dict[str, float]:
    """Comparable figures: latency keys end in _ms (lower is better), throughput in _per_s."""
    flat: dict[str, float] = {}
    for r in results.get("in_process", {}).get("rows", []):
        for k in ("p50_ms", "p99_ms", "images_per_s"):
            if k in r:
                flat[f"in_process/{r['variant']}/b{r['batch']}/{k}"] = r[k]
    served = results.get("served", {})
    for section in ("models", "batching_off"):
        for model, m in served.get(section, {}).items():
            for r in m.get("rows", []):
                for k in ("p50_ms", "p99_ms", "requests_per_s"):
                    if k in r:
                        flat[f"served/{section}/{model}/c{r['concurrency']}/{k}"] = r[k]
    return flat


def compare(old: dict, new: dict, threshold: float = 1.2) -> tuple[list[dict], list[dict]]:
    """Ratios new/old for every shared figure; a regression is latency x threshold or throughput / threshold."""
    a, b = flatten(old), flatten(new)
    rows, regressions = [], []
    for key in sorted(set(a) & set(b)):
        if not a[key]:
            continue
        ratio = b[key] / a[key]
        worse = ratio > threshold if key.endswith("_ms") else ratio < 1 / threshold
        row = {"key": key, "old": a[key], "new": b[key], "ratio": ratio, "regression": worse}
        rows.append(row)
        if worse:
            regressions.append(row)
    return rows, regressions


def comparable(old: dict, new: dict) -> list[str]:
    """BenchError if the two results measured different models (every ratio would read as a regression or
    a gain); otherwise notes on what else differs between them (the machine), for the reader."""
    a, b = ([r.get("export", {}).get(k) for k in ("name", "input_shape", "dtype")] for r in (old, new))
    if a != b:
        raise BenchError(f"--compare: the results are of different models ({' '.join(map(str, a))} against "
                         f"{' '.join(map(str, b))}); compare two runs of one export")
    notes = []
    for key in ("cpu", "gpu", "cores"):
        a, b = old.get("machine", {}).get(key), new.get("machine", {}).get(key)
        if a != b:
            notes.append(f"note: measured on different machines ({key}: {a} against {b})")
    return notes


def load_results(path: str | Path) -> dict:
    """A results.json that run_bench wrote; BenchError naming the file if it is not one."""
    return read_json(path, BenchError, RESULTS_FORMAT, missing=f"{path}: no such results file",
                     fix="; give the results.json that torchship bench wrote")

