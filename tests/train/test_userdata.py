"""Training on your own data (--data package.module:factory): the signature read from the samples, the
checkpoint that records it, resume, and data the factory gets wrong. The text model's 2-rank DDP run and
its way through export and serving are in tests/anymodel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.anymodel.models import tabular, topic_texts
from tests.conftest import run_cli
from torchship import checkpoint as ck
from torchship.config import build
from torchship.train.config import TrainConfig
from torchship.train.loop import train
from torchship.train.userdata import infer_signature

MODELS = "tests.anymodel.models"


def cfg(out, **kw) -> TrainConfig:
    return build(
        TrainConfig,
        {
            "arch": f"{MODELS}:text_classifier",
            "data": f"{MODELS}:topic_texts",
            "epochs": 1,
            "batch_size": 32,
            "lr": 0.03,
            "amp": "off",
            "progress": False,
            "out": str(out),
            **kw,
        },
    )


def test_the_signature_is_read_from_the_samples():
    sig = infer_signature(topic_texts()[1], "validation")
    assert [t.name for t in sig.inputs] == ["attention_mask", "input_ids"]
    assert all(t.dtype == "int64" and t.shape == ["batch", "S"] for t in sig.inputs)
    lo, hi = sig.dims["S"]
    assert 1 <= lo < hi <= 64
    assert sig.inputs[0].range == (1, 1) and 1 <= sig.inputs[1].range[0] < sig.inputs[1].range[1] <= 49
    flat = infer_signature(tabular()[1], "validation")
    assert flat.to_flags().startswith("--input input:float32:B,20 --input-range input=") and flat.dims == {}


def test_a_text_model_trains_and_its_checkpoint_records_its_signature(tmp_path, capsys):
    res = train(cfg(tmp_path))
    assert res.best_value > 0.8
    assert "--input attention_mask:int64:B,S --input input_ids:int64:B,S --dim S=" in capsys.readouterr().out
    meta = ck.load_meta(res.best)
    assert meta["arch"] == f"{MODELS}:text_classifier" and meta["data"]["factory"] == f"{MODELS}:topic_texts"
    assert meta["inputs_by"] == "keyword" and meta["classes"] == ["sports", "music", "food", "travel"]
    assert [t["name"] for t in meta["signature"]["inputs"]] == ["attention_mask", "input_ids"]
    with np.load(res.best / ck.HELDOUT) as held:
        mask, ids, labels = held["input/attention_mask"], held["input/input_ids"], held["labels"]
    assert mask.shape == ids.shape and len(labels) == len(ids) == 64
    assert 0 in mask and meta["signature"]["inputs"][0]["range"] == [0, 1]  # collate's padding was seen


def test_a_tensor_input_goes_to_forward_by_position(tmp_path):
    res = train(cfg(tmp_path, arch=f"{MODELS}:mlp", data=f"{MODELS}:tabular", epochs=3))
    meta = ck.load_meta(res.best)
    assert meta["inputs_by"] == "position" and meta["classes"] is None
    assert meta["signature"]["inputs"][0]["shape"] == ["batch", 20] and res.best_value > 0.7


def test_resume_on_your_own_data_is_bit_exact(tmp_path):
    full = train(cfg(tmp_path / "full", epochs=2))
    train(cfg(tmp_path / "r", epochs=2, max_steps=21))  # 16 steps/epoch: stops mid-epoch 2
    resumed = train(cfg(tmp_path / "r", epochs=2, resume=str(tmp_path / "r")))
    assert resumed.steps == full.steps == 32
    a, b = ck.load_weights(full.latest), ck.load_weights(resumed.latest)
    assert all(torch.equal(a[k], b[k]) for k in a)


class Samples(torch.utils.data.Dataset):
    def __init__(self, make):
        self.make = make

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.make(i)


def one_dataset():
    return Samples(lambda i: (torch.zeros(20), 0))


def bare_tensors():
    return Samples(lambda i: torch.zeros(20)), Samples(lambda i: torch.zeros(20))


def float_targets():
    return Samples(lambda i: (torch.zeros(20), 0.5)), Samples(lambda i: (torch.zeros(20), 0.5))


def bf16_inputs():
    return Samples(lambda i: (torch.zeros(20, dtype=torch.bfloat16), 0)), Samples(
        lambda i: (torch.zeros(20, dtype=torch.bfloat16), 0)
    )


def other_keys():
    return (
        Samples(lambda i: ({"a": torch.zeros(2)}, 0)),
        Samples(lambda i: ({"a" if i < 3 else "b": torch.zeros(2)}, 0)),
    )


def broken():
    raise RuntimeError("no such file: corpus.txt")


BAD = {
    "one_dataset": "the factory must return (train_dataset, val_dataset)",
    "bare_tensors": "validation sample 0: a sample must be (inputs, target), got Tensor",
    "float_targets": "the target must be a class index",
    "bf16_inputs": "input 'input' is bfloat16; inputs may be float32",
    "other_keys": "validation sample 3 has inputs ['b'], sample 0 has ['a']",
    "broken": "the factory failed: RuntimeError: no such file: corpus.txt",
    "missing": "cannot import it",
}


@pytest.mark.parametrize("factory", list(BAD))
def test_data_the_factory_gets_wrong_is_refused_before_anything_is_written(factory, tmp_path, capsys):
    assert (
        run_cli(
            "train",
            "--arch",
            f"{MODELS}:mlp",
            "--data",
            f"tests.train.test_userdata:{factory}",
            "--out",
            tmp_path / "o",
            "--no-progress",
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert BAD[factory] in err[-1], err
    assert not (tmp_path / "o").exists()
