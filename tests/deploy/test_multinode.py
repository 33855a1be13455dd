"""Multi-node rendezvous and restart, for real: torchrun processes on this machine over c10d on 127.0.0.1."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torchship.serve.embedded.process import free_ports

pytestmark = pytest.mark.slow  # real servers, compiles or processes: the full run, not the fast tier

TRAIN = "-m torchship.train --arch tiny_cnn --data synthetic --synthetic-samples 96 --batch-size 16 --epochs 2".split()
TRAIN += ["--seed", "3", "--no-progress"]


def torchrun(args, out, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args, *TRAIN, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        **kw,
    )


def final_weights(out):
    index = json.loads((out / "checkpoints" / "index.json").read_text())
    return torch.load(out / "checkpoints" / index["latest"] / "model.pt", weights_only=True)


def test_two_nodes_over_c10d_match_one_node_with_two_processes(tmp_path):
    single = torchrun(["--standalone", "--nproc-per-node=2"], tmp_path / "single")
    out_single = single.communicate(timeout=300)[0]
    assert single.returncode == 0, out_single[-3000:]
    port = free_ports()[0]
    nodes = [
        torchrun(
            [
                "--nnodes=2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=torchship-test",
            ],
            tmp_path / "multi",
        )
        for _ in range(2)
    ]
    outs = [n.communicate(timeout=300)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), outs[0][-2000:] + outs[1][-2000:]
    a, b = final_weights(tmp_path / "single"), final_weights(tmp_path / "multi")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (
        json.loads(next((tmp_path / "multi" / "checkpoints").glob("step-*/meta.json")).read_text())["world_size"] == 2
    )


def workers_of(pid):
    """Direct children of the torchrun agent: the rank processes it started (ours)."""
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == pid:
                    kids.append(int(d))
            except (OSError, IndexError):
                pass
    return kids


def test_killed_worker_restarts_and_resumes_from_the_last_checkpoint(tmp_path):
    out = tmp_path / "job"
    # TRAIN's flags, plus a checkpoint every 2 steps and automatic resume, as in deploy/k8s/train-job.yaml
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        *TRAIN[:-3],
        "--epochs",
        "6",
        "--seed",
        "3",
        "--save-every",
        "2",
        "--resume",
        "auto",
        "--no-progress",
        "--out",
        str(out),
    ]
    job = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    index = out / "checkpoints" / "index.json"
    deadline = time.time() + 180
    while not index.exists() and time.time() < deadline and job.poll() is None:
        time.sleep(0.05)
    assert index.exists(), "no checkpoint was written"
    victims = workers_of(job.pid)
    assert victims, "no worker processes found"
    os.kill(victims[-1], signal.SIGKILL)
    log = job.communicate(timeout=300)[0]
    assert job.returncode == 0, log[-3000:]
    train_log = (out / "train.log").read_text()
    assert "resumed from" in train_log, train_log
    epochs = [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert epochs[-1] == 6, epochs
