"""The house's layering: torchship/'s contract modules import no stage and not the pipeline above them;
a stage (train, export, serve) imports torchship/'s contracts and never another stage nor the pipeline."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("train", "export", "serve")
PIPELINE = "torchship.pipeline"


def imports(path: Path, root: Path) -> set[str]:
    """Every module a file imports, at any depth (functions included), relative imports resolved."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return found


def top(name: str) -> str:
    return PIPELINE if name == PIPELINE or name.startswith(PIPELINE + ".") else name.split(".")[0]


def violations(owner: str, allowed: set[str], root: Path = ROOT) -> list[str]:
    files = [p for p in sorted((root / owner).rglob("*.py"))
             if owner != "torchship" or "pipeline" not in p.relative_to(root / "torchship").parts]
    assert files, owner
    return [f"{p.relative_to(root)} imports {m}" for p in files for m in sorted(imports(p, root))
            if top(m) in {*STAGES, "torchship", PIPELINE} and top(m) not in allowed]


def test_the_contracts_import_no_stage_and_not_the_pipeline():
    assert violations("torchship", {"torchship"}) == []


def test_no_stage_imports_another_stage_or_the_pipeline():
    for stage in STAGES:
        assert violations(stage, {stage, "torchship"}) == [], stage


def test_the_check_sees_an_import_that_runs_up(tmp_path):
    """Planted: a stage module importing another stage inside a function, and a contract importing the pipeline."""
    for d in ("serve/bench", "torchship/pipeline"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "serve" / "bench" / "run.py").write_text("from ..client import c\ndef f():\n    from export.source import s\n")
    (tmp_path / "torchship" / "manifest.py").write_text("from .io import x\nfrom .pipeline import run\n")
    (tmp_path / "torchship" / "pipeline" / "run.py").write_text("from export.pipeline import run_export\n")
    assert violations("serve", {"serve", "torchship"}, tmp_path) == ["serve/bench/run.py imports export.source",
                                                                   "serve/bench/run.py imports export.source.s"]
    assert violations("torchship", {"torchship"}, tmp_path) == ["torchship/manifest.py imports torchship.pipeline",
                                                               "torchship/manifest.py imports torchship.pipeline.run"]
