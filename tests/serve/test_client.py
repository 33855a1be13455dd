"""Clients of a running server: one gRPC stream, torchship infer (files, held-out samples, top-k, --stream),
a standard image client, and a client's own mistakes named before or without a connection."""

import json
import re
import socket

import numpy as np
import pytest

from tests.conftest import run_cli
from tests.helpers import MODELS, in_process, refused_then_served
from torchship.errors import ServerError
from torchship.manifest import read_manifest
from torchship.serve.client import TritonClient


def test_one_stream_carries_requests_in_turn_and_survives_a_refusal(server, exported):
    """Every model over one ModelStreamInfer call answers as the unary call does, for its own request; a
    refused request raises and the stream keeps serving."""
    from torchship.serve.client import InferStream, decode, infer_channel, request

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


@pytest.mark.slow
def test_unreachable_server_is_a_clear_error(capsys, exported):
    from torchship.serve.embedded.process import free_ports

    assert run_cli("infer", "--url", f"127.0.0.1:{free_ports()[0]}", "--heldout", exported) == 2
    assert "is the server running" in capsys.readouterr().err


@pytest.mark.parametrize(
    "url, says",
    [
        ("localhost", "no port"),
        (":8001", "no host"),
        ("::1", "write an IPv6 address in brackets"),
        ("127.0.0.1:99999", "'99999' is not a port number"),
        ("http://127.0.0.1:8001", "drop the scheme (http://)"),
    ],
)
def test_a_malformed_url_is_refused_before_any_connection(capsys, exported, url, says):
    from torchship.serve.config import check_url

    for argv in (("infer", "--url", url, "--heldout", exported), ("bench", exported, "--url", url)):
        assert run_cli(*argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--url {url}: {says}" in err[0], err
    for good in ("127.0.0.1:8001", "localhost:8001", "[::1]:8001", "triton.internal:443"):
        check_url(good)


def test_a_url_that_is_not_a_grpc_endpoint_is_named(server, exported, capsys):
    """--url at Triton's HTTP or metrics port (8000 or 8002 for 8001) is named as not gRPC, not waited out
    as a server that is not running; a listener that never answers gets its own message."""
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
    from torchship.serve.embedded.process import free_ports

    (tmp_path / "notes.txt").write_text("x")
    arg = {"missing": [tmp_path / "nope.npy"], "suffix": [tmp_path / "notes.txt"], "heldout": ["--heldout", tmp_path]}[
        case
    ]
    assert run_cli("infer", "--url", f"127.0.0.1:{free_ports()[0]}", *arg) == 2
    err = capsys.readouterr().err
    want = {
        "missing": "nope.npy: no such file",
        "suffix": "notes.txt: not an image, .npy or .npz file",
        "heldout": "has no manifest.json",
    }[case]
    assert want in err and "is the server running" not in err and len(err.strip().splitlines()) == 1, err


def test_unreachable_server_is_a_clear_error_on_the_lean_path():
    from torchship.serve.embedded.process import free_ports

    client = TritonClient(f"127.0.0.1:{free_ports()[0]}", timeout_s=5)
    client._configs["m"] = {"input": [{"name": "images"}], "output": [{"name": "logits"}]}  # skip the config fetch
    with pytest.raises(ServerError, match="is the server running"):
        client.infer("m", np.zeros((1, 3, 32, 32), np.float32))


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
        layout, dims, name, dtype = (
            tc.model_config_pb2.ModelInput.Format.Name(inp.format),
            list(inp.dims),
            inp.name,
            inp.data_type,
        )
        dtype = tc.model_config_pb2.DataType.Name(dtype)[len("TYPE_") :]
    else:
        import tritonclient.http as tc

        client = tc.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        config = client.get_model_config("tiny_cnn_onnx")
        inp, out = config["input"][0], config["output"][0]
        layout, dims, name, dtype = inp["format"], inp["dims"], inp["name"], inp["data_type"][len("TYPE_") :]
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
        admin.client.update_log_settings({"log_verbose_level": 1}, headers=admin.control_headers)
        try:
            assert run_cli(*args, *flags) == 0
            results[flags] = json.loads(capsys.readouterr().out)["results"]
        finally:
            admin.client.update_log_settings({"log_verbose_level": 0}, headers=admin.control_headers)
        log = server.log_path.read_bytes()[start:].decode(errors="replace")
        # a request arriving is a START step; a previous window's last request can still log its FINISH here
        handlers[flags] = set(
            re.findall(r'Process for (ModelInferHandler|ModelStreamInferHandler),[^"\n]* step START', log)
        )
    assert handlers == {(): {"ModelInferHandler"}, ("--stream",): {"ModelStreamInferHandler"}}, handlers
    assert results[("--stream",)] == results[()] and len(results[()]) == 12
    np.save(tmp_path / "nan.npy", np.full((1, 3, 32, 32), np.nan, np.float32))
    assert run_cli("infer", "--url", server.url, "--model", "tiny_cnn_onnx", tmp_path / "nan.npy", "--stream") == 2
    err = capsys.readouterr().err.strip()
    assert "contains NaN" in err and len(err.splitlines()) == 1, err
    assert run_cli(*args, "--stream", "--concurrency", 4) == 2
    assert "--stream sends one request at a time" in capsys.readouterr().err


def test_a_reloaded_model_is_read_with_the_config_it_now_serves(server):
    """A client that read a model's config reads it again once it reloads the model: the winner's search loads one
    name with each contender's files in turn, and would check one against another's format otherwise."""
    from torchship.serve.model_config import read_config, served_config_path

    path = served_config_path(server.repo / "tiny_cnn_onnx")
    client = server.client()
    try:
        assert "torchship_probe" not in client.config("tiny_cnn_onnx").get("parameters", {})  # read, and kept
        c = read_config(path)
        c.parameters["torchship_probe"].string_value = "1"
        server.load("tiny_cnn_onnx", client=client, override=c)
        assert client.config("tiny_cnn_onnx")["parameters"]["torchship_probe"]["string_value"] == "1"
    finally:
        server.load("tiny_cnn_onnx", client=client, override=read_config(path))
        client.close()
