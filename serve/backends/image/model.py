"""The image entry's preprocessing, a Triton python-backend model that torchship repo copies into the
repository (with torchship_imageio.py and torchship_tensors.py beside it): each request is one encoded image
file (a UINT8 vector of its bytes), decoded and prepared exactly as training prepared its images (the
preprocessing the export's manifest records, in this model's config), and handed on as the model's float32
input. A request that is not a usable image gets an error response of its own; the others in the batch go on.
It runs in the official container's python backend too (which needs Pillow: deploy/Dockerfile adds it)."""

import json

import triton_python_backend_utils as pb_utils
from torchship_imageio import decode_image
from torchship_tensors import to_numpy, to_triton


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.name = args["model_name"]
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        self.pre = json.loads(params["preprocessing"])
        self.max_pixels = int(params.get("max_pixels") or 0) or None
        self.input = cfg["input"][0]["name"]
        self.output = cfg["output"][0]["name"]

    def execute(self, requests):
        responses = []
        for r in requests:
            t = pb_utils.get_input_tensor_by_name(r, self.input)
            try:
                if t is None:
                    raise ValueError(f"missing input '{self.input}'")
                data = to_numpy(t).reshape(-1).tobytes()  # the file's bytes (a batch of one, ragged)
                kwargs = {"max_pixels": self.max_pixels} if self.max_pixels else {}
                chw = decode_image(data, self.pre, **kwargs)
            except ValueError as e:
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(f"{self.name}: {e}")))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[to_triton(self.output, chw[None])]))
        return responses

    def finalize(self):
        pass
