"""Starting the server process: free ports, and children that die with torchship."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence

from torchship.procfs import cmdline, processes, resident_bytes


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


# A Popen preexec_fn makes Python fork() and run every at-fork handler a native library registered, gRPC's
# among them, which can abort the child while requests are in flight. Without one, Popen uses vfork and
# runs none. So a child that must die with torchship asks for that itself: a short Python trampoline sets
# PR_SET_PDEATHSIG (which survives exec) and then execs the server, whose pid stays the same.
DIE_WITH_PARENT_AND_EXEC = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):  # torchship died before the request took hold\n"
    "    sys.exit('torchship, which started this process, is gone')\n"
    "os.execv(sys.argv[2], sys.argv[3:])\n"
)


def dying_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that Linux SIGTERMs it when torchship's process dies, so a killed client never leaves
    an orphaned server behind; off Linux, ``argv`` as it is. A program that is not there raises
    FileNotFoundError here, as Popen would."""
    if not sys.platform.startswith("linux"):
        return argv
    program = shutil.which(argv[0])
    if program is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
    return [sys.executable, "-I", "-S", "-c", DIE_WITH_PARENT_AND_EXEC, str(os.getpid()), program, *argv]


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


def start_child(argv: list[str], **popen) -> subprocess.Popen:
    """``subprocess.Popen(argv, **popen)`` from a thread that lives as long as this process. Linux sends a
    child its PR_SET_PDEATHSIG when the *thread* that started it ends: a server started straight from a
    worker thread that then ends was SIGTERMed at once."""
    global _starter
    if not sys.platform.startswith("linux"):
        return subprocess.Popen(argv, **popen)
    with _starter_lock:
        if _starter is None or _starter[0] != os.getpid():
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_run_starts, args=(jobs,), name="torchship-starter", daemon=True).start()
            _starter = (os.getpid(), jobs)
        jobs = _starter[1]
    done: concurrent.futures.Future = concurrent.futures.Future()
    jobs.put((lambda: subprocess.Popen(argv, **popen), done))
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


STUB = "triton_python_backend_stub"


def stub_processes(server_pid: int) -> dict[tuple[str, str], set[int]]:
    """(model folder name, version) -> pids of the server's live stub processes for it (a stub's first argument
    is the model file, REPO/<model>/<version>/<file>)."""
    out: dict[tuple[str, str], set[int]] = {}
    for p in processes():
        if p.ppid != server_pid or p.state == "Z":  # not the server's child, or dead and not yet reaped
            continue
        argv = cmdline(p.pid)
        if len(argv) > 1 and argv[0].endswith(STUB):
            path = Path(argv[1])
            out.setdefault((path.parents[1].name, path.parent.name), set()).add(p.pid)
    return out


def instance_memory(server_pid: int, models: Sequence[str]) -> dict[str, int]:
    """model -> resident bytes of its backend processes (Triton's Python stubs, one per instance and version)."""
    out: dict[str, int] = {}
    for (model, _), pids in stub_processes(server_pid).items():
        if model in models:
            out[model] = out.get(model, 0) + sum(resident_bytes(pid) for pid in pids)
    return out
