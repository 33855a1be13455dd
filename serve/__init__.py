"""Serve stage: a Triton model repository, the embedded Triton server, and a typed gRPC client."""
