"""ExportConfig: which formats, batch limits, precision and parity tolerances."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from torchship.config import opt
from torchship.errors import ConfigError
from torchship.runtime import FORMATS

# Parity tolerances per artifact dtype: pass when |artifact - eager| <= atol + rtol * |eager|.
DEFAULT_TOLERANCES = {
    "float32": {"atol": 1e-5, "rtol": 1e-5},
    "bfloat16": {"atol": 0.15, "rtol": 0.03},
    "float16": {"atol": 2e-2, "rtol": 1e-2},
}


@dataclass
class ExportConfig:
    checkpoint: str = opt("", "checkpoint directory, its model.pt, or a training output directory (its best)", cli=False)
    out: str = opt("runs/export", "export directory to create")
    formats: tuple[str, ...] = opt(FORMATS, "formats to export: " + ", ".join(FORMATS))
    max_batch: int = opt(32, "largest batch size every artifact must accept (the dynamic batch range is 1..N)")
    buckets: tuple[int, ...] = opt((1, 8, 32), "static batch sizes for the aoti_buckets packages (requests pad up to the next)")
    odd_batch: int = opt(5, "the odd batch size verification uses besides 1 and --max-batch")
    opset: Optional[int] = opt(None, "ONNX opset (default: the exporter's own, recorded in the manifest)")
    dtype: Literal["float32", "float16", "bfloat16"] = opt("float32", "compute dtype inside the artifacts (inputs and outputs stay float32)")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "device the artifacts are compiled for and verified on")
    name: Optional[str] = opt(None, "model name used for Triton (default: the architecture)")
    overwrite: bool = opt(False, "replace an existing export directory")
    strict: bool = opt(False, "fail when any format cannot be exported (default: keep the others and report it)")
    verify: bool = opt(True, "verify every artifact in a fresh process after exporting")
    atol: Optional[float] = opt(None, "absolute parity tolerance (default per dtype: fp32 1e-5, bf16 0.15, fp16 2e-2)")
    rtol: Optional[float] = opt(None, "relative parity tolerance (default per dtype: fp32 1e-5, bf16 0.03, fp16 1e-2)")
    threads: int = opt(1, "intra-op threads the artifacts will be served with: AOTInductor CPU packages are compiled for it, and verification runs with it")
    seed: int = opt(0, "seed for the random verification inputs")

    def __post_init__(self) -> None:
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown:
            raise ConfigError(f"--formats: unknown {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
        if not self.formats:
            raise ConfigError("--formats: give at least one format")
        if self.max_batch < 2:
            raise ConfigError("--max-batch must be at least 2 (a batch of 1 cannot be exported as dynamic)")
        if not 1 <= self.odd_batch <= self.max_batch:
            raise ConfigError("--odd-batch must be between 1 and --max-batch")
        if any(b < 1 for b in self.buckets) or not self.buckets:
            raise ConfigError("--buckets must be positive batch sizes")
        if max(self.buckets) != self.max_batch and "aoti_buckets" in self.formats:
            raise ConfigError(f"--buckets must end at --max-batch {self.max_batch} (largest given: {max(self.buckets)})")
        self.buckets = tuple(sorted(set(self.buckets)))
        if self.threads < 1:
            raise ConfigError("--threads must be at least 1")

    def tolerances(self) -> dict[str, float]:
        t = dict(DEFAULT_TOLERANCES[self.dtype])
        if self.atol is not None:
            t["atol"] = self.atol
        if self.rtol is not None:
            t["rtol"] = self.rtol
        return t
