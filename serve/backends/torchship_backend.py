"""Python-based stand-ins for Triton's native onnxruntime and pytorch backends: the part that does not
depend on how Triton hosts them.

Two hosts run this code. In the server process (the default): libtriton_<backend>.so, built from
inserver.c, embeds Python and calls torchship_inserver.py. In Triton's python-backend stub processes:
Triton loads <backend-dir>/<backend>/model.py for every model whose platform maps to that backend when
no native library is there. config.pbtxt is the single source of truth: tensor names, dtypes,
batching, threads and the instance kind all come from it. A bad request gets its own error
response; the instance keeps serving the others.
"""

import json
import os
import threading
import time

import numpy as np

import torchship_runtime as rt


PROFILE_ENV = "TORCHSHIP_BACKEND_PROFILE"
TRITON_DTYPES = {"TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
                 "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
                 "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64}


class Profile:
    """Time spent inside execute(), split into before the model (inputs, checks, batching), the model
    itself, and after it (output tensors, responses). Cumulative nanoseconds, written as JSON to
    ``path`` by a background thread every 0.2 s while they change, and at finalize, so a reader can take deltas."""

    KEYS = ("executions", "requests", "pre_ns", "run_ns", "post_ns")

    def __init__(self, path):
        self.path = path
        self.totals = [0] * len(self.KEYS)  # a list: add() runs in every timed request, on cold caches
        self._written = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def add(self, requests, t0, t1, t2, t3):
        t = self.totals
        t[0] += 1
        t[1] += requests
        t[2] += t1 - t0
        t[3] += t2 - t1
        t[4] += t3 - t2

    def write(self):
        snap = dict(zip(self.KEYS, self.totals))
        if snap == self._written:
            return
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(snap, f)
        os.replace(tmp, self.path)
        self._written = snap

    def _loop(self):
        while not self._stop.wait(0.2):
            self.write()

    def close(self):
        self._stop.set()
        self.write()


def _params(cfg):
    return {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}


class BackendModel:
    """Loads the model an instance serves and runs batches of requests; subclasses say which artifact
    format they load. ``log`` is the host's logger (a callable taking one string)."""

    default_filename = "model.onnx"
    log = staticmethod(print)

    def runner_format(self, path, params):
        raise NotImplementedError

    def read_config(self, args):
        """Name and tensors from the instance's config.pbtxt (as JSON); returns the parsed config."""
        cfg = json.loads(args["model_config"])
        self.name = args["model_name"]
        self.inputs = [i["name"] for i in cfg["input"]]
        self.outputs = [o["name"] for o in cfg["output"]]
        self.out_dtypes = [np.dtype(TRITON_DTYPES[o["data_type"]]) for o in cfg["output"]]
        self.profile = None
        return cfg

    def initialize(self, args):
        cfg = self.read_config(args)
        params = _params(cfg)
        self.reject_non_finite = params.get("reject_non_finite", "true").lower() != "false"
        threads = int(params.get("intra_op_thread_count") or params.get("INTRA_OP_THREAD_COUNT") or 1)
        device, why_cpu = self.device_for(args)
        if why_cpu:
            self.log(f"{self.name}: a GPU instance, run on the CPU: {why_cpu}")
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        path = os.path.join(version_dir, cfg.get("default_model_filename") or self.default_filename)
        fmt = self.runner_format(path, params)
        buckets = None
        if fmt == "aoti_buckets":
            buckets = {}
            for item in params["buckets"].split(","):
                size, fname = item.split(":")
                buckets[int(size)] = os.path.join(version_dir, fname)
        self.runner = rt.load(fmt, path, self.inputs, self.outputs, device=device, threads=threads, buckets=buckets,
                              ort_providers=self.ort_providers(cfg, device))
        if os.environ.get(PROFILE_ENV):
            os.makedirs(os.environ[PROFILE_ENV], exist_ok=True)
            # one file per instance object: a reloaded model's old instance may write its final totals after
            # the new one started, so readers sum <model>--*.json and take deltas
            self.profile = Profile(os.path.join(os.environ[PROFILE_ENV], f"{self.name}--{os.getpid()}-{id(self):x}.json"))
        self.log(f"{self.name}: {fmt} from {path} on {device}, {threads} intra-op thread(s)")

    def device_for(self, args):
        """(device, why): where this instance runs, and for a GPU instance that runs on the CPU, why."""
        if args.get("model_instance_kind") != "GPU":
            return "cpu", ""
        why = self.cuda_missing()
        return ("cpu", why) if why else (f"cuda:{args.get('model_instance_device_id', 0)}", "")

    def cuda_missing(self):
        """Why this backend cannot run on CUDA here ("" if it can)."""
        try:
            import torch
        except ImportError:
            return "torch is not installed, so no CUDA device can be found"
        return "" if torch.cuda.is_available() else "torch sees no CUDA device"

    def ort_providers(self, cfg, device):
        return None

    def run(self, arrays, finite=None):
        """One execution: ``arrays`` holds each request's input (None where the host could not read it);
        ``finite``, where the host has checked them, says per request whether its input holds no NaN or Inf
        (else they are checked here). Returns, per request, either the list of its output arrays or an
        error message, and the compute start and end (perf_counter_ns; 0 if nothing ran)."""
        results = [None] * len(arrays)
        batch, owners = [], []
        for i, x in enumerate(arrays):
            if x is None:
                results[i] = self.error(f"missing input '{self.inputs[0]}'")
            elif self.reject_non_finite and not (finite[i] if finite is not None else np.isfinite(x).all()):
                results[i] = self.error(f"input '{self.inputs[0]}' contains NaN or Inf values; "
                                        "send finite pixel values in [0, 1]")
            else:
                batch.append(x)
                owners.append(i)
        if not batch:
            return results, 0, 0
        x = batch[0] if len(batch) == 1 else np.concatenate(batch)
        t1 = time.perf_counter_ns()
        try:
            outs = self.runner.run({self.inputs[0]: x})
        except Exception as e:  # the model failed on this batch: fail its requests, keep serving
            for i in owners:
                results[i] = self.error(f"inference failed: {type(e).__name__}: {e}")
            return results, 0, 0
        t2 = time.perf_counter_ns()
        if len(owners) == 1:  # one request: its outputs as they are, where they already have the config's dtype
            results[owners[0]] = [o if o.dtype is dt and o.flags.c_contiguous else np.ascontiguousarray(o, dtype=dt)
                                  for o, dt in zip([outs[name] for name in self.outputs], self.out_dtypes)]
            return results, t1, t2
        start = 0
        for x, i in zip(batch, owners):
            n = x.shape[0]
            results[i] = [np.ascontiguousarray(outs[name][start:start + n], dtype=dt)
                          for name, dt in zip(self.outputs, self.out_dtypes)]
            start += n
        return results, t1, t2

    def record(self, results, t0, t1, t2):
        """Add one execution (``results`` from run(), started by the host at ``t0``) to the profile, if one
        is being written; call once the responses exist."""
        if self.profile is not None and t1:
            # t1 is set only when the model ran, so a single request was served
            served = 1 if len(results) == 1 else sum(not isinstance(r, str) for r in results)
            self.profile.add(served, t0, t1, t2, time.perf_counter_ns())

    def error(self, msg):
        return f"{self.name}: {msg}"

    def finalize(self):
        if self.profile is not None:
            self.profile.close()
        self.runner = None


class OnnxRuntimeModel(BackendModel):
    default_filename = "model.onnx"

    def runner_format(self, path, params):
        return "onnx"

    def cuda_missing(self):
        import onnxruntime as ort

        why = super().cuda_missing()
        if not why and "CUDAExecutionProvider" not in ort.get_available_providers():
            why = (f"this onnxruntime ({ort.__version__}) has no CUDAExecutionProvider; install onnxruntime-gpu "
                   "in the serving environment")
        return why

    def ort_providers(self, cfg, device):
        if not device.startswith("cuda"):
            return ["CPUExecutionProvider"]
        providers = []
        accs = cfg.get("optimization", {}).get("execution_accelerators", {}).get("gpu_execution_accelerator", [])
        for acc in accs:
            if acc.get("name") == "tensorrt":
                p = acc.get("parameters", {})
                providers.append(("TensorrtExecutionProvider", {
                    "device_id": int(device.split(":")[1]),
                    "trt_fp16_enable": p.get("precision_mode", "FP32") == "FP16",
                    "trt_engine_cache_enable": p.get("trt_engine_cache_enable", "0") == "1",
                    "trt_engine_cache_path": p.get("trt_engine_cache_path", "/tmp/trt_cache")}))
        providers.append(("CUDAExecutionProvider", {"device_id": int(device.split(":")[1])}))
        providers.append("CPUExecutionProvider")
        return providers


class PyTorchModel(BackendModel):
    default_filename = "model.pt"

    def runner_format(self, path, params):
        if path.endswith(".pt2"):
            return "aoti_buckets" if params.get("buckets") else "aoti"
        return "torchscript"


class FloorModel(BackendModel):
    """The floor of serving through this host: answers zeros of the output shape without a model.
    With the model parameter ``hold: true`` it first busy-waits as many microseconds as the first
    input value says (the floor for a model that takes that long). Where the second value is a byte
    count, it spends that wait reading through a buffer of that many bytes, as a model streams its
    weights: the floor for a model of that duration and that memory traffic."""

    CHUNK = 1 << 16  # float32 values read at a time (256 KiB): the wait overshoots by at most one chunk

    def initialize(self, args):
        cfg = self.read_config(args)
        self.out_dims = [[int(d) for d in o["dims"]] for o in cfg["output"]]
        self.hold = _params(cfg).get("hold", "false").lower() == "true"
        self._buf = np.zeros(0, np.float32)

    def wait(self, x):
        """Busy-wait x[0] µs, reading through the first x[1] bytes of the buffer meanwhile; returns the bytes read."""
        t_end = time.perf_counter() + float(x[0]) * 1e-6
        size = int(x[1]) // 4 if x.size > 1 else 0
        if size > self._buf.size:  # one buffer, grown to the largest size asked (at warm-up, a zero-length wait)
            self._buf = np.ones(size, np.float32)
        i = read = 0
        while size and time.perf_counter() < t_end:
            chunk = self._buf[i:min(i + self.CHUNK, size)]
            chunk.argmax()  # reads every value: all are equal
            read += chunk.nbytes
            i = (i + self.CHUNK) % size
        while time.perf_counter() < t_end:
            pass
        return read

    def run(self, arrays, finite=None):
        read = self.wait(arrays[0].reshape(-1)) if self.hold and arrays[0] is not None else 0
        results = [[np.zeros((0 if x is None else x.shape[0], *dims), dt) for dims, dt in zip(self.out_dims, self.out_dtypes)]
                   for x in arrays]
        if read and results[0][0].size:  # the hold says how much it read in its first output value
            results[0][0].flat[0] = read
        return results, 0, 0


MODELS = {"onnxruntime": OnnxRuntimeModel, "pytorch": PyTorchModel, "torchship": FloorModel}
