"""A traced graph that holds at every batch size. torch.jit.trace records Python as it ran on the example: a
model that loops over the pictures of its batch in Python (torchvision's detectors do, in their transform and
postprocessing, and so does any wrapper that calls them) comes out fixed at the example's batch size. Such a
graph fails at any other. A detector traced so is traced again at one picture, and a scripted loop runs that
graph once per picture of the batch (PerPicture): its answers do not depend on the batch, as eager's do not."""

from __future__ import annotations

import weakref
from typing import List, Tuple

import torch
from torch import Tensor

from torchship.errors import ArtifactError, first_line


class PerPicture(torch.nn.Module):
    """``body`` (a graph traced at one picture, one input, the top-K form's four outputs) run on each picture
    of a batch, its outputs joined along the batch. TorchScript carries the loop, and the TorchScript-based ONNX
    exporter turns it into an ONNX Loop."""

    def __init__(self, body: torch.jit.ScriptModule):
        super().__init__()
        self.body = body

    def forward(self, images: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        boxes: List[Tensor] = []
        scores: List[Tensor] = []
        labels: List[Tensor] = []
        count: List[Tensor] = []
        for i in range(images.shape[0]):
            b, s, lab, c = self.body(images[i : i + 1])
            boxes.append(b)
            scores.append(s)
            labels.append(lab)
            count.append(c)
        return torch.cat(boxes), torch.cat(scores), torch.cat(labels), torch.cat(count)


def batch_free(graph, ex: tuple) -> bool:
    """Whether ``graph`` (traced on ``ex``, a batch of 2 or more) runs on a batch of one and answers for one."""
    try:
        with torch.no_grad():
            out = graph(*(x[:1] for x in ex))
    except Exception:
        return False
    outs = out if isinstance(out, (list, tuple)) else [out]
    return all(isinstance(o, Tensor) and o.dim() > 0 and o.shape[0] == 1 for o in outs)


# model -> (the example it was traced on, trace's answer): the TorchScript export and the TorchScript-based ONNX
# export of one model trace it on the same example, and tracing a detector takes seconds (twice, and a run, for
# one that loops per picture). Held no longer than the model.
_traced: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def trace(model: torch.nn.Module, ex: tuple) -> tuple[torch.jit.ScriptModule, bool]:
    """(``model`` as a TorchScript graph that runs at every batch size, whether it loops per picture): traced
    on ``ex``, or where that graph is fixed at ``ex``'s batch size, a per-picture loop (PerPicture) around the
    model traced at one picture. ArtifactError where neither can be had. The caller holds no_grad and the TF32
    setting the trace records. The same model traced again on the very same example tensors gets the same graph
    (callers only read it: torch.jit.freeze and the ONNX exporter work on copies)."""
    seen = _traced.get(model)
    if seen is not None and len(seen[0]) == len(ex) and all(a is b for a, b in zip(seen[0], ex)):
        return seen[1]
    answer = _trace(model, ex)
    _traced[model] = (tuple(ex), answer)
    return answer


def _trace(model: torch.nn.Module, ex: tuple) -> tuple[torch.jit.ScriptModule, bool]:
    graph = torch.jit.trace(model, ex, check_trace=False)
    if batch_free(graph, ex):
        return graph, False
    out = graph(*ex)
    if len(ex) != 1 or not isinstance(out, (list, tuple)) or len(out) != 4:
        raise ArtifactError(
            f"the traced graph is fixed at the example's batch size of {ex[0].shape[0]} (the model loops over its "
            "batch in Python, or reads the batch size as a number): it fails at a batch of 1. Compute on the batch "
            "as a tensor (torchship loops per picture only for a detector: one input, the top-K form's outputs)"
        )
    body = torch.jit.trace(model, tuple(x[:1] for x in ex), check_trace=False)
    try:
        return torch.jit.script(PerPicture(body)), True
    except Exception as e:  # not expected: the loop is plain TorchScript
        raise ArtifactError(f"a per-picture loop around the traced model cannot be scripted: {first_line(e)}") from None
