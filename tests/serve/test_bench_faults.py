"""Benchmark stage, refusals and planted faults: bad input refused before anything runs, partial results kept
when the server goes away, and a wrong answer under load failing the bench; --compare's rule."""

import json
import shutil

import numpy as np
import pytest

from tests.conftest import run_cli
from tests.helpers import BENCH_SHORT as SHORT
from torchship.config import build
from torchship.errors import BenchError, ServerError
from torchship.serve.bench.compare import compare
from torchship.serve.bench.config import BenchConfig
from torchship.serve.bench.run import run_bench


def test_perf_analyzer_asked_for_but_missing_is_refused(exported, tmp_path):
    cfg = build(
        BenchConfig,
        {**SHORT, "load_generator": "perf_analyzer", "skip_in_process": True},
        {"export_dir": str(exported), "out": str(tmp_path), "perf_analyzer": str(tmp_path / "nowhere")},
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("torchship.serve.bench.perf_analyzer.locate", lambda explicit=None: None)
        with pytest.raises(
            BenchError, match="perf_analyzer not found; python -m torchship.serve.bench.perf_analyzer install"
        ):
            run_bench(cfg, log=lambda *a: None)


def _one_row(p50: float, spread: float | None) -> dict:
    row = {"variant": "onnx", "batch": 1, "p50_ms": p50, "p99_ms": p50, "images_per_s": 1e3 / p50}
    return {"in_process": {"rows": [{**row, **({"spread": spread} if spread is not None else {})}]}}


@pytest.mark.parametrize(
    "old_spread, new_spread, new_p50, regression",
    [
        (0.10, 0.05, 10.8, False),  # 8 % slower, inside the 10 % one run measured: noise
        (0.10, 0.05, 11.5, True),  # 15 % slower, beyond both spreads
        (0.02, 0.02, 10.5, True),  # 5 % beyond a 2 % spread: a regression a fixed 20 % rule would miss
        (0.30, 0.02, 12.0, False),  # 20 % inside an unsteady old run's 30 %
        (None, None, 11.9, False),  # results without spreads: the 1.2 fallback
        (None, None, 12.1, True),
    ],
)
def test_compare_calls_a_change_beyond_the_spread_a_regression(old_spread, new_spread, new_p50, regression):
    rows, regressions = compare(_one_row(10.0, old_spread), _one_row(new_p50, new_spread))
    assert {r["key"].rsplit("/", 1)[1] for r in regressions} == (
        {"p50_ms", "p99_ms", "images_per_s"} if regression else set()
    )
    assert len(rows) == 3


def test_compare_threshold_replaces_the_spread():
    assert not compare(_one_row(10.0, 0.01), _one_row(11.0, 0.01), threshold=1.2)[1]
    assert compare(_one_row(10.0, 0.5), _one_row(13.0, 0.5), threshold=1.2)[1]


@pytest.mark.slow
def test_unreachable_server_keeps_partial_results(exported, tmp_path, monkeypatch):
    import torchship.serve.bench.served
    from torchship.serve.embedded.process import free_ports

    monkeypatch.setattr(torchship.serve.bench.served, "READY_WAIT_S", 2.0)
    cfg = build(
        BenchConfig,
        SHORT,
        {
            "export_dir": str(exported),
            "out": str(tmp_path),
            "variants": ["onnx"],
            "url": f"127.0.0.1:{free_ports()[0]}",
        },
    )
    with pytest.raises(ServerError, match="partial results kept"):
        run_bench(cfg, log=lambda *a: None)
    kept = json.loads((tmp_path / "results.json").read_text())
    assert kept["in_process"]["rows"] and kept["errors"]


@pytest.mark.parametrize("where", ["url", "repo", "built"])
def test_unknown_model_is_refused_before_anything_runs(exported, repo, server, tmp_path, where):
    """--models naming a model that will not be served is refused up front, naming the models there are,
    before the in-process part runs or a server starts, with nothing written."""
    out = tmp_path / "out"
    given = {"url": {"url": server.url}, "repo": {"repo": str(repo)}, "built": {}}[where]
    cfg = build(
        BenchConfig, SHORT, {"export_dir": str(exported), "out": str(out), "models": ["tiny_cnn_nope"], **given}
    )
    with pytest.raises(BenchError, match=r"--models tiny_cnn_nope: not in .*; choose from .*tiny_cnn_onnx"):
        run_bench(cfg, log=lambda *a: None)
    assert not out.exists()


def test_budget_no_configuration_meets(exported, server, tmp_path, capsys):
    """Against an already-running server: a budget nothing meets is an error that keeps the results, and
    the sweeps that need the embedded server (batching off, by default) are reported as not done."""
    cfg = build(
        BenchConfig,
        SHORT,
        {
            "export_dir": str(exported),
            "out": str(tmp_path),
            "skip_in_process": True,
            "url": server.url,
            "models": ["tiny_cnn_onnx"],
            "p99_budget_ms": 0.001,
        },
    )
    with pytest.raises(BenchError, match="no configuration meets p99 <= 0.001 ms"):
        run_bench(cfg, log=lambda *a: None)
    served = json.loads((tmp_path / "results.json").read_text())["served"]
    assert served["models"]["tiny_cnn_onnx"]["rows"] and not served["batching_off"]
    assert "only the embedded server allows" in served["reconfigured"]["skipped"]
    assert "Batching off and queue delays: the sweeps" in (tmp_path / "report.md").read_text()


def test_one_at_a_time_counts_each_refusal_and_goes_on(server):
    """Concurrency 1: every good request is timed, every refused one is an error with the server's
    message, and the requests after a refusal are still sent."""
    from torchship.serve.bench.load import closed_loop

    good = np.random.default_rng(0).random((1, 3, 32, 32), dtype=np.float32)
    bad = np.zeros((1, 3, 16, 16), np.float32)
    r = closed_loop(server.url, "tiny_cnn_onnx", [{"images": good}], 1, 12)
    assert len(r["latencies_s"]) == 12 and not r["errors"]
    r = closed_loop(server.url, "tiny_cnn_onnx", [{"images": good}, {"images": bad}], 1, 12)
    assert len(r["latencies_s"]) == 6 and len(r["errors"]) == 6
    assert all("shape" in e for e in r["errors"]), r["errors"][0]


def test_bench_passes_triton_arguments_to_its_server(exported, tmp_path, capsys):
    """--triton-arg reaches the bench's own embedded server as it is: a flag tritonserver does not know
    stops it, and the error shows Triton's own words."""
    assert (
        run_cli(
            "bench",
            exported,
            "--out",
            tmp_path,
            "--skip-in-process",
            "--no-cross-check",
            "--no-plots",
            "--no-progress",
            "--triton-arg=--no-such-triton-flag",
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "no-such-triton-flag" in err and "partial results kept" in err, err


@pytest.mark.slow
def test_a_server_stop_note_reaches_the_bench_log_results_and_report(exported, tmp_path, monkeypatch):
    """When the bench's own server had to be killed (a model that would not unload), the bench says so
    rather than ending as if the server stopped cleanly. That server loaded the one model timed (and the no-op
    model the bench times beside it), not the repository's others: each a backend process more."""
    from torchship.serve.embedded import TritonServer

    real_stop, loaded = TritonServer.stop, []

    def stop_with_note(self):
        loaded.append(list(self.loaded))
        code = real_stop(self)
        self.stop_note = "tiny_cnn_onnx still loaded (planted)"
        return code

    monkeypatch.setattr(TritonServer, "stop", stop_with_note)
    cfg = build(
        BenchConfig,
        {
            **SHORT,
            "skip_in_process": True,
            "concurrency": [1],
            "requests": 2,
            "models": ["tiny_cnn_onnx"],
            "batching_compare": [],
            "plots": False,
        },
        {"export_dir": str(exported), "out": str(tmp_path)},
    )
    lines = []
    results = run_bench(cfg, log=lines.append)
    assert [sorted(names) for names in loaded] == [["_torchship_noop", "tiny_cnn_onnx"]]
    assert results["server_stop_note"] == "tiny_cnn_onnx still loaded (planted)"
    assert "note: tiny_cnn_onnx still loaded (planted)" in lines
    assert "killed at the end: tiny_cnn_onnx still loaded" in (tmp_path / "report.md").read_text()


CORRUPTING = """
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torchship_stub import stub_model  # noqa: E402


class TritonPythonModel(stub_model("onnxruntime")):
    \"\"\"A batcher bug: in a batch of 4 rows or more, the first request's answer comes back wrong.\"\"\"

    def run_batch(self, batch, owners, results):
        super().run_batch(batch, owners, results)
        if sum(f[self.inputs[0]].shape[0] for f in batch) >= 4 and not isinstance(results[owners[0]], str):
            results[owners[0]][0] = results[owners[0]][0] + 0.5
"""


@pytest.mark.slow
def test_a_backend_that_corrupts_one_row_of_a_batch_is_caught_under_load(exported, repo, tmp_path, monkeypatch):
    """Planted: a backend that returns one wrong row in batches of 4 or more. Batch-1 requests one at a time
    never form such a batch, so concurrency 1 checks clean; at 16 in flight the batcher forms them, and the
    bench fails naming the model and the level, with its results and report written."""
    import torchship.serve.embedded.server as server_module
    from torchship.errors import ParityError
    from torchship.serve.embedded.wheel import backend_dir

    planted = tmp_path / "backends"
    shutil.copytree(backend_dir(), planted)
    (planted / "onnxruntime" / "model.py").write_text(CORRUPTING)
    monkeypatch.setattr(server_module, "backend_dir", lambda: planted)
    out = tmp_path / "bench"
    cfg = build(
        BenchConfig,
        {
            **SHORT,
            "skip_in_process": True,
            "models": ["tiny_cnn_onnx"],
            "concurrency": [1, 16],
            "batching_compare": [],
            "plots": False,
        },
        {"export_dir": str(exported), "repo": str(repo), "out": str(out)},
    )
    with pytest.raises(ParityError, match=r"tiny_cnn_onnx at concurrency 16: \d+ of \d+ checked responses wrong") as e:
        run_bench(cfg, log=lambda *a: None)
    assert "at concurrency 1:" not in str(e.value) and "beyond" in str(e.value)
    c1, c16 = json.loads((out / "results.json").read_text())["served"]["models"]["tiny_cnn_onnx"]["rows"]
    assert c1["checked"] >= SHORT["requests"] and c1["wrong"] == 0
    assert c16["wrong"] >= 1 and c16["server"]["avg_batch"] > 1
    assert "WRONG" in (out / "report.md").read_text()


def test_a_wrong_answer_from_the_image_entry_fails_the_bench():
    """The entry's rows go through the same verdict as the models': one wrong response names it."""
    from torchship.serve.bench.checks import wrong_in

    row = {"concurrency": 4, "checked": 12, "wrong": 1, "first_wrong": "request 3: output 'logits' max abs error 2"}
    err = wrong_in({"models": {}, "entry": {"model": "tiny_cnn_image", "rows": [row]}})
    assert err is not None and "tiny_cnn_image at concurrency 4 (the image entry, from the held-out files)" in str(err)
    assert wrong_in({"models": {}, "entry": {"model": "tiny_cnn_image", "rows": [{**row, "wrong": 0}]}}) is None


def test_a_wrong_answer_from_the_text_entry_or_the_model_behind_it_fails_the_bench():
    """A text entry's sweep has two sets of rows: the entry's, from the texts, and the model behind it, from their
    token tensors. A wrong response in either fails the bench, naming the text entry."""
    from torchship.serve.bench.checks import wrong_in

    row = {"concurrency": 4, "checked": 12, "wrong": 1, "first_wrong": "request 3: output 'logits' max abs error 2"}
    ok = {**row, "wrong": 0}
    entry = {"model": "bert_text", "kind": "text", "target": "bert_onnx", "rows": [ok], "tensor_rows": [ok]}
    assert wrong_in({"models": {}, "entry": entry}) is None
    err = wrong_in({"models": {}, "entry": {**entry, "rows": [row]}})
    assert err is not None and "bert_text at concurrency 4 (the text entry, from the held-out files)" in str(err)
    err = wrong_in({"models": {}, "entry": {**entry, "tensor_rows": [row]}})
    assert err is not None and "bert_onnx at concurrency 4 (behind the text entry, its texts' token tensors)" in str(
        err
    )
