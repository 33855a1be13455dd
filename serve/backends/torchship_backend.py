"""Python-based stand-ins for Triton's native onnxruntime and pytorch backends, the part that does not
touch Triton's API (torchship_stub.py does).

Triton loads <backend-dir>/<backend>/model.py for every model whose platform maps to that backend when
no native library is there, and runs it in its python-backend stub processes. config.pbtxt is the
single source of truth: tensor names, dtypes, batching, threads and the instance kind all come from it.
A bad request gets its own error response; the instance keeps serving the others.
"""

import json
import os

import numpy as np

import torchship_runtime as rt


TRITON_DTYPES = {"TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
                 "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
                 "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64}


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

    def run(self, arrays):
        """One execution: ``arrays`` holds each request's input (None where the request has none). Returns,
        per request, either the list of its output arrays or an error message."""
        results = [None] * len(arrays)
        batch, owners = [], []
        for i, x in enumerate(arrays):
            if x is None:
                results[i] = self.error(f"missing input '{self.inputs[0]}'")
            elif self.reject_non_finite and not np.isfinite(x).all():
                results[i] = self.error(f"input '{self.inputs[0]}' contains NaN or Inf values; "
                                        "send finite pixel values in [0, 1]")
            else:
                batch.append(x)
                owners.append(i)
        if not batch:
            return results
        x = batch[0] if len(batch) == 1 else np.concatenate(batch)
        try:
            outs = self.runner.run({self.inputs[0]: x})
        except Exception as e:  # the model failed on this batch: fail its requests, keep serving
            for i in owners:
                results[i] = self.error(f"inference failed: {type(e).__name__}: {e}")
            return results
        start = 0
        for x, i in zip(batch, owners):
            n = x.shape[0]
            results[i] = [np.ascontiguousarray(outs[name][start:start + n], dtype=dt)
                          for name, dt in zip(self.outputs, self.out_dtypes)]
            start += n
        return results

    def error(self, msg):
        return f"{self.name}: {msg}"

    def finalize(self):
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


class NoopModel(BackendModel):
    """Answers zeros of the output shape without running a model: the round trip of the protocol and
    the backend alone, which the benchmark reports beside the models."""

    def initialize(self, args):
        cfg = self.read_config(args)
        self.out_dims = [[int(d) for d in o["dims"]] for o in cfg["output"]]

    def run(self, arrays):
        return [[np.zeros((0 if x is None else x.shape[0], *dims), dt) for dims, dt in zip(self.out_dims, self.out_dtypes)]
                for x in arrays]


MODELS = {"onnxruntime": OnnxRuntimeModel, "pytorch": PyTorchModel, "torchship": NoopModel}
