"""The benchmark report: markdown tables, three plots, and which format wins where."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchship.io import atomic_write_text

from .config import cpu_list


def _f(v, spec=".2f", dash="-"):
    return format(v, spec) if isinstance(v, (int, float)) else dash


def wins(results: dict[str, Any]) -> list[str]:
    lines = []
    rows = results.get("in_process", {}).get("rows", [])
    for b in sorted({r["batch"] for r in rows}):
        at = [r for r in rows if r["batch"] == b and r.get("n")]
        if at:
            best = min(at, key=lambda r: r["p50_ms"])
            eager = next((r for r in at if r["variant"] == "eager"), None)
            vs = f" ({eager['p50_ms'] / best['p50_ms']:.1f}x faster than eager)" if eager and best is not eager else ""
            lines.append(f"- In-process, batch {b}: **{best['variant']}** has the lowest p50, {best['p50_ms']:.2f} ms{vs}.")
    served = results.get("served", {}).get("models", {})
    levels = sorted({r["concurrency"] for m in served.values() for r in m["rows"]})
    for c in levels:
        at = [(name, r) for name, m in served.items() for r in m["rows"] if r["concurrency"] == c and r.get("n")]
        if at:
            name, r = max(at, key=lambda x: x[1]["requests_per_s"])
            lines.append(f"- Served, concurrency {c}: **{name}** has the highest throughput, {r['requests_per_s']:.0f} req/s "
                         f"(p99 {r['p99_ms']:.2f} ms).")
    return lines


ONE_AT_A_TIME = {"stream": "; at 1 (and in the batch-1 overhead) they go one at a time over one bidirectional gRPC stream",
                 "unary": "; at 1 (and in the batch-1 overhead) each is one unary gRPC call"}


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table: the header row, its separator, then the rows."""
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header), *(f"| {' | '.join(row)} |" for row in rows)]


def settling_note(ov: dict[str, Any]) -> str:
    """What the percentiles leave out: each path's first calls in each block, and what those cost."""
    settle = ov["settling_per_block"]
    if not settle:  # blocks shorter than 5 calls leave nothing out
        return ""
    slow = "; ".join(f"{r['model']} {r['block_starts']['served']['p50_ms']:.3f} ms served, "
                     f"{r['block_starts']['in_process']['p50_ms']:.3f} ms in-process" for r in ov["rows"])
    return (f" Percentiles leave out the first {settle} calls of each path in each block ({ov['timed_per_path']} "
            f"timed per path), which run on caches the path before has just used (their p50: {slow}); the means "
            "below count every call.")


def overhead_lines(ov: dict[str, Any] | None, host: str | None = None) -> list[str]:
    """In-process, served and floor side by side at batch 1, and where the difference goes."""
    if not ov or not ov.get("rows"):
        return []
    def p50_p99(d):
        return f"{_f(d.get('p50_ms'), '.3f')} / {_f(d.get('p99_ms'), '.3f')}"

    lines = ["### Where the time goes at batch 1", "",
             f"Measured side by side: {ov['blocks']} rotating blocks, {ov['requests_per_path']} requests per path, one "
             f"request in flight, {ov['threads']} intra-op thread(s). Excess = served − in-process − floor (p50)."
             + settling_note(ov), ""]
    lines += _table(["model", "in-process p50 / p99 ms", "served p50 / p99 ms", "floor p50 / p99 ms", "excess ms"],
                    [[f"{r['model']} ({r['variant']})", p50_p99(r["in_process"]), p50_p99(r["served"]), p50_p99(r["floor"]),
                      _f(r.get("excess_p50_ms"), "+.3f")] for r in ov["rows"]])
    paused = [r for r in ov["rows"] if "in_process_paused" in r]
    if paused:
        lines += ["", "A served model never runs back to back: a round trip passes between two runs. The same artifact "
                  "in this process with a pause as long as the floor before each call (untimed) shows what that "
                  "alone costs on this machine; excess (paused) = served − paused in-process − floor.", ""]
        lines += _table(["model", "in-process p50 ms", "after a pause p50 ms", "pause ms", "excess ms", "excess (paused) ms"],
                        [[r["model"], _f(r["in_process"].get("p50_ms"), ".3f"), _f(r["in_process_paused"].get("p50_ms"), ".3f"),
                          f"{r['in_process_paused']['pause_ms']:.3f}", _f(r.get("excess_p50_ms"), "+.3f"),
                          _f(r.get("excess_vs_paused_p50_ms"), "+.3f")] for r in paused])
    where = {"server": "in the server process, where the backend reports the model's own run as compute infer and "
                       "the time before and after it as compute input and output",
             "stub": "in python-backend stubs, all inside compute infer (with the hand-over to the stub)"}.get(
        host, "where the embedded server hosts it")
    lines += ["", f"Backend host: {host or 'external server'}. Mean µs per request: Triton's statistics (queue, compute "
              f"input, compute infer, compute output), the backend's own profile (before the model, the model, after "
              f"it; {where}), and the rest (client, gRPC, network) = client mean − server total.", "",
              "| path | queue | input | infer | ↳ before model | ↳ model | ↳ after model | output | client + gRPC | in-process mean |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in ov["rows"]:
        sv, b = r["server"], r.get("backend") or {}
        lines.append(f"| {r['model']} | {_f(sv['queue_us'], '.0f')} | {_f(sv['compute_input_us'], '.0f')} | "
                     f"{_f(sv['compute_infer_us'], '.0f')} | {_f(b.get('pre_us'), '.0f')} | {_f(b.get('run_us'), '.0f')} | "
                     f"{_f(b.get('post_us'), '.0f')} | {_f(sv['compute_output_us'], '.0f')} | {_f(r['client_side_us'], '.0f')} | "
                     f"{_f(r['all_calls']['in_process_mean_ms'] * 1e3, '.0f')} |")
    if "floor_server" in ov:
        fs = ov["floor_server"]
        lines.append(f"| floor (no-op) | {_f(fs['queue_us'], '.0f')} | {_f(fs['compute_input_us'], '.0f')} | "
                     f"{_f(fs['compute_infer_us'], '.0f')} | | | | {_f(fs['compute_output_us'], '.0f')} | "
                     f"{_f(ov['floor_client_side_us'], '.0f')} | |")
    held = [r for r in ov["rows"] if "hold" in r]
    if held:
        reads = any(r["hold"].get("memory_bytes") for r in held)
        lines += ["", "The floor depends on how long the model takes: threads that waited longer wake slower, and caches "
                  "go cold. The hold model busy-waits each model's in-process p50"
                  + (", reading through a buffer as large as the model's artifact meanwhile (as the model streams its "
                     "weights)," if reads else "") + " and answers like the no-op, so served − hold is what the real "
                  "model costs beyond its in-process time and that longer floor.", ""]
        lines += _table(["model", "hold µs", "hold buffer MB", "hold read MB", "hold p50 ms", "floor at that duration ms",
                         "served − hold ms"],
                        [[r["model"], f"{r['hold']['hold_us']:.0f}", f"{r['hold'].get('memory_bytes', 0) / 1e6:.1f}",
                          f"{r['hold'].get('read_bytes_mean', 0) / 1e6:.1f}",
                          _f(r["hold"].get("p50_ms"), ".3f"), _f(r["floor_at_duration_p50_ms"], ".3f"),
                          _f(r["served_minus_hold_p50_ms"], "+.3f")] for r in held])
    aw = ov.get("after_wait_us")
    if aw and len(aw.get("spin", {})) > 1:
        waits = sorted(aw["spin"], key=float)
        lines += ["", "This machine after a pause: the same small piece of client work (serialize and parse one request) "
                  "timed right after the bench thread spun or slept that long (median µs). Whatever runs after a "
                  "model-length pause (the response path, the next request) pays this too.", ""]
        lines += _table(["after", *(f"{float(w) / 1e3:.2f} ms" for w in waits)],
                        [[mode, *(_f(aw[mode].get(w), ".1f") for w in waits)] for mode in ("spin", "sleep")])
    tr = ov.get("trace")
    if tr:
        lines += ["", f"Triton's trace ({tr['file']}): each round trip split at the server's timestamps, median µs "
                  "per leg: request (client send until the server has read it), to the model (parsing, queue, batcher), "
                  "backend (execute: the model and its wrapping; the hold's busy-wait included), after the model "
                  "(hand-over to gRPC), response (send until the client has parsed it)."]
        if "error" in tr:
            lines.append(f"- {tr['error']}")
        else:
            lines += [""] + _table(["path", "requests", "request", "to the model", "backend", "after the model", "response"],
                                   [[path, str(g["requests"]), *(_f(g[f"{leg}_us"], ".0f") for leg in
                                                                 ("request", "to_model", "backend", "after_model", "response"))]
                                    for path, g in tr["legs"].items()])
    lines += [f"- {k}: {v}" for k, v in ov.get("notes", {}).items()]
    return lines + [""]


def cpu_pinning(m: dict[str, Any]) -> str:
    """' · bench on CPUs …, server on CPUs …' when either ran on fewer than all of the machine's CPUs, where
    the server's model instances were pinned, and what kept idle CPUs awake (a wake-up latency request,
    spinners)."""
    every = list(range(m.get("cores") or 0))
    parts = [f"{who} on CPU{'s' if len(c) > 1 else ''} {cpu_list(c)}"
             for who, c in (("bench", m.get("bench_cpus")), ("server", m.get("server_cpus"))) if c and c != every]
    if m.get("server_model_cpus"):  # set only when pinned, even to every CPU
        c = m["server_model_cpus"]
        parts.append(f"models on CPU{'s' if len(c) > 1 else ''} {cpu_list(c)}")
    if m.get("cpu_latency_us") is not None:
        parts.append(f"idle CPUs held within {m['cpu_latency_us']} µs of waking")
    if m.get("spin_cpus"):
        c = m["spin_cpus"]
        parts.append(f"spinners on CPU{'s' if len(c) > 1 else ''} {cpu_list(c)}")
    return " · " + ", ".join(parts) if parts else ""


def write_report(results: dict[str, Any], out: Path, plots: bool = True) -> Path:
    m = results["machine"]
    lim = results.get("limits", {})
    lines = [f"# Benchmark: {results['export']['name']}", "",
             f"{results['created']} · CPU {m['cpu']} ({m['cores']} cores) · GPU {m.get('gpu') or 'none'} · "
             f"torch {m['versions'].get('torch')} · onnxruntime {m['versions'].get('onnxruntime')} · "
             f"git {m.get('git_revision') or '?'}" + cpu_pinning(m), ""]
    w = wins(results)
    if w:
        lines += ["## Which format wins where", "", *w, ""]
    if "flops_per_sample" in lim:
        lines += ["## Limits", "",
                  f"- Model: {lim['flops_per_sample'] / 1e9:.3f} GFLOP per sample (counted with torch's FlopCounterMode).",
                  f"- Device peak measured by a matmul: {lim['fp32_flops'] / 1e9:.1f} GFLOP/s fp32, "
                  f"{lim['bf16_flops'] / 1e9:.1f} GFLOP/s bf16 ({results['config']['threads']} thread(s)).", ""]
    ip = results.get("in_process")
    if ip:
        lines += ["## In-process latency", "",
                  f"Device {ip['device']}, {ip['threads']} intra-op thread(s); real held-out images; variants interleaved in "
                  f"{results['config']['blocks']} blocks after {results['config']['warmup']} warm-up runs each.", "",
                  "| variant | batch | p50 ms | p90 ms | p95 ms | p99 ms | mean ms | std ms | images/s | % of fp32 matmul probe |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in ip["rows"]:
            frac = ""
            if "flops_per_sample" in lim and r.get("n"):
                frac = f"{100 * r['images_per_s'] * lim['flops_per_sample'] / lim['fp32_flops']:.1f}"
            lines.append(f"| {r['variant']} | {r['batch']} | {_f(r.get('p50_ms'))} | {_f(r.get('p90_ms'))} | {_f(r.get('p95_ms'))} | "
                         f"{_f(r.get('p99_ms'))} | {_f(r.get('mean_ms'))} | {_f(r.get('std_ms'))} | {_f(r.get('images_per_s'), '.0f')} | {frac} |")
        for k, v in ip.get("notes", {}).items():
            lines.append(f"\n- {k}: {v}")
        lines.append("")
    served = results.get("served")
    if served:
        floor = (served.get("noop", {}).get("rows") or [{}])[0]
        lines += ["## Served through gRPC", "", f"Server {served['url']} ({'embedded' if served['embedded'] else 'external'}). "
                  "Closed loop: each level keeps that many batch-1 requests in flight"
                  f"{ONE_AT_A_TIME.get(results.get('config', {}).get('transport'), '')}. Server columns are Triton's own "
                  "statistics per request (µs); client-side = client mean latency minus the server's share "
                  "(network, serialization, gRPC).", ""]
        if floor.get("n"):
            lines += [f"No-op round trip (the protocol floor, same tensors), on its own before the overhead blocks: "
                      f"p50 {floor['p50_ms']:.3f} ms, p99 {floor['p99_ms']:.3f} ms"
                      + (" (the floor in the excess below is the one timed beside the models)." if served.get("overhead") else "."),
                      ""]
        lines += overhead_lines(served.get("overhead"), results.get("machine", {}).get("python_host"))
        for section, title in (("models", "dynamic batching as configured"), ("batching_off", "dynamic batching off")):
            for model, mm in served.get(section, {}).items():
                lines += [f"### {model} — {title}", "",
                          "| concurrency | ok/sent | p50 ms | p90 ms | p99 ms | req/s | avg batch | queue µs | input µs | infer µs | output µs | client-side µs |",
                          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
                for r in mm["rows"]:
                    s = r["server"]
                    lines.append(f"| {r['concurrency']} | {r['ok']}/{r['sent']} | {_f(r.get('p50_ms'))} | {_f(r.get('p90_ms'))} | "
                                 f"{_f(r.get('p99_ms'))} | {_f(r['requests_per_s'], '.0f')} | {_f(s['avg_batch'])} | "
                                 f"{_f(s['queue_us'], '.0f')} | {_f(s['compute_input_us'], '.0f')} | {_f(s['compute_infer_us'], '.0f')} | "
                                 f"{_f(s['compute_output_us'], '.0f')} | {_f(r.get('client_side_us'), '.0f')} |")
                lines.append("")
        for model, on in served.get("models", {}).items():
            off = served.get("batching_off", {}).get(model)
            if off:
                lines += [f"Dynamic batching gain for {model} (throughput on / off):", ""]
                for a, b in zip(on["rows"], off["rows"]):
                    if b["requests_per_s"]:
                        # where no batch formed, batching cannot explain the difference (drift, the batcher hop)
                        alone = " (no batches formed: the difference is not batching)" if a["server"]["avg_batch"] <= 1 else ""
                        gain = a["requests_per_s"] / b["requests_per_s"]
                        lines.append(f"- concurrency {a['concurrency']}: {gain:.2f}x{alone}")
                lines.append("")
        if "reconfigured" in served:
            lines += [f"Batching off and queue delays: {served['reconfigured']['skipped']}.", ""]
        ol = served.get("open_loop")
        if ol:
            lines += ["### Open loop (Poisson arrivals)", "", "| model | target req/s | achieved | p50 ms | p99 ms | errors |", "|---|---|---|---|---|---|"]
            lines += [f"| {k} | {v['rate_target']:g} | {v['achieved_rps']:.0f} | {_f(v.get('p50_ms'))} | {_f(v.get('p99_ms'))} | {v['errors']} |"
                      for k, v in ol.items()]
            lines.append("")
        pa = served.get("perf_analyzer", {})
        if "skipped" in pa:
            lines += [f"perf_analyzer cross-check: {pa['skipped']}.", ""]
        for model, res in pa.items():
            if model == "skipped":
                continue
            lines += [f"### perf_analyzer cross-check: {model} (dynamic batching {'on' if res.get('dynamic_batching') else 'off'})", ""]
            if "error" in res:
                lines += [f"perf_analyzer failed: {res['error']}", ""]
                continue
            ours = {r["concurrency"]: r for r in served["models"].get(model, {}).get("rows", [])}
            lines += ["| concurrency | perf_analyzer req/s | torchship req/s | perf_analyzer p50 ms | torchship p50 ms | perf_analyzer p99 ms | torchship p99 ms |",
                      "|---|---|---|---|---|---|---|"]
            for r in res["levels"]:
                o = ours.get(r["concurrency"], {})
                lines.append(f"| {r['concurrency']} | {r['requests_per_s']:.0f} | {_f(o.get('requests_per_s'), '.0f')} | {r['p50_ms']:.2f} | "
                             f"{_f(o.get('p50_ms'))} | {r['p99_ms']:.2f} | {_f(o.get('p99_ms'))} |")
            lines.append("")
    rec = results.get("recommendation", {})
    if rec:
        lines += ["## Recommendation", ""]
        if "error" in rec:
            lines.append(f"None: {rec['error']}")
        else:
            lines += [f"- model `{rec['model']}`: max_batch_size {rec['max_batch_size']}, dynamic batching "
                      f"{'on' if rec['dynamic_batching'] else 'off'}, max_queue_delay_microseconds {rec['max_queue_delay_microseconds']}, "
                      f"instance count {rec['instance_count']}",
                      f"- measured: {rec['requests_per_s']:.0f} req/s at p99 {rec['p99_ms']:.2f} ms (concurrency {rec['at_concurrency']})",
                      f"- why: {rec['why']}"]
            if rec.get("written"):
                lines.append(f"- written to: {', '.join(rec['written'])}")
        lines.append("")
    if results.get("errors"):
        lines += ["## Errors", "", *[f"- {e}" for e in results["errors"]], ""]
    if results.get("server_stop_note"):
        lines += ["## Server shutdown", "", f"The embedded server was killed at the end: {results['server_stop_note']}", ""]
    if plots:
        pngs = draw_plots(results, out)
        if pngs:
            lines += ["## Plots", "", *[f"![{p.stem}]({p.name})" for p in pngs], ""]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines))
    return path


def draw_plots(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    made = []
    rows = results.get("in_process", {}).get("rows", [])
    raw = results.get("in_process", {}).get("raw_ms", {})
    if rows:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        b0 = min(r["batch"] for r in rows)
        for r in rows:
            if r["batch"] != b0 or not r.get("n"):
                continue
            key = f"{r['variant']}/b{b0}"
            if key in raw:
                xs = np.sort(raw[key])
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=r["variant"])
        made.append(_save(plt, fig, ax, out / "latency_cdf.png", f"latency at batch {b0} (ms)", "fraction of runs",
                          "In-process latency CDF per format"))
    served = results.get("served", {})
    series = [(f"{m} (batching {'on' if s == 'models' else 'off'})", mm["rows"])
              for s in ("models", "batching_off") for m, mm in served.get(s, {}).items()]
    if series:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, rs in series:
            ax.plot([r["concurrency"] for r in rs], [r["requests_per_s"] for r in rs], marker="o", label=label)
        ax.set_xscale("log", base=2)
        made.append(_save(plt, fig, ax, out / "throughput_vs_concurrency.png", "concurrency (requests in flight)",
                          "throughput (requests/s)", "Served throughput against concurrency"))
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, rs in series:
            rs = [r for r in rs if r.get("n")]
            ax.plot([r["requests_per_s"] for r in rs], [r["p99_ms"] for r in rs], marker="o", label=label)
        made.append(_save(plt, fig, ax, out / "p99_vs_throughput.png", "throughput (requests/s)", "p99 latency (ms)",
                          "p99 latency against throughput"))
    return made


def _save(plt, fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
