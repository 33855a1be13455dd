"""One rule for names: an export is named after its model, and each Triton model after the export and
the format it serves (``<export name>_<format>``); the rule read backwards finds a served model's format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

from .runtime import ARTIFACTS


@dataclass(frozen=True)
class ServedFormat:
    """How one served format reaches Triton. ``platform`` and ``file``: what the official container loads, from
    which file of the version folder. ``artifacts``: the export's artifacts that can serve it, the one the
    embedded server prefers first (it batches the static-batch ``aoti_buckets`` archive; the container reads only
    the dynamic ``aoti`` package). ``precision``: what it computes in ("model": the export's own dtype).
    ``made_for``: what binds the artifact to the device it was exported on ("" where it runs on any)."""

    platform: str
    file: str
    artifacts: tuple[str, ...]
    made_for: str = ""

    @property
    def precision(self) -> str:
        return ARTIFACTS[self.artifacts[0]]


COMPILED, QUANTIZED = "compiled", "quantized"
FORMATS = {  # the one table of served formats: one Triton model each, in this order
    "onnx": ServedFormat("onnxruntime_onnx", "model.onnx", ("onnx",)),
    "torchscript": ServedFormat("pytorch_libtorch", "model.pt", ("torchscript",)),
    "aoti": ServedFormat("torch_aoti", "model.pt2", ("aoti_buckets", "aoti"), made_for=COMPILED),
    "onnx_int8": ServedFormat("onnxruntime_onnx", "model.onnx", ("onnx_int8",), made_for=QUANTIZED),
    "aoti_int8": ServedFormat("torch_aoti", "model.pt2", ("aoti_int8",), made_for=COMPILED),
    "aoti_bf16": ServedFormat("torch_aoti", "model.pt2", ("aoti_bf16",), made_for=COMPILED),
}
SERVED_FORMATS = tuple(FORMATS)
FORMAT_PARAMETER = (
    "torchship_format"  # a model served under the export's plain name records its format in this parameter
)


def export_name(spec: str) -> str:
    """An export's name from its model: a built-in architecture's name, or a factory's function name
    (``package.module:factory`` -> ``factory``)."""
    return spec.split(":")[-1]


def model_name(manifest: dict[str, Any], fmt: str) -> str:
    """The Triton model that serves ``fmt`` of the export ``manifest`` describes."""
    if fmt not in SERVED_FORMATS:
        raise ValueError(f"{fmt!r} is not served; served formats: {', '.join(SERVED_FORMATS)}")
    return f"{manifest['name']}_{fmt}"


def model_names(manifest: dict[str, Any], formats: Iterable[str] = SERVED_FORMATS) -> dict[str, str]:
    """format -> Triton model name."""
    return {f: model_name(manifest, f) for f in formats}


def format_of(model: str, manifest: Optional[dict[str, Any]] = None, config: Any = None) -> Optional[str]:
    """The format a Triton model serves; None if it serves none of them (or another export's). The rule read
    backwards: the format its ``config`` records (a model served under the export's plain name carries
    FORMAT_PARAMETER; a config as JSON, or a ModelConfig), else the suffix of its name after the export's
    name (``manifest``), else, for a repository read on its own, the longest format its name ends in."""
    if config is not None:
        params = config.get("parameters", {}) if isinstance(config, dict) else config.parameters
        if FORMAT_PARAMETER in params:
            p = params[FORMAT_PARAMETER]
            return p.get("string_value") if isinstance(p, dict) else p.string_value
    if manifest is not None:
        prefix = f"{manifest['name']}_"
        fmt = model[len(prefix) :] if model.startswith(prefix) else None
        return fmt if fmt in SERVED_FORMATS else None
    return next((f for f in sorted(SERVED_FORMATS, key=len, reverse=True) if model.endswith("_" + f)), None)


def models_of(manifest: dict[str, Any], served: Iterable[str]) -> list[str]:
    """The served models that belong to this export, in the order given."""
    return [m for m in served if format_of(m, manifest)]


def served_artifact(passed: Iterable[str], fmt: str) -> Optional[str]:
    """The artifact the embedded server runs for ``fmt``, of the artifact formats that ``passed`` verification;
    None where none of them can serve it."""
    have = set(passed)
    return next((a for a in FORMATS[fmt].artifacts if a in have), None)


def sources(fmt: str) -> tuple[str, ...]:
    """The artifact formats that can serve ``fmt`` (a served format's from FORMATS; any other, itself)."""
    return FORMATS[fmt].artifacts if fmt in FORMATS else (fmt,)
