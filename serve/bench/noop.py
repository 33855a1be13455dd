"""The no-op model: the export's tensors in and zeros out, on the same backend host as the real models, so
the bench can time the round trip of the protocol and the backend alone."""

from __future__ import annotations

import shutil
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ..model_config import CONFIG, DTYPES, config_dims, config_text

NOOP_MODEL = "_torchship_noop"


def noop_repo(out: Path, manifest: dict) -> Path:
    """A repository with one model of the export's tensors that answers zeros without running anything,
    on the same backend host as the real models, batched as they are: the round trip of the protocol alone."""
    root = out / "noop_repo"
    mdir = root / NOOP_MODEL
    if mdir.exists():
        shutil.rmtree(mdir)
    (mdir / "1").mkdir(parents=True)
    c = mc.ModelConfig(name=NOOP_MODEL, backend="torchship", max_batch_size=manifest["max_batch"])
    for t in manifest["inputs"]:
        c.input.add(name=t["name"], data_type=DTYPES[t["dtype"]], dims=config_dims(t))
    for t in manifest["outputs"]:
        c.output.add(name=t["name"], data_type=DTYPES[t["dtype"]], dims=config_dims(t))
    c.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
    c.dynamic_batching.SetInParent()  # batched as the served models are, so its ceiling at many in flight is theirs
    (mdir / CONFIG).write_text(config_text(c))
    return root
