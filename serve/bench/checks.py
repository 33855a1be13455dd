"""Served outputs checked under load: the bench's requests are known inputs (the export's reference set), so
each response that comes back while a level is measured can be held to the model's bound, the way `infer
--check` holds an idle server's. Dynamic batching, padding to a bucket and concurrency are where a wrong
answer hides; one wrong response fails the bench."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from torchship import detection_parity, parity
from torchship.errors import ParityError
from torchship.manifest import artifact_of, gate_row, runs_tf32
from torchship.names import format_of
from torchship.tasks import task_of

from ..client import decode_all

KEEP_BYTES = 64 << 20  # output bytes of responses one window keeps for checking; past it the rest go unchecked


@dataclass
class ResponseCheck:
    """How one model's responses are judged. ``expected[o][i]`` is the answer to row ``i % rows`` of the
    bench's requests; within ``bounds[o]`` (atol, rtol) of it, or, with ``min_sqnr_db``, at least that SQNR
    against it (a quantized model, compared with its own answers on the idle server)."""

    model: str
    expected: dict[str, np.ndarray]
    against: str  # in words: "the reference", or "its own answers on the idle server"
    bounds: dict[str, dict[str, float]] = field(default_factory=dict)
    min_sqnr_db: Optional[float] = None
    names: dict[str, str] = field(default_factory=dict)  # served output name -> the manifest's, where they differ
    rule: Optional[dict[str, Any]] = None  # a task's matching rule (a detector's: detections matched by label and IoU)

    def judge(self, i: int, response) -> Optional[str]:
        """Why the response to request ``i`` is wrong, or None."""
        got = {self.names.get(k, k): v for k, v in decode_all(response).items()}
        rows = len(next(iter(self.expected.values())))
        if self.rule is not None:
            want = {o: v[i % rows][None] for o, v in self.expected.items()}
            tol, det = self.rule["tolerances"], self.rule["rule"]
            _, failures = detection_parity.check_set(got, want, tol, det, "the response", 1, real=False)
            return failures[0] if failures else None
        for o, want in self.expected.items():
            g = got.get(o)
            w = want[i % rows][None]
            if g is None or g.shape != w.shape:
                return f"output {o!r} " + (
                    "missing" if g is None else f"has shape {list(g.shape)}, expected {list(w.shape)}"
                )
            if self.min_sqnr_db is not None:
                low = parity.sqnr_failures({o: g}, {o: w}, [o], self.min_sqnr_db, "", self.against)
                if low:
                    return low[0].lstrip()
                continue
            b = self.bounds[o]
            verdict = parity.compare(g, w, b["atol"], b.get("rtol", 0.0))
            if not verdict["pass"]:
                return (
                    f"output {o!r} max abs error {verdict['max_abs']:.3g} against {self.against}, "
                    f"beyond {b['atol']:.3g}"
                )
        return None


def tally(check: Optional[ResponseCheck], kept: list[tuple[int, Any]], into: dict[str, Any]) -> None:
    """Judge the responses one window kept ((request index, response)); add to ``into``'s "checked" and "wrong"
    counts and keep the first wrong one's message."""
    if check is None:
        return
    into["checked"] = into.get("checked", 0) + len(kept)
    for i, response in kept:
        why = check.judge(i, response)
        if why:
            into["wrong"] = into.get("wrong", 0) + 1
            into.setdefault("first_wrong", f"request {i}: {why}")
    into.setdefault("wrong", 0)


def keeper(limit: int = KEEP_BYTES):
    """(keep(i, response), kept): a callable the load generators call per successful response, and the list it
    fills until ``limit`` bytes of outputs are held."""
    kept: list[tuple[int, Any]] = []
    held = [0]

    def keep(i: int, response) -> None:
        if held[0] < limit:
            kept.append((i, response))
            held[0] += sum(len(b) for b in response.raw_output_contents)

    return keep, kept


def response_check(
    client,
    model: str,
    manifest: dict[str, Any],
    fmt: Optional[str],
    expected: Optional[dict[str, np.ndarray]],
    singles: list[dict[str, np.ndarray]],
    rows: int,
    tol: Optional[dict[str, Any]] = None,
) -> ResponseCheck:
    """The check of ``model``'s responses. An fp32 model is held to the bound its export recorded (its TF32
    bound where it was compiled so) against the reference outputs of the bench's inputs (``expected``, by
    output). A quantized model, whose error against eager is quantization and varies by sample, is held to its
    own answers on the idle server: each distinct request sent alone before the sweep, then at least the INT8
    gate's SQNR under load. ``singles`` are the bench's requests, request ``i`` being row ``i % rows`` of the
    pool they were drawn from. Where the bench's inputs have no reference (--shape at a size no reference set has),
    an fp32 model too is held to its idle answers, within twice its bound (two runs each within it). A detector's
    responses are matched to the expected detections by label and IoU (torchship.detection_parity), as infer
    --check matches them. ``tol``: the bounds, where they differ from the manifest's (an image entry's answers in
    each picture's own pixels)."""
    art = artifact_of(manifest, fmt) or {}
    tf32 = runs_tf32(manifest, fmt)
    outputs = [o["name"] for o in manifest["outputs"]]
    tol = tol or manifest["tolerances"]
    task = task_of(manifest)
    names = {w: m for m, w in client.wire_names(model).items()}
    if not art.get("gate") and expected is not None:
        rule = task.response_rule(manifest, tol)  # a detector's: matched by label and IoU, as infer --check does
        if rule is not None:
            return ResponseCheck(model, {o: expected[o] for o in outputs}, "the reference", names=names, rule=rule)
        bounds = {o: parity.bound(tol, o, tf32) for o in outputs}
        return ResponseCheck(model, {o: expected[o] for o in outputs}, "the reference", bounds, names=names)
    idle = [client.infer_all(model, singles[i]) for i in range(min(rows, len(singles)))]
    own = {o: np.concatenate([r[o] for r in idle]) for o in outputs}
    against = "its own answers on the idle server"
    if art.get("gate"):
        rule = task.reduced_response_rule(manifest, gate_row(manifest, art))  # a detector's: matched, as verified
        if rule is not None:
            return ResponseCheck(model, own, against, names=names, rule=rule)
        return ResponseCheck(model, own, against, names=names, min_sqnr_db=parity.sqnr_floor(art["gate"]))
    doubled = {o: {**b, "atol": 2 * b["atol"]} for o, b in tol["outputs"].items()}
    rule = task.response_rule(manifest, {**tol, "outputs": doubled})  # two runs, each within the bounds of the
    if rule is not None:  # reference: twice the bounds apart
        return ResponseCheck(model, own, against, names=names, rule=rule)
    bounds = {o: {k: 2 * v for k, v in parity.bound(tol, o, tf32).items() if k in ("atol", "rtol")} for o in outputs}
    return ResponseCheck(model, own, against, bounds, names=names)


def check_of(client, model: str, inputs) -> ResponseCheck:
    """response_check of a served ``model`` sent the bench's batch-1 requests (``inputs``, a BenchInputs:
    ``inputs.singles``), in the format its served config says it runs."""
    manifest = inputs.manifest
    fmt = format_of(model, manifest, client.config(model))
    return response_check(client, model, manifest, fmt, inputs.expected, inputs.singles, inputs.rows)


def checked_text(r: dict[str, Any]) -> str:
    """A level's checked responses, with the wrong ones called out."""
    if "checked" not in r:
        return "-"
    return f"{r['checked']}" + (f", **{r['wrong']} WRONG**" if r.get("wrong") else ", 0 wrong")


def wrong_in(served: dict[str, Any]) -> Optional[ParityError]:
    """A ParityError naming each model and level (and sweep: batching off, another queue delay) where a checked
    response was wrong, or None."""
    sweeps = [("", m, mm["rows"]) for m, mm in served.get("models", {}).items() if "rows" in mm]
    sweeps += [(" with batching off", m, mm["rows"]) for m, mm in served.get("batching_off", {}).items()]
    sweeps += [
        (f" at a queue delay of {d} us", m, dd["rows"])
        for m, by in served.get("delays", {}).items()
        for d, dd in by.items()
    ]
    entry = served.get("entry", {})
    kind = entry.get("kind", "image")
    if "rows" in entry:
        sweeps.append((f" (the {kind} entry, from the held-out files)", entry["model"], entry["rows"]))
    if "tensor_rows" in entry:  # the model behind a text entry, sent the token tensors of the same texts
        sweeps.append((f" (behind the {kind} entry, its texts' token tensors)", entry["target"], entry["tensor_rows"]))
    failures = [
        f"{model} at concurrency {r['concurrency']}{how}: {r['wrong']} of {r['checked']} checked responses wrong "
        f"(first: {r.get('first_wrong')})"
        for how, model, rows in sweeps
        for r in rows
        if r.get("wrong")
    ]
    return (
        ParityError(
            failures,
            what="served outputs under load",
            hint="the same inputs pass on an idle server only "
            "if infer --check passes; batching, padding to a bucket or concurrency changed the answers",
        )
        if failures
        else None
    )
