"""``torchship repo``, ``torchship serve`` and ``torchship infer``."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from torchship.config import add_dataclass_arguments, build, namespace_overrides
from torchship.errors import ConfigError

from .access import access_from_arguments, add_access_arguments
from .config import InferConfig, RepoConfig, ServeConfig, check_url


def add_repo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "export_dir",
        help="export directory (with manifest.json) written by torchship export; with --history, a repository",
    )
    p.add_argument(
        "--into",
        default=None,
        help="add the export as the next version of each of its models in this "
        "existing repository (the live version stays live: torchship rollout switches)",
    )
    p.add_argument(
        "--keep", type=int, default=3, help="with --into: versions kept on disk per model (the live one always)"
    )
    p.add_argument(
        "--new-signature",
        action="store_true",
        help="with --into: accept inputs or outputs that differ from the served ones",
    )
    p.add_argument(
        "--history", action="store_true", help="list a repository's versions, which is live and where each came from"
    )
    add_dataclass_arguments(p, RepoConfig)


def main_repo(ns: argparse.Namespace) -> int:
    """torchship repo: list a repository's versions (--history), add an export as the next version of each of
    its models (--into), or build a repository (and with --strategy serve the winner under the plain name)."""
    if ns.history:
        return repo_history(ns.export_dir)
    if ns.into:
        return repo_into(ns)
    return repo_build(ns)


def repo_history(repo: str) -> int:
    from torchship.markdown import table

    from .versions import history

    rows = history(repo)
    print(
        "\n".join(
            table(
                ["model", "version", "live", "export", "weights sha256", "added"],
                [
                    [
                        r["model"],
                        r["version"],
                        "live" if r["live"] else "",
                        r.get("export", "-"),
                        (r.get("weights_sha256") or "-")[:12],
                        r.get("added", "-"),
                    ]
                    for r in rows
                ],
            )
        )
    )
    return 0


def repo_into(ns: argparse.Namespace) -> int:
    from .versions import add_version

    if ns.keep < 1:
        raise ConfigError("--keep must be at least 1")
    cfg = build(RepoConfig, {k: v for k, v in namespace_overrides(ns, RepoConfig).items() if k != "out"})
    added = add_version(ns.export_dir, ns.into, cfg, keep=ns.keep, new_signature=ns.new_signature)
    print(f"repository {ns.into}: " + ", ".join(f"{m} version {v}" for m, v in added.items()))
    print(f"switch to them: torchship rollout --url HOST:PORT {ns.into} --check {ns.export_dir}")
    return 0


def repo_build(ns: argparse.Namespace) -> int:
    from torchship.manifest import Export

    from .bench.strategy import pick, serve_by_strategy
    from .repository import build_repository, not_served_text

    cfg = build(RepoConfig, namespace_overrides(ns, RepoConfig))
    export = Export(ns.export_dir)
    manifest = export.manifest
    results = read_bench(cfg.bench) if cfg.bench else None
    if results is not None:  # judged before anything is written
        pick(results, cfg.strategy, manifest)
    res = build_repository(export, cfg)
    print(f"repository {res['path']}: " + ", ".join(f"{m} ({f})" for f, m in res["models"].items()))
    if res["not_served"]:
        print(f"not served: {not_served_text(ns.export_dir, res['not_served'])}")
    entry = res.get("entry")
    if res.get("entry_kind") == "text":
        print(
            f"text entry: {entry} takes a text's UTF-8 bytes (UINT8) and tokenizes it in the server: "
            f'torchship infer --url HOST:PORT --model {entry} --text "..."'
        )
    elif entry:
        print(
            f"image entry: {entry} takes an image file's bytes (UINT8) and prepares it in the server: "
            f"torchship infer --url HOST:PORT --model {entry} photo.jpg"
        )
    if cfg.strategy:
        winner, dest = serve_by_strategy(
            export,
            res["path"],
            cfg.strategy,
            manifest,
            results,
            cfg.only_winner,
            log=lambda line: print(line, flush=True),
            cores=cfg.search_cores(),
        )
        print(f"served as {dest.name}: {winner['why']}")
    print(f"serve it: torchship serve {res['path']}   (official container: see {res['path']}/README.md)")
    return 0


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "repo", nargs="?", default="model_repository", help="Triton model repository (default: model_repository)"
    )
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
        tls = " (TLS, mutual)" if info["mutual_tls"] else " (TLS)" if info["tls"] else ""
        print(f"Triton ready: gRPC {info['grpc']}{tls}  HTTP {info['http']}  metrics {info['metrics']}")
        print(f"models: {', '.join(info['models'])}")
        kept = "" if cfg.log else ", removed after a clean stop: --log FILE keeps one"
        print(f"log: {info['log']}   (Ctrl-C to stop; in-flight requests are drained{kept})")
        print(
            f"control key: {info['key_file']}   (model load/unload, logging, shared memory and trace answer only "
            "to it; torchship's commands on this machine find it there)"
        )
        tls_flags = f" --tls-ca {cfg.tls_ca or cfg.tls_cert}" if info["tls"] else ""
        tls_flags += " --tls-cert CERT --tls-key KEY" if info["mutual_tls"] else ""
        print(
            f"try: torchship infer --url {info['grpc']}{tls_flags} --check EXPORT_DIR   (served outputs against eager)",
            flush=True,
        )
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
    p.add_argument(
        "files",
        nargs="*",
        help="image files (resized to the model's input) or .npy arrays (N,C,H,W or C,H,W) "
        "for an image model; for any model, .npz files keyed by input name, one "
        "request each (arrays with the batch first)",
    )
    add_dataclass_arguments(p, InferConfig)
    add_access_arguments(p)


def main_infer(ns: argparse.Namespace) -> int:
    from .infer import run_infer

    cfg = build(InferConfig, namespace_overrides(ns, InferConfig), {"files": ns.files})
    access_from_arguments(ns, cfg.url)
    return run_infer(cfg)


def read_bench(path: str) -> dict:
    """A bench results.json; ConfigError naming the file if it is missing or not one."""
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--bench {path}: cannot read it as bench results ({type(e).__name__})") from None
    if not isinstance(results, dict) or "served" not in results:
        raise ConfigError(f"--bench {path}: not the results.json of a torchship bench with a served part")
    return results


def add_rollout_arguments(p: argparse.ArgumentParser, rollback: bool = False) -> None:
    p.add_argument("repo", help="the repository the server at --url serves (on a shared volume for a container)")
    p.add_argument("--url", required=True, help="gRPC HOST:PORT of the running Triton (explicit model control)")
    p.add_argument(
        "--check",
        default=None,
        help="export directory whose reference the new version's served outputs must match before it takes traffic",
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=None,
        help="models to switch (default: every model with a version other than the live one to switch to)",
    )
    if rollback:
        p.add_argument(
            "--to", type=int, default=None, help="version to go back to (default: the one before the live one)"
        )
    add_access_arguments(p)


def add_rollback_arguments(p: argparse.ArgumentParser) -> None:
    add_rollout_arguments(p, rollback=True)


def main_rollout(ns: argparse.Namespace) -> int:
    from .model_config import repository_models, versions
    from .rollout import is_candidate, previous, switch
    from .versions import live_version

    repo = Path(ns.repo)
    check_url(ns.url)
    access_from_arguments(ns, ns.url)
    if not repo.is_dir():
        raise ConfigError(f"{repo}: no such repository")
    back = ns.command == "rollback"
    models = ns.models or [
        m
        for m in repository_models(repo)
        if not is_candidate(m)
        and (len(versions(repo / m)) > 1 if back else versions(repo / m)[-1] != live_version(repo / m))
    ]
    if not models:
        print(f"{repo}: nothing to {'roll back' if back else 'roll out'} (every model's newest version is live)")
        return 0
    for m in models:
        target = (ns.to or previous(repo, m)) if back else None
        res = switch(ns.url, repo, m, target, ns.check)
        if res["changed"]:
            print(f"{m}: version {res['live']} live (was {res['was']})")
    return 0


main_rollback = main_rollout
