"""A model's config files in a repository: config.pbtxt (what the official container reads) and, where the embedded
server needs another, embedded.pbtxt; read, printed, and edited in one place."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

CONFIG = "config.pbtxt"
EMBEDDED_CONFIG = "embedded.pbtxt"  # the embedded server's config, where the container's cannot run there
CONFIGS = (CONFIG, EMBEDDED_CONFIG)
TENSOR_NAMES = "torchship_tensor_names"  # parameter: JSON {served name: manifest name}, where a config renames tensors


def read_config(path: str | Path) -> mc.ModelConfig:
    return text_format.Parse(Path(path).read_text(), mc.ModelConfig())


def config_text(c: mc.ModelConfig) -> str:
    return text_format.MessageToString(c)


def repository_models(repo: str | Path) -> list[str]:
    """The models of a repository folder: its subfolders with a config.pbtxt, sorted."""
    return sorted(p.name for p in Path(repo).iterdir() if (p / CONFIG).exists())


def versions(model_dir: str | Path) -> list[int]:
    """The version folders of a model on disk, in order."""
    return sorted(int(p.name) for p in Path(model_dir).iterdir() if p.is_dir() and p.name.isdigit())


def manifest_names(config: dict) -> dict[str, str]:
    """{served name: manifest name} for a model whose config renames its tensors (TENSOR_NAMES; ``config`` in
    Triton's JSON form, as a server reports it); empty where the served names are the manifest's."""
    p = (config.get("parameters") or {}).get(TENSOR_NAMES)
    return json.loads(p["string_value"]) if p else {}


def live_version(model_dir: Path) -> int:
    """The version unversioned requests reach: the highest the config's version policy names, else the highest on
    disk."""
    c = read_config(model_dir / CONFIG)
    on_disk = versions(model_dir)
    if c.version_policy.WhichOneof("policy_choice") == "specific" and c.version_policy.specific.versions:
        return max(c.version_policy.specific.versions)
    return on_disk[-1]


def served_config_path(model_dir: str | Path, live: Optional[dict] = None) -> Path:
    """The config a server loads a model with: the embedded server its embedded.pbtxt where it has one, else its
    config.pbtxt. ``live``: the model's config as a running server reports it (JSON), for a server that may be
    either: one that runs config.pbtxt's platform (the official container's torch_aoti, which the embedded server
    has not) is handed config.pbtxt."""
    d = Path(model_dir)
    if not (d / EMBEDDED_CONFIG).exists():
        return d / CONFIG
    platform = read_config(d / CONFIG).platform
    return d / CONFIG if live is not None and platform and live.get("platform") == platform else d / EMBEDDED_CONFIG


def edit_configs(
    model_dir: str | Path, edit: Callable[..., None], into: Optional[str | Path] = None, per_file: bool = False
) -> list[Path]:
    """Apply ``edit`` to each config of the model in ``model_dir`` (config.pbtxt, and embedded.pbtxt where it has
    one) and write them into ``into`` (default: the same folder), both or neither: each is written to a
    temporary file first and renamed over its file only once both are written. ``per_file``: ``edit`` takes the
    file's name (CONFIG or EMBEDDED_CONFIG) too. Returns the files written."""
    src, dest = Path(model_dir), Path(into or model_dir)
    staged: list[tuple[str, Path]] = []
    try:
        for name in CONFIGS:
            if (src / name).exists():
                c = read_config(src / name)
                edit(c, name) if per_file else edit(c)
                fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=dest)
                with os.fdopen(fd, "w") as f:
                    f.write(config_text(c))
                    f.flush()
                    os.fsync(f.fileno())
                staged.append((tmp, dest / name))
        for tmp, path in staged:
            os.replace(tmp, path)
    finally:
        for tmp, _ in staged:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return [path for _, path in staged]


DTYPES = {
    "float32": mc.TYPE_FP32,
    "float16": mc.TYPE_FP16,
    "float64": mc.TYPE_FP64,
    "int64": mc.TYPE_INT64,
    "int32": mc.TYPE_INT32,
    "int16": mc.TYPE_INT16,
    "int8": mc.TYPE_INT8,
    "uint8": mc.TYPE_UINT8,
    "bool": mc.TYPE_BOOL,
}


def config_dims(spec: dict[str, Any]) -> list[int]:
    """A tensor's dims without the batch, as config.pbtxt takes them: -1 for a dynamic one."""
    return [d if isinstance(d, int) else -1 for d in spec["shape"][1:]]


def served_dims(spec: dict[str, Any]) -> list[int]:
    """config_dims, with [1] for a tensor of one value per request (a detector's count), which Triton needs dims
    for; the model's own config reshapes it from the [batch] the model makes."""
    return config_dims(spec) or [1]


def aoti_tensor_names(manifest: dict[str, Any]) -> dict[str, str]:
    """The names the official container's PyTorch backend gives an AOTInductor package's tensors (26.05 on: read
    from the package's call specification), by the manifest's: the forward's positional arguments ARGS[0],
    ARGS[1], ...; its result RESULT, or RESULT[0], RESULT[1], ... for several outputs (returned as a tuple)."""
    outs = manifest["outputs"]
    return {
        **{t["name"]: f"ARGS[{i}]" for i, t in enumerate(manifest["inputs"])},
        **{t["name"]: "RESULT" if len(outs) == 1 else f"RESULT[{i}]" for i, t in enumerate(outs)},
    }
