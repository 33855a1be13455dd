"""INT8 artifacts, quantized in the scheme that suits the CPU at hand, static (calibrated on real samples) for
convolutional models, dynamic for the rest (transformer-style MatMul models): onnx_int8 by ONNX Runtime's
quantizer, aoti_int8 by torchao's PT2E flow compiled by AOTInductor."""

from __future__ import annotations

import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from torchship.device import NATIVE_INT8_FLAGS, cpu_flags, torch_threads
from torchship.errors import ConfigError

CALIBRATION_LIMIT = 512  # samples: min/max calibration settles long before this; more only costs time


def int8_scheme(flags: set[str] | None = None) -> dict[str, Any]:
    """How to quantize for this CPU (``flags``: its /proc/cpuinfo flags, read here when None): u8 activations and
    s8 per-channel weights, the pair ONNX Runtime's x86 kernels are fastest at. With VNNI the products sum in
    32 bits. Without it (AVX2, AVX-512 before VNNI) pairs of products pass through a saturating 16-bit add
    (vpmaddubsw), where full 8-bit operands overflow it, so one side keeps 7 bits (reduce_range: ONNX Runtime's
    quantizer narrows the weights, torchao's the activations). Without AVX2
    there is no fast INT8 path: ``pays`` is False and ``why`` says so."""
    flags = cpu_flags() if flags is None else flags
    vnni = next((f for f in NATIVE_INT8_FLAGS if f in flags), None)
    base = {"activations": "uint8", "weights": "int8", "per_channel": True}
    if vnni:
        return {
            **base,
            "reduce_range": False,
            "cpu": vnni,
            "pays": True,
            "why": f"{vnni}: u8 x s8 products sum in 32 bits in one instruction",
        }
    simd = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else None
    if simd:
        return {
            **base,
            "reduce_range": True,
            "cpu": simd,
            "pays": True,
            "why": f"no VNNI ({simd}): u8 x s8 products pass through saturating 16-bit sums, so one side keeps "
            "7 bits; a CPU with VNNI runs INT8 faster still",
        }
    return {
        **base,
        "reduce_range": True,
        "cpu": "no AVX2",
        "pays": False,
        "why": "no AVX2 or VNNI: ONNX Runtime has no fast INT8 path on this CPU, so INT8 will not pay here",
    }


def calibration_samples(
    path: str | None, samples: dict[str, np.ndarray], names: list[str]
) -> tuple[dict[str, np.ndarray], str]:
    """The calibration inputs, by input name, and where they came from: ``path`` (an npz keyed by input name),
    else the export's real samples (a checkpoint's held-out split, or --example-inputs)."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--calibration {p}: no such file (an npz of real inputs keyed by input name)")
        with np.load(p) as z:
            missing = [n for n in names if n not in z.files]
            if missing:
                raise ConfigError(
                    f"--calibration {p} has no array {', '.join(missing)} (it has {', '.join(z.files) or 'none'})"
                )
            got = {n: z[n] for n in names}
        source = str(p)
    elif samples:
        got, source = samples, "the export's real samples"
    else:
        raise ConfigError(
            "onnx_int8 needs real inputs to calibrate on: give --calibration FILE.npz (keyed by input "
            "name), or --example-inputs"
        )
    sizes = {len(v) for v in got.values()}
    if len(sizes) != 1 or 0 in sizes:
        raise ConfigError(f"calibration inputs from {source}: the arrays hold different numbers of samples, or none")
    n = min(sizes.pop(), CALIBRATION_LIMIT)
    return {k: np.ascontiguousarray(v[:n]) for k, v in got.items()}, source


def log_line(fmt: str, extra: dict[str, Any]) -> str:
    """The export log's line on how an INT8 artifact was quantized, and why so on this CPU."""
    q = extra["quantization"]
    calibrated = (
        f", calibrated on {q['calibration']['samples']} samples from {q['calibration']['source']}"
        if q["calibration"]
        else ""
    )
    kernels = f", {extra['quantized_kernels']} INT8 kernel calls" if extra.get("quantized_kernels") else ""
    return f"  {fmt}: {q['method']} quantization{calibrated}{kernels}; {q['why']}"


def is_convolutional(model_path: Path) -> bool:
    import onnx

    m = onnx.load(str(model_path), load_external_data=False)
    return any(n.op_type == "Conv" for n in m.graph.node)


def onnx_int8(
    fp32: Path,
    out: Path,
    calibration: dict[str, np.ndarray] | None,
    source: str,
    scheme: dict[str, Any],
    external: bool,
) -> dict[str, Any]:
    """Quantize the fp32 ONNX model ``fp32`` into ``out``: static QDQ calibrated on ``calibration`` (min/max) for
    a convolutional model, dynamic (weights only; activations quantized as they come) otherwise. Returns the
    manifest's extra fields."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    types = {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8}
    static = is_convolutional(fp32)
    with tempfile.TemporaryDirectory(prefix="torchship-int8-") as tmp:
        pre = Path(tmp) / "pre.onnx"
        quant_pre_process(
            str(fp32 if external else _without_shapes(fp32, Path(tmp) / "fp32.onnx")),
            str(pre),
            skip_symbolic_shape=True,
            save_as_external_data=external,
        )
        if static:
            if calibration is None:
                raise ConfigError("static INT8 needs calibration inputs")
            quantize_static(
                str(pre),
                str(out),
                _Reader(calibration),
                quant_format=QuantFormat.QDQ,
                per_channel=scheme["per_channel"],
                reduce_range=scheme["reduce_range"],
                activation_type=types[scheme["activations"]],
                weight_type=types[scheme["weights"]],
                use_external_data_format=external,
            )
        else:
            quantize_dynamic(
                str(pre),
                str(out),
                per_channel=scheme["per_channel"],
                reduce_range=scheme["reduce_range"],
                weight_type=types[scheme["weights"]],
                use_external_data_format=external,
            )
    n = len(next(iter(calibration.values()))) if static and calibration else 0
    return {
        "quantization": {
            **scheme,
            "method": "static" if static else "dynamic",
            "narrowed": "weights",
            "calibration": {"samples": n, "source": source} if static else None,
        }
    }


def _without_shapes(src: Path, dst: Path) -> Path:
    """``src`` without its recorded intermediate shapes (value_info): the exporter's can disagree with what
    ONNX shape inference derives again (a transformer's attention reshapes), which stops the quantizer."""
    import onnx

    m = onnx.load(str(src))
    del m.graph.value_info[:]
    onnx.save(m, str(dst))
    return dst


class _Reader:
    """ONNX Runtime's CalibrationDataReader over the calibration inputs, one sample at a time."""

    def __init__(self, inputs: dict[str, np.ndarray]):
        self.inputs = inputs
        self.it: Iterator[int] = iter(range(len(next(iter(inputs.values())))))

    def get_next(self) -> dict[str, np.ndarray] | None:
        i = next(self.it, None)
        return None if i is None else {k: v[i : i + 1] for k, v in self.inputs.items()}

    def rewind(self) -> None:
        self.it = iter(range(len(next(iter(self.inputs.values())))))


# the quantized oneDNN kernels an AOTInductor package's generated code calls (qconv, qconv2d_pointwise_binary, qlinear)
QUANTIZED_CALL = re.compile(r"aoti_torch_cpu__q(conv|linear)\w*\(")


def aoti_int8(
    model,
    ex: tuple,
    path: Path,
    sig,
    max_batch: int,
    threads: int,
    calibration: dict[str, np.ndarray] | None,
    source: str,
    scheme: dict[str, Any],
) -> dict[str, Any]:
    """AOTInductor package of ``model`` quantized by torchao's PT2E flow for x86 (X86InductorQuantizer), static
    (calibrated on ``calibration``, histogram observers) for every model, transformers too: torchao's dynamic
    mode did not keep their accuracy. Compiled with freezing, which is what turns the quantize/dequantize pairs
    into oneDNN's INT8 kernels; a package whose code calls none of them (the model would run in fp32 after all)
    is refused. Returns the manifest's extra fields."""
    import torch
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

    from .exporters import compile_package, dynamic_shapes, quiet

    if calibration is None:
        raise ConfigError("aoti_int8 needs calibration inputs")
    by_name = dynamic_shapes(sig, max_batch)  # positional below: the quantized graph's arguments have their own names
    dims = tuple(by_name.get(t.name, {}) for t in sig.inputs) if by_name else None
    config = xiq.get_default_x86_inductor_quantization_config(reduce_range=scheme["reduce_range"])
    with quiet(), torch.no_grad(), torch_threads(threads):
        # strict (dynamo) capture: the default one puts every call of a module called twice (a ResNet block's one
        # ReLU) into one partition, which the quantizer refuses ("Input partition has more than one output node")
        captured = torch.export.export(model, ex, dynamic_shapes=dims, strict=True).module()
        prepared = prepare_pt2e(captured, xiq.X86InductorQuantizer().set_global(config))
        n = len(next(iter(calibration.values())))
        for i in range(0, n, max_batch):
            prepared(*(torch.from_numpy(calibration[t.name][i : i + max_batch]) for t in sig.inputs))
        compile_package(torch.export.export(convert_pt2e(prepared), ex, dynamic_shapes=dims), path)
    kernels = quantized_kernels(path)
    if not kernels:
        raise RuntimeError(
            "the compiled package calls no INT8 kernel: AOTInductor compiled the quantized model back "
            "to fp32 (freezing off?)"
        )
    return {
        "freezing": True,
        "compile_threads": threads,
        "quantized_kernels": kernels,
        "quantization": {
            **scheme,
            "method": "static",
            "narrowed": "activations",
            "quantizer": "torchao X86InductorQuantizer",
            "calibration": {"samples": n, "source": source},
        },
    }


def quantized_kernels(package: Path) -> int:
    """How many calls of oneDNN INT8 kernels the generated code inside an AOTInductor package makes."""
    with zipfile.ZipFile(package) as z:
        return sum(
            len(QUANTIZED_CALL.findall(z.read(n).decode(errors="ignore"))) for n in z.namelist() if n.endswith(".cpp")
        )
