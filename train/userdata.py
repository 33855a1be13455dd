"""Your own data: ``--data package.module:factory``, a function of no arguments that returns
``(train_dataset, val_dataset)``. Each sample is ``(inputs, target)``: ``inputs`` a tensor or a dict of
tensors (passed to ``forward`` by keyword), ``target`` a class index. The model's input signature (names,
dtypes, fixed and varying dims, value ranges) is read from the validation samples.

A dataset may carry ``collate_fn`` (to pad samples of different lengths into a batch) and ``classes``
(the class names, for the served model's labels).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from torchship.errors import DataError
from torchship.models import call_factory
from torchship.signature import BATCH, INPUT_DTYPES, MASK, Signature, TensorSpec, dtype_name, is_padding_mask

from .data import DataSplit, heldout_batch

INPUT = "input"  # the name of an input given as a plain tensor, not a dict
SCAN = 64  # validation samples the signature is read from


def split_sample(sample: Any, where: str) -> tuple[dict[str, torch.Tensor], Any]:
    """A sample as ({input name: tensor}, target); DataError naming ``where`` when it has another form."""
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise DataError(
            f"{where}: a sample must be (inputs, target), got {type(sample).__name__}"
            + (f" of {len(sample)}" if isinstance(sample, (tuple, list)) else "")
        )
    x, y = sample
    if isinstance(x, torch.Tensor):
        feeds = {INPUT: x}
    elif isinstance(x, Mapping) and x and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in x.items()):
        feeds = dict(x)
    else:
        raise DataError(f"{where}: inputs must be a tensor or a dict of str -> tensor, got {type(x).__name__}")
    if isinstance(y, torch.Tensor):
        ok = y.numel() == 1 and not y.is_floating_point() and y.dtype != torch.bool
    else:
        ok = isinstance(y, (int, np.integer)) and not isinstance(y, bool)
    if not ok:
        raise DataError(
            f"{where}: the target must be a class index (an int, or an integer tensor of one value); got {y!r:.80}"
        )
    return feeds, y


def infer_signature(ds: Dataset, where: str, scan: int = SCAN) -> Signature:
    """The inputs' signature from the first ``scan`` samples: a dim that varies between samples is dynamic
    over the sizes seen (dims that vary together share one name: S, or S1, S2, ...); integer and float
    inputs get the range of the values seen, which random verification data keeps to."""
    samples = [split_sample(ds[i], f"{where} sample {i}")[0] for i in range(min(scan, len(ds)))]
    names = list(samples[0])
    groups: dict[tuple[int, ...], str] = {}
    specs = []
    for i, s in enumerate(samples):
        if list(s) != names:
            raise DataError(f"{where} sample {i} has inputs {list(s)}, sample 0 has {names}")
    for name in names:
        first = samples[0][name]
        dt = dtype_name(first.dtype)
        if dt not in INPUT_DTYPES:
            raise DataError(
                f"{where}: input {name!r} is {dt}; inputs may be {', '.join(INPUT_DTYPES)} "
                "(cast in the dataset, or inside the model)"
            )
        for i, s in enumerate(samples):
            if s[name].dtype != first.dtype or s[name].dim() != first.dim():
                raise DataError(
                    f"{where} sample {i}: input {name!r} is {dtype_name(s[name].dtype)} "
                    f"{list(s[name].shape)}, sample 0 has {dt} {list(first.shape)}"
                )
        shape: list = [BATCH]
        for axis in range(first.dim()):
            sizes = tuple(int(s[name].shape[axis]) for s in samples)
            if min(sizes) < 1:
                raise DataError(f"{where}: input {name!r} has an empty dim {axis} in some sample")
            shape.append(sizes[0] if len(set(sizes)) == 1 else groups.setdefault(sizes, f"S{len(groups) + 1}"))
        rng = None
        if dt != "bool":
            values = torch.cat([s[name].reshape(-1) for s in samples])
            lo, hi = values.min().item(), values.max().item()
            rng = (float(lo), float(hi)) if first.is_floating_point() else (int(lo), int(hi))
        specs.append(TensorSpec(name, dt, shape, rng))
    dims = {name: (min(sizes), max(sizes)) for sizes, name in groups.items()}
    if len(dims) == 1:  # one varying dim (a sequence length): call it S
        for t in specs:
            t.shape = ["S" if d == "S1" else d for d in t.shape]
        dims = {"S": dims["S1"]}
    return Signature(specs, [], dims)


def load_user_data(spec: str) -> DataSplit:
    """The training and validation datasets --data's factory returns, with the signature read from them
    and the held-out batch export will use."""
    got = call_factory(spec, "--data", error=DataError)
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise DataError(
            f"--data {spec}: the factory must return (train_dataset, val_dataset), got {type(got).__name__}"
        )
    train, val = got
    for what, ds in (("training", train), ("validation", val)):
        try:
            n = len(ds)
        except TypeError:
            raise DataError(
                f"--data {spec}: the {what} dataset has no length (a map-style Dataset is needed: "
                "__len__ and __getitem__)"
            ) from None
        if n == 0:
            raise DataError(f"--data {spec}: the {what} dataset is empty")
    sig = infer_signature(val, f"--data {spec}: validation")
    split_sample(train[0], f"--data {spec}: training sample 0")
    collate = getattr(train, "collate_fn", None)
    feeds, labels = heldout_inputs(val, sig, collate, f"--data {spec}")
    classes = getattr(train, "classes", None)
    return DataSplit(
        train,
        val,
        [str(c) for c in classes] if classes else None,
        None,
        spec,
        signature=widened(sig, feeds),
        collate=collate,
        by_keyword=isinstance(val[0][0], Mapping),
        heldout=(feeds, labels),
    )


def heldout_inputs(
    ds: Dataset, sig: Signature, collate: Optional[Callable], where: str
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The held-out batch (train.data.heldout_batch) by input name, with its targets; DataError when
    collation loses an input or changes a fixed dim."""
    x, y = heldout_batch(ds, collate)
    feeds = {INPUT: x} if isinstance(x, torch.Tensor) else dict(x)
    for t in sig.inputs:
        a = feeds.get(t.name)
        if a is None:
            raise DataError(f"{where}: a collated batch has no input {t.name!r} (it has {', '.join(feeds)})")
        if a.dim() != len(t.shape) or any(isinstance(d, int) and d != s for d, s in zip(t.shape[1:], a.shape[1:])):
            raise DataError(f"{where}: a collated batch has {t.name} of shape {list(a.shape)}, samples have {t.shape}")
    return {t.name: feeds[t.name].numpy() for t in sig.inputs}, y.numpy()


def widened(sig: Signature, feeds: dict[str, np.ndarray]) -> Signature:
    """``sig`` with its dim and value ranges grown to hold ``feeds``: collation pads, so a batch can be
    longer than any sample and hold values (a mask's 0) no sample has. An input that the collated batch shows
    to be a padding mask (rows of ones, then zeros) is recorded as one, so that verification draws masks as
    the collation makes them rather than rows with no 1 at all."""
    dims = dict(sig.dims)
    for name, size in sig.dims_of(feeds).items():
        dims[name] = (min(dims[name][0], size), max(dims[name][1], size))
    specs = []
    for t in sig.inputs:
        rng = t.range
        if rng is not None:
            cast, a = type(rng[0]), feeds[t.name]
            rng = (min(rng[0], cast(a.min())), max(rng[1], cast(a.max())))
        specs.append(
            TensorSpec(t.name, t.dtype, list(t.shape), rng, MASK if is_padding_mask(feeds[t.name]) else t.values)
        )
    return Signature(specs, [], dims)
