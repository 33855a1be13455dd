"""ExportConfig: which formats (and which may fail), batch limits, precision and parity overrides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from torchship.config import opt
from torchship.device import cpu_flags, native_precisions
from torchship.errors import ConfigError
from torchship.parity import GATE
from torchship.runtime import ARTIFACT_FORMATS, BF16_FORMATS, INT8_FORMATS


def reduced_format(precision: str, flags: set[str]) -> str:
    """The artifact that computes ``precision`` fastest on a CPU with ``flags`` (measured, docs/int8.md): for INT8,
    torchao's PT2E package where AMX-INT8's tiles run its oneDNN kernels, else ONNX Runtime's (VNNI without AMX:
    resnet50 at batch 8 ran twice as fast in ONNX Runtime); for bfloat16, the AOTInductor package (ONNX has no
    bfloat16 convolutions)."""
    if precision == "int8":
        return "aoti_int8" if "amx_int8" in flags else "onnx_int8"
    return "aoti_bf16"


def default_formats(device: str, flags: set[str] | None = None) -> tuple[tuple[str, ...], str]:
    """(formats, why in one line): what an export makes when --formats is not given, what the repository serves
    and pays its way on ``device``. TorchScript and ONNX in float32 everywhere; on CUDA also the AOTInductor package
    the official container serves. On a CPU an fp32 AOTInductor package served and ran in-process no faster than
    ONNX Runtime while its compiles took most of the export's time (docs/benchmarks.md), so it is opt-in there;
    instead each precision the CPU (``flags``) computes natively gets the artifact fastest at it (reduced_format):
    INT8 with VNNI or AMX-INT8, bfloat16 with AVX512-BF16 or AMX."""
    if device.startswith("cuda"):
        return (
            "torchscript",
            "aoti",
            "onnx",
        ), "on CUDA: float32 torchscript and onnx, and the aoti package the official container serves"
    flags = cpu_flags() if flags is None else flags
    chosen, why = ["torchscript", "onnx"], ["float32 always (torchscript, onnx)"]
    for precision, (native, reason) in native_precisions(flags).items():
        fmt = reduced_format(precision, flags)
        if native:
            chosen.append(fmt)
        why.append(f"{precision} {'(' + fmt + ')' if native else 'left out'}: {reason}")
    return tuple(chosen), "; ".join(why)


@dataclass
class ExportConfig:
    checkpoint: str = opt(
        "", "checkpoint directory, its model.pt, or a training output directory (its best)", cli=False
    )
    model: Optional[str] = opt(
        None, "your own model instead of a checkpoint: package.module:factory, called with the --model-arg values"
    )
    model_args: tuple[str, ...] = opt(
        (), "KEY=VALUE for --model's factory (JSON values; repeatable)", flag="--model-arg", append=True
    )
    weights: Optional[str] = opt(
        None, "with --model: a state_dict file (.pt/.pth from torch.save(model.state_dict()), or .safetensors)"
    )
    inputs: tuple[str, ...] = opt(
        (),
        "with --model: NAME:DTYPE:DIMS per input, in forward's order; DIMS start with B, e.g. input_ids:int64:B,S "
        "(repeatable)",
        flag="--input",
        append=True,
    )
    dims: tuple[str, ...] = opt(
        (),
        "NAME=MIN..MAX for each named dim of --input, e.g. S=1..128; with a checkpoint trained on your own data, "
        "replaces the range it recorded (repeatable)",
        flag="--dim",
        append=True,
    )
    input_ranges: tuple[str, ...] = opt(
        (),
        "NAME=LO..HI: the values of an input's random verification data; needed for integer inputs (repeatable)",
        flag="--input-range",
        append=True,
    )
    outputs: tuple[str, ...] = opt(
        (),
        "output names in forward's order (default: a dict's keys, else output0, output1, ...; repeatable)",
        flag="--output",
        append=True,
    )
    example_inputs: Optional[str] = opt(
        None, "an npz of real inputs keyed by input name, used by verification, warm-up and bench"
    )
    image_files: Optional[str] = opt(
        None,
        "with --model, for a model that takes one RGB image [B, 3, H, W] in [0, 1] (normalizing itself): a "
        "folder of its image files (JPEG, PNG, ...). The export records the preprocessing the served image "
        "entry applies (RGB, bilinear resize, /255), keeps up to 16 of the files for infer --check, and takes "
        "up to 64 as real samples where --example-inputs gives none",
        metavar="DIR",
    )
    tokenizer: Optional[str] = opt(
        None,
        "a text model's Hugging Face tokenizer.json: kept with the export, it fills the token ids, attention "
        "mask and token type ids, and the repository serves <name>_text, which takes text and tokenizes it in "
        "the server",
        metavar="FILE",
    )
    text_samples: Optional[str] = opt(
        None,
        "with --tokenizer: a UTF-8 file of sample texts, one per line (up to 16 kept), which infer --check sends "
        "to the text entry and holds to eager on the tokenizer's tensors of them",
        metavar="FILE",
    )
    out: str = opt("runs/export", "export directory to create")
    formats: tuple[str, ...] = opt(
        (),
        "formats to export: " + ", ".join(ARTIFACT_FORMATS) + ". Default: torchscript and onnx "
        "in float32; on CUDA also aoti (the official container's torch_aoti); on a CPU "
        "also aoti_int8 where it multiplies 8-bit integers natively (VNNI, AMX-INT8) "
        "and aoti_bf16 where it computes bfloat16 natively (AVX512-BF16, AMX), each "
        "gated on accuracy against float32 and left unserved if it fails. onnx_int8: "
        "ONNX Runtime INT8; aoti_int8: torchao PT2E INT8 compiled by AOTInductor; "
        "aoti_bf16: AOTInductor in bfloat16 behind float32 inputs and outputs",
    )
    calibration: Optional[str] = opt(
        None,
        "onnx_int8, aoti_int8: an npz of real inputs keyed by input name to calibrate on (default: the "
        "checkpoint's held-out samples, or --example-inputs)",
    )
    max_accuracy_drop: float = opt(
        GATE["max_accuracy_drop"],
        "an INT8 artifact passes if its accuracy on the labelled real samples "
        "is within this many points of eager's (without labels: top-1 "
        "agreement >= 99 %% and SQNR >= 20 dB)",
    )
    optional: tuple[str, ...] = opt(
        (),
        "formats that may fail (cannot be exported, or disagree with the reference) without failing the command; they "
        "are reported and not served. Any other format failing exits 3",
    )
    max_batch: int = opt(32, "largest batch size every artifact must accept (the dynamic batch range is 1..N)")
    buckets: tuple[int, ...] = opt(
        (),
        "static batch sizes for the aoti_buckets packages; a batch runs in the next one up, "
        "padded (default: the powers of two up to --max-batch, and --max-batch: a batch "
        "never computes twice its rows)",
    )
    bucket_weights: Literal["auto", "shared", "prepacked"] = opt(
        "auto",
        "aoti_buckets: one copy of the weights for all buckets, or a copy per bucket prepacked for oneDNN (on a CPU "
        "several times faster at small batches, for N buckets times the disk and memory). auto: prepacked on a CPU "
        "while the copies stay under 2 GiB, else shared",
    )
    odd_batch: int = opt(5, "the odd batch size verification uses besides 1 and --max-batch")
    opset: Optional[int] = opt(None, "ONNX opset (default: the exporter's own, recorded in the manifest)")
    dtype: Literal["float32", "float16", "bfloat16"] = opt(
        "float32", "compute dtype inside the artifacts (inputs and outputs stay float32)"
    )
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "device the artifacts are compiled for and verified on")
    tf32: bool = opt(
        False,
        "on CUDA, float32: compile the AOTInductor packages with TensorFloat-32 allowed (faster matmuls and "
        "convolutions on Ampere and later, 10-bit mantissas) and verify them against a TF32 bound, "
        "reported beside the strict one. Off: every artifact is verified in IEEE float32, TF32 off",
    )
    name: Optional[str] = opt(None, "model name used for Triton (default: the architecture)")
    overwrite: bool = opt(False, "replace an existing export directory")
    verify: bool = opt(True, "verify every artifact in a fresh process after exporting")
    atol: Optional[float] = opt(
        None,
        "absolute tolerance against the float64 reference, in place of the bound derived from eager's own rounding "
        "(with --rtol; a flag left out counts as 0)",
    )
    rtol: Optional[float] = opt(
        None, "relative tolerance against the float64 reference, in place of the derived bound (with --atol)"
    )
    allow_degenerate: bool = opt(
        False,
        "go on when eager's outputs are the same for every reference input (a blind check, e.g. a head initialized to "
        "zero)",
    )
    threads: int = opt(
        1,
        "intra-op threads the artifacts will be served with: AOTInductor CPU packages are compiled for it, and "
        "verification runs with it",
    )
    seed: int = opt(0, "seed for the random verification inputs")

    def __post_init__(self) -> None:
        if self.model:
            if self.checkpoint:
                raise ConfigError(f"give a checkpoint ({self.checkpoint}) or --model with --weights, not both")
            missing = [f for f, v in (("--weights", self.weights), ("--input", self.inputs)) if not v]
            if missing:
                raise ConfigError(f"--model needs {' and '.join(missing)} (see torchship export --help)")
        else:
            stray = [
                f
                for f, v in (
                    ("--weights", self.weights),
                    ("--input", self.inputs),
                    ("--image-files", self.image_files),
                    ("--input-range", self.input_ranges),
                    ("--output", self.outputs),
                    ("--example-inputs", self.example_inputs),
                    ("--model-arg", self.model_args),
                )
                if v
            ]
            if stray:
                raise ConfigError(f"{stray[0]} goes with --model; a torchship checkpoint records its own signature")
            if not self.checkpoint:
                raise ConfigError(
                    "give a checkpoint to export, or --model PKG.MODULE:FACTORY --weights FILE --input ..."
                )
        for flag, path in (("--tokenizer", self.tokenizer), ("--text-samples", self.text_samples)):
            if path and not Path(path).is_file():
                raise ConfigError(f"{flag} {path}: no such file")
        if self.text_samples and not self.tokenizer:
            raise ConfigError("--text-samples goes with --tokenizer (the samples are sent as text to the text entry)")
        unknown = [f for f in self.formats if f not in ARTIFACT_FORMATS]
        if unknown:
            raise ConfigError(f"--formats: unknown {', '.join(unknown)}; choose from {', '.join(ARTIFACT_FORMATS)}")
        stray = [f for f in self.optional if f not in (self.formats or ARTIFACT_FORMATS)]
        if stray:
            among = ", ".join(self.formats or ARTIFACT_FORMATS)
            raise ConfigError(f"--optional {stray[0]} is not among --formats ({among})")
        if self.max_batch < 2:
            raise ConfigError("--max-batch must be at least 2 (a batch of 1 cannot be exported as dynamic)")
        if not 1 <= self.odd_batch <= self.max_batch:
            raise ConfigError("--odd-batch must be between 1 and --max-batch")
        if not self.buckets:
            self.buckets = default_buckets(self.max_batch)
        if any(b < 1 for b in self.buckets):
            raise ConfigError("--buckets must be positive batch sizes")
        if max(self.buckets) != self.max_batch and "aoti_buckets" in self.formats:
            raise ConfigError(
                f"--buckets must end at --max-batch {self.max_batch} (largest given: {max(self.buckets)})"
            )
        self.buckets = tuple(sorted(set(self.buckets)))
        int8 = [f for f in self.formats if f in INT8_FORMATS]
        reduced = [f for f in self.formats if f in (*INT8_FORMATS, *BF16_FORMATS)]
        if reduced and self.dtype != "float32":
            raise ConfigError(
                f"--formats {reduced[0]} reduces the float32 model's precision itself; it does not go with "
                f"--dtype {self.dtype}"
            )
        cpu_only = [f for f in self.formats if f in ("aoti_int8", "aoti_bf16")]
        if cpu_only and self.device == "cuda":
            raise ConfigError(
                f"--formats {cpu_only[0]} is compiled for x86 CPUs (oneDNN's INT8 and bf16 kernels); it does "
                "not go with --device cuda"
            )
        if self.calibration and not int8:
            raise ConfigError(f"--calibration calibrates {' and '.join(INT8_FORMATS)}; add one to --formats")
        if self.calibration and not Path(self.calibration).is_file():
            raise ConfigError(
                f"--calibration {self.calibration}: no such file (an npz of real inputs keyed by input name)"
            )
        if not 0 <= self.max_accuracy_drop <= 100:
            raise ConfigError("--max-accuracy-drop is in accuracy points, between 0 and 100")
        if self.threads < 1:
            raise ConfigError("--threads must be at least 1")
        if self.tf32 and (self.dtype != "float32" or self.device == "cpu"):
            raise ConfigError(
                "--tf32 applies to float32 on CUDA; leave it out"
                + (f" with --dtype {self.dtype}" if self.dtype != "float32" else " with --device cpu")
            )

    def for_device(self, device: str, real_samples: bool = True, no_reduced: str = "") -> tuple["ExportConfig", str]:
        """(this config with --formats resolved for ``device``, a line saying what was chosen and why):
        default_formats where none were given. The reduced precisions it adds are optional (a failure is reported
        and not served), and are left out without real samples (a checkpoint's held-out split, or
        --example-inputs) to calibrate and gate them on, with --dtype other than float32, or where the model's
        task says why not (``no_reduced``)."""
        if self.formats:
            return self, ""

        formats, why = default_formats(device)
        reduced = [f for f in formats if f in (*INT8_FORMATS, *BF16_FORMATS)]
        if reduced and (not real_samples or self.dtype != "float32" or no_reduced):
            formats = tuple(f for f in formats if f not in reduced)
            why += f"; {', '.join(reduced)} left out: " + (
                "no real samples to calibrate and gate them on (give --example-inputs)"
                if not real_samples
                else f"--dtype {self.dtype} is already reduced"
                if self.dtype != "float32"
                else no_reduced
            )
            reduced = []
        stray = [f for f in self.optional if f not in formats]
        if stray:
            raise ConfigError(
                f"--optional {stray[0]} is not among the default formats on {device} ({', '.join(formats)}); "
                "name it in --formats"
            )
        return dataclasses.replace(
            self, formats=formats, optional=tuple(dict.fromkeys((*self.optional, *reduced)))
        ), why


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``max_batch``, and ``max_batch`` itself."""
    return tuple(sorted({*(1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch), max_batch}))
