"""The house's floors: torchship's contracts (``torchship.*``) import no stage and not the pipeline; a stage
(``torchship.train``, ``.export``, ``.serve``) imports the contracts and never another stage nor the pipeline;
the pipeline (``torchship.pipeline``) sits on top and drives them. Inside each package no module imports,
however indirectly, one that imports it back: every package reads bottom-up."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# each package's floor: a module imports only its own package or a lower floor
FLOORS = {"torchship": 0, "torchship.train": 1, "torchship.export": 1, "torchship.serve": 1, "torchship.pipeline": 2}


def folders(root: Path) -> dict[str, Path]:
    """Where each package of the namespace lives in the tree, as pyproject.toml's package-dir installs it."""
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {"torchship": root / "torchship", **{name: root / folder for name, folder in mapped.items()}}


def modules(root: Path) -> dict[str, Path]:
    """Every module of the namespace by its dotted name (``torchship.serve.bench.run``), from its file."""
    found = {}
    for name, folder in folders(root).items():
        for p in sorted(folder.rglob("*.py")):
            found[".".join([name, *p.relative_to(folder).with_suffix("").parts])] = p
    return found


def package_of(module: str) -> str:
    """The package of FLOORS a module belongs to: the longest that names it."""
    return max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)


def imports(module: str, path: Path) -> set[str]:
    """Every module a file imports, at any depth (functions included), relative imports resolved."""
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rpartition(".")[0]
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
    return {m for m in found if m == "torchship" or m.startswith("torchship.")}


def violations(package: str, root: Path = ROOT) -> list[str]:
    """Each import in ``package`` that runs up a floor or sideways to a package on its own floor."""
    mine = {m: p for m, p in modules(root).items() if package_of(m) == package}
    assert mine, package
    return [
        f"{m} imports {i}"
        for m, p in mine.items()
        for i in sorted(imports(m, p))
        if package_of(i) != package and FLOORS[package_of(i)] >= FLOORS[package]
    ]


def test_every_floor_imports_only_down():
    for package in FLOORS:
        assert violations(package) == [], package


def test_the_check_sees_an_import_that_runs_up(tmp_path):
    """Planted: a stage importing another stage inside a function and the pipeline, and a contract importing the
    pipeline."""
    for d in ("serve/bench", "train", "export", "torchship/pipeline"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "serve" / "bench" / "run.py").write_text(
        "from ..client import c\nfrom torchship.io import x\ndef f():\n    from torchship.export.source import s\n"
    )
    (tmp_path / "train" / "loop.py").write_text("from torchship.pipeline.run import r\n")
    (tmp_path / "torchship" / "manifest.py").write_text("from .io import x\nfrom .pipeline import run\n")
    (tmp_path / "torchship" / "pipeline" / "run.py").write_text("from torchship.export.pipeline import run_export\n")
    assert violations("torchship.serve", tmp_path) == [
        "torchship.serve.bench.run imports torchship.export.source",
        "torchship.serve.bench.run imports torchship.export.source.s",
    ]
    assert violations("torchship.train", tmp_path) == [
        "torchship.train.loop imports torchship.pipeline.run",
        "torchship.train.loop imports torchship.pipeline.run.r",
    ]
    assert violations("torchship", tmp_path) == [
        "torchship.manifest imports torchship.pipeline",
        "torchship.manifest imports torchship.pipeline.run",
    ]
    assert violations("torchship.pipeline", tmp_path) == []


def module_of(name: str, known: dict[str, Path]) -> str | None:
    """The module an imported name lives in (``torchship.serve.repository.build_repository`` ->
    ``torchship.serve.repository``)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        for candidate in (".".join(parts[:n]), ".".join(parts[:n]) + ".__init__"):
            if candidate in known:
                return candidate.removesuffix(".__init__")
    return None


def cycles(package: str, root: Path = ROOT) -> list[list[str]]:
    """Every import cycle among the modules of ``package`` (imports inside functions included), each as the
    modules around it; [] when the package reads bottom-up."""
    known = modules(root)
    graph: dict[str, set[str]] = {}
    for module, p in known.items():
        if package_of(module) != package:
            continue
        me = module.removesuffix(".__init__")
        graph[me] = {
            m
            for name in imports(module, p)
            if package_of(name) == package
            for m in [module_of(name, known)]
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
    for package in FLOORS:
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
    for d in ("torchship", "train", "export"):
        (tmp_path / d).mkdir()
    assert cycles("torchship.serve", tmp_path) == [
        ["torchship.serve.bench.strategy", "torchship.serve.server", "torchship.serve.config"]
    ]
    (tmp_path / "serve" / "config.py").write_text("def check():\n    pass\n")
    assert cycles("torchship.serve", tmp_path) == []


def test_only_torchship_installs_at_the_top():
    """The installed distribution claims one top-level name: a user's own train.py, export.py or serve/ stays
    theirs."""
    from importlib.metadata import distribution

    assert distribution("torchship").read_text("top_level.txt").split() == ["torchship"]
