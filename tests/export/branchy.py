"""A user model factory whose data-dependent branch torch.export cannot capture (TorchScript trace can)."""

from torch import nn


class Branchy(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.fc = nn.Linear(3, num_classes)

    def forward(self, x):
        feats = x.mean(dim=(2, 3))
        if feats.sum() > -1e9:  # data-dependent control flow (always taken, so a trace stays correct)
            feats = feats * 2
        return self.fc(feats)


def branchy(num_classes: int = 10, **kw) -> nn.Module:
    return Branchy(num_classes)
