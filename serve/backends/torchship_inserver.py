"""The in-server host: libtriton_<backend>.so (inserver.c) embeds Python in the Triton server process and
calls Instance here, one per model instance, from that instance's thread.

The interpreter starts isolated; torchship serve passes the serving environment's sys.path in
TORCHSHIP_SYS_PATH, so the same numpy, onnxruntime and torch as torchship's own process are imported.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [HERE] + [p for p in os.environ.get("TORCHSHIP_SYS_PATH", "").split(os.pathsep) if p]

import time  # noqa: E402

import numpy as np  # noqa: E402

from torchship_backend import MODELS, TRITON_DTYPES  # noqa: E402

NUMPY = {k[len("TYPE_"):]: v for k, v in TRITON_DTYPES.items()}  # request datatypes ("FP32") to numpy
TRITON = {np.dtype(v): k for k, v in NUMPY.items()}  # and back, for the outputs


def log(msg):
    print(f"torchship in-server backend: {msg}", file=sys.stderr, flush=True)


class Instance:
    """One model instance. execute() takes, per request, a tuple of (name, datatype, shape, buffer, finite)
    for its inputs (None if the library could not read them; finite: the library found no NaN or Inf in
    the buffer) and returns, per request, an error message or
    a list of (name, datatype, shape, array) outputs, then the compute start and end on the monotonic
    clock Triton's statistics use, and the total batch size that ran."""

    def __init__(self, backend, config_json, model_dir, version, model_name, instance_name, kind, device_id):
        if backend not in MODELS:
            raise ValueError(f"no torchship backend named {backend!r}; known: {', '.join(MODELS)}")
        self.model = MODELS[backend]()
        self.model.log = log
        self.model.initialize({"model_config": config_json, "model_name": model_name, "model_repository": model_dir,
                               "model_version": str(version), "model_instance_name": instance_name,
                               "model_instance_kind": kind, "model_instance_device_id": str(device_id)})
        self.input = self.model.inputs[0]
        self.outputs = list(zip(self.model.outputs, [TRITON[np.dtype(dt)] for dt in self.model.out_dtypes]))

    def execute(self, batch):
        t0 = time.perf_counter_ns()  # CLOCK_MONOTONIC on Linux, as in inserver.c
        arrays, finite = [], []
        for inputs in batch:
            x, ok = None, True
            for name, dtype, shape, data, data_finite in inputs or ():
                if name == self.input and dtype in NUMPY:
                    x, ok = np.frombuffer(data, NUMPY[dtype]).reshape(shape), data_finite
            arrays.append(x)
            finite.append(ok)
        results, t1, t2 = self.model.run(arrays, finite)
        outs, rows = [], 0
        for res in results:
            if isinstance(res, str):
                outs.append(res)
            else:
                outs.append([(name, tt, a.shape, a) for (name, tt), a in zip(self.outputs, res)])
                rows += res[0].shape[0] if res else 0
        self.model.record(results, t0, t1, t2)
        return outs, t1, t2, rows

    def finalize(self):
        self.model.finalize()

