"""A detector wrapped the way users write their own fixed-shape top-K: torchvision's FCOS (here the built-in
tiny_fcos) with its decoding and a Fast NMS (YOLACT's: one matrix of IoUs, each box suppressed by any
higher-scored box of its label, no sequential steps) in the forward, returning boxes, scores, labels and count."""

from __future__ import annotations

import torch
from torch import nn

from torchship.detectors import tiny_fcos


class FastNMSTopK(nn.Module):
    """images [B, 3, S, S] in [0, 1] -> boxes [B, K, 4], scores [B, K], labels [B, K], count [B]."""

    def __init__(self, num_classes: int = 11, size: int = 128, k: int = 50, candidates: int = 128):
        super().__init__()
        self.detector = tiny_fcos(num_classes, size)
        self.size, self.k, self.candidates = size, k, candidates
        self.score_thresh, self.iou_thresh = 0.2, 0.6  # what the verifier's exceptions read

    def forward(self, images: torch.Tensor):
        det = self.detector
        t = det.transform
        x = (images - torch.tensor(t.image_mean)[:, None, None]) / torch.tensor(t.image_std)[:, None, None]
        feats = [det.backbone(x)]
        head = det.head(feats)
        scores = torch.sqrt(torch.sigmoid(head["cls_logits"]) * torch.sigmoid(head["bbox_ctrness"]))
        b, a, c = scores.shape
        top, idx = scores.flatten(1).topk(self.candidates, dim=1)
        where, labels = torch.div(idx, c, rounding_mode="floor"), idx % c
        # FCOS's anchors on its one level of stride 8: each location's 32 x 32 square
        side = self.size // 8
        ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        centers = torch.stack([xs, ys], -1).reshape(-1, 2).to(images.dtype) * 8
        anchors = torch.cat([centers - 16, centers + 16], -1)[where]
        reg = head["bbox_regression"].gather(1, where[..., None].expand(-1, -1, 4))
        ctr = (anchors[..., :2] + anchors[..., 2:]) / 2
        wh = anchors[..., 2:] - anchors[..., :2]
        boxes = torch.cat([ctr - reg[..., :2] * wh, ctr + reg[..., 2:] * wh], -1).clamp(0, self.size)
        lt = torch.maximum(boxes[:, :, None, :2], boxes[:, None, :, :2])
        rb = torch.minimum(boxes[:, :, None, 2:], boxes[:, None, :, 2:])
        inter = (rb - lt).clamp(min=0).prod(-1)
        area = (boxes[..., 2:] - boxes[..., :2]).prod(-1)
        iou = inter / (area[:, :, None] + area[:, None, :] - inter).clamp(min=1e-6)
        same = labels[:, :, None] == labels[:, None, :]
        higher = torch.ones(self.candidates, self.candidates, dtype=torch.bool).triu(1)
        suppressed = ((iou > self.iou_thresh) & same & higher).any(1)
        keep = (top > self.score_thresh) & ~suppressed
        kept, order = torch.where(keep, top, torch.full_like(top, -1.0)).topk(self.k, dim=1)
        present = kept >= 0
        boxes = boxes.gather(1, order[..., None].expand(-1, -1, 4)) * present[..., None]
        labels = labels.gather(1, order) * present
        return {"boxes": boxes, "scores": kept * present, "labels": labels.long(), "count": present.sum(1)}


class TorchvisionTopK(nn.Module):
    """A torchvision detector behind the top-K form as users write it: the detector's own transform, decoding and
    postprocessing (torchvision's batched_nms) run as in eager, one picture at a time, and each picture's first K
    detections padded with zeros. images [B, 3, S, S] in [0, 1] -> boxes [B, K, 4], scores [B, K], labels [B, K],
    count [B]."""

    def __init__(self, model: nn.Module, k: int = 100):
        super().__init__()
        self.model, self.k = model, k

    def forward(self, images: torch.Tensor):
        found = self.model(list(images))
        boxes, scores, labels = [], [], []
        for d in found:
            b, s, lab = d["boxes"][: self.k], d["scores"][: self.k], d["labels"][: self.k]
            pad = self.k - s.shape[0]
            boxes.append(nn.functional.pad(b, (0, 0, 0, pad)))
            scores.append(nn.functional.pad(s, (0, pad)))
            labels.append(nn.functional.pad(lab, (0, pad)))
        scores = torch.stack(scores)
        return {
            "boxes": torch.stack(boxes),
            "scores": scores,
            "labels": torch.stack(labels),
            "count": (scores > 0).sum(1),
        }


def ssdlite(num_classes: int = 11, k: int = 100, **kw) -> TorchvisionTopK:
    """torchvision's SSDlite320-MobileNetV3 (pictures 320 x 320) behind TorchvisionTopK."""
    from torchvision.models.detection import ssdlite320_mobilenet_v3_large

    return TorchvisionTopK(
        ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=num_classes, **kw), k
    )


def fasterrcnn(num_classes: int = 11, k: int = 100, **kw) -> TorchvisionTopK:
    """torchvision's Faster R-CNN MobileNetV3-Large 320 FPN behind TorchvisionTopK."""
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

    model = fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None, num_classes=num_classes, **kw)
    return TorchvisionTopK(model, k)


@torch.no_grad()
def recalibrated(model: nn.Module, pictures: torch.Tensor, batch: int = 8) -> dict[str, torch.Tensor]:
    """``model``'s weights (fresh ones) with every BatchNorm's statistics measured on ``pictures``: with its
    initial statistics a fresh network's activations do not depend on the picture, and it detects nothing."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    model.eval()
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over every batch
        m.train()
    for i in range(0, len(pictures), batch):
        model(pictures[i : i + batch])
    model.eval()
    return model.state_dict()
