"""torchship installs under one name: the README's commands work from a user's project folder that holds its own
train.py, export.py and serve.py, and none of those files is imported by them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TRAP = "raise SystemExit('the user\\'s own {name} was imported')\n"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project folder: its own train.py, export.py and serve.py, each failing loudly if imported."""
    for name in ("train", "export", "serve"):
        (tmp_path / f"{name}.py").write_text(TRAP.format(name=f"{name}.py"))
    return tmp_path


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


def torchship_cmd() -> list[str]:
    return [shutil.which("torchship", path=str(Path(sys.executable).parent)) or "torchship"]


@pytest.mark.parametrize(
    "cmd",
    [
        ["--help"],
        ["train", "--help"],
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "torchship.train", "--help"],
        ["-m", "torchship.train", "--help"],
    ],
    ids=["torchship", "torchship-train", "torchrun-m", "python-m"],
)
def test_the_readme_commands_run_beside_a_users_own_files(project, cmd):
    argv = [sys.executable, *cmd] if cmd[0] == "-m" else [*torchship_cmd(), *cmd]
    r = run(argv, project)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "imported" not in r.stdout + r.stderr
    assert "usage:" in r.stdout


def test_the_trap_is_sprung_by_a_generic_import(project):
    """Planted: what a package named ``train`` at the top of site-packages would do, the user's file answers."""
    r = run([sys.executable, "-c", "import train"], project)
    assert r.returncode != 0 and "the user's own train.py was imported" in r.stderr
