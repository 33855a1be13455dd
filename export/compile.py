"""AOTInductor compiles in worker processes: each takes one core for tens of seconds, so they run beside each
other and beside the other formats' exports. Each compile gets a fresh process (inductor's choice about
oneDNN prepacking, once made in a process, holds for every later compile in it; see exporters.FREEZE),
which rebuilds the model from the export's own inputs (the checkpoint, or the factory and weights file),
as the parent did. On a CPU the workers are forked from a fork server that imported what a compile imports
(PRELOAD) and compiled nothing, so each starts fresh without paying the import again. The fork server outlives
its export by IDLE_S, for the next export of this process (one started under other variables, in another
folder or with another sys.path, is replaced); each job runs under the environment of the export that asked."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from torchship.device import usable_cpus
from torchship.errors import first_line


def available_memory() -> int:
    """Bytes of memory available to new work (Linux's MemAvailable: free plus reclaimable cache); 0 if unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0


PREPACK_LIMIT = 2 << 30  # bytes of per-bucket prepacked copies that --bucket-weights auto accepts


def bucket_weights(choice: str, device: str, model_bytes: int, buckets) -> tuple[str, str]:
    """(shared or prepacked, why): what --bucket-weights means for this model on ``device``."""
    if choice != "auto":
        return choice, "as asked"
    if device != "cpu":
        return "shared", "prepacking is for oneDNN's CPU kernels"
    copies = model_bytes * len(buckets)
    if copies > PREPACK_LIMIT:
        return "shared", f"a prepacked copy per bucket would take {copies / 2**30:.1f} GiB"
    return "prepacked", (
        f"one copy per bucket, {len(buckets)} x {model_bytes / 1e6:.0f} MB: on a CPU the unpacked "
        "shared weights run batches above 1 several times slower"
    )


def workers_for(model_bytes: int) -> int:
    """How many compiles may run at once: one per usable core, at most 2, fewer where a worker's copy of a
    large model and the compile's own copies (about 5 model sizes in all) would not fit in the memory
    available."""
    available = available_memory()
    by_memory = available // max(1, 5 * model_bytes) if available else 1
    return max(1, min(2, usable_cpus(), by_memory))


def _job(cfg, device: str, kind: str, batch: int, out: str, env: dict[str, str]) -> dict[str, Any]:
    """In a worker: compile ``kind`` ("aoti": the dynamic-batch package at ``out``; "aoti_int8": the same,
    quantized; "aoti_bf16": the same, computing in bfloat16; "bucket": the static ``batch`` model, its weights
    saved to ``out``), under ``env``. Returns {"seconds", ...} or {"error", "traceback"}."""
    t0 = time.perf_counter()
    os.environ.clear()  # the export's, which may have changed since the fork server started
    os.environ.update(env)
    stack = contextlib.ExitStack()
    try:
        import torch

        from torchship.runtime import fp32_precision

        from . import exporters
        from .source import artifact_model, load_source

        src = load_source(cfg, log=lambda *a: None)
        model, sig = artifact_model(src, cfg.dtype, device), src.signature
        # Inductor bakes the TF32 choice into the kernels it generates: compile under the one verification applies
        stack.enter_context(fp32_precision(device, cfg.tf32))
        if kind == "aoti":
            extra = exporters.aoti(model, exporters.example(sig, 2, device), Path(out), sig, cfg.max_batch, cfg.threads)
            return {"seconds": time.perf_counter() - t0, "extra": {**extra, **tf32_field(cfg, device)}}
        if kind == "aoti_bf16":  # the float32 model computing in bfloat16 behind float32 inputs and outputs
            bf16 = artifact_model(src, "bfloat16", device)
            extra = exporters.aoti(bf16, exporters.example(sig, 2, device), Path(out), sig, cfg.max_batch, cfg.threads)
            return {"seconds": time.perf_counter() - t0, "extra": extra}
        if kind == "aoti_int8":
            from . import quantize

            calibration, source = quantize.calibration_samples(
                cfg.calibration, src.samples, [t.name for t in sig.inputs]
            )
            extra = quantize.aoti_int8(
                model,
                exporters.example(sig, 2, device),
                Path(out),
                sig,
                cfg.max_batch,
                cfg.threads,
                calibration,
                source,
                quantize.int8_scheme(),
            )
            return {"seconds": time.perf_counter() - t0, "extra": extra}
        shared = cfg.bucket_weights == "shared"
        files = exporters.compile_bucket(model, sig, batch, cfg.threads, device, shared)
        weights = [f for f in files if not isinstance(f, str)]
        if shared:
            torch.save({k: t for w in weights for k, (t, _) in w.items()}, out)
        return {
            "seconds": time.perf_counter() - t0,
            "files": [f for f in files if isinstance(f, str)],
            "weights": out if shared else None,
        }
    except Exception as e:  # reported as this format's failure; the exception itself may not pickle
        return {"error": first_line(e), "traceback": traceback.format_exc()[-4000:]}
    finally:
        stack.close()


def tf32_field(cfg, device: str) -> dict[str, Any]:
    """The manifest field of an AOTInductor package compiled with TF32 allowed (--tf32 on CUDA): it is verified
    and served with TF32 on, against the TF32 bound."""
    return {"tf32": True} if cfg.tf32 and device.startswith("cuda") and cfg.dtype == "float32" else {}


# the fork server the CPU workers are forked from imports this module (export/preload.py) and compiles nothing
PRELOAD = ("torchship.export.preload",)


def start_method(device: str) -> str:
    """forkserver for a CPU compile where the platform has it; spawn elsewhere: a CUDA compile's worker must not
    be forked from a process whose imports may have touched the driver."""
    return "forkserver" if device == "cpu" and "forkserver" in mp.get_all_start_methods() else "spawn"


class Compiler:
    """A pool of compile workers for one export, used as a context manager: on an error or Ctrl-C the workers
    are ended at once, not awaited. ``submit`` returns a Future of _job's result. The pool starts in a thread of
    its own on the first submit, so that the export goes on while the fork server imports; it ends with the
    export, and the fork server IDLE_S later (at once on an error)."""

    def __init__(self, cfg, device: str, workers: int, work: Path):
        self.cfg, self.device, self.work, self.workers = cfg, device, work, workers
        self.method = start_method(device)
        self.pool = None
        self.jobs: list[Future] = []
        self._queue: list[tuple[tuple, Future]] = []
        self._lock = threading.Lock()
        self._starter: threading.Thread | None = None
        self._failed: str | None = None  # why the pool could not start: every job, later ones too, reports it
        self._holds_server = False

    def submit(self, kind: str, batch: int = 0, out: Path | None = None) -> Future:
        out = out or self.work / f"bs{batch}.weights.pt"
        job: Future = Future()
        self.jobs.append(job)
        args = (self.cfg, self.device, kind, batch, str(out), dict(os.environ))
        with self._lock:
            if self._failed is not None:
                job.set_result({"error": self._failed})
                return job
            if self.pool is None:
                self._queue.append((args, job))
                if self._starter is None:
                    self.work.mkdir(parents=True, exist_ok=True)
                    self._starter = threading.Thread(target=self._start, name="compile-pool", daemon=True)
                    self._starter.start()
                return job
        self._apply(args, job)
        return job

    def _start(self) -> None:
        try:
            ctx = mp.get_context(self.method)
            if self.method == "forkserver":
                ctx.set_forkserver_preload(list(PRELOAD))
                _take_fork_server()
                self._holds_server = True
            pool = ctx.Pool(processes=self.workers, maxtasksperchild=1)
        except Exception as e:  # every job waiting on the pool reports it as its format's failure
            with self._lock:
                self._failed = f"the compile workers could not start: {first_line(e)}"
                queued, self._queue = self._queue, []
            for _, job in queued:
                job.set_result({"error": self._failed})
            return
        with self._lock:
            self.pool, queued, self._queue = pool, self._queue, []
        for args, job in queued:
            self._apply(args, job)

    def _apply(self, args: tuple, job: Future) -> None:
        self.pool.apply_async(_job, args, callback=job.set_result, error_callback=job.set_exception)

    def busy(self) -> int:
        """How many cores the compiles hold now: one per job still running, at most one per worker."""
        return min(self.workers, sum(not j.done() for j in self.jobs))

    def __enter__(self) -> "Compiler":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._starter is not None:
            self._starter.join()
        if self.pool is not None:
            if exc_type is None:
                self.pool.close()
            else:
                self.pool.terminate()
            self.pool.join()
        if self._holds_server:
            _give_fork_server(now=exc_type is not None)
        shutil.rmtree(self.work, ignore_errors=True)


IDLE_S = 120.0  # a fork server this long without an export's compiles ends; the next export starts another
_server: dict[str, Any] = {"key": None, "exports": 0, "timer": None}  # the fork server's key, its holders, its end
_server_lock = threading.Lock()


def _server_key() -> tuple:
    """What the fork server's workers keep from the moment it started, which a job cannot set for itself: the
    variables read while importing (fresh.IMPORT_ENV), the working folder and sys.path."""
    from .fresh import import_env

    return import_env(os.environ), os.getcwd(), tuple(sys.path)


def _take_fork_server() -> None:
    """One more export holds the fork server: the one running, where it started as this process is now, else a
    new one (stopped here; the pool's start starts the next)."""
    with _server_lock:
        if _server["timer"] is not None:
            _server["timer"].cancel()
            _server["timer"] = None
        key = _server_key()
        if _server["exports"] == 0 and _server["key"] != key:
            _stop_fork_server()
            _server["key"] = key
        _server["exports"] += 1


def _give_fork_server(now: bool) -> None:
    """An export is done with the fork server: the last one ends it ``now``, or IDLE_S later unless another
    export takes it first."""
    with _server_lock:
        _server["exports"] -= 1
        if _server["exports"] == 0:
            if now:
                _stop_fork_server()
                _server["key"] = None
            else:
                _server["timer"] = threading.Timer(IDLE_S, stop_fork_server)
                _server["timer"].daemon = True
                _server["timer"].start()


@atexit.register
def stop_fork_server() -> None:
    """End this process's fork server (it holds torch and inductor in memory, about 0.9 GB resident) unless an
    export is using it: when the process's exports are done (``torchship run``, before it serves), IDLE_S after
    the last one, and at exit."""
    with _server_lock:
        if _server["exports"]:
            return
        if _server["timer"] is not None:
            _server["timer"].cancel()
            _server["timer"] = None
        _stop_fork_server()
        _server["key"] = None


def _stop_fork_server() -> None:
    """End multiprocessing's fork server of this process, if one runs, and reap it. It is sent SIGTERM first: it
    holds nothing to save, and ending by itself it would tear down torch and inductor (about 1.5 s of CPU)."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is None:
        return
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None:  # not reaped before stop() reaps it, so the pid is still its own
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(FileNotFoundError):  # its socket's folder, where multiprocessing's exit removed it first
        stop()


def bucket_files(result: dict[str, Any]) -> list:
    """A bucket job's files as compile_bucket returned them (paths, and for shared weights one Weights),
    read back in the parent."""
    import torch
    from torch.export.pt2_archive._package_weights import TensorProperties, Weights

    if result["weights"] is None:
        return list(result["files"])
    tensors = torch.load(result["weights"], weights_only=True)
    return [*result["files"], Weights({k: (t, TensorProperties(t)) for k, t in tensors.items()})]
