"""The python-backend host: Triton's stub process calls these TritonPythonModel classes (through each
backend's model.py) and hands requests over through shared memory.

Tensors cross between Triton and numpy through DLPack (by way of torch, which the serving environment has):
zero-copy both ways, and right under numpy 2, where the stub's own numpy path (built with pybind11 2.10 in the
wheel's python_backend) hands back empty arrays."""

import torch
import triton_python_backend_utils as pb_utils
from torch.utils import dlpack

from torchship_backend import MODELS


def to_numpy(t):
    """A Triton tensor as a numpy array over the same memory."""
    return dlpack.from_dlpack(t.to_dlpack()).numpy()


def to_triton(name, a):
    """A contiguous numpy array as a Triton output tensor over the same memory."""
    return pb_utils.Tensor.from_dlpack(name, dlpack.to_dlpack(torch.from_numpy(a)))


class StubHost:
    """execute() for Triton's python backend around a BackendModel's run()."""

    def initialize(self, args):
        self.log = pb_utils.Logger.log_info
        super().initialize(args)

    def execute(self, requests):
        arrays = []
        for r in requests:
            feeds = {}
            for name in self.inputs:
                t = pb_utils.get_input_tensor_by_name(r, name)
                feeds[name] = None if t is None else to_numpy(t)
            arrays.append(feeds)
        responses = []
        for res in self.run(arrays):
            if isinstance(res, str):
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(res)))
            else:
                tensors = [to_triton(name, a) for name, a in zip(self.outputs, res)]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses


def stub_model(backend):
    """The TritonPythonModel class for one backend name."""
    return type(f"{MODELS[backend].__name__}Stub", (StubHost, MODELS[backend]), {})
