"""What the machine at hand offers: the device to run on, CPU features, CPU count, and the AMP choice
that follows from them. Every stage asks here rather than deciding on its own."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

from .errors import ConfigError

# CPU flags (as /proc/cpuinfo spells them) of instructions that compute bf16 natively. Without one,
# bf16 autocast on the CPU is emulated: resnet18 trained 37x slower than fp32 on an AVX2-only Zen 2.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# ... and of instructions that multiply u8 by s8 into 32-bit sums in one step (VNNI, AMX-INT8)
NATIVE_INT8_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")


def cuda_visible() -> bool:
    """Whether torch sees a CUDA device here."""
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def resolve_device(choice: str, flag: str = "--device") -> str:
    """``auto``, ``cpu`` or ``cuda`` as the device to use; ConfigError naming ``flag`` if CUDA is asked
    for and none is visible."""
    if choice == "cuda" and not cuda_visible():
        raise ConfigError(f"{flag} cuda: no CUDA device is visible")
    if choice not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"{flag} must be auto, cpu or cuda, got {choice!r}")
    return "cuda" if choice == "cuda" or (choice == "auto" and cuda_visible()) else "cpu"


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (an empty set where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16_flag() -> str | None:
    """The first of NATIVE_BF16_FLAGS this CPU has, else None."""
    flags = cpu_flags()
    return next((f for f in NATIVE_BF16_FLAGS if f in flags), None)


def native_precisions(flags: set[str] | None = None) -> dict[str, tuple[bool, str]]:
    """{"int8": (native, why), "bf16": (native, why)}: which reduced precisions this CPU (``flags``: its
    /proc/cpuinfo flags, read here when None) computes natively, each with its reason in a few words."""
    flags = cpu_flags() if flags is None else flags
    int8 = next((f for f in NATIVE_INT8_FLAGS if f in flags), None)
    bf16 = next((f for f in NATIVE_BF16_FLAGS if f in flags), None)
    return {
        "int8": (True, f"{int8} multiplies 8-bit integers natively")
        if int8
        else (False, "no VNNI or AMX-INT8: 8-bit products go through saturating 16-bit sums"),
        "bf16": (True, f"{bf16} computes bfloat16 natively")
        if bf16
        else (False, "no AVX512-BF16 or AMX: bfloat16 would be emulated, many times slower"),
    }


def resolve_amp(amp: str, device: str) -> tuple[str, str]:
    """(precision, reason): what ``--amp`` means on ``device``. ``auto`` is bf16 on a CUDA GPU that
    supports it, and on a CPU that computes bf16 natively (AVX512-BF16 or AMX); otherwise off. An explicit
    choice is kept; its reason warns when bf16 would be emulated on this CPU. ConfigError for fp16 off CUDA."""
    check_amp(amp, device)
    if device == "cuda":
        import torch

        supported = torch.cuda.is_bf16_supported()
        if amp == "auto":
            return ("bf16", "the GPU supports bf16") if supported else ("off", "the GPU has no bf16 support")
        return amp, "as asked"
    flag = native_bf16_flag()
    if amp == "auto":
        if flag:
            return "bf16", f"this CPU computes bf16 natively ({flag})"
        return (
            "off",
            "this CPU has no native bf16 (no AVX512-BF16 or AMX), where bf16 autocast is emulated and much slower",
        )
    if amp == "bf16" and not flag:
        return "bf16", (
            "warning: this CPU has no native bf16 (no AVX512-BF16 or AMX): bf16 autocast is emulated "
            "and can be tens of times slower than --amp off"
        )
    return amp, "as asked"


def check_amp(amp: str, device: str) -> None:
    """ConfigError for an --amp that cannot run on ``device`` (fp16 needs CUDA), without touching the GPU."""
    if amp == "fp16" and device != "cuda":
        raise ConfigError("--amp fp16 needs CUDA (fp16 autocast with GradScaler); on a CPU use --amp bf16, off or auto")


def usable_cpus() -> int:
    """How many CPUs this process may run on: its affinity mask (``taskset``, a container's cpuset), which
    ``os.cpu_count()`` ignores; the machine's count where the platform has no affinity call."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else platform.processor(), for figures' machine lines."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to ``n`` for the block, put back after it."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
