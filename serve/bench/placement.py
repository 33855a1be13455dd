"""How a served model uses the CPU: its instances x intra-op threads, read from and written into its configs, the
points a search measures within the cores it is given (strategy.search_placement), and the grid in words."""

from __future__ import annotations

from typing import Any, Callable

from tritonclient.grpc import model_config_pb2 as mc

THREAD_PARAMETERS = ("intra_op_thread_count", "INTRA_OP_THREAD_COUNT")  # Triton's onnxruntime and pytorch backends


def candidates(cores: int) -> list[tuple[int, int]]:
    """Every (instances, threads per instance) that uses all ``cores`` without oversubscribing them: one
    instance with every core first, then more instances of fewer threads."""
    return [(n, cores // n) for n in range(1, cores + 1) if cores % n == 0]


def placement_of(c: mc.ModelConfig) -> tuple[int, int]:
    """(CPU instances, intra-op threads per instance) of a config."""
    instances = sum(g.count or 1 for g in c.instance_group if g.kind != mc.ModelInstanceGroup.KIND_GPU) or 1
    threads = next((int(c.parameters[k].string_value) for k in THREAD_PARAMETERS if k in c.parameters), 1)
    return instances, threads


def served_placement(config: dict[str, Any]) -> tuple[int, int]:
    """placement_of for a config in Triton's JSON form, as a server reports it."""
    groups = [g for g in config.get("instance_group", []) if g.get("kind") != "KIND_GPU"]
    params = config.get("parameters") or {}
    threads = next((int(params[k]["string_value"]) for k in THREAD_PARAMETERS if k in params), 1)
    return sum(int(g.get("count", 1)) for g in groups) or 1, threads


def placement_edit(instances: int, threads: int) -> Callable[[mc.ModelConfig], None]:
    """The config edit that gives a model ``instances`` CPU instances of ``threads`` intra-op threads each."""

    def edit(c: mc.ModelConfig) -> None:
        for g in c.instance_group:
            if g.kind != mc.ModelInstanceGroup.KIND_GPU:
                g.count = instances
        for key in THREAD_PARAMETERS:
            if key in c.parameters:
                c.parameters[key].string_value = str(threads)

    return edit


def on_gpu(c: mc.ModelConfig) -> bool:
    return any(g.kind == mc.ModelInstanceGroup.KIND_GPU for g in c.instance_group)


MIN_GAIN = 0.05  # more instances win only by more than this: each is a process holding its own runtime and weights


def choose(fit: list[dict[str, Any]]) -> dict[str, Any]:
    """The point to serve among those measured within the strategy (each with a "score", higher better): the
    fewest instances among the points within MIN_GAIN of the best score. On 2 cores resnet18's 2 x 1 beat 1 x 2
    by 1 % (within the windows' spread) for 745 MiB more resident memory in a second torch process."""
    top = max(g["score"] for g in fit)
    near = [g for g in fit if g["score"] >= top - MIN_GAIN * abs(top)]
    return min(near, key=lambda g: (g["instances"], -g["score"]))


def why(grid: list[dict[str, Any]], chosen: dict[str, Any], strategy: str, fit: list) -> str:
    """The choice in words: each point's figure beside the winner's."""

    def figure(g: dict[str, Any]) -> str:
        r = next((r for r in g["rows"] if r["concurrency"] == g["at"]), None)
        return f"{g['instances']}x{g['threads']}: " + (
            f"{r['requests_per_s']:.0f} req/s, p50 {r['p50_ms']:.2f} ms, "
            f"p99 {r['p99_ms']:.2f} ms at {r['concurrency']} in flight"
            if r
            else "outside the budget"
        )

    best = max(fit, key=lambda g: g["score"]) if fit else None
    head = (
        f"no point met {strategy}; the repository's {chosen['instances']} x {chosen['threads']} kept"
        if not fit
        else f"{chosen['instances']} instance(s) x {chosen['threads']} thread(s), best under {strategy}"
        if best is chosen
        else f"{chosen['instances']} instance(s) x {chosen['threads']} thread(s): within {100 * MIN_GAIN:.0f} % of "
        "the best "
        f"under {strategy} with fewer instances (each holds its own runtime and weights)"
    )
    return head + " (" + "; ".join(figure(g) for g in grid) + ")"


def grid_table(placement: dict[str, Any]) -> list[str]:
    """The grid measured, as markdown rows: instances x threads, each level's throughput and latency."""
    from torchship.markdown import table

    from .beside import GENERATORS

    if "grid" not in placement:
        return [f"Instances x threads: {placement.get('skipped', 'not searched')}.", ""]
    chosen = placement["chosen"]
    rows = [
        [
            f"{g['instances']} x {g['threads']}"
            + (" (chosen)" if (g["instances"], g["threads"]) == (chosen["instances"], chosen["threads"]) else ""),
            str(r["concurrency"]),
            f"{r['requests_per_s']:.0f}",
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            f"{r.get('checked', 0)}, {r.get('wrong', 0)} wrong",
        ]
        for g in placement["grid"]
        for r in g["rows"]
    ]
    return (
        [
            f"Instances x intra-op threads on {placement['cores']} core(s), each measured in half-second windows until "
            f"three agree, sent by {GENERATORS[placement.get('load_generator', 'python')]} and checked as the bench "
            "checks:",
            "",
        ]
        + table(["instances x threads", "in flight", "req/s", "p50 ms", "p99 ms", "checked"], rows)
        + ["", placement["why"] + ".", ""]
    )
