"""Detectors: the built-in ``tiny_fcos``, torchvision's one-stage and two-stage detectors by name, and TopK, the
deployable form of a one-stage detector: letterboxed pictures in, a fixed number of detections per picture out
(boxes [B, K, 4] xyxy in the square's pixels, scores [B, K], labels [B, K], count [B]), with the score threshold
and class-aware non-maximum suppression inside the graph, so that every format can carry it and a batcher can
stack its answers."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from torchship.errors import ConfigError

# torchvision.models.detection builders torchship trains by name (weights=None); tiny_fcos is torchship's own
DETECTION_ARCHS = (
    "tiny_fcos",
    "fcos_resnet50_fpn",
    "retinanet_resnet50_fpn",
    "retinanet_resnet50_fpn_v2",
    "ssdlite320_mobilenet_v3_large",
    "fasterrcnn_mobilenet_v3_large_320_fpn",
)
TOPK_DEFAULTS = {"k": 100, "candidates": 256}  # detections per picture; scored boxes that go into the NMS


def is_detector(arch: str) -> bool:
    return arch in DETECTION_ARCHS


class _Backbone(nn.Sequential):
    """Six 3x3 conv-BN-ReLU layers, three of them of stride 2: one feature map of stride 8."""

    def __init__(self, widths=(32, 32, 64, 64, 96, 96)):
        layers, c = [], 3
        for i, w in enumerate(widths):
            layers += [nn.Conv2d(c, w, 3, stride=2 if i % 2 else 1, padding=1, bias=False), nn.BatchNorm2d(w)]
            layers.append(nn.ReLU(inplace=True))
            c = w
        super().__init__(*layers)
        self.out_channels = c


def tiny_fcos(num_classes: int, size: int = 128, **extra: Any) -> nn.Module:
    """A 0.55M-parameter FCOS (torchvision's FCOS with a small backbone and one level of stride 8) for pictures of
    ``size`` x ``size``: trained from scratch on the built-in digits it passes an mAP@50 gate in minutes on a CPU.
    ``num_classes`` counts the background (label 0)."""
    from torchvision.models.detection import FCOS
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.fcos import FCOSHead

    backbone = _Backbone()
    anchors = AnchorGenerator(sizes=((32,),), aspect_ratios=((1.0,),))
    head = FCOSHead(backbone.out_channels, 1, num_classes, num_convs=2)
    return FCOS(backbone, num_classes, min_size=size, max_size=size, anchor_generator=anchors, head=head, **extra)


def build_detector(arch: str, num_classes: int, size: int, extra: dict[str, Any] | None = None) -> nn.Module:
    """An untrained detector for ``num_classes`` labels (the background, 0, included) that takes pictures of
    ``size`` x ``size`` as they are (its own transform does not resize them). ConfigError for an unknown name."""
    extra = dict(extra or {})
    if arch == "tiny_fcos":
        return tiny_fcos(num_classes, size, **extra)
    if ":" in arch:
        from torchship.models import make_model

        return make_model(arch, "--arch", {"num_classes": num_classes, **extra})
    if arch not in DETECTION_ARCHS:
        raise ConfigError(f"--arch {arch!r} is not a detector; use one of {', '.join(DETECTION_ARCHS)}")
    import torchvision

    if not arch.startswith("ssd"):  # SSD resizes to the square its builder fixes (320 x 320)
        extra.update(min_size=size, max_size=size)
    return torchvision.models.get_model(arch, weights=None, weights_backbone=None, num_classes=num_classes, **extra)


def nms_keep(boxes: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, iou_thresh: float) -> torch.Tensor:
    """Greedy class-aware non-maximum suppression with fixed shapes: ``boxes`` [B, N, 4] xyxy sorted by score
    (highest first), ``labels`` [B, N], ``valid`` [B, N] bool (above the score threshold). Returns [B, N] bool:
    the boxes torchvision's batched_nms keeps. N sequential steps of [B, N] work, each a few graph nodes, so that
    TorchScript, torch.export and ONNX carry it without data-dependent shapes."""
    n = boxes.shape[1]
    lt = torch.maximum(boxes[:, :, None, :2], boxes[:, None, :, :2])
    rb = torch.minimum(boxes[:, :, None, 2:], boxes[:, None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area = (boxes[..., 2:] - boxes[..., :2]).clamp(min=0).prod(-1)
    union = area[:, :, None] + area[:, None, :] - inter
    over = inter > iou_thresh * union  # IoU > threshold, without a division by a zero union
    over = over & (labels[:, :, None] == labels[:, None, :])
    over = over & torch.ones(n, n, dtype=torch.bool, device=boxes.device).triu(1)  # only later (lower) boxes
    keep = valid
    steps = n
    if type(valid) is torch.Tensor and not (torch.jit.is_tracing() or torch.compiler.is_compiling()):
        # run eagerly (not traced, exported or compiled): a step whose box no row keeps changes nothing, and no row
        # keeps a box past the last valid one
        anywhere = valid.any(0).nonzero()
        steps = int(anywhere.max()) + 1 if len(anywhere) else 0
    for i in range(steps):
        keep = keep & ~(keep[:, i : i + 1] & over[:, i, :])
    return keep


def has_topk(detector: nn.Module) -> bool:
    """Whether TopK can carry ``detector``'s postprocessing."""
    return type(detector).__name__ in ("FCOS", "RetinaNet")


class OwnPostprocessing(nn.Module):
    """A detector whose postprocessing TopK cannot carry (two-stage, SSD), called as in eager: a list of
    dicts of boxes, scores and labels per picture."""

    def __init__(self, detector: nn.Module):
        super().__init__()
        self.detector = detector

    def forward(self, images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        return self.detector(list(images))


class TopK(nn.Module):
    """A trained one-stage detector (FCOS or RetinaNet, torchvision's classes or the built-in tiny_fcos) as a
    fixed-shape graph: ``images`` [B, 3, S, S] in [0, 1] (letterboxed, torchship.boxes) -> boxes [B, K, 4] float32
    (xyxy, the square's pixels), scores [B, K] float32, labels [B, K] int64 and count [B] int64 (boxes and scores
    in the images' dtype). The first ``count``
    rows of each picture are its detections, highest score first; the rest are zeros.

    It computes what the detector's own postprocessing does (the same scores, box decoding, clipping, score
    threshold and class-aware NMS), over the ``candidates`` highest-scored boxes of the picture: it differs from
    torchvision's only when more than that many boxes pass the score threshold."""

    def __init__(self, detector: nn.Module, size: int, k: int | None = None, candidates: int | None = None):
        super().__init__()
        if not has_topk(detector):
            raise ConfigError(
                f"{type(detector).__name__} cannot be exported with its postprocessing inside: only one-stage FCOS "
                "and RetinaNet detectors have a fixed-shape form (a two-stage detector's proposals and SSD's "
                "per-class NMS do not)"
            )
        self.detector = detector
        self.size = size
        self.k = int(k or TOPK_DEFAULTS["k"])
        self.candidates = int(candidates or max(TOPK_DEFAULTS["candidates"], self.k))
        self.score_thresh = float(detector.score_thresh)
        self.iou_thresh = float(detector.nms_thresh)
        t = detector.transform
        self.register_buffer("mean", torch.tensor(t.image_mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(t.image_std).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("anchors", self._anchors(), persistent=False)

    @torch.no_grad()
    def _anchors(self) -> torch.Tensor:
        """Every location's anchor for a picture of size x size: fixed, so computed once."""
        from torchvision.models.detection.image_list import ImageList

        det = self.detector
        was = det.training
        det.eval()
        p = next(det.parameters())
        x = torch.zeros(1, 3, self.size, self.size, device=p.device, dtype=p.dtype)
        feats = self._features(x)
        anchors = det.anchor_generator(ImageList(x, [(self.size, self.size)]), feats)[0]
        det.train(was)
        return anchors

    def _features(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = self.detector.backbone(x)
        return [out] if isinstance(out, torch.Tensor) else list(out.values())

    def forward(self, images: torch.Tensor):
        det = self.detector
        x = (images - self.mean) / self.std
        head = det.head(self._features(x))
        scores = torch.sigmoid(head["cls_logits"])  # [B, A, C]
        if "bbox_ctrness" in head:
            scores = torch.sqrt(scores * torch.sigmoid(head["bbox_ctrness"]))
        b, a, c = scores.shape
        top, idx = scores.flatten(1).topk(min(self.candidates, a * c), dim=1)  # sorted, highest first
        where = torch.div(idx, c, rounding_mode="floor")
        labels = idx % c
        reg = head["bbox_regression"].gather(1, where[..., None].expand(-1, -1, 4))
        anchors = self.anchors[where]
        if "bbox_ctrness" in head:
            boxes = det.box_coder.decode(reg.reshape(-1, 4), anchors.reshape(-1, 4))
        else:
            boxes = det.box_coder.decode_single(reg.reshape(-1, 4), anchors.reshape(-1, 4))
        boxes = boxes.reshape(b, -1, 4).clamp(0, self.size)
        keep = nms_keep(boxes, labels, top > self.score_thresh, self.iou_thresh)
        kept, order = torch.where(keep, top, torch.full_like(top, -1.0)).topk(self.k, dim=1)
        present = kept >= 0
        count = present.sum(1)
        boxes = boxes.gather(1, order[..., None].expand(-1, -1, 4)) * present[..., None]
        labels = labels.gather(1, order) * present
        return boxes, kept * present, labels.long(), count.long()


def deployable(detector: nn.Module, meta: dict[str, Any]) -> "TopK":
    """The TopK a detection checkpoint's meta describes, around its ``detector`` (weights loaded, eval mode)."""
    det = meta.get("detections")
    if not det:
        TopK(detector, meta["input_shape"][-1])  # raises, saying why this detector has no fixed-shape form
    return TopK(detector, meta["input_shape"][-1], det["k"], det["candidates"]).eval()


def detections(outputs) -> list[dict[str, torch.Tensor]]:
    """TopK's outputs as one dict of boxes, scores and labels per picture (its first ``count`` rows); a list of
    such dicts (OwnPostprocessing's) as it is."""
    if isinstance(outputs, list):
        return outputs
    boxes, scores, labels, count = outputs
    return [
        OrderedDict(boxes=boxes[i, :n], scores=scores[i, :n], labels=labels[i, :n])
        for i, n in enumerate(count.tolist())
    ]
