"""manifest.json: the contract an export directory hands to verification, serving and benchmarks."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any, Optional, TypedDict

import numpy as np

from .errors import ArtifactError, ConfigError
from .io import atomic_write_json, read_json, sha256_file
from .signature import Signature

MANIFEST = "manifest.json"
REFERENCE = "reference.npz"
TOKENIZER = "tokenizer/tokenizer.json"  # a text model's tokenizer (export --tokenizer), which its text entry runs
RAW_SET = "raw"  # the held-out files as a client sends them (export/raw/), and training's tensors of them
RANDOM_SETS = "random_"  # the reference's sets of random inputs: random_b<batch>[_<dim>=<size>...]
PARITY_MD = "parity.md"
FORMAT = "torchship.export/2"  # 2: a float64 reference and a bound per output


class Artifact(TypedDict, total=False):
    """One exported artifact as manifest.json lists it (the fields every stage after export reads)."""

    name: str
    format: str  # the artifact format: onnx, aoti_buckets, aoti_int8, ...
    file: str  # its main file, relative to the export directory
    files: dict[str, str]  # every file it is made of -> sha256
    bytes: int
    dtype: str
    device: str  # what it was exported on: cpu, cuda
    gate: dict[str, Any]  # a reduced precision's accuracy gate
    tf32: bool  # an AOTInductor package compiled with TF32 allowed
    buckets: list[int]


class Manifest(TypedDict, total=False):
    """manifest.json's top level: the JSON on disk, typed for its readers (read_manifest checks the fields they
    all need)."""

    name: str
    device: str
    dtype: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    dims: dict[str, dict[str, int]]
    max_batch: int
    tolerances: dict[str, Any]
    reference: dict[str, Any]
    formats: list[str]
    optional: list[str]
    artifacts: list[Artifact]
    export_failures: list[dict[str, str]]
    verification: dict[str, Any]
    preprocessing: dict[str, Any]
    classes: list[str]


def artifact_of(manifest: Manifest | dict[str, Any], fmt: str) -> Artifact | None:
    """The manifest's artifact of format ``fmt`` (None where it has none)."""
    return next((a for a in manifest["artifacts"] if a["format"] == fmt), None)


def read_manifest(export_dir: str | Path) -> Manifest:
    """Load and sanity-check an export directory's manifest; ArtifactError if unusable."""
    d = Path(export_dir)
    if not d.is_dir():
        raise ArtifactError(f"{d} is not an export directory (run torchship export first)")
    m = read_json(
        d / MANIFEST,
        ArtifactError,
        FORMAT,
        fix="; export again",
        missing=f"{d} has no {MANIFEST}: not an export directory, or an interrupted export",
    )
    _check_fields(d / MANIFEST, m)
    return m


# what the stages after export read from a manifest, so that a hand-edited one is refused here, naming the
# field, rather than failing with a KeyError in whichever stage reads it first
_FIELDS = {
    "name": str,
    "inputs": list,
    "outputs": list,
    "max_batch": int,
    "tolerances": dict,
    "reference": dict,
    "artifacts": list,
}
_TENSOR = {"name": str, "dtype": str, "shape": list}
_ARTIFACT = {"name": str, "format": str, "file": str, "files": dict}
_KINDS = {str: "a string", int: "an integer", list: "a list", dict: "an object"}


def _check_fields(path: Path, m: dict[str, Any]) -> None:
    def need(obj: Any, fields: dict[str, type], where: str) -> None:
        if not isinstance(obj, dict):
            raise ArtifactError(f"{path}: {where.rstrip('.')} is not an object; export again")
        for key, kind in fields.items():
            if not isinstance(obj.get(key), kind):
                what = "missing" if key not in obj else f"not {_KINDS[kind]}"
                raise ArtifactError(f"{path}: {where}{key} is {what}; export again")

    need(m, _FIELDS, "")
    need(m["tolerances"], {"outputs": dict}, "tolerances.")
    for key, fields in (("inputs", _TENSOR), ("outputs", _TENSOR), ("artifacts", _ARTIFACT)):
        for i, item in enumerate(m[key]):
            need(item, fields, f"{key}[{i}].")


def write_manifest(export_dir: str | Path, manifest: dict[str, Any]) -> None:
    atomic_write_json(Path(export_dir) / MANIFEST, manifest)


def artifact_files(artifact: dict[str, Any]) -> dict[str, str]:
    """relative path -> sha256 for every file an artifact consists of."""
    return dict(artifact["files"])


def check_hashes(export_dir: str | Path, manifest: dict[str, Any]) -> list[str]:
    """Re-hash every file the manifest lists; one message per missing or altered file."""
    d = Path(export_dir)
    problems: list[str] = []
    listed = {REFERENCE: manifest["reference"]["sha256"], **manifest["reference"].get(RAW_SET, {}).get("files", {})}
    if manifest.get("text"):
        listed[manifest["text"]["tokenizer"]] = manifest["text"]["sha256"]
    for a in manifest["artifacts"]:
        for rel, sha in artifact_files(a).items():
            listed[rel] = sha
    for rel, sha in listed.items():
        problem = file_problem(d, rel, sha)
        if problem:
            problems.append(problem)
    return problems


def file_problem(d: Path, rel: str, sha: str | None) -> str | None:
    """Why the file ``rel`` under ``d`` is not the one the manifest lists by its sha256, or None."""
    if not (d / rel).is_file():
        return f"{rel} is missing"
    if sha256_file(d / rel) != sha:
        return f"{rel} was altered or truncated (sha256 differs from the manifest)"
    return None


class Export:
    """An export directory as a later stage holds it: its manifest, read once, and its reference arrays, read (and
    their sha256 checked) once, when first asked for. ``torchship run`` hands one Export from stage to stage, so
    each file is read once per run. ``files_checked``: every file the manifest lists (the reference included)
    was hashed against it already (by the export that wrote them, or a check earlier in this process)."""

    def __init__(
        self,
        export_dir: str | Path,
        manifest: dict[str, Any] | None = None,
        reference: dict[str, np.ndarray] | None = None,
        files_checked: bool = False,
    ):
        self.dir = Path(export_dir)
        self.manifest = manifest if manifest is not None else read_manifest(self.dir)
        self._reference = reference
        self.files_checked = files_checked

    @classmethod
    def of(cls, export: "str | Path | Export") -> "Export":
        """``export`` itself if it is one, else the export directory it names, read."""
        return export if isinstance(export, Export) else cls(export)

    def reference(self) -> dict[str, np.ndarray]:
        """The reference arrays (read_reference; without hashing it again where files_checked), read on first use."""
        if self._reference is None:
            self._reference = (
                _load_npz(self.dir / REFERENCE) if self.files_checked else read_reference(self.dir, self.manifest)
            )
        return self._reference

    def check_files(self) -> None:
        """ArtifactError naming each file the manifest lists that is missing or altered (once per Export)."""
        if not self.files_checked:
            problems = check_hashes(self.dir, self.manifest)
            if problems:
                raise ArtifactError(f"{self.dir}: " + "; ".join(problems))
            self.files_checked = True


def read_reference(export_dir: str | Path, manifest: dict[str, Any]) -> dict[str, np.ndarray]:
    """The export's reference arrays (reference.npz: inputs, eager outputs, held-out labels), once its
    sha256 matches the manifest's; ArtifactError naming the file if it is missing or altered."""
    d = Path(export_dir)
    if not (d / REFERENCE).is_file():
        raise ArtifactError(f"{d}: {REFERENCE} is missing; export again")
    data = (d / REFERENCE).read_bytes()  # one read serves the hash and the arrays
    if hashlib.sha256(data).hexdigest() != manifest["reference"].get("sha256"):
        raise ArtifactError(
            f"{d}: {REFERENCE} was altered or truncated (sha256 differs from the manifest); export again"
        )
    return _load_npz(io.BytesIO(data))


def _load_npz(path: Path | io.BytesIO) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def raw_files(export_dir: str | Path, manifest: dict[str, Any]) -> list[tuple[str, bytes]]:
    """The export's held-out files (name, bytes) as a client would send them, each checked against the sha256
    the manifest lists ([] where the export keeps none); ArtifactError naming a missing or altered one."""
    d = Path(export_dir)
    out = []
    for rel, sha in manifest["reference"].get(RAW_SET, {}).get("files", {}).items():
        data = (d / rel).read_bytes() if (d / rel).is_file() else None
        if data is None or hashlib.sha256(data).hexdigest() != sha:
            raise ArtifactError(f"{d}: {rel} is {'missing' if data is None else 'altered'}; export again")
        out.append((Path(rel).name, data))
    return out


def sample_set(manifest: dict[str, Any]) -> str:
    """The reference set to draw real samples from: the held-out images or the example inputs where the
    export has them, else its largest random batch."""
    sets = manifest["reference"]["sets"]
    return manifest["reference"].get("samples") or max(sets, key=lambda k: (sets[k], k == f"{RANDOM_SETS}b{sets[k]}"))


def reference_inputs(
    ref: dict[str, np.ndarray], manifest: dict[str, Any], key: str | None = None
) -> dict[str, np.ndarray]:
    """The inputs of one reference set (default: sample_set), by input name."""
    key = key or sample_set(manifest)
    return {t["name"]: ref[f"input/{key}/{t['name']}"] for t in manifest["inputs"]}


def check_shape(manifest: dict[str, Any], shape: dict[str, int]) -> None:
    """ConfigError naming --shape unless every NAME=SIZE names a dynamic dim of the export within its range."""
    dims = manifest.get("dims", {})
    for name, size in shape.items():
        if name not in dims:
            has = f"its dynamic dims are {', '.join(dims)}" if dims else "its inputs have no dynamic dims"
            raise ConfigError(f"--shape {name}={size}: the export has no dim {name!r} ({has})")
        if not dims[name]["min"] <= size <= dims[name]["max"]:
            raise ConfigError(
                f"--shape {name}={size} is outside the export's range {dims[name]['min']}..{dims[name]['max']}"
            )


def bench_inputs(
    ref: dict[str, np.ndarray], manifest: dict[str, Any], shape: dict[str, int] | None = None
) -> tuple[dict[str, np.ndarray], str, Optional[str]]:
    """Inputs for a benchmark, by input name, a line saying what they are, and the reference set they are
    (None for random inputs, which have no reference outputs). Without ``shape``: the real samples
    (sample_set). With it (a size per dynamic dim): the reference set of those sizes, real samples first,
    then the largest random batch; random inputs of the signature when no set has them."""
    if not shape:
        key = sample_set(manifest)
        return reference_inputs(ref, manifest, key), _described(key, manifest), key
    check_shape(manifest, shape)
    sig = Signature.from_manifest(manifest)
    sets = manifest["reference"]["sets"]
    order = sorted(sets, key=lambda k: (k != manifest["reference"].get("samples"), -sets[k], k))
    for key in order:
        feeds = reference_inputs(ref, manifest, key)
        if all(sig.dims_of(feeds).get(k) == v for k, v in shape.items()):
            return feeds, _described(key, manifest), key
    values = {**{k: hi for k, (lo, hi) in sig.dims.items()}, **shape}
    where = ", ".join(f"{k}={v}" for k, v in values.items())
    return (
        sig.random_inputs(np.random.default_rng(0), 64, values),
        f"random inputs at {where} (no reference set has that size), drawn as verification draws them",
        None,
    )


def reference_outputs(ref: dict[str, np.ndarray], manifest: dict[str, Any], key: str) -> dict[str, np.ndarray]:
    """The reference outputs (eager, in float64 where the model runs in it) of one reference set, by output name."""
    return {o["name"]: ref[f"expected/{key}/{o['name']}"] for o in manifest["outputs"]}


def _described(key: str, manifest: dict[str, Any]) -> str:
    what = {"heldout": "real held-out samples", "examples": "the example inputs"}.get(key, "random inputs")
    dims = manifest["reference"].get("dims", {}).get(key)
    return f"{what} ({key}" + (", " + ", ".join(f"{k}={v}" for k, v in dims.items()) if dims else "") + ")"


def verdicts(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """artifact name -> its recorded verification entry ("pass", "failures", "verified_at", the figures), for
    each artifact that has one."""
    return dict((manifest.get("verification") or {}).get("artifacts", {}))


def gate_row(manifest: dict[str, Any], artifact: dict[str, Any]) -> dict[str, Any]:
    """A reduced-precision artifact's verification row on the real samples (its gate's figures), with its gate;
    the gate alone where it has no verdict."""
    real = manifest["reference"].get("samples") or ""
    return {"gate": artifact["gate"], **verdicts(manifest).get(artifact["name"], {}).get("sets", {}).get(real, {})}


PASSED, FAILED, UNVERIFIED, STALE = (
    "passed verification",
    "failed verification",
    "not verified",
    "verified on other files (the artifact or the reference changed since)",
)


def verdict_state(manifest: dict[str, Any], a: dict[str, Any]) -> str:
    """Where artifact ``a`` stands: PASSED, FAILED, UNVERIFIED, or STALE when its verdict was reached on files
    (the artifact's, or the reference) other than those the manifest lists now."""
    e = verdicts(manifest).get(a["name"])
    if e is None:
        return UNVERIFIED
    made_on = e.get("made_on")
    if made_on and (
        made_on.get("reference") != manifest["reference"].get("sha256") or made_on.get("files") != a["files"]
    ):
        return STALE
    return PASSED if e.get("pass") else FAILED


def passed_formats(manifest: dict[str, Any]) -> set[str]:
    """The formats whose artifact has a passing verdict recorded, on its files as they are: the only ones a
    later stage may serve."""
    return {a["format"] for a in manifest["artifacts"] if verdict_state(manifest, a) == PASSED}


def why_not_passed(manifest: dict[str, Any], fmt: str) -> str:
    """Why ``fmt`` has no passing verdict, in a few words: failed verification, not verified, not exported, ..."""
    a = artifact_of(manifest, fmt)
    if a is None:
        failed = any(f["format"] == fmt for f in manifest.get("export_failures", []))
        return "could not be exported" if failed else "not exported"
    return verdict_state(manifest, a)


def runs_tf32(manifest: dict[str, Any], fmt: str | None) -> bool:
    """Whether the served model of ``fmt`` runs an AOTInductor package compiled with TF32 allowed (its own, or
    the bucket archive the embedded server runs for it), and so is held to the TF32 bound."""
    from .names import sources

    return any(a.get("tf32") for a in manifest["artifacts"] if a["format"] in sources(fmt))


def artifact(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    for a in manifest["artifacts"]:
        if a["name"] == name:
            return a
    raise ArtifactError(
        f"the manifest has no artifact {name!r}; it has {', '.join(a['name'] for a in manifest['artifacts'])}"
    )
