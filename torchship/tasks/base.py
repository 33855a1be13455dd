"""Task: the questions shared code asks of a task, each answered by classification.py and detection.py."""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np


class Task:
    """One task's answers. ``name`` is what a checkpoint's meta and an export's manifest record; ``short`` the
    --task spelling; ``metric`` the key of the checkpoint metric its gate reads, with ``gate_setting`` the
    [run] setting that holds the floor; ``unit`` what a sample is called in training's log."""

    name: str
    short: str
    metric: str
    gate_setting: str
    unit: str
    options_unsupported: tuple[str, ...] = ()  # TrainConfig options its training cannot take
    defaults: dict[str, Any] = {}  # TrainConfig defaults that differ by task
    maps_back = False  # its image entry has a last step mapping the model's answer back to the picture
    labels_file = False  # its first output carries Triton's classification extension (labels.txt)

    def records(self, record: dict[str, Any]) -> bool:
        """Whether a checkpoint's meta, a manifest or a served config (JSON form) is this task's."""
        raise NotImplementedError

    def trains_arch(self, arch: str) -> bool:
        """Whether --task auto trains ``arch`` as this task."""
        raise NotImplementedError

    # the checkpoint and the eager model
    def build(self, meta: dict[str, Any]):
        """The plain model a checkpoint's meta describes, untrained."""
        raise NotImplementedError

    def eager(self, model, meta: dict[str, Any], names: list[str], src: dict[str, Any]):
        """What an export of a checkpoint's ``model`` runs: the model with its preprocessing and postprocessing."""
        raise NotImplementedError

    def gate_line(self, value: float, floor: float) -> str:
        """The train stage's gate in words."""
        raise NotImplementedError

    # export
    needs_truth = False  # its reduced precisions are gated on the real samples' ground truth, which must be there

    def reduced_left_out(self, has_truth: bool) -> str:
        """Why the default formats leave its reduced precisions out of an export (``has_truth``: whether the
        samples come with their ground truth); "" where they are not left out."""
        if self.needs_truth and not has_truth:
            return "no ground truth for the samples to gate them on (a checkpoint's held-out split has it)"
        return ""

    def reduced_gate(self, max_accuracy_drop: float) -> dict[str, Any]:
        """The gate a reduced-precision artifact (INT8, bf16) is verified under, written into its manifest entry."""
        from .. import parity

        return {**parity.GATE, "max_accuracy_drop": max_accuracy_drop}

    def check_reduced_sets(self, manifest, ref, got, gate: dict[str, Any], name: str, rows) -> list[str]:
        """A reduced-precision artifact's (or served model's) outputs, ``got(set, output)``, on every reference set
        under its gate: the real samples gated, the others checked for shape and finiteness. Fills ``rows`` by
        set; returns the failures."""
        from .. import parity

        return parity.check_quantized_sets(manifest, ref, got, gate, name, rows)

    def gate_words(self, row: dict[str, Any]) -> str:
        """A reduced precision's gate figures on the real samples (its row of check_reduced_sets), in words."""
        from .. import parity

        return parity.gate_words(row)

    def check_formats(self, formats, dtype: str) -> None:
        """ConfigError for an export format or --dtype this task's models are not exported to."""

    def derive(self, block: Optional[dict[str, Any]], sets: list[str]) -> Callable:
        """How the reference derives the bounds from eager's outputs (torchship.parity.derive's signature);
        ``block``: what the manifest records of the task's outputs; ``sets``: the input sets' names, in the
        order of the lists it is given."""
        from .. import parity

        return parity.derive

    # parity
    def check_sets(self, tf32: bool) -> Callable:
        """The rule an artifact's or a served model's outputs are held to on the reference sets:
        ``check(manifest, ref, got(set, output), tol, name, sets=None)`` -> [(set, output, row, failure)]."""
        raise NotImplementedError

    pass_rule: str = ""

    def report_lines(self, artifacts: dict[str, Any]) -> list[str]:
        """parity.md's lines after the shared table."""
        return []

    def summary_lines(self, manifest: dict[str, Any]) -> Optional[list[str]]:
        """The run summary's parity section; None: the shared table."""
        return None

    def blind(self, degenerate: list[str]) -> list[str]:
        """Of the outputs the reference found degenerate, those that leave a check blind."""
        return degenerate

    # serving
    def label_parameters(self, manifest: dict[str, Any]) -> dict[str, str]:
        """Config parameters that name its labels for a client (torchship infer)."""
        return {}

    def response_rule(self, manifest: dict[str, Any], tol: dict[str, Any]) -> Optional[dict[str, Any]]:
        """How the bench matches a response to the expected one where the bounds alone do not: None for the
        bounds."""
        return None

    def picture_preprocessing(self, block: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        """What its image entry does to a picture file, where it differs from training's preprocessing; ``block``:
        what the manifest records of the task's outputs."""
        return None

    def for_picture_files(self, manifest, outs, files: list[bytes], tol):
        """(the answers its image entry must give for ``files``, from the reference's on training's tensors of
        them; the bound they are held to)."""
        return outs, tol

    entry_step = "preprocessing"  # what its image entry's first step is called in a failure's words

    def check_files(self, manifest, ref, answers, files: list[bytes], tol, what: str, tf32: bool) -> list[tuple]:
        """(output or None for all, row, failure or None) of a raw entry's ``answers`` on the held-out ``files``
        against the reference's on training's tensors of the same files (RAW_SET)."""
        from ..manifest import RAW_SET

        check = self.check_sets(tf32)
        got = check(manifest, ref, lambda key, o: answers.get(o), tol, what, sets={RAW_SET: len(files)})
        return [(o, row, failure) for _, o, row, failure in got]

    def check_own_files(self, manifest, answers, mine, files: list[bytes], row, what: str, against: str):
        """(row, failures) of a raw entry's ``answers`` on ``files`` against ``mine``, the answers of the
        reduced-precision model behind it on training's tensors of the same files (its gate held it to eager
        already; ``row``: its gate's row on the real samples, the gate in it): within its gate's floors, with
        every top-1 the same."""
        from .. import parity

        first = manifest["outputs"][0]["name"]
        gate = {**row["gate"], "min_top1_agreement": 1.0}
        return parity.check_quantized(answers, mine, None, gate, what, len(answers[first]), True, against)

    def reduced_response_rule(self, manifest: dict[str, Any], row: dict[str, Any]) -> Optional[dict[str, Any]]:
        """How the bench matches a reduced-precision model's responses to its own idle answers, from its gate row
        on the real samples (``row``); None: the gate's SQNR floor."""
        return None

    def decode_file(self, data: bytes, chw) -> np.ndarray:
        """A picture file as a [C, H, W] float32 tensor of the size ``chw`` a served model takes."""
        raise NotImplementedError

    tops_k = True  # its model answers with top-k classes (Triton's classification extension)

    def answer_rows(self, outputs: dict[str, np.ndarray], cfg: dict[str, Any]) -> Optional[dict[str, Any]]:
        """torchship infer's reading of one answer; None: every output as it is."""
        return None

    def answer_lines(self, name: str, row: dict[str, Any]) -> Optional[list[str]]:
        """torchship infer's lines for a row answer_rows read; None: the shared lines."""
        return None
