"""Triton Python-based 'onnxruntime' backend: serves every model whose platform maps to 'onnxruntime'."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torchship_backend import OnnxRuntimeModel as TritonPythonModel  # noqa: E402,F401
