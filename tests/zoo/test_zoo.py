"""The zoo at real size (``python -m pytest -m zoo``, about an hour on 2 cores): each model's realistic
weights through export, verify, repo, a real Triton, ``infer --check`` and a short bench, as
``python -m tests.zoo.run`` runs them. The default run keeps the fast slice in test_faults.py."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cli
from tests.zoo import models as zoo
from tests.zoo.run import run_model

pytestmark = pytest.mark.zoo


@pytest.mark.parametrize("name", [e.name for e in zoo.ZOO])
def test_a_zoo_model_passes_every_format_that_can_export_it_and_is_served(name, tmp_path):
    entry = zoo.BY_NAME[name]
    if entry.needs:
        pytest.importorskip(entry.needs)
    rec = run_model(entry, tmp_path)
    assert not rec.get("error"), rec["error"]
    assert rec["reference"]["rule"] == "fp64", rec["reference"]
    for fmt, f in rec["formats"].items():
        assert f["pass"] or (not f["exported"] and f["reason"]), (fmt, f["reason"])
    assert rec["served"]["check"]["code"] == 0 and rec["served"]["bench"]["code"] == 0, rec["served"]
    buckets = rec["formats"].get("aoti_buckets")
    if buckets and buckets["exported"]:
        assert buckets["bytes"] < 1.2 * rec["weights_bytes"] + (8 << 20), (buckets["bytes"], rec["weights_bytes"])


def test_vit_b_16_as_torchvision_initializes_it_is_refused_as_degenerate(tmp_path, capsys):
    """Its head starts at zero: every input gives the same logits, so no artifact could fail."""
    torch.save(zoo.torchvision_model("vit_b_16").state_dict(), tmp_path / "w.pt")
    assert (
        run_cli(
            "export",
            "--model",
            "tests.zoo.models:torchvision_model",
            "--model-arg",
            'arch="vit_b_16"',
            "--weights",
            tmp_path / "w.pt",
            *zoo.IMAGE,
            "--max-batch",
            "2",
            "--odd-batch",
            "1",
            "--formats",
            "onnx",
            "--out",
            tmp_path / "e",
        )
        == 3
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is the same for every reference input" in err[0], err
    assert not (tmp_path / "e").exists()
