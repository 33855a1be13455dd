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


class TopicTexts(torch.utils.data.Dataset):
    """Token sequences of 1..64 ids whose topic (the class) decides which ids they draw from; samples are
    ({attention_mask, input_ids}, topic) (the dict in another order than forward's parameters, which take
    it by keyword), and ``collate_fn`` pads a batch to its longest sequence."""

    classes = ["sports", "music", "food", "travel"]

    def __init__(self, n: int, seed: int, vocab: int = 50, max_len: int = 64):
        g = torch.Generator().manual_seed(seed)
        self.topics = torch.randint(0, len(self.classes), (n,), generator=g)
        self.lengths = torch.randint(1, max_len + 1, (n,), generator=g)
        width = (vocab - 1) // len(self.classes)
        self.ids = [
            1 + int(t) * width + torch.randint(0, width, (int(n_),), generator=g)
            for t, n_ in zip(self.topics, self.lengths)
        ]

    def __len__(self) -> int:
        return len(self.topics)

    def __getitem__(self, i: int):
        ids = self.ids[i]
        return {"attention_mask": torch.ones_like(ids), "input_ids": ids}, int(self.topics[i])

    @staticmethod
    def collate_fn(batch):
        longest = max(len(x["input_ids"]) for x, _ in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.int64)  # id 0 pads, under a mask of 0
        mask = torch.zeros_like(ids)
        for row, (x, _) in enumerate(batch):
            ids[row, : len(x["input_ids"])] = x["input_ids"]
            mask[row, : len(x["input_ids"])] = 1
        return {"attention_mask": mask, "input_ids": ids}, torch.tensor([y for _, y in batch])


def topic_texts():
    """The --data factory of the text classifier: (train, validation)."""
    return TopicTexts(512, seed=0), TopicTexts(128, seed=1)


def tabular():
    """The --data factory of the MLP: 20 float features per sample, the class a fixed linear rule of them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(640, 20, generator=g)
    y = (x @ torch.randn(20, 3, generator=g)).argmax(1)
    return torch.utils.data.TensorDataset(x[:512], y[:512]), torch.utils.data.TensorDataset(x[512:], y[512:])


class ZeroHead(nn.Module):
    """Its last layer starts at zero (as vit_b_16's head does): the output is the same for every input."""

    def __init__(self, features: int = 20, classes: int = 3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 32), nn.ReLU())
        self.head = nn.Linear(32, classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(features))


def zero_head(**kw) -> ZeroHead:
    return ZeroHead(**kw)


class Float32Inside(nn.Module):
    """Casts to float32 inside, as some model code does: it cannot run in float64."""

    def __init__(self, features: int = 20, classes: int = 3):
        super().__init__()
        self.net = nn.Linear(features, classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features.float()).float()


def float32_inside(**kw) -> Float32Inside:
    return Float32Inside(**kw)


def hf_bert(vocab: int = 30522, classes: int = 4) -> nn.Module:
    """A Hugging Face BertForSequenceClassification, small (2 layers of 32), as users bring one: its forward
    takes input_ids and attention_mask and returns a ModelOutput holding the logits."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        num_labels=classes,
    )
    return BertForSequenceClassification(cfg).eval()


class Dtypes(nn.Module):
    """Every input dtype a signature allows, each answered in its own dtype, and a float32 output that depends on
    all of them: what the served tensors' bytes must carry through Triton exactly."""

    def forward(self, f16: torch.Tensor, i32: torch.Tensor, i64: torch.Tensor, flag: torch.Tensor, f32: torch.Tensor):
        return {
            "f16_doubled": f16 * 2,
            "i32_plus_1": i32 + 1,
            "i64_tripled": i64 * 3,
            "flag_negated": ~flag,
            "total": f32 + f16.float() + i32.float() + i64.float() + flag.float(),
        }


def dtypes() -> Dtypes:
    return Dtypes()
