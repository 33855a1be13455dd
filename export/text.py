"""A text model's tokenizer and its text samples (``export --tokenizer``, ``--text-samples``): which inputs the
tokenizer fills, checked against the signature; the samples as the files a client sends, beside the tensors the
tokenizer makes of them, which join the reference (eager's answers on them are what the served text entry is
held to)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchship.errors import ConfigError
from torchship.images import RAW_COUNT
from torchship.io import sha256_file
from torchship.manifest import RAW_SET, TOKENIZER
from torchship.signature import MASK, Signature, looks_like_mask
from torchship.textio import encode, load_tokenizer


@dataclass
class TextSamples:
    """The tokenizer's spec (the manifest's ``text``, its file not yet placed), and the samples: each text, and
    the model's inputs the tokenizer makes of them (padded to the longest)."""

    spec: dict[str, Any]
    tokenizer: Path
    texts: list[str]
    inputs: dict[str, np.ndarray]


PAD_TOKENS = ("[PAD]", "<pad>", "<|pad|>", "<PAD>")  # BERT's, RoBERTa's and T5's, and their kin


def pad_id(tokenizer) -> int:
    """The id the tokenizer pads with: its padding setting's, else its padding token's (one of PAD_TOKENS);
    ConfigError where it names none, rather than a guess (RoBERTa pads with 1, and 0 is its <s>)."""
    if tokenizer.padding:
        return int(tokenizer.padding["pad_id"])
    found = [t for t in PAD_TOKENS if tokenizer.token_to_id(t) is not None]
    if not found:
        raise ConfigError(
            "--tokenizer: it names no padding token (no padding setting, and none of "
            f"{', '.join(PAD_TOKENS)} in its vocabulary); set the model's own with "
            "tokenizer.enable_padding(pad_id=ID, pad_token=TOKEN) and save it again"
        )
    return int(tokenizer.token_to_id(found[0]))


def text_spec(sig: Signature, tokenizer) -> dict[str, Any]:
    """Which inputs of ``sig`` the tokenizer fills, their dtypes and the sequence range; ConfigError naming what
    does not fit: inputs other than token ids, an attention mask and token type ids; a sequence dim that is not
    named (dynamic); a vocabulary larger than the ids' --input-range."""
    ints = [t for t in sig.inputs if not t.is_float]
    if len(ints) != len(sig.inputs) or not ints:
        raise ConfigError(
            f"--tokenizer: the model's inputs must be token tensors (integer or bool), not "
            f"{', '.join(f'{t.name} ({t.dtype})' for t in sig.inputs if t.is_float)}"
        )
    mask = [t for t in ints if t.values == MASK or looks_like_mask(t.name)]
    types = [t for t in ints if "type" in t.name.lower() and t not in mask]
    ids = [t for t in ints if t not in mask and t not in types]
    if len(ids) != 1 or len(mask) > 1 or len(types) > 1:
        raise ConfigError(
            f"--tokenizer fills token ids, an attention mask (named like *mask*) and token type ids "
            f"(named like *type*); the model takes {', '.join(t.name for t in sig.inputs)}"
        )
    shapes = {tuple(t.shape) for t in ints}
    seq = ids[0].shape[1] if len(ids[0].shape) == 2 else None
    if len(shapes) != 1 or not isinstance(seq, str) or seq not in sig.dims:
        raise ConfigError(
            "--tokenizer: every input must be [B, S] with S a named sequence dim (--dim S=MIN..MAX); "
            f"given {', '.join(f'{t.name} {t.shape}' for t in ints)}"
        )
    lo, hi = sig.dims[seq]
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if ids[0].range is not None and vocab > int(ids[0].range[1]) + 1:
        raise ConfigError(
            f"--tokenizer: its vocabulary holds {vocab} tokens, more than {ids[0].name}'s range "
            f"0..{int(ids[0].range[1])} (the model's embedding); is it the model's own tokenizer?"
        )
    pad = pad_id(tokenizer)
    return {
        "inputs": {
            "ids": ids[0].name,
            "mask": mask[0].name if mask else None,
            "type_ids": types[0].name if types else None,
        },
        "dtypes": {t.name: t.dtype for t in ints},
        "dim": seq,
        "min_length": lo,
        "max_length": hi,
        "pad_id": int(pad),
    }


def load_text(sig: Signature, tokenizer: str, samples: str | None, log=print) -> TextSamples:
    """The tokenizer checked against the signature, and up to RAW_COUNT texts (one per line of ``samples``)."""
    from tokenizers import Tokenizer

    try:
        probe = Tokenizer.from_file(tokenizer)
    except Exception as e:  # the tokenizers package raises its own Exception for a file it cannot read
        raise ConfigError(f"--tokenizer {tokenizer}: not a Hugging Face tokenizer.json ({e})") from None
    spec = text_spec(sig, probe)
    tok = load_tokenizer(tokenizer, spec)
    texts: list[str] = []
    if samples:
        try:
            lines = Path(samples).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--text-samples {samples}: cannot read it as UTF-8 text ({e})") from None
        texts = [line for line in lines if line.strip()][:RAW_COUNT]
        if not texts:
            raise ConfigError(f"--text-samples {samples}: no text in it (one sample per line)")
    else:
        log("text samples: none (--text-samples FILE, one per line, lets infer --check start from text)")
    inputs = encode(tok, texts, spec) if texts else {}
    return TextSamples(spec, Path(tokenizer), texts, inputs)


def write_text(tmp: Path, text: TextSamples) -> tuple[dict[str, Any], dict[str, str]]:
    """The tokenizer and the samples into the export being written: (the manifest's ``text``, the samples' files
    under raw/ by relative path -> sha256)."""
    (tmp / TOKENIZER).parent.mkdir()
    shutil.copyfile(text.tokenizer, tmp / TOKENIZER)
    spec = {**text.spec, "tokenizer": TOKENIZER, "sha256": sha256_file(tmp / TOKENIZER)}
    files = {}
    if text.texts:
        (tmp / RAW_SET).mkdir()
    for i, t in enumerate(text.texts):
        rel = f"{RAW_SET}/text_{i:02d}.txt"
        (tmp / rel).write_text(t, encoding="utf-8")
        files[rel] = sha256_file(tmp / rel)
    return spec, files
