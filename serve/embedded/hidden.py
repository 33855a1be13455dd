"""Arguments the server takes that no other user of the machine may read (the control key): handed to
tritonserver around its command line, which /proc shows to everyone, by a small preloaded library."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).with_name("hidden_args.c")
ARGS_ENV = "TORCHSHIP_HIDDEN_ARGS"  # read by hidden_args.c


def shim(folder: Path) -> Optional[Path]:
    """hidden_args.c built into ``folder`` (a private folder of this user's), once per source; None where no C
    compiler is found or the build fails."""
    source = SOURCE.read_bytes()
    out = folder / f"hidden-args-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if out.exists():
        return out
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    fd, tmp = tempfile.mkstemp(prefix=".hidden-args-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        r = subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE), "-ldl"], capture_output=True, text=True
        )
        if r.returncode != 0:
            return None
        os.replace(tmp, out)
        return out
    finally:
        Path(tmp).unlink(missing_ok=True)


def hide(args: list[str], folder: Path, env: dict[str, str]) -> tuple[list[str], Optional[Path]]:
    """Arrange for tritonserver to receive ``args`` without them showing in its command line: they go into a
    file only this user can read (removed by the server once read), and ``env`` gets the preloaded library
    that hands them over. Returns (what is still to be added to the command line, the file); where no C
    compiler can build the library, ``args`` themselves, with one line on stderr saying what that exposes."""
    lib = shim(folder)
    if lib is None:
        print(
            "torchship serve: no C compiler (cc) here to build the helper that keeps the control key out of the "
            "process list, so tritonserver's command line carries it and other users of this machine can read it "
            "there; install one (apt-get install gcc) to keep it private",
            file=sys.stderr,
            flush=True,
        )
        return list(args), None
    fd, path = tempfile.mkstemp(prefix=".server-args-", dir=folder)  # mode 600
    with os.fdopen(fd, "w") as f:
        f.write("".join(a + "\n" for a in args))
    env["LD_PRELOAD"] = " ".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    env[ARGS_ENV] = path
    return [], Path(path)
