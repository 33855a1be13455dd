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

from torchship.errors import ServerError

SOURCE = Path(__file__).with_name("hidden_args.c")
ARGS_ENV = "TORCHSHIP_HIDDEN_ARGS"  # read by hidden_args.c
USER_PRELOAD_ENV = "TORCHSHIP_USER_PRELOAD"  # the user's own LD_PRELOAD, put back by hidden_args.c for the children


def shim(folder: Path) -> tuple[Optional[Path], str]:
    """(hidden_args.c built into ``folder``, a private folder of this user's, once per source; "") or, where it
    cannot be built, (None, why in words)."""
    source = SOURCE.read_bytes()
    out = folder / f"hidden-args-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if out.exists():
        return out, ""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None, "no C compiler (cc) is here to build"
    fd, tmp = tempfile.mkstemp(prefix=".hidden-args-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        r = subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE), "-ldl"], capture_output=True, text=True
        )
        if r.returncode != 0:
            said = next((line.strip() for line in r.stderr.splitlines() if "error" in line), r.stderr.strip())
            return None, f"the C compiler {cc} failed to build ({said[:200] or f'exit code {r.returncode}'})"
        os.replace(tmp, out)
        return out, ""
    finally:
        Path(tmp).unlink(missing_ok=True)


def hide(
    args: list[str], folder: Path, env: dict[str, str], exposed_ok: bool = False
) -> tuple[list[str], Optional[Path]]:
    """Arrange for tritonserver to receive ``args`` without them showing in its command line: they go into a
    file only this user can read (removed by the server once read), and ``env`` gets the preloaded library
    that hands them over. Returns (what is still to be added to the command line, the file). Where no C
    compiler can build the library, ServerError saying what fixes it; with ``exposed_ok`` (the user's
    --key-on-command-line), ``args`` themselves instead, with one line on stderr saying what that exposes.
    The user's own LD_PRELOAD reaches the server's children as it was."""
    lib, why = shim(folder)
    if lib is None:
        if not exposed_ok:
            raise ServerError(
                f"{why} the helper that keeps the control key out of the process list, where every user of this "
                "machine can read it; install a C compiler (apt-get install gcc), or pass --key-on-command-line "
                "to start with the key readable there (on a machine no one else uses)"
            )
        print(
            f"torchship serve: {why} the helper that keeps the control key out of the process list; "
            "--key-on-command-line: tritonserver's command line carries it, and other users of this machine can "
            "read it there",
            file=sys.stderr,
            flush=True,
        )
        return list(args), None
    fd, path = tempfile.mkstemp(prefix=".server-args-", dir=folder)  # mode 600
    with os.fdopen(fd, "w") as f:
        f.write("".join(a + "\n" for a in args))
    env[USER_PRELOAD_ENV] = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = " ".join(p for p in (str(lib), env[USER_PRELOAD_ENV]) if p)
    env[ARGS_ENV] = path
    return [], Path(path)


def check_restricted(client) -> None:
    """ServerError unless the server behind ``client`` (a TritonClient) refuses a control call made without its
    key: the restriction did not take effect (the preloaded helper skipped, say), and the server must not serve."""
    from dataclasses import replace

    from torchship.errors import AccessError

    from ..client import TritonClient

    keyless = TritonClient(client.url, timeout_s=10.0, access=replace(client.access, key=None))
    try:
        keyless.repository_index()
    except AccessError:
        return
    finally:
        keyless.close()
    raise ServerError(
        f"the server at {client.url} answered a control call without its key: the restriction on model control "
        "did not take effect (were the server's hidden arguments lost on the way, LD_PRELOAD skipped?); "
        "it was stopped rather than served open"
    )
