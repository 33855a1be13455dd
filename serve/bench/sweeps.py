"""The served part's plan as data: which models it sweeps, and the sweeps it runs in order (the progress bar
reads the same list the sweep does)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchship.errors import TorchshipError
from torchship.names import format_of

from .config import BenchConfig
from .noop import NOOP_MODEL
from .windows import LAST


@dataclass
class ServedPlan:
    """The served part's plan, known before anything is timed: the models it sweeps, whether the server is
    embedded (only then are models reloaded with other configs) and whether the no-op model is timed.
    ``error``: the server at --url could not be asked what it serves; the served part raises it."""

    models: list[str]
    embedded: bool
    noop: bool
    error: Optional[TorchshipError] = None
    entry: Optional[str] = None  # the image entry, timed with the export's held-out files


@dataclass(frozen=True)
class Sweep:
    """One sweep of served models over concurrency levels: the sweep itself ("models"), the same again with
    dynamic batching off ("batching_off") or at another queue delay ("delay"), the no-op model ("noop"), or
    the other load generator's cross-check ("cross_check")."""

    kind: str
    models: tuple[str, ...]
    levels: tuple[int, ...]
    delay_us: int = 0


def plan_sweeps(cfg: BenchConfig, manifest: dict, served: ServedPlan, cross_check: bool) -> list[Sweep]:
    """The sweeps bench_served runs, in order: the sweep, the image entry with the held-out files, then on the
    embedded server (which reloads models with changed configs) batching off and each other queue delay, the
    no-op model, and the cross-check on the ONNX model where one is served."""
    levels, models = tuple(cfg.concurrency), served.models
    plan = [Sweep("models", tuple(models), levels)] if models else []
    plan += [Sweep("entry", (served.entry,), levels)] if served.entry else []
    if served.embedded:
        compared = tuple(m for m in models if format_of(m, manifest) in cfg.batching_compare)
        plan += [Sweep("batching_off", compared, levels)] if compared else []
        plan += [Sweep("delay", tuple(models), levels, d) for d in cfg.queue_delays_us] if models else []
    if served.noop:
        plan.append(Sweep("noop", (NOOP_MODEL,), noop_levels(cfg)))
    if cross_check and models:
        model = sorted(models, key=lambda m: not m.endswith("_onnx"))[0]
        plan.append(Sweep("cross_check", (model,), noop_levels(cfg)))
    return plan


def served_runs(cfg: BenchConfig, manifest: dict, served: ServedPlan) -> int:
    """How many measurement windows bench_served plans, three per level: the progress bar's total, grown as a
    level needs more."""
    from .perf_analyzer import locate

    plan = plan_sweeps(cfg, manifest, served, bool(cfg.cross_check and locate(cfg.perf_analyzer)))
    return LAST * sum(len(s.models) * len(s.levels) for s in plan)


def noop_levels(cfg: BenchConfig) -> tuple[int, ...]:
    """Concurrency 1 and the highest level: the no-op model's round trip and the most it carries, and the
    cross-check's two points."""
    return tuple(sorted({1, max(cfg.concurrency)}))
