"""`torchship run` for a detector on the built-in pictures: the train stage gated on mAP@50, then export, repo,
served parity and the bench, each response under load matched by the detection rule. The run is the shared
``detector_run`` (tests/conftest.py), which the export and serving tests of the detector take apart."""

import json

import pytest

pytestmark = pytest.mark.slow  # a detector trained, exported, served and measured: about a minute and a half


def test_a_detector_runs_end_to_end_gated_on_its_map(detector_run):
    first, again = json.loads((detector_run / "outcomes.json").read_text())
    assert first["code"] == 3  # three epochs of 400 pictures: far from 99.9 %
    assert "stage train: mAP@50" in first["stderr"] and "(gate: >= 100%)" in first["stderr"], first["stderr"][-2000:]
    assert first["record"]["gates"]["train"]["pass"] is False and not first["exported"]

    d = detector_run / "run"
    assert again["code"] == 0, again["stderr"][-2000:]
    gates = again["record"]["gates"]
    assert [n for n, g in gates.items() if g["pass"]] == ["export", "check", "bench"], gates
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
