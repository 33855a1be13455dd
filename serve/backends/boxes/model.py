"""A detector's image entry, last step: a Triton python-backend model that torchship repo copies into the
repository (with torchship_boxes.py and torchship_tensors.py beside it). It takes the detector's fixed-shape
answer to a letterboxed picture (boxes in the square's pixels, scores, labels, count) and the picture's size,
and answers with the boxes in the picture's own pixels (torchship.boxes.Letterbox), clipped to it; the padding
rows stay zeros."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from torchship_boxes import Letterbox
from torchship_tensors import to_numpy, to_triton

PASSED = ("scores", "labels", "count")


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.size = int(cfg["parameters"]["letterbox_size"]["string_value"])

    def execute(self, requests):
        responses = []
        for r in requests:
            get = {t: to_numpy(pb_utils.get_input_tensor_by_name(r, t)) for t in ("boxes", "picture_size", *PASSED)}
            boxes = np.array(get["boxes"], dtype=np.float32)  # [n, K, 4]
            for i, (w, h) in enumerate(np.asarray(get["picture_size"]).reshape(-1, 2)):
                n = int(np.asarray(get["count"]).reshape(-1)[i])
                boxes[i, :n] = Letterbox(int(w), int(h), self.size).to_picture(boxes[i, :n])
            outputs = [to_triton("boxes", np.ascontiguousarray(boxes))]
            outputs += [to_triton(t, np.array(get[t])) for t in PASSED]  # a copy: the inputs are read-only
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses

    def finalize(self):
        pass
