"""The raw entries of a repository, which take what users send and answer as the model does: ``<name>_image``
takes an encoded image file (JPEG, PNG, WebP, ...) and ``<name>_text`` a text, each as a UINT8 vector of its
bytes (UTF-8 for text). Each is a Triton ensemble of two models: ``<name>_image_pre`` (``<name>_text_pre``), a
python-backend model that prepares the input as training did (torchship/imageio.py, or the export's tokenizer
with torchship/textio.py, carried beside it), then the model itself. Triton's image_client and other tensor
clients keep the model's own tensor entry."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

import torchship
from torchship.errors import ConfigError
from torchship.imageio import MAX_BYTES, MAX_PIXELS
from torchship.io import atomic_write_text, sha256_file
from torchship.runtime import PROVENANCE
from torchship.tasks import task_of

from .model_config import (
    CONFIG,
    DTYPES,
    EMBEDDED_CONFIG,
    TENSOR_NAMES,
    config_text,
    edit_configs,
    live_version,
    read_config,
    repository_models,
    served_config_path,
    served_dims,
)

IMAGE_INPUT = "image"  # the image entry's input: the file's bytes
TEXT_INPUT = "text"  # the text entry's input: the text's UTF-8 bytes
ENTRY_SUFFIX, PRE_SUFFIX, POST_SUFFIX = "_image", "_image_pre", "_image_post"
PICTURE_SIZE = "picture_size"  # a detector's image entry: the picture's width and height, from pre to post
MODEL_STEP = 1  # an entry's ensemble steps: its preprocessing, the model, and a detector's boxes mapped back
MODEL_OUT = "answer_"  # a detector's outputs inside its image entry, before their boxes are mapped back
TEXT_SUFFIX, TEXT_PRE_SUFFIX = "_text", "_text_pre"
SOURCES = Path(__file__).resolve().parent / "backends"
CONTRACTS = Path(torchship.__file__).resolve().parent  # where torchship/imageio.py and its like are installed
CARRIED = {
    "model.py": SOURCES / "image" / "model.py",
    "torchship_imageio.py": CONTRACTS / "imageio.py",
    "torchship_tensors.py": SOURCES / "torchship_tensors.py",
}
POST_CARRIED = {  # a detector's image entry, last step: boxes back in the picture's pixels
    "model.py": SOURCES / "boxes" / "model.py",
    "torchship_boxes.py": CONTRACTS / "boxes.py",
    "torchship_tensors.py": SOURCES / "torchship_tensors.py",
}
TEXT_CARRIED = {
    "model.py": SOURCES / "text" / "model.py",
    "torchship_textio.py": CONTRACTS / "textio.py",
    "torchship_tensors.py": SOURCES / "torchship_tensors.py",
}


@dataclass(frozen=True)
class Entry:
    """An export's raw entry: its kind ("image" or "text"), its name, its preprocessing model and its input."""

    kind: str
    name: str
    pre: str
    input: str


def entry_names(export_name: str) -> tuple[str, str]:
    """(the image entry, its preprocessing model) of an export."""
    return export_name + ENTRY_SUFFIX, export_name + PRE_SUFFIX


def entry_of(manifest: dict[str, Any]) -> Entry | None:
    """The raw entry an export's repository serves where asked: the text entry where the export keeps a
    tokenizer, the image entry for an image model, else None."""
    name = manifest["name"]
    if manifest.get("text"):
        return Entry("text", name + TEXT_SUFFIX, name + TEXT_PRE_SUFFIX, TEXT_INPUT)
    if is_image_model(manifest):
        return Entry("image", name + ENTRY_SUFFIX, name + PRE_SUFFIX, IMAGE_INPUT)
    return None


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
        raise ConfigError(
            f"--image-entry: {manifest['name']} is not an image model (its manifest records no image "
            "preprocessing, or it has more than one input); build the repository without it"
        )


MAX_PRE_INSTANCES = 8  # each a process of its own; decoding costs a small part of what the model does


def write_image_entry(
    repo: Path, manifest: dict[str, Any], target: str, max_batch: int, version: int, cores: int = 1
) -> list[str]:
    """Write the image entry and its preprocessing model into ``repo``, in front of the model ``target``; returns
    their names. The preprocessing decodes one image at a time per instance: one instance per core given (at
    most MAX_PRE_INSTANCES)."""
    check_image_model(manifest)
    entry = entry_of(manifest)
    tensor = manifest["inputs"][0]
    limits = {"max_pixels": str(MAX_PIXELS), "max_bytes": str(MAX_BYTES)}  # editable in its config.pbtxt
    pre = _pre_config(entry, max_batch, cores, {"preprocessing": json.dumps(manifest["preprocessing"]), **limits})
    pre.output.add(name=tensor["name"], data_type=mc.TYPE_FP32, dims=[int(d) for d in tensor["shape"][1:]])
    maps_back = task_of(manifest).maps_back  # a detector's boxes, mapped back to the picture by a last step
    if maps_back:
        pre.output.add(name=PICTURE_SIZE, data_type=mc.TYPE_INT64, dims=[2])
    _write_pre(repo, pre, version, CARRIED)
    if maps_back:
        _write_post(repo, manifest, entry, max_batch, version, cores)
    _write_ensemble(repo, manifest, entry, target, [tensor["name"]], max_batch, version)
    return [entry.pre, *([post_name(entry)] if maps_back else []), entry.name]


def _write_post(repo: Path, manifest: dict[str, Any], entry: Entry, max_batch: int, version: int, cores: int) -> None:
    """A detector's last step: its outputs and the picture's size in, the boxes in the picture's pixels out."""
    post = mc.ModelConfig(name=post_name(entry), backend="python", max_batch_size=max_batch)
    post.dynamic_batching.SetInParent()
    post.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=max(1, min(cores, MAX_PRE_INSTANCES)))
    post.parameters["letterbox_size"].string_value = str(manifest["detection"]["letterbox"]["size"])
    for o in manifest["outputs"]:
        post.input.add(name=o["name"], data_type=DTYPES[o["dtype"]], dims=served_dims(o))
        post.output.add(name=o["name"], data_type=DTYPES[o["dtype"]], dims=served_dims(o))
    post.input.add(name=PICTURE_SIZE, data_type=mc.TYPE_INT64, dims=[2])
    _write_pre(repo, post, version, POST_CARRIED)


def post_name(entry: Entry) -> str:
    """A detector's image entry's last step (boxes back in the picture's pixels)."""
    return entry.name.removesuffix(ENTRY_SUFFIX) + POST_SUFFIX


def write_text_entry(
    repo: Path, manifest: dict[str, Any], target: str, max_batch: int, version: int, export_dir: Path, cores: int = 1
) -> list[str]:
    """Write the text entry and its tokenizing model (which carries the export's tokenizer.json) into ``repo``,
    in front of the model ``target``; returns their names. Each text becomes [1, L] token tensors, L the
    padded length (torchship.textio.bucket), so requests of near lengths batch together in the model."""
    entry, spec = entry_of(manifest), manifest.get("text")
    if entry is None or not spec:
        raise ConfigError(f"--text-entry: {manifest['name']} keeps no tokenizer; export it with --tokenizer")
    per_token = [o["name"] for o in manifest["outputs"] if spec["dim"] in o["shape"]]
    if per_token:
        raise ConfigError(
            f"--text-entry: output {per_token[0]!r} runs along the sequence, whose padded length the "
            "server chooses; the text entry serves models whose outputs do not (build without it)"
        )
    names = [n for n in spec["inputs"].values() if n]
    pre = _pre_config(entry, max_batch, cores, {"text": json.dumps(spec)})
    for n in names:
        pre.output.add(name=n, data_type=DTYPES[spec["dtypes"][n]], dims=[-1])
    _write_pre(repo, pre, version, {**TEXT_CARRIED, "tokenizer.json": export_dir / spec["tokenizer"]})
    _write_ensemble(repo, manifest, entry, target, names, max_batch, version)
    return [entry.pre, entry.name]


def _pre_config(entry: Entry, max_batch: int, cores: int, params: dict[str, str]) -> mc.ModelConfig:
    """A preprocessing model's config, its outputs to add: the python backend, one request's bytes in (ragged),
    batched, one instance per core given (at most MAX_PRE_INSTANCES)."""
    pre = mc.ModelConfig(name=entry.pre, backend="python", max_batch_size=max_batch)
    pre.input.add(name=entry.input, data_type=mc.TYPE_UINT8, dims=[-1], allow_ragged_batch=True)
    pre.dynamic_batching.SetInParent()
    pre.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=max(1, min(cores, MAX_PRE_INSTANCES)))
    for k, v in params.items():
        pre.parameters[k].string_value = v
    return pre


def _write_pre(repo: Path, pre: mc.ModelConfig, version: int, carried: dict[str, Path]) -> None:
    """A preprocessing model's version folder (the files it carries, with their sha256) and config."""
    vdir = repo / pre.name / str(version)
    vdir.mkdir(parents=True)
    for name, src in carried.items():
        shutil.copy2(src, vdir / name)
    (vdir / PROVENANCE).write_text(json.dumps({"files": {n: sha256_file(vdir / n) for n in carried}}, indent=2) + "\n")
    (repo / pre.name / CONFIG).write_text(config_text(pre))


def _write_ensemble(
    repo: Path, manifest: dict[str, Any], entry: Entry, target: str, tensors: list[str], max_batch: int, version: int
) -> None:
    """The entry itself: an ensemble of its preprocessing model, whose outputs ``tensors`` are the model's inputs
    of those names, then ``target``."""
    ens = mc.ModelConfig(name=entry.name, platform="ensemble", max_batch_size=max_batch)
    ens.input.add(name=entry.input, data_type=mc.TYPE_UINT8, dims=[-1])
    for o in manifest["outputs"]:
        ens.output.add(name=o["name"], data_type=DTYPES[o["dtype"]], dims=served_dims(o))
    (repo / entry.name / str(version)).mkdir(parents=True, exist_ok=True)
    task = task_of(manifest)
    for key, value in task.label_parameters(manifest).items():  # what torchship infer names the labels by
        ens.parameters[key].string_value = value
    if manifest.get("classes") and task.labels_file:  # top-k with class names, as the model's own entry answers
        ens.output[0].label_filename = "labels.txt"
        (repo / entry.name / "labels.txt").write_text("\n".join(manifest["classes"]) + "\n")
    first = ens.ensemble_scheduling.step.add(model_name=entry.pre, model_version=-1)
    first.input_map[entry.input] = entry.input
    for t in tensors:
        first.output_map[t] = f"prepared_{t}"
    model = ens.ensemble_scheduling.step.add(model_name=target)  # put_behind names the target's live version
    for t in tensors:
        model.input_map[t] = f"prepared_{t}"
    for o in manifest["outputs"]:  # a detector's go on to the step that maps its boxes back
        model.output_map[o["name"]] = MODEL_OUT + o["name"] if task.maps_back else o["name"]
    if task.maps_back:
        first.output_map[PICTURE_SIZE] = PICTURE_SIZE
        post = ens.ensemble_scheduling.step.add(model_name=post_name(entry), model_version=-1)
        post.input_map[PICTURE_SIZE] = PICTURE_SIZE
        for o in manifest["outputs"]:
            post.input_map[o["name"]] = MODEL_OUT + o["name"]
            post.output_map[o["name"]] = o["name"]
    (repo / entry.name / CONFIG).write_text(config_text(ens))
    put_behind(repo / entry.name, repo, target)


def put_behind(entry_dir: Path, repo: Path, target: str) -> None:
    """Point the entry in ``entry_dir`` at ``target``: its config.pbtxt naming the target's tensors as the
    container's config of it does, and where those names are not the embedded server's, an embedded.pbtxt naming
    them as the embedded server's does (removed where they agree). Each file is whole at every step."""
    renames = bool(read_config(repo / target / CONFIG).parameters[TENSOR_NAMES].string_value)
    if renames and not (entry_dir / EMBEDDED_CONFIG).exists():
        atomic_write_text(entry_dir / EMBEDDED_CONFIG, (entry_dir / CONFIG).read_text())
    edit_configs(entry_dir, behind(repo, target), per_file=True)
    if (entry_dir / EMBEDDED_CONFIG).exists() and (entry_dir / EMBEDDED_CONFIG).read_text() == (
        entry_dir / CONFIG
    ).read_text():
        (entry_dir / EMBEDDED_CONFIG).unlink()


def behind(repo: Path, target: str):
    """The edit of an entry's configs that puts ``target`` behind its preprocessing, at its live version, each config
    (the container's config.pbtxt, the embedded server's embedded.pbtxt) naming the target's tensors as that
    server's config of the target does: the container's torch_aoti names an AOTInductor package's tensors ARGS[0],
    RESULT, ..."""

    version = live_version(repo / target)

    def edit(c: mc.ModelConfig, name: str) -> None:
        own = read_config(served_config_path(repo / target) if name == EMBEDDED_CONFIG else repo / target / CONFIG)
        served = {m: s for s, m in json.loads(own.parameters[TENSOR_NAMES].string_value or "{}").items()}
        step = c.ensemble_scheduling.step[MODEL_STEP]
        prepared = sorted(set(step.input_map.values())) or [  # an entry written before the model's inputs were
            v for v in c.ensemble_scheduling.step[0].output_map.values() if v.startswith("prepared_")
        ]
        outputs = sorted(set(step.output_map.values()))
        step.model_name = target
        step.model_version = version  # never "the highest loaded", which a version beside the live one would be
        step.ClearField("input_map")
        step.ClearField("output_map")
        for p in prepared:
            t = p.removeprefix("prepared_")
            step.input_map[served.get(t, t)] = p
        for o in outputs:
            t = o.removeprefix(MODEL_OUT)
            step.output_map[served.get(t, t)] = o
        # Triton refuses an ensemble that batches beyond a model in it: the winner may batch less than the first
        c.max_batch_size = min(c.max_batch_size, own.max_batch_size)

    return edit


def entry_target(config: dict[str, Any]) -> str | None:
    """The model a raw entry runs behind its preprocessing, from its config as Triton serves it (JSON); None
    for a config that is no such ensemble."""
    steps = config.get("ensemble_scheduling", {}).get("step", [])
    return steps[MODEL_STEP].get("model_name") if len(steps) > MODEL_STEP else None


def retarget(repo: Path, export_name: str, target: str) -> bool:
    """Point the raw entry of ``export_name`` in ``repo`` (where it has one) at the model ``target``."""
    d = next(
        (
            repo / (export_name + suffix)
            for suffix in (ENTRY_SUFFIX, TEXT_SUFFIX)
            if (repo / (export_name + suffix) / CONFIG).exists()
        ),
        None,
    )
    if d is None:
        return False
    put_behind(d, repo, target)
    return True


def entries_in_front(repo: Path, model: str) -> list[str]:
    """The raw entries of ``repo`` that run ``model`` behind their preprocessing."""
    found = []
    for name in repository_models(repo):
        steps = read_config(repo / name / CONFIG).ensemble_scheduling.step
        if len(steps) > MODEL_STEP and steps[MODEL_STEP].model_name == model:
            found.append(name)
    return found


def pin(version: int):
    """The config edit that makes an entry run version ``version`` of the model behind it."""

    def edit(c: mc.ModelConfig, name: str) -> None:
        c.ensemble_scheduling.step[MODEL_STEP].model_version = version

    return edit
