"""bfloat16 artifacts are gated on accuracy as INT8 ones are, and the planted faults a bf16 artifact may carry are
refused: its input normalization applied twice, and its colour channels read in the wrong order (RGB as BGR). The
default formats follow the CPU: each branch of the detection is forced here."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from tests.conftest import run_cli
from tests.helpers import FlipChannels
from torchship.io import sha256_file
from torchship.manifest import read_manifest, write_manifest
from torchship.models import WithPreprocessing
from torchship.parity import GATE

MEAN, STD = [0.2, 0.5, 0.8], [0.1, 0.3, 0.6]  # distinct per channel, so that a channel swap changes the answer
COLORS = np.random.default_rng(0).random((10, 3)).astype(np.float32)  # each class's colour, in [0, 1] RGB


class ColorNet(nn.Module):
    """A colour classifier: an image's class is the class colour nearest its mean colour (in normalized space),
    after a convolution that mixes each pixel with its neighbours. Its answer depends on every channel's value
    and order, as a trained model's does."""

    def __init__(self):
        super().__init__()
        self.smooth = nn.Conv2d(3, 3, 3, padding=1, groups=3, bias=False)
        nn.init.constant_(self.smooth.weight, 1 / 9)
        self.colors = nn.Parameter((torch.from_numpy(COLORS) - torch.tensor(MEAN)) / torch.tensor(STD))

    def forward(self, x):
        m = self.smooth(x).mean((2, 3))
        return -((m[:, None, :] - self.colors[None]) ** 2).sum(-1)


def color_cnn() -> nn.Module:
    return WithPreprocessing(ColorNet(), MEAN, STD)


def photos(n: int = 32) -> np.ndarray:
    """Images of one class colour each (nearly flat, a little noise): real samples with a clear answer."""
    rng = np.random.default_rng(1)
    base = COLORS[np.arange(n) % len(COLORS)][:, :, None, None]
    return np.clip(base + 0.02 * rng.standard_normal((n, 3, 24, 24)), 0, 1).astype(np.float32)


FAULTS = {"normalized_twice": lambda m: WithPreprocessing(m, MEAN, STD), "channels_swapped": FlipChannels}


@pytest.mark.slow  # 24 s: an export and its verification per planted fault
def test_a_bf16_artifact_is_gated_and_its_planted_faults_are_refused(tmp_path):
    """Each artifact below is the model computing in bfloat16 behind float32 inputs and outputs (an ExportedProgram,
    as a faulty exporter could have written it), listed under the gate a bf16 artifact carries: the faithful one
    passes on the real samples, each planted fault is refused."""
    from torchship.errors import ParityError
    from torchship.export.exporters import example, exported_program
    from torchship.export.source import CastWrapper
    from torchship.export.verify import verify_export
    from torchship.models import named
    from torchship.signature import parse_signature

    torch.save(color_cnn().state_dict(), tmp_path / "w.pt")
    np.savez(tmp_path / "photos.npz", images=photos())
    d = tmp_path / "export"
    assert (
        run_cli(
            "export",
            "--model",
            "tests.export.test_bf16:color_cnn",
            "--weights",
            tmp_path / "w.pt",
            "--input",
            "images:float32:B,3,24,24",
            "--example-inputs",
            tmp_path / "photos.npz",
            "--formats",
            "exported_program",
            "--max-batch",
            "8",
            "--out",
            d,
        )
        == 0
    )
    m = read_manifest(d)
    sig = parse_signature(["images:float32:B,3,24,24"])
    model = color_cnn()
    model.load_state_dict(torch.load(tmp_path / "w.pt"))
    for name, fault in {"faithful": lambda x: x, **FAULTS}.items():
        bf16 = named(CastWrapper(fault(copy.deepcopy(model)).eval(), torch.bfloat16), ["images"]).eval()
        rel = f"bf16/{name}.pt2"
        (d / "bf16").mkdir(exist_ok=True)
        exported_program(bf16, example(sig, 2, "cpu"), d / rel, sig, m["max_batch"])
        m["artifacts"].append(
            {
                "name": name,
                "format": "exported_program",
                "file": rel,
                "files": {rel: sha256_file(d / rel)},
                "dtype": "bfloat16",
                "gate": dict(GATE),
            }
        )
    write_manifest(d, m)
    with pytest.raises(ParityError) as e:
        verify_export(d, log=lambda *a: None)
    v = read_manifest(d)["verification"]["artifacts"]
    assert v["faithful"]["pass"] and v["faithful"]["quantized"], v["faithful"]
    for name in FAULTS:
        assert not v[name]["pass"] and f"{name}: examples" in str(e.value), (name, v[name])
    assert "computes in bfloat16 behind float32 inputs and outputs" in (d / "parity.md").read_text()


@pytest.mark.parametrize(
    "flags, reduced",
    [
        ({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, ["onnx_int8", "aoti_bf16"]),  # Zen 4, Zen 5
        (
            {"avx2", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16"},
            ["aoti_int8", "aoti_bf16"],
        ),  # Sapphire Rapids on
        ({"avx2", "avx_vnni"}, ["onnx_int8"]),  # Alder Lake: VNNI, no native bf16
        ({"avx2", "fma"}, []),  # Zen 2, Zen 3: float32 only
        (set(), []),
    ],
)
def test_the_default_formats_follow_the_cpu(flags, reduced):
    from torchship.export.config import default_formats

    formats, why = default_formats("cpu", flags)
    assert list(formats) == ["torchscript", "onnx", *reduced]
    assert why.startswith("float32 always (torchscript, onnx); int8 ") and ("left out" in why) == (len(reduced) < 2)
    assert default_formats("cuda", flags)[0] == ("torchscript", "aoti", "onnx")  # the container's aoti, no CPU kernels


def test_default_reduced_precisions_are_optional_and_need_real_samples(monkeypatch):
    from torchship.config import build
    from torchship.export.config import ExportConfig

    monkeypatch.setattr("torchship.export.config.cpu_flags", lambda: {"avx512_vnni", "avx512_bf16"})
    cfg = build(ExportConfig, {"checkpoint": "c"})
    resolved, why = cfg.for_device("cpu")
    assert resolved.formats == ("torchscript", "onnx", "onnx_int8", "aoti_bf16") and resolved.optional == (
        "onnx_int8",
        "aoti_bf16",
    )
    bare, why = cfg.for_device("cpu", real_samples=False)
    assert bare.formats == ("torchscript", "onnx") and "left out: no real samples to calibrate and gate them on" in why
    assert build(ExportConfig, {"checkpoint": "c", "formats": ["onnx"]}).for_device("cpu")[0].formats == ("onnx",)


@pytest.mark.slow
def test_an_aoti_bf16_export_compiles_passes_its_gate_and_is_served_batched(trained, tmp_path):
    from torchship.serve.config import RepoConfig
    from torchship.serve.model_config import read_config
    from torchship.serve.repository import build_repository

    d = tmp_path / "export"
    assert run_cli("export", trained, "--formats", "onnx", "aoti_bf16", "--max-batch", "8", "--out", d) == 0
    m = read_manifest(d)
    a = next(a for a in m["artifacts"] if a["format"] == "aoti_bf16")
    assert a["dtype"] == "bfloat16" and a["gate"]["max_accuracy_drop"] == GATE["max_accuracy_drop"]
    held = m["verification"]["artifacts"]["aoti_bf16"]["sets"]["heldout"]
    assert m["verification"]["artifacts"]["aoti_bf16"]["pass"] and held["accuracy_drop"] <= 0.5
    res = build_repository(d, RepoConfig(out=str(tmp_path / "repo")))
    mdir = tmp_path / "repo" / res["models"]["aoti_bf16"]
    assert (
        read_config(mdir / "config.pbtxt").platform == "torch_aoti"
        and read_config(mdir / "embedded.pbtxt").max_batch_size == 8
    )
