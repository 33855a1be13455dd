"""Benchmark stage: well-formed results and report, ordered percentiles, --compare, and bad input."""

import json
import os
import shutil

import numpy as np
import pytest

from serve.bench.compare import compare
from serve.bench.config import BenchConfig
from serve.bench.perf_analyzer import locate
from serve.bench.run import run_bench
from serve.bench.sweep import PACED_CHECKS
from serve.bench.sweeps import ServedPlan, plan_sweeps
from serve.config import default_placement
from tests.conftest import run_cli
from torchship.config import build
from torchship.errors import BenchError, ServerError

SHORT = {
    "variants": ["eager", "onnx", "aoti_buckets"],
    "batch_sizes": [1, 4],
    "iters": 8,
    "blocks": 2,
    "warmup": 1,
    "threads": 1,
    "concurrency": [1, 4],
    "requests": 16,
    "progress": False,
    "load_generator": "python",
    "cross_check": False,
    "window_s": 0.1,
    "max_windows": 4,
}


@pytest.fixture(scope="module")
def bench_run(exported, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cfg = build(BenchConfig, SHORT, {"export_dir": str(exported), "out": str(out), "rate": 50.0, "duration_s": 0.5})
    return run_bench(cfg, log=lambda *a: None), out


def ordered(row):
    return row["min_ms"] <= row["p50_ms"] <= row["p90_ms"] <= row["p95_ms"] <= row["p99_ms"] <= row["max_ms"]


def test_results_and_report_are_well_formed(bench_run):
    results, out = bench_run
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["format"] == "torchship.bench/1" and not on_disk["errors"]
    m = on_disk["machine"]
    assert m["cpu"] and m["cores"] and m["versions"]["torch"] and "git_revision" in m
    assert on_disk["limits"]["flops_per_sample"] > 0 and on_disk["limits"]["fp32_flops"] > 0
    assert on_disk["limits"]["int8_flops"] > 0  # the INT8 probe: gone if neither runtime has an INT8 matmul
    assert {on_disk["limits"][f"{p}_kernel"].split()[0] for p in ("fp32", "bf16", "int8")} <= {
        "torch",
        "onnxruntime",
        "oneDNN",
    }
    rows = on_disk["in_process"]["rows"]
    assert {(r["variant"], r["batch"]) for r in rows} == {
        (v, b) for v in SHORT["variants"] for b in SHORT["batch_sizes"]
    }
    for r in rows:
        assert r["n"] >= SHORT["iters"] and ordered(r) and r["images_per_s"] > 0
        assert 3 <= r["windows"] <= SHORT["max_windows"] and r["spread"] >= 0 and r["stable"] in (True, False)
    served = on_disk["served"]
    assert set(served["models"]) == {"tiny_cnn_onnx", "tiny_cnn_torchscript", "tiny_cnn_aoti"}
    cores = len(os.sched_getaffinity(0))  # the bench's own repository gives each model the default placement
    assert {(mm["instances"], mm["threads"]) for mm in served["models"].values()} == {default_placement(cores)}
    assert on_disk["in_process"]["threads"] == 1  # as --threads says
    for section in ("models", "batching_off"):
        for model, mm in served[section].items():
            assert [r["concurrency"] for r in mm["rows"]] == SHORT["concurrency"]
            for r in mm["rows"]:
                # --requests is a floor: the last three windows hold at least that many
                assert r["sent"] >= r["ok"] >= SHORT["requests"] and r["failed"] == 0, (model, r)
                assert ordered(r) and 3 <= r["windows"] <= SHORT["max_windows"]
                assert len(r["window_requests_per_s"]) == r["windows"]
                assert r["client_cpu_us"] > 0 and r["spread"] >= 0
                # the server's CPU a request: some, and no more than its cores could give at the rate measured
                assert 0 < r["server_cpu_us"] * r["requests_per_s"] / 1e6 <= 1.25 * cores, (model, r)
                assert r["server"]["requests"] == r["ok"]
                assert r["server"]["compute_infer_us"] > 0
                assert r["checked"] >= r["ok"] and r["wrong"] == 0, (model, r)  # every response, held to the bound
    assert served["batching_off"]["tiny_cnn_onnx"]["rows"][0]["server"]["avg_batch"] == 1.0
    noop = served["noop"]["rows"]  # its round trip at concurrency 1, and the most it carries at the top level
    assert "dynamic_batching" in (out / "noop_repo" / "_torchship_noop" / "config.pbtxt").read_text()  # as the models
    assert [r["concurrency"] for r in noop] == [1, max(SHORT["concurrency"])] and all(
        r["ok"] >= SHORT["requests"] for r in noop
    )
    assert all(v["errors"] == 0 and v["sent"] > 0 for v in served["open_loop"].values())
    assert "model" in on_disk["recommendation"]
    report = (out / "report.md").read_text()
    for png in ("latency_cdf.png", "throughput_vs_concurrency.png", "p99_vs_throughput.png"):
        assert (out / png).stat().st_size > 1000 and png in report
    # what users read comes first: served latency and throughput, then the recommendation, then in-process beside served
    heads = [line for line in report.splitlines() if line.startswith("## ")]
    assert heads[:3] == ["## Served over gRPC", "## Recommendation", "## In-process beside served"], heads
    assert "No-op round trip" in report and "## Triton's server-side breakdown" in report
    assert f"Ceiling: with no model to run, the server carried {noop[-1]['requests_per_s']:.0f} requests/s" in report
    for model in served["models"]:
        assert f"- {model}: batching gain " in report
    # the image entry: the held-out files as they are, every answer checked, beside the tensor model behind it
    entry = served["entry"]
    assert entry["model"] == "tiny_cnn_image" and entry["target"] == "tiny_cnn_onnx" and entry["files"] == 16
    assert [r["concurrency"] for r in entry["rows"]] == SHORT["concurrency"]
    assert all(r["checked"] >= r["ok"] > 0 and r["wrong"] == 0 for r in entry["rows"])
    assert 0 < entry["request_bytes"] * 10 < entry["tensor_request_bytes"]  # PNG digits: a tiny file, 12 KB of tensor
    assert entry["preprocessing"]["compute_infer_us"] > 0 and entry["preprocessing"]["requests"] > 0
    assert heads[3] == "## The image entry"
    assert f"| tiny_cnn_image | the image file | {entry['request_bytes']:,} |" in report


def test_the_server_cpu_figure_counts_the_servers_backend_processes():
    """tree_cpu reads a process and its descendants (the embedded server's backends are its children): a child
    that burns 0.3 s of CPU adds that to the tree's use, which this process alone does not; a process that ends
    does not make the use negative."""
    import subprocess
    import sys
    import time

    from torchship.procfs import cpu_used, tree_cpu

    me = os.getpid()
    before, mine = tree_cpu(me), time.process_time()
    burn = (
        "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint(1, flush=True)\n"
        "time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # it has burnt its 0.3 s and sleeps, alive
        during = tree_cpu(me)
        grown = cpu_used(before, during) - (time.process_time() - mine)
        assert grown >= 0.25 and during[child.pid] >= 0.25, grown
    finally:
        child.kill()
        child.wait()
    assert 0 <= cpu_used(during, tree_cpu(me)) < 0.25  # the child gone: its time leaves, none is taken back


def test_the_report_says_how_much_a_bucketed_model_pads(bench_run):
    """Triton's per-batch-size execution counts give the images the bucketed _aoti model computed per
    image sent; batches between buckets are padded up (2 sent in bucket 8 computes 8)."""
    from serve.bench.report import computed_per_request

    results, out = bench_run
    aoti = results["served"]["models"]["tiny_cnn_aoti"]
    assert aoti["buckets"] == [1, 8] and "buckets" not in results["served"]["models"]["tiny_cnn_onnx"]
    for r in aoti["rows"]:
        sent = sum(int(b) * n for b, n in r["server"]["batch_executions"].items())
        assert sent == r["server"]["requests"]  # every request in exactly one execution
    assert (
        "- tiny_cnn_aoti: computes in static-batch buckets (1, 8), each batch padded up to the next; images "
        "computed per image sent, by concurrency: 1: 1.00, 4: " in (out / "report.md").read_text()
    )
    assert computed_per_request([1, 8, 32], {"1": 4, "8": 2, "32": 1}) == 1.0
    assert computed_per_request([1, 8, 32], {"2": 10}) == 4.0
    assert computed_per_request([1, 8, 32], {"40": 1, "3": 1}) == (32 + 8 + 8) / 43


def test_in_process_beside_served_pairs_each_model_with_its_own_artifact(bench_run):
    """The served _aoti model runs the batch-bucket packages, so it sits beside aoti_buckets in-process."""
    from serve.bench.beside import side_by_side

    results, _ = bench_run
    rows = [line.split(" | ") for line in side_by_side(results) if line.startswith("| tiny_cnn_")]
    assert {r[0].lstrip("| "): r[1] for r in rows} == {"tiny_cnn_onnx": "onnx", "tiny_cnn_aoti": "aoti_buckets"}
    onnx = next(r for r in results["in_process"]["rows"] if r["variant"] == "onnx" and r["batch"] == 1)
    assert f"| tiny_cnn_onnx | onnx | {onnx['p50_ms']:.2f} |" in "\n".join(side_by_side(results))


def test_the_winner_as_served_is_set_beside_in_process_at_the_point_the_search_chose(bench_run):
    """torchship run's summary: the winner as it ends up served (the instances x threads the search chose, from the
    search's windows), beside the same artifact in-process; not the sweep's figures nor another grid point's."""
    from serve.bench.beside import side_by_side

    results, _ = bench_run
    onnx = results["served"]["models"]["tiny_cnn_onnx"]["rows"]
    faster = [{**r, "requests_per_s": 3 * r["requests_per_s"]} for r in onnx]
    slower = [{**r, "requests_per_s": r["requests_per_s"] / 3} for r in onnx]
    grid = [
        {"model": "tiny_cnn_onnx", "instances": 1, "threads": 2, "rows": slower},
        {"model": "tiny_cnn_onnx", "instances": 2, "threads": 1, "rows": faster},
        {"model": "tiny_cnn_aoti", "instances": 2, "threads": 1, "rows": slower},
    ]
    winner = {
        "model": "tiny_cnn_onnx",
        "instances": 2,
        "threads": 1,
        "served_as": "tiny_cnn",
        "placement": {"grid": grid},
    }
    lines = side_by_side(results, winner)
    row = next(line.split(" | ") for line in lines if line.startswith("| tiny_cnn (as served) |"))
    best_ip = max(r["images_per_s"] for r in results["in_process"]["rows"] if r["variant"] == "onnx")
    top = max(faster, key=lambda r: r["requests_per_s"])
    assert row[1] == "onnx" and row[5] == f"{top['requests_per_s']:.0f} (concurrency {top['concurrency']}, 2 x 1)"
    assert row[6].rstrip(" |") == f"{100 * top['requests_per_s'] / best_ip:.0f} %"
    assert not any("(as served)" in line for line in side_by_side(results))  # no search, no such row
    assert not any("(as served)" in line for line in side_by_side(results, {**winner, "placement": {}}))


@pytest.mark.slow
def test_a_model_served_from_the_plain_aoti_package_appears_in_every_table(exported, tmp_path):
    """Where only the dynamic aoti package verified (no bucket archive), the server runs model.pt2: the bench records
    that artifact, and the report sets the model beside aoti in-process, as it does in every other table."""
    from serve.bench.beside import side_by_side
    from torchship.manifest import read_manifest, write_manifest

    d = tmp_path / "export"
    shutil.copytree(exported, d)
    m = read_manifest(d)
    m["artifacts"] = [a for a in m["artifacts"] if a["format"] != "aoti_buckets"]
    write_manifest(d, m)
    cfg = build(
        BenchConfig,
        {
            **SHORT,
            "variants": ["aoti"],
            "batch_sizes": [1],
            "concurrency": [1],
            "noop": False,
            "batching_compare": [],
            "plots": False,
        },
        {"export_dir": str(d), "out": str(tmp_path / "bench"), "models": ["tiny_cnn_aoti"]},
    )
    results = run_bench(cfg, log=lambda *a: None)
    mm = results["served"]["models"]["tiny_cnn_aoti"]
    assert (mm["format"], mm["artifact"]) == ("aoti", "aoti")
    report = (tmp_path / "bench" / "report.md").read_text()
    tables: dict[str, list[str]] = {}
    head = ""
    for line in report.splitlines():
        head = line if line.startswith("## ") else head
        if line.startswith("| tiny_cnn_aoti |"):
            tables.setdefault(head, []).append(line)
    assert {"## Served over gRPC", "## In-process beside served", "## Triton's server-side breakdown"} <= set(tables), (
        tables
    )
    assert tables["## In-process beside served"][0].startswith("| tiny_cnn_aoti | aoti |")
    assert any(line.startswith("| tiny_cnn_aoti | aoti |") for line in side_by_side(results))


def test_one_run_reads_the_reference_once_and_rebuilds_eager_once(exported, server, tmp_path):
    """The manifest's reference.npz is read once per bench run (one read serves its sha256 check and its arrays),
    and eager rebuilt once, however many parts use them: the limits, in-process and served."""
    from pathlib import Path

    import torchship.eager
    import torchship.manifest

    reads, hashed, rebuilds = [], [], []
    read_bytes, rebuild, sha = Path.read_bytes, torchship.eager.checkpoint_model, torchship.manifest.sha256_file

    def counted_read(self):
        reads.append(str(self))
        return read_bytes(self)

    def counted_sha(path, *a, **k):
        hashed.append(str(path))
        return sha(path, *a, **k)

    # with the progress bar, as torchship run and the CLI run it: its total is planned before anything is timed
    cfg = build(
        BenchConfig,
        {**SHORT, "batch_sizes": [1], "concurrency": [1], "requests": 4, "progress": True},
        {"export_dir": str(exported), "out": str(tmp_path), "url": server.url, "models": ["tiny_cnn_onnx"]},
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "read_bytes", counted_read)
        mp.setattr(torchship.manifest, "sha256_file", counted_sha)
        mp.setattr(torchship.eager, "checkpoint_model", lambda *a: rebuilds.append(a) or rebuild(*a))
        results = run_bench(cfg, log=lambda *a: None)
    assert results["in_process"]["rows"] and results["served"]["models"]["tiny_cnn_onnx"]["rows"]
    assert [r for r in reads if r.endswith("reference.npz")] == [str(exported / "reference.npz")]
    assert not [h for h in hashed if h.endswith("reference.npz")] and len(rebuilds) == 1


def test_progress_total_counts_every_window(bench_run, exported):
    """The progress bar's total, planned before anything runs, is three windows per served level and per
    in-process variant and batch: what the run measures when every level settles at once; the rest of
    the windows it ran grow the total as they come."""
    from serve.bench.in_process import in_process_runs

    results, out = bench_run
    s = results["served"]
    sweeps = [m["rows"] for section in ("models", "batching_off") for m in s[section].values()]
    sweeps += [d["rows"] for per_model in s["delays"].values() for d in per_model.values()] + [s["noop"]["rows"]]
    sweeps += [s["entry"]["rows"]]
    cfg = build(BenchConfig, SHORT, {"export_dir": str(exported), "out": str(out)})
    manifest = json.loads((exported / "manifest.json").read_text())
    plan = ServedPlan(list(s["models"]), embedded=True, noop=True, entry=s["entry"]["model"], entry_kind="image")
    plan.sweeps = plan_sweeps(cfg, manifest, plan, cross_check=False)
    assert plan.windows() == 3 * sum(len(rows) for rows in sweeps)
    # the plan the bench recorded, and ran: each sweep's models and levels are those of its rows
    assert [(sw["kind"], tuple(sw["models"]), tuple(sw["levels"])) for sw in s["sweeps"]] == [
        (sw.kind, sw.models, sw.levels) for sw in plan.sweeps
    ]
    loaded = {r["variant"]: None for r in results["in_process"]["rows"]}
    assert in_process_runs(cfg, loaded, manifest) == 3 * len(results["in_process"]["rows"])


@pytest.mark.skipif(not locate(), reason="perf_analyzer not installed (python -m serve.bench.perf_analyzer install)")
def test_perf_analyzer_sends_the_sweep_and_the_python_client_cross_checks(exported, server, tmp_path):
    """--load-generator perf_analyzer: the levels are perf_analyzer's windows (Triton counted every request
    it sent), settled under the same rule; the Python client repeats concurrency 1 and the highest level,
    and the report sets the two side by side with the served/in-process ratio for each."""
    cfg = build(
        BenchConfig,
        {
            **SHORT,
            "batch_sizes": [1],
            "variants": ["onnx"],
            "load_generator": "perf_analyzer",
            "cross_check": True,
            "batching_compare": [],
        },
        {"export_dir": str(exported), "out": str(tmp_path), "url": server.url, "models": ["tiny_cnn_onnx"]},
    )
    results = run_bench(cfg, log=lambda *a: None)
    served = results["served"]
    assert served["load_generator"]["name"] == "perf_analyzer"
    for r in served["models"]["tiny_cnn_onnx"]["rows"]:
        assert r["load_generator"] == "perf_analyzer" and r["failed"] == 0 and 3 <= r["windows"] <= 4
        assert r["p50_ms"] <= r["p90_ms"] <= r["p95_ms"] <= r["p99_ms"] and r["client_cpu_us"] > 0
        # three windows of at least 0.1 s each at the measured rate: Triton saw at least that many requests
        assert r["ok"] == r["server"]["requests"] >= 0.9 * r["requests_per_s"] * 3 * 0.1
        assert r["mean_ms"] == pytest.approx(r["client_side_us"] / 1e3 + r["server"]["server_us"] / 1e3)
        # its windows are checked by a few known requests spread over each, not by a second stream of load
        assert r["checked"] == PACED_CHECKS * r["windows"] and r["wrong"] == 0
    cc = served["cross_check"]
    assert cc["load_generator"] == "python" and [r["concurrency"] for r in cc["rows"]] == [1, 4]
    assert all(r["load_generator"] == "python" and r["ok"] >= SHORT["requests"] for r in cc["rows"])
    report = (tmp_path / "report.md").read_text()
    assert "load generator perf_analyzer (--load-generator perf_analyzer)" in report
    assert "## Cross-check: tiny_cnn_onnx with torchship's Python client" in report
    assert "% with perf_analyzer (" in report and "% with torchship's Python client (" in report


def test_perf_analyzer_asked_for_but_missing_is_refused(exported, tmp_path):
    cfg = build(
        BenchConfig,
        {**SHORT, "load_generator": "perf_analyzer", "skip_in_process": True},
        {"export_dir": str(exported), "out": str(tmp_path), "perf_analyzer": str(tmp_path / "nowhere")},
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("serve.bench.perf_analyzer.locate", lambda explicit=None: None)
        with pytest.raises(BenchError, match="perf_analyzer not found; python -m serve.bench.perf_analyzer install"):
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


def test_compare_detects_a_planted_2x_slowdown(bench_run, exported, tmp_path, capsys):
    results, out = bench_run
    rows, regressions = compare(results, results)
    assert rows and not regressions
    slow = json.loads(json.dumps(results))
    for r in slow["in_process"]["rows"]:
        if r["variant"] == "onnx":  # twice as slow, beyond the spread the run measured (wide on busy cores)
            f = 2 * (1 + r.get("spread", 0))
            r["p50_ms"] *= f
            r["p99_ms"] *= f
            r["images_per_s"] /= f
    rows, regressions = compare(results, slow)
    assert regressions and all("/onnx/" in r["key"] for r in regressions)
    assert all(r["ratio"] >= 2.0 or r["ratio"] <= 0.5 for r in regressions)
    (tmp_path / "new.json").write_text(json.dumps(slow))
    capsys.readouterr()
    assert run_cli("bench", "--compare", out / "results.json", tmp_path / "new.json") == 1
    assert "REGRESSION" in capsys.readouterr().out
    assert run_cli("bench", "--compare", out / "results.json", out / "results.json") == 0
    capsys.readouterr()
    other = json.loads(json.dumps(results))
    other["machine"]["cpu"] = "another CPU"
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert run_cli("bench", "--compare", out / "results.json", tmp_path / "other.json") == 0
    assert "note: measured on different machines (cpu: " in capsys.readouterr().out
    other["export"]["name"] = "resnet18"  # ratios against another model would all read as regressions or gains
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert run_cli("bench", "--compare", out / "results.json", tmp_path / "other.json") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the results are of different models (tiny_cnn " in err[0], err
    for bad, says in (
        (tmp_path / "none.json", "no such results file"),
        (exported / "manifest.json", "unknown format 'torchship.export/2'"),
    ):
        assert run_cli("bench", "--compare", out / "results.json", bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(bad) in err[0] and says in err[0], err


@pytest.mark.slow
def test_unreachable_server_keeps_partial_results(exported, tmp_path, monkeypatch):
    import serve.bench.served
    from serve.embedded.process import free_ports

    monkeypatch.setattr(serve.bench.served, "READY_WAIT_S", 2.0)
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
    from serve.bench.load import closed_loop

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
    rather than ending as if the server stopped cleanly."""
    from serve.embedded import TritonServer

    real_stop = TritonServer.stop

    def stop_with_note(self):
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
    import serve.embedded.server as server_module
    from serve.embedded.wheel import backend_dir
    from torchship.errors import ParityError

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


def test_no_variant_reads_above_its_roof_and_the_report_says_what_set_it():
    from serve.bench.report import probe_share, roofs

    lim = {
        "flops_per_sample": 1e9,
        "fp32_flops": 100e9,
        "fp32_kernel": "torch matmul 2048^3",
        "int8_flops": 400e9,
        "int8_kernel": "onnxruntime MatMulInteger u8 x s8 2048^3",
    }
    rows = [
        {"variant": "onnx", "batch": 32, "images_per_s": 150.0},  # 150 GFLOP/s: faster than the fp32 probe
        {"variant": "torchscript", "batch": 32, "images_per_s": 75.0},
        {"variant": "onnx_int8", "batch": 32, "images_per_s": 200.0},
    ]
    roof = roofs(rows, lim, "float32")
    assert roof["fp32_flops"] == (150e9, "onnx itself at batch 32, faster than the probe's kernels")
    assert roof["int8_flops"] == (400e9, "onnxruntime MatMulInteger u8 x s8 2048^3")
    assert [probe_share(r, lim, "float32", roof) for r in rows] == ["100.0", "50.0", "50.0"]


def test_a_load_generator_that_takes_the_servers_cores_is_named_beside_the_figures():
    from serve.bench.report import client_share_lines

    def served(us):
        return {
            "client_cores": 2,
            "models": {
                "m": {
                    "rows": [
                        {"concurrency": 1, "requests_per_s": 500, "client_cpu_us": us},
                        {"concurrency": 16, "requests_per_s": 2000, "client_cpu_us": us},
                    ]
                }
            },
        }

    (line,) = client_share_lines(served(150), "python")
    assert line.startswith("- m: the load generator took 15 % of the 2 cores at concurrency 16 (150 µs a request)")
    assert "python -m serve.bench.perf_analyzer install" in line
    assert client_share_lines(served(50), "python") == []  # 5 %: within what the server can spare


def test_in_process_runs_as_one_served_instance_unless_told():
    """One runtime's idle threads spinning against the next one's in the same process made the in-process figures
    drift: in-process runs take the threads of one instance of the default placement."""
    assert BenchConfig().threads == default_placement(len(os.sched_getaffinity(0)))[1]
    assert BenchConfig(cores=10).threads == 2 and BenchConfig(cores=2, threads=2).threads == 2


def test_auto_sends_large_requests_with_the_cheaper_python_client(tmp_path):
    """perf_analyzer cost 4x the Python client's CPU a request on resnet50's 588 KiB images: auto keeps it for
    small requests only, and says why."""
    from serve.bench.sweep import PA_MAX_REQUEST_BYTES, load_generators

    fake = tmp_path / "perf_analyzer"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    cfg = BenchConfig(perf_analyzer=str(fake))
    small = {"images": np.zeros((4, 3, 32, 32), np.float32)}
    large = {"images": np.zeros((4, 3, 224, 224), np.float32)}
    assert small["images"][0].nbytes < PA_MAX_REQUEST_BYTES < large["images"][0].nbytes
    first, other, why = load_generators(cfg, small, tmp_path / "a.json")
    assert (first.name, other.name) == ("perf_analyzer", "python")
    first, other, why = load_generators(cfg, large, tmp_path / "b.json")
    assert (first.name, other.name) == ("python", "perf_analyzer") and "requests of 588 KiB, above 64 KiB" in why
    first, _, _ = load_generators(
        BenchConfig(perf_analyzer=str(fake), load_generator="perf_analyzer"), large, tmp_path / "c.json"
    )
    assert first.name == "perf_analyzer"  # asked for by name: sent by it


def test_a_perf_analyzer_window_too_short_is_measured_again_not_counted_as_failed_requests():
    """On a busy machine perf_analyzer's window can hold no completed request, or three windows that disagree past
    any bound: retried longer, then measured by the Python client, never counted as a failed request."""
    from serve.bench.perf_analyzer import python_window, too_short

    assert too_short(
        "perf_analyzer exited 3: No valid requests recorded within time interval. Please use a larger time window."
    )
    assert too_short("perf_analyzer exited 2: Failed to obtain stable measurement within 3 measurement windows")
    assert not too_short("perf_analyzer exited 99: Failed to retrieve results from inference request.")
    w = python_window(
        {"latencies_s": [0.001] * 99 + [0.01], "errors": [], "wall_s": 0.5, "cpu_s": 0.02, "completed": 100},
        "No valid requests recorded",
    )
    assert w["requests_per_s"] == 200 and w["p50_ms"] == pytest.approx(1.0) and w["p99_ms"] == pytest.approx(10.0)
    assert w["errors"] == [] and w["python_instead"] == "No valid requests recorded"


def test_a_wrong_answer_from_the_image_entry_fails_the_bench():
    """The entry's rows go through the same verdict as the models': one wrong response names it."""
    from serve.bench.checks import wrong_in

    row = {"concurrency": 4, "checked": 12, "wrong": 1, "first_wrong": "request 3: output 'logits' max abs error 2"}
    err = wrong_in({"models": {}, "entry": {"model": "tiny_cnn_image", "rows": [row]}})
    assert err is not None and "tiny_cnn_image at concurrency 4 (the image entry, from the held-out files)" in str(err)
    assert wrong_in({"models": {}, "entry": {"model": "tiny_cnn_image", "rows": [{**row, "wrong": 0}]}}) is None
