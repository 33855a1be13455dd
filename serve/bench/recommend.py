"""The recommendation: the served configuration with the highest throughput within the p99 budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SATURATED = 0.05  # within this share of the best throughput, more requests in flight add only queueing


def saturation(items: list, row=lambda r: r):
    """Of ``items`` (rows of a sweep, or what ``row`` finds a row in), the one at the fewest requests in flight
    whose throughput is within SATURATED of the best: where the server saturates. resnet50's onnx_int8 (1 x 2 on
    2 cores) served 98 req/s at 16 in flight and 98 at 64, its p99 221 against 660 ms."""
    top = max(row(i)["requests_per_s"] for i in items)
    near = [i for i in items if row(i)["requests_per_s"] >= (1 - SATURATED) * top]
    return min(near, key=lambda i: (row(i)["concurrency"], -row(i)["requests_per_s"]))


def recommend(results: dict, budget_ms: float | None, max_batch: int) -> dict[str, Any]:
    """The served configuration with the highest throughput whose p99 meets the budget (at the fewest requests
    in flight that reach it: saturation)."""
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
        return {
            "error": f"no configuration meets p99 <= {budget_ms:g} ms; the lowest p99 measured was "
            f"{best[3]['p99_ms']:.2f} ms ({best[0]}, concurrency {best[3]['concurrency']})",
            "budget_ms": budget_ms,
        }
    model, batching, delay, r = saturation(ok, lambda c: c[3])
    c = r["concurrency"]
    mbs = min(max_batch, 1 << max(0, (c - 1).bit_length())) if batching == "on" else max_batch
    if batching == "on":
        why_batch = (
            f"{c} requests in flight form batches of at most {c}, so max_batch_size {mbs}"
            f"{' (the export caps it at ' + str(max_batch) + ')' if mbs < c else ''}"
        )
    else:
        why_batch = "requests ran one by one faster than the dynamic batcher merged them at this load"
    placed = served.get("models", {}).get(model, {})
    instances, threads = placed.get("instances", 1), placed.get("threads", 1)
    return {
        "budget_ms": budget_ms,
        "model": model,
        "dynamic_batching": batching == "on",
        "max_batch_size": mbs,
        "max_queue_delay_microseconds": delay,
        "instance_count": instances,
        "at_concurrency": c,
        "p99_ms": r["p99_ms"],
        "requests_per_s": r["requests_per_s"],
        "why": (
            "highest throughput with p99 "
            f"{'<= ' + format(budget_ms, 'g') + ' ms' if budget_ms else '(no budget given)'}; "
            f"{why_batch}; "
            f"{instances} instance(s) x {threads} thread(s) as served (torchship repo --strategy and torchship "
            "run search them within the cores)"
        ),
    }


def batching_edit(rec: dict[str, Any]):
    """The config edit that applies a recommendation's batching (max_batch_size, dynamic batching and its queue
    delay); a batch-1 config stays batch-1."""

    def edit(c) -> None:
        if c.max_batch_size == 0:
            return
        c.max_batch_size = max(1, min(c.max_batch_size, rec["max_batch_size"] or c.max_batch_size))
        # warm-ups above the new max batch fail the load (and a load over the API with one crashed Triton 2.51)
        sizes = sorted({min(w.batch_size, c.max_batch_size) for w in c.model_warmup})
        if sizes and sizes != sorted(w.batch_size for w in c.model_warmup):
            keep = {min(w.batch_size, c.max_batch_size): w for w in c.model_warmup}
            warm = []
            for b in sizes:
                w = type(keep[b])()
                w.CopyFrom(keep[b])
                w.batch_size, w.name = b, f"real_sample_batch_{b}"
                warm.append(w)
            c.ClearField("model_warmup")
            c.model_warmup.extend(warm)
        if rec["dynamic_batching"]:
            c.dynamic_batching.max_queue_delay_microseconds = rec["max_queue_delay_microseconds"]
        else:
            c.ClearField("dynamic_batching")

    return edit


def write_recommendation(repo: Path, rec: dict) -> list[str]:
    """Apply the recommended batching to the model's configs in the repository (both, atomically)."""
    from ..model_config import edit_configs

    return [str(p) for p in edit_configs(Path(repo) / rec["model"], batching_edit(rec))]
