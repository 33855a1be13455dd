"""Fresh processes for the verifier: each artifact runs in a process of its own. One that torch runs is
forked by a host that has imported torch once (``python -m torchship.export.runner --host``), so that a second
artifact does not pay the import; one that ONNX Runtime runs starts its own interpreter (it needs no torch,
and its memory figure then holds none).

A host serves one request at a time; the verifier's threads each take a free host or start one. Each child
runs under the environment of its request. A host is reused only from the same working folder, with the same
variables that an import can read (IMPORT_ENV) and the same modules imported beside torch (what the artifact's
loader imports: runtime.LOADER_MODULES, so that each child does not import it again while the others' children
hold none of it), and exits by itself after IDLE_S seconds without a request, or when ``close_all`` (run at this
process's exit) closes its stdin."""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

IDLE_S = 120.0  # a host not asked for this long exits; the next artifact starts another
# the variables read while python, torch and their libraries are imported: a host started under others is not reused
IMPORT_ENV = ("PYTHON", "LD_", "OMP_", "KMP_", "MKL", "OPENBLAS", "TORCH", "PYTORCH", "CUDA", "NVIDIA", "PATH", "HOME")


def import_env(env) -> tuple:
    """``env``'s variables that an import can read (IMPORT_ENV), sorted: what a process that imported torch keeps of
    the environment it started in."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_ENV)))


_free: dict[tuple, list[_Host]] = {}
_lock = threading.Lock()


class HostError(RuntimeError):
    """The host ended without answering (its stderr's last line in the message)."""


class _Host:
    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = ()):
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torchship.export.runner", "--host", str(IDLE_S), *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
        )

    def run(self, spec_path: Path, env: dict[str, str]) -> int:
        try:
            self.proc.stdin.write(json.dumps({"spec": str(spec_path), "env": env}) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            answer = ""
        if not answer:
            lines = self.close().strip().splitlines()
            raise HostError(f"the runner's host {exit_text(self.proc.returncode)}: {lines[-1] if lines else ''}")
        return int(answer)

    def end(self) -> None:
        """Ask the host to end: it exits at the end of its input."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass  # the host is gone already

    def close(self) -> str:
        """End the host, wait for it, and return what it wrote to stderr."""
        self.end()
        self.proc.wait()
        if self.log.closed:  # closed before
            return ""
        self.log.seek(0)
        text = self.log.read().decode(errors="replace")
        self.log.close()
        return text


def exit_text(code: int | None) -> str:
    """A child's return code in words: "exited 3", or "was killed by SIGSEGV" for a signal (a crash in native code)."""
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (a crash inside the runtime)"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited {code}"


def crash_site(output: str) -> str:
    """Where a child that crashed in native code was, from the Python stack faulthandler wrote to its log (the
    runner enables it): "in _load_aoti (.../_package.py:1045)", the innermost frame; "" where none was written."""
    for line in output.splitlines():
        m = re.match(r'\s+File "(.+)", line (\d+) in (\S+)', line)
        if m:  # faulthandler lists the most recent call first
            path, lineno, func = m.groups()
            return f"in {func} ({'/'.join(Path(path).parts[-2:])}:{lineno})"
    return ""


def _take(key: tuple) -> _Host | None:
    """A pooled host of ``key`` that is still running, if any (those that exited are reaped)."""
    with _lock:
        pool = _free.get(key, [])
        while pool:
            host = pool.pop()
            if host.proc.poll() is None:
                return host
            host.close()
    return None


def run_fresh(
    spec_path: Path, env: dict[str, str], torch_runs_it: bool = True, preload: tuple[str, ...] = ()
) -> tuple[int, str]:
    """Run ``torchship.export.runner``'s ``main(spec_path)`` in a fresh process under ``env`` (forked from a host when
    ``torch_runs_it``, one that imported ``preload`` beside torch); return its exit code (negative: the signal that
    killed it) and its output (stdout and stderr together). Raises HostError if the host ends without answering."""
    if not torch_runs_it:
        proc = subprocess.run(
            [sys.executable, "-m", "torchship.export.runner", str(spec_path)], capture_output=True, text=True, env=env
        )
        return proc.returncode, proc.stdout + proc.stderr
    key = (import_env(env), os.getcwd(), tuple(preload))
    for host in (_take(key), None):  # a pooled host may have exited, idle, just before this request: start one
        fresh = host is None
        host = host or _Host(env, tuple(preload))
        try:
            code = host.run(spec_path, env)
        except HostError:
            if fresh:
                raise
            continue
        with _lock:
            _free.setdefault(key, []).append(host)
        log = Path(f"{spec_path}.log")
        return code, log.read_text(errors="replace") if log.exists() else ""
    raise AssertionError("unreachable")


@atexit.register
def close_all() -> None:
    """End every idle host and wait for it, so that none outlives this process (nor is left unreaped)."""
    with _lock:
        hosts = [h for pool in _free.values() for h in pool]
        _free.clear()
    for h in hosts:  # all asked first, so that they end side by side
        h.end()
    for h in hosts:
        h.close()
