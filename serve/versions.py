"""Model versions in a repository: an export added as the next version of each of its models, the live version
recorded in each config (``version_policy { specific }``), where each version came from, and old ones pruned."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from torchship.errors import ArtifactError
from torchship.runtime import PROVENANCE

from .config import RepoConfig
from .model_config import CONFIG, edit_configs, live_version, read_config, repository_models, versions
from .repository import build_repository


def live(version: int):
    """The config edit that makes ``version`` the one a (re)started server loads."""

    def edit(c) -> None:
        c.version_policy.specific.versions[:] = [version]

    return edit


def set_live(model_dir: Path, version: int) -> None:
    """Record ``version`` as the one a (re)started server loads, in config.pbtxt and embedded.pbtxt."""
    edit_configs(model_dir, live(version))


def served_tensors(model_dir: Path) -> list[tuple]:
    """What clients of a model depend on: each input's and output's name, type and dims, and the max batch."""
    c = read_config(model_dir / CONFIG)
    return [(t.name, t.data_type, tuple(t.dims)) for t in (*c.input, *c.output)] + [
        ("max_batch_size", c.max_batch_size)
    ]


def add_version(
    export_dir: str | Path, repo: str | Path, cfg: RepoConfig, keep: int = 3, new_signature: bool = False, log=print
) -> dict[str, int]:
    """Add ``export_dir`` as the next version of each of its models in ``repo`` (a model the repository lacks
    is added at version 1). The live version stays live (rollout switches); versions beyond the last ``keep``
    are removed, never the live one. A model whose tensors differ from the served ones is refused (ArtifactError)
    unless ``new_signature``. Nothing is changed in ``repo`` before every model's new version is built and
    checked. Returns {model: new version}."""
    repo = Path(repo)
    if not repo.is_dir():
        raise ArtifactError(f"--into {repo}: no such repository (build one with torchship repo EXPORT --out {repo})")
    with tempfile.TemporaryDirectory(prefix=".torchship-version-", dir=repo) as tmp:
        built = Path(tmp) / "repo"
        res = build_repository(
            export_dir,
            dataclasses.replace(
                cfg, out=str(built), overwrite=True, version=1, strategy=None, bench=None, only_winner=False
            ),
        )
        plan: dict[str, int] = {}
        for model in res["models"].values():
            dest = repo / model
            if (dest / CONFIG).exists():
                if served_tensors(dest) != served_tensors(built / model) and not new_signature:
                    raise ArtifactError(
                        f"{model}: the new version's inputs, outputs or max batch differ from the served "
                        f"ones ({_differ(served_tensors(dest), served_tensors(built / model))}); pass "
                        "--new-signature if clients are ready for it"
                    )
                plan[model] = versions(dest)[-1] + 1
            else:
                plan[model] = 1
        for model, v in plan.items():
            dest = repo / model
            if v == 1:
                set_live(built / model, 1)
                (built / model).rename(dest)
                continue
            was = live_version(dest)
            (built / model / "1").rename(dest / str(v))
            edit_configs(built / model, live(was), into=dest)  # the new build's configs, still naming the live version
            for old in versions(dest)[:-keep] if keep > 0 else []:
                if old != was:
                    shutil.rmtree(dest / str(old))
            log(f"{model}: version {v} added beside live version {was} (kept: {', '.join(map(str, versions(dest)))})")
    return plan


def _differ(old: list[tuple], new: list[tuple]) -> str:
    gone = [t[0] for t in old if t not in new]
    return (
        "served "
        + ", ".join(str(t) for t in old if t[0] in gone)
        + "; new "
        + ", ".join(str(t) for t in new if t[0] in gone or t not in old)
    )


def history(repo: str | Path) -> list[dict[str, Any]]:
    """Every model's versions on disk, which one is live, and where each came from."""
    repo = Path(repo)
    rows = []
    for model in repository_models(repo):
        d = repo / model
        live = live_version(d)
        for v in versions(d):
            p = d / str(v) / PROVENANCE
            rows.append(
                {"model": model, "version": v, "live": v == live, **(json.loads(p.read_text()) if p.exists() else {})}
            )
    return rows
