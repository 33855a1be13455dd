"""What every part of one bench run reads, read once: the export's manifest, its reference inputs
(their sha256 checked) and the eager model rebuilt from the manifest."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

import numpy as np

from torchship.eager import eager_from_manifest
from torchship.errors import TorchshipError
from torchship.manifest import RAW_SET, Export, bench_inputs, reference_inputs, reference_outputs

SINGLES = 64  # batch-1 requests drawn from the pool for the served parts


@dataclass
class BenchInputs:
    export_dir: Path
    manifest: dict[str, Any]
    pool: dict[str, np.ndarray]  # the inputs requests are drawn from, by input name
    samples: str  # what they are, in words
    eager: Any = None  # the eager model, or None when it cannot be rebuilt (eager_error says why)
    eager_error: Optional[str] = None
    labels: Optional[np.ndarray] = None  # the pool's labels, where it is a labelled real sample set
    expected: Optional[dict[str, np.ndarray]] = (
        None  # the pool's reference outputs by output name (None: random inputs)
    )
    raw_expected: Optional[dict[str, np.ndarray]] = None  # eager on training's tensors of the held-out files
    raw_inputs: Optional[dict[str, np.ndarray]] = None  # those tensors, by input name

    @property
    def rows(self) -> int:
        """Rows of the pool: request ``i`` of ``singles`` is row ``i % rows``."""
        return len(next(iter(self.pool.values())))

    @cached_property
    def singles(self) -> list[dict[str, np.ndarray]]:
        """The batch-1 requests the served parts send in turn, drawn from the pool."""
        return single_rows(self.pool, SINGLES)


def load_inputs(export: Export, shape: dict[str, int] | None, eager: bool = True) -> BenchInputs:
    """The reference inputs (read once per Export; ArtifactError if reference.npz is missing or altered), and
    ``eager`` rebuilt (the in-process part and the limits need it; what is only served does not)."""
    manifest = export.manifest
    ref = export.reference()
    pool, samples, key = bench_inputs(ref, manifest, shape)
    inputs = BenchInputs(
        export.dir,
        manifest,
        pool,
        samples,
        labels=None if shape else ref.get(f"labels/{manifest['reference'].get('samples')}"),
        expected=reference_outputs(ref, manifest, key) if key else None,
        raw_expected=reference_outputs(ref, manifest, RAW_SET) if RAW_SET in manifest["reference"] else None,
        raw_inputs=reference_inputs(ref, manifest, RAW_SET) if RAW_SET in manifest["reference"] else None,
    )
    try:
        inputs.eager = eager_from_manifest(manifest) if eager else None
    except TorchshipError as e:
        inputs.eager_error = str(e)
    return inputs


def real_inputs(pool: dict[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
    """A batch of every input drawn from ``pool`` (tiled if it holds fewer rows)."""
    reps = -(-batch // len(next(iter(pool.values()))))
    return {k: np.ascontiguousarray(np.concatenate([v] * reps)[:batch]) for k, v in pool.items()}


def single_rows(pool: dict[str, np.ndarray], n: int) -> list[dict[str, np.ndarray]]:
    """``n`` batch-1 requests (feeds by input name) drawn from ``pool``."""
    batch = real_inputs(pool, n)
    return [{k: v[i : i + 1] for k, v in batch.items()} for i in range(n)]
