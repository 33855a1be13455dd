"""Run under torchrun by test_distributed: records each rank's sample indices, final weights, and the names of
the threads still running once train() has returned (it must have left the process group it joined).
With TORCHSHIP_PLANT_SAME_SHARD=1 every rank is handed rank 0's shard (a planted sampler fault)."""

import json
import os
import sys
from pathlib import Path

import torch

import torchship.train.loop as loop
from torchship.config import build
from torchship.train.config import TrainConfig
from torchship.train.loop import train

if os.environ.get("TORCHSHIP_PLANT_SAME_SHARD") == "1":
    real = loop.rank_batches
    loop.rank_batches = lambda n, d, *a, **k: real(n, loop.Dist(0, 0, d.world, d.initialized), *a, **k)

out = Path(sys.argv[1])
seen: list[int] = []
final: dict = {}


def on_step(info):
    seen.extend(int(i) for i in info["indices"])
    final["model"] = info["model"]
    final["rank"] = info["rank"]


cfg = build(
    TrainConfig,
    {
        "arch": "tiny_cnn",
        "data": "synthetic",
        "synthetic_samples": 96,
        "epochs": 1,
        "batch_size": 16,
        "out": str(out / "train"),
        "progress": False,
        "overwrite": True,
    },
)
train(cfg, on_step=on_step)
rank = final["rank"]
torch.save({k: v.detach().clone() for k, v in final["model"].state_dict().items()}, out / f"rank{rank}.pt")
(out / f"rank{rank}.json").write_text(json.dumps(seen))
threads = sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))
(out / f"threads{rank}.json").write_text(json.dumps(threads))
