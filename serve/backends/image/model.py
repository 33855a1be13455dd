"""The image entry's preprocessing, a Triton python-backend model that torchship repo copies into the
repository (with torchship_imageio.py and torchship_tensors.py beside it): each request is one encoded image
file (a UINT8 vector of its bytes), decoded and prepared exactly as training prepared its images (the
preprocessing the export's manifest records, in this model's config), and handed on as the model's float32
input; a detector's picture is letterboxed, and its width and height handed on beside it (picture_size). A
request that is not a usable image gets an error response of its own; the others in the batch go on.
It runs in the official container's python backend too (which needs Pillow: deploy/Dockerfile adds it)."""

import json

import numpy as np
from torchship_imageio import decode_image, decode_picture
from torchship_tensors import answer_each


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.name = args["model_name"]
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        self.pre = json.loads(params["preprocessing"])
        # the limits torchship repo writes into this config (torchship_imageio's defaults where a config has none)
        self.limits = {k: int(params[k]) for k in ("max_pixels", "max_bytes") if params.get(k)}
        self.input = cfg["input"][0]["name"]
        self.output = cfg["output"][0]["name"]

    def prepare(self, data):
        if "letterbox" not in self.pre:
            return {self.output: decode_image(data, self.pre, **self.limits)[None]}
        # a detector's: letterboxed as training did, with the picture's size, which maps its boxes back
        chw, (w, h) = decode_picture(data, int(self.pre["letterbox"]["size"]), **self.limits)
        return {self.output: chw[None], "picture_size": np.array([[w, h]], dtype=np.int64)}

    def execute(self, requests):
        return answer_each(requests, self.name, self.input, self.prepare)

    def finalize(self):
        pass
