"""The embedded Triton server from the nvidia-pytriton wheel: no Docker, no GPU needed."""

from .server import TritonServer, describe

__all__ = ["TritonServer", "describe"]
