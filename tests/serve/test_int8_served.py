"""INT8 models (ONNX Runtime and AOTInductor) served by the real Triton beside their fp32 twin: each answers
under its own name, and infer --check holds it to the accuracy gate export verification applied, catching a
badly calibrated one."""

import shutil

import numpy as np
import pytest

from tests.conftest import run_cli
from tests.helpers import rehash_version
from torchship.errors import ParityError
from torchship.serve.config import RepoConfig, ServeConfig
from torchship.serve.embedded import TritonServer
from torchship.serve.parity import check_served
from torchship.serve.repository import build_repository

pytestmark = pytest.mark.slow  # real servers, compiles or processes: the full run, not the fast tier


@pytest.fixture(scope="module")
def int8_repo(int8_export, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8repo") / "repo"
    res = build_repository(int8_export, RepoConfig(out=str(out)))
    assert res["models"] == {
        "onnx": "tiny_cnn_onnx",
        "onnx_int8": "tiny_cnn_onnx_int8",
        "aoti_int8": "tiny_cnn_aoti_int8",
    }
    return out


def test_the_int8_models_are_served_and_pass_the_gate(int8_repo, int8_export, capsys):
    with TritonServer(ServeConfig(repo=str(int8_repo))) as s:
        report = check_served(s.url, int8_export)
        for model in ("tiny_cnn_onnx_int8", "tiny_cnn_aoti_int8"):
            row = report["models"][model]["heldout"]
            assert row["accuracy_drop"] <= 2.0 and "max_abs" not in row, model
            assert run_cli("infer", "--url", s.url, "--check", int8_export, "--model", model) == 0
            assert "served parity: PASS" in capsys.readouterr().out
        assert report["pass"]


def test_a_badly_calibrated_int8_model_fails_served_parity(int8_repo, int8_export, tmp_path):
    """The planted fault: the served file swapped for one calibrated on all-zero images."""
    from torchship.export.quantize import int8_scheme, onnx_int8

    bad = tmp_path / "repo"
    shutil.copytree(int8_repo, bad)
    zeros = {"images": np.zeros((16, 3, 32, 32), np.float32)}
    onnx_int8(
        int8_export / "onnx" / "model.onnx",
        bad / "tiny_cnn_onnx_int8" / "1" / "model.onnx",
        zeros,
        "zeros",
        int8_scheme(),
        external=False,
    )
    rehash_version(bad / "tiny_cnn_onnx_int8" / "1")
    with TritonServer(ServeConfig(repo=str(bad), models=("tiny_cnn_onnx_int8",))) as s:
        with pytest.raises(ParityError, match=r"tiny_cnn_onnx_int8: heldout: accuracy .* a drop beyond 2 points"):
            check_served(s.url, int8_export)


def test_a_badly_calibrated_aoti_int8_model_fails_served_parity(int8_repo, int8_export, zero_calibrated, tmp_path):
    """The planted fault: the served package swapped for the one calibrated on all-zero images."""
    bad = tmp_path / "repo"
    shutil.copytree(int8_repo, bad)
    shutil.copy2(zero_calibrated[2] / "aoti_int8" / "model.pt2", bad / "tiny_cnn_aoti_int8" / "1" / "model.pt2")
    rehash_version(bad / "tiny_cnn_aoti_int8" / "1")
    with TritonServer(ServeConfig(repo=str(bad), models=("tiny_cnn_aoti_int8",))) as s:
        with pytest.raises(ParityError, match=r"tiny_cnn_aoti_int8: heldout: accuracy .* a drop beyond 2 points"):
            check_served(s.url, int8_export)
