"""Strict float32 on CUDA: the TF32 settings are forced off for the reference, eager and every artifact, and an
artifact compiled with TF32 allowed is held to a TF32 bound of its own, reported beside the strict one. The CUDA
branch is forced here on a CPU: the settings are process-wide switches that need no GPU."""

import numpy as np
import pytest
import torch

from tests.helpers import copy_export
from torchship import parity, runtime
from torchship.errors import ParityError
from torchship.manifest import read_manifest, write_manifest


def tf32_settings():
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def test_the_cuda_branch_sets_strict_float32_and_restores_the_settings():
    before = tf32_settings()
    assert before == (False, True)  # torch's defaults: convolutions on CUDA run in TF32
    with runtime.fp32_precision("cuda:0"):
        assert tf32_settings() == (False, False)
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"  # what Inductor reads for its matmuls
    assert tf32_settings() == before
    with runtime.fp32_precision("cuda", tf32=True):
        assert tf32_settings() == (True, True) and torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert tf32_settings() == before
    with runtime.fp32_precision("cpu"):  # a CPU has no TF32: nothing is touched
        assert tf32_settings() == before
    with pytest.raises(RuntimeError), runtime.fp32_precision("cuda"):
        raise RuntimeError("restored even when the block fails")
    assert tf32_settings() == before
    assert runtime.ort_cuda_options("cuda:1") == {"device_id": 1, "use_tf32": "0"}
    assert runtime.ort_cuda_options("cuda", tf32=True)["use_tf32"] == "1"


def test_a_tf32_bound_is_derived_beside_the_strict_one():
    rng = np.random.default_rng(0)
    ref = {"y": [rng.standard_normal((8, 4))]}
    strict = parity.derive(ref, {"y": [(ref["y"][0] + 1e-6).astype(np.float32)]}, "float32", fp64=True)
    fast = parity.derive(ref, {"y": [(ref["y"][0] + 1e-3).astype(np.float32)]}, "float32", fp64=True)
    tol = parity.with_tf32(strict, fast)
    assert parity.bound(tol, "y")["atol"] == strict["outputs"]["y"]["atol"] and "tf32" not in strict["outputs"]["y"]
    assert parity.bound(tol, "y", tf32=True)["atol"] == pytest.approx(fast["outputs"]["y"]["atol"])
    assert parity.bound(strict, "y", tf32=True) == strict["outputs"]["y"]  # none derived: the strict bound


@pytest.mark.slow
def test_an_artifact_compiled_with_tf32_is_held_to_its_tf32_bound_and_reported(exported, tmp_path):
    """Planted: a strict bound no artifact can meet, a TF32 bound of the recorded size, and aoti_buckets marked
    as compiled with TF32. It passes on its TF32 bound, with the strict bound beside it; onnx, strict, fails."""
    from torchship.export.verify import verify_export

    d = copy_export(exported, tmp_path)
    m = read_manifest(d)
    for o, t in m["tolerances"]["outputs"].items():
        m["tolerances"]["outputs"][o] = {**t, "atol": 1e-12, "tf32": {"atol": t["atol"], "rtol": 0.0}}
    next(a for a in m["artifacts"] if a["format"] == "aoti_buckets")["tf32"] = True
    write_manifest(d, m)
    with pytest.raises(ParityError) as e:
        verify_export(d, only=["aoti_buckets", "onnx"])
    assert "onnx: random_b1 output 'logits'" in str(e.value) and "aoti_buckets:" not in str(e.value)
    entry = read_manifest(d)["verification"]["artifacts"]["aoti_buckets"]
    assert entry["pass"] and entry["tf32"] and all(r["strict_bound"] == 1e-12 for r in entry["sets"].values())
    assert "`aoti_buckets` was compiled with TF32 allowed (--tf32)" in (d / "parity.md").read_text()


def test_tf32_is_refused_where_it_means_nothing():
    from torchship.config import build
    from torchship.errors import ConfigError
    from torchship.export.config import ExportConfig

    with pytest.raises(ConfigError, match="--tf32 applies to float32 on CUDA"):
        build(ExportConfig, {"checkpoint": "x", "tf32": True, "device": "cpu"})


def test_a_torchscript_file_computes_ieee_float32_on_a_gpu_whatever_tf32_was_at_export(tmp_path):
    """Tracing records cuDNN's TF32 switch as the last argument of each aten::_convolution. Exported under
    torch's default (TF32 allowed), the file would compute in TF32 on any GPU, past the strict float32 bound
    it is verified against, whatever the serving process sets."""
    from torchship.export import exporters

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 1)).eval()
    with runtime.tf32_allowed(True):  # torch's default on CUDA, set on any machine
        exporters.torchscript(model, (torch.rand(2, 3, 8, 8),), tmp_path / "model.pt")
        assert tf32_settings() == (True, True), "the exporter must put back the settings it found"
    graph = torch.jit.load(str(tmp_path / "model.pt")).graph
    convs = [n for n in graph.nodes() if n.kind() == "aten::_convolution"]
    assert len(convs) == 2
    assert [list(n.inputs())[-1].toIValue() for n in convs] == [False, False]
