"""`torchship run` stopped and refused: Ctrl-C in a stage, a stage whose inputs are missing, a corrupt run record or
config, and every subcommand's --help."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli

CONFIG = Path(__file__).with_name("tiny.toml")


def processes_naming(text: str) -> list[int]:
    """Processes whose command line mentions ``text`` (a run folder: its ranks' --out, the server's repository)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


@pytest.mark.slow
@pytest.mark.parametrize("stage, waits_for", [("train", "epoch 1/"), ("bench", "served: ")])
def test_ctrl_c_ends_with_one_line_and_leaves_no_process(tmp_path, stage, waits_for):
    """Ctrl-C at the terminal (SIGINT to the whole foreground process group) during DDP training or during
    the bench: one line names the stage and the command to go on, no traceback, and no rank, server or
    stub process is left."""
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "torchship.pipeline.cli",
        "run",
        "--out",
        str(out),
        "--config",
        str(CONFIG),
        "--set",
        "train.nproc=2" if stage == "train" else "train.nproc=1",  # DDP ranks to stop; for the bench, the server
        "--set",
        "train.epochs=30" if stage == "train" else "train.epochs=1",
        "--set",
        f"bench.requests={400 if stage == 'train' else 5000}",
        "--set",
        'export.formats=["onnx"]',
        "--set",
        'repo.formats=["onnx"]',
        "--set",
        'bench.variants=["onnx"]',
    ]
    # A shell starts a background job (`cmd &`) with SIGINT ignored, and a child would inherit that: with a
    # handler here instead, the child starts with the default action, as a command typed at a terminal does.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd=Path(__file__).resolve().parents[2],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        signal.signal(signal.SIGINT, inherited)
    seen, deadline = [], time.monotonic() + 240
    try:
        for line in proc.stdout:
            seen.append(line)
            if waits_for in line:
                break
            assert time.monotonic() < deadline, "".join(seen[-20:])
        time.sleep(2.0)  # well inside the stage: ranks training, or the server answering the bench's requests
        # (5,000 per level, tens of seconds: the bench cannot end before the signal on a fast machine)
        os.killpg(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (err + rest)[-3000:]
    assert "Traceback" not in err + rest, err[-3000:]
    last = err.strip().splitlines()[-1]
    go_on = f"--out {out} --overwrite" if stage == "train" else f"--out {out} --from bench"
    assert last.startswith(f"torchship run: interrupted in the {stage} stage") and last.endswith(go_on), err[-2000:]
    time.sleep(1.0)
    assert processes_naming(str(out)) == [], "a rank, server or stub process outlived the run"
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)


def test_from_a_stage_whose_inputs_are_missing(tmp_path, capsys):
    assert run_cli("run", "--out", tmp_path / "empty", "--from", "repo") == 2
    assert "run the 'export' stage first" in capsys.readouterr().err


def test_a_corrupt_run_record_is_refused_before_any_stage_runs(tmp_path, capsys):
    run = tmp_path / "r"
    (run / "model_repository").mkdir(parents=True)
    (run / "run.json").write_text('{"stages": {')  # cut short
    assert run_cli("run", "--out", run, "--from", "check") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run.json is corrupt" in err[0] and "go on --from check" in err[0], err
    assert (run / "run.json").read_text() == '{"stages": {'


def test_the_summary_names_a_file_it_cannot_read(tmp_path):
    """summary.md is written after a failure too, so a bad file must not replace the run's own error."""
    from torchship.pipeline.run import layout
    from torchship.pipeline.summary import summarize

    dirs = layout(tmp_path)
    for d, name in ((dirs["export"], "manifest.json"), (dirs["bench"], "results.json")):
        d.mkdir(parents=True)
        (d / name).write_text("{")
    record = {"stages": {"bench": {"seconds": 1.0}}, "gates": {}, "outcome": {"status": "failed", "stage": "bench"}}
    text = summarize(tmp_path, record)
    for d, name in ((dirs["export"], "manifest.json"), (dirs["bench"], "results.json")):
        assert f"(left out: {d / name} is corrupt" in text


def test_config_errors_name_the_option(tmp_path, capsys):
    import torch

    assert run_cli("run", "--out", tmp_path / "r", "--set", "train.epochz=3") == 2
    assert "unknown option 'epochz' in [train]" in capsys.readouterr().err
    # a section's own errors name the key the user wrote, not the stage command's flag
    assert run_cli("run", "--out", tmp_path / "r", "--set", "bench.requests=abc") == 2
    assert "bench.requests: cannot read 'abc' as int" in capsys.readouterr().err
    assert run_cli("run", "--out", tmp_path / "r", "--set", "serve.grpc_port=70000") == 2
    assert "serve.grpc_port must be a port number" in capsys.readouterr().err
    if not torch.cuda.is_available():  # where training would run is checked before the run folder is made
        assert run_cli("run", "--out", tmp_path / "r", "--amp", "fp16") == 2
        assert "train.amp fp16 needs CUDA" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    (tmp_path / "c.yaml").write_text("trainn:\n  epochs: 1\n")
    assert run_cli("run", "--out", tmp_path / "r", "--config", tmp_path / "c.yaml") == 2
    assert "unknown section [trainn]" in capsys.readouterr().err
    (tmp_path / "c.yaml").write_text("train: [1\n")  # YAML's parse errors span several lines
    assert run_cli("run", "--out", tmp_path / "r", "--config", tmp_path / "c.yaml") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot parse" in err[0] and "line 2, column 1" in err[0], err


@pytest.mark.parametrize("command", ["train", "export", "verify", "repo", "serve", "infer", "bench", "run"])
def test_help_states_each_default_once(command, capsys):
    with pytest.raises(SystemExit) as e:
        run_cli(command, "--help")
    assert e.value.code == 0
    lines = capsys.readouterr().out.replace("\n                        ", " ").splitlines()
    assert lines and not [x for x in lines if x.count("(default") > 1 or "(default: None)" in x or "(default: )" in x]


def test_every_commands_help_answers_without_importing_torch():
    """`torchship COMMAND --help` builds only that command's parser: torch (about 2 s to import) and what trains,
    exports or serves come in when the command runs."""
    from torchship.pipeline.cli import COMMANDS

    code = (
        "import sys\nfrom torchship.pipeline.cli import build_parser\n"
        f"for name in {sorted(COMMANDS)!r}:\n    build_parser(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout[:500] + r.stderr[-2000:]
