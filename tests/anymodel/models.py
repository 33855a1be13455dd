"""Models that are not image classifiers, defined the way users write them, for the any-signature tests."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """A tabular classifier: float32 [B, features] -> logits."""

    def __init__(self, features: int = 20, classes: int = 3, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)


def mlp(**kw) -> MLP:
    return MLP(**kw)


class TextClassifier(nn.Module):
    """A small transformer encoder over token ids with an attention mask; returns a dict of two outputs."""

    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4, classes: int = 4, max_len: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, max_len, dim) * 0.02)
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm2 = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        b, s = input_ids.shape
        x = self.embed(input_ids) + self.pos[:, :s]
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        keep = attention_mask[:, None, None, :].bool()
        att = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        att = att.masked_fill(~keep, -1e4).softmax(-1)
        x = self.norm1(x + self.proj((att @ v).transpose(1, 2).reshape(b, s, -1)))
        x = self.norm2(x + self.ff(x))
        m = attention_mask[..., None].to(x.dtype)
        embedding = (x * m).sum(1) / m.sum(1).clamp(min=1.0)
        return {"logits": self.head(embedding), "embedding": embedding}


def text_classifier(**kw) -> TextClassifier:
    return TextClassifier(**kw)


class LengthBaked(nn.Module):
    """Right at any length in eager; a trace keeps the traced length as a constant (Python float of a size)."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.lin = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.sum(1) / float(x.shape[1]))


def length_baked(**kw) -> LengthBaked:
    return LengthBaked(**kw)
