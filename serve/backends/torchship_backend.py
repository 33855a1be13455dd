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

TRITON_DTYPES = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
}


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
        self.in_float = {i["name"]: i["data_type"] in ("TYPE_FP16", "TYPE_FP32", "TYPE_FP64") for i in cfg["input"]}
        self.dim_ranges = json.loads(_params(cfg).get("dim_ranges") or "{}")
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
        filename = cfg.get("default_model_filename") or self.default_filename
        path = os.path.join(version_dir, filename)
        self.check_files(version_dir, filename)
        fmt = self.runner_format(path, params)
        buckets = [int(b) for b in params["buckets"].split(",")] if fmt == "aoti_buckets" else None
        tf32 = params.get("tf32", "false").lower() == "true"  # an AOTInductor package compiled with TF32 allowed
        instances = sum(int(g.get("count", 1)) for g in cfg.get("instance_group", []) if g.get("kind") != "KIND_GPU")
        self.instance = args.get("model_instance_name", self.name)
        self.runner = rt.load(
            fmt,
            path,
            self.inputs,
            self.outputs,
            device=device,
            threads=threads,
            buckets=buckets,
            ort_providers=self.ort_providers(cfg, device),
            tf32=tf32,
            spin=instances <= 1,
        )
        self.reported = False
        self.log(f"{self.name}: {fmt} from {path} on {device}, {threads} intra-op thread(s)")

    def check_files(self, version_dir, filename):
        """Refuse to load a version whose files differ from the sha256 torchship repo recorded for them: the
        load fails, the model stays not ready, and the error names each file."""
        problems = rt.version_file_problems(version_dir, [filename])
        if problems is None:
            self.log(f"{self.name}: {version_dir} records no file hashes ({rt.PROVENANCE}); its files are not checked")
        elif problems:
            raise ValueError(
                f"{self.name}: refusing to load version {os.path.basename(version_dir)}: "
                + "; ".join(problems)
                + "; build the repository again with torchship repo"
            )

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

    def refusal(self, feeds):
        """Why a request's inputs cannot run (a missing input, a dynamic dim out of its range, NaN or Inf in
        a float input), or None."""
        for name in self.inputs:
            x = feeds.get(name)
            if x is None:
                return f"missing input '{name}'"
            for i, r in enumerate(self.dim_ranges.get(name) or ()):
                if r and not r[1] <= x.shape[i + 1] <= r[2]:
                    return (
                        f"input '{name}' has {r[0]}={x.shape[i + 1]} (dim {i + 1} of shape {list(x.shape)}), "
                        f"outside the model's range {r[1]}..{r[2]}"
                    )
            if self.reject_non_finite and self.in_float[name] and not np.isfinite(x).all():
                return f"input '{name}' contains NaN or Inf values; send finite values"
        return None

    def run(self, requests):
        """One execution: ``requests`` holds each request's inputs by name (None where it lacks one). Returns,
        per request, either the list of its output arrays or an error message. Requests whose inputs have
        the same non-batch shapes run as one batch."""
        results = [None] * len(requests)
        groups = {}
        for i, feeds in enumerate(requests):
            why = self.refusal(feeds)
            if why:
                results[i] = self.error(why)
            else:
                groups.setdefault(tuple(feeds[n].shape[1:] for n in self.inputs), []).append(i)
        for owners in groups.values():
            self.run_batch([requests[i] for i in owners], owners, results)
        return results

    def run_batch(self, batch, owners, results):
        xs = {n: batch[0][n] if len(batch) == 1 else np.concatenate([f[n] for f in batch]) for n in self.inputs}
        try:
            outs = self.runner.run(xs)
        except Exception as e:  # the model failed on this batch: fail its requests, keep serving
            for i in owners:
                results[i] = self.error(f"inference failed: {type(e).__name__}: {e}")
            return
        if not self.reported:  # read back in the thread that runs the model, once it has run
            self.reported = True
            use = rt.threads_in_use(self.runner)
            self.log(
                f"instance {self.instance} (pid {os.getpid()}) runs with "
                + ", ".join(f"{k}={str(v).lower()}" for k, v in use.items())
            )
        start = 0
        for feeds, i in zip(batch, owners):
            n = feeds[self.inputs[0]].shape[0]
            results[i] = [
                np.ascontiguousarray(outs[name][start : start + n], dtype=dt)
                for name, dt in zip(self.outputs, self.out_dtypes)
            ]
            start += n

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
            why = (
                f"this onnxruntime ({ort.__version__}) has no CUDAExecutionProvider; install onnxruntime-gpu "
                "in the serving environment"
            )
        return why

    def ort_providers(self, cfg, device):
        if not device.startswith("cuda"):
            return ["CPUExecutionProvider"]
        providers = []
        accs = cfg.get("optimization", {}).get("execution_accelerators", {}).get("gpu_execution_accelerator", [])
        for acc in accs:
            if acc.get("name") == "tensorrt":
                p = acc.get("parameters", {})
                providers.append(
                    (
                        "TensorrtExecutionProvider",
                        {
                            "device_id": int(device.split(":")[1]),
                            "trt_fp16_enable": p.get("precision_mode", "FP32") == "FP16",
                            "trt_engine_cache_enable": p.get("trt_engine_cache_enable", "0") == "1",
                            "trt_engine_cache_path": p.get("trt_engine_cache_path", "/tmp/trt_cache"),
                        },
                    )
                )
        providers.append(("CUDAExecutionProvider", rt.ort_cuda_options(device)))
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
        self.out_dims = [[max(1, int(d)) for d in o["dims"]] for o in cfg["output"]]  # a dynamic dim (-1) as 1

    def run(self, requests):
        return [
            [
                np.zeros((0 if f[self.inputs[0]] is None else f[self.inputs[0]].shape[0], *dims), dt)
                for dims, dt in zip(self.out_dims, self.out_dtypes)
            ]
            for f in requests
        ]


MODELS = {"onnxruntime": OnnxRuntimeModel, "pytorch": PyTorchModel, "torchship": NoopModel}
