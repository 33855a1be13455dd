"""The text entry's tokenizer, a Triton python-backend model that torchship repo copies into the repository (with
torchship_textio.py, torchship_tensors.py and the export's tokenizer.json beside it): each request is one text (a
UINT8 vector of its UTF-8 bytes), tokenized exactly as the export's reference was (the spec the manifest records,
in this model's config), cut to the exported sequence range, padded to a length that batches with its neighbours
(torchship_textio.bucket), and handed on as the model's token tensors. A request that is not usable text gets an
error response of its own; the others in the batch go on. It runs in the official container's python backend
too (which needs the tokenizers package: deploy/triton-images.Dockerfile adds it)."""

import json
from pathlib import Path

from torchship_tensors import answer_each
from torchship_textio import decode_text, encode, load_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.name = args["model_name"]
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        self.spec = json.loads(params["text"])
        here = Path(args["model_repository"]) / args["model_version"]
        self.tok = load_tokenizer(str(here / "tokenizer.json"), self.spec)
        self.input = cfg["input"][0]["name"]

    def execute(self, requests):
        return answer_each(
            requests,
            self.name,
            self.input,
            lambda data: encode(self.tok, [decode_text(data)], self.spec, bucketed=True),
        )

    def finalize(self):
        pass
