"""The served part's plan as data: which models it sweeps and the sweeps it runs in order, read by the runner, the
progress bar and the report alike."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Optional

from torchship.errors import TorchshipError
from torchship.names import format_of

from .config import BenchConfig
from .noop import NOOP_MODEL
from .windows import LAST


class SweepKind(StrEnum):
    """What a sweep measures, and where its rows land in results["served"]."""

    MODELS = "models"  # the served models: results["served"]["models"][model]["rows"]
    ENTRY = "entry"  # the raw entry, with the export's held-out files: ["entry"]
    BATCHING_OFF = "batching_off"  # the models reloaded with dynamic batching off: ["batching_off"][model]
    DELAY = "delay"  # the models reloaded at another queue delay: ["delays"][model][delay]
    NOOP = "noop"  # the no-op model's round trip: ["noop"]
    CROSS_CHECK = "cross_check"  # the other load generator on one model: ["cross_check"]

    @property
    def what(self) -> str:
        return WHAT[self]

    @property
    def reconfigures(self) -> bool:
        """Whether its models are reloaded with an edited config first (only the embedded server allows it)."""
        return self in (SweepKind.BATCHING_OFF, SweepKind.DELAY)

    @property
    def on_repository_config(self) -> bool:
        """Whether it measures models as the repository configures them, after a sweep that reconfigured them."""
        return self in (SweepKind.NOOP, SweepKind.CROSS_CHECK)


WHAT = {
    SweepKind.MODELS: "the served models",
    SweepKind.ENTRY: "the raw entry, with the export's held-out files",
    SweepKind.BATCHING_OFF: "dynamic batching off",
    SweepKind.DELAY: "another queue delay",
    SweepKind.NOOP: "the no-op model",
    SweepKind.CROSS_CHECK: "the other load generator's cross-check",
}


@dataclass(frozen=True)
class Sweep:
    """One sweep of served models over concurrency levels, of a SweepKind."""

    kind: SweepKind
    models: tuple[str, ...]
    levels: tuple[int, ...]
    delay_us: int = 0
    max_windows: Optional[int] = None  # fewer than --max-windows

    def edit(self, c) -> None:
        """The config edit a reconfiguring sweep reloads each of its models with."""
        if self.kind is SweepKind.BATCHING_OFF:
            c.ClearField("dynamic_batching")
        elif self.kind is SweepKind.DELAY:
            c.dynamic_batching.max_queue_delay_microseconds = self.delay_us

    def record(self, served: dict[str, Any], model: str, rows: list, other_name: Optional[str] = None) -> None:
        """One model's rows, where this sweep's kind keeps them in results["served"]."""
        if self.kind is SweepKind.MODELS:
            served["models"][model]["rows"] = rows
        elif self.kind is SweepKind.BATCHING_OFF:
            served["batching_off"][model] = {"rows": rows}
        elif self.kind is SweepKind.DELAY:
            served["delays"].setdefault(model, {})[str(self.delay_us)] = {"rows": rows}
        else:
            served["cross_check"] = {"load_generator": other_name, "model": model, "rows": rows}

    def windows(self) -> int:
        """The windows it plans: three a cell (more where a level needs them to settle)."""
        return LAST * len(self.models) * len(self.levels)


@dataclass
class ServedPlan:
    """The served part's plan, known before anything is timed: the models it sweeps, whether the server is
    embedded (only then are models reloaded with other configs), whether the no-op model is timed, the raw entry
    timed with the export's held-out files, and the sweeps in the order they run. ``error``: the server at --url
    could not be asked what it serves; the served part raises it."""

    models: list[str]
    embedded: bool
    noop: bool
    error: Optional[TorchshipError] = None
    entry: Optional[str] = None
    entry_kind: Optional[str] = None  # "image" or "text": a text entry's sweep is followed by its token tensors'
    sweeps: list[Sweep] = field(default_factory=list)

    def windows(self) -> int:
        """The windows of every sweep: the progress bar's total, grown as a level needs more."""
        return sum(
            s.windows() * (2 if s.kind is SweepKind.ENTRY and self.entry_kind == "text" else 1) for s in self.sweeps
        )

    left_out: list[str] = field(default_factory=list)  # the sweeps the settings leave out, in words

    def as_json(self) -> dict[str, Any]:
        """The plan as results.json keeps it: the sweeps, each with its kind in words, and what it leaves out."""
        return {
            "sweeps": [{**asdict(s), "kind": str(s.kind), "what": s.kind.what} for s in self.sweeps],
            "left_out": self.left_out,
        }


def plan_sweeps(cfg: BenchConfig, manifest: dict, served: ServedPlan, cross_check: bool) -> list[Sweep]:
    """The sweeps bench_served runs, in order: the sweep, the raw entry with the held-out files, then on the
    embedded server (which reloads models with changed configs) batching off and each other queue delay, the
    no-op model, and the cross-check on the ONNX model where one is served."""
    levels, models = tuple(cfg.concurrency), served.models
    plan = [Sweep(SweepKind.MODELS, tuple(models), levels)] if models else []
    plan += [Sweep(SweepKind.ENTRY, (served.entry,), levels)] if served.entry else []
    if served.embedded:
        compared = tuple(m for m in models if format_of(m, manifest) in cfg.batching_compare)
        plan += [Sweep(SweepKind.BATCHING_OFF, compared, levels)] if compared else []
        plan += [Sweep(SweepKind.DELAY, tuple(models), levels, d) for d in cfg.queue_delays_us] if models else []
    if served.noop:  # a ceiling, read as rough: its top level moved 25-40 % window to window on 2 cores
        plan.append(
            Sweep(SweepKind.NOOP, (NOOP_MODEL,), noop_levels(cfg), max_windows=min(cfg.max_windows, NOOP_WINDOWS))
        )
    if cross_check and models:
        model = sorted(models, key=lambda m: not m.endswith("_onnx"))[0]
        plan.append(Sweep(SweepKind.CROSS_CHECK, (model,), noop_levels(cfg)))
    return plan


NOOP_WINDOWS = LAST  # the no-op model's windows: the server and the client alone fill the cores, and never settle


def left_out(cfg: BenchConfig, served: ServedPlan, cross_check: bool) -> list[str]:
    """What the settings leave out that torchship bench measures by default, in words with the setting's name."""
    out = []
    if served.embedded and not cfg.batching_compare:
        out.append("dynamic batching off (batching_compare)")
    if not cfg.noop:
        out.append("the no-op round trip (noop)")
    if not cfg.raw_entry:
        out.append("the raw entry (raw_entry)")
    if not cfg.cross_check:
        out.append("the other load generator's cross-check (cross_check)")
    elif not cross_check:
        out.append("the other load generator's cross-check (perf_analyzer is not installed)")
    return out


def noop_levels(cfg: BenchConfig) -> tuple[int, ...]:
    """Concurrency 1 and the highest level: the no-op model's round trip and the most it carries, and the
    cross-check's two points."""
    return tuple(sorted({1, max(cfg.concurrency)}))
