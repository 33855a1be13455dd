"""Triton Python-based 'pytorch' backend: serves every model whose platform maps to 'pytorch'."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torchship_backend import PyTorchModel as TritonPythonModel  # noqa: E402,F401
