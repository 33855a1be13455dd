"""Run under torchrun by test_detect: trains a detector on two ranks, then scores an oracle that is wrong on the
last validation picture alone, and writes what each rank's mAP was."""

import json
import sys
from contextlib import nullcontext
from pathlib import Path

import torch.distributed as dist

from tests.train.test_detect import Oracle
from torchship.config import build
from torchship.train.config import TrainConfig
from torchship.train.detect import evaluate, load_pictures
from torchship.train.distributed import init_distributed
from torchship.train.loop import train

out = Path(sys.argv[1])
d = init_distributed("cpu")  # joined here, so that it outlives train()
cfg = build(
    TrainConfig,
    {"arch": "tiny_fcos", "pictures": 60, "batch_size": 8, "epochs": 1, "amp": "off", "out": str(out / "train")},
    {"nproc": 1, "progress": False},
)
train(cfg)
_, _, val = load_pictures(cfg, 128)
got = evaluate(Oracle(val, shift=1, last_only=True), val, d, 3, "cpu", nullcontext)
(out / f"rank{d.rank}.json").write_text(json.dumps(got))
dist.destroy_process_group()
