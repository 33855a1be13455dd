"""Triton Python-based 'onnxruntime' backend: serves every model whose platform maps to 'onnxruntime', in
Triton's stub processes."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torchship_stub import stub_model  # noqa: E402

TritonPythonModel = stub_model("onnxruntime")
