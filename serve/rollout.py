"""Roll a model version in (or back) on a running Triton without a failed request, gated on served parity.

Triton answers an unversioned request with the highest version loaded, so the new version cannot be checked
beside the live one under the model's own name without taking its traffic. It is checked under a candidate
name first (a folder in the same repository pointing at the new version); then the model is loaded with both
versions and, once both are ready, with the new one alone, so that some version is ready at every moment;
requests in flight on the old one complete."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Optional

from torchship.errors import RolloutError, ServerError, TorchshipError
from torchship.names import FORMAT_PARAMETER, format_of
from torchship.runtime import version_file_problems

from .client import TritonClient
from .entries import entries_in_front, pin
from .model_config import CONFIG, edit_configs, read_config, served_config_path, versions
from .parity import check_served
from .versions import live_version, set_live

CANDIDATE = "__candidate"  # a version is checked under <model>__candidate before it takes the model's traffic


def candidate(model: str) -> str:
    return model + CANDIDATE


def is_candidate(model: str) -> bool:
    return model.endswith(CANDIDATE)


def switch(
    url: str, repo: str | Path, model: str, target: Optional[int] = None, check: Optional[str | Path] = None, log=print
) -> dict[str, Any]:
    """Make version ``target`` (default: the highest on disk) of ``model`` the one that answers, on the server
    at ``url`` serving ``repo``: load it under a candidate name, check its served outputs against ``check``'s
    reference (an export directory) if given, then reload ``model`` with ``target`` alone and record it in the
    config. On a failure before the switch, the candidate is unloaded and removed and RolloutError raised: the
    live version never stopped. One line per step, with its time."""
    d = Path(repo) / model
    on_disk = versions(d)
    live = live_version(d)
    target = on_disk[-1] if target is None else target
    if target not in on_disk:
        raise RolloutError(f"{model}: no version {target} on disk (it has {', '.join(map(str, on_disk))})")
    if target == live:
        log(f"{model}: version {live} is already live")
        return {"model": model, "live": live, "changed": False}
    problems = version_file_problems(d / str(target))
    if problems:
        raise RolloutError(
            f"{model}: version {target} refused: " + "; ".join(problems) + f"; version {live} still serves"
        )
    steps = Steps(model, log)
    with TritonClient(url) as client:
        client.wait_ready(30)
        live_config = client.config(model)  # what the server at url loaded: the embedded stand-in's or the container's
        cdir = Path(repo) / candidate(model)
        try:
            steps.run(
                f"version {target} loaded as {cdir.name} beside live version {live}",
                lambda: load_candidate(client, d, target, live_config),
            )
            if check is not None:
                steps.run(
                    f"served parity of version {target} PASS", lambda: check_served(url, check, models=[cdir.name])
                )
        except BaseException as e:
            _drop_candidate(client, cdir.name, cdir)
            what = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
            raise RolloutError(f"{model}: version {target} refused ({what}); version {live} still serves") from None
        _drop_candidate(client, cdir.name, cdir)
        base = read_config(served_config_path(d, live_config))
        try:
            steps.run(
                f"switched to version {target}; version {live} unloaded after its requests in flight",
                lambda: both_then_one(client, model, base, live, target, lambda v: repoint(client, d, v, live_config)),
            )
        except KeyboardInterrupt:  # the server finishes the switch or not on its own: wait for one version to be left
            serving = _settle(client, model, (live, target))
            set_live(d, serving)
            repoint(client, d, serving, live_config)
            raise RolloutError(f"{model}: interrupted during the switch; version {serving} serves") from None
        except TorchshipError as e:
            raise ServerError(
                f"{model}: the switch to version {target} failed ({e}); ask the server which version is ready"
            ) from None
    set_live(d, target)
    return {"model": model, "live": target, "was": live, "changed": True, "steps": steps.seconds}


class Steps:
    """A rollout's steps, each timed and logged as one line once done."""

    def __init__(self, model: str, log) -> None:
        self.model, self.log, self.seconds = model, log, {}

    def run(self, what: str, fn) -> Any:
        t0 = time.perf_counter()
        out = fn()
        self.seconds[what] = round(time.perf_counter() - t0, 3)
        self.log(f"{self.model}: {what} ({self.seconds[what]:.2f} s)")
        return out


def load_candidate(client: TritonClient, d: Path, target: int, live_config: dict[str, Any]) -> None:
    """Load version ``target`` of the model in ``d`` as its candidate: a folder beside it pointing at that version,
    with the model's configs renamed and pinned to it, in the kind the server at hand loads (``live_config``)."""
    model = d.name
    cand = candidate(model)
    cdir = d.parent / cand
    shutil.rmtree(cdir, ignore_errors=True)
    cdir.mkdir()
    (cdir / str(target)).symlink_to(Path("..") / model / str(target), target_is_directory=True)
    for extra in ("labels.txt", "warmup"):
        if (d / extra).exists():
            (cdir / extra).symlink_to(Path("..") / model / extra)
    fmt = format_of(model, config=read_config(d / CONFIG)) or ""

    def as_candidate(c) -> None:
        c.name = cand
        c.version_policy.specific.versions[:] = [target]
        c.parameters[FORMAT_PARAMETER].string_value = fmt

    edit_configs(d, as_candidate, into=cdir)
    client.load(cand, read_config(served_config_path(cdir, live_config)))


def both_then_one(client: TritonClient, model: str, base, live: int, target: int, move_entries=None) -> None:
    """Reload ``model`` with both versions, then with ``target`` alone: never a moment without a ready version (a
    reload that changes versions keeps the old ones until the new are ready). In between, ``move_entries(target)``
    points the raw entries in front of it at ``target``."""
    base.version_policy.specific.versions[:] = sorted({live, target})
    client.load(model, base)
    if move_entries is not None:
        move_entries(target)
    base.version_policy.specific.versions[:] = [target]
    client.load(model, base)


def repoint(client: TritonClient, d: Path, version: int, live_config: dict[str, Any]) -> None:
    """The raw entries in front of the model in ``d`` made to run ``version`` of it: in their configs on disk, and
    reloaded where the server serves them, with the config of the kind it runs the model with (``live_config``).
    They name the version they run, so that a version loaded beside the live one never answers their requests
    before the switch."""
    container = served_config_path(d, live_config).name == CONFIG
    for name in entries_in_front(d.parent, d.name):
        entry = d.parent / name
        edit_configs(entry, pin(version), per_file=True)
        if client.ready(name):
            client.load(name, read_config(entry / CONFIG if container else served_config_path(entry)))


def _settle(client: TritonClient, model: str, candidates: tuple[int, int], timeout_s: float = 60.0) -> int:
    """The one version of ``candidates`` left ready once the server has finished a switch it was asked for."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = [v for v in candidates if client.ready(model, str(v))]
        if len(ready) == 1 or time.monotonic() > deadline:
            return ready[-1] if ready else candidates[0]
        time.sleep(0.1)


def _drop_candidate(client: TritonClient, cand: str, cdir: Path) -> None:
    try:
        client.unload(cand)
    except TorchshipError:
        pass
    shutil.rmtree(cdir, ignore_errors=True)


def previous(repo: str | Path, model: str) -> int:
    """The version before the live one on disk (rollback's default target)."""
    d = Path(repo) / model
    live = live_version(d)
    older = [v for v in versions(d) if v < live]
    if not older:
        raise RolloutError(f"{model}: no version older than the live {live} is on disk")
    return older[-1]
