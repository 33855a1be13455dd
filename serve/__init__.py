"""Serve stage: a Triton model repository, the embedded Triton server, a typed gRPC client and the benchmark."""
