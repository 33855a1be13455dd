"""A real Triton server over real gRPC: parity per format, batching, bad input, shutdown, model control."""

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from serve.client import TritonClient
from serve.config import ServeConfig
from serve.embedded import TritonServer
from serve.parity import check_served
from tests.conftest import run_cli
from torchship import runtime
from torchship.errors import ClientError, ParityError, ServerError
from torchship.manifest import read_manifest

MODELS = {"tiny_cnn_onnx": "onnx", "tiny_cnn_torchscript": "torchscript", "tiny_cnn_aoti": "aoti_buckets"}


def in_process(exported, fmt):
    m = read_manifest(exported)
    a = next(a for a in m["artifacts"] if a["format"] == fmt)
    return runtime.load_artifact(str(exported), a, ["images"], ["logits"])


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


def assert_onnx_served(url, exported, x) -> None:
    """The served tiny_cnn_onnx at ``url`` answers ``x`` as ONNX Runtime does in this process."""
    np.testing.assert_allclose(TritonClient(url).infer("tiny_cnn_onnx", x),
                               in_process(exported, "onnx").run({"images": x})["logits"], atol=1e-5, rtol=1e-5)


def refused_then_served(stream, exported) -> None:
    """A wrong-shaped request on ``stream`` is refused with the server's message; the next one is served
    and equals in-process ONNX Runtime."""
    from serve.client import decode, request

    with pytest.raises(ClientError, match="unexpected shape|shape"):
        stream(request("tiny_cnn_onnx", np.zeros((1, 3, 16, 16), np.float32), "images"))
    x = np.random.default_rng(9).random((1, 3, 32, 32), dtype=np.float32)
    np.testing.assert_allclose(decode(stream(request("tiny_cnn_onnx", x, "images")), "logits"),
                               in_process(exported, "onnx").run({"images": x})["logits"], atol=1e-5, rtol=1e-5)


def test_one_stream_carries_requests_in_turn_and_survives_a_refusal(server, exported):
    """Every model over one ModelStreamInfer call answers as the unary call does, for its own request; a
    refused request raises and the stream keeps serving."""
    from serve.client import InferStream, decode, infer_channel, request

    channel, unary = infer_channel(server.url)
    stream = InferStream(channel)
    try:
        for k in range(6):
            for model in MODELS:
                x = np.random.default_rng(k).random((1 + k % 3, 3, 32, 32), dtype=np.float32)
                req = request(model, x, "images")
                np.testing.assert_array_equal(decode(stream(req), "logits"), decode(unary(req), "logits"))
        refused_then_served(stream, exported)
    finally:
        stream.close()
        channel.close()


def test_served_parity_check_passes(server, exported, capsys, tmp_path):
    report = check_served(server.url, exported)
    assert report["pass"] and sorted(report["models"]) == sorted(MODELS)
    assert run_cli("infer", "--url", server.url, "--check", exported, "--model", "tiny_cnn_onnx") == 0
    assert f"served parity: PASS (1 model at {server.url})" in capsys.readouterr().out
    np.save(tmp_path / "x.npy", np.zeros((3, 32, 32), np.float32))
    for args in (["--check", exported], [tmp_path / "x.npy"]):  # a mistyped model name, with the names there are
        assert run_cli("infer", "--url", server.url, "--model", "tiny_cnn_onx", *args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"model tiny_cnn_onx is not served at {server.url} (served: {', '.join(sorted(MODELS))}" in err[0], err


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
    outputs = send_concurrently(server.url, model, inputs)
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
    "wrong input name": lambda c, u: c.infer("tiny_cnn_onnx", np.zeros((1, 3, 32, 32), np.float32), input_name="pixels"),
    "wrong dtype": lambda c, u: c.infer("tiny_cnn_onnx", np.zeros((1, 3, 32, 32), np.float64)),
    "wrong rank": lambda c, u: c.infer("tiny_cnn_onnx", np.zeros((3, 32, 32), np.float32)),
    "wrong shape": lambda c, u: c.infer("tiny_cnn_torchscript", np.zeros((1, 3, 16, 16), np.float32)),
    "batch over max_batch_size": lambda c, u: c.infer("tiny_cnn_onnx", np.zeros((9, 3, 32, 32), np.float32)),
    "unknown model": lambda c, u: c.infer("no_such_model", np.zeros((1, 3, 32, 32), np.float32)),
    "unknown version": lambda c, u: c.infer("tiny_cnn_onnx", np.zeros((1, 3, 32, 32), np.float32), version="7"),
    "NaN-filled input": lambda c, u: c.infer("tiny_cnn_aoti", np.full((1, 3, 32, 32), np.nan, np.float32)),
    "oversized message": lambda c, u: raw_infer(u, "tiny_cnn_onnx", "images", [1, 3, 32, 32], "FP32", b"\0" * (64 << 20)),
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
        np.testing.assert_allclose(client.infer(model, x), in_process(exported, fmt).run({"images": x})["logits"],
                                   atol=1e-5, rtol=1e-5)
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


def test_explicit_model_control_unload_and_load(server, exported):
    client = TritonClient(server.url)
    client.client.unload_model("tiny_cnn_torchscript")
    deadline = time.time() + 30
    while client.client.is_model_ready("tiny_cnn_torchscript") and time.time() < deadline:
        time.sleep(0.1)
    with pytest.raises(ClientError):
        client.infer("tiny_cnn_torchscript", np.zeros((1, 3, 32, 32), np.float32))
    server.load("tiny_cnn_torchscript")
    x = np.random.default_rng(1).random((3, 3, 32, 32), dtype=np.float32)
    np.testing.assert_allclose(client.infer("tiny_cnn_torchscript", x),
                               in_process(exported, "torchscript").run({"images": x})["logits"], atol=1e-5, rtol=1e-5)


def test_sigterm_during_a_stream_loses_no_completed_response(repo, exported):
    server = TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",)))
    server.start()
    local = in_process(exported, "onnx")
    completed, errors = [], []
    stop = threading.Event()

    def stream(seed):
        c = TritonClient(server.url, timeout_s=20)
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            x = rng.random((1, 3, 32, 32), dtype=np.float32)
            try:
                completed.append((x, c.infer("tiny_cnn_onnx", x)))
            except Exception as e:  # refused once shutdown begins
                errors.append(e)
                return

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    pgid = server.proc.pid
    n_before = len(completed)
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(60)
    stop.set()
    for t in threads:
        t.join(30)
    assert code == 0
    assert n_before > 0 and len(completed) >= n_before
    for x, y in completed:  # every response that completed is correct
        np.testing.assert_allclose(y, local.run({"images": x})["logits"], atol=1e-5, rtol=1e-5)
    with pytest.raises(ProcessLookupError):  # no stub or server process left in its group
        os.killpg(pgid, 0)
    server.log_path.unlink()


def test_a_stream_whose_first_request_is_refused_still_stops(repo, exported):
    """Triton 2.51 never unloads a model once the first request of a gRPC stream was refused for it, so
    its shutdown would wait out the exit timeout and fail; stop() ends it once every request is answered
    and says which model would not unload."""
    from serve.client import InferStream, infer_channel

    server = TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",))).start()
    channel, _ = infer_channel(server.url)
    stream = InferStream(channel)
    try:
        refused_then_served(stream, exported)
    finally:
        stream.close()
        channel.close()
    pgid = server.proc.pid
    server.stop()
    assert server.stop_note and server.stop_note.startswith("tiny_cnn_onnx still loaded")
    assert f"(server log: {server.log_path})" in server.stop_note
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    server.log_path.unlink()


def test_unload_stall_is_read_from_the_log():
    from serve.embedded.server import UNLOAD_STALL_TICKS, loaded_models, unload_stalled

    head = ("Signal (15) received.\n\"Timeout 20: Found 1 model versions that have in-flight inferences\"\n"
            "\"All models are stopped, unloading models\"\n")
    tick = "\"Timeout {}: Found {} live models and {} in-flight non-inference requests\"\n"
    stalled = head + "".join(tick.format(20 - i, 1, 0) for i in range(UNLOAD_STALL_TICKS))
    assert unload_stalled(stalled) == 1
    assert unload_stalled(head + "".join(tick.format(20 - i, 1, 0) for i in range(UNLOAD_STALL_TICKS - 1))) == 0
    assert unload_stalled(head + "".join(tick.format(20 - i, 1, 1) for i in range(9))) == 0  # still working
    assert unload_stalled(head + "".join(tick.format(20 - i, 9 - i, 0) for i in range(9))) == 0  # progressing
    assert unload_stalled(stalled.replace("All models are stopped", "Waiting")) == 0  # requests not drained
    log = "successfully loaded 'a'\nsuccessfully loaded 'b'\nsuccessfully unloaded 'a'\nsuccessfully loaded 'c'\n"
    assert loaded_models(log + "successfully unloaded 'c'\n") == ["b"]


def test_tampered_artifact_fails_served_parity(repo, exported, tmp_path, capsys):
    import onnx

    bad = tmp_path / "repo"
    shutil.copytree(repo, bad)
    path = bad / "tiny_cnn_onnx" / "1" / "model.onnx"
    model = onnx.load(str(path))
    init = max(model.graph.initializer, key=lambda t: np.prod(t.dims))
    arr = onnx.numpy_helper.to_array(init).copy()
    arr.flat[: arr.size // 4] *= 1.5
    init.CopyFrom(onnx.numpy_helper.from_array(arr, init.name))
    onnx.save(model, str(path))
    with TritonServer(ServeConfig(repo=str(bad), models=("tiny_cnn_onnx",))) as s:
        with pytest.raises(ParityError, match="tiny_cnn_onnx"):
            check_served(s.url, exported)
        capsys.readouterr()
        assert run_cli("infer", "--url", s.url, "--check", exported) == 3
        assert "served parity" in capsys.readouterr().err
    assert not s.log_path.exists()  # a temp log goes with a clean stop


def test_an_altered_reference_is_refused_by_every_reader(server, exported, tmp_path, capsys):
    """The reference samples decide served parity and the repository's warm-up: each reader checks them
    against the manifest's sha256, as verify does, and a cut-short file is named in one line."""
    d = tmp_path / "e"
    shutil.copytree(exported, d)
    ref = d / "reference.npz"
    ref.write_bytes(ref.read_bytes()[:1000])
    for argv in (("repo", d, "--out", tmp_path / "repo"), ("infer", "--url", server.url, "--check", d),
                 ("infer", "--url", server.url, "--heldout", d), ("verify", d)):
        assert run_cli(*argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "reference.npz was altered or truncated" in err[0], (argv, err)
    assert not (tmp_path / "repo").exists()


def test_a_model_that_fails_to_load_is_named_and_its_log_kept(repo, tmp_path):
    """A broken artifact stops start-up with the model's name, the log's tail and the log's path; the
    temp log that a clean stop removes is kept for the user to read."""
    bad = tmp_path / "repo"
    shutil.copytree(repo, bad)
    path = bad / "tiny_cnn_onnx" / "1" / "model.onnx"
    path.write_bytes(path.read_bytes()[:1000])
    server = TritonServer(ServeConfig(repo=str(bad), models=("tiny_cnn_onnx",)))
    with pytest.raises(ServerError, match="tiny_cnn_onnx failed to load") as e:
        server.start()
    assert f"(full log: {server.log_path})" in str(e.value)
    assert server.log_path.exists() and server.proc.poll() is not None
    server.log_path.unlink()


def test_a_server_that_cannot_be_started_leaves_no_temp_log(repo, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(TritonServer, "command", lambda self: [str(tmp_path / "no-such-tritonserver")])
    with pytest.raises(FileNotFoundError):
        TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",))).start()
    assert list(tmp_path.glob("tritonserver-*.log")) == []


def test_unreachable_server_is_a_clear_error(capsys, exported):
    from serve.embedded.process import free_ports

    assert run_cli("infer", "--url", f"127.0.0.1:{free_ports()[0]}", "--heldout", exported) == 2
    assert "is the server running" in capsys.readouterr().err


@pytest.mark.parametrize("url, says", [("localhost", "no port"), (":8001", "no host"), ("::1", "write an IPv6 address in brackets"),
                                       ("127.0.0.1:99999", "'99999' is not a port number"),
                                       ("http://127.0.0.1:8001", "drop the scheme (http://)")])
def test_a_malformed_url_is_refused_before_any_connection(capsys, exported, url, says):
    from serve.config import check_url

    for argv in (("infer", "--url", url, "--heldout", exported), ("bench", exported, "--url", url)):
        assert run_cli(*argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--url {url}: {says}" in err[0], err
    for good in ("127.0.0.1:8001", "localhost:8001", "[::1]:8001", "triton.internal:443"):
        check_url(good)


def test_a_url_that_is_not_a_grpc_endpoint_is_named(server, exported, capsys):
    """--url at Triton's HTTP or metrics port (8000 or 8002 for 8001) is named as not gRPC, not waited out
    as a server that is not running; a listener that never answers gets its own message."""
    import socket

    for port in (server.http_port, server.metrics_port):
        assert run_cli("infer", "--url", f"127.0.0.1:{port}", "--heldout", exported) == 2
        err = capsys.readouterr().err
        assert f"127.0.0.1:{port} is not a gRPC endpoint" in err and "is the server running" not in err, err
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        with pytest.raises(ServerError, match="no gRPC answer from .* within 1s"):
            TritonClient(f"127.0.0.1:{silent.getsockname()[1]}").wait_ready(1)


@pytest.mark.parametrize("case", ["missing", "suffix", "heldout"])
def test_infer_refuses_a_bad_local_path_before_connecting(case, tmp_path, capsys):
    """A missing or unsendable FILE, or a --heldout that is not an export, is named at once, not after
    waiting for a server (none runs at this URL)."""
    from serve.embedded.process import free_ports

    (tmp_path / "notes.txt").write_text("x")
    arg = {"missing": [tmp_path / "nope.npy"], "suffix": [tmp_path / "notes.txt"], "heldout": ["--heldout", tmp_path]}[case]
    assert run_cli("infer", "--url", f"127.0.0.1:{free_ports()[0]}", *arg) == 2
    err = capsys.readouterr().err
    want = {"missing": "nope.npy: no such file", "suffix": "notes.txt: not an image, .npy or .npz file",
            "heldout": "has no manifest.json"}[case]
    assert want in err and "is the server running" not in err and len(err.strip().splitlines()) == 1, err


def test_unreachable_server_is_a_clear_error_on_the_lean_path():
    from serve.embedded.process import free_ports

    client = TritonClient(f"127.0.0.1:{free_ports()[0]}", timeout_s=5)
    client._configs["m"] = {"input": [{"name": "images"}], "output": [{"name": "logits"}]}  # skip the config fetch
    with pytest.raises(ServerError, match="is the server running"):
        client.infer("m", np.zeros((1, 3, 32, 32), np.float32))


def test_serve_refuses_a_folder_without_models_before_starting(capsys, exported, tmp_path):
    """A missing folder, an export directory and an empty folder are refused in one line, naming the fix."""
    assert run_cli("serve", tmp_path / "missing") == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    for folder, message in ((exported, f"torchship repo {exported}"), (tmp_path / "empty", "holds no model")):
        # were the guard gone, serve would start Triton and wait for a signal: send it one, so the test
        # fails (serve stops and returns 0) instead of hanging
        timer = threading.Timer(60, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        try:
            assert run_cli("serve", folder) == 2
        finally:
            timer.cancel()
        assert message in capsys.readouterr().err


def test_serve_names_a_broken_config_before_starting(repo, tmp_path, capsys):
    bad = tmp_path / "repo"
    shutil.copytree(repo, bad)
    config = bad / "tiny_cnn_onnx" / "config.pbtxt"
    line = len(config.read_text().splitlines()) + 1
    config.write_text(config.read_text() + "max_batch_sise: 8\n")  # a typo Triton would only log
    timer = threading.Timer(60, os.kill, (os.getpid(), signal.SIGTERM))  # as above: fail, not hang, if it starts
    timer.start()
    try:
        assert run_cli("serve", bad) == 2
    finally:
        timer.cancel()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{config}: {line}:1" in err[0] and 'no field named "max_batch_sise"' in err[0], err


def test_serve_refuses_a_port_in_use_before_starting(repo, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert run_cli("serve", repo, "--grpc-port", port) == 2
    assert f"--grpc-port {port}: 127.0.0.1:{port} is already in use" in capsys.readouterr().err


class FirstFreePort:
    """A socket whose bind to port 0 gets the lowest port that no open one holds: a port allocator that,
    like Linux now and then, hands out a port again as soon as it is closed."""
    held: set[int] = set()

    def __init__(self, *args):
        self.port = None

    def setsockopt(self, *args):
        pass

    def bind(self, addr):
        port = addr[1] or min(set(range(50000, 50010)) - self.held)
        if port in self.held:
            raise OSError("in use")
        self.port = port
        self.held.add(port)

    def getsockname(self):
        return ("127.0.0.1", self.port)

    def close(self):
        self.held.discard(self.port)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_each_endpoint_gets_its_own_port(repo, capsys, monkeypatch):
    """Ports left to the system are distinct and avoid the ones given, even where the system hands a
    closed port out again (picked one at a time, Triton then refuses to start: 'cannot listen to HTTP
    requests and metrics requests at the same address and port')."""
    import socket
    import types

    import serve.embedded.process as srv

    monkeypatch.setattr(srv, "socket", types.SimpleNamespace(socket=FirstFreePort, SOL_SOCKET=socket.SOL_SOCKET,
                                                             SO_REUSEADDR=socket.SO_REUSEADDR))
    s = TritonServer(ServeConfig(repo=str(repo)))
    assert sorted((s.grpc_port, s.http_port, s.metrics_port)) == [50000, 50001, 50002]
    s = TritonServer(ServeConfig(repo=str(repo), http_port=50000))
    assert s.http_port == 50000 and sorted((s.grpc_port, s.metrics_port)) == [50001, 50002]
    monkeypatch.undo()
    assert run_cli("serve", repo, "--grpc-port", 50000, "--metrics-port", 50000) == 2
    assert "--grpc-port and --metrics-port are both 50000" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--grpc-port", "--metrics-port"])
def test_a_picked_port_taken_before_triton_binds_it_is_picked_again(repo, exported, tmp_path, monkeypatch, flag):
    """Another process takes a port the server picked, between the pick and Triton's bind (gRPC: before the
    server is live; metrics: Triton's last bind, often after). The server starts on a new port, this
    server's own model answers there, and the failed start leaves no temp log."""
    import socket
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    server = TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",)))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", server.ports[flag]))
        taken.listen()
        with server:
            assert server.ports[flag] != taken.getsockname()[1]
            assert_onnx_served(server.url, exported, np.random.default_rng(3).random((2, 3, 32, 32), dtype=np.float32))
    assert server.proc.returncode == 0 and list(tmp_path.glob("tritonserver-*.log")) == []


def test_another_server_on_the_picked_grpc_port_is_not_taken_for_this_one(repo, exported, tmp_path, monkeypatch):
    """What a second Triton that won the race for the picked gRPC port would do: answer live, load and
    ready for any model. start() must not take it for its own server: it starts again on a new port."""
    import tempfile
    from concurrent import futures

    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    class Impostor(service_pb2_grpc.GRPCInferenceServiceServicer):
        def ServerLive(self, request, context):
            return service_pb2.ServerLiveResponse(live=True)

        def RepositoryModelLoad(self, request, context):
            return service_pb2.RepositoryModelLoadResponse()

        def ModelReady(self, request, context):
            return service_pb2.ModelReadyResponse(ready=True)

    server = TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",)))
    taken = server.grpc_port
    impostor = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Impostor(), impostor)
    assert impostor.add_insecure_port(f"127.0.0.1:{taken}") == taken
    impostor.start()
    try:
        with server:
            assert server.grpc_port != taken
            assert_onnx_served(server.url, exported, np.random.default_rng(4).random((1, 3, 32, 32), dtype=np.float32))
    finally:
        impostor.stop(0)
    assert server.proc.returncode == 0 and list(tmp_path.glob("tritonserver-*.log")) == []


def test_a_given_port_taken_after_the_check_is_named(repo, tmp_path, monkeypatch):
    """A port the user gave is not picked again: the error names the flag and keeps the log."""
    import socket
    import tempfile

    from serve.embedded.process import free_ports

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    port = free_ports()[0]
    server = TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",), grpc_port=port))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(ServerError, match=f"--grpc-port {port}: 127.0.0.1:{port} is already in use: it was taken"):
            server.start()
    assert server.grpc_port == port and server.proc.poll() is not None
    assert list(tmp_path.glob("tritonserver-*.log")) == [server.log_path]

def test_the_server_starts_without_running_this_process_fork_handlers(repo, exported):
    """No preexec_fn anywhere: Popen then uses vfork and runs none of the at-fork handlers that native
    libraries loaded here registered. gRPC's, with requests in flight on other threads, can abort the child
    ("Fatal Python error: Aborted" in _execute_child). Python runs its own at-fork hooks exactly when it runs
    those, so one stands witness."""
    forks: list[int] = []
    os.register_at_fork(before=lambda: forks.append(1))  # cannot be unregistered; it only counts
    x = np.random.default_rng(0).random((1, 3, 32, 32), dtype=np.float32)
    with TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",))) as s:
        got = TritonClient(s.url).infer("tiny_cnn_onnx", x)
        started = len(forks)
    assert started == 0, "starting the server ran this process's at-fork handlers"
    np.testing.assert_allclose(got, in_process(exported, "onnx").run({"images": x})["logits"], rtol=1e-4, atol=1e-5)


def test_a_server_started_from_a_thread_that_ends_keeps_serving(repo, exported):
    """Linux sends a child its death signal when the thread that started it ends, not the process: a server
    started straight from a worker thread was SIGTERMed as soon as that thread returned."""
    box: dict = {}

    def start():
        try:
            box["server"] = TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",))).start()
        except BaseException as e:  # raised again below, in the test's own thread
            box["error"] = e

    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    x = np.random.default_rng(1).random((1, 3, 32, 32), dtype=np.float32)
    with box["server"] as s:  # started already: entering does not start it again
        time.sleep(1.0)  # the signal, had it come, came when the thread ended; Triton then drains and exits
        assert s.proc.poll() is None, "the server ended with the thread that started it"
        got = TritonClient(s.url).infer("tiny_cnn_onnx", x)
        with pytest.raises(ServerError, match="already running"):
            s.start()
    np.testing.assert_allclose(got, in_process(exported, "onnx").run({"images": x})["logits"], rtol=1e-4, atol=1e-5)


def test_a_start_interrupted_while_waiting_on_the_starter_ends_the_child(monkeypatch):
    """Ctrl-C (here a SIGINT whose handler raises) while the caller waits for the starter thread: the caller
    gets the interrupt at once, and the child that the starter brings up after it is killed, not orphaned
    (nothing else holds its Popen)."""
    import subprocess
    import sys

    from serve.embedded import process as server

    class Interrupted(BaseException):
        pass

    def raise_interrupted(signum, frame):
        raise Interrupted

    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def slow_popen(*args, **kw):  # runs on the starter thread: the interrupt lands while the caller waits
        time.sleep(1.0)
        started.append(real_popen(*args, **kw))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", slow_popen)
    old = signal.signal(signal.SIGINT, raise_interrupted)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(Interrupted):
            server.start_child([sys.executable, "-c", "import time; time.sleep(60)"])
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)
    deadline = time.monotonic() + 10
    try:
        while not (started and started[0].poll() is not None) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started, "the starter never ran the start"
        assert started[0].returncode == -signal.SIGKILL, "the child outlived the interrupted start"
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()


def test_a_killed_client_process_leaves_no_server_behind(repo, tmp_path):
    """SIGKILL the process that started the server: no finally block runs, yet the server goes too."""
    import subprocess
    import sys

    script = tmp_path / "hold.py"
    script.write_text(f"""
import sys, time
from serve.config import ServeConfig
from serve.embedded import TritonServer
s = TritonServer(ServeConfig(repo={str(repo)!r}, models=("tiny_cnn_onnx",), log={str(tmp_path / "server.log")!r})).start()
print(s.proc.pid, flush=True)
time.sleep(600)
""")
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=str(Path(__file__).resolve().parents[2]))
    server_pid = int(holder.stdout.readline())
    os.kill(server_pid, 0)  # it is up
    holder.kill()
    holder.wait(30)
    deadline = time.time() + 60
    for pid, what in ((server_pid, "the server"),):
        while time.time() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"{what} outlived the process that started it")
    with pytest.raises(ProcessLookupError):
        os.killpg(server_pid, 0)  # its stubs are gone too


def test_top_k_through_the_classification_extension(server, exported):
    """infer(top_k=3) asks Triton for its 'score:index:label' rows: the indices and scores are the
    in-process top 3, in order, with the labels from the repository's labels file."""
    client = TritonClient(server.url)
    x = np.random.default_rng(7).random((2, 3, 32, 32), dtype=np.float32)
    rows = client.infer("tiny_cnn_onnx", x, top_k=3)
    want = in_process(exported, "onnx").run({"images": x})["logits"]
    assert rows.shape == (2, 3)
    for got, logits in zip(rows, want):
        parsed = [s.decode() if isinstance(s, bytes) else s for s in got]
        scores = [float(p.split(":")[0]) for p in parsed]
        idx = [int(p.split(":")[1]) for p in parsed]
        assert idx == list(np.argsort(-logits)[:3])
        np.testing.assert_allclose(scores, np.sort(logits)[::-1][:3], atol=1e-5, rtol=1e-5)
        assert all(len(p.split(":")) == 3 and p.split(":")[2] for p in parsed), parsed
    client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_standard_image_client_reads_the_layout_and_gets_labelled_top_3(server, exported, tmp_path, protocol):
    """What Triton's own image client does: read the input's layout and size from the served config,
    preprocess an image file to match, and ask for the top 3 classes through the classification extension
    (class_count). The labels come back, and the classes are the in-process top 3."""
    from PIL import Image

    if protocol == "grpc":
        import tritonclient.grpc as tc

        client = tc.InferenceServerClient(server.url)
        config = client.get_model_config("tiny_cnn_onnx").config
        inp, out = config.input[0], config.output[0]
        layout, dims, name, dtype = tc.model_config_pb2.ModelInput.Format.Name(inp.format), list(inp.dims), inp.name, inp.data_type
        dtype = tc.model_config_pb2.DataType.Name(dtype)[len("TYPE_"):]
    else:
        import tritonclient.http as tc

        client = tc.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        config = client.get_model_config("tiny_cnn_onnx")
        inp, out = config["input"][0], config["output"][0]
        layout, dims, name, dtype = inp["format"], inp["dims"], inp["name"], inp["data_type"][len("TYPE_"):]
    assert layout == "FORMAT_NCHW", layout
    c, h, w = (int(d) for d in dims)
    pixels = (np.random.default_rng(5).random((48, 40, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "photo.png")
    with Image.open(tmp_path / "photo.png") as im:  # preprocess as the config says: C x H x W, scaled to [0, 1]
        x = np.asarray(im.convert("RGB").resize((w, h), Image.BILINEAR), dtype=np.float32) / 255.0
    x = np.ascontiguousarray(x.transpose(2, 0, 1)[None] if layout == "FORMAT_NCHW" else x[None])
    assert x.shape == (1, c, h, w)
    infer_input = tc.InferInput(name, list(x.shape), dtype)
    infer_input.set_data_from_numpy(x)
    requested = tc.InferRequestedOutput(out.name if protocol == "grpc" else out["name"], class_count=3)
    result = client.infer("tiny_cnn_onnx", [infer_input], outputs=[requested])
    rows = [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy(requested.name()).reshape(-1)]
    classes = read_manifest(exported)["classes"]
    logits = in_process(exported, "onnx").run({"images": x})["logits"][0]
    assert [int(r.split(":")[1]) for r in rows] == list(np.argsort(-logits)[:3])
    assert [r.split(":", 2)[2] for r in rows] == [classes[i] for i in np.argsort(-logits)[:3]]
    client.close()


def test_infer_files_take_float_arrays_and_refuse_integer_pixels(server, exported, tmp_path, capsys):
    """.npy files of any float dtype are sent as the model's float32; an 8-bit array (0-255 pixels) is refused
    by name instead of being served as nonsense; the server keeps answering."""
    x = np.load(exported / "reference.npz")["input/heldout/images"][:2]
    np.save(tmp_path / "f64.npy", x.astype(np.float64))
    np.save(tmp_path / "u8.npy", (x * 255).astype(np.uint8))
    assert run_cli("infer", "--url", server.url, "--model", "tiny_cnn_onnx", "--json", tmp_path / "f64.npy") == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["input"] for r in rows] == ["f64.npy[0]", "f64.npy[1]"]
    assert run_cli("infer", "--url", server.url, "--model", "tiny_cnn_onnx", tmp_path / "u8.npy") == 2
    assert "dtype uint8 is not floating point" in capsys.readouterr().err
    (tmp_path / "cut.npy").write_bytes((tmp_path / "f64.npy").read_bytes()[:20])  # cut short
    np.save(tmp_path / "obj.npy", np.array([{}], dtype=object), allow_pickle=True)  # would need unpickling
    for bad in ("cut.npy", "obj.npy"):
        assert run_cli("infer", "--url", server.url, "--model", "tiny_cnn_onnx", tmp_path / bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"cannot read {tmp_path / bad} as a numpy array" in err[0], err
    assert run_cli("infer", "--url", server.url, "--heldout", exported, "-n", "100000") == 0
    assert "held-out samples; sending those" in capsys.readouterr().err


def test_infer_top_k_beyond_the_classes_prints_them_all_and_zero_is_refused(server, exported, capsys):
    classes = len(read_manifest(exported)["classes"])
    assert run_cli("infer", "--url", server.url, "--heldout", exported, "-n", 1, "--top-k", classes + 5, "--json") == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert sorted(t["index"] for t in row["top_k"]) == list(range(classes))
    expected = np.load(exported / "reference.npz")["expected/heldout/logits"][0]
    assert row["top_k"][0]["index"] == int(expected.argmax())  # the held-out sample eager saw
    assert run_cli("infer", "--url", server.url, "--heldout", exported, "--top-k", 0) == 2
    assert "--top-k, -n and --concurrency must be at least 1" in capsys.readouterr().err


def test_infer_over_one_stream_prints_what_unary_calls_print(server, exported, tmp_path, capsys):
    """--stream sends the same requests one at a time on one stream (Triton's stream handler takes them,
    not the unary one): the same top-k for every input, and a refused input is the same one-line error."""
    args = ["infer", "--url", server.url, "--model", "tiny_cnn_onnx", "--heldout", exported, "-n", 12, "--json"]
    handlers, results = {}, {}  # which of Triton's gRPC handlers took the requests, from its verbose log
    admin = TritonClient(server.url)
    for flags in ((), ("--stream",)):
        start = server.log_path.stat().st_size
        admin.client.update_log_settings({"log_verbose_level": 1})
        try:
            assert run_cli(*args, *flags) == 0
            results[flags] = json.loads(capsys.readouterr().out)["results"]
        finally:
            admin.client.update_log_settings({"log_verbose_level": 0})
        log = server.log_path.read_bytes()[start:].decode(errors="replace")
        handlers[flags] = {h for h in ("ModelInferHandler", "ModelStreamInferHandler") if f"Process for {h}," in log}
    assert handlers == {(): {"ModelInferHandler"}, ("--stream",): {"ModelStreamInferHandler"}}, handlers
    assert results[("--stream",)] == results[()] and len(results[()]) == 12
    np.save(tmp_path / "nan.npy", np.full((1, 3, 32, 32), np.nan, np.float32))
    assert run_cli("infer", "--url", server.url, "--model", "tiny_cnn_onnx", tmp_path / "nan.npy", "--stream") == 2
    err = capsys.readouterr().err.strip()
    assert "contains NaN" in err and len(err.splitlines()) == 1, err
    assert run_cli(*args, "--stream", "--concurrency", 4) == 2
    assert "--stream sends one request at a time" in capsys.readouterr().err
