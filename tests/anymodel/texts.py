"""A small cased WordPiece tokenizer (the Hugging Face tokenizer.json format) trained here on the standard
library's own docstrings, and sample sentences from the same source: text models tested with no download."""

from __future__ import annotations

import re
from pathlib import Path

CORPUS_MODULES = (
    "json",
    "csv",
    "collections",
    "functools",
    "itertools",
    "pathlib",
    "argparse",
    "logging",
    "subprocess",
    "threading",
    "email",
    "http",
    "textwrap",
    "string",
    "random",
    "datetime",
)


def corpus() -> list[str]:
    """The sentences of the corpus modules' docstrings (and of their public functions' and classes')."""
    import importlib

    docs = []
    for name in CORPUS_MODULES:
        m = importlib.import_module(name)
        docs.append(m.__doc__ or "")
        docs += [
            getattr(m, a).__doc__ or ""
            for a in sorted(dir(m))
            if not a.startswith("_") and callable(getattr(m, a, None))
        ]
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(" ".join(d.split()) for d in docs))
    return [s for s in sentences if 20 <= len(s) <= 200]


def make_tokenizer(path: Path, vocab_size: int = 1000, lowercase: bool = False) -> Path:
    """A BERT-style WordPiece tokenizer ([CLS] text [SEP], cased unless ``lowercase``) written to ``path``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, clean_text=True, handle_chinese_chars=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(
        corpus(), trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False)
    )
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def sample_texts(path: Path, n: int = 12) -> Path:
    """``n`` of the corpus's sentences with capitals in them (which a lowercasing tokenizer reads otherwise),
    one per line, of different lengths."""
    picked = list(dict.fromkeys(s for s in corpus() if re.search(r"\b[A-Z][a-z]+", s)))[::7][:n]
    path.write_text("\n".join(picked) + "\n", encoding="utf-8")
    return path
