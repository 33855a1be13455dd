"""The raw entry under load: the export's held-out files sent as they are to ``<name>_image`` (or its texts to
``<name>_text``), every response checked, beside the model behind it fed tensors. What a request holds on the
wire for each, and the time the server spends preparing a file (Triton's statistics of the preprocessing
model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from torchship.manifest import raw_files
from torchship.markdown import cell, table
from torchship.names import format_of
from torchship.tasks import task_of

from ..client import request_feeds
from ..entries import entry_of, entry_target
from .checks import checked_text, response_check
from .inputs import BenchInputs, single_rows
from .stats import settled_stats, stats_delta, stats_of


@dataclass
class EntryRun:
    """The raw entry's sweep, prepared: the held-out files as requests, and the check of their answers (held
    to the bound of the model behind the entry against eager on training's tensors of the same files; a reduced
    precision: to its own answers on the idle server, under its gate's SQNR floor). The sweep itself is
    bench_served's, with torchship's Python client: the files differ in size, which perf_analyzer's fixed
    inputs do not carry. A text entry's texts differ in length, and so in what the model computes: the model
    behind it is swept again with the token tensors of the same texts (``tensor_feeds``), each at its own
    length, as a client that tokenizes sends them."""

    model: str
    kind: str  # "image" or "text"
    pre: str  # its preprocessing model, whose statistics time the decoding
    target: str
    fmt: str | None
    feeds: list[dict[str, np.ndarray]]
    files: list[bytes]
    check: Any
    before: dict[str, Any]
    tensor_feeds: list[dict[str, np.ndarray]] | None = None
    tensor_check: Any = None

    @classmethod
    def prepare(cls, inputs: BenchInputs, client) -> "EntryRun":
        manifest = inputs.manifest
        entry = entry_of(manifest)
        files = [data for _, data in raw_files(inputs.export_dir, manifest)]
        feeds = [{entry.input: np.frombuffer(data, np.uint8)[None]} for data in files]
        target = entry_target(client.config(entry.name))
        fmt = format_of(target, manifest, client.config(target))
        expected, tol = inputs.raw_expected, manifest["tolerances"]
        if expected is not None:  # what the entry answers for the files (a detector: in each picture's own pixels)
            expected, tol = task_of(manifest).for_picture_files(manifest, expected, files, tol)
        check = response_check(client, entry.name, manifest, fmt, expected, feeds, len(feeds), tol)
        run = cls(entry.name, entry.kind, entry.pre, target, fmt, feeds, files, check, stats_of(client, entry.pre))
        if entry.kind == "text":
            run.tensor_feeds = [tokens_of(manifest, inputs.raw_inputs, i) for i in range(len(files))]
            run.tensor_check = response_check(
                client, target, manifest, fmt, inputs.raw_expected, run.tensor_feeds, len(files)
            )
        return run

    def finish(
        self, client, rows: list[dict[str, Any]], inputs: BenchInputs, tensor_rows: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """What the sweep measured (and ``tensor_rows``: the model behind, on the texts' tensors), with what a
        request holds and the server's time preparing a file."""
        done = int(self.before.get("inference_stats", {}).get("success", {}).get("count", 0) or 0)
        after = settled_stats(client, self.pre, done + sum(r["sent"] for r in rows))
        sizes = sorted(request_feeds(self.model, f).ByteSize() for f in self.feeds)
        median = sorted(range(len(self.files)), key=lambda i: len(self.files[i]))[len(self.files) // 2]
        tensor = single_rows(inputs.pool, 1)[0] if self.tensor_feeds is None else self.tensor_feeds[median]
        return {
            "model": self.model,
            "kind": self.kind,
            "target": self.target,
            "format": self.fmt,
            "files": len(self.files),
            "file_bytes": sorted(len(d) for d in self.files)[len(self.files) // 2],
            "request_bytes": sizes[len(sizes) // 2],  # the median file's ModelInferRequest, as gRPC carries it
            "tensor_request_bytes": request_feeds(self.target, client.to_wire(self.target, tensor)).ByteSize(),
            "preprocessing": stats_delta(self.before, after),
            "rows": rows,
            **({"tensor_rows": tensor_rows} if tensor_rows is not None else {}),
        }


def tokens_of(manifest: dict[str, Any], feeds: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """The token tensors of the ``i``-th sample text as a client that tokenizes would send them: its row of the
    tokenizer's tensors, cut to its own length."""
    n = int(feeds[manifest["text"]["inputs"]["mask"]][i].sum()) if manifest["text"]["inputs"]["mask"] else None
    return {k: v[i : i + 1, :n] for k, v in feeds.items()}


def entry_lines(served: dict[str, Any]) -> list[str]:
    """The report's section on the raw entry: its figures beside the model behind it, and what a request holds."""
    e = served.get("entry")
    if not e:
        return []
    text = e.get("kind") == "text"
    title = "## The text entry" if text else "## The image entry"
    if "error" in e:
        return [title, "", f"{e['model']} could not be timed: {e['error']}", ""]
    behind = e.get("tensor_rows") or served.get("models", {}).get(e["target"], {}).get("rows", [])
    rows = [
        [
            m,
            holds,
            f"{size:,}",
            str(r["concurrency"]),
            cell(r.get("p50_ms")),
            cell(r.get("p99_ms")),
            cell(r["requests_per_s"], ".0f"),
            cell(r.get("client_cpu_us"), ".0f"),
            cell(r.get("server_cpu_us"), ".0f"),
            checked_text(r),
        ]
        for m, holds, size, rs in (
            (e["model"], "the text" if text else "the image file", e["request_bytes"], e["rows"]),
            (e["target"], "token tensors" if text else "float32 tensor", e["tensor_request_bytes"], behind),
        )
        for r in rs
    ]
    pre = e.get("preprocessing", {})
    what = (
        f"takes the text as it is and tokenizes it in the server with the export's tokenizer, then runs "
        f"`{e['target']}` ({e['format']}); here its requests carry the export's {e['files']} sample texts in turn "
        f"(median {e['file_bytes']:,} bytes), each answer held to {e['target']}'s bound against eager on the "
        f"tokenizer's tensors of the same text. Bytes a request: the median gRPC request as sent, against "
        f"{e['tensor_request_bytes']:,} for the median text's token tensors, as a client that tokenizes sends them"
        if text
        else f"takes the image file as it is and prepares it in the server as training did, then runs "
        f"`{e['target']}` ({e['format']}); here its requests carry the export's {e['files']} held-out files in "
        f"turn (median {e['file_bytes']:,} bytes), each answer held to {e['target']}'s bound against eager on "
        f"training's tensors of the same file. Bytes a request: the median gRPC request as sent, against "
        f"{e['tensor_request_bytes']:,} for the tensor"
    )
    return [
        title,
        "",
        f"`{e['model']}` {what} ({e['tensor_request_bytes'] / e['request_bytes']:.1f}x). The entry's requests go "
        "out from torchship's Python client (the files differ in size); "
        + (
            "the tensor model's rows here carry the same texts' token tensors, each at its own length (padded in "
            "the server, the texts batch by their padded length)."
            if e.get("tensor_rows")
            else "the tensor model's rows are the sweep's above."
        ),
        "",
        *table(
            [
                "model",
                "a request holds",
                "bytes a request",
                "concurrency",
                "p50 ms",
                "p99 ms",
                "req/s",
                "client CPU µs/req",
                "server CPU µs/req",
                "checked",
            ],
            rows,
        ),
        "",
        f"- Preparing a {'text in the server (tokenize, pad' if text else 'file in the server (decode, resize, scale'}"
        "; Triton's statistics of the preprocessing model): "
        f"{pre.get('busy_us', pre.get('compute_infer_us', 0)):.0f} µs a request (its executions' time over their "
        f"requests; a request waited {pre.get('compute_infer_us', 0):.0f} µs for its batch, one file after another, "
        f"plus {pre.get('queue_us', 0):.0f} µs queued; average batch {pre.get('avg_batch', 0):.1f}).",
        "",
    ]
