"""The reference an export is verified against: its inputs, eager's outputs computed in float64, and the
bound each output is held to, derived from eager's own rounding on those inputs."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchship import parity, runtime
from torchship.errors import first_line
from torchship.manifest import RANDOM_SETS
from torchship.signature import Signature

FP64_CHUNK = 8  # rows per float64 call


@dataclass
class Reference:
    arrays: dict[str, np.ndarray]  # reference.npz: input/SET/NAME, expected/SET/OUTPUT, labels/SET
    sets: dict[str, dict[str, Any]]  # SET -> {"batch": n, "dims": {...}}
    tolerances: dict[str, Any]  # the manifest's: the rule and each output's bound
    degenerate: list[str]  # outputs whose every sample is the same on every set


def input_sets(
    sig: Signature, samples: dict[str, np.ndarray], sample_set: str, odd_batch: int, max_batch: int, seed: int
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, dict[str, Any]]]:
    """The reference inputs: the real samples, then random batches of 1, odd and max at each dynamic-dim case."""
    sets: dict[str, dict[str, np.ndarray]] = {}
    info: dict[str, dict[str, Any]] = {}
    if samples:
        sets[sample_set] = samples
        info[sample_set] = {"batch": len(next(iter(samples.values()))), "dims": sig.dims_of(samples)}
    g = np.random.default_rng(seed)
    for values in sig.dim_cases():
        for b in sorted({1, odd_batch, max_batch}):
            key = f"{RANDOM_SETS}b{b}" + "".join(f"_{k}={v}" for k, v in values.items())
            sets[key] = sig.random_inputs(g, b, values)
            info[key] = {"batch": b, "dims": values}
    return sets, info


def _fp64_fn(model: torch.nn.Module, device: str):
    """``model`` in float64 (float inputs cast up), returning its outputs unrounded."""

    def fn(xs: list[np.ndarray]) -> list[np.ndarray]:
        args = [torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in xs]
        args = [a.double() if a.is_floating_point() else a for a in args]
        with torch.inference_mode():
            out = model(*args)
        outs = out if isinstance(out, (list, tuple)) else [out]
        return [o.detach().cpu().numpy() for o in outs]

    return fn


def _run(
    fn, sets: dict[str, dict[str, np.ndarray]], names: list[str], outputs: list[str], max_batch: int, pace=None
) -> dict[str, list[np.ndarray]]:
    """``fn`` on every set, in chunks of at most ``max_batch``; ``pace()`` (where given) before each chunk, to take
    the cores the compiles beside it leave free."""
    got: dict[str, list[np.ndarray]] = {o: [] for o in outputs}
    paced = fn if pace is None else (lambda xs: (pace(), fn(xs))[1])
    for feeds in sets.values():
        for o, y in zip(outputs, runtime.in_chunks(paced, [feeds[n] for n in names], max_batch)):
            got[o].append(y)
    return got


def fp64_outputs(
    model: torch.nn.Module, sets, names, outputs, max_batch: int, device: str, pace=None
) -> tuple[dict | None, str]:
    """(eager's outputs in float64 per output and set, "") or (None, why it cannot run in float64)."""
    twin = copy.deepcopy(model).double()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # tensors the model makes itself follow it
    try:
        got = _run(_fp64_fn(twin, device), sets, names, outputs, max_batch, pace)
    except Exception as e:  # any model code that insists on float32
        return None, f"it fails in float64 ({first_line(e, 160)})"
    finally:
        torch.set_default_dtype(default)
        del twin
    low = [o for o, ys in got.items() if ys and ys[0].dtype.kind == "f" and ys[0].dtype != np.float64]
    if low:
        return None, f"it returns {got[low[0]][0].dtype} for output {low[0]!r} from float64 inputs (it casts inside)"
    return got, ""


def build_reference(
    eager: torch.nn.Module,
    exported: torch.nn.Module,
    sig: Signature,
    sets,
    info,
    dtype: str,
    max_batch: int,
    device: str,
    labels: np.ndarray | None,
    sample_set: str,
    tf32: bool = False,
    pace=None,
    derive=parity.derive,
) -> Reference:
    """Run eager (``eager``: the float32 model) in float64 and ``exported`` (the module the artifacts are
    made from, in ``dtype``) on every set, and derive each output's bound from the two. On CUDA, float32
    runs in IEEE float32 (TF32 off), so that the bound is a float32 bound; with ``tf32`` eager runs once more
    with TF32 allowed, for the bound of the artifacts compiled so (parity.with_tf32). ``pace()``, where given, runs
    before each chunk: the export sets the thread count there to the cores its compiles leave free. ``derive``
    turns the two into the bounds (a detector's: torchship.detection_parity.derive)."""
    names = [t.name for t in sig.inputs]
    outputs = [t.name for t in sig.outputs]
    with runtime.fp32_precision(device):
        low = _run(runtime.torch_fn(exported, device), sets, names, outputs, max_batch, pace)
    # float64 runs several times slower than float32: in chunks of 8, so that pace() can hand it a core freed early
    ref, why = fp64_outputs(eager, sets, names, outputs, min(max_batch, FP64_CHUNK), device, pace)
    if ref is None:
        with runtime.fp32_precision(device):
            ref = low if dtype == "float32" else _run(runtime.torch_fn(eager, device), sets, names, outputs, max_batch)
    tolerances = derive(ref, low, dtype, fp64=not why, why=why)
    if tf32:
        with runtime.fp32_precision(device, tf32=True):
            fast = _run(runtime.torch_fn(exported, device), sets, names, outputs, max_batch)
        tolerances = parity.with_tf32(tolerances, derive(ref, fast, dtype, fp64=not why, why=why))
    arrays: dict[str, np.ndarray] = {}
    for i, (key, feeds) in enumerate(sets.items()):
        for n in names:
            arrays[f"input/{key}/{n}"] = feeds[n]
        for o in outputs:
            arrays[f"expected/{key}/{o}"] = ref[o][i]
    if labels is not None:
        arrays[f"labels/{sample_set}"] = labels
    return Reference(arrays, info, tolerances, parity.degenerate_outputs(ref))
