"""Live operations on a real Triton under real load: a retrained model rolled in and back out while 16 requests
stay in flight, with no failed request and every answer from one version or the other; a bad version refused
at its parity check while the live one serves on; a new signature refused before anything is written."""

import threading
import time

import numpy as np
import pytest

from tests.helpers import alter_onnx_weight, in_process, rehash_version, scale
from torchship.errors import ArtifactError, ParityError, RolloutError
from torchship.serve.client import TritonClient
from torchship.serve.config import RepoConfig, ServeConfig
from torchship.serve.embedded import TritonServer
from torchship.serve.model_config import versions
from torchship.serve.parity import check_served
from torchship.serve.repository import build_repository
from torchship.serve.rollout import previous, switch
from torchship.serve.versions import add_version, history, live_version

MODEL = "tiny_cnn_onnx"
ONNX = RepoConfig(formats=("onnx",))
# the repositories here hold the tensor model alone: these tests follow its versions (the image entry's own tests
# are in test_image_entry.py)


@pytest.fixture(scope="module")
def retrained(tmp_path_factory):
    """The tiny CNN trained again from another seed, exported to ONNX: version 2, with other outputs."""
    from torchship.config import build
    from torchship.export.config import ExportConfig
    from torchship.export.pipeline import run_export
    from torchship.train.config import TrainConfig
    from torchship.train.loop import train

    out = tmp_path_factory.mktemp("retrained")
    res = train(
        build(
            TrainConfig,
            {
                "arch": "tiny_cnn",
                "epochs": 3,
                "lr": 3e-2,
                "batch_size": 32,
                "out": str(out / "train"),
                "progress": False,
                "seed": 1,
                "amp": "off",
            },
        )
    )
    run_export(
        build(
            ExportConfig, {"checkpoint": str(res.best), "out": str(out / "export"), "max_batch": 8, "formats": ["onnx"]}
        ),
        log=lambda *a: None,
    )
    return out / "export"


@pytest.fixture
def two_versions(exported, retrained, tmp_path):
    repo = tmp_path / "repo"
    build_repository(exported, RepoConfig(out=str(repo), formats=("onnx",), image_entry=False))
    assert add_version(retrained, repo, ONNX, log=lambda *a: None) == {MODEL: 2}
    assert live_version(repo / MODEL) == 1
    return repo


class Flood:
    """16 threads, each sending one batch-1 request after another: (sent, answered, input index, output or error).
    ``xs``: the model's input rows, or the files the image entry ``entry`` takes."""

    def __init__(self, url, xs, threads=16, entry=None):
        self.url, self.xs, self.stop, self.log = url, xs, threading.Event(), []
        self.entry = entry
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(threads)]

    def send(self, client, k):
        if self.entry is None:
            return client.infer(MODEL, self.xs[k : k + 1])
        return client.infer_all(self.entry, {"image": np.frombuffer(self.xs[k], np.uint8)[None]})["logits"]

    def run(self, seed):
        client, i = TritonClient(self.url), seed
        while not self.stop.is_set():
            k = i % len(self.xs)
            t0 = time.monotonic()
            try:
                out = self.send(client, k)
            except Exception as e:  # every failure counts
                out = e
            self.log.append((t0, time.monotonic(), k, out))
            i += 1
        client.close()

    def __enter__(self):
        for t in self.threads:
            t.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        time.sleep(0.5)
        self.stop.set()
        for t in self.threads:
            t.join()


def which(out, k, expected):
    """1 or 2: the version whose output this is (within float rounding of batched execution), else None."""
    for v, want in expected.items():
        if not isinstance(out, Exception) and np.allclose(out[0], want[k], atol=1e-4, rtol=0):
            return v
    return None


@pytest.mark.slow
def test_a_flood_sees_no_failure_during_a_rollout_and_a_rollback(two_versions, exported, retrained, capsys):
    repo = two_versions
    xs = np.load(exported / "reference.npz")["input/heldout/images"][:16]
    expected = {v: in_process(e, "onnx").run({"images": xs})["logits"] for v, e in ((1, exported), (2, retrained))}
    assert not np.allclose(expected[1], expected[2], atol=1e-2)  # the two versions are told apart
    with TritonServer(ServeConfig(repo=str(repo))) as s:
        with Flood(s.url, xs) as flood:
            switch(s.url, repo, MODEL, None, retrained)
            rolled = time.monotonic()
            time.sleep(1.0)
            switch(s.url, repo, MODEL, previous(repo, MODEL), exported)
            back = time.monotonic()
    seen = [(t0, t1, which(out, k, expected), out) for t0, t1, k, out in flood.log]
    failed = [o for *_, o in seen if isinstance(o, Exception)]
    wrong = [v for _, _, v, o in seen if v is None and not isinstance(o, Exception)]
    with capsys.disabled():  # the counts, in the default run's output
        print(
            f"\nflood during a rollout and a rollback: {len(seen)} requests, {len(failed)} failed, {len(wrong)} "
            f"wrong, {sum(v == 2 for _, _, v, _ in seen)} answered by version 2"
        )
    assert not failed and not wrong, (failed[:3], len(wrong))
    assert all(v == 2 for t0, t1, v, _ in seen if rolled < t0 and t1 < back - 1.0)  # after the switch: version 2 only
    assert all(v == 1 for t0, _, v, _ in seen if t0 > back)  # after the rollback: version 1 only
    assert any(v == 2 for _, _, v, _ in seen) and live_version(repo / MODEL) == 1
    assert capsys.readouterr().out.count("tiny_cnn_onnx: ") >= 6  # a line per step


@pytest.mark.slow
def test_the_image_entry_answers_with_the_live_version_through_a_rollout(exported, retrained, tmp_path, monkeypatch):
    """The entry names the version it runs. Entry traffic through a refused rollout whose candidate was loaded
    beside the live version under the model's own name (the planted fault: Triton answers an unversioned step
    with the highest version loaded) is all version 1's; through a rollout that passes, none fails and it is
    version 2's once the switch is done."""
    import torchship.serve.rollout
    from tests.serve.test_image_entry import DIGITS, png, trained_inputs
    from torchship.serve.entries import entry_names
    from torchship.serve.model_config import CONFIG, read_config

    entry = entry_names("tiny_cnn")[0]
    repo = tmp_path / "repo"
    build_repository(exported, RepoConfig(out=str(repo), formats=("onnx",), cores=1))
    add_version(retrained, repo, ONNX, log=lambda *a: None)
    files = [png(d) for d in DIGITS]
    expected = {
        v: in_process(e, "onnx").run({"images": trained_inputs()})["logits"] for v, e in ((1, exported), (2, retrained))
    }

    def beside_live(client, d, target, live_config):  # loads the candidate under the model's own name
        base = read_config(d / CONFIG)
        base.version_policy.specific.versions[:] = [1, target]
        client.load(d.name, base)
        raise RuntimeError("the candidate's check failed")

    with TritonServer(ServeConfig(repo=str(repo))) as s:
        client = TritonClient(s.url)
        with Flood(s.url, files, entry=entry) as flood, monkeypatch.context() as m:
            m.setattr(torchship.serve.rollout, "load_candidate", beside_live)
            with pytest.raises(RolloutError, match="version 1 still serves"):
                switch(s.url, repo, MODEL, None, retrained)
            assert client.ready(MODEL, "2")  # the candidate is loaded beside the live version, under its name
            time.sleep(1.0)
        assert {which(out, k, expected) for *_, k, out in flood.log} == {1}, len(flood.log)
        s.load(MODEL)  # version 1 alone again
        with Flood(s.url, files, entry=entry) as flood:
            switch(s.url, repo, MODEL, None, retrained)
            switched = time.monotonic()
        seen = [(t0, which(out, k, expected)) for t0, _, k, out in flood.log]
        assert None not in {v for _, v in seen}, [o for *_, o in flood.log if isinstance(o, Exception)][:3]
        assert {v for t0, v in seen if t0 > switched} == {2}
        assert read_config(repo / entry / CONFIG).ensemble_scheduling.step[-1].model_version == 2


@pytest.mark.slow
def test_a_bad_new_version_is_refused_and_the_live_one_serves_on(two_versions, exported, retrained):
    repo = two_versions
    path = repo / MODEL / "2" / "model.onnx"
    alter_onnx_weight(path, scale(1.5))
    rehash_version(path.parent)
    xs = np.load(exported / "reference.npz")["input/heldout/images"][:16]
    expected = {1: in_process(exported, "onnx").run({"images": xs})["logits"]}
    with TritonServer(ServeConfig(repo=str(repo))) as s:
        with Flood(s.url, xs) as flood:
            with pytest.raises(
                RolloutError, match=r"tiny_cnn_onnx: version 2 refused \(ParityError: .*version 1 still serves"
            ):
                switch(s.url, repo, MODEL, None, retrained)
        assert sorted(TritonClient(s.url).ready_models()) == [MODEL]  # the candidate is gone
    assert all(which(out, k, expected) == 1 for *_, k, out in flood.log) and len(flood.log) > 16
    assert live_version(repo / MODEL) == 1 and not (repo / f"{MODEL}__candidate").exists()


def test_a_new_signature_is_refused_until_asked_for(exported, tmp_path):
    repo = tmp_path / "repo"
    build_repository(exported, RepoConfig(out=str(repo), formats=("onnx",), image_entry=False))
    with pytest.raises(
        ArtifactError, match=r"tiny_cnn_onnx: the new version's inputs, outputs or max batch differ .*--new-signature"
    ):
        add_version(exported, repo, RepoConfig(formats=("onnx",), max_batch=4), log=lambda *a: None)
    assert versions(repo / MODEL) == [1]  # nothing written
    assert add_version(
        exported, repo, RepoConfig(formats=("onnx",), max_batch=4), new_signature=True, log=lambda *a: None
    ) == {MODEL: 2}
    rows = [r for r in history(repo) if r["model"] == MODEL]
    assert [(r["version"], r["live"]) for r in rows] == [(1, True), (2, False)] and all(
        r["manifest_sha256"] for r in rows
    )


@pytest.mark.slow
def test_the_second_model_workflow_in_one_command(exported, tmp_path, capsys):
    """torchship run --into REPO --url URL: train and export a new model, then roll it out into a live server."""
    from tests.conftest import run_cli

    repo = tmp_path / "repo"
    build_repository(exported, RepoConfig(out=str(repo), formats=("onnx",), image_entry=False))
    config = tmp_path / "run.toml"
    config.write_text(
        '[train]\narch = "tiny_cnn"\nepochs = 2\nlr = 0.03\nnproc = 1\namp = "off"\nprogress = false\nseed = 3\n'
        '[export]\nmax_batch = 8\nformats = ["onnx"]\n[repo]\nformats = ["onnx"]\n[run]\nmin_accuracy = 0.1\n'
    )
    with TritonServer(ServeConfig(repo=str(repo))) as s:
        assert run_cli("run", "--out", tmp_path / "run", "--config", config, "--into", repo, "--url", s.url) == 0
        assert TritonClient(s.url).ready_models() == [MODEL]
    out = capsys.readouterr().out
    assert "tiny_cnn_onnx: served parity of version 2 PASS" in out and live_version(repo / MODEL) == 2
    assert "| rollout |" in (tmp_path / "run" / "summary.md").read_text()
    assert run_cli("run", "--out", tmp_path / "other", "--into", repo) == 2
    assert "--into REPO and --url HOST:PORT go together" in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_during_a_rollout_leaves_one_version_serving_and_says_which(
    two_versions, exported, retrained, monkeypatch
):
    import torchship.serve.rollout

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(torchship.serve.rollout, "check_served", interrupted)  # Ctrl-C while version 2 is being checked
    repo = two_versions
    with TritonServer(ServeConfig(repo=str(repo))) as s:
        with pytest.raises(RolloutError, match=r"version 2 refused \(interrupted\); version 1 still serves"):
            switch(s.url, repo, MODEL, None, retrained)
        client = TritonClient(s.url)
        assert client.ready_models() == [MODEL] and client.ready(MODEL, "1")
        assert not client.ready(MODEL, "2")
        assert check_served(s.url, exported, models=[MODEL], version="1")["pass"]  # infer --check --version
        with pytest.raises(ParityError, match="tiny_cnn_onnx: heldout: .*version 2"):
            check_served(s.url, exported, models=[MODEL], version="2")
    assert live_version(repo / MODEL) == 1 and not (repo / f"{MODEL}__candidate").exists()


def test_a_tampered_candidate_is_refused_before_it_is_loaded(two_versions, exported):
    """Version 2's file altered on disk after torchship repo wrote it: the rollout refuses it, naming the file,
    without loading it; version 1 stays live."""
    path = two_versions / MODEL / "2" / "model.onnx"
    path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 1]))
    with pytest.raises(
        RolloutError, match=r"version 2 refused: model.onnx differs from the sha256 .*version 1 still serves"
    ):
        switch("127.0.0.1:1", two_versions, MODEL, None, exported)  # refused before any server is asked
    assert live_version(two_versions / MODEL) == 1


def test_a_rollout_hands_each_server_the_config_it_runs(exported, tmp_path):
    """An AOTInductor model has two configs: config.pbtxt (torch_aoti, the official container's) and embedded.pbtxt
    (the embedded server's stand-in). The rollout loads the candidate and the switch with the one the server at
    --url runs, read from the config it reports for the live model."""
    from torchship.serve.model_config import CONFIG, EMBEDDED_CONFIG, served_config_path

    build_repository(exported, RepoConfig(out=str(tmp_path / "repo"), formats=("aoti",)))
    d = tmp_path / "repo" / "tiny_cnn_aoti"
    assert (d / EMBEDDED_CONFIG).exists()
    assert served_config_path(d, {"platform": "torch_aoti", "name": d.name}) == d / CONFIG  # the official container
    assert served_config_path(d, {"platform": "", "backend": "pytorch"}) == d / EMBEDDED_CONFIG  # the embedded server
    assert served_config_path(d) == d / EMBEDDED_CONFIG  # the embedded server torchship starts itself
    onnx = tmp_path / "onnx"
    build_repository(exported, RepoConfig(out=str(onnx), formats=("onnx",), image_entry=False))
    assert served_config_path(onnx / MODEL, {"platform": "onnxruntime_onnx"}) == onnx / MODEL / CONFIG
