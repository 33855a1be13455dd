"""Training behaviour on CPU: AMP, exact resume, checkpoint contents and crash safety."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from torchship import checkpoint as ck
from torchship.config import build
from torchship.errors import CheckpointError
from torchship.models import build_model
from torchship.train.config import TrainConfig
from torchship.train.loop import train


def cfg(tmp_path, **kw) -> TrainConfig:
    base = {
        "arch": "tiny_cnn",
        "data": "synthetic",
        "synthetic_samples": 128,
        "epochs": 2,
        "batch_size": 16,
        "lr": 1e-2,
        "out": str(tmp_path),
        "progress": False,
        "amp": "off",
    }
    base.update(kw)
    return build(TrainConfig, base)


def losses(out) -> list[float]:
    return [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_bf16_amp_loss_goes_down(tmp_path):
    seen = []
    res = train(cfg(tmp_path, amp="bf16", epochs=6), on_step=lambda i: seen.append(i["step"]))
    ls = losses(tmp_path)
    assert all(b < a for a, b in zip(ls, ls[1:])), ls
    assert ls[-1] < 0.85 * ls[0], ls
    assert json.loads((res.latest / ck.META).read_text())["amp"] == "bf16"


@pytest.mark.parametrize(
    "flags, amp",
    [
        ({"avx2", "fma"}, "off"),
        ({"avx2", "avx512f", "avx512_bf16"}, "bf16"),
        ({"avx2", "amx_tile", "amx_bf16"}, "bf16"),
    ],
)
def test_amp_auto_is_bf16_only_where_the_cpu_computes_it_natively(tmp_path, monkeypatch, capsys, flags, amp):
    """The CPU's features decide, forced both ways here whatever this machine has: the choice and its reason
    are printed once and recorded in the checkpoint's metadata."""
    from torchship import device

    monkeypatch.setattr(device, "cpu_flags", lambda: flags)
    res = train(cfg(tmp_path, amp="auto", epochs=1))
    meta = json.loads((res.latest / ck.META).read_text())
    assert meta["amp"] == amp and meta["train_config"]["amp"] == "auto"
    assert ("computes bf16 natively" if amp == "bf16" else "no native bf16") in meta["amp_reason"]
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("amp ")]
    assert said == [f"amp {amp} (--amp auto): {meta['amp_reason']}"], said


def test_explicit_bf16_on_a_cpu_without_it_runs_with_a_warning(monkeypatch):
    from torchship import device

    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx2"})
    amp, why = device.resolve_amp("bf16", "cpu")
    assert amp == "bf16" and why.startswith("warning: this CPU has no native bf16") and "emulated" in why
    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx512_bf16"})
    assert device.resolve_amp("bf16", "cpu") == ("bf16", "as asked")
    assert device.resolve_amp("off", "cpu") == ("off", "as asked")


def test_cpu_flags_are_read_from_this_machine():
    from torchship import device

    flags = device.cpu_flags()
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo")
    assert "fpu" in flags or "neon" in flags or "asimd" in flags or "fp" in flags, sorted(flags)[:20]
    assert device.native_bf16_flag() == next((f for f in device.NATIVE_BF16_FLAGS if f in flags), None)


def weights(ckpt_dir):
    return torch.load(ckpt_dir / ck.WEIGHTS, weights_only=True)


def run_resumed(tmp_path, name, stop_at, tamper=None):
    first = train(cfg(tmp_path / name, max_steps=stop_at))
    if tamper:
        tamper(first.latest)
    return train(cfg(tmp_path / name, resume=str(tmp_path / name)))


def test_resume_is_bit_exact(tmp_path):
    full = train(cfg(tmp_path / "full", save_every=5))
    resumed = run_resumed(tmp_path, "resumed", stop_at=11)  # 8 steps/epoch: stops mid-epoch 2
    assert resumed.steps == full.steps
    a, b = weights(full.latest), weights(resumed.latest)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"


def test_resume_check_catches_a_planted_fault(tmp_path):
    """Skip one batch in the saved position: the bit-exact comparison must notice."""
    full = train(cfg(tmp_path / "full"))

    def skip_a_batch(d):
        st = torch.load(d / ck.STATE, weights_only=True)
        st["step_in_epoch"] += 1
        torch.save(st, d / ck.STATE)

    resumed = run_resumed(tmp_path, "bad", stop_at=11, tamper=skip_a_batch)
    a, b = weights(full.latest), weights(resumed.latest)
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_loads_weights_only_into_a_fresh_model(trained):
    meta = json.loads((trained / ck.META).read_text())
    sd = torch.load(trained / ck.WEIGHTS, weights_only=True)
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in sd)
    for key in (
        "arch",
        "model_args",
        "classes",
        "preprocessing",
        "input_shape",
        "metrics",
        "torch_version",
        "git_revision",
    ):
        assert key in meta
    model = build_model(meta["arch"], meta["num_classes"], meta["input_shape"][0], meta["model_args"]).eval()
    model.load_state_dict(sd, strict=True)
    held = np.load(trained / ck.HELDOUT)
    x = torch.from_numpy(held["images"][:8])
    from torchship.models import WithPreprocessing

    pre = meta["preprocessing"]
    out1 = WithPreprocessing(model, pre["mean"], pre["std"]).eval()(x)
    model2 = build_model(meta["arch"], meta["num_classes"], meta["input_shape"][0], meta["model_args"]).eval()
    ck.load_into(model2, ck.load_weights(trained), "test")
    out2 = WithPreprocessing(model2, pre["mean"], pre["std"]).eval()(x)
    assert torch.equal(out1, out2)
    assert (out1.argmax(1).numpy() == held["labels"][:8]).mean() > 0.5


def test_crash_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    first = train(cfg(tmp_path, epochs=1))
    before = (tmp_path / "checkpoints" / ck.INDEX).read_text()
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        with open(f, "r+b") as fh:  # leave a truncated file behind, then die
            fh.truncate(100)
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        train(cfg(tmp_path, epochs=2, resume=str(tmp_path)))
    monkeypatch.undo()
    assert (tmp_path / "checkpoints" / ck.INDEX).read_text() == before
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == []
    d = ck.resolve_checkpoint(tmp_path, which="latest")
    assert d == first.latest
    ck.load_weights(d)  # sha256 matches and it loads


def test_corrupt_weights_are_reported(trained, tmp_path):

    bad = tmp_path / "bad"
    shutil.copytree(trained, bad)
    with open(bad / ck.WEIGHTS, "r+b") as f:
        f.truncate(200)
    with pytest.raises(CheckpointError, match="truncated or altered"):
        ck.load_weights(bad)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        ck.load_weights(bad, check_hash=False)


@pytest.mark.slow
def test_compile_profile_and_channels_last_write_a_clean_checkpoint(tmp_path):
    """torch.compile + DDP-free profile + channels_last: the saved keys carry no _orig_mod. prefix."""
    res = train(cfg(tmp_path, epochs=1, compile=True, profile=True, channels_last=True))
    sd = weights(res.latest)
    assert sd and not any(k.startswith(("_orig_mod.", "module.")) for k in sd)
    model = build_model("tiny_cnn", 10, 3)
    model.load_state_dict(sd, strict=True)
    traces = list((tmp_path / "profile").rglob("*.json*"))
    assert traces, "no profiler trace written"
