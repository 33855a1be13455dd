"""The Triton server inside the nvidia-pytriton wheel: where it is, the backend directory it serves
torchship's Python-based backends from, and the environment it needs."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import stat
import sys
import sysconfig
import tempfile
from pathlib import Path

import torchship
from torchship.errors import ServerError

from ..access import KEY_ENVS

BACKENDS_SRC = Path(__file__).resolve().parents[1] / "backends"
RUNTIME_SRC = Path(torchship.__file__).resolve().parent / "runtime.py"
# Python-based stand-ins for Triton's native backends the wheel lacks, and torchship's no-op model
BACKENDS = ("onnxruntime", "pytorch", "torchship")


def triton_home() -> tuple[Path, Path]:
    """(pytriton/tritonserver directory, nvidia_pytriton.libs directory) from the installed wheel."""
    spec = importlib.util.find_spec(
        "pytriton"
    )  # located, not imported: its Python API and its dependencies are not used
    if spec is None or not spec.origin:
        raise ServerError(
            "the embedded Triton server comes from the nvidia-pytriton wheel: pip install --no-deps "
            "nvidia-pytriton==0.7.0 (without its dependencies: its Python API, which torchship does not "
            "use, asks for numpy<2), or install requirements.lock"
        )
    pkg = Path(spec.origin).resolve().parent
    home, libs = pkg / "tritonserver", pkg.parent / "nvidia_pytriton.libs"
    if not (home / "bin" / "tritonserver").exists():
        raise ServerError(f"no tritonserver binary under {home}; reinstall nvidia-pytriton")
    return home, libs


def backend_dir() -> Path:
    """A backend directory: Triton's python backend with the stub for this Python, and torchship's
    Python-based backends (one model.py each, run by that stub). Built once per content hash and reused."""
    home, _ = triton_home()
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = home / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.exists():
        raise ServerError(f"the Triton Python stub has no build for Python {ver}; use Python 3.11, 3.12 or 3.13")
    shared = [
        BACKENDS_SRC / "torchship_backend.py",
        BACKENDS_SRC / "torchship_stub.py",
        BACKENDS_SRC / "torchship_tensors.py",
        RUNTIME_SRC,
    ]
    files = shared + [BACKENDS_SRC / b / "model.py" for b in BACKENDS]
    h = hashlib.sha256(sys.version.encode())
    for f in files + [stub]:
        h.update(f.read_bytes())
    root = private_dir() / h.hexdigest()[:16]
    if (root / ".complete").exists():
        return root
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root.parent))
    try:
        (tmp / "python").mkdir()
        for f in (home / "backends" / "python").iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / "python" / f.name)
        shutil.copy2(stub, tmp / "python" / "triton_python_backend_stub")
        for name in BACKENDS:
            (tmp / name).mkdir()
            for f in shared:  # the stub imports torchship.runtime under the name torchship_runtime
                shutil.copy2(f, tmp / name / ("torchship_runtime.py" if f == RUNTIME_SRC else f.name))
            shutil.copy2(BACKENDS_SRC / name / "model.py", tmp / name / "model.py")
        (tmp / ".complete").touch()
        os.replace(tmp, root)
    except OSError:
        if not (root / ".complete").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # another process built it first, or the build failed
    return root


def private_dir() -> Path:
    """This user's folder for what the server runs (the backends, the helper of hidden.py, the file that hands
    the key over), under the temp folder: created mode 700, closed to others where only they could read it, and
    refused where it is another user's or others could write to it, since code put there runs inside the
    server."""
    d = Path(tempfile.gettempdir()) / f"torchship-backends-{os.getuid()}"
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = d.lstat()
    mine = stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
    if mine and stat.S_IMODE(info.st_mode) & 0o077 and not stat.S_IMODE(info.st_mode) & 0o022:
        d.chmod(0o700)  # ours, and no one else could have put anything in it: closed to others from now on
        info = d.lstat()
    if not mine or stat.S_IMODE(info.st_mode) & 0o077:
        raise ServerError(
            f"{d} holds the code the server runs, and it is not this user's alone (owner uid "
            f"{info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}); remove it, or set TMPDIR to a private "
            "folder"
        )
    return d


def python_libdir() -> str:
    """The folder holding this interpreter's shared libpython, or "" where it has none."""
    libdir, name = sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("INSTSONAME") or ""
    return libdir if name and (Path(libdir) / name).is_file() else ""


def server_env() -> dict[str, str]:
    """LD_LIBRARY_PATH for the wheel's libraries and this interpreter's libpython (the stub links it; a
    Python built apart from the system's, as pyenv's or conda's, keeps it where no loader looks); this
    environment's bin/ first on PATH, because the stub's embedded Python adopts the virtual environment
    found there (it ignores PYTHONPATH)."""
    _, libs = triton_home()
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(libs), python_libdir(), env.get("LD_LIBRARY_PATH", "")) if p
    )
    env["PATH"] = os.pathsep.join((str(Path(sys.prefix) / "bin"), env.get("PATH", "")))
    env.pop("PYTHONPATH", None)
    for name in KEY_ENVS:  # the server has its key from its arguments; the backends run model code
        env.pop(name, None)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
