"""Planted faults: verification against the float64 reference catches each, on a BERT-style classifier (and,
under -m zoo, on resnet50 at 224), and passes the faithful artifact beside them (no false failure).

Each fault is a real artifact (an ExportedProgram of the faulty model) listed in the manifest beside the
faithful one, as a faulty exporter would have written it; one verification run checks them all.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import FlipChannels
from tests.zoo import models as zoo
from torchship.errors import ParityError
from torchship.io import sha256_file
from torchship.manifest import read_manifest, write_manifest

pytestmark = pytest.mark.slow  # real servers, compiles or processes: the full run, not the fast tier

SMALL = {"max_batch": 2, "odd_batch": 1, "formats": ("exported_program",)}


class SwapLastTwo(nn.Module):
    """The text analogue: two inputs of the same kind fed in each other's place."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.inner(input_ids, token_type_ids, attention_mask)


class OnLogits(nn.Module):
    """The model with ``fn`` applied to its logits (a dict's "logits", or the tensor itself)."""

    def __init__(self, inner: nn.Module, fn):
        super().__init__()
        self.inner, self.fn = inner, fn

    def forward(self, *args):
        out = self.inner(*args)
        return {"logits": self.fn(out["logits"])} if isinstance(out, dict) else self.fn(out)


def softmaxed(inner: nn.Module) -> nn.Module:
    return OnLogits(inner, lambda y: y.softmax(-1))


def zeros(inner: nn.Module) -> nn.Module:
    return OnLogits(inner, torch.zeros_like)


def scale_weight(name: str):
    def fault(inner: nn.Module) -> nn.Module:
        with torch.no_grad():
            dict(inner.named_parameters())[name].mul_(1 + 1e-3)
        return inner

    return fault


def train_mode(inner: nn.Module) -> nn.Module:
    """BatchNorm (resnet50) or dropout (BERT) left in training mode when the artifact was made."""
    return inner.train()


def image_normalized_twice(inner: nn.Module) -> nn.Module:
    inner.normalize = nn.Sequential(inner.normalize, copy.deepcopy(inner.normalize))
    return inner


def text_normalized_twice(inner: nn.Module) -> nn.Module:
    ln = inner.bert.embeddings.LayerNorm
    inner.bert.embeddings.LayerNorm = nn.Sequential(ln, copy.deepcopy(ln))
    return inner


MODELS = {
    "resnet50": {
        "entry": zoo.BY_NAME["resnet50"],
        "head": ("model.fc.weight", "model.fc.bias"),
        "faults": {
            "weight_scaled": scale_weight("model.layer3.2.conv2.weight"),
            "normalized_twice": image_normalized_twice,
            "rgb_bgr_swapped": FlipChannels,
            "train_mode": train_mode,
            "softmax_added": softmaxed,
        },
    },
    "bert_tiny": {
        "entry": zoo.BY_NAME["bert_tiny"],
        "head": ("classifier.weight", "classifier.bias"),
        "faults": {
            "weight_scaled": scale_weight("bert.encoder.layer.1.output.dense.weight"),
            "normalized_twice": text_normalized_twice,
            "inputs_swapped": SwapLastTwo,
            "train_mode": train_mode,
            "softmax_added": softmaxed,
        },
    },
}


@pytest.fixture(scope="module")
def zoo_weights(tmp_path_factory):
    """name -> the zoo model's realistic weights file, made once for the module."""
    from tests.zoo.run import weights_for

    made = {}

    def get(name: str):
        if name not in made:
            made[name] = weights_for(MODELS[name]["entry"], tmp_path_factory.mktemp(name) / "weights.pt")
        return made[name]

    return get


def export_with_faults(name: str, tmp, faults: dict, weights, head_scale: float = 1.0):
    """Export the zoo model ``name`` (``weights``, the head scaled by ``head_scale``) to an ExportedProgram,
    then add one artifact per fault, made from the faulty model the same way."""
    from tests.zoo.run import model_args
    from torchship.config import build
    from torchship.export.config import ExportConfig
    from torchship.export.exporters import example, exported_program
    from torchship.export.pipeline import run_export
    from torchship.export.source import load_source

    spec = MODELS[name]
    entry = spec["entry"]
    if head_scale != 1.0:
        sd = torch.load(weights)
        for key in spec["head"]:
            sd[key] = sd[key] * head_scale
        weights = tmp / "weights.pt"
        torch.save(sd, weights)
    cfg = build(
        ExportConfig,
        {
            "model": f"tests.zoo.models:{entry.factory}",
            "model_args": model_args(entry),
            "weights": str(weights),
            "out": str(tmp / "export"),
            **_flags(entry.flags),
            **SMALL,
            "verify": False,
        },
    )
    run_export(cfg, log=lambda *a: None)
    d = tmp / "export"
    m = read_manifest(d)
    src = load_source(cfg, log=lambda *a: None)
    sig = src.signature
    (d / "faults").mkdir()
    for fault, make in faults.items():
        deployable = copy.deepcopy(src.model)
        deployable.inner = make(deployable.inner)
        rel = f"faults/{fault}.pt2"
        exported_program(deployable, example(sig, 2, "cpu"), d / rel, sig, cfg.max_batch)
        m["artifacts"].append(
            {"name": fault, "format": "exported_program", "file": rel, "files": {rel: sha256_file(d / rel)}}
        )
    write_manifest(d, m)
    return d


def _flags(flags: tuple[str, ...]) -> dict:
    """--input/--dim/--input-range flags as ExportConfig fields."""
    out: dict[str, list] = {"inputs": [], "dims": [], "input_ranges": []}
    key = {"--input": "inputs", "--dim": "dims", "--input-range": "input_ranges"}
    for flag, value in zip(flags[::2], flags[1::2]):
        out[key[flag]].append(value)
    return out


def verdicts(d) -> dict[str, dict]:
    from torchship.export.verify import verify_export

    with pytest.raises(ParityError):
        verify_export(d, log=lambda *a: None)
    return read_manifest(d)["verification"]["artifacts"]


# resnet50 at 224 is real size: under -m zoo; bert_tiny keeps every planted fault in the default run
CASES = [pytest.param(n, marks=pytest.mark.zoo) if n == "resnet50" else n for n in MODELS]


@pytest.mark.parametrize("name", CASES)
def test_every_planted_fault_is_caught_and_the_faithful_artifact_passes(name, tmp_path, zoo_weights):
    if name == "bert_tiny":
        pytest.importorskip("transformers")
    spec = MODELS[name]
    d = export_with_faults(name, tmp_path, spec["faults"], zoo_weights(name))
    results = verdicts(d)
    assert results["exported_program"]["pass"], results["exported_program"]
    tol = read_manifest(d)["tolerances"]
    assert tol["rule"] == "fp64"
    for fault in spec["faults"]:
        r = results[fault]
        assert "error" not in r, f"{fault} did not load or run: {r['error']}"  # caught on its values, not its file
        assert not r["pass"], f"{name}: the planted fault {fault} passed verification"
        worst = max(row["max_abs"] for row in r["sets"].values())
        assert worst > 3 * next(iter(tol["outputs"].values()))["atol"], (fault, worst)  # not a near miss


@pytest.mark.parametrize("name", CASES)
def test_an_artifact_returning_zeros_is_caught_on_outputs_near_1e10(name, tmp_path, zoo_weights):
    """Outputs around 1e-10: a fixed absolute tolerance passes an artifact of zeros; the bound scales with
    the reference, and catches it."""
    if name == "bert_tiny":
        pytest.importorskip("transformers")
    d = export_with_faults(name, tmp_path, {"zeros": zeros}, zoo_weights(name), head_scale=1e-10)
    ref = np.load(d / "reference.npz")
    scale = max(float(np.abs(ref[k]).max()) for k in ref.files if k.startswith("expected/"))
    assert 1e-13 < scale < 1e-8, scale
    results = verdicts(d)
    assert results["exported_program"]["pass"] and not results["zeros"]["pass"]
