"""``torchship train``: checks the config up front, then trains here or launches torchrun ranks."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from torchship.config import add_dataclass_arguments, build, namespace_overrides, to_argv
from torchship.device import usable_cpus
from torchship.errors import ConfigError, TorchshipError

from .config import TrainConfig

if TYPE_CHECKING:
    from .loop import TrainResult

# torch, the training loop and the tasks' data are imported where training starts, so that --help answers at once

ERROR_FILE_ENV = "TORCHSHIP_ERROR_FILE"


def auto_nproc(device: str) -> tuple[int, str]:
    """(ranks, why) for --nproc 0: one rank per GPU; on a CPU one process using every core it may use,
    which trained resnet18 1.4x faster on 2 cores than 2 DDP ranks (their gradient all-reduce takes a core)."""
    import torch

    if device == "cuda":
        n = max(1, torch.cuda.device_count())
        return n, f"one rank per visible GPU ({n})"
    return 1, (
        f"one process with {usable_cpus()} thread(s): on a CPU it trains faster than DDP ranks, whose "
        "gradient all-reduce takes cores from the model; --nproc N runs N DDP ranks"
    )


def preflight(cfg: TrainConfig, world: int) -> None:
    """Every check that needs no process group, so mistakes surface before ranks start."""
    import torch

    from torchship.checkpoint import load_meta, resolve_checkpoint

    from . import checkpoint as ck
    from .loop import prepare_out, resolve_device
    from .tasks import training_for

    device = resolve_device(cfg)
    if device == "cuda" and world > (n := torch.cuda.device_count()):
        raise ConfigError(
            f"--nproc {world} starts one rank per GPU, but {n} GPU(s) are visible; use --nproc {n} or "
            "fewer (0: one per GPU)"
        )
    cfg.check_world(world)
    prepare_out(cfg)
    resume = cfg.resolved_resume()
    if resume:
        d = resolve_checkpoint(resume, which="latest")
        load_meta(d)
        ck.load_train_state(d)
    training_for(cfg).check(cfg, scan=True)
    cpus = usable_cpus()
    if device == "cpu" and world > cpus:
        print(
            f"torchship train: note: {world} ranks on {cpus} CPU(s) take turns on the cores, which is slower than "
            f"--nproc {cpus}",
            file=sys.stderr,
            flush=True,
        )


def run_train(cfg: TrainConfig) -> TrainResult | None:
    """Train in this process, or relaunch as ``cfg.nproc`` torchrun ranks.

    Returns the TrainResult when training ran in this process, None after a torchrun launch
    (results are on disk under cfg.out). Raises TorchshipError subclasses for user mistakes.
    """
    from .loop import resolve_device, train

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    nproc = cfg.nproc
    if not nproc and not under_torchrun:
        nproc, why = auto_nproc(resolve_device(cfg))
        print(f"torchship train: --nproc 0 (auto): {why}", flush=True)
    if nproc <= 1 or under_torchrun:
        return train(cfg)
    preflight(cfg, nproc)
    launch_torchrun(["-m", "torchship.train", *to_argv(cfg, exclude=("nproc",))], nproc)
    return None


def launch_torchrun(module_argv: list[str], nproc: int, extra: list[str] | None = None) -> None:
    """Run ``torchrun --standalone --nproc-per-node=N <module_argv>`` and turn a rank's
    one-line error back into a TorchshipError here."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: 2 per rank oversubscribes small machines
    with tempfile.TemporaryDirectory(prefix="torchship-ranks-") as tmp:
        os.environ[ERROR_FILE_ENV] = str(Path(tmp) / "error")
        args = get_args_parser().parse_args(
            [
                "--standalone",
                f"--nproc-per-node={nproc}",
                f"--log-dir={Path(tmp) / 'logs'}",  # else the agent leaves a torchelastic_* folder in /tmp
                *(extra or []),
                "--no-python",
                sys.executable,
                "-u",
                *module_argv,
            ]
        )
        # torchrun's agent logs each signal and stop at WARNING; a Ctrl-C then needs no more than the one line
        # torchship prints for it
        elastic = logging.getLogger("torch.distributed.elastic")
        level = elastic.level
        elastic.setLevel(logging.ERROR)
        # the agent installs SIGINT/SIGTERM handlers of its own and leaves them installed
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            run(args)
        except SignalException:  # the agent's own SIGINT/SIGTERM handler: it has stopped the ranks
            raise KeyboardInterrupt from None
        except ChildFailedError as e:
            msgs = sorted(Path(tmp).glob("error*"))
            if msgs:
                raise TorchshipError(msgs[0].read_text().strip()) from None
            raise TorchshipError(rank_failure(e, nproc)) from None
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            elastic.setLevel(level)
            os.environ.pop(ERROR_FILE_ENV, None)


def rank_failure(e, nproc: int) -> str:
    """One line for a rank that died without writing a torchship error: killed by a signal (SIGKILL from
    the out-of-memory killer, as a rank leaves no traceback then), or failed with a traceback above."""
    rank, failure = e.get_first_failure()
    if failure.exitcode < 0:
        why = (
            ": the kernel's out-of-memory killer, most likely (every rank holds its own copy of torch, the "
            f"model and the data); launch fewer than {nproc} ranks with --nproc"
            if failure.signal_name() == "SIGKILL"
            else ""
        )
        return f"training rank {rank} was killed by {failure.signal_name()}{why}"
    return f"training rank {rank} failed with exit code {failure.exitcode}; see its traceback above"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(p, TrainConfig)


def main_cli(ns: argparse.Namespace) -> int:
    cfg = build(TrainConfig, namespace_overrides(ns, TrainConfig))
    run_train(cfg)
    return 0


def rank_main(argv: list[str] | None = None) -> int:
    """Entry point for ``torchrun ... -m torchship.train FLAGS`` (the user's own torchrun line)."""
    p = argparse.ArgumentParser(
        prog="python -m torchship.train", description="torchship training, one rank per process"
    )
    add_dataclass_arguments(p, TrainConfig, exclude=("nproc",))
    try:
        cfg = build(TrainConfig, namespace_overrides(p.parse_args(argv), TrainConfig), {"nproc": 1})
        from .loop import train

        train(cfg)
    except TorchshipError as e:
        rank = os.environ.get("RANK", "0")
        msg = f"rank {rank}: {e}" if os.environ.get("WORLD_SIZE", "1") != "1" else str(e)
        if os.environ.get(ERROR_FILE_ENV):
            Path(os.environ[ERROR_FILE_ENV] + f".{rank}").write_text(str(e) + "\n")
        print(f"torchship: error: {msg}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C reaches every rank; the launcher says where the run stopped
        return 130
    return 0
