"""Shared fixtures: one small trained model and its exports per test run, reused by every test that only reads
them. Under pytest-xdist (the suite runs on two workers) each is built by the first worker that needs it and
reused by the other (``once``)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_xdist_auto_num_workers(config):
    """-n auto: one worker per usable core and one more, up to 4. The suite waits on Triton servers and child
    processes about half of its time, so one extra worker keeps the cores busy."""
    return min(4, len(os.sched_getaffinity(0)) + 1)


# The files whose tests wait longest on their first fixture, handed to the workers first (each file runs on one
# worker, in this order, the rest after them in collection order): the run's end to end, which builds its own,
# then the shared exports (``exported``), training and the detector's run (``detector_run``), which later files read.
FIRST = (
    "tests/e2e/test_run.py",
    "tests/export/test_export.py",
    "tests/train/test_train.py",
    "tests/export/test_detect_export.py",
)
# Files that only read what a file in FIRST builds, handed out last: a worker that took one early would wait idle
LAST = ("tests/e2e/test_run_detect.py",)


def pytest_collection_modifyitems(config, items):
    """The files in FIRST first, those in LAST last; the zoo only when asked for by name (-m zoo): it takes about
    an hour."""
    rank = {f: i for i, f in enumerate(FIRST)} | {f: len(FIRST) + 1 + i for i, f in enumerate(LAST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(FIRST)))
    if "zoo" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="the model zoo runs with -m zoo")
    for item in items:
        if item.get_closest_marker("zoo"):
            item.add_marker(skip)


def once(tmp_path_factory, name: str, build) -> Path:
    """The folder ``build(folder)`` fills, built once per test run however many xdist workers ask for it: the
    first builds it under a file lock, the others wait and reuse it. Tests only read what it holds."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    out = root / f"once-{name}"
    with FileLock(str(out) + ".lock"):
        if not (out / ".built").exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            (out / ".built").touch()
    return out


@pytest.fixture(scope="session", autouse=True)
def helpers_kept_for_the_session():
    """The verifier's hosts and the compile fork server idle 10 minutes before they end, not IDLE_S's 2: a
    worker's exports are often minutes apart, and each new host or fork server imports torch again (2 to 6 CPU-s).
    They still end at the worker's exit, and the fork server on a change of key (folder, variables). The tests of
    their idle end set IDLE_S themselves; CLI subprocesses keep the default."""
    from torchship.export import compile as compile_
    from torchship.export import fresh

    compile_.IDLE_S = fresh.IDLE_S = 600.0
    yield


def run_cli(*argv: str) -> int:
    from torchship.pipeline.cli import main

    return main([str(a) for a in argv])


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    """A tiny CNN trained for a few epochs on the digits: the checkpoint directory."""
    from torchship.config import build
    from torchship.train.config import TrainConfig
    from torchship.train.loop import train

    def make(out):
        train(
            build(
                TrainConfig,
                {
                    "arch": "tiny_cnn",
                    "epochs": 6,
                    "lr": 3e-2,
                    "batch_size": 32,
                    "out": str(out),
                    "progress": False,
                    "seed": 0,
                    "amp": "off",
                },
            )
        )

    from torchship import checkpoint as ck

    return ck.resolve_checkpoint(once(tmp_path_factory, "trained", make), which="best")


def python() -> str:
    return sys.executable


def export_quietly(checkpoint: Path, folder: Path, settings: dict) -> None:
    """run_export of ``checkpoint`` into folder/export at max batch 8, with ``settings`` on top, saying nothing."""
    from torchship.config import build
    from torchship.export.config import ExportConfig
    from torchship.export.pipeline import run_export

    cfg = {"checkpoint": str(checkpoint), "out": str(folder / "export"), "max_batch": 8, **settings}
    run_export(build(ExportConfig, cfg), log=lambda *a: None)


@pytest.fixture(scope="session")
def exported(trained, tmp_path_factory) -> Path:
    """Every fp32 format exported (example batch 2, max batch 8, buckets 1/8) and verified."""
    from torchship.runtime import FP32_FORMATS

    settings = {"buckets": [1, 8], "odd_batch": 5, "formats": list(FP32_FORMATS)}
    return once(tmp_path_factory, "exported", lambda d: export_quietly(trained, d, settings)) / "export"


@pytest.fixture(scope="session")
def int8_export(trained, tmp_path_factory) -> Path:
    """The tiny CNN as fp32 ONNX, INT8 ONNX and INT8 AOTInductor (calibrated on its held-out samples), verified.
    The gate allows a 2-point drop: the tiny CNN (85 %) has near-ties, and one of its 64 held-out samples is 1.6
    points."""
    settings = {"formats": ["onnx", "onnx_int8", "aoti_int8"], "max_accuracy_drop": 2.0}
    return once(tmp_path_factory, "int8", lambda d: export_quietly(trained, d, settings)) / "export"


@pytest.fixture(scope="session")
def zero_calibrated(trained, tmp_path_factory) -> tuple[int, str, Path]:
    """The INT8 tests' planted fault: both INT8 formats calibrated on all-zero images, so their activation ranges
    collapse. (exit code, stderr, export directory): export writes the directory even when verification fails."""

    def make(tmp):
        zeros = tmp / "zeros.npz"
        with np.load(trained / "heldout.npz") as held:
            np.savez(zeros, images=np.zeros_like(held["images"][:32], dtype=np.float32))
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = run_cli(
                "export",
                trained,
                "--out",
                tmp / "export",
                "--formats",
                "onnx_int8",
                "aoti_int8",
                "--max-batch",
                "8",
                "--calibration",
                zeros,
            )
        (tmp / "outcome.json").write_text(json.dumps({"code": code, "stderr": err.getvalue()}))

    tmp = once(tmp_path_factory, "zeros", make)
    outcome = json.loads((tmp / "outcome.json").read_text())
    return outcome["code"], outcome["stderr"], tmp / "export"


@pytest.fixture(scope="session")
def detector_run(tmp_path_factory) -> Path:
    """`torchship run` for a detector (tests/e2e/detect.toml: tiny_fcos, 400 pictures, 3 epochs, TorchScript),
    first stopped by its mAP gate, set out of reach, then run again from export: the run folder ``run/`` (train/,
    export/, model_repository/, ...) beside ``outcomes.json``, each run's exit code, stderr, record and whether
    the export was there after it. Trained long enough for many detections on a picture, many of them overlapping
    (the NMS has work), and none on a blank one: the detector the export and serving tests take apart."""

    def make(root):
        outcomes = []
        for more in ([], ["--from", "export"]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = run_cli("run", "--out", root / "run", "--config", ROOT / "tests/e2e/detect.toml", *more)
            record = json.loads((root / "run" / "run.json").read_text())
            exported = (root / "run" / "export").exists()
            outcomes.append({"code": code, "stderr": err.getvalue(), "record": record, "exported": exported})
        (root / "outcomes.json").write_text(json.dumps(outcomes))

    return once(tmp_path_factory, "detector", make)


@pytest.fixture(scope="session")
def repo(exported, tmp_path_factory) -> Path:
    from torchship.serve.config import RepoConfig
    from torchship.serve.repository import build_repository

    out = tmp_path_factory.mktemp("repo") / "model_repository"
    # one core per model: the shared server's models serve beside the other workers' servers on the same cores, and
    # stubs of two spinning threads each took over ten seconds to stop there (tests/serve/test_placement.py covers
    # the default, every core)
    # the tensor entries alone: the image entry (a python stub more) has its own tests, test_image_entry.py
    build_repository(exported, RepoConfig(out=str(out), max_queue_delay_us=2000, cores=1, image_entry=False))
    return out


@pytest.fixture
def backend(monkeypatch):
    """serve/backends/torchship_backend.py, imported as a served backend imports it: with torchship.runtime under
    the name torchship_runtime, the copy each backend directory carries."""
    from torchship import runtime

    monkeypatch.setitem(sys.modules, "torchship_runtime", runtime)
    from torchship.serve.backends import torchship_backend

    return torchship_backend


@pytest.fixture(scope="session")
def server(repo):
    """One real embedded Triton server for the serve tests."""
    from torchship.serve.config import ServeConfig
    from torchship.serve.embedded import TritonServer

    s = TritonServer(ServeConfig(repo=str(repo)))
    s.start()
    yield s
    code = s.stop()
    # a model that never unloads is a Triton 2.51 fault that stop() ends and names (test_server_life covers it);
    # beside the other workers it has stalled this shared server's end about once in four runs, with no test's
    # answer wrong: it is reported as a warning, and any other unclean exit fails
    stalled = code == -signal.SIGKILL and "still loaded" in (s.stop_note or "")
    assert code == 0 or stalled, f"the shared server did not stop cleanly (exit code {code}):\n{s.log_tail()}"
    if stalled:
        warnings.warn(f"the shared server's unload stalled and it was ended: {s.stop_note}", stacklevel=2)
