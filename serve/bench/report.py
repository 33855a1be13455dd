"""The benchmark report: served latency and throughput first, then the recommendation, in-process beside
served, Triton's own breakdown, and the plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchship.io import atomic_write_text
from torchship.markdown import cell as _f
from torchship.markdown import table

from .beside import GENERATORS, cross_check_lines, side_by_side
from .checks import checked_text
from .entry import entry_lines
from .plots import draw_plots


def moved(r: dict[str, Any], stability: float) -> bool:
    """Whether a settled level's windows, all of them, are further apart than ``stability`` (%): it moved between
    states over the sweep and its last three caught one of them, so another run may read the other."""
    return bool(r.get("stable")) and r.get("drift", 0.0) * 100 > stability


def machine_moved(r: dict[str, Any], stability: float) -> bool:
    """Whether the machine's own speed (machine.MachineProbe) moved further than ``stability`` (%) while the
    level was measured: its figures are the machine's as much as the model's."""
    return r.get("machine_moved", 0.0) * 100 > stability


def spread_text(r: dict[str, Any], stability: float = float("inf")) -> str:
    """A row's spread across its last three windows ("±3%") and, where measured, the 95 % confidence interval of
    their mean ("CI ±5%"); marked where the windows never agreed (with the cause where the probe measured one: the
    machine moved, or the level itself is rough), where they agreed only at the end (see moved), and where the
    machine moved while they agreed."""
    if "spread" not in r:
        return "-"
    text = f"±{100 * r['spread']:.0f}%" + (f", CI ±{100 * r['interval']:.0f}%" if "interval" in r else "")
    machine = f"the machine moved ±{100 * r.get('machine_moved', 0.0):.0f}%"
    if not r.get("stable"):
        cause = machine if machine_moved(r, stability) else "rough" if "machine_moved" in r else ""
        return f"{text} UNSTABLE after {r['windows']} windows" + (f": {cause}" if cause else "")
    return (
        text
        + (f" MOVED ±{100 * r['drift']:.0f}% over {r['windows']} windows" if moved(r, stability) else "")
        + (f"; {machine}" if machine_moved(r, stability) else "")
    )


def probe_line(probe: dict[str, Any] | None, stability: float) -> str:
    """The machine's own speed over the bench, in a sentence ("" without a probe)."""
    if not probe or not probe.get("readings"):
        return ""
    speeds = [s for _, s in probe["readings"]]
    return (
        f" The machine's own speed, a fixed probe between rounds ({probe['probe']}), read {len(speeds)} times: "
        f"{min(speeds):,.0f} to {max(speeds):,.0f} a second; what lasted (the medians of each three in a row) spread "
        f"±{100 * probe['spread']:.0f}%"
        + (
            "; a level measured while it moved further than the stability is marked so, and its spread is the "
            "machine's as much as the model's."
            if probe["spread"] * 100 > stability
            else "."
        )
    )


def served_lines(served: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """p50, p99 and throughput per model and concurrency, with their spread, then the batching gain per model."""
    stability = cfg.get("stability", 0)
    rows = [
        [
            model,
            str(r["concurrency"]),
            _f(r.get("p50_ms")),
            _f(r.get("p99_ms")),
            _f(r["requests_per_s"], ".0f"),
            spread_text(r, stability),
            _f(r["server"]["avg_batch"]),
            _f(r.get("client_cpu_us"), ".0f"),
            _f(r.get("server_cpu_us"), ".0f"),
            f"{r['ok']}/{r['sent']}",
            checked_text(r),
        ]
        for model, mm in served.get("models", {}).items()
        for r in mm["rows"]
    ]
    every = [r for mm in served.get("models", {}).values() for r in mm["rows"]]
    unstable = sum(not r.get("stable", True) for r in every)
    shifted = sum(moved(r, stability) for r in every)
    on_machine = sum(machine_moved(r, stability) for r in every)
    gen = served.get("load_generator", {"name": "python"})
    lines = [
        "## Served over gRPC",
        "",
        f"Server {served['url']} ({'embedded' if served['embedded'] else 'external'}); load generator "
        f"{GENERATORS[gen['name']]}{' (' + gen['why'] + ')' if gen.get('why') else ''}. Closed loop: each level "
        "keeps that many batch-1 requests in flight; dynamic batching as configured. The levels are measured "
        f"in rounds, one window of at least {cfg.get('window_s', 0):g} s per level per round, until a level's "
        f"last three windows agree within {cfg.get('stability', 0):g} % (throughput and mean latency); its "
        "figures come from those three. A level's windows are a round apart, so the machine's drift over "
        "the sweep shows in its spread: how far apart the three windows' throughputs and mean latencies are, "
        "beside the 95 % confidence interval of their mean (CI; Student's t over three windows, the wider of the "
        "two figures'). "
        "Client CPU: the load generator's own CPU time per request; server CPU: tritonserver's and its backends' "
        "(the embedded server; - for one at --url), over the requests Triton counted. Measured/sent: requests in "
        "the last three windows, and in all of the level's windows. Checked: responses compared with the "
        "reference outputs of their inputs under the model's bound (a reduced-precision model: with its own "
        "answers on the idle server, under its gate's SQNR floor; a detector's matched within twice what its gate "
        "measured); one wrong response fails the bench."
        + (
            " perf_analyzer's percentiles are the mean of its three windows' own."
            if gen["name"] == "perf_analyzer"
            else ""
        )
        + probe_line(served.get("machine_probe"), stability)
        + (f" **{unstable} level(s) never settled**: read them as rough." if unstable else "")
        + (f" **{on_machine} level(s) measured while the machine moved**: marked with how far." if on_machine else "")
        + (
            f" **{shifted} level(s) MOVED**: their three last windows agree, but all their windows lie further "
            f"apart than {stability:g} %; the level ran in two states over the sweep, and another run may read "
            "the other: read them as rough."
            if shifted
            else ""
        ),
        "",
    ]
    lines += table(
        [
            "model",
            "concurrency",
            "p50 ms",
            "p99 ms",
            "req/s",
            "spread",
            "avg batch",
            "client CPU µs/req",
            "server CPU µs/req",
            "measured/sent",
            "checked",
        ],
        rows,
    ) + [""]
    if served.get("left_out"):
        lines += [
            f"Left out by the settings (each on by default in torchship bench): {'; '.join(served['left_out'])}.",
            "",
        ]
    for model, mm in served.get("models", {}).items():
        rs = mm["rows"]
        if len(rs) > 1 and rs[0]["requests_per_s"]:
            lines.append(
                f"- {model}: batching gain {rs[-1]['requests_per_s'] / rs[0]['requests_per_s']:.2f}x "
                f"(throughput at concurrency {rs[-1]['concurrency']} over concurrency {rs[0]['concurrency']})"
            )
    lines += client_share_lines(served, gen["name"])
    for model, mm in served.get("models", {}).items():
        if mm.get("buckets"):
            lines.append(padding_line(model, mm["buckets"], mm["rows"]))
    memory = {m: mm["instance_rss_bytes"] for m, mm in served.get("models", {}).items() if mm.get("instance_rss_bytes")}
    if memory:
        lines.append(
            "- Resident memory of each model's backend process after the sweep: "
            + ", ".join(f"{m} {b / 2**20:.0f} MiB" for m, b in memory.items())
        )
    for model, off in served.get("batching_off", {}).items():
        on = {r["concurrency"]: r for r in served["models"].get(model, {}).get("rows", [])}
        gains = [
            f"{r['concurrency']}: {on[r['concurrency']]['requests_per_s'] / r['requests_per_s']:.2f}x"
            for r in off["rows"]
            if r["requests_per_s"] and r["concurrency"] in on
        ]
        lines.append(f"- {model}: dynamic batching on over off, by concurrency: {', '.join(gains)}")
    rows = served.get("noop", {}).get("rows") or [{}]
    if rows[0].get("n"):
        line = (
            f"- No-op round trip (same tensors, no model): p50 {rows[0]['p50_ms']:.2f} ms, p99 "
            f"{rows[0]['p99_ms']:.2f} ms "
            f"at concurrency {rows[0]['concurrency']}"
        )
        if len(rows) > 1:
            line += (
                f"; {rows[-1]['requests_per_s']:.0f} req/s at concurrency {rows[-1]['concurrency']}, the most the "
                "server, its backend and the load generator carry on these cores with no model to run"
            )
        lines.append(line)
    return lines + [""]


CLIENT_SHARE = 0.10  # past this share of the cores, the load generator is named as a limit beside the figures


def client_share_lines(served: dict[str, Any], gen: str) -> list[str]:
    """Where the load generator took more than CLIENT_SHARE of the cores the server runs on (it runs on the same
    ones), a line saying how much, per model at its highest level, and what costs less."""
    cores = served.get("client_cores")
    out = []
    for model, mm in served.get("models", {}).items():
        r = max(mm.get("rows") or [{}], key=lambda r: r.get("concurrency", 0))
        if not cores or not r.get("client_cpu_us"):
            continue
        share = r["client_cpu_us"] * r["requests_per_s"] / 1e6 / cores
        if share > CLIENT_SHARE:
            cheaper = (
                "; perf_analyzer costs less a request: python -m torchship.serve.bench.perf_analyzer install"
                if gen == "python"
                else ""
            )
            out.append(
                f"- {model}: the load generator took {100 * share:.0f} % of the {cores} cores at concurrency "
                f"{r['concurrency']} ({r['client_cpu_us']:.0f} µs a request), time the server could not use{cheaper}"
            )
    return out


PRECISION_PROBE = {"onnx_int8": "int8_flops", "aoti_int8": "int8_flops", "aoti_bf16": "bf16_flops"}


def probe_key(variant: str, dtype: str | None) -> str:
    """The probe a variant is read against: that of the precision it computes in."""
    return PRECISION_PROBE.get(variant) or ("fp32_flops" if dtype in (None, "float32") else "bf16_flops")


def roofs(rows: list[dict[str, Any]], lim: dict[str, Any], dtype: str | None) -> dict[str, tuple[float, str]]:
    """Per probe: (the roof, what set it): the fastest probe kernel of that precision, or a variant that ran faster
    still (a kernel the probe does not try), so that no row reads above 100 %."""
    out = {
        k: (lim[k], lim.get(k.replace("_flops", "_kernel"), "matmul"))
        for k in ("fp32_flops", "bf16_flops", "int8_flops")
        if lim.get(k)
    }
    for r in rows:
        key = probe_key(r["variant"], dtype)
        rate = r.get("images_per_s", 0) * lim.get("flops_per_sample", 0)
        if key in out and rate > out[key][0]:
            out[key] = (rate, f"{r['variant']} itself at batch {r['batch']}, faster than the probe's kernels")
    return out


def probe_share(r: dict[str, Any], lim: dict[str, Any], dtype: str | None, roof: dict[str, tuple[float, str]]) -> str:
    """A row's throughput as a percentage of the roof of the precision its variant computes in (roofs)."""
    key = probe_key(r["variant"], dtype)
    return f"{100 * r['images_per_s'] * lim['flops_per_sample'] / roof[key][0]:.1f}" if key in roof else "-"


def computed_per_request(buckets: list[int], executions: dict[str, int]) -> float | None:
    """Images a bucketed model computed per image it was sent: each batch is padded up to the next
    bucket (batches above the largest are split into chunks of it)."""
    from torchship.runtime import bucket_for

    largest = max(buckets)
    sent = sum(int(b) * n for b, n in executions.items())
    computed = sum(
        n * ((int(b) // largest) * largest + (bucket_for(int(b) % largest, buckets) if int(b) % largest else 0))
        for b, n in executions.items()
    )
    return computed / sent if sent else None


def padding_line(model: str, buckets: list[int], rows: list[dict[str, Any]]) -> str:
    ratios = [
        (r["concurrency"], computed_per_request(buckets, r.get("server", {}).get("batch_executions", {}))) for r in rows
    ]
    shown = ", ".join(f"{c}: {x:.2f}" for c, x in ratios if x is not None)
    return (
        f"- {model}: computes in static-batch buckets ({', '.join(map(str, buckets))}), each batch padded up to "
        f"the next; images computed per image sent, by concurrency: {shown or 'not reported by the server'}"
    )


def breakdown_lines(served: dict[str, Any]) -> list[str]:
    """Triton's own statistics per request (µs): where a served request's time goes inside the server."""
    rows = []
    for section, how in (("models", "on"), ("batching_off", "off")):
        for model, mm in served.get(section, {}).items():
            for r in mm["rows"]:
                s = r["server"]
                rows.append(
                    [
                        model,
                        how,
                        str(r["concurrency"]),
                        _f(s["queue_us"], ".0f"),
                        _f(s["compute_input_us"], ".0f"),
                        _f(s["compute_infer_us"], ".0f"),
                        _f(s["compute_output_us"], ".0f"),
                        _f(r.get("client_side_us"), ".0f"),
                    ]
                )
    return (
        [
            "## Triton's server-side breakdown",
            "",
            "Mean µs per request from Triton's statistics; client-side is the client's mean latency less the "
            "server's share (gRPC, serialization, network).",
            "",
        ]
        + table(
            [
                "model",
                "batching",
                "concurrency",
                "queue",
                "compute input",
                "compute infer",
                "compute output",
                "client-side",
            ],
            rows,
        )
        + [""]
    )


def write_report(results: dict[str, Any], out: Path, plots: bool = True) -> Path:
    m = results["machine"]
    lim = results.get("limits", {})
    lines = [
        f"# Benchmark: {results['export']['name']}",
        "",
        f"{results['created']} · CPU {m['cpu']} ({m['cores']} cores) · GPU {m.get('gpu') or 'none'} · "
        f"torch {m['versions'].get('torch')} · onnxruntime {m['versions'].get('onnxruntime')} · "
        f"git {m.get('git_revision') or '?'}",
        "",
    ]
    if results["export"].get("samples"):
        lines += [f"Inputs: {results['export']['samples']}.", ""]
    served = results.get("served")
    if served:
        lines += served_lines(served, results.get("config", {}))
    if results.get("winner"):
        from .placement import winner_lines

        lines += winner_lines(results["winner"])
    for res in results.get("soak", {}).values():
        from .soak import soak_lines

        lines += soak_lines(res)
    rec = results.get("recommendation", {})
    if rec:
        lines += ["## Recommendation", ""]
        if "error" in rec:
            lines.append(f"None: {rec['error']}")
        else:
            lines += [
                f"- model `{rec['model']}`: max_batch_size {rec['max_batch_size']}, dynamic batching "
                f"{'on' if rec['dynamic_batching'] else 'off'}, max_queue_delay_microseconds "
                f"{rec['max_queue_delay_microseconds']}, "
                f"instance count {rec['instance_count']}",
                f"- measured: {rec['requests_per_s']:.0f} req/s at p99 {rec['p99_ms']:.2f} ms (concurrency "
                f"{rec['at_concurrency']})",
                f"- why: {rec['why']}",
            ]
            if rec.get("written"):
                lines.append(f"- written to: {', '.join(rec['written'])}")
        lines.append("")
    lines += side_by_side(results, results.get("winner"))
    lines += entry_lines(results.get("served", {}))
    ip = results.get("in_process")
    if ip:
        lines += [
            "## In-process latency",
            "",
            f"Device {ip['device']}, {ip['threads']} intra-op thread(s); variants interleaved in blocks (at least "
            f"{results['config']['blocks']}, more until each variant's last three block means agree within "
            f"{results['config'].get('stability', 0):g} %) after {results['config']['warmup']} warm-up runs each. "
            "Spread: how far apart those three block means are.",
            "",
        ]
        probe = "flops_per_sample" in lim
        roof = roofs([r for r in ip["rows"] if r.get("n")], lim, results["export"].get("dtype")) if probe else {}
        acc = ip.get("accuracy")
        lines += table(
            ["variant", "batch", "p50 ms", "p99 ms", "mean ms", "samples/s", "spread"]
            + (["% of its precision's probe"] if probe else [])
            + (["held-out accuracy %"] if acc else []),
            [
                [
                    r["variant"],
                    str(r["batch"]),
                    _f(r.get("p50_ms")),
                    _f(r.get("p99_ms")),
                    _f(r.get("mean_ms")),
                    _f(r.get("images_per_s"), ".0f"),
                    spread_text(r),
                ]
                + ([probe_share(r, lim, results["export"].get("dtype"), roof)] if probe else [])
                + ([_f(acc.get(r["variant"]))] if acc else [])
                for r in ip["rows"]
                if r.get("n")
            ],
        )
        lines += [f"- {k}: {v}" for k, v in ip.get("notes", {}).items()] + [""]
        if probe:
            names = {"fp32_flops": "fp32", "bf16_flops": "bf16", "int8_flops": "INT8"}
            lines += [
                f"The model costs {lim['flops_per_sample'] / 1e9:.3f} GFLOP per sample (torch's FlopCounterMode). "
                f"Each variant is read against the roof of the precision it computes in (INT8 against INT8, bf16 "
                f"against bf16, the rest against the export's dtype), the fastest kernel found on this machine at "
                f"{results['config']['threads']} thread(s): "
                + "; ".join(
                    f"{names[k]} {v / 1e9:.1f} G{'OP' if k == 'int8_flops' else 'FLOP'}/s ({what})"
                    for k, (v, what) in roof.items()
                )
                + ".",
                "",
            ]
    if served:
        lines += breakdown_lines(served)
        if "reconfigured" in served:
            lines += [f"Batching off and queue delays: {served['reconfigured']['skipped']}.", ""]
        for model, per_delay in served.get("delays", {}).items():
            lines += (
                [f"### {model} at other queue delays", ""]
                + table(
                    ["delay µs", "concurrency", "p50 ms", "p99 ms", "req/s"],
                    [
                        [
                            d,
                            str(r["concurrency"]),
                            _f(r.get("p50_ms")),
                            _f(r.get("p99_ms")),
                            _f(r["requests_per_s"], ".0f"),
                        ]
                        for d, mm in per_delay.items()
                        for r in mm["rows"]
                    ],
                )
                + [""]
            )
        ol = served.get("open_loop")
        if ol:
            lines += (
                ["## Open loop (Poisson arrivals)", ""]
                + table(
                    ["model", "target req/s", "achieved", "p50 ms", "p99 ms", "errors"],
                    [
                        [
                            k,
                            f"{v['rate_target']:g}",
                            f"{v['achieved_rps']:.0f}",
                            _f(v.get("p50_ms")),
                            _f(v.get("p99_ms")),
                            str(v["errors"]),
                        ]
                        for k, v in ol.items()
                    ],
                )
                + [""]
            )
        lines += cross_check_lines(served, results)
    if results.get("errors"):
        lines += ["## Errors", "", *[f"- {e}" for e in results["errors"]], ""]
    if results.get("server_stop_note"):
        lines += [
            "## Server shutdown",
            "",
            f"The embedded server was killed at the end: {results['server_stop_note']}",
            "",
        ]
    if plots:
        pngs = draw_plots(results, out)
        if pngs:
            lines += ["## Plots", "", *[f"![{p.stem}]({p.name})" for p in pngs], ""]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines))
    return path
