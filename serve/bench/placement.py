"""How a served model uses the CPU: its instances x intra-op threads, read from and written into its configs, the
points a search measures within the cores it is given (search.search), and the search in words."""

from __future__ import annotations

from typing import Any, Callable

from tritonclient.grpc import model_config_pb2 as mc

from ..config import default_placement

THREAD_PARAMETERS = ("intra_op_thread_count", "INTRA_OP_THREAD_COUNT")  # Triton's onnxruntime and pytorch backends


def candidates(cores: int) -> list[tuple[int, int]]:
    """Every (instances, threads per instance) that uses all ``cores`` without oversubscribing them: one
    instance with every core first, then more instances of fewer threads."""
    return [(n, cores // n) for n in range(1, cores + 1) if cores % n == 0]


def grid_of(cores: int) -> list[tuple[int, int]]:
    """The placements the search measures: the repository's default on ``cores`` cores, then every one that uses
    them all (candidates)."""
    default = default_placement(cores)
    return [default] + [p for p in candidates(cores) if p != default]


def placement_of(c: mc.ModelConfig | dict[str, Any]) -> tuple[int, int]:
    """(CPU instances, intra-op threads per instance) of a config: a ModelConfig, or its JSON form as a server
    reports it."""
    if isinstance(c, dict):
        from google.protobuf import json_format

        c = json_format.ParseDict(c, mc.ModelConfig(), ignore_unknown_fields=True)
    instances = sum(g.count or 1 for g in c.instance_group if g.kind != mc.ModelInstanceGroup.KIND_GPU) or 1
    threads = next((int(c.parameters[k].string_value) for k in THREAD_PARAMETERS if k in c.parameters), 1)
    return instances, threads


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


def winner_lines(winner: dict[str, Any]) -> list[str]:
    """What serves under the export's plain name and why, with the search behind the choice: the same words in the
    run's summary, the bench report and the repository's README."""
    return [f"Served as `{winner['served_as']}`: `{winner['model']}`. Why: {winner['why']}.", ""] + grid_table(winner)


def grid_table(winner: dict[str, Any]) -> list[str]:
    """The search behind ``winner`` (its "placement" record) as markdown: each contender at each instances x
    threads, each level's figures, who measured it, and what the search left out."""
    from torchship.markdown import table

    from .beside import GENERATORS

    placement = winner.get("placement") or {}
    skipped = [f"- {line}." for line in placement.get("skipped", [])]
    if "grid" not in placement:
        return [f"Instances x threads: {'; '.join(placement.get('skipped', [])) or 'not searched'}.", ""]
    chosen = (winner["model"], winner.get("instances"), winner.get("threads"))
    rows = [
        [
            f"{g['model']} {g['instances']} x {g['threads']}"
            + (" (chosen)" if (g["model"], g["instances"], g["threads"]) == chosen else ""),
            str(r["concurrency"]),
            f"{r['requests_per_s']:.0f}",
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            f"{r.get('checked', 0)}, {r.get('wrong', 0)} wrong",
            f"the {r.get('measured_by', 'sweep')}",
        ]
        for g in placement["grid"]
        for r in g["rows"]
    ]
    return (
        [
            f"The models that could win, at each instances x intra-op threads on {placement['cores']} core(s), "
            f"measured until three windows agree, sent by {GENERATORS[placement.get('load_generator', 'python')]} "
            "and checked as the bench checks:",
            "",
        ]
        + table(
            ["model, instances x threads", "in flight", "req/s", "p50 ms", "p99 ms", "checked", "measured by"], rows
        )
        + [""]
        + skipped
        + ([""] if skipped else [])
    )
