"""Bad input to a running server: each refused with the server's message while the server keeps answering,
and an altered reference refused by every reader."""

import shutil

import numpy as np
import pytest

from tests.conftest import run_cli
from tests.helpers import MODELS, in_process
from torchship.errors import ClientError
from torchship.serve.client import TritonClient


def raw_infer(url, model, name, shape, datatype, payload: bytes):
    """A hand-built gRPC request, as a hostile or buggy client could send it."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    req = service_pb2.ModelInferRequest(model_name=model)
    t = req.inputs.add(name=name, datatype=datatype)
    t.shape.extend(shape)
    req.raw_input_contents.append(payload)
    with grpc.insecure_channel(url, options=[("grpc.max_send_message_length", 1 << 30)]) as ch:
        return service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)


BAD = {
    "wrong input name": lambda c, u: c.infer(
        "tiny_cnn_onnx", np.zeros((1, 3, 32, 32), np.float32), input_name="pixels"
    ),
    "wrong dtype": lambda c, u: c.infer("tiny_cnn_onnx", np.zeros((1, 3, 32, 32), np.float64)),
    "wrong rank": lambda c, u: c.infer("tiny_cnn_onnx", np.zeros((3, 32, 32), np.float32)),
    "wrong shape": lambda c, u: c.infer("tiny_cnn_torchscript", np.zeros((1, 3, 16, 16), np.float32)),
    "batch over max_batch_size": lambda c, u: c.infer("tiny_cnn_onnx", np.zeros((9, 3, 32, 32), np.float32)),
    "unknown model": lambda c, u: c.infer("no_such_model", np.zeros((1, 3, 32, 32), np.float32)),
    "unknown version": lambda c, u: c.infer("tiny_cnn_onnx", np.zeros((1, 3, 32, 32), np.float32), version="7"),
    "NaN-filled input": lambda c, u: c.infer("tiny_cnn_aoti", np.full((1, 3, 32, 32), np.nan, np.float32)),
    "oversized message": lambda c, u: raw_infer(
        u, "tiny_cnn_onnx", "images", [1, 3, 32, 32], "FP32", b"\0" * (64 << 20)
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_gets_an_error_and_the_server_keeps_answering(server, exported, case):
    import grpc

    client = TritonClient(server.url)
    with pytest.raises((ClientError, grpc.RpcError)) as e:
        BAD[case](client, server.url)
    msg = str(e.value) if isinstance(e.value, ClientError) else e.value.details()
    assert msg and len(msg.splitlines()) <= 3, msg
    if case == "NaN-filled input":
        assert "NaN" in msg
    x = np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32)
    for model, fmt in MODELS.items():  # every model still answers correctly
        np.testing.assert_allclose(
            client.infer(model, x), in_process(exported, fmt).run({"images": x})["logits"], atol=1e-5, rtol=1e-5
        )
    assert server.proc.poll() is None


def test_one_non_finite_value_anywhere_is_refused_and_extreme_finite_ones_are_served(server, exported):
    """The backends check each request for NaN and Inf: one bad value at the first, a middle or the last
    position is enough, while the largest, smallest and subnormal finite values and -0.0 pass and are
    served like any input."""
    client = TritonClient(server.url)
    x = np.random.default_rng(3).random((1, 3, 32, 32), dtype=np.float32)
    for pos, bad in ((0, np.inf), (x.size // 2, np.nan), (x.size - 1, -np.inf), (x.size - 1, np.nan)):
        y = x.copy()
        y.flat[pos] = bad
        with pytest.raises(ClientError, match="NaN or Inf"):
            client.infer("tiny_cnn_torchscript", y)
    fi = np.finfo(np.float32)
    y = x.copy()
    y.flat[:5] = [fi.max, fi.min, fi.tiny, fi.smallest_subnormal, -0.0]
    with np.errstate(over="ignore", invalid="ignore"):  # the extremes may overflow inside the model
        want = in_process(exported, "torchscript").run({"images": y})["logits"]
    np.testing.assert_allclose(client.infer("tiny_cnn_torchscript", y), want, atol=1e-5, rtol=1e-5)
    client.close()


def test_an_altered_reference_is_refused_by_every_reader(server, exported, tmp_path, capsys):
    """The reference samples decide served parity and the repository's warm-up: each reader checks them
    against the manifest's sha256, as verify does, and a cut-short file is named in one line."""
    d = tmp_path / "e"
    shutil.copytree(exported, d)
    ref = d / "reference.npz"
    ref.write_bytes(ref.read_bytes()[:1000])
    for argv in (
        ("repo", d, "--out", tmp_path / "repo"),
        ("infer", "--url", server.url, "--check", d),
        ("infer", "--url", server.url, "--heldout", d),
        ("verify", d),
    ):
        assert run_cli(*argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "reference.npz was altered or truncated" in err[0], (argv, err)
    assert not (tmp_path / "repo").exists()
