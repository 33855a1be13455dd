"""Benchmark stage: well-formed results and report, ordered percentiles, in-process beside served, the
progress bar's plan, and --compare on a planted slowdown."""

import json
import os
import shutil

import pytest

from tests.conftest import run_cli
from tests.helpers import BENCH_SHORT as SHORT
from torchship.config import build
from torchship.serve.bench.compare import compare
from torchship.serve.bench.config import BenchConfig
from torchship.serve.bench.run import run_bench
from torchship.serve.bench.sweeps import ServedPlan, plan_sweeps
from torchship.serve.config import default_placement


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
    from torchship.serve.bench.report import computed_per_request

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
    from torchship.serve.bench.beside import side_by_side

    results, _ = bench_run
    rows = [line.split(" | ") for line in side_by_side(results) if line.startswith("| tiny_cnn_")]
    assert {r[0].lstrip("| "): r[1] for r in rows} == {"tiny_cnn_onnx": "onnx", "tiny_cnn_aoti": "aoti_buckets"}
    onnx = next(r for r in results["in_process"]["rows"] if r["variant"] == "onnx" and r["batch"] == 1)
    assert f"| tiny_cnn_onnx | onnx | {onnx['p50_ms']:.2f} |" in "\n".join(side_by_side(results))


def test_the_winner_as_served_is_set_beside_in_process_at_the_point_the_search_chose(bench_run):
    """torchship run's summary: the winner as it ends up served (the instances x threads the search chose, from the
    search's windows), beside the same artifact in-process; not the sweep's figures nor another grid point's."""
    from torchship.serve.bench.beside import side_by_side

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
    # against in-process on the same cores: two instances of one thread against the in-process threads
    same = best_ip * 2 / results["in_process"]["threads"]
    assert row[6].rstrip(" |") == f"{100 * top['requests_per_s'] / same:.0f} %"
    # and where a served request's CPU went: the model's own (in-process), the rest of the server, the client
    cost = next(line for line in lines if line.startswith("- tiny_cnn (as served), 2 x 1, "))
    own = 1e6 * results["in_process"]["threads"] / best_ip
    total = top["server_cpu_us"] + top["client_cpu_us"]
    assert f"{total:.0f} µs of CPU a request: the model's own {own:.0f} (" in cost, cost
    assert f"the client {top['client_cpu_us']:.0f} (" in cost and f"on the same cores would give {same:.0f}" in cost
    assert not any("(as served)" in line for line in side_by_side(results))  # no search, no such row
    assert not any("(as served)" in line for line in side_by_side(results, {**winner, "placement": {}}))


@pytest.mark.slow
def test_a_model_served_from_the_plain_aoti_package_appears_in_every_table(exported, tmp_path):
    """Where only the dynamic aoti package verified (no bucket archive), the server runs model.pt2: the bench records
    that artifact, and the report sets the model beside aoti in-process, as it does in every other table."""
    from torchship.manifest import read_manifest, write_manifest
    from torchship.serve.bench.beside import side_by_side

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
    from torchship.serve.bench.in_process import in_process_runs

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


def test_compare_discounts_a_served_slowdown_that_the_machines_own_move_explains(bench_run, tmp_path, capsys):
    """The probe of the machine's own speed, read between the bench's rounds, is in results.json and the report.
    Planted: every served figure 1.5 times slower, beyond its spread; with the probe reading the machine 1.5
    times slower too, --compare does not count them and says why; with the probe steady, they are regressions."""
    results, out = bench_run
    probe = results["served"]["machine_probe"]
    assert len(probe["readings"]) >= 4 and probe["median"] > 0 and "on one core" in probe["probe"]
    rows = [r for mm in results["served"]["models"].values() for r in mm["rows"]]
    assert all(r["machine_moved"] >= 0 for r in rows)
    assert "The machine's own speed, a fixed probe between rounds" in (out / "report.md").read_text()

    slow = json.loads(json.dumps(results))
    for mm in slow["served"]["models"].values():
        for r in mm["rows"]:
            f = 1.5 * (1 + r.get("spread", 0))
            r["p50_ms"] *= f
            r["p99_ms"] *= f
            r["requests_per_s"] /= f
    steady = tmp_path / "steady.json"
    steady.write_text(json.dumps(slow))
    slow["served"]["machine_probe"]["median"] /= 1.5 * (1 + max(r.get("spread", 0) for r in rows))
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(slow))
    _, regressions = compare(results, json.loads(steady.read_text()))
    assert regressions and all(r["key"].startswith("served/models/") for r in regressions)
    rows, none = compare(results, slow)
    assert not none and {r["key"] for r in rows if r.get("explained")} == {r["key"] for r in regressions}
    capsys.readouterr()
    assert run_cli("bench", "--compare", out / "results.json", steady) == 1
    assert run_cli("bench", "--compare", out / "results.json", moved) == 0
    said = capsys.readouterr().out
    assert "the machine's own speed (the probe both benches read between rounds), new/old: 0." in said
    assert "the machine moved -" in said and "more that the machine's own move explains" in said, said[-1500:]


def test_no_variant_reads_above_its_roof_and_the_report_says_what_set_it():
    from torchship.serve.bench.report import probe_share, roofs

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


def test_in_process_runs_as_one_served_instance_unless_told():
    """One runtime's idle threads spinning against the next one's in the same process made the in-process figures
    drift: in-process runs take the threads of one instance of the default placement, for the model at hand (a
    compute-bound one gets every core as one instance)."""
    small, costly = {"flops_per_sample": 7.4e7}, {"flops_per_sample": 8.2e9}
    assert BenchConfig().for_model(small).threads == default_placement(len(os.sched_getaffinity(0)))[1]
    assert BenchConfig(cores=10).for_model(small).threads == 2 and BenchConfig(cores=10).for_model({}).threads == 2
    assert BenchConfig(cores=2).for_model(costly).threads == 2 and BenchConfig(cores=4).for_model(costly).threads == 4
    assert BenchConfig(cores=2, threads=1).for_model(costly).threads == 1  # as given
