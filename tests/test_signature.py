"""Attention masks as inputs of their own kind: random verification data draws them as a tokenizer makes them."""

import numpy as np
import pytest

from torchship.errors import ConfigError
from torchship.signature import MASK, Signature, is_padding_mask, padding_mask, parse_signature

TEXT = ["input_ids:int64:B,S", "attention_mask:int64:B,S"]


def tokenizer_like(draw) -> None:
    """AssertionError unless every mask ``draw(rng, shape)`` gives is a padding mask with at least one 1 per row,
    at every length from 1 up, and draws both a full row and a one-token row once a batch has two rows."""
    rng = np.random.default_rng(0)
    for s in (1, 2, 7, 64):
        for batch in (1, 2, 5, 32):
            m = draw(rng, (batch, s))
            assert m.shape == (batch, s) and np.isin(m, (0, 1)).all()
            rows = m.astype(np.int8)
            assert (rows.sum(1) >= 1).all(), f"a row with no 1 at S={s}, batch {batch}"
            assert (np.diff(rows, axis=1) <= 0).all(), "ones must come first, padding after"
            if batch >= 2:
                assert rows[0].sum() == s and rows[1].sum() == 1


def test_padding_masks_never_have_an_empty_row():
    tokenizer_like(lambda rng, shape: padding_mask(rng, shape, np.int64))
    tokenizer_like(lambda rng, shape: padding_mask(rng, shape, np.bool_))
    m = padding_mask(np.random.default_rng(1), (3, 4, 9), np.int32)  # any leading dims: each row along the last
    assert m.dtype == np.int32 and (m.sum(-1) >= 1).all()


def test_the_check_fails_a_generator_that_can_draw_an_empty_row():
    def planted(rng, shape):  # lengths from 0: what a uniform 0/1 mask amounts to at S=1
        lengths = rng.integers(0, shape[-1], size=shape[0], endpoint=True)
        return (np.arange(shape[-1])[None] < lengths[:, None]).astype(np.int64)

    with pytest.raises(AssertionError, match="a row with no 1"):
        tokenizer_like(planted)


def test_a_mask_is_declared_by_keyword_or_read_from_a_mask_name():
    sig = parse_signature(TEXT, ["S=1..8"], ["input_ids=0..99", "attention_mask=mask"])
    assert sig.inputs[1].values == MASK and not sig.notes
    sig = parse_signature(TEXT, ["S=1..8"], ["input_ids=0..99", "attention_mask=0..1"])
    assert sig.inputs[1].values == MASK and "drawn as padding masks" in sig.notes[0] and "uniform:0..1" in sig.notes[0]
    sig = parse_signature(TEXT, ["S=1..8"], ["input_ids=0..99", "attention_mask=uniform:0..1"])
    assert sig.inputs[1].values is None and sig.inputs[1].range == (0, 1)
    sig = parse_signature(["x:int64:B,S", "flags:int64:B,S"], ["S=1..8"], ["x=0..9", "flags=0..1"])
    assert sig.inputs[1].values is None  # not named like a mask: uniform 0s and 1s
    sig = parse_signature(["input_ids:int64:B,S", "key_padding_mask:bool:B,S"], ["S=1..8"], ["input_ids=0..9"])
    assert sig.inputs[1].values == MASK and "bool input named like a mask" in sig.notes[0]
    with pytest.raises(ConfigError, match="only the batch dim"):
        parse_signature(["mask:int64:B"], [], ["mask=mask"])


def test_a_mask_survives_the_manifest_and_draws_masks():
    sig = parse_signature(TEXT, ["S=1..8"], ["input_ids=0..99", "attention_mask=mask"])
    back = Signature.from_manifest(sig.to_manifest())
    assert back.inputs[1].values == MASK and "--input-range attention_mask=mask" in back.to_flags()
    feeds = back.random_inputs(np.random.default_rng(0), 5, {"S": 8})
    assert is_padding_mask(feeds["attention_mask"]) and feeds["attention_mask"].dtype == np.int64
    assert not is_padding_mask(np.ones((4, 8), np.int64))  # no padding at all: nothing says it is a mask
