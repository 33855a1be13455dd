"""The embedded server's life: start, ports, model control, streams drained on SIGTERM, failures named,
and nothing left behind."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from concurrent import futures
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_cli
from tests.helpers import assert_onnx_served, in_process, refused_then_served, rehash_version
from torchship.errors import ClientError, ServerError
from torchship.serve.client import TritonClient
from torchship.serve.config import ServeConfig
from torchship.serve.embedded import TritonServer


def test_explicit_model_control_unload_and_load(server, exported):
    client = TritonClient(server.url)
    client.unload("tiny_cnn_torchscript")
    deadline = time.time() + 30
    while client.ready("tiny_cnn_torchscript") and time.time() < deadline:
        time.sleep(0.1)
    with pytest.raises(ClientError):
        client.infer("tiny_cnn_torchscript", np.zeros((1, 3, 32, 32), np.float32))
    # the instance's stub ended in its finalize (without tearing torch down): an error raised there would be
    # logged by the stub, with the frame it came from, before Triton says the model is unloaded
    while "successfully unloaded 'tiny_cnn_torchscript'" not in server.log_path.read_text() and time.time() < deadline:
        time.sleep(0.1)
    log = server.log_path.read_text()
    assert "successfully unloaded 'tiny_cnn_torchscript'" in log and "): finalize" not in log, server.log_tail()
    server.load("tiny_cnn_torchscript")
    x = np.random.default_rng(1).random((3, 3, 32, 32), dtype=np.float32)
    np.testing.assert_allclose(
        client.infer("tiny_cnn_torchscript", x),
        in_process(exported, "torchscript").run({"images": x})["logits"],
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.slow
def test_sigterm_during_a_stream_loses_no_completed_response(repo, exported):
    server = TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",)))
    server.start()
    local = in_process(exported, "onnx")
    completed, errors = [], []
    stop = threading.Event()

    def stream(seed):
        c = TritonClient(server.url, timeout_s=20)
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            x = rng.random((1, 3, 32, 32), dtype=np.float32)
            try:
                completed.append((x, c.infer("tiny_cnn_onnx", x)))
            except Exception as e:  # refused once shutdown begins
                errors.append(e)
                return

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    pgid = server.proc.pid
    n_before = len(completed)
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(60)
    stop.set()
    for t in threads:
        t.join(30)
    assert code == 0
    assert n_before > 0 and len(completed) >= n_before
    for x, y in completed:  # every response that completed is correct
        np.testing.assert_allclose(y, local.run({"images": x})["logits"], atol=1e-5, rtol=1e-5)
    with pytest.raises(ProcessLookupError):  # no stub or server process left in its group
        os.killpg(pgid, 0)
    server.log_path.unlink()


@pytest.mark.slow
def test_a_stream_whose_first_request_is_refused_still_stops(repo, exported, tmp_path):
    """Triton 2.51 never unloads a model once the first request of a gRPC stream was refused for it, so
    its shutdown would wait out the exit timeout and fail; stop() ends it once every request is answered
    and says which model would not unload. The log is a file of the test's (a temp log goes after a clean
    stop), so that it can be read whichever way the stop went."""
    from torchship.serve.client import InferStream, infer_channel

    log = tmp_path / "tritonserver.log"
    server = TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",), log=str(log))).start()
    channel, _ = infer_channel(server.url)
    stream = InferStream(channel)
    try:
        refused_then_served(stream, exported)
    finally:
        stream.close()
        channel.close()
    pgid = server.proc.pid
    server.stop()
    if "successfully unloaded 'tiny_cnn_onnx'" in server.log_path.read_text():
        assert server.stop_note is None  # this time Triton unloaded it (seen once, the machine under load)
    else:
        assert server.stop_note and server.stop_note.startswith("tiny_cnn_onnx still loaded")
        assert f"(server log: {server.log_path})" in server.stop_note
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_unload_stall_is_read_from_the_log():
    from torchship.serve.embedded.shutdown import UNLOAD_STALL_TICKS, live_at_exit, loaded_models, unload_stalled

    head = (
        'Signal (15) received.\n"Timeout 20: Found 1 model versions that have in-flight inferences"\n'
        '"All models are stopped, unloading models"\n'
    )
    tick = '"Timeout {}: Found {} live models and {} in-flight non-inference requests"\n'
    stalled = head + "".join(tick.format(20 - i, 1, 0) for i in range(UNLOAD_STALL_TICKS))
    assert unload_stalled(stalled) == 1
    assert unload_stalled(head + "".join(tick.format(20 - i, 1, 0) for i in range(UNLOAD_STALL_TICKS - 1))) == 0
    n = UNLOAD_STALL_TICKS + 2
    assert unload_stalled(head + "".join(tick.format(20 - i, 1, 1) for i in range(n))) == 0  # still working
    assert unload_stalled(head + "".join(tick.format(20 - i, n - i, 0) for i in range(n))) == 0  # progressing
    assert unload_stalled(stalled.replace("All models are stopped", "Waiting")) == 0  # requests not drained
    # Triton's own exit timeout ran out first (a long drain leaves fewer ticks): the last count says who is live
    assert live_at_exit(head + "".join(tick.format(3 - i, 2, 0) for i in range(4))) == 2
    assert live_at_exit(head + tick.format(20, 2, 0) + tick.format(19, 0, 0)) == 0
    assert live_at_exit(stalled.replace("All models are stopped", "Waiting")) == 0
    log = "successfully loaded 'a'\nsuccessfully loaded 'b'\nsuccessfully unloaded 'a'\nsuccessfully loaded 'c'\n"
    assert loaded_models(log + "successfully unloaded 'c'\n") == ["b"]


def test_a_model_that_fails_to_load_is_named_and_its_log_kept(repo, tmp_path):
    """A broken artifact stops start-up with the model's name, the log's tail and the log's path; the
    temp log that a clean stop removes is kept for the user to read."""
    bad = tmp_path / "repo"
    shutil.copytree(repo, bad)
    path = bad / "tiny_cnn_onnx" / "1" / "model.onnx"
    path.write_bytes(path.read_bytes()[:1000])
    rehash_version(path.parent)
    server = TritonServer(ServeConfig(repo=str(bad), models=("tiny_cnn_onnx",)))
    with pytest.raises(ServerError, match="tiny_cnn_onnx failed to load") as e:
        server.start()
    assert f"(full log: {server.log_path})" in str(e.value)
    assert server.log_path.exists() and server.proc.poll() is not None
    server.log_path.unlink()


def test_a_server_that_cannot_be_started_leaves_no_temp_log(repo, tmp_path, monkeypatch):

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(TritonServer, "command", lambda self: [str(tmp_path / "no-such-tritonserver")])
    with pytest.raises(FileNotFoundError):
        TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",))).start()
    assert list(tmp_path.glob("tritonserver-*.log")) == []


def test_serve_refuses_a_folder_without_models_before_starting(capsys, exported, tmp_path):
    """A missing folder, an export directory and an empty folder are refused in one line, naming the fix."""
    assert run_cli("serve", tmp_path / "missing") == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    for folder, message in ((exported, f"torchship repo {exported}"), (tmp_path / "empty", "holds no model")):
        # were the guard gone, serve would start Triton and wait for a signal: send it one, so the test
        # fails (serve stops and returns 0) instead of hanging
        timer = threading.Timer(60, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        try:
            assert run_cli("serve", folder) == 2
        finally:
            timer.cancel()
        assert message in capsys.readouterr().err


def test_serve_names_a_broken_config_before_starting(repo, tmp_path, capsys):
    bad = tmp_path / "repo"
    shutil.copytree(repo, bad)
    config = bad / "tiny_cnn_onnx" / "config.pbtxt"
    line = len(config.read_text().splitlines()) + 1
    config.write_text(config.read_text() + "max_batch_sise: 8\n")  # a typo Triton would only log
    timer = threading.Timer(60, os.kill, (os.getpid(), signal.SIGTERM))  # as above: fail, not hang, if it starts
    timer.start()
    try:
        assert run_cli("serve", bad) == 2
    finally:
        timer.cancel()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{config}: {line}:1" in err[0] and 'no field named "max_batch_sise"' in err[0], err


def test_serve_refuses_a_port_in_use_before_starting(repo, capsys):

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert run_cli("serve", repo, "--grpc-port", port) == 2
    assert f"--grpc-port {port}: 127.0.0.1:{port} is already in use" in capsys.readouterr().err


class FirstFreePort:
    """A socket whose bind to port 0 gets the lowest port that no open one holds: a port allocator that,
    like Linux now and then, hands out a port again as soon as it is closed."""

    held: set[int] = set()

    def __init__(self, *args):
        self.port = None

    def setsockopt(self, *args):
        pass

    def bind(self, addr):
        port = addr[1] or min(set(range(50000, 50010)) - self.held)
        if port in self.held:
            raise OSError("in use")
        self.port = port
        self.held.add(port)

    def getsockname(self):
        return ("127.0.0.1", self.port)

    def close(self):
        self.held.discard(self.port)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_each_endpoint_gets_its_own_port(repo, capsys, monkeypatch):
    """Ports left to the system are distinct and avoid the ones given, even where the system hands a
    closed port out again (picked one at a time, Triton then refuses to start: 'cannot listen to HTTP
    requests and metrics requests at the same address and port')."""
    import torchship.serve.embedded.process as srv

    monkeypatch.setattr(
        srv,
        "socket",
        types.SimpleNamespace(socket=FirstFreePort, SOL_SOCKET=socket.SOL_SOCKET, SO_REUSEADDR=socket.SO_REUSEADDR),
    )
    s = TritonServer(ServeConfig(repo=str(repo)))
    assert sorted((s.grpc_port, s.http_port, s.metrics_port)) == [50000, 50001, 50002]
    s = TritonServer(ServeConfig(repo=str(repo), http_port=50000))
    assert s.http_port == 50000 and sorted((s.grpc_port, s.metrics_port)) == [50001, 50002]
    monkeypatch.undo()
    assert run_cli("serve", repo, "--grpc-port", 50000, "--metrics-port", 50000) == 2
    assert "--grpc-port and --metrics-port are both 50000" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--grpc-port", "--metrics-port"])
def test_a_picked_port_taken_before_triton_binds_it_is_picked_again(repo, exported, tmp_path, monkeypatch, flag):
    """Another process takes a port the server picked, between the pick and Triton's bind (gRPC: before the
    server is live; metrics: Triton's last bind, often after). The server starts on a new port, this
    server's own model answers there, and the failed start leaves no temp log."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    server = TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",)))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", server.ports[flag]))
        taken.listen()
        with server:
            assert server.ports[flag] != taken.getsockname()[1]
            assert_onnx_served(server.url, exported, np.random.default_rng(3).random((2, 3, 32, 32), dtype=np.float32))
    assert server.proc.returncode == 0 and list(tmp_path.glob("tritonserver-*.log")) == []


@pytest.mark.slow
def test_another_server_on_the_picked_grpc_port_is_not_taken_for_this_one(repo, exported, tmp_path, monkeypatch):
    """What a second Triton that won the race for the picked gRPC port would do: answer live, load and
    ready for any model. start() must not take it for its own server: it starts again on a new port."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    class Impostor(service_pb2_grpc.GRPCInferenceServiceServicer):
        def ServerLive(self, request, context):
            return service_pb2.ServerLiveResponse(live=True)

        def RepositoryModelLoad(self, request, context):
            return service_pb2.RepositoryModelLoadResponse()

        def ModelReady(self, request, context):
            return service_pb2.ModelReadyResponse(ready=True)

    server = TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",)))
    taken = server.grpc_port
    impostor = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Impostor(), impostor)
    assert impostor.add_insecure_port(f"127.0.0.1:{taken}") == taken
    impostor.start()
    try:
        with server:
            assert server.grpc_port != taken
            assert_onnx_served(server.url, exported, np.random.default_rng(4).random((1, 3, 32, 32), dtype=np.float32))
    finally:
        impostor.stop(0)
    assert server.proc.returncode == 0 and list(tmp_path.glob("tritonserver-*.log")) == []


def test_a_given_port_taken_after_the_check_is_named(repo, tmp_path, monkeypatch):
    """A port the user gave is not picked again: the error names the flag and keeps the log."""
    from torchship.serve.embedded.process import free_ports

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    port = free_ports()[0]
    server = TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",), grpc_port=port))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(ServerError, match=f"--grpc-port {port}: 127.0.0.1:{port} is already in use: it was taken"):
            server.start()
    assert server.grpc_port == port and server.proc.poll() is not None
    assert list(tmp_path.glob("tritonserver-*.log")) == [server.log_path]


@pytest.mark.slow
def test_the_server_starts_without_running_this_process_fork_handlers(repo, exported):
    """No preexec_fn anywhere: Popen then uses vfork and runs none of the at-fork handlers that native
    libraries loaded here registered. gRPC's, with requests in flight on other threads, can abort the child
    ("Fatal Python error: Aborted" in _execute_child). Python runs its own at-fork hooks exactly when it runs
    those, so one stands witness."""
    forks: list[int] = []
    os.register_at_fork(before=lambda: forks.append(1))  # cannot be unregistered; it only counts
    x = np.random.default_rng(0).random((1, 3, 32, 32), dtype=np.float32)
    with TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",))) as s:
        got = TritonClient(s.url).infer("tiny_cnn_onnx", x)
        started = len(forks)
    assert started == 0, "starting the server ran this process's at-fork handlers"
    np.testing.assert_allclose(got, in_process(exported, "onnx").run({"images": x})["logits"], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_server_started_from_a_thread_that_ends_keeps_serving(repo, exported):
    """Linux sends a child its death signal when the thread that started it ends, not the process: a server
    started straight from a worker thread was SIGTERMed as soon as that thread returned."""
    box: dict = {}

    def start():
        try:
            box["server"] = TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",))).start()
        except BaseException as e:  # raised again below, in the test's own thread
            box["error"] = e

    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    x = np.random.default_rng(1).random((1, 3, 32, 32), dtype=np.float32)
    with box["server"] as s:  # started already: entering does not start it again
        time.sleep(1.0)  # the signal, had it come, came when the thread ended; Triton then drains and exits
        assert s.proc.poll() is None, "the server ended with the thread that started it"
        got = TritonClient(s.url).infer("tiny_cnn_onnx", x)
        with pytest.raises(ServerError, match="already running"):
            s.start()
    np.testing.assert_allclose(got, in_process(exported, "onnx").run({"images": x})["logits"], rtol=1e-4, atol=1e-5)


def test_a_start_interrupted_while_waiting_on_the_starter_ends_the_child(monkeypatch):
    """Ctrl-C (here a SIGINT whose handler raises) while the caller waits for the starter thread: the caller
    gets the interrupt at once, and the child that the starter brings up after it is killed, not orphaned
    (nothing else holds its Popen)."""
    from torchship.serve.embedded import process as server

    class Interrupted(BaseException):
        pass

    def raise_interrupted(signum, frame):
        raise Interrupted

    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def slow_popen(*args, **kw):  # runs on the starter thread: the interrupt lands while the caller waits
        time.sleep(1.0)
        started.append(real_popen(*args, **kw))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", slow_popen)
    old = signal.signal(signal.SIGINT, raise_interrupted)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(Interrupted):
            server.start_child([sys.executable, "-c", "import time; time.sleep(60)"])
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)
    deadline = time.monotonic() + 10
    try:
        while not (started and started[0].poll() is not None) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started, "the starter never ran the start"
        assert started[0].returncode == -signal.SIGKILL, "the child outlived the interrupted start"
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
def test_a_killed_client_process_leaves_no_server_behind(repo, tmp_path):
    """SIGKILL the process that started the server: no finally block runs, yet the server goes too."""
    script = tmp_path / "hold.py"
    script.write_text(f"""
import sys, time
from torchship.serve.config import ServeConfig
from torchship.serve.embedded import TritonServer
s = TritonServer(ServeConfig(repo={str(repo)!r}, models=("tiny_cnn_onnx",),
                             log={str(tmp_path / "server.log")!r})).start()
print(s.proc.pid, flush=True)
time.sleep(600)
""")
    holder = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).resolve().parents[2])
    )
    server_pid = int(holder.stdout.readline())
    os.kill(server_pid, 0)  # it is up
    holder.kill()
    holder.wait(30)
    deadline = time.time() + 60
    for pid, what in ((server_pid, "the server"),):
        while time.time() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"{what} outlived the process that started it")
    with pytest.raises(ProcessLookupError):
        os.killpg(server_pid, 0)  # its stubs are gone too


@pytest.mark.slow
def test_a_backend_process_that_never_starts_fails_the_start_in_time(repo, tmp_path, monkeypatch):
    """Planted: the Python stub cannot start (as when it cannot find libpython). The load call is bounded by
    --ready-timeout and the error carries the server log's tail, instead of start() waiting for good."""
    import torchship.serve.embedded.server as server_mod

    broken = tmp_path / "backends"
    shutil.copytree(server_mod.backend_dir(), broken)
    stub = broken / "python" / "triton_python_backend_stub"
    stub.write_text("#!/bin/sh\necho 'triton_python_backend_stub: planted failure' >&2\nexit 127\n")
    monkeypatch.setattr(server_mod, "backend_dir", lambda: broken)
    outcome = {}

    def start():
        try:
            TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",), ready_timeout=10)).start().stop()
            outcome["error"] = None
        except ServerError as e:
            outcome["error"] = str(e)

    t = threading.Thread(target=start, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "start() still waits on a model whose backend never started"
    assert outcome["error"] and "tiny_cnn_onnx" in outcome["error"] and "planted failure" in outcome["error"], outcome


OWN_AUTO_COMPLETE = """
class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_output({"name": "DOUBLED", "data_type": "TYPE_FP32", "dims": [4]})
        return config

    def execute(self, requests):
        raise NotImplementedError
"""


def test_a_model_that_completes_its_own_config_is_asked_and_ours_are_not(repo, tmp_path):
    """Triton asks each python model for its config in a stub process of its own, one more per load: the
    embedded server skips that for torchship's repositories (no model defines auto_complete_config), and
    still asks where one does, whose served config then has the output it added."""
    own = tmp_path / "own" / "doubler"
    (own / "1").mkdir(parents=True)
    (own / "config.pbtxt").write_text(
        'name: "doubler"\nbackend: "python"\nmax_batch_size: 0\n'
        'input { name: "X" data_type: TYPE_FP32 dims: [4] }\ninstance_group { kind: KIND_CPU count: 1 }\n'
    )
    (own / "1" / "model.py").write_text(OWN_AUTO_COMPLETE)
    assert "--disable-auto-complete-config" in TritonServer(ServeConfig(repo=str(repo))).command()
    server = TritonServer(ServeConfig(repo=str(own.parent)))
    assert "--disable-auto-complete-config" not in server.command()
    with server:
        outputs = TritonClient(server.url).config("doubler").get("output", [])
    assert [o["name"] for o in outputs] == ["DOUBLED"], outputs
