"""Benchmark stage, who sends the requests: perf_analyzer and torchship's Python client, the load generator's
own share of the cores, and windows perf_analyzer could not measure."""

import numpy as np
import pytest

from tests.helpers import BENCH_SHORT as SHORT
from torchship.config import build
from torchship.serve.bench.config import BenchConfig
from torchship.serve.bench.perf_analyzer import locate
from torchship.serve.bench.run import run_bench
from torchship.serve.bench.sweep import PACED_CHECKS


@pytest.mark.skipif(
    not locate(), reason="perf_analyzer not installed (python -m torchship.serve.bench.perf_analyzer install)"
)
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


def test_a_load_generator_that_takes_the_servers_cores_is_named_beside_the_figures():
    from torchship.serve.bench.report import client_share_lines

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
    assert "python -m torchship.serve.bench.perf_analyzer install" in line
    assert client_share_lines(served(50), "python") == []  # 5 %: within what the server can spare


def test_auto_sends_large_requests_with_the_cheaper_python_client(tmp_path):
    """perf_analyzer cost 4x the Python client's CPU a request on resnet50's 588 KiB images: auto keeps it for
    small requests only, and says why."""
    from torchship.serve.bench.sweep import PA_MAX_REQUEST_BYTES, load_generators

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
    from torchship.serve.bench.perf_analyzer import python_window, too_short

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
