"""The generated repository: layout, protobuf configs, and names that agree with the manifest."""

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from serve.repository import EMBEDDED_CONFIG
from tests.conftest import run_cli
from torchship.manifest import read_manifest


def cfg(path):
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def test_layout_and_configs(repo, exported):
    m = read_manifest(exported)
    expected = {"tiny_cnn_onnx": ("onnxruntime_onnx", "model.onnx"), "tiny_cnn_torchscript": ("pytorch_libtorch", "model.pt"),
                "tiny_cnn_aoti": ("torch_aoti", "model.pt2")}
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == sorted(expected)
    for name, (platform, fname) in expected.items():
        c = cfg(repo / name / "config.pbtxt")
        assert c.name == name and c.platform == platform
        assert (repo / name / "1" / fname).exists()
        assert [i.name for i in c.input] == [i["name"] for i in m["inputs"]]
        assert [o.name for o in c.output] == [o["name"] for o in m["outputs"]]
        assert c.output[0].label_filename == "labels.txt"
        assert (repo / name / "labels.txt").read_text().split() == m["classes"]
        assert c.version_policy.HasField("latest")
        assert c.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU and c.instance_group[0].count == 1
        w = c.model_warmup[0].inputs["images"]
        assert (repo / name / "warmup" / w.input_data_file).stat().st_size == 4 * int(np.prod(w.dims))
        if platform == "torch_aoti":  # the official container does not batch AOTI models yet
            assert c.max_batch_size == 0 and list(c.input[0].dims) == [1, 3, 32, 32]
            emb = cfg(repo / name / EMBEDDED_CONFIG)
            assert emb.backend == "pytorch" and emb.max_batch_size == 8 and list(emb.input[0].dims) == [3, 32, 32]
            assert emb.parameters["buckets"].string_value == "1:model.pt2,8:model_bs8.pt2"
        else:
            assert c.max_batch_size == 8 and list(c.input[0].dims) == [3, 32, 32]
            assert c.dynamic_batching.max_queue_delay_microseconds == 2000
    assert "nvcr.io/nvidia/tritonserver:" in (repo / "README.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--max-batch", "0"], "--max-batch must be at least 1"),
    (["--max-batch", "1000"], "exceeds the export's max batch"),
    (["--formats", "onnx", "tensorrt"], "tensorrt cannot be served"),
    (["--instance-count", "0"], "must be at least 1"),
])
def test_bad_repository_options_are_refused_and_write_nothing(exported, tmp_path, capsys, args, message):
    out = tmp_path / "repo"
    assert run_cli("repo", exported, "--out", out, *args) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
