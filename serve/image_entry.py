"""The image entry of a repository: ``<name>_image`` takes an encoded image file (JPEG, PNG, WebP, ...) as a
UINT8 vector of its bytes, and answers as the model does. It is a Triton ensemble of two models:
``<name>_image_pre``, a python-backend model that decodes and prepares the image as training did
(torchship/imageio.py, carried beside it), then the model itself. Triton's image_client and other tensor
clients keep the model's own tensor entry."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from torchship.errors import ConfigError
from torchship.io import atomic_write_text, sha256_file
from torchship.runtime import PROVENANCE

from .model_config import CONFIG, DTYPES, config_dims, config_text, read_config

IMAGE_INPUT = "image"  # the entry's input: the file's bytes
ENTRY_SUFFIX, PRE_SUFFIX = "_image", "_image_pre"
SOURCES = Path(__file__).resolve().parent / "backends"
ROOT = Path(__file__).resolve().parents[1]
CARRIED = {"model.py": SOURCES / "image" / "model.py", "torchship_imageio.py": ROOT / "torchship" / "imageio.py",
           "torchship_tensors.py": SOURCES / "torchship_tensors.py"}


def entry_names(export_name: str) -> tuple[str, str]:
    """(the image entry, its preprocessing model) of an export."""
    return export_name + ENTRY_SUFFIX, export_name + PRE_SUFFIX


def is_image_model(manifest: dict[str, Any]) -> bool:
    """One input, and the image preprocessing its training recorded."""
    return bool(manifest.get("preprocessing")) and len(manifest["inputs"]) == 1


def wants_image_entry(manifest: dict[str, Any], asked: bool | None) -> bool:
    """Whether the repository serves the image entry: as asked, else (None) wherever the export is an image model."""
    return is_image_model(manifest) if asked is None else asked


def check_image_model(manifest: dict[str, Any]) -> None:
    """ConfigError unless the export is an image model: one float input, and the preprocessing its training
    recorded."""
    if not is_image_model(manifest):
        raise ConfigError(f"--image-entry: {manifest['name']} is not an image model (its manifest records no image "
                          "preprocessing, or it has more than one input); build the repository without it")


MAX_PRE_INSTANCES = 8  # each a process of its own; decoding costs a small part of what the model does


def write_image_entry(repo: Path, manifest: dict[str, Any], target: str, max_batch: int, version: int,
                      cores: int = 1) -> list[str]:
    """Write the entry and its preprocessing model into ``repo``, in front of the model ``target``; returns
    their names. The preprocessing decodes one image at a time per instance: one instance per core given (at
    most MAX_PRE_INSTANCES)."""
    check_image_model(manifest)
    entry, pre_name = entry_names(manifest["name"])
    tensor = manifest["inputs"][0]
    chw = [int(d) for d in tensor["shape"][1:]]

    pre = mc.ModelConfig(name=pre_name, backend="python", max_batch_size=max_batch)
    pre.input.add(name=IMAGE_INPUT, data_type=mc.TYPE_UINT8, dims=[-1], allow_ragged_batch=True)
    pre.output.add(name=tensor["name"], data_type=mc.TYPE_FP32, dims=chw)
    pre.dynamic_batching.SetInParent()
    pre.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=max(1, min(cores, MAX_PRE_INSTANCES)))
    pre.parameters["preprocessing"].string_value = json.dumps(manifest["preprocessing"])
    vdir = repo / pre_name / str(version)
    vdir.mkdir(parents=True)
    for name, src in CARRIED.items():
        shutil.copy2(src, vdir / name)
    (vdir / PROVENANCE).write_text(json.dumps({"files": {n: sha256_file(vdir / n) for n in CARRIED}}, indent=2) + "\n")
    (repo / pre_name / CONFIG).write_text(config_text(pre))

    ens = mc.ModelConfig(name=entry, platform="ensemble", max_batch_size=max_batch)
    ens.input.add(name=IMAGE_INPUT, data_type=mc.TYPE_UINT8, dims=[-1])
    for o in manifest["outputs"]:
        ens.output.add(name=o["name"], data_type=DTYPES[o["dtype"]], dims=config_dims(o))
    if manifest.get("classes"):  # top-k with class names, as the model's own entry answers
        ens.output[0].label_filename = "labels.txt"
        (repo / entry).mkdir()
        (repo / entry / "labels.txt").write_text("\n".join(manifest["classes"]) + "\n")
    first = ens.ensemble_scheduling.step.add(model_name=pre_name, model_version=-1)
    first.input_map[IMAGE_INPUT] = IMAGE_INPUT
    first.output_map[tensor["name"]] = "pixels"
    second = ens.ensemble_scheduling.step.add(model_name=target, model_version=-1)
    second.input_map[tensor["name"]] = "pixels"
    for o in manifest["outputs"]:
        second.output_map[o["name"]] = o["name"]
    (repo / entry / str(version)).mkdir(parents=True, exist_ok=True)
    (repo / entry / CONFIG).write_text(config_text(ens))
    return [pre_name, entry]


def entry_target(config: dict[str, Any]) -> str | None:
    """The model an image entry runs behind its preprocessing, from its config as Triton serves it (JSON); None
    for a config that is no such ensemble."""
    steps = config.get("ensemble_scheduling", {}).get("step", [])
    return steps[-1].get("model_name") if steps else None


def retarget(repo: Path, export_name: str, target: str) -> bool:
    """Point the image entry of ``export_name`` in ``repo`` (where it has one) at the model ``target``."""
    path = repo / entry_names(export_name)[0] / CONFIG
    if not path.exists():
        return False
    c = read_config(path)
    c.ensemble_scheduling.step[1].model_name = target
    # Triton refuses an ensemble that batches beyond a model in it: the winner may batch less than the first target
    c.max_batch_size = min(c.max_batch_size, read_config(repo / target / CONFIG).max_batch_size)
    atomic_write_text(path, config_text(c))
    return True
