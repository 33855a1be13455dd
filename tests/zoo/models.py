"""The model zoo: the architectures users deploy, as factories for ``torchship export --model``, and the
weights each is exported with.

Fresh initializations give unrealistic outputs (fresh resnet50 logits reach 39, mobilenet_v3_large's 5e-10,
efficientnet_b0's 5e-14, and vit_b_16's head starts at zero), so ``realistic`` makes weights that behave
like trained ones before they are saved: BatchNorm running statistics recalibrated on random images,
LayerNorm scales and shifts spread as training leaves them, and a zero-initialized head drawn at random.
Every image model takes float32 [0, 1] images and normalizes them inside (ImageNet mean and std), as a
deployed model does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from torchship.models import WithPreprocessing

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


@dataclass
class Entry:
    """A zoo model: its factory (in this module), the export flags of its signature, and what it costs."""

    name: str
    factory: str
    args: dict = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    export: tuple[str, ...] = ()  # further export flags (batch limits)
    needs: str = ""  # an optional package it needs
    bench_shape: tuple[str, ...] = ()
    formats: tuple[str, ...] = ()  # the formats it takes, where not every fp32 format (a detector's)


IMAGE = ("--input", "images:float32:B,3,224,224")
TEXT_BERT = (
    "--input",
    "input_ids:int64:B,S",
    "--input",
    "attention_mask:int64:B,S",
    "--input",
    "token_type_ids:int64:B,S",
    "--dim",
    "S=1..128",
    "--input-range",
    "input_ids=0..30521",
    "--input-range",
    "attention_mask=mask",
    "--input-range",
    "token_type_ids=0..1",
)
TEXT_GPT2 = tuple(
    "--input input_ids:int64:B,S --input attention_mask:int64:B,S --dim S=1..64 "
    "--input-range input_ids=0..50256 --input-range attention_mask=mask".split()
)
GPT2_BATCHES = ("--max-batch", "4", "--odd-batch", "3", "--buckets", "1", "4")

ZOO = [
    Entry("resnet50", "torchvision_model", {"arch": "resnet50"}, IMAGE),
    Entry("mobilenet_v3_large", "torchvision_model", {"arch": "mobilenet_v3_large"}, IMAGE),
    Entry("efficientnet_b0", "torchvision_model", {"arch": "efficientnet_b0"}, IMAGE),
    Entry("convnext_tiny", "torchvision_model", {"arch": "convnext_tiny"}, IMAGE),
    Entry("vit_b_16", "torchvision_model", {"arch": "vit_b_16"}, IMAGE, ("--max-batch", "8", "--buckets", "1", "8")),
    Entry("bert_tiny", "bert", {"size": "tiny"}, TEXT_BERT, needs="transformers", bench_shape=("S=128",)),
    Entry(
        "bert_base",
        "bert",
        {"size": "base"},
        TEXT_BERT,
        ("--max-batch", "8", "--buckets", "1", "8"),
        needs="transformers",
        bench_shape=("S=128",),
    ),
    Entry("gpt2_tiny", "gpt2", {"size": "tiny"}, TEXT_GPT2, GPT2_BATCHES, needs="transformers", bench_shape=("S=64",)),
    Entry("gpt2_base", "gpt2", {"size": "base"}, TEXT_GPT2, GPT2_BATCHES, needs="transformers", bench_shape=("S=64",)),
    Entry(
        "mlp_2gb", "big_mlp", {}, ("--input", "features:float32:B,4096"), ("--max-batch", "8", "--buckets", "1", "8")
    ),
    Entry(
        "fcos_resnet50_fpn",
        "fcos_resnet50_fpn",
        {},
        ("--input", "images:float32:B,3,320,320"),
        ("--max-batch", "4", "--odd-batch", "3"),
        formats=("torchscript", "exported_program", "aoti", "onnx"),
    ),
]
BY_NAME = {e.name: e for e in ZOO}


def torchvision_model(arch: str, num_classes: int = 1000) -> nn.Module:
    """A torchvision classifier behind ImageNet normalization: [0, 1] images in, logits out."""
    import torchvision

    return WithPreprocessing(getattr(torchvision.models, arch)(num_classes=num_classes), IMAGENET_MEAN, IMAGENET_STD)


def fcos_resnet50_fpn(size: int = 320, num_classes: int = 91, score_thresh: float = 0.05) -> nn.Module:
    """torchvision's FCOS with a ResNet-50 FPN backbone, built for pictures of ``size`` x ``size`` (COCO's 91
    labels); exported behind torchship's TopK, NMS inside. The threshold is torchvision's RetinaNet default: a
    detector with random weights scores its boxes near 0.07, under FCOS's own 0.2."""
    import torchvision

    return torchvision.models.detection.fcos_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=num_classes, min_size=size, max_size=size,
        score_thresh=score_thresh,
    )  # fmt: skip


BERT_SIZES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
}
GPT2_SIZES = {"tiny": dict(n_embd=128, n_layer=2, n_head=2), "base": dict(n_embd=768, n_layer=12, n_head=12)}


def bert(size: str = "tiny", num_labels: int = 4) -> nn.Module:
    """A BERT-style sequence classifier (Hugging Face's BertForSequenceClassification, random weights)."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=30522, max_position_embeddings=512, num_labels=num_labels, **BERT_SIZES[size])
    return BertForSequenceClassification(cfg).eval()


class CausalLM(nn.Module):
    """(input_ids, attention_mask) -> logits [B, S, vocab]: GPT2LMHeadModel's forward takes the KV cache
    second, so the inputs are passed on by keyword."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, attention_mask=attention_mask).logits


def gpt2(size: str = "tiny") -> nn.Module:
    """A GPT-2-style causal LM returning logits over the vocabulary for every position (no KV cache)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=50257, n_positions=1024, use_cache=False, **GPT2_SIZES[size])
    return CausalLM(GPT2LMHeadModel(cfg)).eval()


class BigMLP(nn.Module):
    """A plain MLP whose weights exceed 2 GB (2.48 GB): past protobuf's limit for one ONNX file."""

    def __init__(self, features: int = 4096, hidden: int = 16384, classes: int = 1000):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)


def big_mlp() -> nn.Module:
    return BigMLP()


def realistic(model: nn.Module, example: dict[str, torch.Tensor], seed: int = 0) -> nn.Module:
    """Weights that behave like trained ones: BatchNorm statistics recalibrated on ``example`` (random inputs
    of the model's signature), LayerNorm scale and shift spread around 1 and 0, a zero head drawn at
    random. Returns the model in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm) and m.elementwise_affine:
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        for p in model.parameters():
            if p.dim() == 2 and not p.any():  # vit_b_16's head, and any other layer initialized to zero
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
        bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if bns:
            for m in bns:
                m.reset_running_stats()
                m.momentum = None  # a cumulative average over the calibration batches
            model.train()
            for _ in range(2):
                if hasattr(model, "anchor_generator"):  # a torchvision detector in training mode wants targets:
                    t = model.transform  # its backbone alone sees the images, normalized as its forward does
                    x = next(iter(example.values()))
                    model.backbone(
                        (x - torch.tensor(t.image_mean)[:, None, None]) / torch.tensor(t.image_std)[:, None, None]
                    )
                else:
                    model(**example)
            for m in bns:
                m.momentum = 0.1
    return model.eval()
