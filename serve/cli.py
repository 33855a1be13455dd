"""``torchship repo``, ``torchship serve`` and ``torchship infer``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from torchship.config import add_dataclass_arguments, build, namespace_overrides
from torchship.errors import ConfigError

from .config import InferConfig, RepoConfig, ServeConfig


def add_repo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("export_dir", help="export directory (with manifest.json) written by torchship export")
    add_dataclass_arguments(p, RepoConfig)


def main_repo(ns: argparse.Namespace) -> int:
    from .repository import build_repository

    cfg = build(RepoConfig, namespace_overrides(ns, RepoConfig))
    winner = None
    if cfg.strategy:  # read and judged before anything is written
        from torchship.manifest import read_manifest

        from .strategy import pick

        if not cfg.bench:
            raise ConfigError(f"--strategy {cfg.strategy} judges a bench's served figures: give --bench results.json "
                              f"(torchship bench {ns.export_dir} writes one)")
        winner = pick(read_bench(cfg.bench), cfg.strategy, read_manifest(ns.export_dir))
    res = build_repository(ns.export_dir, cfg)
    print(f"repository {res['path']}: " + ", ".join(f"{m} ({f})" for f, m in res["models"].items()))
    if res["skipped"]:
        print(f"not in the export, skipped: {', '.join(res['skipped'])}")
    if winner:
        from torchship.manifest import read_manifest

        from .strategy import serve_winner

        if winner["format"] not in res["models"]:
            raise ConfigError(f"the winner {winner['model']} is not in this repository (it serves "
                              f"{', '.join(res['models'].values())})")
        dest = serve_winner(res["path"], winner, read_manifest(ns.export_dir), cfg.only_winner)
        print(f"served as {dest.name}: {winner['why']}")
    print(f"serve it: torchship serve {res['path']}   (official container: see {res['path']}/README.md)")
    return 0


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("repo", nargs="?", default="model_repository", help="Triton model repository (default: model_repository)")
    add_dataclass_arguments(p, ServeConfig)


def main_serve(ns: argparse.Namespace) -> int:
    from .embedded import TritonServer, describe

    cfg = build(ServeConfig, namespace_overrides(ns, ServeConfig), {"repo": ns.repo})
    server = TritonServer(cfg)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        info = describe(server)
        print(f"Triton ready: gRPC {info['grpc']}  HTTP {info['http']}  metrics {info['metrics']}")
        print(f"models: {', '.join(info['models'])}")
        kept = "" if cfg.log else ", removed after a clean stop: --log FILE keeps one"
        print(f"log: {info['log']}   (Ctrl-C to stop; in-flight requests are drained{kept})")
        print(f"try: torchship infer --url {info['grpc']} --check EXPORT_DIR   (served outputs against eager)", flush=True)
        while not stop.wait(0.5):
            if server.proc.poll() is not None:
                print(f"tritonserver exited with code {server.proc.returncode}:\n{server.log_tail()}", file=sys.stderr)
                return 1
    finally:
        code = server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if server.stop_note:
        print(f"server killed (exit code {code}): {server.stop_note}")
    else:
        print(f"server stopped (exit code {code})")
    return 0


def add_infer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="*", help="image files (resized to the model's input) or .npy arrays (N,C,H,W or C,H,W) "
                                            "for an image model; for any model, .npz files keyed by input name, one "
                                            "request each (arrays with the batch first)")
    add_dataclass_arguments(p, InferConfig)


def main_infer(ns: argparse.Namespace) -> int:
    from .infer import run_infer

    return run_infer(build(InferConfig, namespace_overrides(ns, InferConfig), {"files": ns.files}))


def read_bench(path: str) -> dict:
    """A bench results.json; ConfigError naming the file if it is missing or not one."""
    import json
    from pathlib import Path

    try:
        results = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--bench {path}: cannot read it as bench results ({type(e).__name__})") from None
    if not isinstance(results, dict) or "served" not in results:
        raise ConfigError(f"--bench {path}: not the results.json of a torchship bench with a served part")
    return results
