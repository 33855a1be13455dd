"""A model's tensor signature: its inputs and outputs, each with a dtype and dims, and the ranges of its
dynamic dims. Parsed from ``--input``/``--dim``/``--input-range``, recorded in the manifest, and read back
by every stage after export."""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .errors import ConfigError

BATCH = "batch"  # the manifest's name for dim 0 of every tensor
DYNAMIC = "dynamic"  # an output dim that varies with the inputs in a way no input dim names
INPUT_DTYPES = ("float32", "float16", "int64", "int32", "bool")
NP_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
}


MASK = "mask"  # --input-range NAME=mask: padding masks, as a tokenizer makes them


@dataclass
class TensorSpec:
    name: str
    dtype: str
    shape: list  # shape[0] is BATCH; the others are ints or names of dynamic dims
    range: Optional[tuple[float, float]] = None  # the values random inputs take (integer inputs)
    values: Optional[str] = None  # MASK: random inputs are padding masks (padding_mask); None: uniform in range

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.range is not None:
            d["range"] = list(self.range)
        if self.values is not None:
            d["values"] = self.values
        return d

    @property
    def is_float(self) -> bool:
        return self.dtype.startswith("float")


@dataclass
class Signature:
    inputs: list[TensorSpec]
    outputs: list[TensorSpec] = field(default_factory=list)
    dims: dict[str, tuple[int, int]] = field(default_factory=dict)  # dynamic non-batch dim -> (min, max)
    notes: list[str] = field(default_factory=list)  # how a flag was read, for the export to print (not recorded)

    def to_manifest(self) -> dict[str, Any]:
        return {
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "dims": {k: {"min": lo, "max": hi} for k, (lo, hi) in self.dims.items()},
        }

    @classmethod
    def from_manifest(cls, m: dict[str, Any]) -> "Signature":
        def spec(t):
            return TensorSpec(
                t["name"], t["dtype"], list(t["shape"]), tuple(t["range"]) if t.get("range") else None, t.get("values")
            )

        return cls(
            [spec(t) for t in m["inputs"]],
            [spec(t) for t in m["outputs"]],
            {k: (int(v["min"]), int(v["max"])) for k, v in m.get("dims", {}).items()},
        )

    def to_flags(self) -> str:
        """The inputs as the --input/--dim/--input-range flags that declare them."""

        def num(v):
            return f"{v:g}" if isinstance(v, float) else str(v)

        out = [
            f"--input {t.name}:{t.dtype}:{','.join('B' if d == BATCH else str(d) for d in t.shape)}"
            for t in self.inputs
        ]
        out += [f"--dim {k}={lo}..{hi}" for k, (lo, hi) in self.dims.items()]
        out += [
            f"--input-range {t.name}=" + (MASK if t.values == MASK else f"{num(t.range[0])}..{num(t.range[1])}")
            for t in self.inputs
            if t.range is not None or t.values == MASK
        ]
        return " ".join(out)

    def dims_of(self, feeds: dict[str, Any]) -> dict[str, int]:
        """The size of each dynamic dim in a batch of inputs (by input name)."""
        out: dict[str, int] = {}
        for t in self.inputs:
            for axis, d in enumerate(t.shape):
                if isinstance(d, str) and d in self.dims:
                    out.setdefault(d, int(feeds[t.name].shape[axis]))
        return out

    def shape(self, t: TensorSpec, batch: int, values: dict[str, int]) -> tuple[int, ...]:
        return (batch, *(d if isinstance(d, int) else values[d] for d in t.shape[1:]))

    def random_inputs(self, rng: np.random.Generator, batch: int, values: dict[str, int]) -> dict[str, np.ndarray]:
        """Random inputs of every input's dtype: floats in [0, 1) or their range, integers in their range,
        masks as padding masks (``values`` gives each dynamic dim's size)."""
        out = {}
        for t in self.inputs:
            shp = self.shape(t, batch, values)
            if t.values == MASK:
                out[t.name] = padding_mask(rng, shp, NP_DTYPES[t.dtype])
            elif t.dtype == "bool":
                out[t.name] = rng.random(shp) < 0.5
            elif t.is_float:
                lo, hi = t.range or (0.0, 1.0)
                out[t.name] = (lo + (hi - lo) * rng.random(shp)).astype(NP_DTYPES[t.dtype])
            else:
                lo, hi = t.range or (0, 1)
                out[t.name] = rng.integers(int(lo), int(hi), size=shp, endpoint=True).astype(NP_DTYPES[t.dtype])
        return out

    def dim_cases(self) -> list[dict[str, int]]:
        """The dynamic-dim values to verify at: for each dim its minimum, its maximum and an odd value
        between (the others at their maximum). One case (empty) when there are none."""
        if not self.dims:
            return [{}]
        base = {k: hi for k, (lo, hi) in self.dims.items()}
        cases = [base]
        for k, (lo, hi) in self.dims.items():
            mid = (lo + hi) // 2 | 1
            for v in dict.fromkeys((lo, mid if lo < mid < hi else lo, hi)):
                case = {**base, k: v}
                if case not in cases:
                    cases.append(case)
        return cases

    def example_values(self) -> dict[str, int]:
        """Dynamic-dim sizes for tracing: at least 2 (a size of 1 would be specialized) and distinct from
        the example batch of 2 where the range allows, so that no two dims look equal to the exporter."""
        taken = {2}
        out = {}
        for k, (lo, hi) in self.dims.items():
            v = next((v for v in range(max(lo, 2), hi + 1) if v not in taken), max(lo, min(hi, 2)))
            out[k] = v
            taken.add(v)
        return out


def padding_mask(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    """Padding masks as a tokenizer makes them: along the last axis, a run of ones (at least one) followed by
    zeros. Lengths are drawn in 1..S; with two or more rows the first is full and the second holds one token,
    so both ends of the range are always checked. A row with no 1 at all, which no tokenizer sends and on
    which attention has no defined answer, is never drawn."""
    s, rows = shape[-1], int(np.prod(shape[:-1]))
    lengths = rng.integers(1, s, size=rows, endpoint=True)
    if rows >= 2:
        lengths[0], lengths[1] = s, 1
    return (np.arange(s)[None, :] < lengths[:, None]).reshape(shape).astype(dtype)


def is_padding_mask(a: np.ndarray) -> bool:
    """Whether ``a`` holds padding masks with some padding: 0s and 1s only, each row along the last axis a
    run of ones (at least one) then zeros, and at least one 0."""
    if a.ndim < 2 or a.size == 0 or not np.isin(a, (0, 1)).all():
        return False
    rows = a.reshape(-1, a.shape[-1]).astype(np.int8)
    return bool((rows[:, 0] == 1).all() and (np.diff(rows, axis=1) <= 0).all() and (rows == 0).any())


def looks_like_mask(name: str) -> bool:
    return "mask" in name.lower()


def _unit(t: TensorSpec) -> Optional[tuple]:
    """A mask's value range, 0..1, in the input's kind (none for bool)."""
    return None if t.dtype == "bool" else (0.0, 1.0) if t.is_float else (0, 1)


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_name(name: str, what: str) -> str:
    if not _NAME.match(name) or keyword.iskeyword(name) or name == "self":
        raise ConfigError(
            f"{what} {name!r} is not a valid name: use letters, digits and '_' (the exporters name "
            "graph inputs after it)"
        )
    return name


def _span(text: str, flag: str, cast=int) -> tuple:
    lo, sep, hi = text.partition("..")
    try:
        if not sep:
            raise ValueError
        a, b = cast(lo), cast(hi)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give a range as LO..HI, e.g. 1..128") from None
    if a > b:
        raise ConfigError(f"{flag} {text!r}: the low end exceeds the high end")
    return a, b


def parse_dims(dims: list[str] | tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """``--dim NAME=MIN..MAX`` values as {name: (min, max)}; ConfigError naming the one that is wrong."""
    out: dict[str, tuple[int, int]] = {}
    for text in dims:
        name, sep, span = text.partition("=")
        if not sep:
            raise ConfigError(f"--dim {text!r} must look like NAME=MIN..MAX, e.g. S=1..128")
        lo, hi = _span(span, f"--dim {name}")
        if lo < 1:
            raise ConfigError(f"--dim {text!r}: a dim's minimum must be at least 1")
        out[_check_name(name, "--dim")] = (lo, hi)
    return out


def parse_signature(
    inputs: list[str] | tuple[str, ...],
    dims: list[str] | tuple[str, ...] = (),
    ranges: list[str] | tuple[str, ...] = (),
) -> Signature:
    """``--input NAME:DTYPE:DIMS`` (DIMS comma-separated, the first ``B``), ``--dim NAME=MIN..MAX`` for every
    named dim, ``--input-range NAME=LO..HI``; ConfigError naming the flag and value that is wrong."""
    if not inputs:
        raise ConfigError("--input: give at least one, as NAME:DTYPE:DIMS (e.g. --input features:float32:B,20)")
    dim_ranges = parse_dims(dims)
    specs, seen, used = [], set(), set()
    for text in inputs:
        parts = text.split(":")
        if len(parts) != 3:
            raise ConfigError(f"--input {text!r} must look like NAME:DTYPE:DIMS, e.g. input_ids:int64:B,S")
        name, dtype, dimtext = parts
        _check_name(name, "--input")
        if name in seen:
            raise ConfigError(f"--input {name} is given twice")
        seen.add(name)
        if dtype == "bfloat16":
            raise ConfigError(
                f"--input {name}: bfloat16 inputs cannot be fed (numpy, ONNX Runtime's Python API and "
                "Triton's clients have no bfloat16 arrays); take float32 and cast inside the model, "
                "or export with --dtype bfloat16 to compute in bfloat16"
            )
        if dtype not in INPUT_DTYPES:
            raise ConfigError(f"--input {name}: dtype {dtype!r} is not one of {', '.join(INPUT_DTYPES)}")
        raw = [d.strip() for d in dimtext.split(",")]
        if raw[0] != "B":
            raise ConfigError(f"--input {name}: the first dim must be B, the batch (got {dimtext!r})")
        shape: list = [BATCH]
        for d in raw[1:]:
            if d.isdigit() and int(d) > 0:
                shape.append(int(d))
            elif d in dim_ranges:
                shape.append(d)
                used.add(d)
            else:
                raise ConfigError(
                    f"--input {name}: dim {d!r} is neither a positive integer nor a dim given by --dim {d}=MIN..MAX"
                )
        specs.append(TensorSpec(name, dtype, shape))
    unused = [k for k in dim_ranges if k not in used]
    if unused:
        raise ConfigError(f"--dim {unused[0]} is used by no --input")
    by_name = {t.name: t for t in specs}
    notes: list[str] = []
    for text in ranges:
        name, sep, span = text.partition("=")
        if not sep or name not in by_name:
            raise ConfigError(
                f"--input-range {text!r} must look like NAME=LO..HI (or NAME=mask) with NAME one of the "
                f"inputs ({', '.join(by_name)})"
            )
        t = by_name[name]
        if span == MASK:
            if len(t.shape) < 2:
                raise ConfigError(
                    f"--input-range {name}=mask: a mask runs along a sequence axis, and {name} has only the batch dim"
                )
            t.values, t.range = MASK, _unit(t)
            continue
        uniform = span.startswith("uniform:")
        span = span[len("uniform:") :] if uniform else span
        if t.dtype == "bool":
            raise ConfigError(f"--input-range {name}: a bool input takes no range (only =mask, for a padding mask)")
        t.range = _span(span, f"--input-range {name}", int if not t.is_float else float)
        if not uniform and t.range == (0, 1) and not t.is_float and looks_like_mask(name) and len(t.shape) >= 2:
            t.values = MASK
            notes.append(
                f"--input-range {name}=0..1 on an input named like a mask: drawn as padding masks (each row "
                f"ones, then zeros, at least one 1), as a tokenizer makes them; {name}=uniform:0..1 draws "
                "independent 0s and 1s instead"
            )
    for t in specs:
        if t.dtype == "bool" and t.values is None and looks_like_mask(t.name) and len(t.shape) >= 2:
            t.values = MASK
            notes.append(
                f"--input {t.name} is a bool input named like a mask: drawn as padding masks (each row True, "
                "then False, at least one True), as a tokenizer makes them"
            )
        if not t.is_float and t.dtype != "bool" and t.range is None and t.values is None:
            raise ConfigError(
                f"--input {t.name} is {t.dtype}: give the values its random verification data may take "
                f"with --input-range {t.name}=LO..HI (e.g. token ids 0..VOCAB-1), or {t.name}=mask for "
                "an attention mask"
            )
    return Signature(specs, [], dim_ranges, notes)


def dtype_name(dtype: Any) -> str:
    """'float32', 'int64', ... for a numpy or torch dtype."""
    s = str(dtype).replace("torch.", "")
    return "bool" if s in ("bool", "bool_") else s
