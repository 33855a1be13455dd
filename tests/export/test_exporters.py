"""The ONNX exporter's per-process work: torchlib's list of ops is read once however many models a process exports,
and each export still answers as its own model does."""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, act: nn.Module):
        super().__init__()
        self.fc, self.act = nn.Linear(6, 3), act

    def forward(self, x):
        return self.act(self.fc(x))


def test_two_onnx_exports_in_one_process_read_torchlibs_ops_once_and_each_runs_as_its_model(tmp_path, monkeypatch):
    import onnxruntime as ort
    from torch.onnx._internal.exporter import _registration

    from torchship.export import exporters
    from torchship.signature import Signature, TensorSpec

    calls = []
    real = _registration.onnxscript_apis.get_torchlib_ops  # already read once, where an earlier test exported
    monkeypatch.setattr(_registration.onnxscript_apis, "get_torchlib_ops", lambda: calls.append(1) or real())
    sig = Signature([TensorSpec("x", "float32", ["batch", 6])], [TensorSpec("y", "float32", ["batch", 3])])
    x = torch.rand(5, 6)
    for i, act in enumerate((nn.ReLU(), nn.Tanh())):
        torch.manual_seed(i)
        model = Net(act).eval()
        path = tmp_path / f"m{i}.onnx"
        with torch.no_grad():
            assert exporters.onnx(model, (torch.rand(2, 6),), path, sig, 8, None)["exporter"] == "dynamo"
            want = model(x).numpy()
        got = ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})[0]
        assert abs(got - want).max() < 1e-6
    assert len(calls) == 1, calls
