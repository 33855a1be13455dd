"""Load generation over gRPC: a closed loop (N requests in flight) and an open loop (Poisson arrivals)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from ..client import infer_channel, request_feeds
from .stats import summarize


def closed_loop(
    url: str, model: str, inputs: list[dict[str, np.ndarray]], concurrency: int, n: int, min_s: float = 0.0, keep=None
) -> dict[str, Any]:
    """Keep ``concurrency`` requests in flight until ``n`` complete and ``min_s`` seconds have passed;
    per-request latency in seconds, and the CPU seconds this process spent (the client's own cost).
    Requests are built before timing and sent on tritonclient's generated gRPC stub; at concurrency 1 one
    at a time in this thread, so no callback thread is in the measured path. ``keep(i, response)`` is
    handed each answer to ``inputs[i]``, to be checked once the window is over."""
    prepared = [request_feeds(model, feeds) for feeds in inputs]
    lat: list[float] = []
    errors: list[str] = []
    channel, call = infer_channel(url)
    cpu0, t_start = time.process_time(), time.perf_counter()

    def more(sent: int) -> bool:
        return sent < n or time.perf_counter() - t_start < min_s

    if concurrency == 1:
        completed = _one_at_a_time(call, prepared, more, lat, errors, keep)
    else:
        completed = _in_flight(call, prepared, more, lat, errors, keep, concurrency, max(60.0, n * 2.0, min_s + 60.0))
    wall = time.perf_counter() - t_start
    channel.close()
    return {
        "latencies_s": lat,
        "errors": errors,
        "wall_s": wall,
        "completed": completed,
        "cpu_s": time.process_time() - cpu0,
    }


def _one_at_a_time(call, prepared: list, more, lat: list[float], errors: list[str], keep) -> int:
    """closed_loop at concurrency 1: each request sent from this thread once the last has answered."""
    import grpc

    sent = 0
    while more(sent):
        t0 = time.perf_counter()
        try:
            response = call(prepared[sent % len(prepared)], timeout=60)
            lat.append(time.perf_counter() - t0)
            if keep is not None:
                keep(sent % len(prepared), response)
        except grpc.RpcError as e:
            errors.append(e.details() or str(e.code()))
        sent += 1
    return sent


def _in_flight(
    call, prepared: list, more, lat: list[float], errors: list[str], keep, concurrency: int, timeout_s: float
) -> int:
    """closed_loop above concurrency 1: ``concurrency`` futures in flight, each answer sending the next."""
    lock = threading.Lock()
    done = threading.Event()
    issued, finished = [0], [0]

    def issue():
        with lock:
            if not more(issued[0]):
                if finished[0] == issued[0]:
                    done.set()
                return
            i = issued[0]
            issued[0] += 1
        t0 = time.perf_counter()
        call.future(prepared[i % len(prepared)], timeout=60).add_done_callback(lambda f, t0=t0, i=i: complete(f, t0, i))

    def complete(fut, t0, i):
        dt = time.perf_counter() - t0
        err = fut.exception()
        with lock:
            if err is not None:
                errors.append(err.details() if hasattr(err, "details") else str(err))
            else:
                lat.append(dt)
                if keep is not None:
                    keep(i % len(prepared), fut.result())
            finished[0] += 1
        issue()

    for _ in range(concurrency):
        issue()
    done.wait(timeout=timeout_s)
    return finished[0]


def paced(url: str, model: str, inputs: list[dict[str, np.ndarray]], n: int, span_s: float, keep) -> dict[str, Any]:
    """``n`` requests one at a time, spread evenly over ``span_s`` seconds, each answer handed to ``keep(i,
    response)``: the few known requests that check another load generator's window without adding a second
    stream of load to it (a closed loop beside perf_analyzer at concurrency 1 doubled what was in flight)."""
    import grpc

    prepared = [request_feeds(model, feeds) for feeds in inputs]
    channel, call = infer_channel(url)
    errors: list[str] = []
    t_start = time.perf_counter()
    for i in range(n):
        wait = t_start + i * span_s / n - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        try:
            keep(i % len(prepared), call(prepared[i % len(prepared)], timeout=60))
        except grpc.RpcError as e:
            errors.append(e.details() or str(e.code()))
    channel.close()
    return {"sent": n, "errors": errors}


def open_loop(url: str, model: str, inputs: list[dict[str, np.ndarray]], rate: float, duration: float) -> dict:
    """Poisson arrivals at ``rate`` requests/s for ``duration`` seconds (latency includes queueing)."""
    channel, call = infer_channel(url)
    prepared = [request_feeds(model, feeds) for feeds in inputs]
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
    """One concurrency level of a sweep: the client's percentiles and throughput beside Triton's breakdown."""
    s = summarize(res["latencies_s"])
    row = {
        "concurrency": concurrency,
        "sent": res["completed"],
        "ok": len(res["latencies_s"]),
        "failed": len(res["errors"]),
        **s,
        "requests_per_s": len(res["latencies_s"]) / res["wall_s"] if res["wall_s"] else 0.0,
        "images_per_s": batch * len(res["latencies_s"]) / res["wall_s"] if res["wall_s"] else 0.0,
        "server": delta,
    }
    if s.get("n"):
        row["client_side_us"] = s["mean_ms"] * 1e3 - delta.get("server_us", 0.0)
    if res["errors"]:
        row["first_error"] = res["errors"][0][:300]
    return row
