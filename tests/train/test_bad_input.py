"""Every bad training input is a one-line error naming the problem, and nothing is overwritten."""

import os
import shutil

import pytest

from tests.conftest import run_cli
from torchship.errors import TorchshipError


def err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


BASE = ["train", "--arch", "tiny_cnn", "--epochs", "1", "--no-progress"]


def test_missing_data_folder(tmp_path, capsys):
    assert run_cli(*BASE, "--data", tmp_path / "nope", "--out", tmp_path / "o") == 2
    assert "no such directory" in err_line(capsys)
    assert not (tmp_path / "o").exists()  # refused before the run's folder and log are made


def test_unknown_architecture(tmp_path, capsys):
    assert run_cli("train", "--arch", "resnet9000", "--epochs", "1", "--no-progress", "--out", tmp_path / "o") == 2
    assert "--arch 'resnet9000' is unknown" in err_line(capsys)
    assert not (tmp_path / "o").exists()


def test_empty_data_folder(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    assert run_cli(*BASE, "--data", tmp_path / "data", "--out", tmp_path / "o") == 2
    assert "no images found" in err_line(capsys)


def test_single_class_folder(tmp_path, capsys):
    from PIL import Image

    (tmp_path / "data" / "cat").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (8, 8), (i, 0, 0)).save(tmp_path / "data" / "cat" / f"{i}.png")
    assert run_cli(*BASE, "--data", tmp_path / "data", "--out", tmp_path / "o") == 2
    assert "only one class" in err_line(capsys)


def test_image_folder_trains(tmp_path, capsys):
    from PIL import Image

    for c, color in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
        (tmp_path / "data" / c).mkdir(parents=True)
        for i in range(8):
            Image.new("RGB", (20, 20), tuple(max(0, v - 9 * i) for v in color)).save(tmp_path / "data" / c / f"{i}.png")
    assert run_cli(*BASE, "--data", tmp_path / "data", "--image-size", "16", "--out", tmp_path / "o") == 2
    assert "fewer than --batch-size 64; lower --batch-size" in err_line(capsys)  # 16 images, the default batch
    assert (
        run_cli(*BASE, "--data", tmp_path / "data", "--image-size", "16", "--batch-size", "4", "--out", tmp_path / "o")
        == 0
    )
    assert "weights:" in capsys.readouterr().out


def test_corrupt_resume_checkpoint(trained, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(trained, bad)
    (bad / "train_state.pt").write_bytes(b"not a checkpoint")
    assert run_cli(*BASE, "--data", "digits", "--resume", bad, "--out", tmp_path / "o") == 2
    assert "corrupt or truncated" in err_line(capsys)


def test_checkpoint_of_another_architecture(trained, tmp_path, capsys):
    assert run_cli(*BASE[:2], "resnet18", *BASE[3:], "--resume", trained, "--out", tmp_path / "o") == 2
    assert "holds tiny_cnn with 10 classes" in err_line(capsys)


def test_checkpoint_of_another_class_count(trained, tmp_path, capsys):
    assert (
        run_cli(*BASE, "--data", "synthetic", "--num-classes", "3", "--resume", trained, "--out", tmp_path / "o") == 2
    )
    assert "with 3 classes" in err_line(capsys)


def test_fp16_without_cuda(tmp_path, capsys):
    assert run_cli(*BASE, "--amp", "fp16", "--out", tmp_path / "o") == 2
    assert "--amp fp16 needs CUDA" in err_line(capsys)


def test_resume_that_does_not_exist(tmp_path, capsys):
    assert run_cli(*BASE, "--resume", tmp_path / "missing", "--out", tmp_path / "o") == 2
    assert "does not exist" in err_line(capsys)
    assert not (tmp_path / "o").exists(), "a missing --resume must not start a fresh run"


def test_batch_smaller_than_world_size(tmp_path, capsys):
    assert run_cli(*BASE, "--batch-size", "1", "--nproc", "2", "--out", tmp_path / "o") == 2
    assert "smaller than the world size 2" in err_line(capsys)


def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """Checked with CUDA made to look present (one GPU): each rank takes a GPU of its own, so a second rank
    would fail in torch.cuda.set_device after torchrun had started it."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert run_cli(*BASE, "--data", "synthetic", "--nproc", "2", "--out", tmp_path / "o") == 2
    assert "--nproc 2 starts one rank per GPU, but 1 GPU(s) are visible" in err_line(capsys)
    assert not (tmp_path / "o").exists()


def test_more_ranks_than_cpus_is_noted(tmp_path, monkeypatch, capsys):
    from torchship.config import build
    from torchship.train import launch
    from torchship.train.config import TrainConfig

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    launch.preflight(build(TrainConfig, {"arch": "tiny_cnn", "data": "synthetic", "out": str(tmp_path / "o")}), 2)
    assert "2 ranks on 1 CPU(s) take turns on the cores" in capsys.readouterr().err


def test_default_ranks_are_one_process_on_a_cpu_and_one_per_gpu(monkeypatch):
    """--nproc 0: on a CPU one process using every CPU it may use (the affinity mask's count, not the
    machine's), which trains faster there than DDP ranks; on CUDA one rank per GPU. Each says why."""
    import torch

    from torchship.train import launch

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 5})
    n, why = launch.auto_nproc("cpu")
    assert n == 1 and "one process with 2 thread(s)" in why and "--nproc N runs N DDP ranks" in why
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert launch.auto_nproc("cuda") == (4, "one rank per visible GPU (4)")


def test_existing_output_is_not_overwritten(trained, tmp_path, capsys):
    out = trained.parent.parent
    before = (out / "checkpoints" / "index.json").read_text()
    assert run_cli(*BASE, "--out", out) == 2
    assert "already holds checkpoints" in err_line(capsys)
    assert (out / "checkpoints" / "index.json").read_text() == before


@pytest.mark.parametrize(
    "code, says",
    [
        (
            "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
            r"rank \d was killed by SIGKILL: the kernel's out-of-memory killer",
        ),
        ("raise SystemExit(3)", r"rank \d failed with exit code 3; see its traceback above"),
    ],
)
def test_a_rank_that_dies_without_an_error_is_named(code, says, monkeypatch, tmp_path):
    """A rank killed by the out-of-memory killer leaves no traceback: the launcher says what killed it, and leaves
    nothing behind in the temporary folder (torchrun's agent writes its logs there unless told where)."""
    import tempfile

    from torchship.train.launch import launch_torchrun

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # launch_torchrun sets it if unset; leave this process as it was
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(TorchshipError, match=says):
        launch_torchrun(["-c", code], 2)
    assert not list(tmp_path.iterdir())
