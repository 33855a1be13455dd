"""``torchship infer``: requests from image files, .npy or .npz arrays, or an export's held-out samples,
sent to a served model over gRPC; the answers printed (top-k classes, or every output)."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from torchship.errors import ClientError, DataError, ShapeError
from torchship.tasks import task_of

from .config import InferConfig
from .entries import IMAGE_INPUT, POST_SUFFIX, PRE_SUFFIX, TEXT_INPUT, TEXT_PRE_SUFFIX, entry_target

SHOWN = 6  # values of each output printed per request (--json prints them all)


def run_infer(ns: InferConfig) -> int:
    """The infer command: --check compares every served model with eager; otherwise FILES and --heldout
    samples are sent and the answers printed. Exit 0, or a ClientError/ShapeError/DataError."""
    from .client import TritonClient
    from .parity import check_served, served_markdown

    if ns.check:
        report = check_served(ns.url, ns.check, [ns.model] if ns.model else None, version=ns.version)
        print(json.dumps(report, indent=2) if ns.json else served_markdown(report))
        n = len(report["models"])
        print(f"served parity: PASS ({n} model{'s' if n != 1 else ''} at {ns.url})")
        return 0
    heldout = _check_local_inputs(ns)  # a mistyped path is refused before any connection is tried
    client = TritonClient(ns.url)
    client.wait_ready(10)
    ready = client.require_models([ns.model] if ns.model else [])
    model = ns.model or next((m for m in ready if not m.endswith((PRE_SUFFIX, POST_SUFFIX, TEXT_PRE_SUFFIX))), None)
    if model is None:
        raise ClientError(f"no model is ready at {ns.url}")
    if ns.text:
        model, requests = _text_requests(ns, client, model, ready)
        cfg = client.config(model)
    else:
        images = ns.raw and ns.files and all(is_image_file(f) for f in ns.files)
        entry = raw_entry(client, model, ready, IMAGE_INPUT) if images else None
        if entry and entry != model:  # the server prepares the image as training did: the file goes as it is
            print(
                f"torchship infer: sending the files as they are to {entry}, the image entry in front of {model} "
                "(--no-raw sends tensors)",
                file=sys.stderr,
            )
            model = entry
        cfg = client.config(model)
        requests = _gather(ns, cfg, heldout)
    if not requests:
        raise ClientError("nothing to send: give FILES, --heldout EXPORT_DIR or --check EXPORT_DIR")
    rows, task = [], task_of(cfg)
    for (name, _feeds, label), (outputs, top) in zip(requests, _send_all(client, model, cfg, requests, ns)):
        row: dict[str, Any] = {"input": name}
        if top is not None:  # Triton returns min(top_k, classes) 'score:index:label' entries per row
            entries = [t.decode() if isinstance(t, bytes) else str(t) for t in np.asarray(top).reshape(-1)]
            row["top_k"] = [
                {
                    "score": float(t.split(":")[0]),
                    "index": int(t.split(":")[1]),
                    "label": t.split(":", 2)[2] if t.count(":") >= 2 else "",
                }
                for t in entries
            ]
        read = task.answer_rows(outputs, cfg) if outputs is not None else None
        if read is not None:
            row.update(read)
        elif outputs is not None:
            row["outputs"] = {k: v.tolist() for k, v in outputs.items()}
        if label is not None:
            row["true_label"] = label
        rows.append(row)
    if ns.json:
        print(json.dumps({"model": model, "url": ns.url, "results": rows}, indent=2))
        return 0
    for r in rows:
        parts = []
        if "top_k" in r:
            parts.append(", ".join(f"{t['label'] or t['index']} ({t['score']:.3f})" for t in r["top_k"]))
        lines = task.answer_lines(r["input"], r)
        if lines is not None:  # the task's own reading of an answer (a picture's detections, one a line)
            print("\n".join(lines))
            continue
        for k, v in r.get("outputs", {}).items():
            flat = np.asarray(v).reshape(-1)
            parts.append(
                f"{k} {list(np.shape(v))} [{', '.join(f'{x:.4g}' for x in flat[:SHOWN])}"
                f"{', ...' if flat.size > SHOWN else ''}]"
            )
        truth = f"   [true: {r['true_label']}]" if "true_label" in r else ""
        print(f"{r['input']}: {'   '.join(parts)}{truth}")
    return 0


def takes_image_arrays(cfg: dict[str, Any]) -> bool:
    """One float input laid out NCHW (what image files and .npy arrays are sent to), or an image entry."""
    ins = cfg["input"]
    return (
        len(ins) == 1 and ins[0].get("data_type") == "TYPE_FP32" and ins[0].get("format") == "FORMAT_NCHW"
    ) or takes_files(cfg)


def takes_files(cfg: dict[str, Any], name: str = IMAGE_INPUT) -> bool:
    """A raw entry (torchship repo): one UINT8 vector named ``name``, an encoded image file's bytes as they are
    (``image``), or a text's UTF-8 bytes (``text``)."""
    ins = cfg["input"]
    return (
        len(ins) == 1
        and ins[0].get("data_type") == "TYPE_UINT8"
        and [int(d) for d in ins[0]["dims"]] == [-1]
        and ins[0]["name"] == name
    )


def is_image_file(f: str) -> bool:
    from torchship.images import IMAGE_SUFFIXES

    return Path(f).suffix.lower() in IMAGE_SUFFIXES


def raw_entry(client, model: str, ready, name: str) -> str | None:
    """The raw entry taking ``name`` (IMAGE_INPUT, TEXT_INPUT) that runs ``model`` behind it, where the server has
    one: ``model`` itself where it is that entry."""
    if takes_files(client.config(model), name):
        return model
    for m in ready:
        cfg = client.config(m) if m != model else {}
        if cfg and takes_files(cfg, name) and entry_target(cfg) == model:
            return m
    return None


def _text_requests(ns, client, model: str, ready) -> tuple[str, list[tuple[str, dict[str, np.ndarray], Any]]]:
    """(the model to send to, a request per --text): its UTF-8 bytes to the text entry in front of ``model``, or
    the token tensors --export's tokenizer makes of it (padded to its own length) to the model itself."""
    entry = raw_entry(client, model, ready, TEXT_INPUT) if ns.raw else None
    if entry:
        if entry != model:
            print(
                f"torchship infer: sending the texts to {entry}, the text entry in front of {model}, which "
                "tokenizes them (--no-raw sends tensors)",
                file=sys.stderr,
            )
        return entry, [
            (_shown(t), {TEXT_INPUT: np.frombuffer(t.encode("utf-8"), np.uint8)[None]}, None) for t in ns.text
        ]
    if takes_files(client.config(model), TEXT_INPUT):
        raise ClientError(f"--no-raw: {model} is a text entry, which takes text; name the model behind it")
    if not ns.export:
        raise ClientError(
            ("--no-raw tokenizes here: " if not ns.raw else f"{model} at {ns.url} has no text entry in front of it; ")
            + "give --export EXPORT_DIR to tokenize with its tokenizer"
            + ("" if not ns.raw else ", or serve a repository built from an export made with --tokenizer")
        )
    from torchship.manifest import Export
    from torchship.textio import encode, load_tokenizer

    export = Export(ns.export)
    spec = export.manifest.get("text")
    if not spec:
        raise ClientError(f"--export {ns.export}: it keeps no tokenizer (export with --tokenizer)")
    export.check_files()
    tok = load_tokenizer(str(export.dir / spec["tokenizer"]), spec)
    return model, [(_shown(t), encode(tok, [t], spec), None) for t in ns.text]


def _shown(text: str, width: int = 40) -> str:
    """A text as a result's name: its start, quoted."""
    return repr(text if len(text) <= width else text[: width - 3] + "...")


def input_names(cfg: dict[str, Any]) -> list[str]:
    """A served model's inputs by the manifest's names (what .npz files and --heldout samples are keyed by)."""
    from .model_config import manifest_names

    back = manifest_names(cfg)
    return [back.get(i["name"], i["name"]) for i in cfg["input"]]


def _check_local_inputs(ns) -> dict | None:
    """Every FILE exists and is an image, .npy or .npz file, and --heldout is an export directory (its
    manifest is returned)."""
    from torchship.images import IMAGE_SUFFIXES

    for f in ns.files:
        p = Path(f)
        if not p.is_file():
            raise ClientError(f"{p}: no such file")
        if p.suffix not in (".npy", ".npz") and p.suffix.lower() not in IMAGE_SUFFIXES:
            raise ClientError(f"{p}: not an image, .npy or .npz file")
    if not ns.heldout:
        return None
    from torchship.manifest import read_manifest

    return read_manifest(ns.heldout)


def _load(p: Path):
    try:
        return np.load(p)  # allow_pickle=False: an object array is refused, not unpickled
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"cannot read {p} as a numpy array ({e}); save one with numpy.save or numpy.savez") from None


def _npz_request(p: Path, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """One request from an .npz keyed by input name; ShapeError naming a missing or unknown input."""
    names = input_names(cfg)
    with _load(p) as z:
        feeds = {k: z[k] for k in z.files}
    missing, unknown = [n for n in names if n not in feeds], [k for k in feeds if k not in names]
    if missing or unknown:
        raise ShapeError(
            f"{p}: "
            + "; ".join(
                ([f"no array for input(s) {', '.join(missing)}"] if missing else [])
                + ([f"array(s) {', '.join(unknown)} name no input"] if unknown else [])
            )
            + f" (model {cfg['name']} takes {', '.join(names)})"
        )
    rows = {len(v) if v.ndim else 0 for v in feeds.values()}
    if 0 in rows or len(rows) != 1:
        raise ShapeError(
            f"{p}: every array needs the batch first, and the same number of rows "
            f"(shapes: {', '.join(f'{k} {list(v.shape)}' for k, v in feeds.items())})"
        )
    return {n: feeds[n] for n in names}


def _gather(ns, cfg: dict[str, Any], heldout: dict | None) -> list[tuple[str, dict[str, np.ndarray], Any]]:
    """(name, feeds by input name, true label or None) per request: image files and .npy rows one row per
    request (image models), .npz files one request each, --heldout samples one each."""
    image = takes_image_arrays(cfg)
    dims = [int(d) for d in cfg["input"][0]["dims"]]
    chw = dims[1:] if int(cfg.get("max_batch_size", 0)) == 0 else dims
    first = input_names(cfg)[0]
    out: list[tuple[str, dict[str, np.ndarray], Any]] = []
    for f in ns.files:
        p = Path(f)
        if p.suffix == ".npz":
            out.append((p.name, _npz_request(p, cfg), None))
            continue
        if takes_files(cfg):  # the server decodes and prepares it: send the file as it is
            out.append((p.name, {first: np.frombuffer(p.read_bytes(), np.uint8)[None]}, None))
            continue
        if not image:
            raise ShapeError(
                f"{p}: model {cfg['name']} takes {', '.join(i['name'] for i in cfg['input'])}, not an "
                "image; give one .npz per request, keyed by input name (numpy.savez)"
            )
        if p.suffix == ".npy":
            arr = _load(p)
            arr = arr[None] if arr.ndim == 3 else arr
            if arr.ndim != 4 or list(arr.shape[1:]) != chw:
                raise ShapeError(
                    f"{p}: shape {list(arr.shape)} does not match the model input [N, {', '.join(map(str, chw))}]"
                )
            if arr.dtype.kind != "f":  # 0-255 pixels cast to float would be served as nonsense without an error
                raise ShapeError(
                    f"{p}: dtype {arr.dtype} is not floating point; save float32 pixel values in [0, 1] "
                    "(divide 8-bit images by 255) or pass the image file itself"
                )
            out += [(f"{p.name}[{i}]", {first: row[None].astype(np.float32)}, None) for i, row in enumerate(arr)]
        else:
            try:  # 8-bit pixels / 255 at the model's own height and width, as the ImageFolder data set reads them
                x = task_of(cfg).decode_file(p.read_bytes(), chw)  # as its training and image entry do
            except ValueError as e:
                raise ShapeError(f"{p}: {e}") from None
            out.append((p.name, {first: x[None]}, None))
    if heldout is not None:
        from torchship.manifest import read_reference, reference_inputs, sample_set

        ref = read_reference(ns.heldout, heldout)
        key = sample_set(heldout)
        feeds = reference_inputs(ref, heldout, key)
        labels = ref.get(f"labels/{key}")
        n = len(next(iter(feeds.values())))
        if ns.n > n:
            what = "held-out" if key == "heldout" else f"{key!r}"
            print(f"torchship infer: {ns.heldout} holds {n} {what} samples; sending those", file=sys.stderr)
        for i in range(min(ns.n, n)):
            label = heldout["classes"][int(labels[i])] if labels is not None and heldout.get("classes") else None
            out.append((f"{key}[{i}]", {k: v[i : i + 1] for k, v in feeds.items()}, label))
    return out


def _send_all(client, model: str, cfg: dict[str, Any], requests, ns) -> list:
    """(every output by name or None, the classification rows or None) per request: an image model answers
    with its top-k classes alone; any other with every output, plus the top-k of its first output when that
    output has class labels."""
    image, labelled = takes_image_arrays(cfg) and task_of(cfg).tops_k, bool(cfg["output"][0].get("label_filename"))

    def one(feeds, stream=None):
        top = client.classify(model, feeds, ns.top_k, ns.version, stream) if image or labelled else None
        return (None if image else client.infer_all(model, feeds, ns.version, stream)), top

    if ns.stream:
        stream = client.open_stream(len(requests) * (1 + (labelled and not image)))
        try:
            return [one(feeds, stream) for _, feeds, _ in requests]
        finally:
            stream.close()
    if ns.concurrency <= 1:
        return [one(feeds) for _, feeds, _ in requests]

    with ThreadPoolExecutor(ns.concurrency) as pool:
        return list(pool.map(lambda r: one(r[1]), requests))
