"""Reading Triton's log after SIGTERM: whether the unload stalled, which models stayed loaded, and the note
that says so."""

from __future__ import annotations

import re

EXIT_TIMEOUT_S = 20  # Triton's own limit for draining and unloading after SIGTERM
# Once SIGTERM's drain is over, Triton unloads every model and reports the ones still live once a second; on a
# busy machine Python stubs took over 5 s, and with two threads each beside other servers over 10 s, to stop; a stall is
# called at three quarters of Triton's own limit.
UNLOAD_STALL_TICKS = 15


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


def live_at_exit(log: str) -> int:
    """How many models Triton last reported live while unloading after SIGTERM (0 where it never did)."""
    mark = log.find("All models are stopped, unloading models")
    live = re.findall(r"Found (\d+) live models", log[mark:]) if mark >= 0 else []
    return int(live[-1]) if live else 0


def loaded_models(log: str) -> list[str]:
    """The models that the log shows loaded and not unloaded since."""
    state: dict[str, bool] = {}
    for verb, name in re.findall(r"successfully (loaded|unloaded) '([^']+)'", log):
        state[name] = verb == "loaded"
    return sorted(n for n, up in state.items() if up)


def stall_note(models: list[str], killed: bool = True) -> str:
    how = (
        f"at {UNLOAD_STALL_TICKS} checks in a row (one a second) after every request was answered, so the "
        f"server was killed rather than left to its {EXIT_TIMEOUT_S} s exit timeout"
        if killed
        else f"when Triton's {EXIT_TIMEOUT_S} s exit timeout ran out"
    )
    return (
        f"{', '.join(models)} still loaded {how}. Triton 2.51 keeps a model loaded for good once the first "
        "request of a gRPC stream was refused for it (a wrong shape, dtype or input name); unary calls, and "
        "refusals later in a stream, do not"
    )
