"""The traced graph holds at every batch size: a model that loops over its batch in Python is traced per picture
where it has the top-K form, and refused in one line otherwise; a batch-free model is traced as it is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchship.errors import ArtifactError
from torchship.export.tracing import trace


class PerRow(nn.Module):
    """Four outputs computed one picture at a time in a Python loop, with a data-dependent count: what a wrapper
    around torchvision's postprocessing does."""

    def forward(self, images):
        rows = []
        for x in images:
            kept = x.flatten()[x.flatten() > 0.5][:5]
            rows.append(nn.functional.pad(kept, (0, 5 - kept.shape[0])))
        scores = torch.stack(rows)
        return scores[..., None].repeat(1, 1, 4), scores, (scores > 0).long(), (scores > 0).sum(1)


class Batched(nn.Module):
    def forward(self, images):
        return images.mean((2, 3))


class LoopedLogits(nn.Module):
    def forward(self, images):
        return torch.stack([x.mean((1, 2)) for x in images])


def test_a_model_that_loops_over_its_pictures_is_traced_per_picture():
    ex = (torch.rand(2, 3, 4, 4),)
    graph, per_picture = trace(PerRow(), ex)
    assert per_picture
    x = torch.rand(5, 3, 4, 4)
    x[2] = 0  # nothing above the threshold: its row all padding, between full ones
    for got, want in zip(graph(x), PerRow()(x)):
        assert torch.equal(got, want)
    plain = torch.jit.trace(PerRow(), ex, check_trace=False)  # the fault it mends: a plain trace holds at 2 only
    with pytest.raises(RuntimeError, match="Expected 2 elements"):
        plain(x)


def test_a_batched_model_is_traced_as_it_is_and_any_other_loop_refused():
    graph, per_picture = trace(Batched(), (torch.rand(2, 3, 4, 4),))
    assert not per_picture and graph(torch.rand(3, 3, 4, 4)).shape == (3, 3)
    with pytest.raises(ArtifactError, match="fixed at the example's batch size of 2"):
        trace(LoopedLogits(), (torch.rand(2, 3, 4, 4),))


@pytest.mark.parametrize("told", [False, True], ids=["capture-fails", "told-it-loops"])
def test_a_model_that_loops_over_its_pictures_gets_onnx_from_the_per_picture_trace(told, tmp_path):
    """Whether torch.export is tried (its exporter captures the loop at the example's batch size alone: refused),
    or skipped because the TorchScript export found the loop first (the pipeline passes per_picture), the ONNX file
    comes from the TorchScript-based exporter, runs at every batch size as eager does, and says why it was made
    so."""
    import onnxruntime as ort

    from torchship.export.exporters import PER_PICTURE_WHY, onnx
    from torchship.signature import Signature, TensorSpec

    outs = [TensorSpec("boxes", "float32", ["B", 5, 4]), TensorSpec("scores", "float32", ["B", 5]),
            TensorSpec("labels", "int64", ["B", 5]), TensorSpec("count", "int64", ["B"])]  # fmt: skip
    sig = Signature([TensorSpec("images", "float32", ["B", 3, 4, 4])], outs)
    path = tmp_path / "model.onnx"
    with torch.no_grad():
        extra = onnx(PerRow(), (torch.rand(2, 3, 4, 4),), path, sig, 8, None, per_picture=told)
    assert extra["exporter"] == "torchscript" and extra["per_picture"]
    why = extra["exporter_why"]
    assert why.endswith(PER_PICTURE_WHY if told else "the batch size as a number)"), why
    assert extra["batch_dim_param"]
    x = torch.rand(5, 3, 4, 4)
    x[2] = 0
    got = ort.InferenceSession(str(path)).run(None, {"images": x.numpy()})
    for g, want in zip(got, PerRow()(x)):
        assert (g == want.numpy()).all()


def test_one_models_torchscript_and_onnx_exports_trace_it_once_and_each_runs_as_eager(tmp_path, monkeypatch):
    """The TorchScript export and then the TorchScript-based ONNX export of one model on one example share its
    trace (for a model that loops per picture: the batch trace, the one-picture trace and the run between, seconds
    for a detector); each file still answers as eager at another batch size. Other example tensors trace anew."""
    import onnxruntime as ort

    from torchship.export import exporters
    from torchship.signature import Signature, TensorSpec

    calls = []
    real = torch.jit.trace
    monkeypatch.setattr(torch.jit, "trace", lambda *a, **k: calls.append(1) or real(*a, **k))
    outs = [TensorSpec("boxes", "float32", ["B", 5, 4]), TensorSpec("scores", "float32", ["B", 5]),
            TensorSpec("labels", "int64", ["B", 5]), TensorSpec("count", "int64", ["B"])]  # fmt: skip
    sig = Signature([TensorSpec("images", "float32", ["B", 3, 4, 4])], outs)
    model, ex = PerRow(), (torch.rand(2, 3, 4, 4),)
    with torch.no_grad():
        exporters.torchscript(model, ex, tmp_path / "model.pt")
        exporters.onnx(model, ex, tmp_path / "model.onnx", sig, 8, None, per_picture=True)
    assert len(calls) == 2, calls  # at the example's batch, then at one picture: once for both formats
    x = torch.rand(5, 3, 4, 4)
    x[2] = 0
    want = PerRow()(x)
    got_ts = torch.jit.load(str(tmp_path / "model.pt"))(x)
    got_onnx = ort.InferenceSession(str(tmp_path / "model.onnx")).run(None, {"images": x.numpy()})
    for ts, ox, w in zip(got_ts, got_onnx, want):
        assert torch.equal(ts, w) and (ox == w.numpy()).all()
    trace(model, (ex[0].clone(),))
    assert len(calls) == 4  # the same values in other tensors: traced again
