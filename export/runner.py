"""Fresh-process artifact runner: ``python -m export.runner SPEC.json`` loads one artifact the way a
deployment would and writes its outputs on the reference inputs (the verifier compares them)."""

from __future__ import annotations

import json
import resource
import sys
import traceback
from pathlib import Path

import numpy as np

from torchship.errors import first_line


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    from torchship import runtime

    d = Path(spec["export_dir"])
    a = spec["artifact"]
    result: dict = {"ok": False}
    try:
        r = runtime.load_artifact(
            str(d), a, spec["inputs"], spec["outputs"], device=spec["device"], threads=spec["threads"]
        )
        result["input_names"] = r.input_names
        result["output_names"] = r.output_names
        ref = np.load(d / spec["reference"])
        outs = {}
        names = spec["inputs"]
        for key in spec["sets"]:
            got = runtime.in_chunks(
                lambda xs: list(r.run(dict(zip(names, xs))).values()),
                [ref[f"input/{key}/{n}"] for n in names],
                spec["max_batch"],
            )
            for name, out in zip(spec["outputs"], got):
                outs[f"{key}/{name}"] = out
        np.savez(spec["out"], **outs)
        result["ok"] = True
        result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # loading and running it
    except Exception as e:  # reported to the verifier as this artifact's failure
        result["error"] = first_line(e)
        result["traceback"] = traceback.format_exc()[-4000:]
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
