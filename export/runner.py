"""Fresh-process artifact runner: ``python -m torchship.export.runner SPEC.json`` loads one artifact the way a
deployment would and writes its outputs on the reference inputs (the verifier compares them).

``python -m torchship.export.runner --host IDLE_S [MODULE ...]`` imports torch and each MODULE once, then runs
each request read from stdin (one JSON line: the spec path and the environment) in a child forked for it, and
answers each with the child's exit code (negative: the signal that killed it). The child is a process of its own
that holds nothing of the export; only the imports are shared. The host exits at the end of its input, or after
IDLE_S seconds without a request."""

from __future__ import annotations

import faulthandler
import json
import os
import select
import signal
import sys
import traceback
from pathlib import Path

import numpy as np

from torchship.errors import first_line
from torchship.procfs import own_peak_rss_bytes


def main(spec_path: str) -> int:
    faulthandler.enable()  # a crash in native code leaves its Python stack in the log (fresh.crash_site)
    spec = json.loads(Path(spec_path).read_text())
    from torchship import runtime

    d = Path(spec["export_dir"])
    a = spec["artifact"]
    result: dict = {"ok": False}
    try:
        r = runtime.load_artifact(
            str(d), a, spec["inputs"], spec["outputs"], device=spec["device"], threads=spec["threads"]
        )
        result["input_names"] = r.input_names
        result["output_names"] = r.output_names
        ref = np.load(d / spec["reference"])
        outs = {}
        names = spec["inputs"]
        for key in spec["sets"]:
            got = runtime.in_chunks(
                lambda xs: list(r.run(dict(zip(names, xs))).values()),
                [ref[f"input/{key}/{n}"] for n in names],
                spec["max_batch"],
            )
            for name, out in zip(spec["outputs"], got):
                outs[f"{key}/{name}"] = out
        np.savez(spec["out"], **outs)
        result["ok"] = True
        result["peak_rss_bytes"] = own_peak_rss_bytes()  # loading and running it
    except Exception as e:  # reported to the verifier as this artifact's failure
        result["error"] = first_line(e)
        result["traceback"] = traceback.format_exc()[-4000:]
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


def _child(spec_path: str, env: dict[str, str]) -> int:
    """In the forked child: the request's environment, stdin closed, stdout and stderr to the spec's log,
    Ctrl-C as in any process."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(spec_path + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        return main(spec_path)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stderr.flush()


def host(idle_s: float, preload: list[str]) -> int:
    """Answer each spec path on stdin with the exit code of a child forked to run it; see the module's doc."""
    import importlib

    import torch  # noqa: F401  (the import every child shares; AOTInductor's loader needs no more: runtime.load_aoti)

    for name in preload:  # what the children's loader imports (runtime.LOADER_MODULES)
        try:
            importlib.import_module(name)
        except ImportError:  # another torch: each child imports what its loader needs, as without a preload
            pass

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C ends the verifier, and its end ends this host
    stdin = sys.stdin.buffer.raw
    while select.select([stdin], [], [], idle_s)[0]:
        line = stdin.readline()
        if not line.strip():
            return 0
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os._exit(_child(request["spec"], request["env"]))
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        sys.stdout.write(f"{code}\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--host":
        code = host(float(sys.argv[2]), sys.argv[3:])
        sys.stdout.flush()
        os._exit(code)  # it holds nothing to save: no teardown of torch and its loaders (0.5 to 1 s of CPU)
    sys.exit(main(sys.argv[1]))
