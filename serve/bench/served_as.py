"""What serves under the export's plain name: a per-format model's folder copied under that name, with the
settings that won, its winner.json, the raw entry in front of it and the repository README's section on it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from torchship.errors import ConfigError
from torchship.io import atomic_write_text
from torchship.names import FORMAT_PARAMETER, format_of

from ..entries import retarget
from ..model_config import edit_configs, repository_models
from ..repo_readme import readme_with_winner
from .placement import placement_edit
from .recommend import batching_edit


def copy_as(repo: Path, model: str, fmt: str, name: str, edits=(), files: dict[str, str] | None = None) -> Path:
    """``repo/name``: a copy of ``model``'s folder, its configs named ``name``, recording the format it serves
    (``fmt``) and given ``edits``, with ``files`` ({file name: text}) beside them; written beside the others and
    renamed into place. Returns the folder."""
    src = repo / model
    if not (src / "config.pbtxt").exists():
        raise ConfigError(f"{repo} does not serve {model}, the winner (it has {', '.join(repository_models(repo))})")
    staging = repo / f".{name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(src, staging, symlinks=True)

    def as_named(c) -> None:
        c.name = name
        c.parameters[FORMAT_PARAMETER].string_value = fmt
        for edit in edits:
            edit(c)

    edit_configs(src, as_named, into=staging)
    for file, text in (files or {}).items():
        (staging / file).write_text(text)
    dest = repo / name
    if dest.exists():
        shutil.rmtree(dest)
    staging.rename(dest)
    return dest


def serve_winner(repo: str | Path, winner: dict[str, Any], manifest: dict[str, Any], only_winner: bool = False) -> Path:
    """Add the winner to ``repo`` as the model ``<export name>`` (copy_as), set to the batching and the instances x
    threads that won, with its winner.json; the raw entry, where there is one, in front of it, and the README's
    section on it. ``only_winner`` removes the per-format models. Returns the new model's folder."""
    repo = Path(repo)
    edits = [batching_edit(winner["batching"])] if winner.get("batching") else []
    if (winner.get("placement") or {}).get("grid"):  # searched here: the placement it chose (else the repository's)
        edits.append(placement_edit(winner["instances"], winner["threads"]))
    name = manifest["name"]
    dest = copy_as(repo, winner["model"], winner["format"], name, edits, {"winner.json": json.dumps(winner, indent=2)})
    if only_winner:
        for m in repository_models(repo):
            if m != name and format_of(m, manifest):
                shutil.rmtree(repo / m)
    retarget(repo, name, name)  # the image entry, where there is one, in front of the winner
    readme = repo / "README.md"
    text = readme_with_winner(readme.read_text() if readme.exists() else "", name, winner)
    atomic_write_text(readme, text)
    return dest
