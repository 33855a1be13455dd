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
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
    )


def shard_problems(out: Path) -> list[str]:
    """What is wrong with the samples the two ranks of a ddp_worker run saw: nothing, when each saw its own."""
    s0, s1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    problems = [] if s0 and s1 else ["a rank saw no samples"]
    if set(s0) & set(s1):
        problems.append(f"ranks saw the same samples ({len(set(s0) & set(s1))} of them)")
    if len(set(s0)) != len(s0) or len(set(s1)) != len(s1):
        problems.append("a rank saw a sample twice")
    return problems


@pytest.mark.slow
def test_two_ranks_get_disjoint_samples_and_identical_parameters(tmp_path):
    r = torchrun(str(HERE / "ddp_worker.py"), str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert shard_problems(tmp_path) == []
    p0, p1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert p0.keys() == p1.keys()
    for k in p0:
        assert torch.equal(p0[k], p1[k]), f"{k} differs across ranks"
    # only rank 0 wrote files: one log, one metrics file, one checkpoint index
    assert (tmp_path / "train" / "checkpoints" / "index.json").exists()
    assert len((tmp_path / "train" / "metrics.jsonl").read_text().splitlines()) == 1
    # train() left the group it joined: a Gloo thread still running at interpreter shutdown can abort a
    # rank that has finished its work (SIGABRT, "terminate called without an active exception")
    for rank in (0, 1):
        names = json.loads((tmp_path / f"threads{rank}.json").read_text())
        assert not [n for n in names if "gloo" in n], f"rank {rank} still runs Gloo threads after train(): {names}"


@pytest.mark.slow
def test_the_sharding_check_catches_ranks_that_share_a_shard(tmp_path):
    """Planted: a sampler that hands every rank rank 0's shard, in a real two-rank run."""
    r = torchrun(str(HERE / "ddp_worker.py"), str(tmp_path), env={"TORCHSHIP_PLANT_SAME_SHARD": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert [p.split(" (")[0] for p in shard_problems(tmp_path)] == ["ranks saw the same samples"]


@pytest.mark.slow
def test_torchship_train_nproc_2_launches_ranks(tmp_path):
    """The CLI's --nproc path (in-process torchrun launch), end to end."""
    flags = "--arch tiny_cnn --data synthetic --synthetic-samples 64 --epochs 1 --batch-size 16 --nproc 2".split()
    flags += ["--out", str(tmp_path / "o"), "--no-progress"]
    r = subprocess.run(
        [sys.executable, "-m", "torchship.pipeline.cli", "train", *flags],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads(next((tmp_path / "o" / "checkpoints").glob("step-*/meta.json")).read_text())
    assert meta["world_size"] == 2


def test_a_cuda_rank_takes_its_gpu_and_nccl(monkeypatch):
    """The CUDA branch, forced on any machine: a rank under torchrun selects its local GPU and asks for NCCL."""
    import torch.distributed as dist

    from torchship.train.distributed import init_distributed

    seen = {}
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: seen.setdefault("device", i))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.setdefault("backend", backend))
    d = init_distributed("cuda")
    assert seen == {"device": 1, "backend": "nccl"}
    assert (d.rank, d.local_rank, d.world, d.initialized) == (1, 1, 2, True)
