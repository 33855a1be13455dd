"""Crash-safe file writes (temporary file, fsync, rename) and content hashes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from .runtime import sha256_file  # noqa: F401  (one definition, which the serving backends carry too)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], mode: int = 0o644) -> Path:
    """Call ``write(tmp_path)`` then rename the result onto ``path``, with permissions ``mode`` (the
    temporary file is readable by this user alone until then).

    A crash (or exception) inside ``write`` leaves any previous file at ``path`` untouched
    and removes the temporary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, mode: int = 0o644) -> Path:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    return atomic_write(path, write, mode)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(
    path: str | os.PathLike, error: type[Exception], fmt: str | None = None, missing: str | None = None, fix: str = ""
) -> dict[str, Any]:
    """The JSON object in the file at ``path``. Raises ``error`` naming the file when it is missing
    (``missing`` is then the whole message), unreadable, not JSON, not an object, or (with ``fmt``) not
    tagged ``"format": fmt``; ``fix`` is appended to the last three messages."""
    p = Path(path)
    if not p.is_file():
        raise error(missing or f"{p} does not exist or is not a file")
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{p} is corrupt ({e}){fix}") from None
    if not isinstance(obj, dict):
        raise error(f"{p} is corrupt (a JSON {type(obj).__name__}, not an object){fix}")
    if fmt is not None and obj.get("format") != fmt:
        raise error(f"{p}: unknown format {obj.get('format')!r} (expected {fmt}){fix}")
    return obj


def check_out_dir(out: str | os.PathLike, overwrite: bool, error: type[Exception]) -> Path:
    """Refuse ``out``, raising ``error``, when it is a file, or, without ``overwrite``, a directory that
    already holds something: what a stage writes through staging_dir may replace it only when asked."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise error(f"{p} is a file, and --out takes a directory to write; choose another --out")
    if p.is_dir() and not overwrite and any(p.iterdir()):
        raise error(f"{p} already exists; pass --overwrite to replace it, or choose another --out")
    return p


@contextmanager
def staging_dir(final: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Build a directory under a temporary name, then rename it to ``final`` on success.

    On error the staging directory is removed and ``final`` is left as it was. With
    ``overwrite`` an existing ``final`` is replaced only after the new one is complete.
    """
    final = Path(final)
    if final.exists() and not final.is_dir():
        raise NotADirectoryError(f"{final} is a file; a directory would replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    os.chmod(tmp, 0o755)
    try:
        yield tmp
        if final.exists():
            if not overwrite:
                raise FileExistsError(final)
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def git_revision(cwd: str | os.PathLike | None = None) -> str | None:
    """The current git commit of the source tree, or None outside a checkout."""
    here = cwd or Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    rev = out.stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=5
    ).stdout.strip()
    return rev + ("-dirty" if dirty else "")
