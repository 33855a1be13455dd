"""The repository's README.md: what torchship repo wrote, how to serve it (the embedded server, the official
container with its key-restricted control plane), and the section on the model the strategy serves under the
export's plain name."""

from __future__ import annotations

from typing import Any

from torchship.markdown import table
from torchship.names import FORMATS
from torchship.parity import gate_words

from .access import restricted_flags
from .config import (
    COMPUTE_BOUND_FLOPS,
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_METRICS_PORT,
    TRITON_IMAGE,
    RepoConfig,
)
from .entries import Entry
from .model_config import TENSOR_NAMES, aoti_tensor_names

KEY_PLACEHOLDER = "KEY"  # where the README's docker command puts the key it reads


WINNER_HEADING = "## Served by strategy"


def readme_with_winner(text: str, name: str, winner: dict[str, Any]) -> str:
    """The repository README ``text`` with its section on the model served under the export's plain name (from
    that model's winner.json) written, or written again in place of an earlier one."""
    section = (
        f"`{name}` serves `{winner['model']}` ({winner['format']}, {winner.get('precision', 'float32')}"
        + (f"; {gate_words(winner['gate'])}" if winner.get("gate") else "")
        + f"). Why: {winner['why']}.\n"
    )
    if winner.get("placement"):
        from .bench.placement import grid_table

        section += "\n" + "\n".join(grid_table(winner))
    return text.split(f"\n{WINNER_HEADING}\n")[0].rstrip() + f"\n\n{WINNER_HEADING}\n\n" + section


IMAGES_TAG = "torchship-triton-images"  # the official image with Pillow: deploy/triton-images.Dockerfile
KEY_LINE = (
    "(umask 077; openssl rand -base64 32 > ../triton-admin-key)  # the key model control answers to; "
    "outside the repository"
)


def compute_bound_note(manifest: dict[str, Any]) -> str:
    """For a model of COMPUTE_BOUND_FLOPS a sample or more, a sentence saying why its default is every core."""
    flops = manifest.get("flops_per_sample") or 0
    if flops < COMPUTE_BOUND_FLOPS:
        return ""
    return (
        f" The model costs {flops / 1e9:.1f} GFLOP a sample, at or above {COMPUTE_BOUND_FLOPS / 1e9:g}: "
        "compute-bound, so unless told otherwise one instance gets every core."
    )


def render_readme(
    manifest, names, formats, cfg: RepoConfig, gpu: bool, container_aoti: bool = True, raw: Entry | None = None
) -> str:
    """The repository's README.md: its models, tensors, how each server runs them, and the container's command.
    ``raw``: the raw entry, where the repository has one (its preprocessing needs Pillow, or tokenizers)."""
    pre = manifest.get("preprocessing")
    dims = manifest.get("dims", {})
    tensors = [
        f"Input `{t['name']}`: {t['dtype']} {t['shape']}" + (f" — {pre['contract']}" if pre else "") + "."
        for t in manifest["inputs"]
    ]
    tensors += [
        f"Output `{t['name']}`: {t['dtype']} {t['shape']}"
        + (", with class labels for Triton's classification extension" if manifest.get("classes") and i == 0 else "")
        + "."
        for i, t in enumerate(manifest["outputs"])
    ]
    tensors += [f"Dim `{k}`: {v['min']}..{v['max']} (`-1` in the configs)." for k, v in dims.items()]
    rows = "\n".join(
        table(["model", "format", "platform"], [[f"`{names[f]}`", f, f"`{FORMATS[f].platform}`"] for f in formats])
    )
    buckets_only = (
        ""
        if container_aoti
        else (
            f"\n\n**`{names['aoti']}` holds only the bucket archive** (the export has no verified `aoti` package), "
            "which the container's `torch_aoti` cannot load; export the `aoti` format too to serve this model there."
        )
    )
    aoti = [f for f in formats if FORMATS[f].platform == "torch_aoti"]
    named = " and ".join(f"`{names[f]}/config.pbtxt`" for f in aoti) or f"`{manifest['name']}_aoti/config.pbtxt`"
    wire = ", ".join(f"`{k}` is `{v}`" for k, v in aoti_tensor_names(manifest).items())
    packages = [f"`{names[f]}`" for f in ("aoti_int8", "aoti_bf16") if f in aoti]
    int8 = (
        ""
        if not packages
        else f" {' and '.join(packages)} {'is' if len(packages) == 1 else 'are'} batched the same way over "
        f"{'its' if len(packages) == 1 else 'their'} one dynamic-batch package, without padding."
    )
    kind_note = (
        "The models run on GPU 0 (`KIND_GPU` instances), so `torchship serve` below needs a CUDA GPU too; "
        "`torchship repo --instance-kind cpu` builds the same repository for a machine without one."
        if gpu
        else f"The models run on the CPU (`KIND_CPU` instances), in the container too: {cfg.instance_count} "
        "instance(s) "
        f"of {cfg.threads} intra-op thread(s) each, {cfg.instance_count * cfg.threads} core(s) in all (`torchship "
        "repo --cores N` builds it for a machine of N cores). `torchship repo --instance-kind gpu` builds the same "
        "repository with the models on GPU 0." + compute_bound_note(manifest)
    )
    flags = " ".join(f.replace(KEY_PLACEHOLDER, "$K") for f in restricted_flags(KEY_PLACEHOLDER))
    image, build, entry_note = TRITON_IMAGE, "", ""
    entry = raw.name if raw else None
    if raw:
        image = IMAGES_TAG
        build = f"docker build -f deploy/triton-images.Dockerfile -t {IMAGES_TAG} deploy/  # from torchship's folder\n"
        entry_note = (
            (
                f"\n\n`{entry}` takes a text as it is (a `TYPE_UINT8` vector of its UTF-8 bytes), tokenizes it in the "
                f"server with the export's tokenizer, then runs the model behind it: an ensemble of `{raw.pre}` "
                f"(python backend, which tokenizes with the `tokenizers` package) and that model. The official image "
                f"lacks that package, so the command runs `{IMAGES_TAG}`, the official image with it added; "
                "`torchship repo --no-text-entry` builds the repository without the entry, for the official image as "
                "it is."
            )
            if raw.kind == "text"
            else (
                f"\n\n`{entry}` takes an image file as it is (a `TYPE_UINT8` vector of its bytes: JPEG, PNG, WebP, "
                f"...) and prepares it in the server as training did, then runs the model behind it: an ensemble of "
                f"`{raw.pre}` (python backend, which decodes with Pillow) and that model. The official image has no "
                f"Pillow, so the command runs `{IMAGES_TAG}`, the official image with Pillow added; `torchship repo "
                "--no-image-entry` builds the repository without the entry, for the official image as it is."
            )
        )
    vision = [a for a in manifest["artifacts"] if a["format"] in formats and a.get("torchvision_ops")]
    if vision:
        ops = sorted({op for a in vision for op in a["torchvision_ops"]})
        models = " and ".join(f"`{names[a['format']]}`" for a in vision)
        entry_note += (
            f"\n\n{models} call{'s' if len(vision) == 1 else ''} torchvision's operators "
            f"({', '.join(f'`{op}`' for op in ops)}). In the container the PyTorch backend (`pytorch_libtorch`) runs "
            "them: the official image builds it with TorchVision's operators (`TRITON_PYTORCH_ENABLE_TORCHVISION`, "
            "on by default). `torchship serve` loads torchvision's operator library where a file calls them."
        )
    return f"""# Triton model repository: {manifest["name"]}

Generated by `torchship repo` from an export manifest ({manifest["created"]}, torch {manifest["torch_version"]}).

{rows}

{chr(10).join(tensors)}

## Serve it with the official Triton container (GPU)

```bash
{build}{KEY_LINE}
docker run --rm --gpus all --shm-size=1g --user 1000:1000 --read-only --tmpfs /tmp --cap-drop ALL \\
  --security-opt no-new-privileges \\
  -p {DEFAULT_HTTP_PORT}:8000 -p {DEFAULT_GRPC_PORT}:8001 -p {DEFAULT_METRICS_PORT}:8002 \\
  -v "$PWD:/models:ro" -v "$PWD/../triton-admin-key:/run/secrets/triton_admin_key:ro" {image} \\
  sh -c 'K=$(cat /run/secrets/triton_admin_key); exec tritonserver --model-repository=/models \\
    --model-control-mode=explicit --load-model=* {flags}'
```

Model load and unload, logging, shared memory and trace then answer only to that key (`torchship rollout
--key-file ../triton-admin-key`); inference, health, metadata, config and statistics stay open.{entry_note}

26.07 or later is needed for {named}: Triton batches `torch_aoti` models from that release on. Their tensors
carry the names the container's PyTorch backend gives an AOTInductor package's: {wire}. Clients of those models in
the container send and read those names; `torchship infer` and `torchship bench` translate them from the
`{TENSOR_NAMES}` parameter in the config.{buckets_only}

{kind_note}

## Serve it without Docker{"" if gpu else " or a GPU"}

```bash
torchship serve {cfg.out}
```

The embedded Triton 2.51 does not know the `torch_aoti` platform. `torchship serve` loads that model with
`embedded.pbtxt` instead: the same tensors, batched (up to the largest bucket) over the static-batch
AOTInductor models in `buckets.pt2`, which share one copy of the weights, padding each batch up to the
next bucket.{int8}
"""
