"""Serve stage: a Triton model repository, the embedded Triton server, and a typed gRPC client."""

import os as _os

# grpcio's EventEngine client (on by default in grpcio 1.85) reads each reply on a poller thread of its
# own and then wakes the thread waiting for it; with it off, the waiting thread polls the socket itself,
# one thread hop less per request (README, "Served latency at batch 1"). gRPC reads this variable when it
# is first imported, so it is set here, before any serve module imports grpc, and only for this
# process's clients: the server and perf_analyzer get the environment without it. A GRPC_EXPERIMENTS of
# your own (even an empty one) keeps gRPC's choice.
GRPC_CLIENT_EXPERIMENTS = "-event_engine_client"
_GRPC_DEFAULTED = "GRPC_EXPERIMENTS" not in _os.environ
if _GRPC_DEFAULTED:
    _os.environ["GRPC_EXPERIMENTS"] = GRPC_CLIENT_EXPERIMENTS


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the gRPC client setting above, where torchship set it (for other programs)."""
    if _GRPC_DEFAULTED and env.get("GRPC_EXPERIMENTS") == GRPC_CLIENT_EXPERIMENTS:
        env = {k: v for k, v in env.items() if k != "GRPC_EXPERIMENTS"}
    return env
