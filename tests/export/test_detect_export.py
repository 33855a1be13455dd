"""A detector's export: its deployable form (fixed-shape outputs, NMS inside) in each format, verified by matching
detections. The faithful artifact passes; each planted fault, written over the artifact as it would be exported,
fails verification with exit 3, and the report names the problem."""

import copy
import hashlib
import json
import shutil

import pytest
import torch

from tests.conftest import run_cli
from torchship.checkpoint import load_meta, load_weights, resolve_checkpoint
from torchship.detectors import TopK, build_detector

pytestmark = pytest.mark.slow  # a detector trained, exported and served first (detector_run): about 90 s


@pytest.fixture(scope="module")
def detector(detector_run):
    """The shared detector run's folder (tests/conftest.py): its train/ (a tiny_fcos trained for three epochs of 400
    pictures) and export/ (TorchScript, verified), which the tests here only read."""
    return detector_run / "run"


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
    out = tmp_path / "buckets"
    assert run_cli("export", detector / "train", "--formats", "aoti_buckets", "--out", out) == 2
    assert "a detector exports to torchscript, exported_program, aoti, onnx, onnx_int8" in capsys.readouterr().err
    assert not out.exists()


def test_a_detector_from_own_weights_and_a_users_own_topk_export_serve_and_check(detector, tmp_path, capsys):
    """torchvision's FCOS class from one's own weights (--model, --weights) is exported behind TopK; a user's module
    that returns the top-K form itself (its own decoding and Fast NMS) is exported as it is, its thresholds read from
    it. Both verify by matching detections, serve, and pass infer --check over gRPC."""
    import numpy as np

    from torchship.serve.config import RepoConfig, ServeConfig
    from torchship.serve.embedded import TritonServer
    from torchship.serve.repository import build_repository

    ckpt = resolve_checkpoint(detector / "train")
    weights = load_weights(ckpt)
    torch.save(weights, tmp_path / "fcos.pt")
    torch.save({f"detector.{k}": v for k, v in weights.items()}, tmp_path / "wrapper.pt")
    with np.load(ckpt / "heldout.npz") as held:
        np.savez(tmp_path / "pictures.npz", images=held["images"].astype(np.float32))
    common = ["--input", "images:float32:B,3,128,128", "--example-inputs", tmp_path / "pictures.npz",
              "--formats", "torchscript", "--max-batch", "8"]  # fmt: skip
    models = {
        "fcos": ["--model", "torchship.detectors:tiny_fcos", "--model-arg", "num_classes=11"],
        "user": ["--model", "tests.export.user_detectors:FastNMSTopK"],
    }
    for name, flags in models.items():
        assert run_cli("export", *flags, "--weights", tmp_path / f"{'wrapper' if name == 'user' else name}.pt",
                       *common, "--out", tmp_path / name) == 0, capsys.readouterr().err[-2000:]  # fmt: skip
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert manifest["verification"]["pass"] and manifest["tolerances"]["rule"] == "detection"
        assert manifest["source"].get("wrapped") == ("TopK" if name == "fcos" else None)
        held = manifest["verification"]["artifacts"]["torchscript"]["sets"]["examples/boxes"]
        assert held["map"] == 1.0 and held["pass"]
        ref = np.load(tmp_path / name / "reference.npz")
        assert ref["expected/examples/count"].sum() > 50  # real detections matched, not an empty check
    user = json.loads((tmp_path / "user" / "manifest.json").read_text())["detection"]
    assert (user["k"], user["score_thresh"], user["iou_thresh"], user["candidates"]) == (50, 0.2, 0.6, None)
    repo = tmp_path / "repo"
    for name in models:  # one server for both: each export's models copied into one repository
        build_repository(tmp_path / name, RepoConfig(out=str(tmp_path / f"repo_{name}"), cores=1))
        shutil.copytree(tmp_path / f"repo_{name}", repo, dirs_exist_ok=True)
    server = TritonServer(ServeConfig(repo=str(repo)))
    server.start()
    try:
        for name in models:
            assert run_cli("infer", "--url", server.url, "--check", tmp_path / name) == 0
    finally:
        server.stop()
    assert capsys.readouterr().out.count("served parity: PASS") == 2


def rehash(version, file):
    """provenance.json of a served version folder with ``file``'s sha256 as it is now: what a faulty build that
    wrote the file would have recorded."""
    provenance = json.loads((version / "provenance.json").read_text())
    provenance["files"][file] = hashlib.sha256((version / file).read_bytes()).hexdigest()
    (version / "provenance.json").write_text(json.dumps(provenance))


def skip_the_resize(version):
    """The fault: a server-side letterbox that pastes the picture at its own size, cropped to the square, instead of
    scaling it to fit (the preprocessing model's carried decoder)."""
    decoder = version / "torchship_imageio.py"
    text = decoder.read_text()
    start, end = text.index("    if (nw, nh) != (w, h):"), text.index("    return out, (w, h)")
    pasted = (
        "    chw = np.asarray(im, dtype=np.float32).transpose(2, 0, 1)[:, :size, :size] / 255.0\n"
        "    out = np.full((3, size, size), pad, dtype=np.float32)\n"
        "    out[:, : chw.shape[1], : chw.shape[2]] = chw\n"
    )
    decoder.write_text(text[:start] + pasted + text[end:])
    rehash(version, "torchship_imageio.py")


def levels(bench):
    """The bench's levels of the detector's TorchScript model."""
    return json.loads((bench / "results.json").read_text())["served"]["models"]["tiny_fcos_torchscript"]["rows"]


BENCH = ["--skip-in-process", "--concurrency", "16", "--requests", "32", "--window-s", "0.2", "--max-windows", "3",
         "--load-generator", "python", "--no-cross-check", "--no-noop", "--no-raw-entry", "--no-plots",
         "--no-progress"]  # fmt: skip


def test_the_served_detector_batches_answers_picture_files_and_fails_each_planted_fault(detector, tmp_path, capsys):
    """The repository serves the fixed-shape detections with dynamic batching (the count as one value a picture),
    and an image entry that letterboxes a picture file of any size in the server as training did and answers in
    the picture's pixels: infer prints each picture's detections, none for a blank one. (That served parity passes
    from tensors and from the held-out files, and that at 16 in flight the server forms batches and the bench
    matches every response, the detector's run proves: tests/e2e/test_run_detect.py.) Then, on the same server, a
    letterbox that skips the resize fails infer --check (exit 3), and a model with its labels shifted fails it and
    the bench (every response wrong)."""
    import numpy as np
    from PIL import Image

    from torchship.serve.config import RepoConfig, ServeConfig
    from torchship.serve.embedded import TritonServer
    from torchship.serve.repository import build_repository

    export, repo = detector / "export", tmp_path / "repo"
    build_repository(export, RepoConfig(out=str(repo), cores=1))
    config = (repo / "tiny_fcos_torchscript" / "config.pbtxt").read_text()
    assert "dynamic_batching" in config and "reshape" in config and "label_filename" not in config
    assert (repo / "tiny_fcos_image_post").is_dir()
    files = sorted((export / "raw").iterdir())
    sizes = [Image.open(f).size for f in files]
    assert len(set(sizes)) > 4 and max(sizes[0]) != 128  # pictures the letterbox scales
    Image.new("RGB", (150, 100), (128, 128, 128)).save(tmp_path / "blank.png")
    server = TritonServer(ServeConfig(repo=str(repo)))
    server.start()
    try:
        assert run_cli("infer", "--url", server.url, files[0], tmp_path / "blank.png") == 0
        printed = capsys.readouterr().out
        assert run_cli("infer", "--url", server.url, "--json", files[0]) == 0
        found = json.loads(capsys.readouterr().out)["results"][0]["detections"]
        tensor = ["--model", "tiny_fcos_torchscript", "--no-raw", "--json", files[0]]  # letterboxed by infer
        assert run_cli("infer", "--url", server.url, *tensor) == 0
        square = json.loads(capsys.readouterr().out)["results"][0]["detections"]

        skip_the_resize(repo / "tiny_fcos_image_pre" / "1")
        server.load("tiny_fcos_image_pre")
        assert run_cli("infer", "--url", server.url, "--check", export) == 3
        resize = capsys.readouterr().err

        faulty(export, "labels_shifted", repo / "tiny_fcos_torchscript" / "1" / "model.pt")
        rehash(repo / "tiny_fcos_torchscript" / "1", "model.pt")
        server.load("tiny_fcos_torchscript")
        assert run_cli("infer", "--url", server.url, "--check", export, "--model", "tiny_fcos_torchscript") == 3
        labels = capsys.readouterr().err
        assert run_cli("bench", export, "--url", server.url, "--out", tmp_path / "bad_bench", *BENCH) == 3
    finally:
        server.stop()
    (bad,) = levels(tmp_path / "bad_bench")
    assert bad["wrong"] == bad["checked"] > 0, bad.get("first_wrong")
    assert f"{files[0].name}: {len(found)} detection(s)" in printed and "blank.png: no detections" in printed
    w, h = sizes[0]
    boxes = np.array([d["box"] for d in found])
    assert len(found) > 3 and (boxes[:, 2] <= w).all() and (boxes[:, 3] <= h).all()  # in the picture's pixels
    assert [d["label"] for d in square] == [d["label"] for d in found]
    mapped = np.minimum(np.array([d["box"] for d in square]) * max(w, h) / 128, [w, h, w, h])  # clipped to it
    assert np.abs(mapped - boxes).max() < 0.5
    assert "tiny_fcos_image: raw" in resize and "through the server's letterbox" in resize, resize[-2000:]
    assert "tiny_fcos_torchscript" in labels and "has no match" in labels, labels[-2000:]


REDUCED = ("onnx_int8", "aoti_bf16")  # a detector's reduced precisions, where this CPU computes them natively
EVERY_FORMAT = ("torchscript", "exported_program", "aoti", "onnx", *REDUCED)


@pytest.fixture(scope="module")
def every_format(detector, tmp_path_factory):
    """The shared detector exported to every format a detector takes, the reduced precisions optional (each
    served where it passes its gate), from a copy of its checkpoint whose deployable keeps 12 detections of 16
    candidates."""
    root = tmp_path_factory.mktemp("every_format")
    ckpt = shutil.copytree(resolve_checkpoint(detector / "train"), root / "checkpoint")
    meta = json.loads((ckpt / "meta.json").read_text())  # a smaller pool: the NMS is one graph step a candidate,
    meta["detections"].update(k=12, candidates=16)  # so every format exports and compiles several times faster
    (ckpt / "meta.json").write_text(json.dumps(meta))
    flags = ["--formats", *EVERY_FORMAT, "--optional", *REDUCED, "--max-batch", "8", "--out", root / "export"]
    assert run_cli("export", ckpt, *flags) == 0
    return root / "export"


@pytest.fixture(scope="module")
def every_format_served(every_format, tmp_path_factory):
    """One server over every_format's repository (each format that passed, and the image entry), for the tests
    that send it requests: its gRPC url."""
    from torchship.serve.config import RepoConfig, ServeConfig
    from torchship.serve.embedded import TritonServer
    from torchship.serve.repository import build_repository

    repo = tmp_path_factory.mktemp("every_format_repo") / "repo"
    build_repository(every_format, RepoConfig(out=str(repo), cores=1))
    with TritonServer(ServeConfig(repo=str(repo))) as server:
        yield server.url


def own_rule(manifest, fmt):
    """(tolerances, detection block) a format's answers are held to against its own: the export's bounds for a
    float32 artifact, twice the changes its gate measured against float32's for a reduced one."""
    from torchship.manifest import gate_row
    from torchship.tasks import DETECTION

    art = next(a for a in manifest["artifacts"] if a["format"] == fmt)
    if not art.get("gate"):
        return manifest["tolerances"], manifest["detection"]
    rule = DETECTION.reduced_response_rule(manifest, gate_row(manifest, art))
    return rule["tolerances"], rule["rule"]


def test_a_blank_picture_inside_a_batch_is_answered_right_by_every_format_and_the_image_entry(
    every_format, every_format_served, tmp_path
):
    """A blank picture among full ones, in one batch of every artifact (TorchScript, ExportedProgram, AOTInductor,
    ONNX, and the reduced precisions) and at 16 in flight through the server's batcher, for every served model and
    the image entry: it finds nothing, and each full picture beside it finds what that format finds for it alone
    (matched as verification matches)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    from PIL import Image

    from torchship import detection_parity, runtime
    from torchship.imageio import decode_picture
    from torchship.manifest import verdicts
    from torchship.serve.client import TritonClient

    export = every_format
    manifest = json.loads((export / "manifest.json").read_text())
    files = sorted((export / "raw").iterdir())[:3]
    pictures = np.stack([decode_picture(f.read_bytes(), 128)[0] for f in files])
    blank = np.full((1, 3, 128, 128), 0.5, np.float32)
    batch = np.concatenate([pictures[:1], blank, pictures[1:]])  # full, blank, full, full
    names = [o["name"] for o in manifest["outputs"]]
    runners = {
        a["format"]: runtime.load(a["format"], str(export / a["file"]), ["images"], names)
        for a in manifest["artifacts"]
    }
    alone = {  # each format's answer for each picture by itself
        fmt: {o: np.concatenate([r.run({"images": x[None]})[o] for x in batch]) for o in names}
        for fmt, r in runners.items()
    }

    def agrees(got, fmt, rows, what):
        tol, det = own_rule(manifest, fmt)
        want = {o: alone[fmt][o][rows] for o in names}
        row, failures = detection_parity.check_set(got, want, tol, det, what, len(want["count"]), False)
        assert not failures, failures

    for fmt, runner in runners.items():
        counts = alone[fmt]["count"]
        assert counts[1] == 0 and min(counts[[0, 2, 3]]) > 3, (fmt, counts)
        agrees(runner.run({"images": batch}), fmt, slice(0, 4), f"{fmt} at a batch of 4")
        agrees(runner.run({"images": batch[:2]}), fmt, slice(0, 2), f"{fmt} at a batch of 2")

    Image.new("RGB", (150, 100), (128, 128, 128)).save(tmp_path / "blank.png")
    datas = [files[0].read_bytes(), (tmp_path / "blank.png").read_bytes(), *(f.read_bytes() for f in files[1:])]
    served = {f"tiny_fcos_{f}": f for f in runners if f != "exported_program" and verdicts(manifest)[f]["pass"]}
    with TritonClient(every_format_served) as client:
        entry = "tiny_fcos_image"
        assert sorted(m for m in client.ready_models() if not m.startswith(entry)) == sorted(served)
        feed = client.config(entry)["input"][0]["name"]
        models = [*served, entry]

        def one(i):  # 16 in flight: single pictures that the batcher stacks, the blank among them
            model, p = models[i % len(models)], i % 4
            if model == entry:
                return model, p, client.infer_all(model, {feed: np.frombuffer(datas[p], np.uint8)[None]})
            return model, p, client.infer_all(model, {"images": batch[p : p + 1]})

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one, range(8 * len(models))))
    for model, p, got in answers:
        if model == entry:  # in the picture's pixels: the blank finds nothing, the others something
            assert (int(got["count"].reshape(-1)[0]) == 0) == (p == 1), (model, p, got["count"])
        else:
            agrees(got, served[model], slice(p, p + 1), f"{model} picture {p} at 16 in flight")


class ScaledLogits(TopK):
    """TopK with one weight scaled by 1.05: the classification head's last layer (its logits), a fault a wrong
    quantization scale makes. (Scaled in a layer a normalization follows, the answer does not change at all; in
    most of the backbone it moves the detections less than bf16's own rounding does.)"""

    def __init__(self, detector, size, k, candidates):
        super().__init__(detector, size, k, candidates)
        self.detector = copy.deepcopy(detector)
        with torch.no_grad():
            self.detector.head.classification_head.cls_logits.weight.mul_(1.05)


def test_a_detectors_reduced_precisions_are_gated_on_map50_and_a_scaled_weight_is_refused(
    every_format, every_format_served, tmp_path
):
    """Each reduced precision this CPU computes natively is verified under the detection gate on the held-out
    pictures (mAP@50 against the ground truth within 0.01 of float32's, against float32's detections at least 0.95,
    mean score change at most 0.01), served where it passes and checked over gRPC. Beside them, bf16 artifacts as
    a faulty exporter could write them: the faithful one passes, one with a logit weight scaled by 1.05 is
    refused."""
    from torchship.errors import ParityError
    from torchship.export.exporters import example, exported_program
    from torchship.export.source import CastWrapper
    from torchship.export.verify import verify_export
    from torchship.manifest import read_manifest, write_manifest
    from torchship.models import named
    from torchship.signature import Signature

    m = read_manifest(every_format)
    v = m["verification"]["artifacts"]
    for fmt in REDUCED:
        row = v[fmt]["sets"]["heldout"]
        assert {"map50", "eager_map50", "map50_vs_float32", "score_shift"} <= set(row), row
        within = row["map50_drop"] <= 0.01 and row["map50_vs_float32"] >= 0.95 and row["score_shift"] <= 0.01
        assert v[fmt]["pass"] == within, (fmt, row)
    assert any(v[f]["pass"] for f in REDUCED), {f: v[f]["sets"]["heldout"] for f in REDUCED}

    export = shutil.copytree(every_format, tmp_path / "export")
    sig = Signature.from_manifest(m)
    ckpt = resolve_checkpoint(m["source"]["path"])
    meta = load_meta(ckpt)
    det = build_detector("tiny_fcos", meta["num_classes"], 128)
    det.load_state_dict(load_weights(ckpt))
    gate = next(a for a in m["artifacts"] if a["format"] == "aoti_bf16")["gate"]
    (export / "planted").mkdir()
    for name, cls in {"bf16_faithful": TopK, "bf16_scaled_logits": ScaledLogits}.items():
        top = cls(det.eval(), 128, meta["detections"]["k"], meta["detections"]["candidates"]).eval()
        bf16 = named(CastWrapper(top, torch.bfloat16), ["images"]).eval()
        rel = f"planted/{name}.pt2"
        exported_program(bf16, example(sig, 2, "cpu"), export / rel, sig, m["max_batch"])
        sha = hashlib.sha256((export / rel).read_bytes()).hexdigest()
        entry = {"name": name, "format": "exported_program", "file": rel, "files": {rel: sha}, "dtype": "bfloat16"}
        m["artifacts"].append({**entry, "gate": gate})
    write_manifest(export, m)
    with pytest.raises(ParityError) as e:
        verify_export(export, only=["bf16_faithful", "bf16_scaled_logits"], log=lambda *a: None)
    v = read_manifest(export)["verification"]["artifacts"]
    assert v["bf16_faithful"]["pass"], v["bf16_faithful"]["sets"]["heldout"]
    assert not v["bf16_scaled_logits"]["pass"] and "moved their scores" in str(e.value), str(e.value)[-1500:]
    assert "gate figures on the held-out pictures" in (export / "parity.md").read_text()

    assert run_cli("infer", "--url", every_format_served, "--check", every_format) == 0
