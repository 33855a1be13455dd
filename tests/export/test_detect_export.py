"""A detector's export: its deployable form (fixed-shape outputs, NMS inside) in each format, verified by matching
detections. The faithful artifact passes; each planted fault, written over the artifact as it would be exported,
fails verification with exit 3, and the report names the problem."""

import hashlib
import json
import shutil

import pytest
import torch

from tests.conftest import run_cli
from torchship.checkpoint import load_meta, load_weights, resolve_checkpoint
from torchship.detectors import TopK, build_detector

pytestmark = pytest.mark.slow  # a detector trained to detect, then exported: about half a minute before any test


@pytest.fixture(scope="module")
def detector(tmp_path_factory):
    """A tiny_fcos trained for two epochs (many detections, many of them overlapping: the NMS has work), exported
    to TorchScript and verified."""
    root = tmp_path_factory.mktemp("detector")
    args = ["train", "--arch", "tiny_fcos", "--pictures", "200", "--epochs", "2", "--no-progress"]
    assert run_cli(*args, "--out", root / "train") == 0
    export = ["export", root / "train", "--formats", "torchscript", "--max-batch", "8", "--out", root / "export"]
    assert run_cli(*export) == 0
    return root


class Planted(TopK):
    """TopK with one fault of the kinds that break a detector's export while its eager model stays right."""

    def __init__(self, detector, size, k, candidates, fault):
        super().__init__(detector, size, k, candidates)
        self.fault = fault
        if fault == "nms_iou":
            self.iou_thresh = 0.45

    def forward(self, images):
        boxes, scores, labels, count = super().forward(images)
        if self.fault == "xywh":
            boxes = torch.cat([boxes[..., :2], boxes[..., 2:] - boxes[..., :2]], -1)
        if self.fault == "score_offset":
            scores = scores + 0.01 * (count[:, None] > torch.arange(scores.shape[1]))
        if self.fault == "labels_shifted":
            labels = labels + (count[:, None] > torch.arange(labels.shape[1])).long()
        return boxes, scores, labels, count


def faulty(export, fault, path):
    """The TorchScript file a faulty exporter would have written for ``export``'s detector, at ``path``; its
    sha256."""
    manifest = json.loads((export / "manifest.json").read_text())
    ckpt = resolve_checkpoint(manifest["source"]["path"])
    meta = load_meta(ckpt)
    det = build_detector("tiny_fcos", meta["num_classes"], 128)
    det.load_state_dict(load_weights(ckpt))
    model = Planted(det.eval(), 128, meta["detections"]["k"], meta["detections"]["candidates"], fault).eval()
    path.parent.mkdir(exist_ok=True)
    with torch.no_grad():
        torch.jit.trace(model, torch.rand(2, 3, 128, 128)).save(path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def plant(export, faults, out):
    """A copy of ``export`` with one TorchScript artifact per fault beside the faithful one (named torchscript_FAULT,
    under its own folder, in the manifest with its hash): what faulty exporters would have written."""
    shutil.copytree(export, out)
    manifest = json.loads((out / "manifest.json").read_text())
    faithful = manifest["artifacts"][0]
    for fault in faults:
        file = f"torchscript_{fault}/model.pt"
        sha = faulty(export, fault, out / file)
        manifest["artifacts"].append({**faithful, "name": f"torchscript_{fault}", "file": file, "files": {file: sha}})
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_the_faithful_detector_passes_with_every_detection_paired(detector):
    manifest = json.loads((detector / "export" / "manifest.json").read_text())
    assert manifest["verification"]["pass"] and manifest["tolerances"]["rule"] == "detection"
    assert [o["name"] for o in manifest["outputs"]] == ["boxes", "scores", "labels", "count"]
    assert manifest["detection"]["k"] == 100 and manifest["detection"]["letterbox"]["size"] == 128
    held = manifest["verification"]["artifacts"]["torchscript"]["sets"]["heldout/boxes"]
    assert held["map"] == 1.0 and held["pass"]
    ref = dict(**__import__("numpy").load(detector / "export" / "reference.npz"))
    assert ref["expected/heldout/count"].sum() > 100  # real detections to match, not an empty check
    assert "mAP 1.0000 against eager's detections" in (detector / "export" / "parity.md").read_text()


FAULTS = {"xywh": "has no match", "score_offset": "a matched score is", "nms_iou": "has no match",
          "labels_shifted": "has no match"}  # fmt: skip


def test_each_planted_fault_fails_verification(detector, tmp_path, capsys):
    bad = plant(detector / "export", FAULTS, tmp_path / "bad")
    assert run_cli("verify", bad) == 3
    err = capsys.readouterr().err
    verdicts = json.loads((bad / "manifest.json").read_text())["verification"]["artifacts"]
    assert verdicts["torchscript"]["pass"]  # the faithful one, verified beside them
    for fault, says in FAULTS.items():
        assert not verdicts[f"torchscript_{fault}"]["pass"], fault
        assert any(says in f for f in verdicts[f"torchscript_{fault}"]["failures"]), (fault, err[-2000:])
        assert f"torchscript_{fault}: heldout" in err


def test_a_detector_is_refused_formats_that_cannot_carry_it(detector, tmp_path, capsys):
    out = tmp_path / "int8"
    assert run_cli("export", detector / "train", "--formats", "onnx_int8", "--out", out) == 2
    assert "a detector exports to torchscript, exported_program, aoti, onnx" in capsys.readouterr().err
    assert not out.exists()


def test_the_served_detector_batches_and_answers_as_verified(detector, tmp_path, capsys):
    """The repository serves the fixed-shape detections with dynamic batching (the count as one value a picture),
    and served parity over gRPC matches them as the verifier does; at 16 in flight the server forms batches and
    the bench matches every response the same way. A wrong model in the served folder fails both."""
    from serve.config import RepoConfig, ServeConfig
    from serve.embedded import TritonServer
    from serve.repository import build_repository

    for repo in (tmp_path / "repo", tmp_path / "bad_repo"):
        build_repository(detector / "export", RepoConfig(out=str(repo), cores=1, image_entry=False))
    version = tmp_path / "bad_repo" / "tiny_fcos_torchscript" / "1"  # a wrong model in the served folder
    faulty(detector / "export", "labels_shifted", version / "model.pt")
    provenance = json.loads((version / "provenance.json").read_text())
    provenance["files"]["model.pt"] = hashlib.sha256((version / "model.pt").read_bytes()).hexdigest()  # as written
    (version / "provenance.json").write_text(json.dumps(provenance))
    config = (tmp_path / "repo" / "tiny_fcos_torchscript" / "config.pbtxt").read_text()
    assert "dynamic_batching" in config and "reshape" in config and "label_filename" not in config
    bench = ["--skip-in-process", "--concurrency", "16", "--requests", "64", "--window-s", "0.2", "--max-windows",
             "3", "--load-generator", "python", "--no-cross-check", "--no-noop", "--no-raw-entry", "--no-plots",
             "--no-progress"]  # fmt: skip
    for repo, code in ((tmp_path / "repo", 0), (tmp_path / "bad_repo", 3)):
        server = TritonServer(ServeConfig(repo=str(repo)))
        server.start()
        try:
            assert run_cli("infer", "--url", server.url, "--check", detector / "export") == code
            out = tmp_path / f"bench_{repo.name}"
            assert run_cli("bench", detector / "export", "--url", server.url, "--out", out, *bench) == code
        finally:
            server.stop()
        (row,) = json.loads((out / "results.json").read_text())["served"]["models"]["tiny_fcos_torchscript"]["rows"]
        assert row["checked"] == row["sent"] >= 64 and row["failed"] == 0
        assert row["wrong"] == (0 if code == 0 else row["checked"]), row.get("first_wrong")
        if code == 0:
            assert row["server"]["avg_batch"] > 1
    out = capsys.readouterr()
    assert "served parity: PASS" in out.out and "has no match" in out.err
