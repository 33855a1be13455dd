"""The official container's torch_aoti models (Triton 26.07 on): configs that batch, with the tensor names its
PyTorch backend gives an AOTInductor package's tensors, and clients that translate them to the manifest's.

Without a Docker engine the container cannot run here, so its configs are checked against the backend's own
rules: the fields of the batching torch_aoti configs in Triton's QA (qa/common/gen_qa_models.py,
create_torch_aoti_model_config), and the names pytorch_backend derives from the package's call specification
(src/pt2/model_state.cc), computed from the package itself. The translation is driven through a real Triton:
the embedded server serves the container's config (its platform, which Triton 2.51 does not know, left out)
with torchship's stand-in backend, which takes tensors in order as the container's backend does."""

import json
import shutil

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from torchship.errors import ClientError, ParityError
from torchship.manifest import read_manifest
from torchship.serve.config import ServeConfig
from torchship.serve.embedded import TritonServer
from torchship.serve.model_config import CONFIG, EMBEDDED_CONFIG, TENSOR_NAMES
from torchship.serve.repository import aoti_tensor_names

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def backend_names(spec: dict, prefix: str) -> list[str]:
    """The names pytorch_backend gives the leaves of one call specification (torch's pytree JSON): a tuple or
    list child i as PREFIX[i], a dict child as PREFIX[key], a leaf as PREFIX."""
    kids = spec["children_spec"]
    if not kids:
        return [prefix]
    keys = json.loads(spec["context"]) if spec["type"] == "builtins.dict" else range(len(kids))
    return [n for k, child in zip(keys, kids) for n in backend_names(child, f"{prefix}[{k}]")]


def call_spec_names(pt2) -> tuple[list[str], list[str]]:
    """(input names, output names) as the container's backend reads them from the package at ``pt2``: the
    call specification's (args, kwargs) as ARGS[i] and KWARGS[key], its result as RESULT[...], or RESULT for a
    single tensor."""
    import torch

    ins, outs = (json.loads(s)[1] for s in torch._inductor.aoti_load_package(str(pt2)).loader.get_call_spec())
    args, kwargs = ins["children_spec"]
    named = [
        backend_names(spec, prefix) for spec, prefix in ((args, "ARGS"), (kwargs, "KWARGS")) if spec["children_spec"]
    ]
    return sum(named, []), backend_names(outs, "RESULT")


def assert_container_config(mdir, manifest: dict, max_batch: int) -> None:
    """``mdir``'s config.pbtxt is a batching torch_aoti model whose tensors carry the names the backend reads
    from its package, in the manifest's order, with the manifest's dtypes and dims."""
    c = text_format.Parse((mdir / CONFIG).read_text(), mc.ModelConfig())
    assert (c.backend, c.platform, c.max_batch_size) == ("pytorch", "torch_aoti", max_batch)
    assert c.HasField("dynamic_batching") and c.version_policy.latest.num_versions == 1
    ins, outs = call_spec_names(mdir / "1" / "model.pt2")
    assert [i.name for i in c.input] == ins and [o.name for o in c.output] == outs
    emb = text_format.Parse((mdir / EMBEDDED_CONFIG).read_text(), mc.ModelConfig())
    for wire, plain in ((c.input, emb.input), (c.output, emb.output)):
        assert [(t.data_type, list(t.dims)) for t in wire] == [(t.data_type, list(t.dims)) for t in plain]
    assert [t.name for t in emb.input] == [
        t["name"] for t in manifest["inputs"]
    ]  # the embedded server's: the manifest's
    named = json.loads(c.parameters[TENSOR_NAMES].string_value)
    assert named == dict(zip(ins + outs, [t["name"] for t in manifest["inputs"] + manifest["outputs"]]))
    assert set(c.model_warmup[0].inputs) == set(ins)


def test_the_container_aoti_config_batches_with_the_backends_tensor_names(repo, exported):
    assert_container_config(repo / "tiny_cnn_aoti", read_manifest(exported), 8)


def test_the_names_follow_the_manifests_inputs_and_outputs():
    m = {
        "inputs": [{"name": "input_ids"}, {"name": "attention_mask"}],
        "outputs": [{"name": "logits"}, {"name": "embedding"}],
    }
    assert aoti_tensor_names(m) == {
        "input_ids": "ARGS[0]",
        "attention_mask": "ARGS[1]",
        "logits": "RESULT[0]",
        "embedding": "RESULT[1]",
    }
    assert aoti_tensor_names({"inputs": [{"name": "x"}], "outputs": [{"name": "y"}]}) == {"x": "ARGS[0]", "y": "RESULT"}


def test_a_planted_wrong_name_is_caught_by_the_call_specification(repo, exported, tmp_path):
    mdir = tmp_path / "tiny_cnn_aoti"
    shutil.copytree(repo / "tiny_cnn_aoti", mdir)
    (mdir / CONFIG).write_text((mdir / CONFIG).read_text().replace('"RESULT"', '"RESULT[0]"'))
    with pytest.raises(AssertionError):
        assert_container_config(mdir, read_manifest(exported), 8)


@pytest.fixture(scope="module")
def container_names_server(repo, tmp_path_factory):
    """A real Triton serving tiny_cnn_aoti from its container config (tensors ARGS[0] and RESULT)."""
    root = tmp_path_factory.mktemp("container_names") / "repo"
    shutil.copytree(repo / "tiny_cnn_aoti", root / "tiny_cnn_aoti")
    c = text_format.Parse((root / "tiny_cnn_aoti" / CONFIG).read_text(), mc.ModelConfig())
    c.ClearField("platform")  # Triton 2.51 does not know torch_aoti; the stand-in runs the same package
    (root / "tiny_cnn_aoti" / EMBEDDED_CONFIG).write_text(text_format.MessageToString(c))
    s = TritonServer(ServeConfig(repo=str(root)))
    s.start()
    yield s
    assert s.stop() == 0, s.log_tail()


@pytest.mark.slow
def test_infer_and_bench_translate_the_containers_names(container_names_server, exported, tmp_path):
    from torchship.config import build
    from torchship.serve.bench.config import BenchConfig
    from torchship.serve.bench.run import run_bench
    from torchship.serve.client import TritonClient
    from torchship.serve.parity import check_served

    url = container_names_server.url
    client = TritonClient(url)
    assert [i["name"] for i in client.config("tiny_cnn_aoti")["input"]] == ["ARGS[0]"]
    report = check_served(url, exported, models=["tiny_cnn_aoti"])
    assert report["pass"] and list(report["models"]) == ["tiny_cnn_aoti"]
    cfg = build(
        BenchConfig,
        {
            "export_dir": str(exported),
            "out": str(tmp_path),
            "url": url,
            "models": ["tiny_cnn_aoti"],
            "requests": 12,
            "concurrency": [1, 4],
            "skip_in_process": True,
            "batching_compare": [],
            "noop": False,
            "cross_check": False,
            "plots": False,
            "progress": False,
            "load_generator": "python",
            "window_s": 0.1,
            "max_windows": 3,
        },
    )
    run_bench(cfg, log=lambda *a: None)
    rows = json.loads((tmp_path / "results.json").read_text())["served"]["models"]["tiny_cnn_aoti"]["rows"]
    assert all(r["failed"] == 0 and r["checked"] > 0 and r.get("wrong", 0) == 0 for r in rows), rows
    client.close()


@pytest.mark.slow
def test_without_the_translation_the_requests_are_refused(container_names_server, exported, monkeypatch):
    """The planted fault: a client that sends the manifest's names to the container's model."""
    from torchship.serve.client import TritonClient
    from torchship.serve.parity import check_served

    monkeypatch.setattr(TritonClient, "wire_names", lambda self, model: {})
    with pytest.raises((ClientError, ParityError)) as e:
        check_served(container_names_server.url, exported, models=["tiny_cnn_aoti"])
    assert "images" in str(e.value) or "ARGS[0]" in str(e.value), str(e.value)
