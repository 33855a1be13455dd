"""Load an exported artifact and run it on numpy batches: the one loader per format that the
verifier (in a fresh process) and the Triton Python backends both use.

Kept free of torchship imports so the serving backends can carry a copy of this file.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import threading
import zipfile
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

# The one table of artifact formats (what the exporter writes and this module loads), each with what it computes
# in: "model" (the model's own dtype), "int8" (quantized: gated on accuracy rather than rounding) or "bf16" (in
# bfloat16 behind float32 inputs and outputs: gated on accuracy too). torchship.names' FORMATS serves them.
ARTIFACTS = {
    "torchscript": "model",
    "exported_program": "model",
    "aoti": "model",
    "aoti_buckets": "model",
    "onnx": "model",
    "onnx_int8": "int8",
    "aoti_int8": "int8",
    "aoti_bf16": "bf16",
}
ARTIFACT_FORMATS = tuple(ARTIFACTS)
FP32_FORMATS, INT8_FORMATS, BF16_FORMATS = (
    tuple(f for f, p in ARTIFACTS.items() if p == precision) for precision in ("model", "int8", "bf16")
)
BUCKET_PREFIX = "bs"  # the model name of each static batch size inside an aoti_buckets archive: bs1, bs8, ...


class Runner:
    """A loaded artifact. ``run({input_name: array}) -> {output_name: array}``.

    ``input_names``/``output_names`` are what the artifact itself exposes where the format
    records names (ONNX graph, TorchScript schema, ExportedProgram signature); otherwise None.
    """

    input_names: list[str] | None = None
    output_names: list[str] | None = None

    def __init__(
        self, fn: Callable[[list[np.ndarray]], list[np.ndarray]], inputs: Sequence[str], outputs: Sequence[str]
    ):
        self._fn = fn
        self.contract_inputs = list(inputs)
        self.contract_outputs = list(outputs)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.contract_outputs, self._fn([feeds[n] for n in self.contract_inputs])))


def _torch_setup(threads: int):
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass  # already set in this process
    return torch


def set_tf32(allowed: bool) -> tuple[bool, bool]:
    """Allow or forbid TensorFloat-32 for float32 matmuls and cuDNN convolutions on CUDA; returns the two
    settings it replaced, for restore_tf32. On CUDA, convolutions run in TF32 by default, which rounds float32
    to 10 mantissa bits: a bound derived from such a run is too wide to catch a wrong weight. The allow_tf32
    flags are the ones Inductor reads when it compiles, and torch's newer fp32_precision settings follow them
    (setting those directly leaves the cuDNN flag unreadable in torch 2.14). Needs no GPU: process-wide switches."""
    import torch

    previous = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = allowed
    return previous


def restore_tf32(previous: tuple[bool, bool]) -> None:
    """Put back what set_tf32 replaced."""
    import torch

    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@contextlib.contextmanager
def tf32_allowed(allowed: bool):
    """set_tf32 for the block, on any machine, and what it replaced put back after."""
    previous = set_tf32(allowed)
    try:
        yield
    finally:
        restore_tf32(previous)


@contextlib.contextmanager
def fp32_precision(device: str, tf32: bool = False):
    """On CUDA: float32 computed as IEEE float32 (``tf32`` False) or with TF32 allowed, inside the block; the
    settings before it are restored after. Elsewhere: nothing (CPUs have no TF32)."""
    with tf32_allowed(tf32) if device.startswith("cuda") else contextlib.nullcontext():
        yield


def torch_fn(module, device: str, threads: int = 0):
    """``module`` as a function of a list of numpy inputs (its positional arguments), under inference mode,
    returning its outputs as numpy arrays (floating outputs as float32)."""
    import torch

    set_here = threading.local()

    def fn(xs: list[np.ndarray]) -> list[np.ndarray]:
        if threads > 0 and not getattr(set_here, "done", False):
            # torch.set_num_threads sets OpenMP's thread count for the calling thread only, and AOTInductor's
            # compiled code reads the calling thread's setting. A served model runs on a thread other than
            # the one that loaded it, so each thread sets it on its first call.
            torch.set_num_threads(threads)
            set_here.done = True
        with torch.inference_mode():
            out = module(*[torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in xs])
        outs = out if isinstance(out, (list, tuple)) else [out]
        return [(o.float() if o.is_floating_point() else o).detach().cpu().numpy() for o in outs]

    return fn


def in_chunks(
    fn: Callable[[list[np.ndarray]], list[np.ndarray]], xs: Sequence[np.ndarray], size: int
) -> list[np.ndarray]:
    """``fn`` over the inputs ``xs`` (arrays of equal length) in batches of at most ``size`` rows, the
    outputs joined again."""
    n = len(xs[0])
    if n <= size:
        return fn(list(xs))
    parts = [fn([x[i : i + size] for x in xs]) for i in range(0, n, size)]
    return [np.concatenate([p[k] for p in parts]) for k in range(len(parts[0]))]


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``n`` rows (ValueError if none does)."""
    for b in sorted(buckets):
        if b >= n:
            return b
    raise ValueError(f"batch {n} exceeds the largest bucket {max(buckets)}")


def padded_call(
    fns: dict[int, Callable[[list[np.ndarray]], list[np.ndarray]]], xs: list[np.ndarray]
) -> list[np.ndarray]:
    """Run the inputs ``xs`` through static-batch functions keyed by batch size: pad the batch dim up to
    the next bucket with copies of the last row, run, and return only the real rows. Batches above the
    largest bucket are split into chunks."""
    largest = max(fns)
    n = xs[0].shape[0]
    if n > largest:
        return in_chunks(lambda part: padded_call(fns, part), xs, largest)
    b = bucket_for(n, fns)
    if b != n:
        xs = [np.concatenate([x, np.repeat(x[-1:], b - n, axis=0)]) for x in xs]
    return [o[:n] for o in fns[b](xs)]


ONNX_FORMATS = ("onnx", "onnx_int8")  # the formats ONNX Runtime runs; torch runs every other
# what loading a format imports beyond torch (torch.export.load: the archive reader and dynamo, about 1.2 s of CPU,
# and on its first symbolic shape the export tracer, whose files its shape environment skips, 0.35 s more): a
# process that runs many such artifacts, each in a child of its own, imports them once before forking them
LOADER_MODULES = {"exported_program": ("torch.export.pt2_archive._package", "torch.export._trace")}


def load(
    fmt: str,
    path: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    device: str = "cpu",
    threads: int = 1,
    buckets: Sequence[int] | None = None,
    ort_providers: Sequence[str] | None = None,
    tf32: bool = False,
    spin: bool = True,
) -> Runner:
    """Load the artifact file ``path``; for aoti_buckets, ``buckets`` picks which of its batch sizes to run
    (default: all). On CUDA, float32 runs in IEEE float32 unless ``tf32`` (an artifact compiled with TF32
    allowed): for torch formats this process's TF32 settings are set, for ONNX Runtime its CUDA provider's.
    ``spin`` False: ONNX Runtime's idle intra-op threads sleep instead of spinning, so that processes sharing
    the cores (several instances of a served model) do not burn each other's time."""
    if fmt in ONNX_FORMATS:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = max(1, threads)
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if not spin:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        providers = list(
            ort_providers
            or (
                [("CUDAExecutionProvider", ort_cuda_options(device, tf32)), "CPUExecutionProvider"]
                if device.startswith("cuda")
                else ["CPUExecutionProvider"]
            )
        )
        sess = ort.InferenceSession(path, so, providers=providers)
        out_names = [o.name for o in sess.get_outputs()]
        feed_names = list(inputs)  # the graph's own names; verification checks that they are the manifest's

        def fn(xs: list[np.ndarray]) -> list[np.ndarray]:
            return sess.run(out_names, dict(zip(feed_names, xs)))

        r = Runner(fn, inputs, outputs)
        r.input_names = [i.name for i in sess.get_inputs()]
        r.output_names = out_names
        r.session = sess
        return r

    torch = _torch_setup(threads)
    if device.startswith("cuda"):
        torch.zeros(1, device=device)  # the CUDA context exists before any loader runs (AOTInductor's needs it)
        set_tf32(tf32)  # for the life of this process, which loads this one artifact
    if fmt == "torchscript":
        m = with_torchvision(lambda: torch.jit.load(path, map_location=device)).eval()
        r = Runner(torch_fn(m, device, threads), inputs, outputs)
        r.input_names = [a.name for a in m.forward.schema.arguments[1:]]
        return r
    if fmt == "exported_program":
        ep = with_torchvision(lambda: torch.export.load(path), names_torchvision(path))
        m = ep.module().to(device)
        r = Runner(torch_fn(m, device, threads), inputs, outputs)
        r.input_names = list(ep.graph_signature.user_inputs)
        return r
    if fmt in ("aoti", "aoti_int8", "aoti_bf16"):
        return Runner(torch_fn(with_torchvision(lambda: load_aoti(path)), device, threads), inputs, outputs)
    if fmt == "aoti_buckets":
        runners = with_torchvision(lambda: load_buckets(path, device))
        missing = sorted(set(buckets or ()) - set(runners))
        if missing:
            raise ValueError(
                f"{path} has no bucket of batch {missing[0]}; it has {', '.join(map(str, sorted(runners)))}"
            )
        fns = {b: torch_fn(r, device, threads) for b, r in runners.items() if not buckets or b in buckets}
        return Runner(lambda xs: padded_call(fns, xs), inputs, outputs)
    raise ValueError(f"unknown artifact format {fmt!r}; known: {', '.join(ARTIFACT_FORMATS)}")


def with_torchvision(load: Callable[[], Any], needs: bool = False) -> Any:
    """``load()``, with torchvision's operators (a detector's ``torchvision::nms``, ``roi_align``) registered
    where it needs them: first where ``needs`` says so (an ExportedProgram's loader fails without naming them),
    else once ``load()`` has failed for want of them. Registered by torchvision's extension library alone where
    it loads (``torchvision_library``), else by importing torchvision; only the artifacts that call its operators
    pay for them."""
    missing = None
    if not needs:
        try:
            return load()
        except Exception as e:
            if "torchvision" not in str(e):
                raise
            missing = e
    for register in (torchvision_library, _import_torchvision):
        if register():
            try:
                return load()
            except Exception as e:
                if not needs and "torchvision" not in str(e):
                    raise
                missing = e
    if missing is None:  # torchvision is not installed: the loader's own error
        return load()
    raise missing


def names_torchvision(path: str) -> bool:
    """Whether the graph an ExportedProgram archive holds (its JSON members) calls torchvision's operators."""
    with zipfile.ZipFile(path) as z:
        return any(b"torch.ops.torchvision." in z.read(n) for n in z.namelist() if n.endswith(".json"))


def torchvision_library() -> bool:
    """Registers torchvision's C++ operators by loading its extension library (``_C.so``, ``_C_stable.so``)
    without importing the package: importing torchvision imports torch._dynamo through torchvision.ops, seconds
    of CPU and more memory in every process that loads a detector. False where no library is found or
    it does not load."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.origin:
        return False
    for lib in sorted(Path(spec.origin).parent.glob("_C*.so")):
        try:
            torch.ops.load_library(str(lib))
            return True
        except OSError:
            continue
    return False


def _import_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401  (registers its operators)
    except ImportError:
        return False
    return True


def threads_in_use(runner: Runner) -> dict[str, Any]:
    """What ``runner`` runs with, as its runtime reports it: intra- and inter-op threads (for torch formats, the
    calling thread's setting, which is the one a call from this thread uses), whether ONNX Runtime's idle
    threads spin, and how many threads this process has."""
    sess = getattr(runner, "session", None)
    if sess is not None:
        so = sess.get_session_options()
        try:
            spin = so.get_session_config_entry("session.intra_op.allow_spinning")
        except RuntimeError:  # not set: ONNX Runtime's default, spinning
            spin = "1"
        out = {
            "runtime": "onnxruntime",
            "intra_op": so.intra_op_num_threads,
            "inter_op": so.inter_op_num_threads,
            "spinning": spin != "0",
        }
    else:
        import torch

        out = {"runtime": "torch", "intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads()}
    try:
        out["process_threads"] = len(os.listdir("/proc/self/task"))
    except OSError:
        pass
    return out


def ort_cuda_options(device: str, tf32: bool = False) -> dict[str, Any]:
    """ONNX Runtime's CUDA provider options for ``device``: IEEE float32 unless ``tf32`` (its default allows TF32)."""
    return {"device_id": int(device.split(":")[1]) if ":" in device else 0, "use_tf32": "1" if tf32 else "0"}


def load_aoti(path: str):
    """An AOTInductor package's model, as a function of its input tensors returning its output tensors. torch's
    public loader (aoti_load_package) wraps the C++ loader used here, but reaching it imports all of inductor
    and dynamo, seconds of CPU in every process that loads a package (each served instance's); the C++ loader
    needs only torch. A torch without that loader's signature gets the public one."""
    import torch

    try:
        run = _cpp_loader(path, "model").boxed_run
    except (AttributeError, TypeError):
        return torch._inductor.aoti_load_package(path)
    return lambda *xs: run(list(xs))


def _cpp_loader(path: str, name: str, device_index: int = -1):
    """torch's C++ loader of the model ``name`` in the .pt2 archive at ``path`` (one runner, not single-threaded),
    the one call of its private signature here: a torch where it differs raises AttributeError or TypeError."""
    import torch

    return torch._C._aoti.AOTIModelPackageLoader(path, name, False, 1, device_index)


def load_buckets(path: str, device: str = "cpu") -> dict:
    """batch size -> the loaded static-batch model of an aoti_buckets archive (a function of its input tensors
    returning its output tensors), all sharing one copy of the weights where the archive stores them apart from
    the code. torch's public loader (aoti_load_package) loads one model and not weights stored apart; the loader
    underneath it (load_pt2) imports torch's export serializer and dynamo with it, more CPU and memory than the load
    itself in each process that loads an archive (each served instance). So this reads the archive itself and hands
    each model to the C++ loader (as load_aoti does); a torch without that loader's signature gets load_pt2. The
    export tests run it on every aoti_buckets export, with weights shared and prepacked."""
    index = int(device.split(":")[1]) if device.startswith("cuda:") else -1
    try:
        runners = {}
        for name, constants in _bucket_parts(path).items():
            model = _cpp_loader(path, name, index)
            if constants:  # user_managed: the loader keeps pointers to these tensors, which the closure keeps alive
                model.load_constants(constants, False, True, True)
            runners[name] = lambda *xs, run=model.boxed_run, keep=constants: run(list(xs))
    except (AttributeError, TypeError):
        from torch.export.pt2_archive._package import load_pt2

        runners = load_pt2(path, load_weights_from_disk=True, device_index=index).aoti_runners
    return {
        int(n[len(BUCKET_PREFIX) :]): r
        for n, r in runners.items()
        if n.startswith(BUCKET_PREFIX) and n[len(BUCKET_PREFIX) :].isdigit()
    }


def _bucket_parts(path: str) -> dict:
    """The models of a .pt2 archive (a zip under one top folder), each with the constants it reads from the
    archive's shared weights ({} where its library holds them): name -> {constant: tensor}, the tensors views
    of one loaded copy, as load_pt2 builds them."""
    import torch

    with zipfile.ZipFile(path) as z:
        files = z.namelist()
        top = files[0].split("/")[0] + "/"
        aoti, weights_dir = top + "data/aotinductor/", top + "data/weights/"
        models = {f[len(aoti) :].split("/")[0] for f in files if f.startswith(aoti)}
        configs = {
            f[len(aoti) :].split("/")[0]: json.loads(z.read(f))
            for f in files
            if f.startswith(aoti) and f.endswith("weights_config.json")
        }
        weights = {f[len(weights_dir) :]: torch.load(io.BytesIO(z.read(f))) for f in files if f.startswith(weights_dir)}
    return {
        m: {
            name: weights[file].as_strided(shape, stride, offset)
            for name, (file, shape, stride, offset) in configs.get(m, {}).items()
        }
        for m in sorted(models)
    }


def load_artifact(export_dir: str, artifact: dict, inputs: Sequence[str], outputs: Sequence[str], **kw) -> Runner:
    """Load one manifest artifact entry (its file) from ``export_dir``, compiled with TF32 where it records so;
    ``kw`` as load takes them (device, threads)."""
    path = os.path.join(export_dir, artifact["file"])
    return load(artifact["format"], path, inputs, outputs, tf32=bool(artifact.get("tf32")), **kw)


PROVENANCE = "provenance.json"  # in each version folder of a repository: where it came from, each file's sha256


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def version_file_problems(version_dir: str | os.PathLike, loads: Sequence[str] = ()) -> list[str] | None:
    """Each file of a repository version folder that is missing or differs from the sha256 its provenance.json
    records, and each of ``loads`` (the files about to be loaded) that it does not list; None when the folder
    records no hashes (a repository written by hand, or before they were recorded)."""
    try:
        with open(os.path.join(version_dir, PROVENANCE)) as f:
            files = json.load(f).get("files")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return [f"{PROVENANCE} cannot be read ({type(e).__name__})"]
    if not isinstance(files, dict):
        return None
    problems = [f"{name} is not listed in {PROVENANCE}" for name in loads if name not in files]
    for name, sha in files.items():
        path = os.path.join(version_dir, name)
        if not os.path.isfile(path):
            problems.append(f"{name} is missing")
        elif sha256_file(path) != sha:
            problems.append(f"{name} differs from the sha256 in {PROVENANCE} (altered or truncated)")
    return problems
