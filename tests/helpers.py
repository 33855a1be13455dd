"""Helpers the stage tests share: copies of the session's export to alter, faults planted in them as a
faulty exporter would have written them, and the served tiny model checked against in-process runtimes."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import onnx
import pytest
from torch import nn

from torchship import runtime
from torchship.errors import ClientError
from torchship.io import sha256_file
from torchship.manifest import read_manifest, write_manifest
from torchship.serve.client import TritonClient


class FlipChannels(nn.Module):
    """RGB read as BGR: the channels reversed before the model."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, images):
        return self.inner(images.flip(1))


def copy_export(exported, tmp_path):
    dst = tmp_path / "export"
    shutil.copytree(exported, dst)
    return dst


def rehash(d, rel):
    """Make the manifest agree with a changed file, as a faulty exporter would have written it."""
    m = read_manifest(d)
    for a in m["artifacts"]:
        if rel in a["files"]:
            a["files"][rel] = sha256_file(d / rel)
    write_manifest(d, m)


def rehash_version(vdir) -> None:
    """Make a repository version folder's provenance.json agree with its files, as a faulty repository builder
    would have written it: the planted fault then reaches the server, and only served parity can catch it."""
    prov = json.loads((vdir / "provenance.json").read_text())
    prov["files"] = {name: sha256_file(vdir / name) for name in prov["files"]}
    (vdir / "provenance.json").write_text(json.dumps(prov))


def alter_onnx_weight(path, change) -> None:
    """Change the largest weight (initializer) of the ONNX model at ``path`` in place with ``change(array)``, as a
    faulty exporter would have written it."""
    model = onnx.load(str(path))
    init = max(model.graph.initializer, key=lambda t: np.prod(t.dims))
    arr = onnx.numpy_helper.to_array(init).copy()
    change(arr)
    init.CopyFrom(onnx.numpy_helper.from_array(arr, init.name))
    onnx.save(model, str(path))


def scale(factor: float, part: float = 1.0):
    """A change for alter_onnx_weight: the first ``part`` of the weight's values times ``factor``."""

    def change(arr) -> None:
        arr.flat[: int(arr.size * part)] *= factor

    return change


def perturb_onnx(d, delta: float) -> None:
    """Add ``delta`` to one weight of the export's ONNX model (its largest initializer) and rehash it."""

    def add(arr) -> None:
        arr.flat[0] += delta

    alter_onnx_weight(d / "onnx/model.onnx", add)
    rehash(d, "onnx/model.onnx")


MODELS = {"tiny_cnn_onnx": "onnx", "tiny_cnn_torchscript": "torchscript", "tiny_cnn_aoti": "aoti_buckets"}


def in_process(exported, fmt):
    m = read_manifest(exported)
    a = next(a for a in m["artifacts"] if a["format"] == fmt)
    return runtime.load_artifact(str(exported), a, ["images"], ["logits"])


def assert_onnx_served(url, exported, x) -> None:
    """The served tiny_cnn_onnx at ``url`` answers ``x`` as ONNX Runtime does in this process."""
    np.testing.assert_allclose(
        TritonClient(url).infer("tiny_cnn_onnx", x),
        in_process(exported, "onnx").run({"images": x})["logits"],
        atol=1e-5,
        rtol=1e-5,
    )


def refused_then_served(stream, exported) -> None:
    """A wrong-shaped request on ``stream`` is refused with the server's message; the next one is served
    and equals in-process ONNX Runtime."""
    from torchship.serve.client import decode, request

    with pytest.raises(ClientError, match="unexpected shape|shape"):
        stream(request("tiny_cnn_onnx", np.zeros((1, 3, 16, 16), np.float32), "images"))
    x = np.random.default_rng(9).random((1, 3, 32, 32), dtype=np.float32)
    np.testing.assert_allclose(
        decode(stream(request("tiny_cnn_onnx", x, "images")), "logits"),
        in_process(exported, "onnx").run({"images": x})["logits"],
        atol=1e-5,
        rtol=1e-5,
    )


EVIL_CONFIG = {
    "name": "evil",
    "backend": "python",
    "max_batch_size": 0,
    "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [1]}],
    "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [1]}],
}
EVIL_CODE = (
    "import pathlib\npathlib.Path({marker!r}).write_text('code from a load request ran in the server')\n"
    "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"
)


def plant_attacks(
    grpc_url: str, http_url: str, marker, log_file, victim: str, grpc_headers=None, http_headers=None
) -> dict[str, str]:
    """The control-plane attacks a process with network access to the server tries, over gRPC and HTTP: load a
    python model whose code writes ``marker``, unload the ``victim`` model, turn on verbose logging, and send the
    server's log to ``log_file``. What the server answered to each, by name: "accepted", "restricted" (refused for
    want of the key) or its message. ``*_headers`` are the headers sent with each (none: an attacker without the
    key). What was accepted is undone with the same headers."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    files = {"file:1/model.py": EVIL_CODE.format(marker=str(marker)).encode()}
    g, h = grpcclient.InferenceServerClient(grpc_url), httpclient.InferenceServerClient(http_url)
    calls = {}
    for proto, c, headers in (("grpc", g, grpc_headers), ("http", h, http_headers)):
        calls.update(
            {
                f"{proto} load with code": lambda c=c, hd=headers: c.load_model(
                    "evil", config=json.dumps(EVIL_CONFIG), files=files, headers=hd
                ),
                f"{proto} unload": lambda c=c, hd=headers: c.unload_model(victim, headers=hd),
                f"{proto} verbose log": lambda c=c, hd=headers: c.update_log_settings(
                    {"log_verbose_level": 1}, headers=hd
                ),
                f"{proto} log redirect": lambda c=c, hd=headers: c.update_log_settings(
                    {"log_file": str(log_file)}, headers=hd
                ),
            }
        )
    answers = {}
    try:
        for name, call in calls.items():
            try:
                call()
                answers[name] = "accepted"
            except InferenceServerException as e:
                msg = e.message() or ""
                answers[name] = "restricted" if "restricted" in msg else msg
            if answers[name] == "accepted":
                if "unload" in name:
                    g.load_model(victim, headers=grpc_headers)
                elif "load with code" in name:
                    g.unload_model("evil", headers=grpc_headers)
                elif "verbose" in name:
                    g.update_log_settings({"log_verbose_level": 0}, headers=grpc_headers)
    finally:
        g.close()
        h.close()
    return answers


def make_certs(folder) -> dict[str, str]:
    """A CA and, signed by it, a server certificate for 127.0.0.1 and localhost and a client certificate, made
    with the openssl command: {"ca", "server_cert", "server_key", "client_cert", "client_key"}: PEM paths."""

    def run(*args):
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=torchship test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    )
    for who, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (folder / f"{who}.ext").write_text(ext + "\n")
        run(
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            f"/CN=torchship {who}",
            "-keyout",
            f"{who}.key",
            "-out",
            f"{who}.csr",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{who}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            f"{who}.ext",
            "-out",
            f"{who}.pem",
        )
    return {
        "ca": str(folder / "ca.pem"),
        "server_cert": str(folder / "server.pem"),
        "server_key": str(folder / "server.key"),
        "client_cert": str(folder / "client.pem"),
        "client_key": str(folder / "client.key"),
    }


# a bench of seconds: the served and in-process parts of the bench's tests
BENCH_SHORT = {
    "variants": ["eager", "onnx", "aoti_buckets"],
    "batch_sizes": [1, 4],
    "iters": 8,
    "blocks": 2,
    "warmup": 1,
    "threads": 1,
    "concurrency": [1, 4],
    "requests": 16,
    "progress": False,
    "load_generator": "python",
    "cross_check": False,
    "window_s": 0.1,
    "max_windows": 4,
}
