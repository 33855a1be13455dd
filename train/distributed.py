"""Ranks and shards: joining the process group torchrun describes, and each rank's batches of indices."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world: int = 1
    initialized: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> Dist:
    """Join the process group torchrun describes in the environment, if any."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Dist()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        # Before the group exists: torch.distributed.nn.functional (imported by torch._dynamo, which DDP imports)
        # takes group=group.WORLD as a default argument, evaluated at import. Imported after init, those
        # defaults keep the group alive past destroy_process_group, and Gloo's threads run on into interpreter
        # shutdown, where freeing the group at last can abort the rank ("terminate called without an active
        # exception"). Imported now, the defaults are None.
        import torch.distributed.nn as _nn  # noqa: F401  (bound as _nn: a plain import would make torch local here)

        backend = "nccl" if device == "cuda" else "gloo"
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            # torchrun's agent store outlives a worker restart: without a per-attempt prefix a restarted
            # rank can read the dead round's addresses and fail to connect ("Connection refused").

            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                world_size=world,
                is_master=False,
                timeout=timedelta(minutes=10),
            )
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            dist.init_process_group(
                backend, store=dist.PrefixStore(f"torchship/attempt_{attempt}", store), rank=rank, world_size=world
            )
        else:
            dist.init_process_group(backend)
    return Dist(rank, local, world, True)


def rank_batches(ds_len: int, d: Dist, per_rank: int, epoch: int, seed: int, shuffle: bool) -> list[list[int]]:
    """This rank's index batches for one epoch: a disjoint shard, same order on every run."""
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(ds_len, generator=g).tolist()
        usable = (ds_len // (per_rank * d.world)) * per_rank * d.world  # drop the ragged tail
        mine = order[:usable][d.rank :: d.world]
        return [mine[i : i + per_rank] for i in range(0, len(mine), per_rank)]
    mine = list(range(d.rank, ds_len, d.world))  # validation: every sample exactly once overall
    return [mine[i : i + per_rank] for i in range(0, len(mine), per_rank)]


def rank_loader(
    ds, batches: list[list[int]], workers: int, seed: int, collate: Optional[Callable] = None
) -> DataLoader:
    """A DataLoader over ``batches`` (rank_batches), its workers seeded."""
    return DataLoader(
        ds,
        batch_sampler=batches,
        num_workers=workers,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(seed),
        persistent_workers=False,
    )
