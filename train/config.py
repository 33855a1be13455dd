"""TrainConfig: every training option, its unit and its cross-field checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from torchship.config import opt
from torchship.errors import ConfigError
from torchship.tasks import Task, task_named


@dataclass
class TrainConfig:
    arch: str = opt(
        "resnet18",
        "model: resnet18, resnet50, mobilenet_v3_small, tiny_cnn, a detector (tiny_fcos, fcos_resnet50_fpn, "
        "retinanet_resnet50_fpn, ssdlite320_mobilenet_v3_large, fasterrcnn_mobilenet_v3_large_320_fpn), or "
        "package.module:factory",
    )
    task: Literal["auto", "classify", "detect"] = opt(
        "auto",
        "what the model learns. auto: detect for a detector --arch, else classify. detect: boxes and labels, "
        "from --data digits (the built-in pictures of digits on photos) or a COCO instances JSON (or its folder); "
        "a package.module:factory detector is called with num_classes (the background counted) and trained as "
        "torchvision's detectors are: model(images, targets) returns a dict of losses",
    )
    data: str = opt(
        "digits",
        "dataset: 'digits' (scikit-learn's 8x8 digits, no download), 'synthetic', an ImageFolder PATH, or your own "
        "package.module:factory returning (train, val) datasets of (inputs, class index) samples, inputs a "
        "tensor or a dict of tensors (see docs/any-model.md)",
    )
    image_size: Optional[int] = opt(
        None, "input height and width in pixels (default: 32 for digits/synthetic, 224 for folders, 128 to detect)"
    )
    epochs: Optional[int] = opt(
        None,
        "passes over the training split (default: 3 to classify, where the digits reach 97-99 %%; 10 to detect)",
    )
    batch_size: Optional[int] = opt(
        None, "global batch size, split evenly across DDP ranks (default: 64 to classify, 16 to detect)"
    )
    lr: Optional[float] = opt(
        None, "peak learning rate of AdamW, warm-up then cosine decay (default: 2e-3 to classify, 3e-3 to detect)"
    )
    weight_decay: float = opt(5e-4, "AdamW weight decay")
    amp: Literal["auto", "off", "bf16", "fp16"] = opt(
        "auto",
        "autocast precision. auto: bf16 on a CUDA GPU that supports it "
        "and on a CPU that computes bf16 natively (AVX512-BF16 or AMX), "
        "else off; bf16 on a CPU without it is emulated and much slower; "
        "fp16 (with GradScaler) needs CUDA",
    )
    nproc: int = opt(
        0,
        "DDP processes to launch through torchrun on this machine (0: one per GPU; on a CPU one process "
        "using every core, which trains faster there than several ranks)",
    )
    out: str = opt("runs/train", "output directory for checkpoints, metrics.jsonl and the log")
    resume: Optional[str] = opt(
        None,
        "resume exactly from this checkpoint directory (or an output directory: its latest); "
        "'auto': resume from OUT's latest checkpoint if it has one, else start fresh (restartable jobs)",
    )
    seed: int = opt(0, "seed for initialisation, data order and the train/validation split")
    val_fraction: float = opt(0.2, "fraction of the data held out for validation (stratified)")
    synthetic_samples: int = opt(512, "number of samples for --data synthetic")
    num_classes: Optional[int] = opt(None, "classes for --data synthetic (default 10)")
    pictures: int = opt(1500, "pictures in the built-in detection set (--task detect --data digits)")
    workers: int = opt(0, "DataLoader worker processes per rank (ImageFolder data)")
    grad_clip: Optional[float] = opt(None, "clip the global gradient norm to this value (unscaled first under fp16)")
    compile: bool = opt(False, "wrap the model in torch.compile (the saved weights stay unwrapped)")
    profile: bool = opt(
        False, "write a torch.profiler trace of a few steps to OUT/profile (Chrome/Perfetto/TensorBoard)"
    )
    channels_last: bool = opt(False, "use the channels_last memory format")
    keep_last: int = opt(2, "keep this many most recent checkpoints (the best one is always kept)")
    save_every: int = opt(0, "also checkpoint every N optimizer steps (0: only at epoch ends)")
    max_steps: Optional[int] = opt(None, "stop after this many optimizer steps in total, saving a resumable checkpoint")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "where to train: auto picks CUDA when present")
    overwrite: bool = opt(False, "allow writing into an OUT directory that already holds checkpoints")
    model_arg: tuple[str, ...] = opt((), "extra constructor argument for the model, KEY=JSON_VALUE (repeatable)")
    progress: bool = opt(True, "show a progress bar on rank 0")

    def __post_init__(self) -> None:
        for key, value in self.resolved_task().defaults.items():  # a detector learns from fewer, larger pictures
            if getattr(self, key) is None:
                setattr(self, key, value)
        if self.epochs < 1:
            raise ConfigError("--epochs must be at least 1")
        if self.batch_size < 1:
            raise ConfigError("--batch-size must be at least 1")
        if self.nproc < 0:
            raise ConfigError("--nproc must be 0 (auto) or more")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError("--val-fraction must be between 0 and 1")
        if self.lr <= 0:
            raise ConfigError("--lr must be positive")
        if self.keep_last < 1:
            raise ConfigError("--keep-last must be at least 1")
        if self.image_size is not None and self.image_size < 8:
            raise ConfigError("--image-size must be at least 8 pixels")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError("--max-steps must be at least 1")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError("--grad-clip must be positive")
        if self.synthetic_samples < 4:
            raise ConfigError("--synthetic-samples must be at least 4")
        if self.pictures < 4:
            raise ConfigError("--pictures must be at least 4")

    def resolved_task(self) -> Task:
        """The task this run trains (--task, or for auto the one --arch belongs to)."""
        return task_named(self.task, self.arch)

    def resolved_resume(self) -> Optional[str]:
        """--resume with 'auto' resolved: OUT when it already holds a checkpoint, else None."""
        if self.resume != "auto":
            return self.resume

        return self.out if (Path(self.out) / "checkpoints" / "index.json").exists() else None

    def check_world(self, world_size: int) -> None:
        """Checks that need the world size: the global batch must split evenly across ranks."""
        if self.batch_size < world_size:
            raise ConfigError(
                f"--batch-size {self.batch_size} is smaller than the world size {world_size}: "
                f"every rank needs at least one sample per step; raise --batch-size or lower --nproc"
            )
        if self.batch_size % world_size:
            raise ConfigError(
                f"--batch-size {self.batch_size} does not split evenly across {world_size} ranks; "
                f"use a multiple of {world_size}"
            )
