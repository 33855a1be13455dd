"""A killed backend process is healed under load: the model reports not ready while it is down, requests fail
only in that window, it serves again within 10 s, and the heal is printed and counted."""

import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from torchship.serve.client import TritonClient
from torchship.serve.config import ServeConfig
from torchship.serve.embedded import TritonServer
from torchship.serve.embedded.process import stub_processes
from torchship.serve.model_config import read_config

MODEL = "tiny_cnn_onnx"
# A stub killed while it holds its shared memory's lock takes Triton 2.51's python backend down with it: the next
# execute throws this and the server aborts (SIGABRT), a fault of the backend no healer can reach (open upstream as
# triton-inference-server/server#8882). That outcome is reported as an expected failure.
UPSTREAM_ABORT = "boost::interprocess::lock_exception"


@pytest.mark.slow
def test_a_killed_backend_process_is_healed_under_load(repo, capfd, monkeypatch):
    from torchship.serve.embedded import heal

    listings = []  # the healer's listings of the server's processes, each of which reads all of /proc
    monkeypatch.setattr(heal, "stub_processes", lambda pid: listings.append(1) or stub_processes(pid))
    x = np.random.default_rng(0).random((1, 3, 32, 32), dtype=np.float32)
    log, ready, stop, errors = [], [], threading.Event(), []
    with TritonServer(ServeConfig(repo=str(repo), models=(MODEL,))) as s:

        def flood():
            client = TritonClient(s.url)
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    client.infer(MODEL, x)
                    log.append((t0, True))
                except Exception as e:
                    log.append((t0, False))
                    errors.append((t0, str(e)[:160]))
                    time.sleep(0.01)

        def watch():
            import tritonclient.grpc as grpcclient

            c = grpcclient.InferenceServerClient(s.url)
            while not stop.is_set():
                ready.append((time.monotonic(), c.is_model_ready(MODEL)))
                time.sleep(0.05)

        threads = [threading.Thread(target=flood) for _ in range(8)] + [threading.Thread(target=watch)]
        for t in threads:
            t.start()
        try:  # a failed check ends the load too: threads left sending would outlive the test
            time.sleep(1.0)
            off = read_config(repo / MODEL / "config.pbtxt")
            off.ClearField("dynamic_batching")
            s.load(MODEL, override=off)  # a reload replaces the stub, as bench's sweeps do: not a death
            time.sleep(5.0)  # past the healer's settling time after Triton's reload lines
            assert not s.healer.heals
            # on a busy machine a reload's old stub can leave after the settling time: with a stub still there for
            # each instance, that is not a death (a pid no process has stands for the late leaver)
            s.healer.known[MODEL, "1"] = s.healer.known[MODEL, "1"] | {2**22 + 7}
            time.sleep(1.0)
            assert not s.healer.heals
            before = len(listings)
            time.sleep(2.0)  # nothing changes: four ticks, at most one listing (every heal.RESCAN_S)
            assert len(listings) - before <= 1, len(listings) - before
            settled = time.monotonic()
            (stub,) = stub_processes(s.proc.pid)[MODEL, "1"]
            killed = time.monotonic()
            os.kill(stub, signal.SIGKILL)  # a stub of the server this test started
            deadline = killed + 15
            while time.monotonic() < deadline and not (
                s.healer.heals
                and any(ok for t, ok in log if t > killed + 0.2 and t > killed + s.healer.heals[0]["seconds"])
            ):
                time.sleep(0.1)
            time.sleep(1.0)
        finally:
            stop.set()
            for t in threads:
                t.join()
        if s.proc.poll() is not None and UPSTREAM_ABORT in s.log_path.read_text(errors="replace"):
            pytest.xfail(f"Triton aborted on {UPSTREAM_ABORT} after the kill (server log: {s.log_path})")
        status = json.loads(s.healer.heals_file.read_text())
    log = [(t, ok) for t, ok in log if t > settled]  # from the kill's side of the reload on
    ready = [(t, r) for t, r in ready if t > settled]
    failed = [t for t, ok in log if not ok]
    last_failure = max(failed, default=killed)
    after = [t for t, ok in log if ok and t > last_failure]
    recovered = min(after) - killed if after else float("inf")
    down = [t for t, r in ready if not r]
    with capfd.disabled():
        print(
            f"\nheal under load: {len(log)} requests, {len(failed)} failed, served again {recovered:.1f} s after the "
            f"kill (the heal took {status['events'][0]['seconds']:.1f} s), not ready for about {len(down) * 0.05:.1f} s"
        )
    assert recovered < 10, (errors[:2], errors[-2:], killed, settled)
    assert status["heals"] == 1 and status["events"][0]["model"] == MODEL
    # failures only in the window: requests in flight at the kill (sent up to a second before: the stub's health
    # check waits 1 s) until the model serves again. There may be none: requests in flight at the kill can wait out
    # that second and be answered after a quick heal
    assert all(killed - 1.0 <= t <= killed + recovered for t in failed)
    assert down and all(killed <= t <= killed + recovered + 0.5 for t in down)  # not ready while down, only then
    assert all(ok for t, ok in log if t > killed + recovered + 0.5)
    err = capfd.readouterr().err
    assert f"heal: {MODEL}'s backend process " in err and f"healed {MODEL} in " in err
