"""The house's layering: torchship/'s contract modules import no stage and not the pipeline above them;
a stage (train, export, serve) imports torchship/'s contracts and never another stage nor the pipeline; and
inside each, no module imports, however indirectly, one that imports it back: every package reads bottom-up."""

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
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return found


def top(name: str) -> str:
    return PIPELINE if name == PIPELINE or name.startswith(PIPELINE + ".") else name.split(".")[0]


def violations(owner: str, allowed: set[str], root: Path = ROOT) -> list[str]:
    files = [
        p
        for p in sorted((root / owner).rglob("*.py"))
        if owner != "torchship" or "pipeline" not in p.relative_to(root / "torchship").parts
    ]
    assert files, owner
    return [
        f"{p.relative_to(root)} imports {m}"
        for p in files
        for m in sorted(imports(p, root))
        if top(m) in {*STAGES, "torchship", PIPELINE} and top(m) not in allowed
    ]


def test_the_contracts_import_no_stage_and_not_the_pipeline():
    assert violations("torchship", {"torchship"}) == []


def test_no_stage_imports_another_stage_or_the_pipeline():
    for stage in STAGES:
        assert violations(stage, {stage, "torchship"}) == [], stage


def test_the_check_sees_an_import_that_runs_up(tmp_path):
    """Planted: a stage module importing another stage inside a function, and a contract importing the pipeline."""
    for d in ("serve/bench", "torchship/pipeline"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "serve" / "bench" / "run.py").write_text(
        "from ..client import c\ndef f():\n    from export.source import s\n"
    )
    (tmp_path / "torchship" / "manifest.py").write_text("from .io import x\nfrom .pipeline import run\n")
    (tmp_path / "torchship" / "pipeline" / "run.py").write_text("from export.pipeline import run_export\n")
    assert violations("serve", {"serve", "torchship"}, tmp_path) == [
        "serve/bench/run.py imports export.source",
        "serve/bench/run.py imports export.source.s",
    ]
    assert violations("torchship", {"torchship"}, tmp_path) == [
        "torchship/manifest.py imports torchship.pipeline",
        "torchship/manifest.py imports torchship.pipeline.run",
    ]


def module_of(name: str, root: Path) -> str | None:
    """The module file an imported name lives in (``serve.repository.build_repository`` -> ``serve.repository``)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        path = root.joinpath(*parts[:n])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts[:n])
    return None


def cycles(package: str, root: Path = ROOT) -> list[list[str]]:
    """Every import cycle among the modules of ``package`` (imports inside functions included), each as the
    modules around it; [] when the package reads bottom-up."""
    graph: dict[str, set[str]] = {}
    for p in sorted((root / package).rglob("*.py")):
        me = ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        graph[me] = {
            m
            for name in imports(p, root)
            if name.split(".")[0] == package
            for m in [module_of(name, root)]
            if m and m != me and not me.startswith(m + ".")
        }
    found, done = [], set()

    def walk(node: str, path: list[str]) -> None:
        if node in path:
            cycle = path[path.index(node) :]
            if set(cycle) not in [set(c) for c in found]:
                found.append(cycle)
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            walk(nxt, path + [node])
        done.add(node)

    for node in sorted(graph):
        walk(node, [])
    return found


def test_no_package_has_an_import_cycle():
    for package in (*STAGES, "torchship"):
        assert cycles(package) == [], package


def test_the_check_sees_a_cycle_through_an_import_inside_a_function(tmp_path):
    """Planted: a config that imports, inside a check, a module whose own imports lead back to the config."""
    (tmp_path / "serve" / "bench").mkdir(parents=True)
    (tmp_path / "serve" / "__init__.py").write_text("")
    (tmp_path / "serve" / "bench" / "__init__.py").write_text("")
    (tmp_path / "serve" / "config.py").write_text("def check():\n    from .bench.strategy import parse\n")
    (tmp_path / "serve" / "bench" / "strategy.py").write_text("from ..server import Server\n")
    (tmp_path / "serve" / "server.py").write_text("from .config import ServeConfig\n")
    (tmp_path / "serve" / "client.py").write_text("from .config import ServeConfig\n")
    assert cycles("serve", tmp_path) == [["serve.bench.strategy", "serve.server", "serve.config"]]
    (tmp_path / "serve" / "config.py").write_text("def check():\n    pass\n")
    assert cycles("serve", tmp_path) == []
