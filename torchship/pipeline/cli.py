"""The ``torchship`` console script: thin subcommands over each stage's plain functions."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from ..errors import Interrupted, TorchshipError

# subcommand -> (module, help). Modules are imported lazily so `torchship --help` is fast.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("torchship.train.launch", "train a model with DDP/AMP and write checkpoints"),
    "export": (
        "torchship.export.cli",
        "export a checkpoint, or your own model and weights, to TorchScript, ExportedProgram, "
        "AOTInductor and ONNX, then verify each against eager in float64",
    ),
    "verify": (
        "torchship.export.cli",
        "re-verify an export directory (hashes, then parity against its float64 reference)",
    ),
    "repo": ("torchship.serve.cli", "build a Triton model repository from an export manifest"),
    "serve": ("torchship.serve.cli", "start the embedded Triton Inference Server on a repository"),
    "infer": ("torchship.serve.cli", "send images, .npz requests or an export's samples to a Triton server over gRPC"),
    "rollout": (
        "torchship.serve.cli",
        "switch a running Triton to each model's newest version on disk, once its served "
        "outputs pass the parity check, without a failed request",
    ),
    "rollback": (
        "torchship.serve.cli",
        "switch a running Triton back to an earlier version still on disk, the same way",
    ),
    "bench": (
        "torchship.serve.bench.cli",
        "benchmark in-process and served latency/throughput, or compare two results",
    ),
    "run": (
        "torchship.pipeline.run_cli",
        "every stage in one run folder: train, export (each format verified against "
        "eager), repo (the Triton repository), check (served outputs over gRPC against "
        "eager) and bench",
    ),
}


EXIT_RULE = (
    "Exit status: 0 when every requested format is exported and verified; 3 when a format not marked "
    "--optional cannot be exported or disagrees with the reference (the export directory is still written, "
    "and torchship repo serves only the formats that passed); 2 for a usage or input error."
)
EXPORT_EXAMPLES = (
    "Examples: 'torchship export runs/RUN/train' (a torchship checkpoint: the signature, preprocessing "
    "and held-out samples come from it); 'torchship export --model torchvision.models:resnet50 --weights "
    "resnet50.pt --input x:float32:B,3,224,224' (your own model: a factory, a state_dict file and the "
    "signature)."
)
EPILOGS = {
    "export": EXPORT_EXAMPLES + " " + EXIT_RULE + " Also 3 when eager's outputs are the same for every reference "
    "input (--allow-degenerate goes on).",
    "verify": EXIT_RULE,
}


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless its help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        if "(default" in help_ or action.default in (None, "", argparse.SUPPRESS):
            return help_
        return super()._get_help_string(action)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchship",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="From a PyTorch model to a verified, served and benchmarked Triton deployment.",
        epilog="Run 'torchship COMMAND --help' for each command's options and defaults.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_,
            description=help_[0].upper() + help_[1:] + ".",
            epilog=EPILOGS.get(name),
            formatter_class=DefaultsHelpFormatter,
        )
        if only == name:
            mod = importlib.import_module(module)
            getattr(mod, f"add_{name}_arguments", getattr(mod, "add_arguments", None))(p)
            p.set_defaults(_handler=getattr(mod, f"main_{name}", getattr(mod, "main_cli", None)))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    ns = parser.parse_args(argv)
    if not getattr(ns, "_handler", None):
        parser.print_help()
        return 0 if not argv else 2
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.jit")
    try:
        return int(ns._handler(ns) or 0)
    except TorchshipError as e:
        print(f"torchship {ns.command}: {'' if isinstance(e, Interrupted) else 'error: '}{e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"torchship {ns.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
