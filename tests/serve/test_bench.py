"""Benchmark stage: well-formed results and report, ordered percentiles, --compare, and bad input."""

import json
import os

import numpy as np
import pytest

from serve.bench import compare, read_profile, run_bench, served_runs, split_block_starts, trace_legs
from serve.bench_config import BenchConfig
from serve.report import cpu_pinning
from tests.conftest import run_cli, spinners_of
from torchship.config import build
from torchship.errors import BenchError, ServerError

SHORT = {"variants": ["eager", "onnx", "aoti_buckets"], "batch_sizes": [1, 4], "iters": 8, "blocks": 2, "warmup": 1,
         "concurrency": [1, 4], "requests": 16, "progress": False, "cross_check": False}


@pytest.fixture(scope="module")
def bench_run(exported, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cfg = build(BenchConfig, SHORT, {"export_dir": str(exported), "out": str(out), "rate": 50.0, "duration_s": 0.5,
                                     "trace": True, "transport": "stream",  # the default, unary, in the tests below
                                     "spin_cpus": str(max(os.sched_getaffinity(0)))})
    return run_bench(cfg, log=lambda *a: None), out


def ordered(row):
    return row["min_ms"] <= row["p50_ms"] <= row["p90_ms"] <= row["p95_ms"] <= row["p99_ms"] <= row["max_ms"]


def test_results_and_report_are_well_formed(bench_run):
    results, out = bench_run
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["format"] == "torchship.bench/1" and not on_disk["errors"]
    m = on_disk["machine"]
    assert m["cpu"] and m["cores"] and m["versions"]["torch"] and "git_revision" in m
    assert m["bench_cpus"] == m["server_cpus"] == sorted(os.sched_getaffinity(0))  # nothing pinned: the server inherits
    assert on_disk["limits"]["flops_per_sample"] > 0 and on_disk["limits"]["fp32_flops"] > 0
    rows = on_disk["in_process"]["rows"]
    assert {(r["variant"], r["batch"]) for r in rows} == {(v, b) for v in SHORT["variants"] for b in SHORT["batch_sizes"]}
    for r in rows:
        assert r["n"] == SHORT["iters"] and ordered(r) and r["images_per_s"] > 0
    served = on_disk["served"]
    assert set(served["models"]) == {"tiny_cnn_onnx", "tiny_cnn_torchscript", "tiny_cnn_aoti"}
    for section in ("models", "batching_off"):
        for model, mm in served[section].items():
            assert [r["concurrency"] for r in mm["rows"]] == SHORT["concurrency"]
            for r in mm["rows"]:
                assert r["sent"] == r["ok"] == SHORT["requests"] and r["failed"] == 0, (model, r)
                assert ordered(r)
                assert r["server"]["requests"] == SHORT["requests"]
                assert r["server"]["compute_infer_us"] > 0
    assert served["batching_off"]["tiny_cnn_onnx"]["rows"][0]["server"]["avg_batch"] == 1.0
    assert served["noop"]["rows"][0]["ok"] == SHORT["requests"]
    assert all(v["errors"] == 0 and v["sent"] > 0 for v in served["open_loop"].values())
    assert "model" in on_disk["recommendation"]
    report = (out / "report.md").read_text()
    for png in ("latency_cdf.png", "throughput_vs_concurrency.png", "p99_vs_throughput.png"):
        assert (out / png).stat().st_size > 1000 and png in report
    assert "Which format wins where" in report and "No-op round trip" in report
    pinned = "server on CPU" in report.splitlines()[2]
    assert pinned == (m["server_cpus"] != list(range(m["cores"])))
    assert cpu_pinning({"cores": 4, "bench_cpus": [0], "server_cpus": [2, 3]}) == " · bench on CPU 0, server on CPUs 2,3"
    assert m["server_model_cpus"] == []  # not pinned
    assert m["spin_cpus"] == [max(os.sched_getaffinity(0))] and "spinners on CPU" in report.splitlines()[2]
    assert spinners_of(os.getpid()) == []  # gone with the run
    assert (cpu_pinning({"cores": 2, "cpu_latency_us": 0, "spin_cpus": [0, 1]})
            == " · idle CPUs held within 0 µs of waking, spinners on CPUs 0,1")
    assert (cpu_pinning({"cores": 2, "bench_cpus": [0], "server_cpus": [0], "server_model_cpus": [1]})
            == " · bench on CPU 0, server on CPU 0, models on CPU 1")
    assert "Where the time goes at batch 1" in report and "one at a time over one bidirectional gRPC stream" in report
    gains = report.split("Dynamic batching gain for tiny_cnn_onnx")[1].split("\n\n")[1].splitlines()
    assert gains[0].startswith("- concurrency 1: ") and gains[0].endswith("(no batches formed: the difference is not batching)")
    if served["models"]["tiny_cnn_onnx"]["rows"][1]["server"]["avg_batch"] > 1:
        assert "no batches formed" not in gains[1]


def test_overhead_is_measured_side_by_side_and_attributed(bench_run, exported):
    """In-process, served and floor for every served model, with Triton's and the backend's breakdown."""
    results, _ = bench_run
    ov = results["served"]["overhead"]
    n, timed = ov["requests_per_path"], ov["timed_per_path"]  # made; in the percentiles (each block's first left out)
    assert ov["settling_per_block"] >= 1 and timed == n - ov["settling_per_block"] * ov["blocks"]
    assert {r["model"]: r["variant"] for r in ov["rows"]} == {
        "tiny_cnn_onnx": "onnx", "tiny_cnn_torchscript": "torchscript", "tiny_cnn_aoti": "aoti_buckets"}
    for r in ov["rows"]:
        assert r["in_process"]["n"] == r["served"]["n"] == r["floor"]["n"] == timed
        assert r["block_starts"]["served"]["n"] == r["block_starts"]["in_process"]["n"] == n - timed
        assert r["excess_p50_ms"] == pytest.approx(r["served"]["p50_ms"] - r["in_process"]["p50_ms"] - r["floor"]["p50_ms"])
        q = r["in_process_paused"]  # the same artifact, with an untimed floor-long sleep before each call
        assert q["n"] == timed and q["pause_ms"] > 0 and q["p50_ms"] < q["pause_ms"] + r["in_process"]["p50_ms"]
        assert r["excess_vs_paused_p50_ms"] == pytest.approx(r["served"]["p50_ms"] - q["p50_ms"] - r["floor"]["p50_ms"])
        assert r["server"]["requests"] == n, "statistics must cover exactly this section's requests"
        b = r["backend"]
        assert b and min(b.values()) > 0, r  # the backend wrote its profile for this model
        # the backend's time is part of Triton's compute time, not beside it
        sv = r["server"]
        assert b["pre_us"] + b["run_us"] + b["post_us"] < sv["compute_input_us"] + sv["compute_infer_us"] + sv["compute_output_us"]
        if results["machine"]["python_host"] == "server":  # the model's own run is what Triton books as compute infer
            assert b["run_us"] == pytest.approx(sv["compute_infer_us"], rel=0.05)
    assert ov["floor_server"]["requests"] == n
    for r in ov["rows"]:  # the hold spins the model's in-process time, so it can't answer faster than that
        held = r["hold"]["hold_us_per_block"]  # set before each block from the model's in-process times so far
        assert len(held) == ov["blocks"] and r["hold"]["n"] == timed and r["hold"]["min_ms"] >= min(held) / 1e3
        assert r["served_minus_hold_p50_ms"] == pytest.approx(r["served"]["p50_ms"] - r["hold"]["p50_ms"])
    files = {a["name"]: a["file"] for a in json.loads((exported / "manifest.json").read_text())["artifacts"]}
    for r in ov["rows"]:  # meanwhile it reads through a buffer as large as the model's file (bucket 1's for buckets)
        assert r["hold"]["memory_bytes"] == (exported / files[r["variant"]]).stat().st_size > 0
        assert r["hold"]["read_bytes_mean"] > 0, "the hold said it read nothing while it waited"


def test_progress_total_counts_every_timed_served_call(bench_run, exported):
    """The progress bar's total for the served part equals the calls the run actually timed."""
    results, out = bench_run
    s = results["served"]
    sweeps = [m["rows"] for section in ("models", "batching_off") for m in s[section].values()]
    sweeps += [d["rows"] for per_model in s["delays"].values() for d in per_model.values()] + [s["noop"]["rows"]]
    ov = s["overhead"]
    paths = 1 + sum(2 + ("served" in r) + ("hold" in r) for r in ov["rows"])  # the floor; in-process twice each
    timed = sum(r["sent"] for rows in sweeps for r in rows) + paths * ov["requests_per_path"]
    cfg = build(BenchConfig, SHORT, {"export_dir": str(exported), "out": str(out), "rate": 50.0, "duration_s": 0.5})
    manifest = json.loads((exported / "manifest.json").read_text())
    assert served_runs(cfg, manifest, list(s["models"]), embedded=True, floors=(True, True)) == timed


def test_trace_splits_every_round_trip(bench_run):
    """--trace: every timed call of every served path is matched with its own trace in Triton's file."""
    results, out = bench_run
    ov = results["served"]["overhead"]
    legs, n = ov["trace"]["legs"], ov["timed_per_path"]
    assert (out / "triton_trace.json").stat().st_size > 0
    assert set(legs) == {f"{r['model']}/{p}" for r in ov["rows"] for p in ("served", "hold")} | {"floor"}
    for path, g in legs.items():
        assert g["requests"] == n, path
        assert min(v for k, v in g.items() if k.endswith("_us")) >= 0, (path, g)
    for r in ov["rows"]:  # the hold's busy-wait lies inside its backend leg, and the floor's backend leg is shorter
        assert legs[f"{r['model']}/hold"]["backend_us"] >= min(r["hold"]["hold_us_per_block"])
        assert legs["floor"]["backend_us"] < legs[f"{r['model']}/hold"]["backend_us"]
    aw = ov["after_wait_us"]
    assert set(aw) == {"spin", "sleep"} and len(aw["spin"]) == 1 + len(ov["rows"]) and min(aw["spin"].values()) > 0
    assert "Triton's trace" in (out / "report.md").read_text()


def test_block_starts_are_split_from_each_blocks_steady_calls():
    """The overhead percentiles leave out the first calls of every block, and only those: a path's first calls
    after another path ran are slow for a reason no served request meets (the other path swept the caches)."""
    per_block, settle = 6, 2
    calls = [100.0 if j % per_block < settle else 1.0 + j for j in range(3 * per_block)]  # 3 blocks, slow starts
    first, rest = split_block_starts(calls, per_block, settle)
    assert first == [100.0] * 6 and len(rest) == 12 and max(rest) < 100
    assert rest == [c for c in calls if c != 100.0]  # in order, nothing else dropped
    assert split_block_starts(calls, per_block, 0) == ([], calls)


def test_trace_legs_match_each_call_with_its_own_request():
    """Matching is by model and time: a call whose window holds no trace of its model is left out, and a
    trace of another model in the same window is not taken for it."""
    ev = ["GRPC_WAITREAD_END", "REQUEST_START", "COMPUTE_START", "COMPUTE_END", "GRPC_SEND_START"]

    def t(start):
        return dict(zip(ev, (start - 5, start, start + 20, start + 1020, start + 1030)))

    trace = {"a": [t(1_000), t(10_000)], "b": [t(20_000)]}
    stamps = {"a/served": [(990, 2_100), (9_990, 11_100), (19_990, 21_100)], "b/served": [(990, 2_100), (19_990, 21_100)]}
    legs = trace_legs(trace, stamps, {"a/served": "a", "b/served": "b"})
    assert legs["a/served"]["requests"] == 2 and legs["b/served"]["requests"] == 1
    g = legs["a/served"]  # µs from ns stamps: 5 ns until read, 25 to the model, 1000 in it, 10 to gRPC, 70 back
    assert [g[f"{k}_us"] for k in ("request", "to_model", "backend", "after_model", "response")] == \
        pytest.approx([0.005, 0.025, 1.0, 0.010, 0.070])


def test_backend_profile_counts_each_request_once(exported, tmp_path):
    """The profile's request count follows the requests sent, batched or not: it cannot silently drift."""
    from serve.client import TritonClient
    from serve.config import RepoConfig, ServeConfig
    from serve.repository import build_repository
    from serve.server import TritonServer

    build_repository(exported, RepoConfig(out=str(tmp_path / "repo"), formats=("onnx",)))
    prof = tmp_path / "profile"
    with TritonServer(ServeConfig(repo=str(tmp_path / "repo"), backend_profile=str(prof))) as s:
        c = TritonClient(s.url)
        for batch in (1, 3, 8):
            c.infer("tiny_cnn_onnx", np.random.default_rng(batch).random((batch, 3, 32, 32), dtype=np.float32))
        c.close()
    p = read_profile(str(prof), "tiny_cnn_onnx")  # finalize() writes the last totals
    assert p["requests"] == p["executions"] == 3 + 1  # three requests, plus the model's warm-up sample
    assert p["run_ns"] > 0 and p["pre_ns"] > 0 and p["post_ns"] > 0


def test_compare_detects_a_planted_2x_slowdown(bench_run, exported, tmp_path, capsys):
    results, out = bench_run
    rows, regressions = compare(results, results)
    assert rows and not regressions
    slow = json.loads(json.dumps(results))
    for r in slow["in_process"]["rows"]:
        if r["variant"] == "onnx":
            r["p50_ms"] *= 2
            r["p99_ms"] *= 2
            r["images_per_s"] /= 2
    rows, regressions = compare(results, slow)
    assert regressions and all("/onnx/" in r["key"] for r in regressions)
    assert {round(r["ratio"], 3) for r in regressions} <= {2.0, 0.5}
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
    for bad, says in ((tmp_path / "none.json", "no such results file"),
                      (exported / "manifest.json", "unknown format 'torchship.export/1'")):
        assert run_cli("bench", "--compare", out / "results.json", bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(bad) in err[0] and says in err[0], err


def test_unreachable_server_keeps_partial_results(exported, tmp_path):
    from serve.server import free_ports

    cfg = build(BenchConfig, SHORT, {"export_dir": str(exported), "out": str(tmp_path), "variants": ["onnx"],
                                     "url": f"127.0.0.1:{free_ports()[0]}"})
    with pytest.raises(ServerError, match="partial results kept"):
        run_bench(cfg, log=lambda *a: None)
    kept = json.loads((tmp_path / "results.json").read_text())
    assert kept["in_process"]["rows"] and kept["errors"]


def test_bench_server_takes_the_bench_settings_the_serve_section_leaves_open(exported, repo, tmp_path):
    """torchship run hands bench_server its serve section: bench.python_host, bench.server_cpus and
    bench.server_model_cpus apply where that section leaves them at their defaults, and give way where it
    sets them."""
    from serve.bench import bench_server
    from serve.config import ServeConfig
    from torchship.manifest import read_manifest

    cfg = build(BenchConfig, SHORT, {"export_dir": str(exported), "out": str(tmp_path), "python_host": "stub",
                                     "server_cpus": "0", "server_model_cpus": "0"})
    manifest = read_manifest(exported)
    s = bench_server(ServeConfig(repo=str(repo)), cfg, manifest, tmp_path)
    assert (s.python_host, s.cpus, s.model_cpus) == ("stub", [0], [0])
    assert "--host-policy=cpu,cpu-cores=0-0" in s.command()
    last = max(os.sched_getaffinity(0))
    s = bench_server(ServeConfig(repo=str(repo), python_host="server", cpus=str(last), model_cpus=str(last)), cfg,
                     manifest, tmp_path)
    assert (s.python_host, s.cpus, s.model_cpus) == ("server", [last], [last])
    assert s.proc is None  # nothing started


@pytest.mark.parametrize("where", ["url", "repo", "built"])
def test_unknown_model_is_refused_before_anything_runs(exported, repo, server, tmp_path, where):
    """--models naming a model that will not be served is refused up front, naming the models there are,
    before the in-process part runs or a server starts, with nothing written."""
    out = tmp_path / "out"
    given = {"url": {"url": server.url}, "repo": {"repo": str(repo)}, "built": {}}[where]
    cfg = build(BenchConfig, SHORT, {"export_dir": str(exported), "out": str(out), "models": ["tiny_cnn_nope"], **given})
    with pytest.raises(BenchError, match=r"--models tiny_cnn_nope: not in .*; choose from .*tiny_cnn_onnx"):
        run_bench(cfg, log=lambda *a: None)
    assert not out.exists()


def test_budget_no_configuration_meets(exported, server, tmp_path, capsys):
    """Against an already-running server: a budget nothing meets is an error that keeps the results, and
    the sweeps that need the embedded server (batching off, by default) are reported as not done."""
    cfg = build(BenchConfig, SHORT, {"export_dir": str(exported), "out": str(tmp_path), "skip_in_process": True,
                                     "url": server.url, "models": ["tiny_cnn_onnx"], "p99_budget_ms": 0.001})
    with pytest.raises(BenchError, match="no configuration meets p99 <= 0.001 ms"):
        run_bench(cfg, log=lambda *a: None)
    served = json.loads((tmp_path / "results.json").read_text())["served"]
    assert served["models"]["tiny_cnn_onnx"]["rows"] and not served["batching_off"]
    assert "only the embedded server allows" in served["reconfigured"]["skipped"]
    assert "Batching off and queue delays: the sweeps" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("transport", ["stream", "unary"])
def test_one_at_a_time_counts_each_refusal_and_goes_on(server, transport):
    """Concurrency 1 over either transport: every good request is timed, every refused one is an error
    with the server's message, and the requests after a refusal are still sent."""
    from serve.bench import closed_loop

    good = np.random.default_rng(0).random((1, 3, 32, 32), dtype=np.float32)
    bad = np.zeros((1, 3, 16, 16), np.float32)
    r = closed_loop(server.url, "tiny_cnn_onnx", [good], 1, 12, "images", transport)
    assert len(r["latencies_s"]) == 12 and not r["errors"]
    # a good request first: a stream whose first request is refused keeps its model from unloading
    # (Triton 2.51; test_serve's test_a_stream_whose_first_request_is_refused_still_stops)
    r = closed_loop(server.url, "tiny_cnn_onnx", [good, bad], 1, 12, "images", transport)
    assert len(r["latencies_s"]) == 6 and len(r["errors"]) == 6
    assert all("shape" in e for e in r["errors"]), r["errors"][0]


def test_a_server_stop_note_reaches_the_bench_log_results_and_report(exported, tmp_path, monkeypatch):
    """When the bench's own server had to be killed (a model that would not unload), the bench says so
    rather than ending as if the server stopped cleanly."""
    from serve.server import TritonServer

    real_stop = TritonServer.stop

    def stop_with_note(self):
        code = real_stop(self)
        self.stop_note = "tiny_cnn_onnx still loaded (planted)"
        return code

    monkeypatch.setattr(TritonServer, "stop", stop_with_note)
    cfg = build(BenchConfig, {**SHORT, "skip_in_process": True, "overhead": False, "concurrency": [1], "requests": 2,
                              "models": ["tiny_cnn_onnx"], "batching_compare": [], "plots": False},
                {"export_dir": str(exported), "out": str(tmp_path)})
    lines = []
    results = run_bench(cfg, log=lines.append)
    assert results["server_stop_note"] == "tiny_cnn_onnx still loaded (planted)"
    assert "note: tiny_cnn_onnx still loaded (planted)" in lines
    assert "killed at the end: tiny_cnn_onnx still loaded" in (tmp_path / "report.md").read_text()


def test_the_hold_reads_memory_while_it_waits(backend):
    """The hold model, called directly as its host calls it: it waits as long as asked, reads through a buffer of
    the size asked meanwhile and says how much it read; asked for no bytes, it only waits."""
    import time

    hold = backend.FloorModel()
    hold.initialize({"model_name": "hold", "model_config": json.dumps({
        "input": [{"name": "x"}], "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": ["10"]}],
        "parameters": {"hold": {"string_value": "true"}}})})
    for nbytes in (1 << 20, 0):
        x = np.zeros((1, 3, 4, 4), np.float32)
        x.flat[:2] = 3000, nbytes  # µs, bytes
        t0 = time.perf_counter()
        results, _, _ = hold.run([x])
        assert time.perf_counter() - t0 >= 3e-3
        (y,), = results
        assert y.shape == (1, 10) and not y.flat[1:].any()
        assert (y.flat[0] > 0) == bool(nbytes), f"asked to read {nbytes} bytes, it says it read {y.flat[0]:.0f}"
    assert hold._buf.nbytes == 1 << 20  # kept at the largest size asked: a wait that reads nothing does not shrink it
