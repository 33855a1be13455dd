"""The embedded Triton Inference Server: the binary shipped in the nvidia-pytriton wheel, run as a child
process against a repository, with the environment its Python stub needs set up here."""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import io
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from google.protobuf import json_format

from torchship.errors import ServerError

from . import child_env
from .config import ServeConfig, cpu_list, cuda_visible, parse_cpu_range, parse_cpus
from .repository import EMBEDDED_CONFIG, read_config, repository_models, served_config_path

HERE = Path(__file__).resolve().parent
EXIT_TIMEOUT_S = 20  # Triton's own limit for draining and unloading after SIGTERM
# Once SIGTERM's drain is over, Triton unloads every model and reports the ones still live once a second.
UNLOAD_STALL_TICKS = 5
# A port picked free can be taken by another process before Triton binds it; start() then picks again.
PORT_ATTEMPTS = 3
PORT_TAKEN = re.compile(r"Socket '[^']*:(\d+)' already in use")


def free_ports(host: str = "127.0.0.1", n: int = 1, avoid: Sequence[int] = ()) -> list[int]:
    """``n`` distinct ports on ``host`` that the system picks, none in ``avoid``. Every socket stays open
    until all are picked: bound and closed one at a time, the system can hand out the same port twice."""
    socks: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < n:
            s = socket.socket()
            socks.append(s)
            s.bind((host, 0))
            if s.getsockname()[1] not in avoid:
                ports.append(s.getsockname()[1])
        return ports
    finally:
        for s in socks:
            s.close()


def port_in_use(host: str, port: int) -> bool:
    """Whether ``port`` on ``host`` cannot be bound now as Triton binds it (SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def listens_on(pid: int, port: int) -> Optional[bool]:
    """Whether process ``pid`` holds a listening TCP socket on ``port``, read from /proc (None where /proc
    cannot tell). A server that answers on a port is not always the one this process started."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()  # sl local_address rem_address st ... uid timeout inode
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{fields[9]}]")
        except FileNotFoundError:  # no IPv6
            continue
        except (OSError, IndexError, ValueError):
            return None
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:  # closed meanwhile
            pass
    return False


def triton_home() -> tuple[Path, Path]:
    """(pytriton/tritonserver directory, nvidia_pytriton.libs directory) from the installed wheel."""
    try:
        import pytriton
    except ImportError:
        raise ServerError("the embedded Triton server needs the nvidia-pytriton package: pip install nvidia-pytriton") from None
    pkg = Path(pytriton.__file__).resolve().parent
    home, libs = pkg / "tritonserver", pkg.parent / "nvidia_pytriton.libs"
    if not (home / "bin" / "tritonserver").exists():
        raise ServerError(f"no tritonserver binary under {home}; reinstall nvidia-pytriton")
    return home, libs


BACKENDS = ("onnxruntime", "pytorch", "torchship")  # torchship: the floor models the bench serves
INSERVER_LIB = "libtorchship_inserver.so"


def compile_inserver(dest: Path) -> None:
    """Build inserver.c against this Python's shared libpython into ``dest``; ServerError says what is missing."""
    import sysconfig

    hint = "or serve with --python-host stub"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise ServerError(f"the in-server backend needs a C compiler (cc) to build; install one, {hint}")
    libdir, ldlib = sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("LDLIBRARY") or ""
    if not (ldlib.endswith(".so") and (Path(libdir) / ldlib).exists()):
        raise ServerError(f"the in-server backend needs a shared libpython, and this Python ({sys.executable}) "
                          f"has none; use a Python built with --enable-shared, {hint}")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise ServerError(f"the in-server backend needs Python's headers (no Python.h in {include}); install the "
                          f"python3-dev package, {hint}")
    cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(dest), str(HERE / "backends" / "inserver.c"), f"-I{include}",
           f"-L{libdir}", f"-l{ldlib[3:-3]}", f"-Wl,-rpath,{libdir}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-10:])
        raise ServerError(f"building the in-server backend failed (exit {done.returncode}), {hint}: {' '.join(cmd)}"
                          + (f"\n{tail}" if tail else ""))


def backend_dir(host: str = "server") -> Path:
    """A backend directory: Triton's python backend + the stub for this Python, and torchship's Python-based
    onnxruntime/pytorch/torchship backends, hosted in the server process (``server``: a library built from
    inserver.c) or in python-backend stubs (``stub``: model.py files). Built once per content hash and reused."""
    import sysconfig

    home, _ = triton_home()
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = home / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.exists():
        raise ServerError(f"the Triton Python stub has no build for Python {ver}; use Python 3.10-3.13")
    src = HERE / "backends"
    shared = [src / "torchship_backend.py", HERE.parent / "torchship" / "runtime.py"]
    if host == "server":
        files = shared + [src / "torchship_inserver.py", src / "inserver.c"]
    else:
        files = shared + [src / "torchship_stub.py"] + [src / b / "model.py" for b in BACKENDS]
    h = hashlib.sha256(f"{host}\0{sys.version}\0{sysconfig.get_config_var('LIBDIR')}".encode())
    for f in files + [stub]:
        h.update(f.read_bytes())
    root = Path(tempfile.gettempdir()) / f"torchship-backends-{os.getuid()}" / f"{host}-{h.hexdigest()[:16]}"
    if (root / ".complete").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root.parent))
    try:
        (tmp / "python").mkdir()
        for f in (home / "backends" / "python").iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / "python" / f.name)
        shutil.copy2(stub, tmp / "python" / "triton_python_backend_stub")
        if host == "server":
            compile_inserver(tmp / INSERVER_LIB)
        for name in BACKENDS:
            (tmp / name).mkdir()
            for f in files:
                if f.suffix == ".py" and f.name != "model.py":
                    shutil.copy2(f, tmp / name / ("torchship_runtime.py" if f.name == "runtime.py" else f.name))
            if host == "stub":
                shutil.copy2(src / name / "model.py", tmp / name / "model.py")
            if host == "server":  # one library, linked under each backend's name: one interpreter for all
                (tmp / name / f"libtriton_{name}.so").symlink_to(Path("..") / INSERVER_LIB)
        (tmp / ".complete").touch()
        os.replace(tmp, root)
    except OSError:
        if not (root / ".complete").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # another process built it first, or the build failed
    return root


def resolve_python_host(host: str) -> tuple[str, str]:
    """(host, note): ``auto`` is ``server`` where the in-server backend builds and no GPU is visible, else
    ``stub`` with the reason (the in-server host has not been run against CUDA yet)."""
    if host != "auto":
        return host, ""
    if cuda_visible():
        return "stub", ("serving from python-backend stubs: the in-server host is not yet validated with CUDA "
                        "(--python-host server to use it anyway)")
    try:
        backend_dir("server")
        return "server", ""
    except ServerError as e:
        return "stub", f"serving from python-backend stubs: {str(e).splitlines()[0]}"


# What runs between fork and exec decides whether starting a child is safe in a process with threads at work
# (gRPC's pollers, a client's requests). A Popen preexec_fn makes Python fork() and run every at-fork handler
# that a native library registered, gRPC's among them: with requests in flight they can abort the child
# ("Fatal Python error: Aborted" in _execute_child), hang it, or close descriptors the parent's gRPC still
# polls. Without one, Popen uses vfork and runs none. So torchship never passes a preexec_fn: a child pinned
# to CPUs inherits the mask of the thread that starts it (``start_child``), and a child that must
# die with torchship asks for that itself, first thing. For the server binary a short Python trampoline does
# it and then execs the server: PR_SET_PDEATHSIG survives exec, and the pid stays the server's.
DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                   "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
                   "if os.getppid() != int(sys.argv[1]):  # torchship died before the request took hold\n"
                   "    sys.exit('torchship, which started this process, is gone')\n")
DIE_WITH_PARENT_AND_EXEC = DIE_WITH_PARENT + "os.execv(sys.argv[2], sys.argv[3:])\n"


def python_child(code: str, *args: str) -> list[str]:
    """argv for a short isolated Python child running ``code`` (which starts with DIE_WITH_PARENT): its
    argv[1] is this process's pid, then ``args``."""
    return [sys.executable, "-I", "-S", "-c", code, str(os.getpid()), *args]


def dying_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that Linux SIGTERMs it when torchship's process dies, so a killed client (SIGKILL, an
    unhandled SIGTERM) never leaves an orphaned server behind; off Linux, ``argv`` as it is (stop() in
    finally blocks is then the only guard). A program that is not there raises FileNotFoundError here, in
    this process, as Popen would, rather than in the trampoline."""
    if not sys.platform.startswith("linux"):
        return argv
    program = shutil.which(argv[0])
    if program is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
    return python_child(DIE_WITH_PARENT_AND_EXEC, program, *argv)


class CpusRefused(Exception):
    """Linux would not let a child start on the CPUs asked for; ``allowed`` is what the caller may use."""

    def __init__(self, allowed: set[int]):
        super().__init__(f"CPUs {cpu_list(allowed)} allowed")
        self.allowed = allowed


_starter_lock = threading.Lock()
_starter: Optional[tuple[int, queue.SimpleQueue]] = None  # (pid, its queue): a forked child needs its own


def _run_starts(jobs: queue.SimpleQueue) -> None:
    while True:
        fn, done = jobs.get()
        if done.set_running_or_notify_cancel():
            try:
                done.set_result(fn())
            except BaseException as e:
                done.set_exception(e)


def start_child(argv: list[str], cpus: Sequence[int] = (), **popen) -> subprocess.Popen:
    """``subprocess.Popen(argv, **popen)``, started from torchship's starter thread, a thread that lives as long
    as this process. Linux sends a child its PR_SET_PDEATHSIG when the *thread* that started it ends, not the
    process: a server or spinner started straight from a thread that then ends (a worker thread, a request
    handler) was SIGTERMed at once. The child begins on ``cpus``, else on the CPUs of the calling thread, as if
    that thread had started it. Raises CpusRefused if Linux will not allow ``cpus``."""
    global _starter
    if not hasattr(os, "sched_setaffinity"):  # not Linux: no death signal to tie to a thread, and no pins
        return subprocess.Popen(argv, **popen)
    allowed = os.sched_getaffinity(0)
    mask = set(cpus) or allowed

    def start() -> subprocess.Popen:
        before = os.sched_getaffinity(0)
        try:
            os.sched_setaffinity(0, mask)  # Linux keeps a mask per thread; the child inherits this one
        except OSError:
            raise CpusRefused(allowed) from None
        try:
            return subprocess.Popen(argv, **popen)
        finally:
            os.sched_setaffinity(0, before)

    with _starter_lock:
        if _starter is None or _starter[0] != os.getpid():
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_run_starts, args=(jobs,), name="torchship-starter", daemon=True).start()
            _starter = (os.getpid(), jobs)
        jobs = _starter[1]
    done: concurrent.futures.Future = concurrent.futures.Future()
    jobs.put((start, done))
    try:
        return done.result()
    except BaseException:  # the start failed (nothing to end), or a Ctrl-C came: end the child once it is up
        done.add_done_callback(_end_started)
        raise


def _end_started(done: concurrent.futures.Future) -> None:
    if done.exception() is None:
        proc = done.result()
        proc.kill()
        proc.wait()


CPU_LATENCY_DEVICE = "/dev/cpu_dma_latency"


class CpuLatencyRequest:
    """A PM QoS request: while the file stays open, Linux keeps idle CPUs in states that wake within
    ``us`` microseconds. On a virtual machine a halted vCPU is slow to wake, and a served request
    wakes several sleeping threads in turn (client, gRPC frontend, scheduler, model instance, stub)."""

    def __init__(self, us: int, device: str = CPU_LATENCY_DEVICE):
        import struct

        try:
            self.fd = os.open(device, os.O_WRONLY)
        except OSError as e:
            raise ServerError(f"--cpu-latency-us needs write access to {device} ({e.strerror}); run as root, "
                              "or leave it unset") from None
        os.write(self.fd, struct.pack("i", us))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# One spinner, in a session of its own. It asks to die with torchship (whose pid is argv[1]). Linux's
# autogroups share CPU time between sessions before it looks at a task's policy, so it then gives its
# session's group the lowest weight (nice 19: where autogroups are off, or in a container's cgroup, the write
# is harmless), then itself SCHED_IDLE, then pins itself to the CPU in argv[2], says so, and yields in a loop:
# whenever the scheduler hands it the CPU while real work waits (a tick inside a long model run), it hands
# it straight back.
SPINNER = (DIE_WITH_PARENT +
           "try:\n"
           "    with open('/proc/self/autogroup', 'w') as f:\n"
           "        f.write('19')\n"
           "except OSError:\n"
           "    pass\n"
           "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
           "os.sched_setaffinity(0, {int(sys.argv[2])})\n"
           "print('spinning', flush=True)\n"
           "y = os.sched_yield\n"
           "while True:\n"
           "    y()\n")


class IdleSpinners:
    """Keeps ``cpus`` from going idle without root: one process per CPU, pinned there at SCHED_IDLE, the
    lowest priority Linux has, spins for as long as this object is open. Any other thread that wakes on
    that CPU preempts it at once and gets all but a sliver of the CPU, so it costs no throughput; what it
    saves is the halt: on a virtual machine a vCPU with nothing to run halts, and the thread woken there
    next (a request's model instance, the gRPC thread with its reply) waits for the vCPU and then finds
    cold caches. A rootless stand-in for CpuLatencyRequest(0) on the CPUs that serve, at the price of
    those CPUs showing 100 % busy."""

    def __init__(self, cpus: Sequence[int]):
        flag = "--spin-cpus"
        self.procs: list[subprocess.Popen] = []
        if not hasattr(os, "SCHED_IDLE"):
            raise ServerError(f"{flag} needs Linux's SCHED_IDLE scheduling class, which this system lacks")
        check_affinity(cpus, flag, cpu_list(cpus))
        try:
            for cpu in cpus:
                # its own session, so a Ctrl-C at the terminal reaches torchship only, which stops it
                proc = start_child(python_child(SPINNER, str(cpu)), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True)
                self.procs.append(proc)
                said = proc.stdout.readline()
                if said != b"spinning\n":  # it died setting itself up; its last line says why
                    proc.wait()
                    why = proc.stderr.read().decode(errors="replace").strip().splitlines() or ["no message"]
                    raise ServerError(f"{flag}: the spinner for CPU {cpu} exited with code {proc.returncode}: {why[-1]}")
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()  # nothing to finish: it only spins
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        self.procs = []


class KeepAwake:
    """What serve and bench hold while they measure or serve, so that a request does not wait for an idle
    CPU to wake: a /dev/cpu_dma_latency request of ``latency_us`` (root) and spinners on ``spin_cpus``
    (any user); either may be absent."""

    def __init__(self, latency_us: Optional[int], spin_cpus: Sequence[int]):
        self.spinners: Optional[IdleSpinners] = None
        self.latency = CpuLatencyRequest(latency_us) if latency_us is not None else None
        try:
            self.spinners = IdleSpinners(spin_cpus) if spin_cpus else None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for held in (self.latency, self.spinners):
            if held is not None:
                held.close()


def check_affinity(cpus: Sequence[int], flag: str, spec: str) -> None:
    """Raise ServerError naming ``flag`` and what the user wrote (``spec``) if Linux would not run a thread on ``cpus``."""
    refused = affinity_refused(cpus)
    if refused:
        raise ServerError(f"{flag} {spec}: Linux refused to run a thread on CPUs {cpu_list(cpus)} ({refused}); choose "
                          "CPUs in this container's or cgroup's CPU set")


def affinity_refused(cpus: Sequence[int]) -> Optional[str]:
    """Why Linux would refuse to run a thread on ``cpus`` (None if it would not), asked by a throwaway
    thread, since an affinity call pins only the calling thread: taskset's mask on this process does not
    bind the server's model threads, a cgroup's CPU set does."""
    why: list[str] = []

    def probe() -> None:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            why.append(e.strerror or str(e))
    t = threading.Thread(target=probe, name="torchship-affinity-probe")
    t.start()
    t.join()
    return why[0] if why else None


def server_env() -> dict[str, str]:
    """LD_LIBRARY_PATH for the wheel's libraries; this environment's bin/ first on PATH, because the
    stub's embedded Python adopts the virtual environment found there (it ignores PYTHONPATH)."""
    import numpy

    if int(numpy.__version__.split(".")[0]) >= 2:
        raise ServerError(f"numpy {numpy.__version__} is installed; the Triton Python stub needs numpy<2 "
                          "(with numpy 2 every response comes back empty): pip install 'numpy<2'")
    _, libs = triton_home()
    env = child_env(dict(os.environ))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(libs), env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(Path(sys.prefix) / "bin"), env.get("PATH", "")))
    env.pop("PYTHONPATH", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    # for the in-server backend's embedded interpreter: this Python's home and import path
    env["TORCHSHIP_PYTHON_HOME"] = sys.base_prefix
    env["TORCHSHIP_SYS_PATH"] = os.pathsep.join(p for p in sys.path if p and Path(p).is_dir())
    return env


class TritonServer:
    """Start/stop the embedded server. Use as a context manager; ``url`` is the gRPC address."""

    def __init__(self, cfg: ServeConfig, extra_repos: list[str | Path] = ()):
        self.cfg = cfg
        self.extra_repos = [Path(r).resolve() for r in extra_repos]
        self.repo = Path(cfg.repo).resolve()
        if not self.repo.is_dir():
            raise ServerError(f"repository {self.repo} does not exist (build one with torchship repo)")
        names = list(cfg.models) or self.repository_models()  # the models start() will load
        if not names:
            hint = ("it is an export directory: build a repository from it with torchship repo "
                    f"{cfg.repo} --out model_repository" if (self.repo / "manifest.json").exists()
                    else "build one with torchship repo EXPORT_DIR")
            raise ServerError(f"{self.repo} holds no model (no <model>/config.pbtxt); {hint}")
        self.check_configs(names)
        flags = {"--grpc-port": cfg.grpc_port, "--http-port": cfg.http_port, "--metrics-port": cfg.metrics_port}
        given = [p for p in flags.values() if p]
        for flag, port in flags.items():
            if port and given.count(port) > 1:
                same = " and ".join(f for f, p in flags.items() if p == port)
                raise ServerError(f"{same} are both {port}; each endpoint needs its own port")
            if port and port_in_use(cfg.host, port):
                raise ServerError(f"{flag} {port}: {cfg.host}:{port} is already in use; choose another port, "
                                  "or leave the flag out to pick a free one")
        self.given = {flag for flag, port in flags.items() if port}  # the rest are picked, and picked again if taken
        picked = iter(free_ports(cfg.host, 3 - len(given), avoid=given))
        self.ports = {flag: port or next(picked) for flag, port in flags.items()}  # by the flag that sets each
        self.proc: Optional[subprocess.Popen] = None
        # without cfg.log, start() makes the log a temp file, removed after a clean stop and kept (and named)
        # after a failure
        self.log_path: Optional[Path] = Path(cfg.log) if cfg.log else None
        self._keep_log = bool(cfg.log)
        self.loaded: list[str] = []
        self.stop_note: Optional[str] = None  # set by stop() when it had to cut the shutdown short
        self._log_start = 0  # where this start's lines begin in the log
        self.awake: Optional[KeepAwake] = None  # held from start to stop
        self.python_host, self.python_host_note = resolve_python_host(cfg.python_host)
        self.cpus: list[int] = parse_cpus(cfg.cpus) if cfg.cpus else []  # [] : inherit this process's CPUs
        # Triton pins each KIND_CPU instance's thread (and what it starts: stubs, runtime threads) to this range
        self.model_cpus: list[int] = parse_cpu_range(cfg.model_cpus) if cfg.model_cpus else []
        self.spin_cpus: list[int] = parse_cpus(cfg.spin_cpus, "--spin-cpus") if cfg.spin_cpus else []
        if self.model_cpus:
            check_affinity(self.model_cpus, "--model-cpus", cfg.model_cpus)

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

    def command(self) -> list[str]:
        home, _ = triton_home()
        cmd = [str(home / "bin" / "tritonserver"), f"--model-repository={self.repo}",
               *[f"--model-repository={r}" for r in self.extra_repos],
               f"--backend-directory={backend_dir(self.python_host)}", "--model-control-mode=explicit",
               f"--grpc-address={self.cfg.host}", f"--grpc-port={self.grpc_port}",
               f"--http-address={self.cfg.host}", f"--http-port={self.http_port}",
               f"--metrics-address={self.cfg.host}", f"--metrics-port={self.metrics_port}",
               "--allow-gpu-metrics=false", "--exit-on-error=false", "--strict-readiness=true",
               f"--exit-timeout-secs={EXIT_TIMEOUT_S}", "--log-verbose=0", f"--cache-directory={home / 'caches'}"]
        if not cuda_visible():
            cmd += ["--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0"]
        if self.model_cpus:  # "cpu" is the host policy Triton gives every KIND_CPU instance by default
            cmd.append(f"--host-policy=cpu,cpu-cores={self.model_cpus[0]}-{self.model_cpus[-1]}")
        if self.cfg.trace_file:
            cmd += [f"--trace-config=triton,file={Path(self.cfg.trace_file).resolve()}", "--trace-config=level=TIMESTAMPS",
                    "--trace-config=rate=1", "--trace-config=count=-1", "--trace-config=log_frequency=0"]
        return cmd

    def log_tail(self, lines: int = 25) -> str:
        """The end of the server log, for an error message: the log is then kept, and its path ends the tail."""
        if self.log_path is None:  # never started
            return "(no server log)"
        self._keep_log = True
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no server log)"
        keep = [l for l in text if "CudaDriverHelper" not in l]
        return "\n".join(keep[-lines:] + [f"(full log: {self.log_path})"])

    def start(self) -> "TritonServer":
        """Start the server, load every model (or cfg.models) and wait until all are ready.
        Raises ServerError with the tail of the server log on failure. A port this server picked that
        another process takes before Triton binds it is picked again, up to PORT_ATTEMPTS starts."""
        if self.running:
            raise ServerError(f"this server is already running (pid {self.proc.pid}, gRPC at {self.url}); stop() it "
                              "before starting it again")
        attempt = 1
        while True:
            try:
                return self._start_once()
            except Exception:
                flag = self.port_taken()
                if flag is None:
                    raise
                port = self.ports[flag]
                if flag in self.given or attempt == PORT_ATTEMPTS:
                    why = ("it was taken after the check at start-up; choose another port, or leave the flag out "
                           "to pick a free one" if flag in self.given else
                           f"another process took each port picked for it, {PORT_ATTEMPTS} times")
                    raise ServerError(f"{flag} {port}: {self.cfg.host}:{port} is already in use: {why} "
                                      f"(server log: {self.log_path})") from None
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
        self.ports[flag] = free_ports(self.cfg.host, 1, avoid=list(self.ports.values()))[0]
        if not self.cfg.log:
            self.log_path.unlink(missing_ok=True)
            self.log_path, self._keep_log = None, False
        self.proc, self.loaded, self.stop_note = None, [], None

    def _start_once(self) -> "TritonServer":
        env = server_env()
        if self.cfg.backend_profile:
            env["TORCHSHIP_BACKEND_PROFILE"] = str(Path(self.cfg.backend_profile).resolve())
        if self.log_path is None:
            self.log_path = Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
        log = open(self.log_path, "ab")
        self._log_start = log.seek(0, os.SEEK_END)  # a given log may hold earlier runs' lines
        awake: Optional[KeepAwake] = None
        try:
            awake = KeepAwake(self.cfg.cpu_latency_us, self.spin_cpus)
            try:  # every thread Triton starts inherits the mask it begins with
                self.proc = start_child(dying_with_parent(self.command()), self.cpus, stdout=log,
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)
            except CpusRefused as e:
                # no flag named: the pin comes from serve --cpus, bench --server-cpus or run's serve.cpus
                raise ServerError(f"Linux refused to run the server on CPUs {cpu_list(self.cpus)}: this process may "
                                  f"use CPUs {cpu_list(e.allowed)} (a container or cgroup may allow fewer than the "
                                  "machine has); pin it to those") from None
        except BaseException:
            if awake is not None:
                awake.close()
            if not self._keep_log:  # nothing ran, so the empty temp log tells nothing
                self.log_path.unlink(missing_ok=True)
            raise
        finally:
            log.close()
        self.awake = awake
        deadline = time.monotonic() + self.cfg.ready_timeout
        try:
            client = self._client()
            while True:
                if self.proc.poll() is not None:
                    raise ServerError(f"tritonserver exited with code {self.proc.returncode} during start-up:\n{self.log_tail()}")
                try:  # a bounded wait: a port taken by something that is not a gRPC server never answers
                    if (client.is_server_live(client_timeout=1.0)  # and it is this server that answers
                            and listens_on(self.proc.pid, self.grpc_port) is not False):
                        break
                except Exception:
                    pass
                if time.monotonic() > deadline:
                    raise ServerError(f"tritonserver not live after {self.cfg.ready_timeout:.0f}s:\n{self.log_tail()}")
                time.sleep(0.1)
            names = list(self.cfg.models or self.repository_models())
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:  # loads overlap their imports
                for f in [pool.submit(self.load, n, None, deadline) for n in names]:
                    f.result()
            self.loaded.sort()
            return self
        except BaseException:
            self.stop()
            raise

    def check_configs(self, names: Sequence[str]) -> None:
        """Parse the config of each model in ``names`` (its embedded.pbtxt where it has one, as load() does,
        else its config.pbtxt), so that a broken one is named with its line, and one that asks for GPU
        instances on a machine without a CUDA GPU is refused, before the server starts (Triton itself only
        logs either among its start-up lines)."""
        from google.protobuf.text_format import ParseError
        from tritonclient.grpc import model_config_pb2 as mc

        for name in names:
            path = served_config_path(self.repo / name)
            try:
                config = read_config(path)
            except FileNotFoundError:
                continue  # an unknown model: Triton's own load error names it
            except (ParseError, UnicodeDecodeError) as e:
                raise ServerError(f"{path}: {str(e).rstrip('.')}; fix it, or build the repository again with torchship "
                                  "repo") from None
            if any(g.kind == mc.ModelInstanceGroup.KIND_GPU for g in config.instance_group) and not cuda_visible():
                raise ServerError(f"model {name} asks for GPU instances (KIND_GPU in {path}) and no CUDA GPU is visible "
                                  "here; build the repository again with torchship repo EXPORT_DIR --instance-kind cpu, "
                                  "or serve it on a machine with a GPU")

    def repository_models(self) -> list[str]:
        return repository_models(self.repo)

    def load(self, name: str, client=None, deadline: float | None = None, override=None) -> None:
        """Load (or reload) one model: with ``override`` (a ModelConfig) if given, else with
        embedded.pbtxt where the repository has one, else with its config.pbtxt."""
        from tritonclient.utils import InferenceServerException

        client = client or self._client()
        path = served_config_path(self.repo / name)
        if override is None and path.name == EMBEDDED_CONFIG:  # Triton reads config.pbtxt itself
            override = read_config(path)
        config = json_format.MessageToJson(override) if override is not None else None
        try:
            client.load_model(name, config=config)
        except InferenceServerException as e:
            raise ServerError(f"model {name} failed to load: {e.message()}\n{self.log_tail()}") from None
        while not client.is_model_ready(name):
            if deadline and time.monotonic() > deadline:
                raise ServerError(f"model {name} not ready in time:\n{self.log_tail()}")
            time.sleep(0.05)
        if name not in self.loaded:
            self.loaded.append(name)

    def _client(self):
        import tritonclient.grpc as grpcclient

        return grpcclient.InferenceServerClient(self.url)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (Triton drains in-flight requests), then SIGKILL the group if it hangs, or once every
        request is answered and a model still will not unload (``stop_note`` then says which)."""
        if self.awake is not None:
            self.awake.close()
            self.awake = None
        if self.proc is None or self.proc.poll() is not None:
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
                    if stuck:
                        log.seek(0)
                        self.stop_note = (stall_note(loaded_models(log.read().decode(errors="replace"))
                                                     or [f"{stuck} model(s)"]) + f" (server log: {self.log_path})")
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(10)
                    break
        # stub processes share the server's process group; make sure none outlives it
        try:
            os.killpg(self.proc.pid, 0)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.returncode == 0 and not self._keep_log:
            self.log_path.unlink(missing_ok=True)
        return self.proc.returncode

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> "TritonServer":
        return self if self.running else self.start()  # `with TritonServer(cfg).start() as s:` starts one

    def __exit__(self, *exc) -> None:
        self.stop()


def unload_stalled(log: str) -> int:
    """How many models are still live after ``UNLOAD_STALL_TICKS`` unchanged reports once every request has
    been answered, from what Triton logged after SIGTERM; 0 while the shutdown still makes progress."""
    mark = log.find("All models are stopped, unloading models")
    if mark < 0:
        return 0
    live = [int(n) for n in re.findall(r"Found (\d+) live models and 0 in-flight non-inference requests", log[mark:])]
    if len(live) < UNLOAD_STALL_TICKS or len(set(live[-UNLOAD_STALL_TICKS:])) > 1:
        return 0
    return live[-1]


def loaded_models(log: str) -> list[str]:
    """The models that the log shows loaded and not unloaded since."""
    state: dict[str, bool] = {}
    for verb, name in re.findall(r"successfully (loaded|unloaded) '([^']+)'", log):
        state[name] = verb == "loaded"
    return sorted(n for n, up in state.items() if up)


def stall_note(models: list[str]) -> str:
    return (f"{', '.join(models)} still loaded at {UNLOAD_STALL_TICKS} checks in a row (one a second) after every "
            f"request was answered, so the server was killed rather than left to its {EXIT_TIMEOUT_S} s exit "
            "timeout. Triton 2.51 keeps a model loaded for good once the first request of a gRPC stream was "
            "refused for it (a wrong shape, dtype or input name); unary calls, and refusals later in a stream, do "
            "not")


def describe(server: TritonServer) -> dict:
    return {"grpc": server.url, "python_host": server.python_host, "http": f"{server.cfg.host}:{server.http_port}", "metrics": server.metrics_url,
            "models": server.loaded, "log": str(server.log_path), "pid": server.proc.pid if server.proc else None,
            "cpus": server_cpus(server), "model_cpus": server.model_cpus,
            "spin_cpus": server.spin_cpus}


def server_cpus(server: TritonServer) -> list[int]:
    """The CPUs the running server may use, as Linux reports them for its process ([] once it has exited)."""
    try:
        return sorted(os.sched_getaffinity(server.proc.pid)) if server.proc else []
    except OSError:
        return []

