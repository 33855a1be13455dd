"""Every backend behind a real Triton server over real gRPC: each format served as it runs in-process,
the served parity check, and the dynamic batcher routing each response to its request."""

import shutil
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.conftest import run_cli
from tests.helpers import MODELS, alter_onnx_weight, in_process, rehash_version, scale
from torchship.errors import ParityError
from torchship.serve.bench.stats import served_count, settled_stats, stats_of
from torchship.serve.client import TritonClient
from torchship.serve.config import ServeConfig
from torchship.serve.embedded import TritonServer
from torchship.serve.parity import check_served


@pytest.mark.parametrize("model", sorted(MODELS))
def test_served_equals_in_process(server, exported, model):
    client = TritonClient(server.url)
    local = in_process(exported, MODELS[model])
    for n in (1, 5, 8):
        x = np.random.default_rng(n).random((n, 3, 32, 32), dtype=np.float32)
        got = client.infer(model, x)
        want = local.run({"images": x})["logits"]
        assert got.shape == (n, 10)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_served_parity_check_passes(server, exported, capsys, tmp_path):
    report = check_served(server.url, exported)
    assert report["pass"] and sorted(report["models"]) == sorted(MODELS)
    assert run_cli("infer", "--url", server.url, "--check", exported, "--model", "tiny_cnn_onnx") == 0
    assert f"served parity: PASS (1 model at {server.url})" in capsys.readouterr().out
    np.save(tmp_path / "x.npy", np.zeros((3, 32, 32), np.float32))
    for args in (["--check", exported], [tmp_path / "x.npy"]):  # a mistyped model name, with the names there are
        assert run_cli("infer", "--url", server.url, "--model", "tiny_cnn_onx", *args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1
            and f"model tiny_cnn_onx is not served at {server.url} (served: {', '.join(sorted(MODELS))}" in err[0]
        ), err


def check_each_response(inputs, outputs, reference):
    """Per-request correctness: response i must equal the reference for request i."""
    bad = [i for i, (x, y) in enumerate(zip(inputs, outputs)) if not np.allclose(y, reference(x), atol=1e-5, rtol=1e-5)]
    if bad:
        raise AssertionError(f"responses {bad} do not belong to their requests")


def send_concurrently(url, model, inputs):
    client = grpcclient.InferenceServerClient(url)
    results = [None] * len(inputs)
    done = threading.Semaphore(0)

    def cb(i):
        def f(result, error):
            results[i] = error if error else result.as_numpy("logits")
            done.release()

        return f

    for i, x in enumerate(inputs):
        inp = grpcclient.InferInput("images", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        client.async_infer(model, [inp], callback=cb(i))
    for _ in inputs:
        assert done.acquire(timeout=60)
    client.close()
    return results


def stats(url, model):
    s = TritonClient(url).statistics(model)["model_stats"][0]
    return int(s.get("inference_count", 0)), int(s.get("execution_count", 0))


@pytest.mark.parametrize("model", ["tiny_cnn_onnx", "tiny_cnn_aoti"])
def test_dynamic_batcher_merges_requests_and_routes_each_response(server, exported, model):
    local = in_process(exported, MODELS[model])
    rng = np.random.default_rng(7)
    inputs = [rng.random((1 + i % 3, 3, 32, 32), dtype=np.float32) for i in range(48)]
    inf0, exe0 = stats(server.url, model)
    booked = served_count(stats_of(TritonClient(server.url), model))
    outputs = send_concurrently(server.url, model, inputs)
    # Triton books a request when the backend releases it, which can be just after the client has its response
    settled_stats(TritonClient(server.url), model, booked + len(inputs), timeout_s=10.0)
    inf1, exe1 = stats(server.url, model)
    assert not [o for o in outputs if isinstance(o, Exception)]
    assert inf1 - inf0 == sum(len(x) for x in inputs)
    assert exe1 - exe0 < len(inputs), "the dynamic batcher merged nothing"
    check_each_response(inputs, outputs, lambda x: local.run({"images": x})["logits"])


def test_per_request_check_catches_misrouted_responses(exported):
    local = in_process(exported, "onnx")
    rng = np.random.default_rng(3)
    inputs = [rng.random((1, 3, 32, 32), dtype=np.float32) for _ in range(4)]
    outputs = [local.run({"images": x})["logits"] for x in inputs]
    check_each_response(inputs, outputs, lambda x: local.run({"images": x})["logits"])
    swapped = [outputs[1], outputs[0], *outputs[2:]]  # a batcher that mixed up two requests
    with pytest.raises(AssertionError, match=r"responses \[0, 1\]"):
        check_each_response(inputs, swapped, lambda x: local.run({"images": x})["logits"])


@pytest.mark.slow
def test_tampered_artifact_fails_served_parity(repo, exported, tmp_path, capsys):
    bad = tmp_path / "repo"
    shutil.copytree(repo, bad)
    path = bad / "tiny_cnn_onnx" / "1" / "model.onnx"
    alter_onnx_weight(path, scale(1.5, part=0.25))
    rehash_version(path.parent)
    with TritonServer(ServeConfig(repo=str(bad), models=("tiny_cnn_onnx",))) as s:
        with pytest.raises(ParityError, match="tiny_cnn_onnx"):
            check_served(s.url, exported)
        capsys.readouterr()
        assert run_cli("infer", "--url", s.url, "--check", exported) == 3
        assert "served parity" in capsys.readouterr().err
    assert not s.log_path.exists()  # a temp log goes with a clean stop
