"""Tensors of every dtype a signature allows cross the embedded server intact: float16, int32, int64, bool and
float32 in, int32, int64, bool and float32 out (floating outputs are served as float32), through each backend,
exactly. Under numpy 2 the Triton stub's own numpy path returned empty
arrays with the right shapes; the DLPack path the backends use must not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import run_cli

FLAGS = [
    "--input",
    "f16:float16:B,4",
    "--input",
    "i32:int32:B,4",
    "--input",
    "i64:int64:B,4",
    "--input",
    "flag:bool:B,4",
    "--input",
    "f32:float32:B,4",
    "--input-range",
    "i32=-1000..1000",
    "--input-range",
    "i64=-100000..100000",
]


@pytest.fixture(scope="module")
def dtypes_served(tmp_path_factory):
    from torchship.serve.config import RepoConfig, ServeConfig
    from torchship.serve.embedded import TritonServer
    from torchship.serve.repository import build_repository

    d = tmp_path_factory.mktemp("dtypes")
    torch.save({}, d / "w.pt")
    assert (
        run_cli(
            "export",
            "--model",
            "tests.anymodel.models:dtypes",
            "--weights",
            d / "w.pt",
            *FLAGS,
            "--formats",
            "onnx",
            "torchscript",
            "--max-batch",
            "8",
            "--out",
            d / "export",
        )
        == 0
    )
    build_repository(d / "export", RepoConfig(out=str(d / "repo")))
    with TritonServer(ServeConfig(repo=str(d / "repo"))) as s:
        yield s, d / "export"


def feeds(n: int = 5) -> dict[str, np.ndarray]:
    g = np.random.default_rng(0)
    return {
        "f16": g.standard_normal((n, 4)).astype(np.float16),
        "i32": g.integers(-1000, 1000, (n, 4), dtype=np.int32),
        "i64": g.integers(-(10**5), 10**5, (n, 4), dtype=np.int64),
        "flag": g.random((n, 4)) < 0.5,
        "f32": g.standard_normal((n, 4)).astype(np.float32),
    }


@pytest.mark.parametrize("model", ["dtypes_onnx", "dtypes_torchscript"])
def test_every_dtype_comes_back_exactly(dtypes_served, model):
    from tests.anymodel.models import dtypes
    from torchship.serve.client import TritonClient

    server, _ = dtypes_served
    x = feeds()
    with torch.no_grad():
        want = {
            k: v.numpy()
            for k, v in dtypes()(*[torch.from_numpy(x[k]) for k in ("f16", "i32", "i64", "flag", "f32")]).items()
        }
    want["f16_doubled"] = want["f16_doubled"].astype(np.float32)  # floating outputs are served as float32
    got = TritonClient(server.url).infer_all(model, x)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape)  # empty or retyped: refused here
        if name == "total":
            np.testing.assert_allclose(g, w, rtol=1e-6)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)


def test_the_served_check_passes_for_every_dtype(dtypes_served):
    from torchship.serve.parity import check_served

    server, export = dtypes_served
    assert check_served(server.url, export)["pass"]
