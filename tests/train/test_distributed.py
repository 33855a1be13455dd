"""Real 2-process torchrun (gloo) runs: disjoint shards, identical parameters, rank-0-only files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def torchrun(*args: str, env=None, timeout=240) -> subprocess.CompletedProcess:
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args],
                          capture_output=True, text=True, timeout=timeout, env=e)


def test_two_ranks_get_disjoint_samples_and_identical_parameters(tmp_path):
    r = torchrun(str(HERE / "ddp_worker.py"), str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    s0 = json.loads((tmp_path / "rank0.json").read_text())
    s1 = json.loads((tmp_path / "rank1.json").read_text())
    assert s0 and s1
    assert not set(s0) & set(s1), "ranks saw the same samples"
    assert len(set(s0)) == len(s0) and len(set(s1)) == len(s1)
    p0, p1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert p0.keys() == p1.keys()
    for k in p0:
        assert torch.equal(p0[k], p1[k]), f"{k} differs across ranks"
    # only rank 0 wrote files: one log, one metrics file, one checkpoint index
    assert (tmp_path / "train" / "checkpoints" / "index.json").exists()
    assert len((tmp_path / "train" / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through Linux's /proc")
def test_a_rank_frees_its_process_group_before_it_exits(tmp_path):
    """After training, no Gloo thread may outlive destroy_process_group: a group freed only at interpreter
    shutdown can abort a rank that has finished its work (SIGABRT, "terminate called without an active
    exception"), and torchrun then reports the whole job failed."""
    r = torchrun(str(HERE / "shutdown_worker.py"), str(tmp_path), "--arch", "tiny_cnn", "--data", "synthetic",
                 "--synthetic-samples", "64", "--epochs", "1", "--batch-size", "16", "--no-progress",
                 "--out", str(tmp_path / "train"))
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        names = json.loads((tmp_path / f"threads{rank}.json").read_text())
        assert not [n for n in names if "gloo" in n], f"rank {rank} still runs Gloo threads after training: {names}"


def test_sharding_check_can_fail(tmp_path, monkeypatch):
    """The disjointness assertion above catches a sampler that hands every rank the same shard."""
    import train.loop as loop

    real = loop._batches

    def same_shard(ds_len, d, per_rank, epoch, seed, shuffle):
        return real(ds_len, loop.Dist(0, 0, d.world, d.initialized), per_rank, epoch, seed, shuffle)

    rank0 = same_shard(96, loop.Dist(0, 0, 2, True), 8, 0, 0, True)
    rank1 = same_shard(96, loop.Dist(1, 1, 2, True), 8, 0, 0, True)
    assert set(sum(rank0, [])) & set(sum(rank1, []))
    good0 = real(96, loop.Dist(0, 0, 2, True), 8, 0, 0, True)
    good1 = real(96, loop.Dist(1, 1, 2, True), 8, 0, 0, True)
    assert not set(sum(good0, [])) & set(sum(good1, []))


@pytest.mark.slow
def test_torchship_train_nproc_2_launches_ranks(tmp_path):
    """The CLI's --nproc path (in-process torchrun launch), end to end."""
    r = subprocess.run([sys.executable, "-m", "torchship.pipeline.cli", "train", "--arch", "tiny_cnn", "--data", "synthetic",
                        "--synthetic-samples", "64", "--epochs", "1", "--batch-size", "16", "--nproc", "2",
                        "--out", str(tmp_path / "o"), "--no-progress"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads(next((tmp_path / "o" / "checkpoints").glob("step-*/meta.json")).read_text())
    assert meta["world_size"] == 2
