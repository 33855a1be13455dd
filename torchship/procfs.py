"""What Linux's /proc says of processes: each one's parent, state and resident memory, a process tree's total,
and a sampler of its peak. Where there is no /proc, there is nothing to read: empty answers, zeros."""

from __future__ import annotations

import os
import threading
from typing import Iterator, NamedTuple


class Proc(NamedTuple):
    pid: int
    ppid: int
    state: str  # R, S, D, Z (dead, not yet reaped), ...
    rss_bytes: int
    cpu_s: float  # user and system CPU seconds used so far


def processes() -> Iterator[Proc]:
    """Every process /proc lists now (those that end while it is read are skipped)."""
    page, tick = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_CLK_TCK")
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for d in names:
        if not d.isdigit():
            continue
        try:
            fields = _stat(int(d))
            yield Proc(
                int(d), int(fields[1]), fields[0], int(fields[21]) * page, (int(fields[11]) + int(fields[12])) / tick
            )
        except (OSError, IndexError, ValueError):
            continue


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command's name: state, parent, ... (OSError if it is gone)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def cmdline(pid: int) -> list[str]:
    """A process's argv ([] if it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return []


def state(pid: int) -> str:
    """A process's state letter (R, S, D, Z: dead, not yet reaped, ...), or "" if it is gone."""
    try:
        return _stat(pid)[0]
    except (OSError, IndexError):
        return ""


def resident_bytes(pid: int) -> int:
    """A process's resident memory in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def own_peak_rss_bytes() -> int:
    """This process's peak resident memory in bytes, its own: Linux's VmHWM. (getrusage's ru_maxrss of a
    process started by fork and exec keeps the parent's peak when that was larger.) 0 if unknown."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0


def tree(root: int) -> list[Proc]:
    """``root`` and all its live descendants, as /proc lists them now."""
    children: dict[int, list[Proc]] = {}
    found: dict[int, Proc] = {}
    for p in processes():
        children.setdefault(p.ppid, []).append(p)
        found[p.pid] = p
    out, stack = [], [found[root]] if root in found else []
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children.get(p.pid, []))
    return out


def tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and all its descendants together."""
    return sum(p.rss_bytes for p in tree(root))


def tree_cpu(root: int) -> dict[int, float]:
    """CPU seconds (user and system) each of ``root`` and its live descendants has used so far, by pid ({}
    where /proc is not)."""
    return {p.pid: p.cpu_s for p in tree(root)}


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds a process tree used between two tree_cpu readings: each live process's growth (all of it, for
    one started since). A process that ended between them takes its last part with it; none counts below 0."""
    return sum(max(0.0, s - before.get(pid, 0.0)) for pid, s in after.items())


class RssSampler:
    """Peak resident memory of a process (``root``, default this one) and all its descendants together,
    sampled every ``interval`` seconds while in its with block."""

    def __init__(self, interval: float = 0.25, root: int | None = None):
        self.peak = 0
        self.root = root or os.getpid()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, args=(interval,), daemon=True)

    def _loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak = max(self.peak, tree_rss(self.root))

    def __enter__(self) -> RssSampler:
        if os.path.isdir("/proc"):
            self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
