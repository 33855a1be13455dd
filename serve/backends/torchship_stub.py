"""The python-backend host: Triton's stub process calls these TritonPythonModel classes (through each
backend's model.py) and hands requests over through shared memory; tensors cross as torchship_tensors says."""

import os
import sys

import triton_python_backend_utils as pb_utils
from torchship_backend import MODELS
from torchship_tensors import to_numpy, to_triton


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

    def finalize(self):
        """The instance is unloaded: Triton has had the stub's answer by now and only waits for this process to
        end. It ends here, without the interpreter's teardown of what the model loaded (with torch, about 0.5 s
        of CPU an instance, paid at every unload, reload and stop, beside the instances still serving)."""
        super().finalize()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def stub_model(backend):
    """The TritonPythonModel class for one backend name."""
    return type(f"{MODELS[backend].__name__}Stub", (StubHost, MODELS[backend]), {})
