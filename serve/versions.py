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
from torchship.io import atomic_write_text

from .config import RepoConfig
from .repository import EMBEDDED_CONFIG, PROVENANCE, build_repository, config_text, read_config, repository_models

def versions(model_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def live_version(model_dir: Path) -> int:
    """The version unversioned requests reach: the highest the config's version policy names, else the highest on disk."""
    c = read_config(model_dir / "config.pbtxt")
    on_disk = versions(model_dir)
    if c.version_policy.WhichOneof("policy_choice") == "specific" and c.version_policy.specific.versions:
        return max(c.version_policy.specific.versions)
    return on_disk[-1]


def set_live(model_dir: Path, version: int) -> None:
    """Record ``version`` as the one a (re)started server loads, in config.pbtxt and embedded.pbtxt."""
    for name in ("config.pbtxt", EMBEDDED_CONFIG):
        p = model_dir / name
        if p.exists():
            c = read_config(p)
            c.version_policy.specific.versions[:] = [version]
            atomic_write_text(p, config_text(c))


def signature(model_dir: Path) -> list[tuple]:
    c = read_config(model_dir / "config.pbtxt")
    return [(t.name, t.data_type, tuple(t.dims)) for t in (*c.input, *c.output)] + [("max_batch_size", c.max_batch_size)]


def add_version(export_dir: str | Path, repo: str | Path, cfg: RepoConfig, keep: int = 3, new_signature: bool = False,
                log=print) -> dict[str, int]:
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
        res = build_repository(export_dir, dataclasses.replace(cfg, out=str(built), overwrite=True, version=1,
                                                               strategy=None, bench=None, only_winner=False))
        plan: dict[str, int] = {}
        for model in res["models"].values():
            dest = repo / model
            if (dest / "config.pbtxt").exists():
                if signature(dest) != signature(built / model) and not new_signature:
                    raise ArtifactError(f"{model}: the new version's inputs, outputs or max batch differ from the served "
                                        f"ones ({_differ(signature(dest), signature(built / model))}); pass --new-signature "
                                        "if clients are ready for it")
                plan[model] = versions(dest)[-1] + 1
            else:
                plan[model] = 1
        for model, v in plan.items():
            dest = repo / model
            if v == 1:
                set_live(built / model, 1)
                (built / model).rename(dest)
                continue
            live = live_version(dest)
            (built / model / "1").rename(dest / str(v))
            for name in ("config.pbtxt", EMBEDDED_CONFIG):  # the new build's configs, still naming the live version
                if (built / model / name).exists():
                    shutil.copy2(built / model / name, dest / name)
            set_live(dest, live)
            for old in versions(dest)[:-keep] if keep > 0 else []:
                if old != live:
                    shutil.rmtree(dest / str(old))
            log(f"{model}: version {v} added beside live version {live} (kept: {', '.join(map(str, versions(dest)))})")
    return plan


def _differ(old: list[tuple], new: list[tuple]) -> str:
    gone = [t[0] for t in old if t not in new]
    return "served " + ", ".join(str(t) for t in old if t[0] in gone) + "; new " + \
        ", ".join(str(t) for t in new if t[0] in gone or t not in old)


def history(repo: str | Path) -> list[dict[str, Any]]:
    """Every model's versions on disk, which one is live, and where each came from."""
    repo = Path(repo)
    rows = []
    for model in repository_models(repo):
        d = repo / model
        live = live_version(d)
        for v in versions(d):
            p = d / str(v) / PROVENANCE
            rows.append({"model": model, "version": v, "live": v == live,
                         **(json.loads(p.read_text()) if p.exists() else {})})
    return rows
