"""Text to the token tensors a model takes, exactly as the export recorded it: the one tokenizer (a Hugging Face
``tokenizer.json``) that the export's reference and the served text entry both run. It needs numpy and the
``tokenizers`` package only (not torch), so the server's preprocessing model can carry it as one file.

A spec (the manifest's ``text``) names the inputs it fills: ``ids`` (token ids), ``mask`` (the attention mask,
1 on a token, 0 on padding) and ``type_ids`` (segment ids, all 0 for one text), their dtypes, and the sequence
range the model was exported for: a text is cut to ``max_length`` tokens (special tokens included) and padded
with ``pad_id``. Refuses, with the reason in words (ValueError): an empty request and bytes that are not UTF-8."""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_BYTES = 1 << 20  # a request's text: a megabyte is far more than any sequence range keeps


def load_tokenizer(path: str, spec: dict[str, Any]):
    """The tokenizer at ``path``, cutting at the spec's max_length and padding nothing itself (encode pads)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.enable_truncation(max_length=int(spec["max_length"]))
    return tok


def decode_text(data: bytes, max_bytes: int = MAX_BYTES) -> str:
    """A request's bytes as the text they encode; ValueError saying why where they are not usable text."""
    if not len(data):
        raise ValueError("the request holds no bytes: send the text, UTF-8 encoded")
    if len(data) > max_bytes:
        raise ValueError(
            f"the text is {len(data):,} bytes, more than the {max_bytes:,} this server reads; "
            "send less (the model reads its first tokens only)"
        )
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"the bytes are not UTF-8 text ({e.reason} at byte {e.start}); send the text UTF-8 encoded"
        ) from None


PAD_MULTIPLE = 16  # the server pads a text to a multiple of this many tokens


def bucket(length: int, spec: dict[str, Any]) -> int:
    """The length a sequence of ``length`` tokens is padded to in the server: the next multiple of PAD_MULTIPLE,
    within the exported range, so requests of near lengths batch together while the padding the model computes
    stays small."""
    lo, hi = int(spec["min_length"]), int(spec["max_length"])
    return max(lo, min(-(-length // PAD_MULTIPLE) * PAD_MULTIPLE, hi))


def encode(tok, texts: list[str], spec: dict[str, Any], bucketed: bool = False) -> dict[str, np.ndarray]:
    """The texts as the model's inputs, by input name: each tokenized with its special tokens, cut to
    max_length, and padded to the longest (at least min_length), or with ``bucketed`` to its bucket."""
    encodings = [tok.encode(t) for t in texts]
    longest = max(max(len(e.ids) for e in encodings), int(spec["min_length"]))
    width = bucket(longest, spec) if bucketed else longest
    names, dtypes = spec["inputs"], spec["dtypes"]
    ids = np.full((len(texts), width), int(spec["pad_id"]), np.int64)
    mask = np.zeros((len(texts), width), np.int64)
    types = np.zeros((len(texts), width), np.int64)
    for i, e in enumerate(encodings):
        ids[i, : len(e.ids)] = e.ids
        mask[i, : len(e.ids)] = 1
        types[i, : len(e.ids)] = e.type_ids
    out = {names["ids"]: ids, names.get("mask"): mask, names.get("type_ids"): types}
    return {k: v.astype(dtypes[k]) for k, v in out.items() if k}
