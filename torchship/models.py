"""Model builders by name (torchvision, a tiny CNN, or a user's package.module:factory)."""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any, Callable, Optional

import torch
from torch import nn

from torchship.errors import CheckpointError, ConfigError, TorchshipError

TORCHVISION_ARCHS = ("resnet18", "resnet34", "resnet50", "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0")


class TinyCNN(nn.Module):
    """A 5.5k-parameter CNN (at width 16) for fast tests and smoke runs."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class Normalize(nn.Module):
    """(x - mean) / std per channel. Used in training and baked into exported graphs,
    so both apply exactly the same arithmetic."""

    def __init__(self, mean: list[float], std: list[float]):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class WithPreprocessing(nn.Module):
    """The deployable model: raw [0, 1] images in, logits out (normalization inside)."""

    def __init__(self, model: nn.Module, mean: list[float], std: list[float]):
        super().__init__()
        self.normalize = Normalize(mean, std)
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(self.normalize(images))


class Flat(nn.Module):
    """Calls ``inner`` with its positional inputs and returns its outputs as one tensor or a flat tuple:
    dict outputs (and dict subclasses) in the order of ``keys`` (else their own), tuples and lists as they are."""

    def __init__(self, inner: nn.Module, keys: Optional[list] = None):
        super().__init__()
        self.inner = inner
        self.keys = keys

    def flat(self, out):
        if isinstance(out, dict):
            out = tuple(out[k] for k in (self.keys or out))
        if isinstance(out, (list, tuple)):
            return out[0] if len(out) == 1 else tuple(out)
        return out


def named(inner: nn.Module, input_names: list[str], keys: Optional[list] = None, by_keyword: bool = False) -> nn.Module:
    """``inner`` behind a forward whose parameters carry the input names, so that every exporter names
    the graph inputs after them (TorchScript's schema, ExportedProgram's signature, ONNX's inputs).
    ``by_keyword``: pass them on as keyword arguments (a model trained on dict samples), else in order."""
    args = ", ".join(input_names)
    call = ", ".join(f"{n}={n}" for n in input_names) if by_keyword else args
    ns: dict[str, Any] = {}
    exec(f"def forward(self, {args}):\n    return self.flat(self.inner({call}))\n", ns)  # names checked by the parser
    cls = type("Deployable", (Flat,), {"forward": ns["forward"]})
    return cls(inner, keys).eval()


def parse_model_args(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """KEY=JSON_VALUE pairs from --model-arg into a dict."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--model-arg {pair!r} must look like KEY=VALUE")
        key, raw = pair.split("=", 1)
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def import_factory(spec: str, flag: str) -> Callable[..., Any]:
    """The function a ``package.module:function`` name points to; ConfigError naming ``flag`` otherwise."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{flag} {spec!r} must look like package.module:function")

    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` would: the working directory first
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{flag} {spec}: cannot import it ({e}); is the package on PYTHONPATH?") from None


def call_factory(
    spec: str, flag: str, kwargs: dict[str, Any] | None = None, error: type = ConfigError, hint: str = ""
) -> Any:
    """What the ``package.module:function`` named by ``spec`` returns for ``kwargs``; ``error`` naming ``flag``
    when it cannot be imported (ConfigError) or raises."""
    fn = import_factory(spec, flag)
    kwargs = kwargs or {}
    try:
        return fn(**kwargs)
    except TorchshipError:
        raise
    except Exception as e:
        called = f" (called with {', '.join(kwargs)})" if kwargs else ""
        raise error(f"{flag} {spec}: the factory failed{called}: {type(e).__name__}: {e}{hint}") from None


def make_model(spec: str, flag: str, kwargs: dict[str, Any] | None = None) -> nn.Module:
    """A user's model factory called with ``kwargs``; ConfigError naming ``flag`` if it fails or returns
    something that is not an nn.Module."""
    model = call_factory(spec, flag, kwargs, hint="; pass constructor arguments with --model-arg KEY=VALUE")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{flag} {spec}: the factory returned {type(model).__name__}, not an nn.Module")
    return model


def check_arch(arch: str) -> Callable[..., nn.Module] | None:
    """Refuse an --arch that names no known model, before anything is written; returns the factory of a
    package.module:factory name, else None."""
    if ":" in arch:
        return import_factory(arch, "--arch")
    if arch != "tiny_cnn" and arch not in TORCHVISION_ARCHS:
        raise ConfigError(
            f"--arch {arch!r} is unknown; use one of {', '.join(TORCHVISION_ARCHS + ('tiny_cnn',))} "
            "or package.module:factory"
        )
    return None


def build_model(
    arch: str, num_classes: int | None, in_channels: int | None = 3, extra: dict[str, Any] | None = None
) -> nn.Module:
    """Build an untrained model. A package.module:factory is called with ``num_classes`` (image data) or,
    when it is None (your own data), with ``extra`` alone. Raises ConfigError for an unknown name or a
    broken factory."""
    extra = dict(extra or {})
    factory = check_arch(arch)
    if arch == "tiny_cnn":
        return TinyCNN(num_classes=num_classes, in_channels=in_channels, **extra)
    if factory is not None:
        return make_model(arch, "--arch", extra if num_classes is None else {"num_classes": num_classes, **extra})
    import torchvision  # check_arch has made sure it is one of TORCHVISION_ARCHS

    if in_channels != 3:
        raise ConfigError(f"--arch {arch} expects 3 input channels, the data has {in_channels}")
    return torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **extra)


def model_from_meta(meta: dict[str, Any]) -> nn.Module:
    """Rebuild the (untrained) model a checkpoint's metadata describes."""
    try:
        if "signature" in meta:  # trained on your own data: the factory takes the recorded arguments alone
            return build_model(meta["arch"], None, None, meta.get("model_args"))
        return build_model(meta["arch"], meta["num_classes"], meta["input_shape"][0], meta.get("model_args"))
    except KeyError as e:
        raise CheckpointError(f"checkpoint metadata lacks {e}; it was not written by torchship train") from None
