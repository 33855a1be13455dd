"""The generated repository: layout, protobuf configs, and names that agree with the manifest."""

import hashlib
import json
import shutil

import numpy as np
import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from tests.conftest import run_cli
from torchship.errors import ServerError
from torchship.manifest import read_manifest, read_reference
from torchship.serve.config import ServeConfig
from torchship.serve.embedded import TritonServer
from torchship.serve.model_config import EMBEDDED_CONFIG


def cfg(path):
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def test_layout_and_configs(repo, exported):
    m = read_manifest(exported)
    expected = {
        "tiny_cnn_onnx": ("onnxruntime_onnx", "model.onnx"),
        "tiny_cnn_torchscript": ("pytorch_libtorch", "model.pt"),
        "tiny_cnn_aoti": ("torch_aoti", "model.pt2"),
    }
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == sorted(expected)
    for name, (platform, fname) in expected.items():
        c = cfg(repo / name / "config.pbtxt")
        assert c.name == name and c.platform == platform
        assert (repo / name / "1" / fname).exists()
        # the container's PyTorch backend names an AOTInductor package's tensors by its call specification
        ins, outs = (["ARGS[0]"], ["RESULT"]) if platform == "torch_aoti" else (["images"], ["logits"])
        assert [i.name for i in c.input] == ins and [o.name for o in c.output] == outs
        assert c.output[0].label_filename == "labels.txt"
        assert (repo / name / "labels.txt").read_text().split() == m["classes"]
        assert c.version_policy.HasField("latest")
        assert c.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU and c.instance_group[0].count == 1
        w = c.model_warmup[0].inputs[ins[0]]
        assert (repo / name / "warmup" / w.input_data_file).stat().st_size == 4 * int(np.prod(w.dims))
        assert c.max_batch_size == 8 and list(c.input[0].dims) == [3, 32, 32]  # the container batches torch_aoti
        assert c.input[0].format == mc.ModelInput.FORMAT_NCHW  # image clients read the layout here
        assert c.dynamic_batching.max_queue_delay_microseconds == 2000
        if platform == "torch_aoti":
            assert c.backend == "pytorch"
            assert json.loads(c.parameters["torchship_tensor_names"].string_value) == {
                "ARGS[0]": "images",
                "RESULT": "logits",
            }
            emb = cfg(repo / name / EMBEDDED_CONFIG)
            assert emb.backend == "pytorch" and emb.max_batch_size == 8 and list(emb.input[0].dims) == [3, 32, 32]
            assert [i.name for i in emb.input] == ["images"] and [o.name for o in emb.output] == ["logits"]
            assert emb.parameters["buckets"].string_value == "1,8" and emb.default_model_filename == "buckets.pt2"
            # the batcher takes what queued, up to max_batch_size; preferred sizes would cut it down
            assert emb.HasField("dynamic_batching") and not emb.dynamic_batching.preferred_batch_size
            assert sorted(p.name for p in (repo / name / "1").iterdir()) == [
                "buckets.pt2",
                "model.pt2",
                "provenance.json",
            ]
            assert emb.input[0].format == mc.ModelInput.FORMAT_NCHW
    readme = (repo / "README.md").read_text()
    assert "nvcr.io/nvidia/tritonserver:" in readme and "The models run on the CPU (`KIND_CPU` instances)" in readme


@pytest.mark.slow
def test_without_the_aoti_package_the_aoti_model_serves_the_buckets_and_the_readme_says_so(exported, tmp_path, backend):
    """The official container's torch_aoti reads one package, not the bucket archive: where the export has no
    verified aoti package, the embedded config is the model's only config, and the README says why."""
    from torchship.manifest import write_manifest
    from torchship.serve.config import RepoConfig
    from torchship.serve.repository import build_repository

    d = tmp_path / "export"
    shutil.copytree(exported, d)
    m = read_manifest(d)
    m["artifacts"] = [a for a in m["artifacts"] if a["format"] != "aoti"]
    write_manifest(d, m)
    repo = tmp_path / "repo"
    build_repository(d, RepoConfig(out=str(repo)))
    mdir = repo / "tiny_cnn_aoti"
    assert (
        sorted(p.name for p in (mdir / "1").iterdir()) == ["buckets.pt2", "provenance.json"]
        and not (mdir / EMBEDDED_CONFIG).exists()
    )
    c = cfg(mdir / "config.pbtxt")
    assert c.backend == "pytorch" and c.parameters["buckets"].string_value == "1,8" and c.max_batch_size == 8
    assert "`tiny_cnn_aoti` holds only the bucket archive" in (repo / "README.md").read_text()
    model = backend.PyTorchModel()
    model.log = lambda *a: None
    model.initialize(
        {
            "model_config": json.dumps(config_json(c)),
            "model_name": mdir.name,
            "model_repository": str(mdir),
            "model_version": "1",
        }
    )
    ref = read_reference(d, m)
    (out,) = model.run([{"images": ref["input/random_b5/images"]}])
    np.testing.assert_allclose(
        out[0], ref["expected/random_b5/logits"], atol=m["tolerances"]["outputs"]["logits"]["atol"]
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-batch", "0"], "--max-batch must be at least 1"),
        (["--max-batch", "1000"], "exceeds the export's max batch"),
        (["--formats", "onnx", "tensorrt"], "tensorrt cannot be served"),
        (["--instance-count", "0"], "must be at least 1"),
        (
            ["--ort-accelerator", "tensorrt", "--instance-kind", "cpu"],
            "configures ONNX Runtime on a GPU, and these instances are KIND_CPU",
        ),
        (
            ["--no-trt-fp16", "--instance-kind", "gpu"],
            "--no-trt-fp16 applies to TensorRT engines only; add --ort-accelerator tensorrt",
        ),
    ],
)
def test_bad_repository_options_are_refused_and_write_nothing(exported, tmp_path, capsys, args, message):
    out = tmp_path / "repo"
    assert run_cli("repo", exported, "--out", out, *args) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.fixture(scope="module")
def gpu_repo(exported, tmp_path_factory):
    """A repository for a GPU server, built here (no GPU needed to build one)."""
    out = tmp_path_factory.mktemp("gpu") / "repo"
    assert (
        run_cli(
            "repo",
            exported,
            "--out",
            out,
            "--instance-kind",
            "gpu",
            "--ort-accelerator",
            "tensorrt",
            "--no-trt-fp16",
            "--trt-cache",
            "/engines",
        )
        == 0
    )
    return out


def config_json(config):
    """A config as Triton hands it to a backend: JSON with the proto's own field names."""
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def test_gpu_repository_configs_and_the_providers_the_backend_builds_from_them(gpu_repo, backend):
    OnnxRuntimeModel = backend.OnnxRuntimeModel
    configs = {p.parent.name + "/" + p.name: cfg(p) for p in sorted(gpu_repo.glob("*/*.pbtxt"))}
    # the image entry decodes on the CPU, in front of the ONNX model on the GPU
    pre = configs.pop("tiny_cnn_image_pre/config.pbtxt")
    assert pre.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU and pre.instance_group[0].count >= 1
    steps = configs.pop("tiny_cnn_image/config.pbtxt").ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["tiny_cnn_image_pre", "tiny_cnn_onnx"]
    # the AOTInductor package, compiled for this CPU, is left out of a repository for a GPU
    assert sorted(configs) == ["tiny_cnn_onnx/config.pbtxt", "tiny_cnn_torchscript/config.pbtxt"]
    for name, c in configs.items():
        (group,) = c.instance_group
        assert group.kind == mc.ModelInstanceGroup.KIND_GPU and list(group.gpus) == [0], name
        assert bool(c.optimization.execution_accelerators.gpu_execution_accelerator) == name.startswith(
            "tiny_cnn_onnx"
        ), name
    onnx = configs["tiny_cnn_onnx/config.pbtxt"]
    (acc,) = onnx.optimization.execution_accelerators.gpu_execution_accelerator
    assert acc.name == "tensorrt" and acc.parameters["precision_mode"] == "FP32"
    assert acc.parameters["trt_engine_cache_enable"] == "1" and acc.parameters["trt_engine_cache_path"] == "/engines"
    # what the ONNX Runtime backend asks for on a GPU instance: TensorRT first, then CUDA, then the CPU
    assert OnnxRuntimeModel().ort_providers(config_json(onnx), "cuda:0") == [
        (
            "TensorrtExecutionProvider",
            {
                "device_id": 0,
                "trt_fp16_enable": False,
                "trt_engine_cache_enable": True,
                "trt_engine_cache_path": "/engines",
            },
        ),
        ("CUDAExecutionProvider", {"device_id": 0, "use_tf32": "0"}),
        "CPUExecutionProvider",
    ]  # IEEE float32
    assert OnnxRuntimeModel().ort_providers(config_json(onnx), "cpu") == ["CPUExecutionProvider"]
    assert "The models run on GPU 0 (`KIND_GPU` instances)" in (gpu_repo / "README.md").read_text()


def test_a_gpu_instance_runs_on_cuda_where_there_is_one_and_on_the_cpu_elsewhere(gpu_repo, exported, backend):
    """The pytorch backend's instance, initialized as Triton initializes a KIND_GPU instance: its device
    follows CUDA, and its outputs still match the export's reference."""
    import torch

    mdir = gpu_repo / "tiny_cnn_torchscript"
    said = []
    model = backend.PyTorchModel()
    model.log = said.append
    model.initialize(
        {
            "model_config": json.dumps(config_json(cfg(mdir / "config.pbtxt"))),
            "model_name": mdir.name,
            "model_repository": str(mdir),
            "model_version": "1",
            "model_instance_kind": "GPU",
            "model_instance_device_id": "0",
        }
    )
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    threads = cfg(mdir / "config.pbtxt").parameters["INTRA_OP_THREAD_COUNT"].string_value
    assert said[-1].endswith(f"on {device}, {threads} intra-op thread(s)"), said
    m = read_manifest(exported)
    ref, tol = read_reference(exported, m), m["tolerances"]["outputs"]["logits"]
    (out,) = model.run([{"images": ref["input/random_b5/images"]}])
    np.testing.assert_allclose(out[0], ref["expected/random_b5/logits"], rtol=tol["rtol"], atol=tol["atol"])


def test_a_gpu_instance_runs_on_cuda_only_where_its_runtime_can(backend, monkeypatch):
    """Where a KIND_GPU instance runs, decided per backend: the pytorch backend needs a CUDA device that torch
    sees; the ONNX Runtime backend also needs an onnxruntime built with CUDA (a GPU machine with the CPU
    build of onnxruntime runs ONNX on the CPU, and the log says what to install)."""
    import onnxruntime
    import torch

    OnnxRuntimeModel, PyTorchModel = backend.OnnxRuntimeModel, backend.PyTorchModel
    gpu = {"model_instance_kind": "GPU", "model_instance_device_id": "1"}
    cuda_builds = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: cuda_builds)
    assert PyTorchModel().device_for(gpu) == ("cuda:1", "")
    assert OnnxRuntimeModel().device_for(gpu) == ("cuda:1", "")
    assert OnnxRuntimeModel().device_for({**gpu, "model_instance_kind": "CPU"}) == ("cpu", "")

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    device, why = OnnxRuntimeModel().device_for(gpu)
    assert device == "cpu" and "has no CUDAExecutionProvider; install onnxruntime-gpu" in why, why
    assert PyTorchModel().device_for(gpu) == ("cuda:1", "")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for model in (PyTorchModel(), OnnxRuntimeModel()):
        assert model.device_for(gpu) == ("cpu", "torch sees no CUDA device")


@pytest.mark.slow
def test_a_repository_serves_on_a_device_only_the_artifacts_made_for_it(int8_export, tmp_path, capsys):
    """AOTInductor packages are compiled for the device they were exported on, INT8 models quantized for its CPU:
    a GPU repository from a CPU export leaves them out, and says so in one line; the float ONNX model serves."""
    from torchship.manifest import read_manifest
    from torchship.serve.servable import not_served

    out = tmp_path / "repo"
    assert run_cli("repo", int8_export, "--out", out, "--instance-kind", "gpu") == 0
    said = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "tiny_cnn_image",
        "tiny_cnn_image_pre",
        "tiny_cnn_onnx",
    ]
    line = next(x for x in said.splitlines() if x.startswith("not served: "))
    assert line == (
        "not served: onnx_int8: quantized for the CPU it was exported on, not for a GPU (export them on a "
        "machine with the device they are to serve on); aoti_int8: compiled for the CPU it was exported on, "
        "not for a GPU (export them on a machine with the device they are to serve on)"
    ), line
    m = read_manifest(int8_export)
    assert not_served(m, device="cpu") == not_served(m) == {}  # on the CPU it was made for, all of it serves
    for a in m["artifacts"]:
        a["device"] = "cuda:0"  # as a GPU machine's export records them
    assert set(not_served(m, device="cuda")) == set() and set(not_served(m, device="cpu")) == {"onnx_int8", "aoti_int8"}


def test_serving_a_gpu_repository_without_a_gpu_is_refused_before_the_server_starts(gpu_repo, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: the repository is servable here")
    assert run_cli("serve", gpu_repo) == 2
    err = capsys.readouterr().err
    assert "asks for GPU instances (KIND_GPU in" in err and "--instance-kind cpu" in err, err


def tampered(repo, tmp_path, rel="tiny_cnn_onnx/1/model.onnx"):
    """A copy of ``repo`` with one byte of one served file changed (a flipped bit on disk, an edit after review)."""
    bad = tmp_path / "repo"
    shutil.copytree(repo, bad)
    data = bytearray((bad / rel).read_bytes())
    data[len(data) // 2] ^= 0x01
    (bad / rel).write_bytes(bytes(data))
    return bad


def test_each_version_records_the_sha256_of_its_files(repo):

    for model in ("tiny_cnn_onnx", "tiny_cnn_torchscript", "tiny_cnn_aoti"):
        vdir = repo / model / "1"
        files = json.loads((vdir / "provenance.json").read_text())["files"]
        assert set(files) == {p.name for p in vdir.iterdir()} - {"provenance.json"}
        assert all(hashlib.sha256((vdir / f).read_bytes()).hexdigest() == sha for f, sha in files.items())


def test_serve_refuses_a_tampered_repository_before_it_starts(repo, tmp_path, capsys):
    bad = tampered(repo, tmp_path)
    assert run_cli("serve", bad) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "model tiny_cnn_onnx version 1: model.onnx differs from the sha256 in provenance.json" in err[0]
    )


def test_the_backend_refuses_to_load_a_file_that_differs_from_its_hash(repo, tmp_path, backend):
    """The check inside the server itself: Triton's load of such a model fails, naming the file."""
    bad = tampered(repo, tmp_path, "tiny_cnn_torchscript/1/model.pt")
    mdir = bad / "tiny_cnn_torchscript"
    model = backend.PyTorchModel()
    model.log = lambda *a: None
    args = {
        "model_config": json.dumps(config_json(cfg(mdir / "config.pbtxt"))),
        "model_name": mdir.name,
        "model_repository": str(mdir),
        "model_version": "1",
    }
    with pytest.raises(ValueError, match="refusing to load version 1: model.pt differs from the sha256"):
        model.initialize(args)
    shutil.copy2(repo / "tiny_cnn_torchscript/1/model.pt", mdir / "1" / "model.pt")
    model.initialize(args)  # the file as recorded loads


@pytest.mark.slow
def test_a_tampered_model_is_not_served_by_a_real_triton(repo, tmp_path, monkeypatch):
    """With serve's own check out of the way, Triton's load of the model fails inside the backend and the model
    never reports ready; the log names the file."""
    bad = tampered(repo, tmp_path)
    monkeypatch.setattr(TritonServer, "check_configs", lambda self, names: None)
    server = TritonServer(ServeConfig(repo=str(bad), models=("tiny_cnn_onnx",)))
    with pytest.raises(ServerError, match="tiny_cnn_onnx failed to load") as e:
        server.start()
    assert "model.onnx differs from the sha256 in provenance.json" in str(e.value)
    server.log_path.unlink()


def test_a_models_two_configs_are_edited_together_or_not_at_all(repo, tmp_path):
    """The one function every config edit goes through: both files or neither."""
    from torchship.serve.model_config import CONFIG, edit_configs, read_config

    mdir = tmp_path / "tiny_cnn_aoti"
    shutil.copytree(repo / "tiny_cnn_aoti", mdir)
    before = {n: (mdir / n).read_text() for n in (CONFIG, EMBEDDED_CONFIG)}

    seen = []

    def fails_on_the_second(c):
        seen.append(c.name)
        if len(seen) == 2:
            raise RuntimeError("planted: the second file's edit fails")
        c.max_batch_size = 1

    with pytest.raises(RuntimeError, match="planted"):
        edit_configs(mdir, fails_on_the_second)
    assert {n: (mdir / n).read_text() for n in before} == before and sorted(p.name for p in mdir.glob(".*")) == []
    written = edit_configs(mdir, lambda c: setattr(c, "max_batch_size", 4))
    assert sorted(p.name for p in written) == sorted(before) and all(
        read_config(p).max_batch_size == 4 for p in written
    )
