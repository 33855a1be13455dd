"""The benchmark: in-process latency per format, served latency and throughput over gRPC, a recommendation."""
