"""The embedded Triton Inference Server: the wheel's binary run as a child process against a repository,
with ports picked, readiness awaited, models loaded explicitly, and a shutdown that drains."""

from __future__ import annotations

import io
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

from torchship.device import cuda_visible
from torchship.errors import ServerError, TorchshipError
from torchship.runtime import version_file_problems

from ..access import Access, forget, remember, restricted_flags, write_key
from ..config import ServeConfig
from ..model_config import CONFIG, EMBEDDED_CONFIG, read_config, repository_models, served_config_path, versions
from .hidden import check_restricted, hide
from .process import dying_with_parent, free_ports, listens_on, port_in_use, start_child
from .shutdown import EXIT_TIMEOUT_S, live_at_exit, loaded_models, stall_note, unload_stalled
from .wheel import backend_dir, private_dir, server_env, triton_home

# A port picked free can be taken by another process before Triton binds it; start() then picks again.
PORT_ATTEMPTS = 3
PORT_TAKEN = re.compile(r"Socket '[^']*:(\d+)' already in use")
PORTS = ("--grpc-port", "--http-port", "--metrics-port")
FAILED_START_STOP_S = 3.0  # after a failed start, how long SIGTERM gets before the server is killed


class TritonServer:
    """Start/stop the embedded server. Use as a context manager; ``url`` is the gRPC address."""

    def __init__(self, cfg: ServeConfig, extra_repos: Sequence[str | Path] = ()):
        self.cfg = cfg
        self.extra_repos = [Path(r).resolve() for r in extra_repos]
        self.repo = Path(cfg.repo).resolve()
        if not self.repo.is_dir():
            raise ServerError(f"repository {self.repo} does not exist (build one with torchship repo)")
        names = list(cfg.models) or repository_models(self.repo)  # the models start() will load
        if not names:
            hint = (
                "it is an export directory: build a repository from it with torchship repo "
                f"{cfg.repo} --out model_repository"
                if (self.repo / "manifest.json").exists()
                else "build one with torchship repo EXPORT_DIR"
            )
            raise ServerError(f"{self.repo} holds no model (no <model>/config.pbtxt); {hint}")
        self.check_configs(names)
        flags = dict(zip(PORTS, (cfg.grpc_port, cfg.http_port, cfg.metrics_port)))
        given = [p for p in flags.values() if p]
        for flag, port in flags.items():
            if port and given.count(port) > 1:
                same = " and ".join(f for f, p in flags.items() if p == port)
                raise ServerError(f"{same} are both {port}; each endpoint needs its own port")
            if port and port_in_use(cfg.host, port):
                raise ServerError(
                    f"{flag} {port}: {cfg.host}:{port} is already in use; choose another port, "
                    "or leave the flag out to pick a free one"
                )
        self.given = {flag for flag, port in flags.items() if port}  # the rest are picked, and picked again if taken
        picked = iter(free_ports(cfg.host, 3 - len(given), avoid=given))
        self.ports = {flag: port or next(picked) for flag, port in flags.items()}
        self.proc: Optional[subprocess.Popen] = None
        # without cfg.log, start() makes the log a temp file, removed after a clean stop and kept (and named)
        # after a failure
        self.log_path: Optional[Path] = Path(cfg.log) if cfg.log else None
        self._keep_log = bool(cfg.log)
        self.loaded: list[str] = []
        self.stop_note: Optional[str] = None  # set by stop() when it had to cut the shutdown short
        self._log_start = 0  # where this start's lines begin in the log
        self.healer = None  # heal.Healer while the server runs with cfg.heal
        # Model control (load, unload, the repository index), shared memory, logging and trace answer only to this
        # key, new at each start; torchship's own calls present it, and key_file gives it to other clients.
        self.key: Optional[str] = None
        self.key_file: Optional[Path] = None
        self._hidden_args: Optional[Path] = None  # the key's way into tritonserver, removed once read

    @property
    def grpc_port(self) -> int:
        return self.ports["--grpc-port"]

    @property
    def http_port(self) -> int:
        return self.ports["--http-port"]

    @property
    def metrics_port(self) -> int:
        return self.ports["--metrics-port"]

    @property
    def url(self) -> str:
        return f"{self.cfg.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.cfg.host}:{self.metrics_port}/metrics"

    @property
    def access(self) -> Access:
        """What torchship's own calls present to this server."""
        cfg = self.cfg
        return Access(
            key=self.key,
            key_source=str(self.key_file or "this server's start"),
            tls_ca=(cfg.tls_ca or cfg.tls_cert) if cfg.tls_cert else None,
            tls_cert=cfg.tls_own_cert,
            tls_key=cfg.tls_own_key,
            insecure=True,  # this machine's own server, at whichever of its addresses --host names
        )

    def command(self) -> list[str]:
        """tritonserver's command line; the control key is not on it (_start_once hands it over)."""
        home, _ = triton_home()
        cmd = [
            str(home / "bin" / "tritonserver"),
            f"--model-repository={self.repo}",
            *[f"--model-repository={r}" for r in self.extra_repos],
            f"--backend-directory={backend_dir()}",
            "--model-control-mode=explicit",
            f"--grpc-address={self.cfg.host}",
            f"--grpc-port={self.grpc_port}",
            f"--http-address={self.cfg.host}",
            f"--http-port={self.http_port}",
            f"--metrics-address={self.cfg.host}",
            f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            "--exit-on-error=false",
            "--strict-readiness=true",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            "--log-verbose=0",
            f"--cache-directory={home / 'caches'}",
        ]
        if not asks_auto_complete([self.repo, *self.extra_repos]):
            # each model load would start one more python-backend stub process, only to ask for a config change
            cmd.append("--disable-auto-complete-config")
        if not cuda_visible():
            cmd += ["--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0"]
        return cmd + self.cfg.tls_flags() + list(self.cfg.triton_args)

    def log_tail(self, lines: int = 25) -> str:
        """The end of the server log, for an error message: the log is then kept, and its path ends the tail."""
        if self.log_path is None:  # never started
            return "(no server log)"
        self._keep_log = True
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no server log)"
        keep = [line for line in text if "CudaDriverHelper" not in line]
        # a refused option comes first, before Triton's whole usage text
        refused = [line for line in keep[:-lines] if "unrecognized option" in line or "invalid argument" in line]
        return "\n".join(refused[:3] + keep[-lines:] + [f"(full log: {self.log_path})"])

    def start(self) -> "TritonServer":
        """Start the server, load every model (or cfg.models) and wait until all are ready.
        Raises ServerError with the tail of the server log on failure. A port this server picked that
        another process takes before Triton binds it is picked again, up to PORT_ATTEMPTS starts."""
        if self.running:
            raise ServerError(
                f"this server is already running (pid {self.proc.pid}, gRPC at {self.url}); stop() it "
                "before starting it again"
            )
        attempt = 1
        while True:
            try:
                self._start_once()
                if self.cfg.heal:
                    from .heal import Healer

                    self.healer = Healer(
                        self, log=lambda line: print(f"torchship serve: {line}", file=sys.stderr, flush=True)
                    )
                    self.healer.start()
                return self
            except Exception:
                flag = self.port_taken()
                if flag is None:
                    raise
                port = self.ports[flag]
                if flag in self.given or attempt == PORT_ATTEMPTS:
                    why = (
                        "it was taken after the check at start-up; choose another port, or leave the flag out "
                        "to pick a free one"
                        if flag in self.given
                        else f"another process took each port picked for it, {PORT_ATTEMPTS} times"
                    )
                    raise ServerError(
                        f"{flag} {port}: {self.cfg.host}:{port} is already in use: {why} (server log: {self.log_path})"
                    ) from None
                self.repick(flag)
                attempt += 1

    def port_taken(self) -> Optional[str]:
        """The flag of the port Triton could not bind, if that is why the last start failed."""
        if self.proc is None or self.proc.poll() is None or self.log_path is None:
            return None
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                found = PORT_TAKEN.search(f.read().decode(errors="replace"))
        except OSError:
            return None
        port = int(found.group(1)) if found else None
        return next((flag for flag, p in self.ports.items() if p == port), None)

    def repick(self, flag: str) -> None:
        """A new port for ``flag``, away from this server's others; the failed start's temp log goes."""
        self._drop_key()
        self.ports[flag] = free_ports(self.cfg.host, 1, avoid=list(self.ports.values()))[0]
        if not self.cfg.log:
            self.log_path.unlink(missing_ok=True)
            self.log_path, self._keep_log = None, False
        self.proc, self.loaded, self.stop_note = None, [], None

    def _start_once(self) -> "TritonServer":
        env = server_env()
        if self.log_path is None:
            self.log_path = Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
        self.key = secrets.token_urlsafe(32)
        shown, self._hidden_args = hide(restricted_flags(self.key), private_dir(), env, self.cfg.key_on_command_line)
        self.key_file = write_key(self.url, self.key)
        remember(self.url, self.access)
        log = open(self.log_path, "ab")
        self._log_start = log.seek(0, os.SEEK_END)  # a given log may hold earlier runs' lines
        try:  # a session of its own: a Ctrl-C at the terminal reaches torchship, which stops the server
            self.proc = start_child(
                dying_with_parent(self.command() + shown),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except BaseException:
            if not self._keep_log:  # nothing ran, so the empty temp log tells nothing
                self.log_path.unlink(missing_ok=True)
            self._drop_key()
            raise
        finally:
            log.close()
        deadline = time.monotonic() + self.cfg.ready_timeout
        try:
            client = self.client()
            while True:
                if self.proc.poll() is not None:
                    raise ServerError(
                        f"tritonserver exited with code {self.proc.returncode} during start-up:\n{self.log_tail()}"
                    )
                # a bounded wait (a port taken by something that is not a gRPC server never answers), and it is this
                # server that answers, and holds each of its ports: metrics is Triton's last bind, after it is live,
                # and a failed one ends it
                if client.live(timeout_s=1.0) and all(
                    listens_on(self.proc.pid, p) is not False for p in self.ports.values()
                ):
                    break
                if time.monotonic() > deadline:
                    raise ServerError(f"tritonserver not live after {self.cfg.ready_timeout:.0f}s:\n{self.log_tail()}")
                time.sleep(0.1)
            check_restricted(client)  # fails closed: a server whose control plane answers without the key stops
            names = list(self.cfg.models or repository_models(self.repo))
            # an ensemble after the models in it: loading it first makes Triton load them itself, each from its
            # config.pbtxt, which may be the container's (torch_aoti) rather than the embedded.pbtxt it runs here
            ensembles = [n for n in names if read_config(self.repo / n / CONFIG).platform == "ensemble"]
            for group in ([n for n in names if n not in ensembles], ensembles):
                with ThreadPoolExecutor(max_workers=max(1, len(group))) as pool:  # loads overlap their imports
                    for f in [pool.submit(self.load, n, None, deadline) for n in group]:
                        f.result()
            self.loaded.sort()
            return self
        except BaseException:
            self.stop(timeout=FAILED_START_STOP_S)  # nothing was served: no drain to wait for
            raise

    def check_configs(self, names: Sequence[str]) -> None:
        """Parse the config of each model in ``names`` (as load() reads it), so that a broken one is named with
        its line, one whose files differ from the sha256 the repository recorded is named with the file, and one
        that asks for GPU instances where no CUDA GPU is visible is refused, before the server starts (Triton
        itself only logs these among its start-up lines, or, for the files, leaves the model not ready)."""
        from google.protobuf.text_format import ParseError
        from tritonclient.grpc import model_config_pb2 as mc

        for name in names:
            path = served_config_path(self.repo / name)
            try:
                config = read_config(path)
            except FileNotFoundError:
                continue  # an unknown model: Triton's own load error names it
            except (ParseError, UnicodeDecodeError) as e:
                raise ServerError(
                    f"{path}: {str(e).rstrip('.')}; fix it, or build the repository again with torchship repo"
                ) from None
            for v in served_versions(self.repo / name, config):
                problems = version_file_problems(self.repo / name / str(v))
                if problems:
                    raise ServerError(
                        f"model {name} version {v}: " + "; ".join(problems) + "; it would not be served: "
                        "build the repository again with torchship repo"
                    )
            if any(g.kind == mc.ModelInstanceGroup.KIND_GPU for g in config.instance_group) and not cuda_visible():
                raise ServerError(
                    f"model {name} asks for GPU instances (KIND_GPU in {path}) and no CUDA GPU is visible "
                    "here; build the repository again with torchship repo EXPORT_DIR --instance-kind cpu, "
                    "or serve it on a machine with a GPU"
                )

    def load(self, name: str, client=None, deadline: float | None = None, override=None) -> None:
        """Load (or reload) one model: with ``override`` (a ModelConfig) if given, else with
        embedded.pbtxt where the repository has one, else with its config.pbtxt. ``client``: a TritonClient of
        this server (default: a new one)."""
        client = client or self.client()
        path = served_config_path(self.repo / name)
        if override is None and path.name == EMBEDDED_CONFIG:  # Triton reads config.pbtxt itself
            override = read_config(path)
        try:  # bounded: a model whose backend process never starts holds the call open for good
            client.load(name, override, timeout_s=max(1.0, deadline - time.monotonic()) if deadline else None)
        except TorchshipError as e:
            raise ServerError(
                f"model {name} failed to load: {str(e).removeprefix(f'load {name}: ')}\n{self.log_tail()}"
            ) from None
        while not client.ready(name):
            if deadline and time.monotonic() > deadline:
                raise ServerError(f"model {name} not ready in time:\n{self.log_tail()}")
            time.sleep(0.05)
        if name not in self.loaded:
            self.loaded.append(name)

    def client(self):
        """A TritonClient of this server, presenting its key."""
        from ..client import TritonClient

        return TritonClient(self.url, access=self.access)

    def _drop_key(self) -> None:
        """The key's files go with the server that answered to it."""
        for path in (self.key_file, self._hidden_args):
            if path is not None:
                path.unlink(missing_ok=True)
        forget(self.url)
        self.key_file = self._hidden_args = None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (Triton drains in-flight requests), then SIGKILL the group if it hangs, or once every
        request is answered and a model still will not unload (``stop_note`` then says which, as it does when
        Triton gives up at its own exit timeout)."""
        if self.healer is not None:  # stubs die on purpose from here on
            self.healer.stop()
            self.healer = None
        if self.proc is None or self.proc.poll() is not None:
            self._drop_key()
            return None if self.proc is None else self.proc.returncode
        try:
            log = open(self.log_path, "rb")
            log.seek(0, os.SEEK_END)
        except OSError:  # the log was removed meanwhile: stop without watching it
            log = io.BytesIO()
        shutdown_log = b""  # what the server logs from SIGTERM on, read as it comes
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        with log:
            while True:
                try:
                    self.proc.wait(0.25)
                    break
                except subprocess.TimeoutExpired:
                    pass
                shutdown_log += log.read()
                stuck = unload_stalled(shutdown_log.decode(errors="replace"))
                if stuck or time.monotonic() > deadline:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(10)
                    break
            shutdown_log += log.read()
            text = shutdown_log.decode(errors="replace")
            killed = unload_stalled(text)  # or Triton gave up at its own exit timeout with models still live:
            stuck = killed or live_at_exit(text)
            if stuck:
                log.seek(0)
                self.stop_note = (
                    stall_note(
                        loaded_models(log.read().decode(errors="replace")) or [f"{stuck} model(s)"], bool(killed)
                    )
                    + f" (server log: {self.log_path})"
                )
        # stub processes share the server's process group; make sure none outlives it
        gone = time.monotonic() + 10
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
            while time.monotonic() < gone:  # until the killed stubs have been reaped
                os.killpg(self.proc.pid, 0)
                time.sleep(0.05)
        except ProcessLookupError:
            pass
        self._drop_key()
        if self.proc.returncode == 0 and not self._keep_log and not self.stop_note:
            self.log_path.unlink(missing_ok=True)
        return self.proc.returncode

    def instance_memory(self) -> dict[str, int]:
        """model -> resident bytes of its backend processes (Python stubs), for the models loaded now."""
        from .process import instance_memory

        return instance_memory(self.proc.pid, self.loaded) if self.running else {}

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> "TritonServer":
        return self if self.running else self.start()  # `with TritonServer(cfg).start() as s:` starts one

    def __exit__(self, *exc) -> None:
        self.stop()


def asks_auto_complete(repos: Sequence[str | Path]) -> bool:
    """Whether a model in ``repos`` defines its own auto_complete_config (a python model's model.py): the
    embedded server's backends are all python-based, and none of torchship's defines one."""
    for repo in repos:
        for f in Path(repo).glob("*/*/model.py"):
            try:
                if "auto_complete_config" in f.read_text(errors="replace"):
                    return True
            except OSError:
                continue
    return False


def served_versions(model_dir: Path, config) -> list[int]:
    """The version folders Triton loads for a model under its config's version policy."""
    on_disk = versions(model_dir)
    policy = config.version_policy.WhichOneof("policy_choice")
    if policy == "specific":
        return [v for v in on_disk if v in config.version_policy.specific.versions]
    if policy == "all":
        return on_disk
    return on_disk[-max(1, config.version_policy.latest.num_versions) :]


def describe(server: TritonServer) -> dict:
    return {
        "grpc": server.url,
        "http": f"{server.cfg.host}:{server.http_port}",
        "metrics": server.metrics_url,
        "models": server.loaded,
        "log": str(server.log_path),
        "pid": server.proc.pid if server.proc else None,
        "key_file": str(server.key_file) if server.key_file else None,
        "tls": bool(server.cfg.tls_cert),
        "mutual_tls": bool(server.cfg.tls_client_ca),
    }
