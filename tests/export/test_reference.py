"""The reference and the bound: eager in float64, a bound derived from eager's own rounding, near-ties,
degenerate references refused, the float32 fallback, reduced precision, ONNX external data and the
bucket archive's shared weights."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest
import torch

from tests.conftest import run_cli
from torchship import parity
from torchship.manifest import read_manifest

MODELS = "tests.anymodel.models"
MLP_FLAGS = ["--input", "features:float32:B,20", "--max-batch", "4", "--odd-batch", "3", "--buckets", "1", "4"]


def save_weights(factory, path, **kw):
    torch.manual_seed(0)
    torch.save(factory(**kw).state_dict(), path)
    return path


def test_the_bound_comes_from_eager_rounding_and_every_artifact_is_held_to_it(exported):
    m = read_manifest(exported)
    tol = m["tolerances"]
    assert tol["rule"] == "fp64" and tol["multiple"] == parity.MULTIPLE
    out = tol["outputs"]["logits"]
    assert 0 < out["eager_error"] < 1e-4 * out["scale"]  # float32 rounding, measured, not assumed
    assert out["atol"] == pytest.approx(
        parity.MULTIPLE * out["eager_error"] + parity.FLOOR_EPS * parity.EPS["float32"] * out["scale"]
    )
    ref = np.load(exported / "reference.npz")
    assert ref["expected/random_b5/logits"].dtype == np.float64
    for name, entry in m["verification"]["artifacts"].items():
        worst, bound, multiple, _ = parity.artifact_summary(entry, tol)
        assert entry["pass"] and worst <= bound == out["atol"], name
    text = (exported / "parity.md").read_text()
    assert "Reference: eager in float64" in text and "| logits |" in text and "x eager's error" in text


def test_a_near_tie_counts_as_agreement_and_a_real_swap_does_not():
    want = np.array([[2.0, 2.0 - 1e-7, 0.0], [2.0, 1.0, 0.0]])
    tied = np.array([[1.9999, 2.0, 0.0], [2.0, 1.0, 0.0]], np.float32)  # rounding broke the tie the other way
    assert parity.top1_agreement(tied, want, 1e-6).all()
    row, failure = parity.check_output(tied, want, {"atol": 2e-4, "rtol": 0.0}, "m: heldout", 2, top1=True)
    assert failure is None and row["top1_agree"] == "2/2"
    want = np.array([[2.0, 1.5, 0.0]])
    swapped = np.array([[1.71, 1.79, 0.0]], np.float32)  # every value within 0.3, the top class 0.5 below
    assert not parity.top1_agreement(swapped, want, 0.3).any()
    row, failure = parity.check_output(swapped, want, {"atol": 0.3, "rtol": 0.0}, "m: heldout", 1, top1=True)
    assert "top-1 class differs from the reference on 1 real samples" in failure, failure


def test_a_degenerate_reference_is_refused_unless_allowed(tmp_path, capsys):
    """A zero head answers the same for every input: no artifact could fail against it."""
    from tests.anymodel.models import zero_head

    w = save_weights(zero_head, tmp_path / "w.pt")
    argv = ["export", "--model", f"{MODELS}:zero_head", "--weights", w, *MLP_FLAGS, "--formats", "exported_program"]
    assert run_cli(*argv, "--out", tmp_path / "e") == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "'output0' is the same for every reference input" in err[0] and "--allow-degenerate" in err[0]
    ), err
    assert not (tmp_path / "e").exists()
    assert run_cli(*argv, "--out", tmp_path / "e", "--allow-degenerate") == 0
    assert read_manifest(tmp_path / "e")["reference"]["degenerate"] == ["output0"]
    assert "**Blind check:**" in (tmp_path / "e" / "parity.md").read_text()


def test_atol_and_rtol_replace_the_derived_bound(tmp_path, capsys):
    from tests.anymodel.models import mlp

    w = save_weights(mlp, tmp_path / "w.pt")
    argv = ["export", "--model", f"{MODELS}:mlp", "--weights", w, *MLP_FLAGS, "--formats", "onnx"]
    assert run_cli(*argv, "--out", tmp_path / "tight", "--atol", "1e-15") == 3  # below float32 rounding itself
    assert "exceeds the bound 1e-15" in capsys.readouterr().err
    tol = read_manifest(tmp_path / "tight")["tolerances"]
    assert tol["rule"] == "given" and tol["outputs"]["output0"] == {"atol": 1e-15, "rtol": 0.0}
    assert run_cli(*argv, "--out", tmp_path / "loose", "--atol", "1e-4", "--rtol", "1e-3") == 0
    assert "as given" in (tmp_path / "loose" / "parity.md").read_text()


@pytest.mark.slow
def test_a_model_that_cannot_run_in_float64_falls_back_to_a_scale_relative_bound(tmp_path):
    from tests.anymodel.models import float32_inside

    w = save_weights(float32_inside, tmp_path / "w.pt")
    assert (
        run_cli(
            "export",
            "--model",
            f"{MODELS}:float32_inside",
            "--weights",
            w,
            *MLP_FLAGS,
            "--formats",
            "exported_program",
            "onnx",
            "--out",
            tmp_path / "e",
        )
        == 0
    )
    m = read_manifest(tmp_path / "e")
    tol = m["tolerances"]
    assert tol["rule"] == "scale" and "fails in float64" in tol["why"]
    out = tol["outputs"]["output0"]
    assert out["atol"] == pytest.approx(parity.FALLBACK_REL["float32"] * out["scale"])
    assert "Reference: eager in float32, because it fails in float64" in (tmp_path / "e" / "parity.md").read_text()


@pytest.mark.slow
def test_a_bfloat16_export_is_held_to_eager_rounding_in_bfloat16(trained, exported, tmp_path):
    out = tmp_path / "bf16"
    assert (
        run_cli(
            "export",
            trained,
            "--dtype",
            "bfloat16",
            "--formats",
            "torchscript",
            "exported_program",
            "--max-batch",
            "8",
            "--odd-batch",
            "5",
            "--out",
            out,
        )
        == 0
    )
    tol = read_manifest(out)["tolerances"]
    fp32 = read_manifest(exported)["tolerances"]["outputs"]["logits"]
    bf16 = tol["outputs"]["logits"]
    assert tol["dtype"] == "bfloat16" and bf16["eager_error"] > 100 * fp32["eager_error"]  # bfloat16 rounds far more
    assert bf16["atol"] == pytest.approx(
        parity.MULTIPLE * bf16["eager_error"] + parity.FLOOR_EPS * 2**-7 * bf16["scale"]
    )
    assert "10 x eager in bfloat16's own error" in (out / "parity.md").read_text()


@pytest.mark.slow
def test_onnx_external_data_is_hashed_verified_copied_and_served(tmp_path, monkeypatch, capsys):
    """Above protobuf's 2 GB limit ONNX keeps the weights in a file beside the graph. The limit is lowered
    here so that a small model takes that path; the zoo's 2.5 GB MLP takes it for real."""
    from tests.anymodel.models import mlp
    from torchship.errors import ArtifactError
    from torchship.export import exporters
    from torchship.serve.config import RepoConfig, ServeConfig
    from torchship.serve.embedded import TritonServer
    from torchship.serve.parity import check_served
    from torchship.serve.repository import build_repository

    monkeypatch.setattr(exporters, "ONNX_EXTERNAL_BYTES", 0)
    w = save_weights(mlp, tmp_path / "w.pt")
    d = tmp_path / "e"
    assert (
        run_cli("export", "--model", f"{MODELS}:mlp", "--weights", w, *MLP_FLAGS, "--formats", "onnx", "--out", d) == 0
    )
    (a,) = read_manifest(d)["artifacts"]
    assert a["external_data"] == ["model.onnx.data"] and set(a["files"]) == {"onnx/model.onnx", "onnx/model.onnx.data"}
    repo = tmp_path / "repo"
    build_repository(d, RepoConfig(out=str(repo)))
    assert sorted(p.name for p in (repo / "mlp_onnx" / "1").iterdir()) == [
        "model.onnx",
        "model.onnx.data",
        "provenance.json",
    ]
    with TritonServer(ServeConfig(repo=str(repo))) as server:
        assert check_served(server.url, d)["pass"]
    data = d / "onnx" / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:-8])  # the weights file alone, truncated
    with pytest.raises(ArtifactError, match="onnx/model.onnx.data was altered or truncated"):
        from torchship.export.verify import verify_export

        verify_export(d)


@pytest.mark.slow
def test_the_bucket_archive_stores_the_weights_once(tmp_path):
    """Two static-batch models, one copy of their weights: AOTInductor keeps constants out of each model's
    library, and constants equal across buckets are packaged once. The prepacked aoti package compiles first in
    the same export: its prepacking (oneDNN's own weight layout, which only a model's library can hold) must not
    reach the buckets' compile."""
    from tests.anymodel.models import mlp

    kw = {"features": 512, "hidden": 4096}  # 8.4 MB of weights, well above the models' own code
    w = save_weights(mlp, tmp_path / "w.pt", **kw)
    weights = sum(t.numel() * t.element_size() for t in torch.load(w).values())
    d = tmp_path / "e"
    assert (
        run_cli(
            "export",
            "--model",
            f"{MODELS}:mlp",
            *[a for k, v in kw.items() for a in ("--model-arg", f"{k}={v}")],
            "--weights",
            w,
            "--input",
            "features:float32:B,512",
            "--max-batch",
            "8",
            "--odd-batch",
            "5",
            "--buckets",
            "1",
            "8",
            "--formats",
            "aoti",
            "aoti_buckets",
            "--bucket-weights",
            "shared",
            "--out",
            d,
        )
        == 0
    )
    a = next(a for a in read_manifest(d)["artifacts"] if a["format"] == "aoti_buckets")
    assert a["shared_constants"] > 0 and a["buckets"] == [1, 8]
    with zipfile.ZipFile(d / a["file"]) as z:
        stored = sum(i.file_size for i in z.infolist() if "/weights/" in i.filename)
    assert weights <= stored < 1.05 * weights, (stored, weights)  # unshared, it held two copies
    assert a["bytes"] < 1.2 * weights + (4 << 20)
    v = read_manifest(d)["verification"]["artifacts"]
    assert v["aoti"]["pass"] and v["aoti_buckets"]["pass"]
    assert {row["batch"] for row in v["aoti_buckets"]["sets"].values()} == {1, 5, 8}  # bucket 8 padded the 5


def test_auto_bucket_weights_prepack_on_a_cpu_while_the_copies_stay_small():
    from torchship.export.compile import PREPACK_LIMIT, bucket_weights

    buckets = (1, 2, 4, 8, 16, 32)
    assert bucket_weights("auto", "cpu", 45 << 20, buckets)[0] == "prepacked"
    assert bucket_weights("auto", "cpu", PREPACK_LIMIT // 4, buckets)[0] == "shared"  # six copies over the limit
    assert bucket_weights("auto", "cuda", 45 << 20, buckets)[0] == "shared"
    assert bucket_weights("shared", "cpu", 45 << 20, buckets) == ("shared", "as asked")
