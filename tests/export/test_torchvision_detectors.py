"""torchvision's own detectors as users bring them: SSDlite320-MobileNetV3 and Faster R-CNN MobileNetV3-320 behind
the top-K wrapper users write (tests/export/user_detectors.py: torchvision's transform, decoding and batched_nms,
one picture at a time, padded to K), from fresh weights with their BatchNorm statistics measured on the built-in
pictures. Each exports to TorchScript and ONNX (torch.export cannot capture them: the TorchScript-based exporter
makes the ONNX file), verifies by matching detections, serves, and passes infer --check over gRPC, the image entry
included. A graph traced at one batch size, as a plain trace of such a wrapper is, fails verification."""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest
import torch

from tests.conftest import run_cli
from tests.export import user_detectors
from torchship.io import sha256_file
from torchship.manifest import read_manifest, write_manifest

pytestmark = pytest.mark.slow  # two exports (about 30 s each) and one server

SIZE = 320
MODELS = {  # factory, the threshold given as a model argument (a blank picture scores below it)
    "ssdlite": ("score_thresh=0.2", 0.2, 0.55),
    "fasterrcnn": ("box_score_thresh=0.11", 0.11, 0.5),
}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Each model exported (torchscript, onnx) from its weights, with real example pictures (a blank one last)
    and picture files (a blank one among them): {name: export folder}."""
    from PIL import Image

    from torchship.boxes import letterbox
    from torchship.train.detection_data import builtin_detection

    root = tmp_path_factory.mktemp("tv_detectors")
    data = builtin_detection(40, 256, seed=0)  # pictures of 192 to 384 pixels a side, letterboxed into 320
    pictures = torch.from_numpy(np.stack([letterbox(im, SIZE)[0] for im in data.images]))
    blank = np.full((1, 3, SIZE, SIZE), 0.5, np.float32)
    np.savez(root / "pictures.npz", images=np.concatenate([pictures[37:].numpy(), blank]))  # three and a blank
    (root / "files").mkdir()
    for i, im in enumerate(data.images[:4]):
        Image.fromarray(im).save(root / "files" / f"picture-{i}.png")
    Image.new("RGB", (300, 200), (128, 128, 128)).save(root / "files" / "blank.png")
    out = {}
    for name, (arg, _, _) in MODELS.items():
        torch.manual_seed(0)
        torch.save(user_detectors.recalibrated(getattr(user_detectors, name)(), pictures[:32]), root / f"{name}.pt")
        flags = ["--model", f"tests.export.user_detectors:{name}", "--model-arg", arg, "--weights", root / f"{name}.pt",
                 "--input", f"images:float32:B,3,{SIZE},{SIZE}", "--example-inputs", root / "pictures.npz",
                 "--image-files", root / "files", "--max-batch", "4", "--odd-batch", "3",
                 "--formats", "torchscript", "onnx"]  # fmt: skip
        assert run_cli("export", *flags, "--out", root / name) == 0
        out[name] = root / name
    return out


def test_each_exports_to_torchscript_and_onnx_with_its_own_postprocessing(exports):
    for name, (_, score, iou) in MODELS.items():
        export = exports[name]
        m = read_manifest(export)
        assert m["verification"]["pass"] and m["tolerances"]["rule"] == "detection", name
        by = {a["format"]: a for a in m["artifacts"]}
        assert by["torchscript"]["per_picture"] and "torchvision::nms" in by["torchscript"]["torchvision_ops"]
        assert by["onnx"]["exporter"] == "torchscript" and by["onnx"]["per_picture"]
        assert by["onnx"]["exporter_why"].startswith("torch.export cannot capture the model: it loops over")
        det = m["detection"]
        assert (det["score_thresh"], det["iou_thresh"]) == (score, iou), det  # the final detections', read from it
        ref = np.load(export / "reference.npz")
        count = ref["expected/examples/count"]
        assert count[-1] == 0 and count[:-1].sum() > 30, count  # the blank picture finds nothing, in its batch
        for fmt in ("torchscript", "onnx"):
            held = m["verification"]["artifacts"][fmt]["sets"]["examples/boxes"]
            assert held["map"] == 1.0 and held["pass"], (name, fmt, held)
        report = (export / "parity.md").read_text()
        assert "`onnx` was made by the TorchScript-based ONNX exporter" in report
        assert "as a loop over the batch's pictures" in report
    assert "torchvision::roi_align" in read_manifest(exports["fasterrcnn"])["artifacts"][0]["torchvision_ops"]


def test_each_serves_and_passes_infer_check_over_grpc_the_image_entry_included(exports, tmp_path, capsys):
    from torchship.serve.config import RepoConfig, ServeConfig
    from torchship.serve.embedded import TritonServer
    from torchship.serve.repository import build_repository

    repo = tmp_path / "repo"
    for name, export in exports.items():
        build_repository(export, RepoConfig(out=str(tmp_path / name), cores=1))
        config = (tmp_path / name / f"{name}_torchscript" / "config.pbtxt").read_text()
        assert 'platform: "pytorch_libtorch"' in config and "dynamic_batching" in config
        readme = (tmp_path / name / "README.md").read_text()
        assert "torchvision::nms" in readme and "TRITON_PYTORCH_ENABLE_TORCHVISION" in readme
        shutil.copytree(tmp_path / name, repo, dirs_exist_ok=True)
    server = TritonServer(ServeConfig(repo=str(repo)))
    server.start()
    try:
        for name, export in exports.items():
            assert run_cli("infer", "--url", server.url, "--check", export) == 0, name
            checked = capsys.readouterr().out
            assert f"| {name}_image | raw | 5 |" in checked and "served parity: PASS (3 models" in checked, checked[
                -2000:
            ]
            files = sorted((export / "raw").iterdir())
            assert run_cli("infer", "--url", server.url, "--model", f"{name}_image", *files) == 0
            printed = capsys.readouterr().out
            assert "blank.png: no detections" in printed and "picture-0.png: " in printed, printed[-2000:]
    finally:
        server.stop()


def test_a_graph_traced_at_one_batch_size_fails_verification(exports, tmp_path):
    """The planted fault: the wrapper traced as it is at a batch of 2 (what a plain trace gives; its Python loop
    over the pictures unrolled twice), listed beside the faithful artifacts. It fails at every other batch size."""
    from torchship.errors import ParityError
    from torchship.export.verify import verify_export

    export = shutil.copytree(exports["ssdlite"], tmp_path / "ssdlite")
    m = read_manifest(export)
    model = user_detectors.ssdlite(score_thresh=0.2)
    model.load_state_dict(_weights(export))
    flat = _Flat(model.eval())
    rel = "fixed/model.pt"
    (export / "fixed").mkdir()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's own: that this graph will not hold at other inputs
        torch.jit.trace(flat, torch.rand(2, 3, SIZE, SIZE), check_trace=False).save(export / rel)
    entry = {**m["artifacts"][0], "name": "torchscript_fixed", "file": rel, "files": {rel: sha256_file(export / rel)}}
    m["artifacts"].append(entry)
    write_manifest(export, m)
    with pytest.raises(ParityError) as e:  # the faithful artifacts' verdicts, kept, are the first test's
        verify_export(export, only=["torchscript_fixed"], log=lambda *a: None)
    v = read_manifest(export)["verification"]["artifacts"]
    assert v["torchscript"]["pass"] and not v["torchscript_fixed"]["pass"]
    assert "torchscript_fixed" in str(e.value), str(e.value)[-2000:]


def _weights(export):
    return torch.load(json.loads((export / "manifest.json").read_text())["source"]["weights"], weights_only=True)


class _Flat(torch.nn.Module):
    """The wrapper's dict as the export's four outputs, in order."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, images):
        out = self.model(images)
        return out["boxes"], out["scores"], out["labels"], out["count"]
