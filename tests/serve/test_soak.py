"""The soak: one level held for a while against the real server, every response checked, memory sampled; a
planted leak in a backend process fails it, naming that process."""

import json
import shutil

import numpy as np
import pytest

from tests.conftest import run_cli
from torchship.errors import ConfigError
from torchship.serve.bench.soak import growth_per_1000, parse_duration, soak_failure
from torchship.serve.config import RepoConfig
from torchship.serve.model_config import CONFIG, config_text, read_config
from torchship.serve.repository import build_repository


def test_growth_is_the_slope_after_the_caches_fill():
    rng = np.random.default_rng(0)
    requests = np.arange(0, 20_000, 100)
    flat = 200e6 + rng.normal(0, 50e3, len(requests))  # noise of +-50 kB around a steady 200 MB
    flat[:10] -= 30e6  # the start, where arenas fill: left out
    assert abs(growth_per_1000(requests, flat)) < 8 * 1024
    leak = 200e6 + 100 * requests  # 100 bytes a request
    assert growth_per_1000(requests, leak) == pytest.approx(100e3, rel=1e-6)
    assert growth_per_1000([0, 1], [1, 2]) == 0.0  # too few samples to say


def test_durations_and_the_verdict():
    assert [parse_duration(t) for t in ("90", "90s", "2m", "0.5h")] == [90, 90, 120, 1800]
    for bad in ("", "2 minutes", "-3s", "0"):
        with pytest.raises(ConfigError, match="give a duration such as 120s, 2m or 1h"):
            parse_duration(bad)
    res = {
        "model": "m",
        "concurrency": 16,
        "duration_s": 60,
        "sent": 9000,
        "failed": 0,
        "checked": 9000,
        "wrong": 0,
        "bound_bytes_per_1000": 64 * 1024,
        "processes": {
            "tritonserver (pid 1)": {
                "growth_bytes_per_1000": 10e3,
                "within_bound": True,
                "first_bytes": 1 << 26,
                "last_bytes": 1 << 26,
            },
            "m backend (pid 2)": {
                "growth_bytes_per_1000": 1e6,
                "within_bound": False,
                "first_bytes": 1 << 27,
                "last_bytes": 1 << 28,
            },
        },
    }
    err = soak_failure(res)
    assert (
        err is not None
        and "m backend (pid 2) grew 976.6 KiB per 1000 requests (bound 64 KiB; 128 -> 256 MiB)" in str(err)
    )
    assert "tritonserver" not in str(err)
    res["processes"]["m backend (pid 2)"]["within_bound"] = True
    assert soak_failure(res) is None


LEAKY = '''
import json, os, sys
sys.path.insert(0, {backend!r})
from torchship_stub import stub_model

Base = stub_model("onnxruntime")


class TritonPythonModel(Base):
    """The real ONNX Runtime backend, keeping 32 KiB per request it answers: a planted leak."""

    def initialize(self, args):  # the python backend names this file as the model's; the stand-in loads model.onnx
        cfg = json.loads(args["model_config"])
        cfg["default_model_filename"] = "model.onnx"
        super().initialize({{**args, "model_config": json.dumps(cfg)}})

    def execute(self, requests):
        self.kept = getattr(self, "kept", [])
        self.kept += [b"x" * (32 << 10) for _ in requests]
        return super().execute(requests)
'''


def leaky_repo(exported, tmp_path):
    """The export's ONNX model served by a python-backend model.py that leaks, answering correctly."""
    from torchship.serve.embedded.wheel import backend_dir

    repo = tmp_path / "leaky"
    build_repository(exported, RepoConfig(out=str(repo), formats=("onnx",)))
    model = repo / "tiny_cnn_onnx"
    c = read_config(model / CONFIG)
    c.platform, c.backend = "", "python"
    c.ClearField("default_model_filename")  # the python backend runs 1/model.py; the stand-in reads model.onnx
    (model / CONFIG).write_text(config_text(c))
    (model / "1" / "model.py").write_text(LEAKY.format(backend=str(backend_dir() / "onnxruntime")))
    return repo


@pytest.mark.slow
def test_a_soak_checks_every_response_and_catches_a_planted_leak(exported, tmp_path, capsys):
    from torchship.serve.bench.served_as import copy_as

    out = tmp_path / "healthy"
    repo = tmp_path / "repo"
    build_repository(exported, RepoConfig(out=str(repo), formats=("onnx",)))
    copy_as(repo, "tiny_cnn_onnx", "onnx", "tiny_cnn")  # served under the export's name, as a strategy serves it
    # four seconds hold a few thousand requests, some still filling the arenas: a bound of 1 MiB per 1000 requests
    # (the default 64 KiB is for soaks of minutes) passes a healthy backend and fails one that keeps 32 KiB each
    bound = ("--soak-bound-kib", "1024")
    assert (
        run_cli(
            "bench",
            exported,
            "--repo",
            repo,
            "--soak",
            "4s",
            "--concurrency",
            "8",
            "--out",
            out,
            *bound,
            "--no-progress",
            "--load-generator",
            "python",
            "--no-cross-check",
        )
        == 0
    )
    # without --models: the model served under the export's name alone, its whole length said before it starts
    assert "soak: tiny_cnn at 8 in flight, 4 s in all" in capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())["soak"]
    assert list(res) == ["tiny_cnn"]
    res = res["tiny_cnn"]
    assert res["sent"] > 100 and res["checked"] == res["sent"] and res["wrong"] == 0 and res["failed"] == 0
    names = sorted(res["processes"])
    assert len(names) == 2 and names[0].startswith("tiny_cnn backend (pid ") and names[1].startswith("tritonserver")
    assert all(p["within_bound"] and len(p["samples"]) >= 6 for p in res["processes"].values())
    assert "## Soak" in (out / "report.md").read_text() and "in-process" not in res
    capsys.readouterr()

    leaky = leaky_repo(exported, tmp_path)
    # a repository that serves nothing under the export's name: a soak without --models is refused in one line
    assert run_cli("bench", exported, "--repo", leaky, "--soak", "4s", "--out", tmp_path / "none") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--soak without --models soaks tiny_cnn, the model served under the export" in err[0]
    assert not (tmp_path / "none").exists()  # refused before anything was measured or written
    assert (
        run_cli(
            "bench",
            exported,
            "--repo",
            leaky,
            "--models",
            "tiny_cnn_onnx",
            "--soak",
            "4s",
            "--concurrency",
            "8",
            "--out",
            tmp_path / "leak",
            *bound,
            "--no-progress",
            "--load-generator",
            "python",
            "--no-cross-check",
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "soak of tiny_cnn_onnx at 8 in flight" in err and "tiny_cnn_onnx backend (pid " in err, err
    assert "KiB per 1000 requests (bound 1024 KiB" in err and "tritonserver" not in err.split("grew")[0]
    res = json.loads((tmp_path / "leak" / "results.json").read_text())["soak"]["tiny_cnn_onnx"]
    assert res["checked"] == res["sent"] and res["wrong"] == 0  # it answered right all along: only memory failed it
    shutil.rmtree(leaky)
