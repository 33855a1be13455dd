"""``torchship repo``, ``torchship serve`` and ``torchship infer``."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

import numpy as np

from torchship.config import add_dataclass_arguments, build, namespace_overrides
from torchship.errors import ClientError, DataError, ShapeError

from .config import RepoConfig, ServeConfig, check_url


def add_repo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("export_dir", help="export directory (with manifest.json) written by torchship export")
    add_dataclass_arguments(p, RepoConfig)


def main_repo(ns: argparse.Namespace) -> int:
    from .repository import build_repository

    cfg = build(RepoConfig, namespace_overrides(ns, RepoConfig))
    res = build_repository(ns.export_dir, cfg)
    print(f"repository {res['path']}: " + ", ".join(f"{m} ({f})" for f, m in res["models"].items()))
    if res["skipped"]:
        print(f"not in the export, skipped: {', '.join(res['skipped'])}")
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
    p.add_argument("files", nargs="*", help="image files (resized to the model's input) or .npy arrays (N,C,H,W or C,H,W)")
    p.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC address HOST:PORT")
    p.add_argument("--model", default=None, help="model name (default: every served model with --check, else the first)")
    p.add_argument("--version", default="", help="model version (default: the server's latest)")
    p.add_argument("--top-k", type=int, default=3, help="classes to print per input (Triton classification extension)")
    p.add_argument("--check", metavar="EXPORT_DIR", default=None,
                   help="send the export's reference inputs to every served model and compare with eager; exit 3 on mismatch")
    p.add_argument("--heldout", metavar="EXPORT_DIR", default=None, help="send N held-out samples of this export")
    p.add_argument("-n", type=int, default=4, help="with --heldout: how many samples")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (async gRPC)")
    p.add_argument("--stream", action="store_true",
                   help="send the requests one at a time over one bidirectional gRPC stream (ModelStreamInfer)")
    p.add_argument("--json", action="store_true", help="print results as JSON")


def main_infer(ns: argparse.Namespace) -> int:
    from .client import TritonClient
    from .parity import check_served, served_markdown

    check_url(ns.url)
    if ns.check:
        report = check_served(ns.url, ns.check, [ns.model] if ns.model else None)
        print(json.dumps(report, indent=2) if ns.json else served_markdown(report))
        n = len(report["models"])
        print(f"served parity: PASS ({n} model{'s' if n != 1 else ''} at {ns.url})")
        return 0
    if ns.top_k < 1 or ns.n < 1 or ns.concurrency < 1:
        raise ClientError("--top-k, -n and --concurrency must be at least 1")
    if ns.stream and ns.concurrency > 1:
        raise ClientError("--stream sends one request at a time; leave out --concurrency, or --stream")
    heldout = _check_local_inputs(ns)  # a mistyped path is refused before any connection is tried
    client = TritonClient(ns.url)
    client.wait_ready(10)
    ready = client.require_models([ns.model] if ns.model else [])
    model = ns.model or next(iter(ready), None)
    if model is None:
        raise ClientError(f"no model is ready at {ns.url}")
    cfg = client.config(model)
    dims = [int(d) for d in cfg["input"][0]["dims"]]
    chw = dims[1:] if int(cfg.get("max_batch_size", 0)) == 0 else dims
    inputs, labels = _gather_inputs(ns, chw, heldout)
    if not inputs:
        raise ClientError("nothing to send: give image/.npy FILES, --heldout EXPORT_DIR or --check EXPORT_DIR")
    results = _run_requests(client, model, inputs, ns)
    rows = []
    for (name, _), res, label in zip(inputs, results, labels):
        # one batch-1 request per input; Triton returns min(top_k, classes) entries
        top = [r.decode() if isinstance(r, bytes) else str(r) for r in np.asarray(res).reshape(-1)]
        rows.append({"input": name, "top_k": [{"score": float(t.split(":")[0]), "index": int(t.split(":")[1]),
                                               "label": t.split(":", 2)[2] if t.count(":") >= 2 else ""} for t in top],
                     **({"true_label": label} if label is not None else {})})
    if ns.json:
        print(json.dumps({"model": model, "url": ns.url, "results": rows}, indent=2))
    else:
        for r in rows:
            best = ", ".join(f"{t['label'] or t['index']} ({t['score']:.3f})" for t in r["top_k"])
            truth = f"   [true: {r['true_label']}]" if "true_label" in r else ""
            print(f"{r['input']}: {best}{truth}")
    return 0


def _check_local_inputs(ns) -> dict | None:
    """Every FILE exists and is an image or .npy file, and --heldout is an export directory (its manifest
    is returned)."""
    from train.data import IMAGE_SUFFIXES

    for f in ns.files:
        p = Path(f)
        if not p.is_file():
            raise ClientError(f"{p}: no such file")
        if p.suffix != ".npy" and p.suffix.lower() not in IMAGE_SUFFIXES:
            raise ClientError(f"{p}: not an image or .npy file")
    if not ns.heldout:
        return None
    from torchship.manifest import read_manifest

    return read_manifest(ns.heldout)


def _gather_inputs(ns, chw: list[int], heldout: dict | None) -> tuple[list[tuple[str, np.ndarray]], list]:
    """The requests to send, checked against the model's input (files as _check_local_inputs left them;
    ``heldout``: the --heldout export's manifest it returned)."""
    from train.data import load_image_file

    inputs, labels = [], []
    for f in ns.files:
        p = Path(f)
        if p.suffix == ".npy":
            try:
                arr = np.load(p)  # allow_pickle=False: an object array is refused, not unpickled
            except (OSError, ValueError, EOFError) as e:
                raise DataError(f"cannot read {p} as a numpy array ({e}); save one with numpy.save") from None
            arr = arr[None] if arr.ndim == 3 else arr
            if arr.ndim != 4 or list(arr.shape[1:]) != chw:
                raise ShapeError(f"{p}: shape {list(arr.shape)} does not match the model input [N, {', '.join(map(str, chw))}]")
            if arr.dtype.kind != "f":  # 0-255 pixels cast to float would be served as nonsense without an error
                raise ShapeError(f"{p}: dtype {arr.dtype} is not floating point; save float32 pixel values in [0, 1] "
                                 "(divide 8-bit images by 255) or pass the image file itself")
            for i, row in enumerate(arr):
                inputs.append((f"{p.name}[{i}]", row[None].astype(np.float32)))
                labels.append(None)
        else:
            inputs.append((p.name, load_image_file(p, chw[-1])[None]))
            labels.append(None)
    if heldout is not None:
        from torchship.manifest import read_reference, reference_inputs

        ref = read_reference(ns.heldout, heldout)
        x, y = next(iter(reference_inputs(ref, heldout, "heldout").values()))[: ns.n], ref["labels/heldout"][: ns.n]
        if ns.n > len(x):
            print(f"torchship infer: {ns.heldout} holds {len(x)} held-out samples; sending those", file=sys.stderr)
        for i, (row, label) in enumerate(zip(x, y)):
            inputs.append((f"heldout[{i}]", row[None]))
            labels.append(heldout["classes"][int(label)])
    return inputs, labels


def _run_requests(client, model: str, inputs, ns) -> list:
    if ns.stream:
        stream = client.open_stream(len(inputs))
        try:
            return [client.infer(model, x, version=ns.version, top_k=ns.top_k, stream=stream) for _, x in inputs]
        finally:
            stream.close()
    if ns.concurrency <= 1:
        return [client.infer(model, x, version=ns.version, top_k=ns.top_k) for _, x in inputs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(ns.concurrency) as pool:
        return list(pool.map(lambda item: client.infer(model, item[1], version=ns.version, top_k=ns.top_k), inputs))
