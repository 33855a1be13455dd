"""`torchship run` for a detector on the built-in pictures: the train stage gated on mAP@50, then export, repo,
served parity and the bench, each response under load matched by the detection rule."""

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow  # a detector trained, exported, served and measured: about a minute

CONFIG = Path(__file__).with_name("detect.toml")


def test_a_detector_runs_end_to_end_gated_on_its_map(tmp_path, capsys):
    d = tmp_path / "run"
    assert run_cli("run", "--out", d, "--config", CONFIG) == 3  # two epochs of 200 pictures: far from 99.9 %
    err = capsys.readouterr().err
    assert "stage train: mAP@50" in err and "(gate: >= 100%)" in err, err[-2000:]
    record = json.loads((d / "run.json").read_text())
    assert record["gates"]["train"]["pass"] is False and not (d / "export").exists()

    assert run_cli("run", "--out", d, "--config", CONFIG, "--from", "export") == 0
    record = json.loads((d / "run.json").read_text())
    assert [n for n, g in record["gates"].items() if g["pass"]] == ["export", "check", "bench"], record["gates"]
    served = json.loads((d / "served_parity.json").read_text())
    assert sorted(served["models"]) == ["tiny_fcos_image", "tiny_fcos_torchscript"]  # the files, and the tensors
    assert served["models"]["tiny_fcos_image"]["raw"]["map"] == 1.0
    results = json.loads((d / "bench" / "results.json").read_text())
    rows = {r["concurrency"]: r for r in results["served"]["models"]["tiny_fcos_torchscript"]["rows"]}
    assert all(r["checked"] == r["sent"] > 0 and r["wrong"] == 0 and r["failed"] == 0 for r in rows.values())
    assert rows[16]["server"]["avg_batch"] > 1  # the padded top-K batches
    entry = results["served"]["entry"]  # the picture files sent as they are, each answer checked in their pixels
    assert entry["model"] == "tiny_fcos_image" and all(r["wrong"] == 0 < r["checked"] for r in entry["rows"])
    summary = (d / "summary.md").read_text()
    assert "## Detections against eager's" in summary and "| tiny_fcos_torchscript |" in summary
