"""Served beside in-process in the bench report: each served model against the same artifact run in the
bench's own process, the ceiling the round trip alone sets, and the other load generator's cross-check."""

from __future__ import annotations

from typing import Any

from torchship.markdown import cell as _f
from torchship.markdown import table
from torchship.names import format_of

from .results import served_models

GENERATORS = {"python": "torchship's Python client", "perf_analyzer": "perf_analyzer"}


def served_artifact_of(model: str, mm: dict[str, Any]) -> str | None:
    """The artifact a served model ran, as the bench recorded it (results from before it did: its name's format)."""
    return mm.get("artifact") or format_of(model)


def noop_ceiling(results: dict[str, Any]) -> dict[str, Any]:
    """The no-op model's row at the highest concurrency it was measured at (empty if it was not)."""
    rows = [r for r in results.get("served", {}).get("noop", {}).get("rows") or [] if r.get("n")]
    return max(rows, key=lambda r: r["concurrency"]) if len(rows) > 1 else {}


def side_by_side(results: dict[str, Any], winner: dict[str, Any] | None = None) -> list[str]:
    """Each served model beside its artifact run in this process: batch-1 latency, and best throughput; with
    ``winner`` (torchship run's, its placement searched), the winner as served, from the search's figures."""
    ip = results.get("in_process", {}).get("rows", [])
    served = served_models(results)
    measured = [(model, mm, mm["rows"], mm.get("instances"), mm.get("threads")) for model, mm in served.items()]
    point = as_served(winner)
    if point and winner["model"] in served:
        measured.append((f"{winner['served_as']} (as served)", served[winner["model"]], *point))
    ip_threads = results.get("in_process", {}).get("threads")
    rows, costs = [], []
    for model, mm, levels, instances, threads in measured:
        variant = served_artifact_of(model, mm)
        mine = [r for r in ip if r["variant"] == variant and r.get("n")]
        if not mine or not levels:
            continue
        one = next((r for r in mine if r["batch"] == 1), {})
        c1 = next((r for r in levels if r["concurrency"] == 1), {})
        best_ip = max(mine, key=lambda r: r["images_per_s"])  # samples/s; the key keeps its first name
        best_sv = max(levels, key=lambda r: r["requests_per_s"])
        placed = f", {instances} x {threads}" if instances else ""
        bound = same_cores(best_ip["images_per_s"], ip_threads, instances, threads)
        rows.append(
            [
                model,
                variant,
                _f(one.get("p50_ms")),
                _f(c1.get("p50_ms")),
                f"{best_ip['images_per_s']:.0f} (batch {best_ip['batch']})",
                f"{best_sv['requests_per_s']:.0f} (concurrency {best_sv['concurrency']}{placed})",
                f"{100 * best_sv['requests_per_s'] / bound:.0f} %",
            ]
        )
        costs += cost_line(model, best_sv, best_ip, ip_threads, instances, threads, bound)
    if not rows:
        return []
    lines = [
        "## In-process beside served",
        "",
        f"In-process on {ip_threads} intra-op thread(s), one served instance's; served by each model's instances x "
        f"intra-op threads on the machine's {results.get('machine', {}).get('cores', '?')} core(s), the load "
        "generator on the same cores. Served / in-process is on the same cores: the in-process samples/s times the "
        "cores the served model uses over the in-process threads, the most those cores would give in-process.",
        "",
    ] + table(
        [
            "model",
            "artifact",
            "in-process p50 ms (batch 1)",
            "served p50 ms (concurrency 1)",
            "in-process samples/s",
            "served samples/s (instances x threads)",
            "served / in-process",
        ],
        rows,
    )
    if costs:
        lines += [
            "",
            "Where a served request's CPU went, at each model's best level (the server's and the client's "
            "CPU a request, measured over the level's windows; the model's own, in-process at its best batch):",
            "",
        ] + costs
    if point and any(r[0].endswith("(as served)") for r in rows):
        lines += [
            "",
            f"{winner['served_as']} (as served): `{winner['model']}` at the instances x threads the search "
            "chose, from the windows that chose it.",
        ]
    ceiling = noop_ceiling(results)
    if ceiling:
        lines += [
            "",
            f"Ceiling: with no model to run, the server carried {ceiling['requests_per_s']:.0f} requests/s at "
            f"concurrency {ceiling['concurrency']} on these cores (gRPC, the backend's round trip and the load "
            "generator alone); a model whose in-process throughput is near or above that is held by the "
            "round trip, not by its own speed.",
        ]
    return lines + [""]


def same_cores(rate: float, ip_threads: int | None, instances: int | None, threads: int | None) -> float:
    """In-process samples/s ``rate`` (on ``ip_threads`` threads) on the cores a served model of ``instances`` x
    ``threads`` uses: scaled by their ratio, as if the model scaled with its cores (the most they would give)."""
    if not (ip_threads and instances and threads):
        return rate
    return rate * instances * threads / ip_threads


def cost_line(model, sv, ip, ip_threads, instances, threads, bound) -> list[str]:
    """One served model's CPU a request, split: the model's own (its in-process CPU a sample), the rest of the
    server (Triton, gRPC, the backend and its copies), the client; [] where the bench did not read the server's."""
    if not sv.get("server_cpu_us") or not sv.get("client_cpu_us") or not ip_threads:
        return []
    own = 1e6 * ip_threads / ip["images_per_s"]
    server, client = sv["server_cpu_us"], sv["client_cpu_us"]
    total = server + client
    placed = f"{instances} x {threads}, " if instances else ""
    return [
        f"- {model}, {placed}{sv['concurrency']} in flight: {total:.0f} µs of CPU a request: the model's own "
        f"{own:.0f} ({100 * own / total:.0f} %), the rest of the server {max(0.0, server - own):.0f} "
        f"({100 * max(0.0, server - own) / total:.0f} %), the client {client:.0f} ({100 * client / total:.0f} %); "
        f"served {sv['requests_per_s']:.0f} a second where in-process on the same cores would give {bound:.0f}"
    ]


def as_served(winner: dict[str, Any] | None) -> tuple[list[dict[str, Any]], int, int] | None:
    """The rows, instances and threads of the point the search chose for ``winner`` (None where it searched
    nothing)."""
    placement = (winner or {}).get("placement") or {}
    chosen = (winner or {}).get("model"), (winner or {}).get("instances"), (winner or {}).get("threads")
    point = next((g for g in placement.get("grid", []) if (g["model"], g["instances"], g["threads"]) == chosen), None)
    return (point["rows"], point["instances"], point["threads"]) if point else None


def cross_check_lines(served: dict[str, Any], results: dict[str, Any]) -> list[str]:
    """The other load generator beside the sweep's, on one model at concurrency 1 and the highest level,
    then the served/in-process ratio with each."""
    cc = served.get("cross_check", {})
    if "skipped" in cc or "rows" not in cc:
        return [f"Cross-check with another load generator: {cc.get('skipped', 'none')}.", ""]
    model, main = cc["model"], GENERATORS[served["load_generator"]["name"]]
    other = GENERATORS[cc["load_generator"]]
    ours = {r["concurrency"]: r for r in served["models"].get(model, {}).get("rows", [])}
    lines = [f"## Cross-check: {model} with {other}", ""]
    lines += table(
        [
            "concurrency",
            f"{main} req/s",
            f"{other} req/s",
            f"{main} p50 ms",
            f"{other} p50 ms",
            f"{main} p99 ms",
            f"{other} p99 ms",
            f"{main} CPU µs/req",
            f"{other} CPU µs/req",
        ],
        [
            [
                str(r["concurrency"]),
                _f(ours.get(r["concurrency"], {}).get("requests_per_s"), ".0f"),
                f"{r['requests_per_s']:.0f}",
                _f(ours.get(r["concurrency"], {}).get("p50_ms")),
                _f(r.get("p50_ms")),
                _f(ours.get(r["concurrency"], {}).get("p99_ms")),
                _f(r.get("p99_ms")),
                _f(ours.get(r["concurrency"], {}).get("client_cpu_us"), ".0f"),
                _f(r.get("client_cpu_us"), ".0f"),
            ]
            for r in cc["rows"]
        ],
    ) + [""]
    top = cc["rows"][-1]
    return lines + ratio_lines(model, [ours.get(top["concurrency"]), top], results)


def ratio_lines(model: str, rows: list[dict[str, Any] | None], results: dict[str, Any]) -> list[str]:
    """Served throughput at the highest concurrency over the same artifact's best in-process throughput
    (same thread count), with each load generator's row."""
    variant = served_artifact_of(model, served_models(results).get(model, {}))
    ip = [r for r in results.get("in_process", {}).get("rows", []) if r["variant"] == variant and r.get("n")]
    rows = [r for r in rows if r]
    if not ip or not rows:
        return []
    best = max(r["images_per_s"] for r in ip)
    each = ", ".join(
        f"{100 * r['requests_per_s'] / best:.0f} % with {GENERATORS[r.get('load_generator', 'python')]} "
        f"({_f(r.get('client_cpu_us'), '.0f')} µs of client CPU per request)"
        for r in rows
    )
    threads = results.get("in_process", {}).get("threads")
    return [
        f"- served over in-process at concurrency {rows[0]['concurrency']} ({variant}, best in-process {best:.0f} "
        f"samples/s on {threads} thread(s)): {each}; the client runs on the same cores as the server",
        "",
    ]
