"""Detection training and the detector's deployable form: TopK keeps exactly what the detector's own
postprocessing keeps, a run writes checkpoints that say how to deploy it, and its mAP counts every validation
picture once, over all ranks."""

import json
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import run_cli
from torchship.detectors import TopK, build_detector, detections, nms_keep
from torchship.errors import ConfigError
from torchship.train.config import TrainConfig
from torchship.train.detect import evaluate, load_pictures
from torchship.train.distributed import Dist


def spread(detector: torch.nn.Module, x: torch.Tensor) -> torch.nn.Module:
    """An untrained detector whose class scores on ``x`` differ from place to place, as a trained one's do (the
    prior init makes them all equal): class logits of standard deviation 1.5."""
    torch.manual_seed(0)
    conv = detector.eval().head.classification_head.cls_logits
    torch.nn.init.normal_(conv.weight, std=0.3)
    tk = TopK(detector, x.shape[-1])
    with torch.no_grad():
        logits = detector.head(tk._features((x - tk.mean) / tk.std))["cls_logits"]
        conv.weight *= 1.5 / logits.std()
    return detector


def threshold_for(detector, x: torch.Tensor, at_most: int) -> float:
    """A score threshold that at most ``at_most`` of any picture's scored boxes pass."""
    tk = TopK(detector, x.shape[-1], candidates=10**6)
    with torch.no_grad():
        head = detector.head(tk._features((x - tk.mean) / tk.std))
    scores = torch.sigmoid(head["cls_logits"])
    if "bbox_ctrness" in head:
        scores = torch.sqrt(scores * torch.sigmoid(head["bbox_ctrness"]))
    return float(scores.flatten(1).topk(at_most, dim=1).values[:, -1].max())


@pytest.mark.parametrize("arch", ["tiny_fcos", "retinanet_resnet50_fpn"])
def test_topk_keeps_what_the_detectors_own_postprocessing_keeps(arch):
    x = torch.rand(3, 3, 128, 128, generator=torch.Generator().manual_seed(1))
    det = spread(build_detector(arch, 11, 128), x)
    det.score_thresh = threshold_for(det, x, 150)
    tk = TopK(det, 128, k=100, candidates=160).eval()
    with torch.no_grad():
        want = det(list(x))
        got = detections(tk(x))
        boxes, scores, labels, count = tk(x)
    assert boxes.shape == (3, 100, 4) and scores.shape == (3, 100) and labels.shape == (3, 100)
    assert count.dtype == labels.dtype == torch.int64 and boxes.dtype == scores.dtype == torch.float32
    assert sum(len(w["boxes"]) for w in want) > 30  # the comparison covers real suppression work
    for w, g, n in zip(want, got, count.tolist()):
        assert len(g["boxes"]) == len(w["boxes"]) == n
        torch.testing.assert_close(g["labels"], w["labels"])
        torch.testing.assert_close(g["scores"], w["scores"], rtol=0, atol=1e-6)
        torch.testing.assert_close(g["boxes"], w["boxes"], rtol=0, atol=1e-4)
    padded = torch.arange(100)[None] >= count[:, None]
    assert not boxes[padded].any() and not scores[padded].any() and not labels[padded].any()


def test_nms_keep_is_torchvisions_batched_nms():
    from torchvision.ops import batched_nms

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        xy = torch.rand(2, 120, 2, generator=g) * 100
        boxes = torch.cat([xy, xy + 5 + torch.rand(2, 120, 2, generator=g) * 30], -1)
        scores = torch.rand(2, 120, generator=g).sort(dim=1, descending=True).values
        labels = torch.randint(0, 3, (2, 120), generator=g)
        keep = nms_keep(boxes, labels, scores > 0.2, 0.5)
        for i in range(2):
            ok = scores[i] > 0.2
            want = batched_nms(boxes[i][ok], scores[i][ok], labels[i][ok], 0.5)
            assert torch.equal(keep[i].nonzero().flatten(), want.sort().values)


class Oracle(torch.nn.Module):
    """A TopK-shaped detector that answers each validation picture with its true boxes, moved right by ``nudge``
    of their width, with labels moved by ``shift`` (only on the last picture when ``last_only``)."""

    def __init__(self, val, shift: int = 0, nudge: float = 0.0, last_only: bool = False):
        super().__init__()
        self.val, self.shift, self.nudge, self.last_only = val, shift, nudge, last_only

    def forward(self, images):
        out = torch.zeros(len(images), 100, 4), torch.zeros(len(images), 100), torch.zeros(len(images), 100).long()
        count = torch.zeros(len(images), dtype=torch.long)
        for i, img in enumerate(images):
            j = next(j for j in range(len(self.val)) if torch.equal(self.val.images[j], img))
            n, boxes = len(self.val.boxes[j]), self.val.boxes[j].clone()
            boxes[:, 0::2] += self.nudge * (boxes[:, 2:3] - boxes[:, 0:1])
            shift = self.shift if not self.last_only or j == len(self.val) - 1 else 0
            out[0][i, :n], out[1][i, :n] = boxes, 1.0
            out[2][i, :n], count[i] = self.val.labels[j] + shift, n
        return (*out, count)


def test_the_map_gate_passes_true_boxes_and_fails_an_untrained_detector():
    cfg = TrainConfig(arch="tiny_fcos", pictures=40, batch_size=4)
    _, _, val = load_pictures(cfg, 128)

    def score(model):
        return evaluate(model, val, Dist(), 3, "cpu", nullcontext)

    assert score(Oracle(val)) == {"map": 1.0, "map50": 1.0, "mar100": 1.0}
    assert score(Oracle(val, shift=1))["map50"] < 0.05  # labels count
    assert score(Oracle(val, shift=1, last_only=True))["map50"] < 1.0  # every picture counts
    nudged = score(Oracle(val, nudge=0.25))  # IoU 0.6: a hit at 0.5, a miss from 0.65 up
    assert nudged["map50"] == 1.0 and nudged["map"] < 0.5
    assert score(TopK(build_detector("tiny_fcos", 11, 128), 128))["map50"] < 0.05


def test_a_detection_run_writes_what_export_needs(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        run_cli(
            "train", "--arch", "tiny_fcos", "--pictures", "48", "--batch-size", "8", "--epochs", "1",
            "--max-steps", "2", "--no-progress", "--out", out,
        )
        == 0
    )  # fmt: skip
    ckpt = json.loads((out / "checkpoints" / "index.json").read_text())["best"]
    meta = json.loads((out / "checkpoints" / ckpt / "meta.json").read_text())
    assert meta["task"] == "detection" and meta["classes"] == [str(d) for d in range(10)]
    assert meta["num_classes"] == 11 and meta["input_shape"] == [3, 128, 128]
    assert meta["letterbox"]["size"] == 128 and meta["detections"]["k"] == 100
    assert set(meta["metrics"]) == {"map", "map50", "mar100"}
    held = np.load(out / "checkpoints" / ckpt / "heldout.npz")
    assert held["images"].shape[1:] == (3, 128, 128) and held["images"].dtype == np.float32
    n = len(held["images"])
    assert held["boxes"].shape[:1] == held["labels"].shape[:1] == held["count"].shape == (n,)
    assert (held["count"] >= 1).all() and (held["labels"][:, 0] >= 1).all()
    assert "mAP@50" in capsys.readouterr().out


def test_a_coco_set_of_other_sizes_trains_letterboxed(tmp_path):
    """Pictures of 160 x 96 reach the detector letterboxed into 128 squares, their boxes scaled by 0.8 with them."""
    from tests.train.test_detection_data import write_coco

    rng = np.random.default_rng(0)
    pictures = [rng.random((3, 96, 160)).astype(np.float32) for _ in range(10)]
    anns = [{"id": i, "image_id": 100 + i, "category_id": 7, "bbox": [10 + i, 20, 50, 40]} for i in range(10)]
    coco = write_coco(tmp_path / "coco", pictures, anns, [{"id": 7, "name": "thing"}])
    out = tmp_path / "run"
    args = ["train", "--arch", "tiny_fcos", "--data", coco, "--batch-size", "4", "--max-steps", "1", "--no-progress"]
    assert run_cli(*args, "--out", out) == 0
    ckpt = out / "checkpoints" / "step-0000001"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["classes"] == ["thing"] and meta["num_classes"] == 2 and meta["input_shape"] == [3, 128, 128]
    held = np.load(ckpt / "heldout.npz")
    assert (held["images"][:, :, 77:, :] == 0.5).all()  # 96 * 0.8 = 76.8 rows of picture, then the padding
    x0 = held["boxes"][:, 0, 0] / 0.8 - 10  # each picture's own box, found by its x
    assert np.allclose(x0, x0.round()) and set(x0.round().astype(int)) <= set(range(10))
    b = held["boxes"][:, 0] / 0.8
    assert np.allclose(b[:, [1, 3]], [20, 60], atol=1e-4) and np.allclose(b[:, 2] - b[:, 0], 50, atol=1e-4)
    assert (held["labels"][:, 0] == 1).all()


@pytest.mark.slow
def test_a_detector_topk_cannot_carry_trains_and_is_scored_as_in_eager(tmp_path):
    out = tmp_path / "frcnn"
    arch = "fasterrcnn_mobilenet_v3_large_320_fpn"
    args = ["train", "--arch", arch, "--pictures", "24", "--batch-size", "4", "--max-steps", "1", "--no-progress"]
    assert run_cli(*args, "--out", out) == 0
    meta = json.loads((out / "checkpoints" / "step-0000001" / "meta.json").read_text())
    assert meta["task"] == "detection" and meta["detections"] is None  # no fixed-shape form
    assert set(meta["metrics"]) == {"map", "map50", "mar100"}
    with pytest.raises(ConfigError, match="FasterRCNN cannot be exported with its postprocessing inside"):
        TopK(build_detector(arch, 11, 128), 128)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--data", "synthetic"], "detection reads 'digits'"),
        (["--image-size", "100"], "a multiple of 32"),
        (["--compile"], "--compile: not supported for detection"),
        (["--data", "nope.json"], "no such COCO instances file"),
    ],
)
def test_detection_refuses_what_it_cannot_train(tmp_path, capsys, flags, message):
    base = ["train", "--arch", "tiny_fcos", "--pictures", "16", "--batch-size", "4", "--no-progress"]
    assert run_cli(*base, *flags, "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.slow
def test_two_ranks_train_a_detector_and_score_every_validation_picture_once(tmp_path):
    """A 2-rank run trains and checkpoints once; each rank's mAP covers the pictures of both (an oracle wrong on
    the last picture alone scores as it does in one process)."""
    from tests.train.test_distributed import torchrun

    root = Path(__file__).parents[2]  # the worker imports the oracle from this module
    r = torchrun(str(Path(__file__).parent / "detect_worker.py"), str(tmp_path), env={"PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stderr[-3000:]
    root = tmp_path / "train" / "checkpoints"
    meta = json.loads((root / json.loads((root / "index.json").read_text())["best"] / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["task"] == "detection"
    _, _, val = load_pictures(TrainConfig(arch="tiny_fcos", pictures=60, batch_size=8), 128)
    alone = evaluate(Oracle(val, shift=1, last_only=True), val, Dist(), 3, "cpu", nullcontext)
    assert 0 < alone["map50"] < 1
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == pytest.approx(alone, abs=1e-9)
