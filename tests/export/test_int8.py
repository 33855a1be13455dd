"""INT8: the scheme follows the CPU's flags (both branches forced), the accuracy gate passes a good artifact and
catches a badly calibrated one, onnx_int8 and aoti_int8 exports are verified under the gate, and an aoti_int8
package that runs no INT8 kernel is refused."""

import json

import numpy as np
import pytest

from tests.conftest import run_cli
from torchship.export.quantize import int8_scheme, quantized_kernels
from torchship.parity import GATE, check_quantized, sqnr_db


@pytest.mark.parametrize(
    "flags, reduce_range, pays, cpu",
    [
        ({"avx2", "avx512f", "avx512_vnni"}, False, True, "avx512_vnni"),  # Zen 4, Ice Lake and later
        ({"avx2", "avx_vnni"}, False, True, "avx_vnni"),  # Alder Lake and later
        ({"avx2", "amx_int8", "avx512_vnni"}, False, True, "amx_int8"),  # Sapphire Rapids
        ({"avx2", "fma"}, True, True, "avx2"),  # Zen 2/3, Haswell to Coffee Lake
        ({"avx2", "avx512f"}, True, True, "avx512f"),  # Skylake-SP: AVX-512 without VNNI
        ({"sse4_2"}, True, False, "no AVX2"),
    ],
)
def test_the_scheme_follows_the_cpu_flags(flags, reduce_range, pays, cpu):
    s = int8_scheme(flags)
    assert (s["activations"], s["weights"], s["per_channel"]) == ("uint8", "int8", True)
    assert (s["reduce_range"], s["pays"], s["cpu"]) == (reduce_range, pays, cpu)
    assert ("INT8 will not pay here" in s["why"]) == (not pays) and ("7 bits" in s["why"]) == (reduce_range and pays)


def classifier(n=200, classes=10, seed=0):
    g = np.random.default_rng(seed)
    want = g.normal(size=(n, classes)).astype(np.float32)
    return want, want.argmax(-1)


def test_the_gate_passes_within_the_allowed_drop_and_names_a_larger_one():
    want, labels = classifier()
    got = want.copy()
    got[0] = -got[0]  # one sample of 200 flipped: 0.5 points
    row, failures = check_quantized({"logits": got}, {"logits": want}, labels, GATE, "m: heldout", 200, real=True)
    assert not failures and row["accuracy_drop"] == 0.5 and row["eager_accuracy"] == 100.0
    got[1] = -got[1]  # two: 1.0 point
    row, failures = check_quantized({"logits": got}, {"logits": want}, labels, GATE, "m: heldout", 200, real=True)
    assert failures == [
        "m: heldout: accuracy 99.00 % against eager's 100.00 % on 200 labelled samples, a drop beyond 0.5 points"
    ]


def test_without_labels_top1_agreement_and_sqnr_decide():
    want, _ = classifier()
    got = want.copy()
    got[:3] = -got[:3]  # 98.5 % agreement
    emb = np.random.default_rng(1).normal(size=(200, 16)).astype(np.float32)
    noisy = emb + np.random.default_rng(2).normal(scale=0.2, size=emb.shape).astype(np.float32)  # ~14 dB
    _, failures = check_quantized(
        {"logits": got, "emb": noisy}, {"logits": want, "emb": emb}, None, GATE, "m", 200, True
    )
    assert len(failures) == 2 and "top-1 agrees with eager on 98.5 %" in failures[0] and "SQNR" in failures[1]
    _, failures = check_quantized(
        {"logits": want, "emb": emb + 0.01}, {"logits": want, "emb": emb}, None, GATE, "m", 200, True
    )
    assert not failures
    assert sqnr_db(emb, emb) == float("inf") and sqnr_db(2 * emb, emb) == pytest.approx(0.0)


def test_random_inputs_are_only_checked_for_shape_and_finiteness():
    want, _ = classifier(8)
    row, failures = check_quantized({"logits": -want}, {"logits": want}, None, GATE, "m: random_b8", 8, real=False)
    assert not failures and row["pass"] and "top1_agreement" not in row
    bad = want.copy()
    bad[0, 0] = np.nan
    _, failures = check_quantized({"logits": bad}, {"logits": want}, None, GATE, "m: random_b8", 8, real=False)
    _, wrong = check_quantized({"logits": want[:, :3]}, {"logits": want}, None, GATE, "m: random_b8", 8, real=False)
    assert failures == ["m: random_b8 output 'logits': not finite"] and "shape [8, 3], eager [8, 10]" in wrong[0]


def quantized(export, fmt: str) -> tuple[dict, dict, dict]:
    """(the export's manifest, its ``fmt`` artifact, how that artifact was quantized)."""
    m = json.loads((export / "manifest.json").read_text())
    a = next(a for a in m["artifacts"] if a["format"] == fmt)
    return m, a, a["quantization"]


@pytest.mark.slow
def test_an_onnx_int8_export_is_calibrated_and_passes_the_gate(int8_export):
    import onnx

    m, a, q = quantized(int8_export, "onnx_int8")
    assert (
        q["method"] == "static"
        and q["calibration"]["samples"] == 64
        and q["calibration"]["source"] == "the export's real samples"
    )
    assert q == {**q, **int8_scheme()} and a["gate"] == {**GATE, "max_accuracy_drop": 2.0}
    ops = {n.op_type for n in onnx.load(str(int8_export / a["file"])).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops  # really quantized, not an fp32 copy
    v = m["verification"]["artifacts"]["onnx_int8"]
    assert v["pass"] and v["quantized"]
    held = v["sets"]["heldout"]
    assert held["accuracy_drop"] <= 2.0 and held["top1_agreement"] >= 0.9 and held["sqnr_db"]["logits"] > 20
    parity_md = (int8_export / "parity.md").read_text()
    assert "| onnx_int8 | static, u8 activations, s8 weights, per channel" in parity_md and "64 samples" in parity_md


@pytest.mark.slow
def test_an_aoti_int8_export_calls_int8_kernels_and_passes_the_gate(int8_export):
    m, a, q = quantized(int8_export, "aoti_int8")
    assert (
        q["method"] == "static" and q["quantizer"] == "torchao X86InductorQuantizer" and q["narrowed"] == "activations"
    )
    assert q["calibration"] == {"samples": 64, "source": "the export's real samples"} and a["freezing"]
    assert a["quantized_kernels"] == quantized_kernels(int8_export / a["file"]) >= 3  # two convolutions, one linear
    v = m["verification"]["artifacts"]["aoti_int8"]
    held = v["sets"]["heldout"]
    assert v["pass"] and v["quantized"] and held["accuracy_drop"] <= 2.0 and held["sqnr_db"]["logits"] > 20
    narrowed = ", 7-bit activations" if q["reduce_range"] else ""
    assert (
        f"| aoti_int8 | static, u8 activations, s8 weights, per channel{narrowed} | 64 samples"
        in (int8_export / "parity.md").read_text()
    )


@pytest.mark.slow
def test_a_package_compiled_back_to_fp32_is_refused(trained, tmp_path, monkeypatch):
    """The planted fault: without freezing, AOTInductor compiles the quantized graph's quantize/dequantize pairs
    as plain fp32 arithmetic, which would pass the gate while running no faster; the kernel count refuses it."""
    from torchship.config import build
    from torchship.export import exporters
    from torchship.export.config import ExportConfig
    from torchship.export.quantize import aoti_int8
    from torchship.export.source import artifact_model, load_source

    src = load_source(build(ExportConfig, {"checkpoint": str(trained)}), log=lambda *a: None)
    model = artifact_model(src, "float32", "cpu")
    monkeypatch.setattr(exporters, "FREEZE", {"freezing": False})
    with pytest.raises(RuntimeError, match="calls no INT8 kernel"):
        aoti_int8(
            model,
            exporters.example(src.signature, 2, "cpu"),
            tmp_path / "model.pt2",
            src.signature,
            8,
            1,
            {"images": src.samples["images"][:16]},
            "held-out",
            int8_scheme(),
        )


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["onnx_int8", "aoti_int8"])
def test_constant_calibration_fails_the_gate_naming_the_artifact(zero_calibrated, fmt):
    """The planted fault: calibrated on all-zero images, the activation ranges collapse and accuracy falls."""
    code, err, _ = zero_calibrated
    assert code == 3, err
    assert f"{fmt}: heldout: accuracy" in err and "a drop beyond 0.5 points" in err


@pytest.mark.parametrize(
    "fmt, args, says",
    [
        ("onnx_int8", ["--calibration", "nowhere.npz"], "--calibration nowhere.npz: no such file"),
        ("onnx_int8", ["--dtype", "bfloat16"], "onnx_int8 reduces the float32 model's precision itself"),
        ("aoti_int8", ["--dtype", "float16"], "aoti_int8 reduces the float32 model's precision itself"),
        ("aoti_bf16", ["--dtype", "bfloat16"], "aoti_bf16 reduces the float32 model's precision itself"),
        ("aoti_int8", ["--device", "cuda"], "aoti_int8 is compiled for x86 CPUs"),
        ("aoti_bf16", ["--device", "cuda"], "aoti_bf16 is compiled for x86 CPUs"),
        (
            "onnx",
            ["--calibration", "nowhere.npz"],
            "--calibration calibrates onnx_int8 and aoti_int8; add one to --formats",
        ),
    ],
)
def test_bad_int8_input_is_refused_in_one_line(trained, tmp_path, capsys, fmt, args, says):
    code = run_cli("export", trained, "--out", tmp_path / "export", "--formats", fmt, *args)
    err = capsys.readouterr().err
    assert code != 0 and says in err and len(err.strip().splitlines()) == 1, err
