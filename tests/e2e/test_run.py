"""`torchship run` end to end on a tiny configuration: every stage, --from export, and a failing gate."""

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.helpers import alter_onnx_weight, rehash_version, scale
from torchship.io import sha256_file

CONFIG = Path(__file__).with_name("tiny.toml")
RUN_KEY = "the-run-servers-key-7c1f0a9e"  # the key the run's server answers to, known here to look for it


# the placement fixed, so the run searches none: the module's first run and tests/serve/test_strategy.py search it
ONE_PLACEMENT = ("--set", "repo.instance_count=1", "--set", "repo.threads=1")


@pytest.fixture(scope="module")
def counted_run(tmp_path_factory, exported):
    """The run, with this process's reads of its hand-over files counted: manifest.json parsed, reference.npz
    loaded and hashed, and the stage configs built. (The verifier's fresh processes read their own.) It starts
    once the shared export (``exported``, unused here) is built: the two compile beside each other otherwise,
    and every file that waits on the shared export waits longer."""
    import torchship.manifest
    import torchship.pipeline.run

    d = tmp_path_factory.mktemp("e2e") / "run"
    reads = {"manifest.json": 0, "reference.npz loaded": 0, "reference.npz hashed": 0, "stage configs": 0}
    attacks = {}  # the planted control-plane attacks on the run's server, and whether the planted code ran
    parse, load, hash_, configs = (
        torchship.manifest.read_json,
        torchship.manifest._load_npz,
        torchship.manifest.sha256_file,
        torchship.pipeline.run.stage_configs,
    )

    def counted_parse(path, *a, **k):
        reads["manifest.json"] += Path(path).name == "manifest.json"
        return parse(path, *a, **k)

    def counted_load(path):
        reads["reference.npz loaded"] += Path(path).name == "reference.npz"
        return load(path)

    def counted_hash(path, *a, **k):
        reads["reference.npz hashed"] += Path(path).name == "reference.npz"
        return hash_(path, *a, **k)

    def counted_configs(*a, **k):
        reads["stage configs"] += 1
        return configs(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torchship.manifest, "read_json", counted_parse)
        mp.setattr(torchship.manifest, "_load_npz", counted_load)
        mp.setattr(torchship.manifest, "sha256_file", counted_hash)
        mp.setattr(torchship.pipeline.run, "stage_configs", counted_configs)
        import torchship.serve.embedded.server
        import torchship.serve.parity

        mp.setattr(torchship.serve.embedded.server.secrets, "token_urlsafe", lambda n: RUN_KEY)
        servers, check = [], torchship.serve.parity.check_served
        start = torchship.serve.embedded.server.TritonServer.start
        mp.setattr(
            torchship.serve.embedded.server.TritonServer, "start", lambda self: servers.append(self) or start(self)
        )

        def attacked_then_checked(url, *a, **k):  # the run's server, attacked while it serves the check stage
            from tests.helpers import plant_attacks

            s = servers[-1]
            attacks["answers"] = plant_attacks(
                url, f"{s.cfg.host}:{s.http_port}", d.parent / "marker", d.parent / "log", sorted(s.loaded)[0]
            )
            attacks["marker written"] = (d.parent / "marker").exists()
            return check(url, *a, **k)

        mp.setattr(torchship.serve.parity, "check_served", attacked_then_checked)
        assert run_cli("run", "--out", d, "--config", CONFIG) == 0
    return d, reads, attacks


@pytest.fixture(scope="module")
def run_dir(counted_run):
    return counted_run[0]


def test_one_run_reads_each_hand_over_once(counted_run):
    """The export stage hands its manifest and reference on in memory; the repo, check and bench stages read
    neither again, and the stage configs are built once, for the checks before the run and the run itself."""
    _, reads, _ = counted_run
    assert reads == {"manifest.json": 0, "reference.npz loaded": 0, "reference.npz hashed": 0, "stage configs": 1}, (
        reads
    )


@pytest.mark.slow
def test_a_run_from_a_later_stage_reads_each_hand_over_once(run_dir, tmp_path, monkeypatch):
    """--from repo reads the export from disk: its manifest parsed once, its reference loaded once, for the
    repo, check and bench stages together."""
    import torchship.manifest

    d = tmp_path / "run"
    shutil.copytree(run_dir, d)
    counts = {"manifest": 0, "reference": 0}
    parse, load = torchship.manifest.read_json, torchship.manifest._load_npz
    monkeypatch.setattr(
        torchship.manifest,
        "read_json",
        lambda p, *a, **k: (
            counts.__setitem__("manifest", counts["manifest"] + (Path(p).name == "manifest.json")) or parse(p, *a, **k)
        ),
    )
    monkeypatch.setattr(
        torchship.manifest,
        "_load_npz",
        lambda p: counts.__setitem__("reference", counts["reference"] + (Path(p).name == "reference.npz")) or load(p),
    )
    assert (
        run_cli(
            *("run", "--out", d, "--config", CONFIG),
            "--from",
            "repo",
            "--set",
            'repo.formats=["onnx"]',
            "--set",
            'bench.variants=["onnx"]',
        )
        == 0
    )
    assert counts == {"manifest": 1, "reference": 1}, counts


def test_the_runs_server_refuses_the_planted_control_plane_attacks(counted_run):
    _, _, attacks = counted_run
    assert len(attacks["answers"]) == 8 and set(attacks["answers"].values()) == {"restricted"}, attacks
    assert not attacks["marker written"]


def test_the_servers_key_stays_out_of_the_run_folder(run_dir):
    """The run's server answered model control only to its key (the winner's load used it), and no file of the
    run folder, its logs, run.json and summary.md included, holds it."""
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "tritonserver.log" for p in files) and any(p.name == "summary.md" for p in files)
    assert [p for p in files if RUN_KEY.encode() in p.read_bytes()] == []


def test_every_stage_output_exists_and_is_consistent(run_dir):
    rec = json.loads((run_dir / "run.json").read_text())
    assert list(rec["stages"])[:5] == ["train", "export", "repo", "check", "bench"]
    assert all(g["pass"] for g in rec["gates"].values()) and rec["outcome"] == {"status": "passed"}
    assert rec["peak_rss_bytes"] > 0 and rec["server_exit_code"] == 0
    index = json.loads((run_dir / "train/checkpoints/index.json").read_text())
    assert (run_dir / "train/checkpoints" / index["best"] / "model.pt").exists()
    from torchship.export.config import default_formats
    from torchship.names import model_names
    from torchship.serve.repository import servable_formats, served_artifacts

    m = json.loads((run_dir / "export/manifest.json").read_text())
    # the default formats of this CPU: float32 always, a reduced precision where it computes one natively (each
    # gated on accuracy, optional: one that fails its gate is reported and not served)
    assert [a["name"] for a in m["artifacts"]] == list(default_formats("cpu")[0]) and m["verification"]["pass"]
    assert {"torchscript", "onnx"} <= set(servable_formats(m))
    for a in m["artifacts"]:
        for rel, sha in a["files"].items():
            assert sha256_file(run_dir / "export" / rel) == sha
    served_models = sorted(model_names(m, servable_formats(m)).values())
    assert sorted(p.name for p in (run_dir / "model_repository").iterdir() if p.is_dir()) == sorted(
        [
            "tiny_cnn",
            "tiny_cnn_image",
            "tiny_cnn_image_pre",
            *served_models,  # the image entry, by default
        ]
    )
    winner = rec["stages"]["bench"]["winner"]  # max-throughput by default, served under the plain name after the bench
    assert winner["strategy"] == "max-throughput" and winner["served_as"] == "tiny_cnn" and winner["runner_up"]
    assert f"serves {winner['model']} as tiny_cnn (max-throughput)" in rec["gates"]["bench"]["detail"]
    # its instances x threads measured as the run's [bench] says: tiny.toml's Python client, every response checked
    grid = winner["placement"]["grid"]
    assert winner["placement"]["load_generator"] == "python" and grid
    assert all(r["checked"] >= r["ok"] > 0 and r["wrong"] == 0 for g in grid for r in g["rows"])
    summary_text = (run_dir / "summary.md").read_text()
    assert "| tiny_cnn (as served) |" in summary_text and "sent by torchship's Python client" in summary_text
    parity = json.loads((run_dir / "served_parity.json").read_text())
    assert parity["pass"] and sorted(parity["models"]) == sorted([*served_models, "tiny_cnn_image"])
    assert list(parity["models"]["tiny_cnn_image"]) == ["raw"]  # checked from the export's held-out files
    assert (run_dir / "export/raw").is_dir() and m["reference"]["raw"]["batch"] == 16
    # after the bench, the entry runs the winner behind it
    from torchship.serve.model_config import CONFIG, read_config

    ens = read_config(run_dir / "model_repository/tiny_cnn_image" / CONFIG)
    assert ens.ensemble_scheduling.step[-1].model_name == "tiny_cnn"
    bench = json.loads((run_dir / "bench/results.json").read_text())
    assert bench["format"] == "torchship.bench/1" and bench["served"]["models"]
    # in-process: what the summary sets beside each served model, and no sweep the summary does not report
    assert {r["variant"] for r in bench["in_process"]["rows"]} == set(served_artifacts(m).values())
    served = bench["served"]
    assert served["embedded"] and not served["batching_off"]
    assert "noop" not in served and "the no-op round trip (noop)" in served["left_out"]  # and the summary says so
    assert all(r["checked"] >= r["ok"] and r["wrong"] == 0 for mm in served["models"].values() for r in mm["rows"])
    assert (run_dir / "bench/report.md").exists() and (run_dir / "logs/tritonserver.log").exists()
    entry = served["entry"]  # the image entry timed with the held-out files, every answer checked
    assert entry["model"] == "tiny_cnn_image" and all(r["checked"] >= r["ok"] > 0 for r in entry["rows"])
    summary = (run_dir / "summary.md").read_text()
    for needle in (
        "all gates passed",
        "validation accuracy",
        "Parity against the float64 reference",
        "## Served over gRPC",
        "peak RSS",
        "batching gain",
        "Recommendation: `tiny_cnn_",
        "## In-process beside served",
        "Left out by the settings (each on by default in torchship bench): ",
        f"Served as `tiny_cnn`: `{winner['model']}`. Why: max-throughput: the highest served throughput: ",
        f"Image entry: `tiny_cnn_image` takes an image file as it is and prepares it in the server as training did, "
        f"then runs `tiny_cnn` ({winner['model']}): a request holds the file, ",
        "where the float32 tensor is 12,288 bytes",
        "## The image entry",
    ):
        assert needle in summary
    # one set of figures for what serves as tiny_cnn: those of the placement written into its configs, in
    # winner.json, the summary, the bench report and the repository's README alike
    from torchship.serve.bench.placement import placement_of

    written = json.loads((run_dir / "model_repository/tiny_cnn/winner.json").read_text())
    assert written["figures"] == winner["figures"] == bench["winner"]["figures"]
    assert placement_of(read_config(run_dir / "model_repository/tiny_cnn" / CONFIG)) == (
        winner["instances"],
        winner["threads"],
    )
    point = next(
        g
        for g in winner["placement"]["grid"]
        if (g["model"], g["instances"], g["threads"]) == (winner["model"], winner["instances"], winner["threads"])
    )
    assert winner["row"] in [{k: r[k] for k in winner["row"]} for r in point["rows"]]
    for text in (
        summary,
        (run_dir / "bench/report.md").read_text(),
        (run_dir / "model_repository/README.md").read_text(),
    ):
        assert winner["figures"] in text


@pytest.mark.slow
def test_run_trains_and_serves_a_text_model_from_your_own_factories(tmp_path):
    """torchship run --arch F --data F for a model that is not an image classifier: trained on its data
    factory, exported from the checkpoint's recorded signature, served, checked and benched."""
    d = tmp_path / "run"
    assert (
        run_cli(
            *("run", "--out", d, "--config", CONFIG),
            "--arch",
            "tests.anymodel.models:text_classifier",
            "--data",
            "tests.anymodel.models:topic_texts",
            "--epochs",
            "1",
            "--set",
            'train.model_arg=["dim=16"]',
            "--set",
            'export.formats=["onnx","torchscript"]',
            "--set",
            'bench.variants=["onnx"]',
            "--set",
            "bench.concurrency=[1]",
            *ONE_PLACEMENT,
        )
        == 0
    )
    rec = json.loads((d / "run.json").read_text())
    assert rec["outcome"] == {"status": "passed"}
    m = json.loads((d / "export/manifest.json").read_text())
    assert [t["name"] for t in m["inputs"]] == ["attention_mask", "input_ids"] and "S" in m["dims"]
    assert m["outputs"][1] == {"name": "embedding", "dtype": "float32", "shape": ["batch", 16]}
    assert json.loads((d / "served_parity.json").read_text())["pass"]
    summary = (d / "summary.md").read_text()
    assert "text_classifier_onnx" in summary and "images/s" not in summary


@pytest.mark.slow
def test_from_export_reuses_the_checkpoint_without_retraining(run_dir):
    ckpts = run_dir / "train/checkpoints"
    before = {p.name: p.stat().st_mtime_ns for p in ckpts.rglob("*")}
    log_before = (run_dir / "train/train.log").read_text()
    # the serve section reaches the run's server: a Triton argument passed on as it is
    assert (
        run_cli(
            "run",
            "--out",
            run_dir,
            "--config",
            CONFIG,
            "--from",
            "export",
            "--set",
            'serve.triton_args=["--log-verbose=1"]',
            "--set",
            'export.formats=["onnx","torchscript"]',
            "--set",
            'bench.variants=["onnx"]',
            *ONE_PLACEMENT,
        )
        == 0
    )
    assert "Process for ModelInferHandler" in (run_dir / "logs/tritonserver.log").read_text()  # logged at verbose 1
    assert {p.name: p.stat().st_mtime_ns for p in ckpts.rglob("*")} == before
    assert (run_dir / "train/train.log").read_text() == log_before
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["from"] == "export" and "train" in rec["stages"]  # the train record is kept, not redone
    m = json.loads((run_dir / "export/manifest.json").read_text())
    assert {a["format"] for a in m["artifacts"]} == {"onnx", "torchscript"}


@pytest.mark.slow
def test_a_failing_gate_exits_non_zero_naming_the_stage(run_dir, tmp_path, capsys):
    bad = tmp_path / "run"
    shutil.copytree(run_dir, bad)
    path = bad / "model_repository/tiny_cnn_onnx/1/model.onnx"
    alter_onnx_weight(path, scale(1.5))
    rehash_version(path.parent)
    capsys.readouterr()
    assert run_cli("run", "--out", bad, "--config", CONFIG, "--from", "check") == 3
    err = capsys.readouterr().err
    assert "stage check:" in err and "tiny_cnn_onnx" in err
    rec = json.loads((bad / "run.json").read_text())
    assert rec["gates"]["check"]["pass"] is False and rec["server_exit_code"] == 0
    assert (
        rec["outcome"]["status"] == "gate failed"
        and "**a gate FAILED**: stage check:" in (bad / "summary.md").read_text()
    )


@pytest.mark.slow
def test_a_run_stopped_by_an_error_says_where_and_how_to_go_on(run_dir, tmp_path, capsys):
    """No gate failed, yet the run did not finish: the summary must not read "all gates passed"."""
    bad = tmp_path / "run"
    shutil.copytree(run_dir, bad)
    path = bad / "model_repository/tiny_cnn_onnx/1/model.onnx"
    path.write_bytes(path.read_bytes()[:1000])  # the server cannot load it
    rehash_version(path.parent)
    assert run_cli("run", "--out", bad, "--config", CONFIG, "--from", "check") == 2
    assert "tiny_cnn_onnx failed to load" in capsys.readouterr().err
    rec = json.loads((bad / "run.json").read_text())
    assert rec["outcome"]["status"] == "failed" and rec["outcome"]["stage"] == "check"
    summary = (bad / "summary.md").read_text()
    assert "all gates passed" not in summary
    assert "**stopped by an error** in the check stage (ServerError: model tiny_cnn_onnx failed to load" in summary
    assert f"--out {bad} --from check" in summary


@pytest.mark.slow
def test_an_interrupted_run_says_so(run_dir, tmp_path, monkeypatch, capsys):
    import torchship.serve.bench.run

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(torchship.serve.bench.run, "run_bench", interrupt)
    bad = tmp_path / "run"
    shutil.copytree(run_dir, bad)
    assert run_cli("run", "--out", bad, "--config", CONFIG, "--from", "bench") == 130
    rec = json.loads((bad / "run.json").read_text())
    assert rec["outcome"] == {"status": "interrupted", "stage": "bench"} and rec["server_exit_code"] == 0
    summary = (bad / "summary.md").read_text()
    assert "all gates passed" not in summary and "**interrupted** in the bench stage" in summary
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"torchship run: interrupted in the bench stage: the stages after it did not run; go on with "
        f"torchship run --out {bad} --from bench"
    ], err


def test_a_finished_run_is_not_redone_without_overwrite(run_dir, tmp_path, capsys):
    """`run --out` on a folder that holds a run would train over its checkpoints: refused, with the ways
    on, and nothing in the folder touched. --overwrite lets it through (here to a data error of its own)."""
    before = {p: sha256_file(p) for p in sorted(run_dir.rglob("*")) if p.is_file()}
    assert run_cli("run", "--out", run_dir, "--config", CONFIG) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "already holds a trained run" in err[0]
        and "--from STAGE" in err[0]
        and "--overwrite" in err[0]
    ), err
    assert {p: sha256_file(p) for p in sorted(run_dir.rglob("*")) if p.is_file()} == before
    # a run stopped in training before its first checkpoint has nothing to lose: run it again as it was
    stopped, missing = tmp_path / "stopped", tmp_path / "no-such-images"
    for _ in range(2):
        assert run_cli("run", "--out", stopped, "--config", CONFIG, "--set", f"train.data={missing}") == 2
        err = capsys.readouterr().err
        assert "already holds" not in err and str(missing) in err, err
    assert f"`torchship run --out {stopped} --from train`" in (stopped / "summary.md").read_text()
    (stopped / "train" / "checkpoints").mkdir(parents=True)  # one stopped after a checkpoint: only with --overwrite
    assert run_cli("run", "--out", stopped, "--config", CONFIG, "--set", f"train.data={missing}") == 2
    assert "already holds a trained run" in capsys.readouterr().err
    assert run_cli("run", "--out", stopped, "--config", CONFIG, "--set", f"train.data={missing}", "--overwrite") == 2
    err = capsys.readouterr().err
    assert "already holds" not in err and str(missing) in err, err
    assert f"`torchship run --out {stopped} --overwrite`" in (stopped / "summary.md").read_text()
