"""The soak: one model held at one level of requests in flight for a long while, every response checked, and the
resident memory of the server and of each of the model's backend processes sampled as it goes; a process whose
memory grows faster than a stated bound per thousand requests fails it."""

from __future__ import annotations

import re
import threading
import time
from typing import Any, Callable

import numpy as np

from torchship.errors import BenchError, ConfigError

from .checks import ResponseCheck, keeper, tally
from .load import closed_loop
from .stats import served_count, stats_of, summarize

SOAK_WINDOW_S = 5.0  # the load is sent in windows this long; each window's responses are checked at its end
SAMPLE_S = 0.5  # how often resident memory is read
SETTLE = 0.25  # the first quarter of the requests is left out of the growth: arenas and caches fill there


def parse_duration(text: str) -> float:
    """ "90", "90s", "2m", "1h" as seconds; ConfigError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"--soak {text!r}: give a duration such as 120s, 2m or 1h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def growth_per_1000(requests: list[float], rss: list[float]) -> float:
    """Bytes a process grew per thousand requests: the least-squares slope of resident memory against requests
    served, over the samples after the first SETTLE of the requests (0 with too few samples)."""
    r, m = np.asarray(requests, float), np.asarray(rss, float)
    keep = r >= r[-1] * SETTLE if len(r) else r.astype(bool)
    r, m = r[keep], m[keep]
    if len(r) < 3 or np.ptp(r) == 0:
        return 0.0
    return float(np.polyfit(r, m, 1)[0] * 1000)


def soak(
    url: str,
    model: str,
    sent: list,
    client,
    check: ResponseCheck | None,
    concurrency: int,
    duration_s: float,
    processes: Callable[[], dict[str, int]],
    rss: Callable[[int], int],
    bound_bytes: float,
    log=print,
    tick: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Hold ``concurrency`` requests of ``sent`` (wire requests) in flight at ``model`` for ``duration_s``;
    ``processes()`` names the processes to watch ({label: pid}), read with ``rss(pid)`` every SAMPLE_S.
    Returns the figures: requests, failures, checked and wrong, and per process its samples, first and last
    resident bytes and growth per thousand requests against ``bound_bytes``."""
    samples: list[tuple[float, float, dict[str, int]]] = []
    stop = threading.Event()
    base = served_count(stats_of(client, model))

    def sample() -> None:
        while True:
            try:
                done = served_count(stats_of(client, model)) - base
            except Exception:  # the server went away: the load says so
                done = samples[-1][1] if samples else 0
            samples.append((time.perf_counter() - t0, done, {k: rss(p) for k, p in processes().items()}))
            if stop.wait(SAMPLE_S):
                return

    t0 = time.perf_counter()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    judged: dict[str, Any] = {}
    sent_n, failed, first_error, latencies = 0, 0, None, []
    try:
        while time.perf_counter() - t0 < duration_s:
            keep, kept = keeper()
            left = duration_s - (time.perf_counter() - t0)
            res = closed_loop(url, model, sent, concurrency, 1, min(SOAK_WINDOW_S, max(0.1, left)), keep)
            tally(check, kept, judged)
            sent_n += res["completed"]
            failed += len(res["errors"])
            first_error = first_error or (res["errors"][0][:300] if res["errors"] else None)
            latencies += res["latencies_s"]
            if tick:
                tick()
    finally:
        stop.set()
        sampler.join()
    wall = time.perf_counter() - t0
    names = sorted({k for _, _, by in samples for k in by})
    procs = {}
    for name in names:
        pts = [(done, by[name]) for _, done, by in samples if by.get(name)]
        if not pts:
            continue
        g = growth_per_1000([p[0] for p in pts], [p[1] for p in pts])
        procs[name] = {
            "first_bytes": pts[0][1],
            "last_bytes": pts[-1][1],
            "peak_bytes": max(p[1] for p in pts),
            "growth_bytes_per_1000": g,
            "within_bound": g <= bound_bytes,
            "samples": [[round(t, 2), int(d), by.get(name, 0)] for t, d, by in samples],
        }
    lat = summarize(latencies)
    out = {
        "model": model,
        "concurrency": concurrency,
        "duration_s": round(wall, 1),
        "sent": sent_n,
        "requests_per_s": sent_n / wall if wall else 0.0,
        "failed": failed,
        "bound_bytes_per_1000": bound_bytes,
        "settle": SETTLE,
        "processes": procs,
        **judged,
        **({k: lat[k] for k in ("p50_ms", "p99_ms")} if lat["n"] else {}),
    }
    if first_error:
        out["first_error"] = first_error
    return out


def soak_failure(res: dict[str, Any]) -> BenchError | None:
    """The soak's verdict: a BenchError naming each process past the bound, each failed and each wrong response,
    or None."""
    bound = res["bound_bytes_per_1000"] / 1024
    past = [
        f"{name} grew {p['growth_bytes_per_1000'] / 1024:.1f} KiB per 1000 requests (bound {bound:g} KiB; "
        f"{p['first_bytes'] / 2**20:.0f} -> {p['last_bytes'] / 2**20:.0f} MiB)"
        for name, p in res["processes"].items()
        if not p["within_bound"]
    ]
    if res.get("wrong"):
        past.append(f"{res['wrong']} of {res['checked']} checked responses wrong (first: {res.get('first_wrong')})")
    if res["failed"]:
        past.append(f"{res['failed']} failed requests (first: {res.get('first_error')})")
    if not past:
        return None
    return BenchError(
        f"soak of {res['model']} at {res['concurrency']} in flight for {res['duration_s']:g} s "
        f"({res['sent']} requests): " + "; ".join(past)
    )


def soak_lines(res: dict[str, Any]) -> list[str]:
    """The soak's section of the report."""
    from torchship.markdown import table

    rows = [
        [
            name,
            f"{p['first_bytes'] / 2**20:.1f}",
            f"{p['last_bytes'] / 2**20:.1f}",
            f"{p['peak_bytes'] / 2**20:.1f}",
            f"{p['growth_bytes_per_1000'] / 1024:+.1f}",
            "yes" if p["within_bound"] else "**NO**",
        ]
        for name, p in res["processes"].items()
    ]
    checked = res.get("checked")
    head = (
        f"`{res['model']}` ({res.get('instances', '?')} instance(s) x {res.get('threads', '?')} thread(s)) held at "
        f"{res['concurrency']} requests in flight for {res['duration_s']:g} s: {res['sent']} "
        f"requests ({res['requests_per_s']:.0f}/s, p50 {res.get('p50_ms', 0):.2f} ms, p99 {res.get('p99_ms', 0):.2f} "
        "ms), "
        f"{res['failed']} failed, "
        + (f"{checked} checked, {res.get('wrong', 0)} wrong" if checked is not None else "responses not checked")
        + ". Resident memory sampled every "
        f"{SAMPLE_S:g} s; growth is the least-squares slope of memory against requests served, leaving out the first "
        f"{100 * SETTLE:.0f} % of the requests (where arenas and caches fill); the bound is "
        f"{res['bound_bytes_per_1000'] / 1024:g} KiB per 1000 requests."
    )
    if not rows:
        return ["## Soak", "", head, "", f"Memory: {res.get('memory_note', 'not sampled')}.", ""]
    return (
        ["## Soak", "", head, ""]
        + table(["process", "first MiB", "last MiB", "peak MiB", "KiB per 1000 requests", "within the bound"], rows)
        + [""]
    )


def bench_soak(
    cfg, inputs, plan, url: str, server, bar, results: dict[str, Any], save: Callable[[], None], log=print
) -> None:
    """Fill results["soak"]: each model of the plan soaked in turn at the highest --concurrency for --soak. The
    memory of an embedded ``server`` and of each model's backend processes is sampled; a server at --url that
    is not this bench's is not (its processes are not known here)."""
    from torchship.procfs import resident_bytes

    from ..client import TritonClient
    from ..embedded.process import stub_processes
    from .checks import check_of
    from .placement import placement_of

    client = TritonClient(url)
    client.wait_ready(15)
    client.require_models(plan.models)
    level, duration = max(cfg.concurrency), parse_duration(cfg.soak)
    log(
        f"soak: {', '.join(plan.models)} at {level} in flight, {duration:g} s "
        + (f"each, {len(plan.models) * duration:g} s in all" if len(plan.models) > 1 else "in all")
    )
    out: dict[str, Any] = {}
    results["soak"] = out
    try:
        for model in plan.models:
            check = check_of(client, model, inputs)
            sent = [client.to_wire(model, f) for f in inputs.singles]
            closed_loop(url, model, sent, level, 4 * level)  # untimed: every batch size the level forms, once

            def processes(model=model) -> dict[str, int]:
                if server is None or not server.running:
                    return {}
                stubs = sorted(
                    p for (m, _), pids in stub_processes(server.proc.pid).items() if m == model for p in pids
                )
                return {
                    f"tritonserver (pid {server.proc.pid})": server.proc.pid,
                    **{f"{model} backend (pid {p})": p for p in stubs},
                }

            log(f"soak: {model} at {level} in flight for {duration:g} s")
            res = soak(
                url,
                model,
                sent,
                client,
                check,
                level,
                duration,
                processes,
                resident_bytes,
                1024 * cfg.soak_bound_kib,
                log,
                tick=(lambda: bar.update(1)) if bar else None,
            )
            if server is None:
                res["memory_note"] = (
                    f"not sampled: the server at {url} is not this bench's own, so its processes are "
                    "not known here (soak an embedded server: leave out --url)"
                )
            res["instances"], res["threads"] = placement_of(client.config(model))
            out[model] = res
            save()
    finally:
        client.close()


def soak_windows(cfg, models: list[str]) -> int:
    """The soak's windows, for the progress bar."""
    return len(models) * max(1, int(-(-parse_duration(cfg.soak) // SOAK_WINDOW_S)))
