"""Healing the embedded server: a model whose backend process died is unloaded (so that it reports not ready,
and a load balancer routes away from it) and loaded again.

Triton's Python backend runs each model instance in a stub process. When one dies (killed, out of memory, a
crash inside a runtime), Triton keeps reporting the model ready while every request to it fails with "Stub
process ... is not healthy". A watcher thread compares each loaded model version's stub processes with those
it saw before: a stub gone with no new one in its place, while Triton still calls that version ready, is a
death. A model Triton logged loading or unloading in the last few seconds is being reloaded (its old stubs
stop on their own), a version that still has a stub for each instance its config asks for is ending a reload
(the old stubs can outlive the settling time on a busy machine), and a version Triton no longer calls ready was
unloaded (a rollout): all are left alone. Listing the server's processes reads every process on the machine, so
between lifecycle lines and while every stub it knows of lives, the watcher lists them only every RESCAN_S."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Callable

from torchship.procfs import state

from .process import stub_processes

SETTLE_S = 3.0  # after Triton logs a (re)load or unload of a model, its stubs may come and go this long
RESCAN_S = 5.0  # while nothing changes, how often the server's processes are listed anew (a stub that dies is seen
# at the next tick: only new ones, which come with a lifecycle line, could otherwise wait this long)
LIFECYCLE = re.compile(r'"(?:loading: ([^:"]+):\d+|successfully (?:un)?loaded \'([^\']+)\')')


class Healer(threading.Thread):
    """Watches ``server`` (a started TritonServer) every ``interval`` seconds and heals its loaded models."""

    def __init__(self, server, interval: float = 0.5, log: Callable[[str], None] = print):
        super().__init__(name="torchship-healer", daemon=True)
        self.server, self.interval, self.log = server, interval, log
        self.known: dict[tuple[str, str], set[int]] = {}
        self.busy: dict[str, float] = {}  # model -> when Triton last logged loading or unloading it
        self.log_offset = server.log_path.stat().st_size if server.log_path and server.log_path.exists() else 0
        self.heals: list[dict] = []
        self.halt = threading.Event()
        self.heals_file = Path(f"{server.log_path}.heals.json") if server.log_path else None
        self.scanned: tuple[float, frozenset[str]] = (-RESCAN_S, frozenset())  # when the last listing was, of what

    def run(self) -> None:
        client = self.server.client()
        while not self.halt.wait(self.interval):
            proc = self.server.proc
            if proc is None or proc.poll() is not None:  # the server is gone (stopped, or killed): nothing to heal
                return
            try:
                self.tick(client)
            except Exception as e:  # the watcher must outlive a failed check; the next tick tries again
                if proc.poll() is None and not self.halt.is_set():  # a server going away is not news
                    self.log(f"heal: check failed ({type(e).__name__}: {e})")

    def note_reloads(self) -> None:
        """Note the models Triton logged loading or unloading since the last look."""
        try:
            with open(self.server.log_path, "rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace")
                self.log_offset = f.tell()
        except OSError:
            return
        for m in LIFECYCLE.finditer(text):
            self.busy[m.group(1) or m.group(2)] = time.monotonic()

    def unchanged(self, loaded: frozenset[str]) -> bool:
        """Whether this tick may skip listing the server's processes: the last listing is under RESCAN_S old and
        was of the same loaded models, none of them is settling, and every stub it found is still alive."""
        now = time.monotonic()
        at, then = self.scanned
        return (
            now - at < RESCAN_S
            and loaded == then
            and all(now - t >= SETTLE_S for t in self.busy.values())
            and all(state(pid) not in ("", "Z") for pids in self.known.values() for pid in pids)
        )

    def tick(self, client) -> None:
        self.note_reloads()
        loaded = frozenset(self.server.loaded)
        if self.unchanged(loaded):
            return
        self.scanned = (time.monotonic(), loaded)
        live = stub_processes(self.server.proc.pid)
        for key in sorted(set(live) | set(self.known)):
            model, version = key
            if model not in loaded:
                continue
            pids, known = live.get(key, set()), self.known.get(key)
            if time.monotonic() - self.busy.get(model, -SETTLE_S) < SETTLE_S:  # being (re)loaded: take what is there
                if pids:
                    self.known[key] = pids
                else:
                    self.known.pop(key, None)
                continue
            if known is None or pids - known:  # first seen, or reloaded: the new stubs replace the old ones
                if pids:
                    self.known[key] = pids if known is None else pids - known
                continue
            dead = known - pids
            if not dead or self.halt.is_set():
                continue
            if not client.ready(model, version):  # unloaded on purpose
                self.known.pop(key, None)
                continue
            if len(pids) >= instances(client, model, version):  # a reload's old stubs leaving late
                self.known[key] = pids
                continue
            self.heal(client, model, sorted(dead))
        for model in loaded - {m for m, _ in live} - {m for m, _ in self.known}:  # no stub at all: gone while settling
            if (
                time.monotonic() - self.busy.get(model, -SETTLE_S) >= SETTLE_S
                and not self.halt.is_set()
                and client.config(model).get("platform") != "ensemble"
                and client.ready(model)
            ):
                self.heal(client, model, [])  # (an ensemble runs in no process of its own: nothing to heal)

    def heal(self, client, model: str, dead: list[int]) -> None:
        t0 = time.monotonic()
        self.log(
            f"heal: {model}'s backend process {', '.join(map(str, dead)) or 'is gone'}"
            f"{' died' if dead else ''}; reporting it not ready and loading it again"
        )
        client.unload(model)
        while client.ready(model) and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        for key in [k for k in self.known if k[0] == model]:
            self.known.pop(key)
        self.server.load(model, client, time.monotonic() + 60)
        self.busy[model] = time.monotonic()  # its new stubs settle in
        entry = {
            "model": model,
            "dead_pids": dead,
            "seconds": round(time.monotonic() - t0, 2),
            "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        self.heals.append(entry)
        line = f"healed {model} in {entry['seconds']:.1f} s (heal {len(self.heals)} of this server)"
        self.log(line)
        if self.heals_file:
            self.heals_file.write_text(json.dumps({"heals": len(self.heals), "events": self.heals}, indent=2) + "\n")
            with open(self.server.log_path, "a") as f:  # beside Triton's own lines
                f.write(f"torchship: {line}\n")

    def stop(self) -> None:
        self.halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)


def instances(client, model: str, version: str) -> int:
    """How many backend processes the loaded config of ``model`` asks for (one per instance)."""
    config = client.config(model, version, fresh=True)
    return sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
