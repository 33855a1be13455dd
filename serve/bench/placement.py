"""How a served model uses the CPU: its instances x intra-op threads, searched within the cores it is given on a
running embedded server (each point loaded, measured with every response checked, and the best one written into
the model's configs)."""

from __future__ import annotations

from typing import Any, Callable

from tritonclient.grpc import model_config_pb2 as mc

from torchship.errors import ParityError
from torchship.names import format_of

from ..model_config import edit_configs, read_config, served_config_path

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


def search(server, model: str, export, strategy: str, cores: int, log=print) -> dict[str, Any]:
    """Measure ``model`` (served by ``server``, an embedded TritonServer) at each of candidates(``cores``) with
    SHORT_BENCH's levels, every response checked, and keep the one ``strategy`` prefers: it is written into the
    model's configs and loaded. Returns {"grid": [{instances, threads, rows}], "chosen": {...}, "why": words}.
    A GPU model is left as it is (one instance per GPU). ParityError if a response was wrong."""
    from ..config import parse_strategy
    from .checks import response_check
    from .config import SHORT_BENCH, BenchConfig
    from .inputs import load_inputs, single_rows
    from .served import LoadGenerator, sweep
    from .strategy import best_row

    path = served_config_path(server.repo / model)
    base = read_config(path)
    if on_gpu(base):
        return {"skipped": "GPU instances: one per GPU, the threads only for operators on the CPU"}
    kind, budget = parse_strategy(strategy)
    cfg = BenchConfig(export_dir=str(export.dir), **{**SHORT_BENCH, "concurrency": (1, 16)}, cross_check=False,
                      progress=False, plots=False)
    inputs = load_inputs(export, None)
    singles = single_rows(inputs.pool, 64)
    client = server.client()
    check = response_check(client, model, export.manifest, format_of(model, export.manifest, client.config(model)),
                           inputs.expected, singles, len(next(iter(inputs.pool.values()))))
    grid = []
    try:
        for instances, threads in candidates(cores):
            c = read_config(path)
            placement_edit(instances, threads)(c)
            server.load(model, client=client, override=c)
            rows = sweep(server.url, [model], singles, cfg, cfg.concurrency, None, client, LoadGenerator("python"),
                         {model: check})[model]
            wrong = sum(r.get("wrong", 0) for r in rows)
            if wrong:
                raise ParityError(f"{model} at {instances} instance(s) x {threads} thread(s): {wrong} wrong responses "
                                  "under load")
            best = best_row(rows, kind, budget)
            grid.append({"instances": instances, "threads": threads, "rows": rows,
                         "score": best[0] if best else None, "at": best[1]["concurrency"] if best else None})
            log(f"placement {model}: {instances} instance(s) x {threads} thread(s): " + ", ".join(
                f"{r['requests_per_s']:.0f} req/s p99 {r['p99_ms']:.2f} ms at {r['concurrency']} in flight" for r in rows))
        fit = [g for g in grid if g["score"] is not None]
        chosen = max(fit, key=lambda g: g["score"]) if fit else \
            next(g for g in grid if (g["instances"], g["threads"]) == placement_of(base))
        edit_configs(server.repo / model, placement_edit(chosen["instances"], chosen["threads"]))
        server.load(model, client=client, override=read_config(path))
    finally:
        client.close()
    return {"cores": cores, "grid": grid, "chosen": {"instances": chosen["instances"], "threads": chosen["threads"]},
            "why": why(grid, chosen, strategy, fit)}


def why(grid: list[dict[str, Any]], chosen: dict[str, Any], strategy: str, fit: list) -> str:
    """The choice in words: each point's figure beside the winner's."""
    def figure(g: dict[str, Any]) -> str:
        r = next((r for r in g["rows"] if r["concurrency"] == g["at"]), None)
        return (f"{g['instances']}x{g['threads']}: " + (f"{r['requests_per_s']:.0f} req/s, p50 {r['p50_ms']:.2f} ms, "
                                                          f"p99 {r['p99_ms']:.2f} ms at {r['concurrency']} in flight"
                                                          if r else "outside the budget"))
    head = (f"{chosen['instances']} instance(s) x {chosen['threads']} thread(s), best under {strategy}" if fit else
            f"no point met {strategy}; the repository's {chosen['instances']}x{chosen['threads']} kept")
    return head + " (" + "; ".join(figure(g) for g in grid) + ")"


def grid_table(placement: dict[str, Any]) -> list[str]:
    """The grid measured, as markdown rows: instances x threads, each level's throughput and latency."""
    from torchship.markdown import table

    if "grid" not in placement:
        return [f"Instances x threads: {placement.get('skipped', 'not searched')}.", ""]
    chosen = placement["chosen"]
    rows = [[f"{g['instances']} x {g['threads']}" + (" (chosen)" if (g["instances"], g["threads"]) ==
                                                      (chosen["instances"], chosen["threads"]) else ""),
             str(r["concurrency"]), f"{r['requests_per_s']:.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
             f"{r.get('checked', 0)}, {r.get('wrong', 0)} wrong"]
            for g in placement["grid"] for r in g["rows"]]
    return [f"Instances x intra-op threads on {placement['cores']} core(s), each measured in half-second windows until "
            "three agree, every response checked:", ""] + table(
        ["instances x threads", "in flight", "req/s", "p50 ms", "p99 ms", "checked"], rows) + ["", placement["why"] + ".", ""]
