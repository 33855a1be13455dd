"""Tensors between Triton's python backend and numpy, through DLPack with numpy's own support (numpy >= 1.22):
zero-copy both ways, right under numpy 2, where the stub's numpy path (built with pybind11 2.10 in the wheel's
python_backend) hands back empty arrays, and without importing torch in a process that serves ONNX."""

import ctypes

import numpy as np
import triton_python_backend_utils as pb_utils


class _Capsule:
    """A Triton tensor's DLPack capsule, as the protocol object np.from_dlpack takes (the tensor lives in CPU
    memory: a Python-based backend's inputs are on the host)."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, **_):
        return self.t.to_dlpack()

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU, device 0


def to_numpy(t):
    """A Triton tensor as a numpy array over the same memory."""
    return np.from_dlpack(_Capsule(t))


# python_backend marks a capsule it has taken "used_dlpack", where the DLPack protocol says "used_dltensor": numpy's
# capsule destructor knows only the latter, and would take the capsule as never consumed
_set_capsule_name = ctypes.pythonapi.PyCapsule_SetName
_set_capsule_name.argtypes = (ctypes.py_object, ctypes.c_char_p)
_USED = b"used_dltensor"  # a module constant: the capsule keeps a pointer to it


def to_triton(name, a):
    """A contiguous numpy array as a Triton output tensor over the same memory."""
    capsule = a.__dlpack__()
    t = pb_utils.Tensor.from_dlpack(name, capsule)
    _set_capsule_name(capsule, _USED)
    return t


def answer_each(requests, model_name, input_name, prepare):
    """A raw entry's preprocessing, one request at a time: ``prepare`` takes a request's bytes (its UINT8 vector)
    and returns its output arrays by name; whatever it raises becomes that request's error response, naming the
    model (a ValueError says why in words; anything else, from a decoder, is named by its type), and the others
    in the batch go on."""
    responses = []
    for r in requests:
        t = pb_utils.get_input_tensor_by_name(r, input_name)
        try:
            if t is None:
                raise ValueError(f"missing input '{input_name}'")
            outputs = prepare(np.ascontiguousarray(to_numpy(t)).reshape(-1).tobytes())
        except Exception as e:  # one request's bad input never fails the batch it came in
            why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"{model_name}: {why}"))
            )
            continue
        responses.append(
            pb_utils.InferenceResponse(
                output_tensors=[to_triton(k, np.ascontiguousarray(v)) for k, v in outputs.items()]
            )
        )
    return responses
