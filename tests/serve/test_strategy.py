"""The strategy picks the winner from bench figures (a doctored results file picks another), and the winner is
served under the export's plain name by the real Triton, held to the same parity as under its own name."""

import json
import os

import pytest

from tests.conftest import run_cli
from torchship.errors import ConfigError
from torchship.serve.bench.placement import grid_of, placement_of
from torchship.serve.bench.search import Point, choose, deep_level, search_levels
from torchship.serve.bench.strategy import pick
from torchship.serve.config import ServeConfig, parse_strategy
from torchship.serve.embedded import TritonServer
from torchship.serve.model_config import read_config
from torchship.serve.parity import check_served

MANIFEST = {"name": "tiny_cnn", "max_batch": 8}


def row(c, rps, p50, p99):
    return {"concurrency": c, "requests_per_s": rps, "p50_ms": p50, "p99_ms": p99, "n": 100, "failed": 0}


def results(onnx, int8):
    return {
        "served": {
            "models": {
                "tiny_cnn_onnx": {"rows": onnx},
                "tiny_cnn_onnx_int8": {"rows": int8},
                "_torchship_noop": {"rows": [row(1, 5000, 0.2, 0.3)]},
            }
        }
    }


FAST_INT8 = results(
    [row(1, 200, 4.0, 6.0), row(16, 600, 25.0, 40.0)], [row(1, 300, 3.0, 5.0), row(16, 900, 17.0, 30.0)]
)
LOW_LATENCY_ONNX = results(
    [row(1, 400, 2.0, 3.0), row(16, 700, 20.0, 35.0)], [row(1, 300, 3.0, 5.0), row(16, 900, 17.0, 60.0)]
)


@pytest.mark.parametrize(
    "res, strategy, model, runner_up",
    [
        (FAST_INT8, "max-throughput", "tiny_cnn_onnx_int8", "tiny_cnn_onnx"),
        (FAST_INT8, "min-latency", "tiny_cnn_onnx_int8", "tiny_cnn_onnx"),
        (LOW_LATENCY_ONNX, "max-throughput", "tiny_cnn_onnx_int8", "tiny_cnn_onnx"),
        (LOW_LATENCY_ONNX, "min-latency", "tiny_cnn_onnx", "tiny_cnn_onnx_int8"),
        (LOW_LATENCY_ONNX, "p99-budget=50", "tiny_cnn_onnx", "tiny_cnn_onnx_int8"),  # int8's 900 req/s has p99 60 ms
    ],
)
def test_the_strategy_picks_from_the_figures(res, strategy, model, runner_up):
    w = pick(res, strategy, MANIFEST)
    assert (w["model"], w["runner_up"]["model"]) == (model, runner_up)
    assert w["format"] == model[len("tiny_cnn_") :] and w["why"].startswith(f"{strategy}: ") and "runner-up" in w["why"]


def test_max_throughput_is_read_where_the_server_saturates_not_deeper_in_the_queue():
    """Throughput level from 16 to 64 in flight (within 5 %): the winner's figures, the recommendation's batch
    and its p99 are those at 16; a clear gain at 64 (more than 5 %) still takes 64."""
    from torchship.serve.bench.recommend import recommend

    flat = results(
        [row(1, 30, 33.0, 44.0), row(16, 34, 463.0, 491.0)],
        [row(1, 77, 13.0, 20.0), row(16, 95, 157.0, 221.0), row(64, 98, 600.0, 660.0)],
    )
    w = pick(flat, "max-throughput", MANIFEST)
    assert w["model"] == "tiny_cnn_onnx_int8" and w["row"]["concurrency"] == 16 and w["row"]["p99_ms"] == 221.0

    def int8_only(res):
        return {"served": {"models": {"tiny_cnn_onnx_int8": res["served"]["models"]["tiny_cnn_onnx_int8"]}}}

    rec = recommend(int8_only(flat), None, 32)
    assert (rec["model"], rec["at_concurrency"], rec["max_batch_size"]) == ("tiny_cnn_onnx_int8", 16, 16)
    deeper = results([row(1, 30, 33.0, 44.0)], [row(16, 1750, 9.0, 21.0), row(64, 3488, 17.0, 36.0)])
    assert pick(deeper, "max-throughput", MANIFEST)["row"]["concurrency"] == 64
    assert recommend(int8_only(deeper), None, 32)["at_concurrency"] == 64


def test_the_benchs_p99_budget_holds_max_throughput_within_it():
    """A bench run with --p99-budget-ms keeps that budget in its results: max-throughput judged on them is the
    highest throughput within it, so the choice moves where the fastest point's p99 is over the budget, and the
    winner's p99 at the level it was chosen at stands beside that at MIDDLE in flight."""
    queue = results(
        [row(1, 400, 2.0, 3.0), row(16, 700, 20.0, 35.0)],
        [row(1, 300, 3.0, 5.0), row(16, 800, 17.0, 30.0), row(64, 1000, 60.0, 120.0)],
    )
    w = pick(queue, "max-throughput", MANIFEST)
    assert (w["model"], w["row"]["concurrency"], w["strategy"]) == ("tiny_cnn_onnx_int8", 64, "max-throughput")
    assert w["at_middle"]["p99_ms"] == 30.0 and "(at 16 in flight: 800 req/s at p99 30.00 ms" in w["why"]
    budget = {**queue, "config": {"p99_budget_ms": 50.0}}
    w = pick(budget, "max-throughput", MANIFEST)  # int8 at 16 within it, beyond the noise of onnx's 700
    assert (w["model"], w["row"]["concurrency"], w["strategy"]) == ("tiny_cnn_onnx_int8", 16, "p99-budget=50")
    assert "at_middle" not in w and w["why"].startswith("p99-budget=50: the highest throughput with p99 <= 50 ms")
    tight = {**queue, "config": {"p99_budget_ms": 32.0}}
    assert pick(tight, "max-throughput", MANIFEST)["model"] == "tiny_cnn_onnx_int8"  # 30 ms: still within
    tighter = {**queue, "config": {"p99_budget_ms": 10.0}}
    w = pick(tighter, "max-throughput", MANIFEST)  # only the one-request rows: onnx's 400 against int8's 300
    assert (w["model"], w["row"]["concurrency"]) == ("tiny_cnn_onnx", 1)
    assert pick(budget, "min-latency", MANIFEST)["strategy"] == "min-latency"  # a budget leaves min-latency as it is
    assert search_levels("p99-budget", (1, 64), 64) == (1, 16, 64)  # under a budget the middle level is searched


def test_a_runner_up_within_the_noise_is_said_to_be():
    """The search serves a point it measured; a model the sweep alone measured is a runner-up at most, and where
    its figures lie within the noise of the winner's, the winner's words say that a rerun may serve either. Where
    the gap is wider they say nothing of the kind."""
    from torchship.serve.bench.search import settle
    from torchship.serve.bench.strategy import winner_of

    searched = [Point("tiny_cnn_onnx", "float32", 1, 2, [row(16, 950, 20.0, 35.0)])]
    swept = Point("tiny_cnn_onnx_int8", "int8", 1, 2, [row(16, 900, 17.0, 30.0)])
    w = winner_of(settle(searched, [swept], "max-throughput", None, 0.10, MANIFEST, {}), "max-throughput", MANIFEST)
    assert (w["model"], w["runner_up"]["model"], w["runner_up"]["within_noise"]) == (
        "tiny_cnn_onnx",
        "tiny_cnn_onnx_int8",
        True,
    )
    assert "tiny_cnn_onnx_int8, 900 req/s at p99 30.00 ms, p50 17.00 ms, 16 in flight, 5 % below the winner" in w["why"]
    assert "within the noise (10 %; the machine's own speed moved 0 % while they were measured): a rerun" in w["why"]
    w = pick(FAST_INT8, "max-throughput", MANIFEST)  # 900 against 600: a third below
    assert "within_noise" not in w["runner_up"] and "a rerun may serve" not in w["why"]
    moved = results([row(16, 600, 25.0, 40.0)], [{**row(16, 900, 17.0, 30.0), "machine_moved": 0.4}])
    w = pick(moved, "max-throughput", MANIFEST)  # a third below, while the machine's speed moved 40 %
    assert w["runner_up"]["within_noise"] and "the machine's own speed moved 40 % while" in w["why"]


def test_within_the_noise_the_stated_rule_chooses_and_beyond_it_the_figures_do():
    """The choice repeats from run to run: points whose scores lie within the noise (the windows' agreement, or a
    row's own spread where it is wider) are ordered by the higher precision, then the lower p99, then the fewer
    instances, not by which window was luckier."""
    from torchship.serve.bench.search import Point, choose

    def p(model, precision, instances, rps, p99, spread=0.0, p50=5.0):
        return Point(model, precision, instances, 2 // instances, [{**row(16, rps, p50, p99), "spread": spread}])

    def chosen(points, kind="max-throughput"):
        return choose(points, kind, None, 0.10).chosen

    fp32 = p("m_onnx", "float32", 2, 1000.0, 30.0)
    assert chosen([fp32, p("m_onnx_int8", "int8", 2, 1080.0, 20.0)]) is fp32  # 8 % apart: the higher precision
    faster = p("m_onnx_int8", "int8", 2, 1200.0, 20.0)
    assert chosen([fp32, faster]) is faster  # 20 % apart: the figures
    assert chosen([fp32, p("m_onnx_int8", "int8", 2, 1200.0, 20.0, spread=0.25)]) is fp32  # its windows moved 25 %
    calmer = p("m_onnx", "float32", 1, 960.0, 25.0)
    assert chosen([fp32, calmer]) is calmer  # one precision: the lower p99
    assert chosen([fp32, p("m_onnx", "float32", 1, 960.0, 30.0)]).instances == 1  # and then the fewer instances
    quick = p("m_onnx_int8", "int8", 2, 500.0, 20.0, p50=2.0)
    assert chosen([fp32, quick], "min-latency") is quick  # min-latency scores -p50: 2.0 against 5.0 ms
    near = choose([fp32, faster, calmer], "max-throughput", None, 0.10)
    assert (near.best, set(map(id, near.near))) == (faster, {id(faster)})  # fp32 and calmer 17 % and 20 % below 1200
    assert choose([fp32], "p99-budget", 10.0, 0.10) is None  # nothing within the budget


def test_the_search_serves_a_point_it_measured_and_the_others_are_runners_up_at_most():
    """The sweep's other models join the search's final choice as runners-up only: on a busy machine a contender's
    later windows can read below another model's earlier sweep figure, and the plain name must still go to a
    model the search placed (the summary's "as served" row is its figures). Under a p99 budget no searched point
    meets, every point is considered."""
    from torchship.serve.bench.search import settle
    from torchship.serve.bench.strategy import winner_of

    searched = [
        Point("tiny_cnn_onnx", "float32", n, 2 // n, [row(16, rps, 5.0, 9.0)]) for n, rps in ((1, 800), (2, 900))
    ]
    other = Point("tiny_cnn_onnx_int8", "int8", 1, 2, [row(16, 1500, 4.0, 30.0)])
    final = settle(searched, [other], "max-throughput", None, 0.10, MANIFEST, {})
    assert final.chosen is searched[1] and other in final.points
    w = winner_of(final, "max-throughput", MANIFEST)
    assert (w["model"], w["instances"], w["runner_up"]["model"]) == ("tiny_cnn_onnx", 2, "tiny_cnn_onnx_int8")
    calm = Point("tiny_cnn_onnx_int8", "int8", 1, 2, [row(16, 700, 4.0, 6.0)])
    assert settle(searched, [calm], "p99-budget", 8.0, 0.10, MANIFEST, {}).chosen is calm  # only it meets 8 ms


def test_a_budget_nothing_meets_and_a_bad_strategy_are_refused():
    with pytest.raises(ConfigError, match=r"no served model meets p99 <= 1 ms \(the lowest p99 measured was 3.00 ms\)"):
        pick(LOW_LATENCY_ONNX, "p99-budget=1", MANIFEST)
    for bad in ("fastest", "p99-budget=", "p99-budget=-3", "p99-budget=x"):
        with pytest.raises(ConfigError, match="choose max-throughput, min-latency or p99-budget=MS"):
            parse_strategy(bad)


@pytest.mark.slow
def test_the_winner_answers_under_the_plain_name_and_is_held_to_its_gate(int8_export, tmp_path, capsys, monkeypatch):
    import torchship.serve.bench.config

    monkeypatch.setitem(torchship.serve.bench.config.SHORT_BENCH, "window_s", 0.1)  # the search, in shorter windows
    bench = tmp_path / "results.json"
    bench.write_text(json.dumps(FAST_INT8))
    repo = tmp_path / "repo"
    assert run_cli("repo", int8_export, "--out", repo, "--strategy", "max-throughput", "--bench", bench) == 0
    out = capsys.readouterr().out
    assert (
        "served as tiny_cnn: max-throughput: the highest served throughput: tiny_cnn_onnx_int8 (int8, accuracy " in out
    )
    winner = json.loads((repo / "tiny_cnn" / "winner.json").read_text())  # the precision and its gate's figures
    # the file's figures chose what to search (INT8 alone: 900 against 600 req/s); the search's own figures, at the
    # placement it chose, are the winner's
    chosen = next(
        g
        for g in winner["placement"]["grid"]
        if (g["model"], g["instances"], g["threads"]) == (winner["model"], winner["instances"], winner["threads"])
    )
    assert winner["placement"]["contenders"] == ["tiny_cnn_onnx_int8"] and chosen["source"] == "search"
    assert winner["row"] in [{k: r[k] for k in winner["row"]} for r in chosen["rows"]] and winner["figures"] in out
    assert (
        winner["precision"] == "int8"
        and winner["gate"]["max_accuracy_drop"] == 2.0
        and "accuracy_drop" in winner["gate"]
    )
    readme = (repo / "README.md").read_text()
    assert "## Served by strategy" in readme and "(onnx_int8, int8; accuracy " in readme
    assert 'string_value: "onnx_int8"' in (repo / "tiny_cnn" / "config.pbtxt").read_text()
    with TritonServer(ServeConfig(repo=str(repo))) as s:
        report = check_served(s.url, int8_export, models=["tiny_cnn"])
        assert report["pass"] and "accuracy" in report["models"]["tiny_cnn"]["heldout"]  # the INT8 gate, not a bound
        assert sorted(check_served(s.url, int8_export)["models"]) == [
            "tiny_cnn",
            "tiny_cnn_aoti_int8",
            "tiny_cnn_image",  # in front of the INT8 winner: held to its answers on training's tensors
            "tiny_cnn_onnx",
            "tiny_cnn_onnx_int8",
        ]
    only = tmp_path / "only"
    assert (
        run_cli("repo", int8_export, "--out", only, "--strategy", "min-latency", "--bench", bench, "--only-winner") == 0
    )
    # the winner alone, and the image entry in front of it
    assert sorted(p.name for p in only.iterdir() if p.is_dir()) == ["tiny_cnn", "tiny_cnn_image", "tiny_cnn_image_pre"]
    assert read_config(only / "tiny_cnn_image" / "config.pbtxt").ensemble_scheduling.step[-1].model_name == "tiny_cnn"


@pytest.mark.slow
def test_without_a_bench_file_a_short_bench_picks_the_winner(int8_export, tmp_path, capsys, monkeypatch):
    import torchship.serve.bench.config
    import torchship.serve.bench.search
    import torchship.serve.bench.strategy

    monkeypatch.setitem(torchship.serve.bench.config.SHORT_BENCH, "window_s", 0.1)  # the same bench, in shorter windows
    for module in (torchship.serve.bench.search, torchship.serve.bench.strategy):  # the middle level below the deep
        monkeypatch.setattr(module, "MIDDLE", 4)  # one, 16 here (max batch 8 on two instances)
    repo = tmp_path / "repo"
    assert (
        run_cli("repo", int8_export, "--out", repo, "--formats", "onnx", "onnx_int8", "--strategy", "max-throughput")
        == 0
    )
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "repo-bench" / "results.json").read_text())
    served = results["served"]["models"]
    assert sorted(served) == ["tiny_cnn_onnx", "tiny_cnn_onnx_int8"] and "in_process" not in results
    best = max(served, key=lambda m: max(r["requests_per_s"] for r in served[m]["rows"]))
    winner = json.loads((repo / "tiny_cnn" / "winner.json").read_text())
    assert f"served as tiny_cnn: max-throughput: the highest served throughput: {winner['model']}" in out
    # the models that could win (the bench's best, and any within the noise of it) searched at each instances x
    # threads within this machine's cores, every response checked, at the levels that decide max-throughput; the
    # chosen point written into the winner's configs
    placement = winner["placement"]
    cores = len(os.sched_getaffinity(0))
    assert {best, winner["model"]} <= set(placement["contenders"]) and placement["load_generator"] == "python"
    for model in placement["contenders"]:
        at = {(g["instances"], g["threads"]) for g in placement["grid"] if g["model"] == model}
        assert at == set(grid_of(cores)), at
    levels = search_levels(
        "max-throughput", torchship.serve.bench.config.SHORT_BENCH["concurrency"], deep_level(8, cores)
    )
    for g in placement["grid"]:
        assert set(levels) <= {r["concurrency"] for r in g["rows"]}
        assert all(r["checked"] > 0 and r["wrong"] == 0 for r in g["rows"])
    points = [Point(g["model"], g["precision"], g["instances"], g["threads"], g["rows"]) for g in placement["grid"]]
    again = choose(points, "max-throughput", None, 0.10).chosen  # the stated rule over the figures it recorded
    assert (again.model, again.instances, again.threads) == (winner["model"], winner["instances"], winner["threads"])
    assert {placement_of(read_config(p)) for p in (repo / "tiny_cnn").glob("*.pbtxt")} == {again.placement}
    won = next(
        g
        for g in placement["grid"]
        if (g["model"], g["instances"], g["threads"]) == (winner["model"], *again.placement)
    )
    assert 4 in {r["concurrency"] for r in won["rows"]}  # the winner measured at the middle level too
    assert 4 in (winner["row"]["concurrency"], winner.get("at_middle", {}).get("concurrency"))
    assert "The models that could win, at each instances x intra-op threads on" in (repo / "README.md").read_text()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--only-winner"], "--bench and --only-winner go with --strategy"),
        (["--bench", "r.json"], "--bench and --only-winner go with --strategy"),
        (
            ["--strategy", "max-throughput", "--bench", "missing.json"],
            "--bench missing.json: cannot read it as bench results",
        ),
        (["--strategy", "fast", "--bench", "r.json"], "choose max-throughput, min-latency or p99-budget=MS"),
    ],
)
def test_bad_strategy_input_is_refused_and_writes_nothing(exported, tmp_path, capsys, args, says):
    code = run_cli("repo", exported, "--out", tmp_path / "repo", *args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err
    assert not (tmp_path / "repo").exists()


def test_a_smaller_max_batch_takes_the_warm_up_down_with_it(exported, tmp_path):
    """A warm-up above max_batch_size fails the load (and over the load API crashed Triton 2.51): the batching edit
    brings each warm-up within the new max batch."""
    from torchship.serve.bench.recommend import batching_edit
    from torchship.serve.config import RepoConfig
    from torchship.serve.repository import build_repository

    build_repository(exported, RepoConfig(out=str(tmp_path / "repo"), formats=("onnx",)))
    c = read_config(tmp_path / "repo" / "tiny_cnn_onnx" / "config.pbtxt")
    assert [w.batch_size for w in c.model_warmup] == [1, 8]
    batching_edit({"max_batch_size": 4, "dynamic_batching": True, "max_queue_delay_microseconds": 0})(c)
    assert c.max_batch_size == 4 and [(w.name, w.batch_size) for w in c.model_warmup] == [
        ("real_sample_batch_1", 1),
        ("real_sample_batch_4", 4),
    ]
    assert all(w.inputs["images"].input_data_file == "images" for w in c.model_warmup)


@pytest.mark.slow
def test_a_winner_the_search_left_loaded_is_loaded_again_as_written(int8_export, tmp_path, monkeypatch):
    """The search can end with the winning placement loaded under the plain name (the last point it measured).
    Its folder is written anew after that, so the winner is loaded again: else the entry in front of it, loaded
    next, makes Triton read the folder itself, and an AOTInductor model's config.pbtxt is not the embedded
    server's to load (its embedded.pbtxt is)."""
    from dataclasses import asdict
    from pathlib import Path

    import torchship.serve.bench.strategy as strategy
    from torchship.manifest import read_manifest
    from torchship.serve.bench.placement import placement_edit
    from torchship.serve.bench.recommend import batching_edit
    from torchship.serve.bench.search import Choice
    from torchship.serve.bench.served_as import copy_as
    from torchship.serve.config import RepoConfig
    from torchship.serve.model_config import served_config_path
    from torchship.serve.repository import build_repository

    manifest, model = read_manifest(int8_export), "tiny_cnn_aoti_int8"
    point = Point(model, "int8", 2, 1, [row(1, 300, 3.0, 5.0), row(16, 900, 17.0, 30.0)], source="search")
    choice = Choice(point, point, [point], {id(point): (900.0, point.rows[1])}, 0.10, [point])

    def search_ending_on_the_winner(server, export, repo, *a, **k):
        """What the search does where its last point wins: that point loaded under the plain name, as it serves."""
        winner = strategy.winner_of(choice, "max-throughput", manifest)
        edits = [batching_edit(winner["batching"])] if winner.get("batching") else []
        copy_as(Path(repo), model, "aoti_int8", "tiny_cnn", [*edits, placement_edit(2, 1)])
        server.load("tiny_cnn", override=read_config(served_config_path(Path(repo) / "tiny_cnn")))
        return choice, {"cores": 2, "grid": [{**asdict(point), "score": 900.0, "at": 16}]}

    monkeypatch.setattr(strategy, "search", search_ending_on_the_winner)
    repo = tmp_path / "repo"
    build_repository(int8_export, RepoConfig(out=str(repo), cores=1))
    with TritonServer(ServeConfig(repo=str(repo))) as server:
        winner, dest = strategy.serve_by_strategy(
            int8_export, repo, "max-throughput", manifest, FAST_INT8, cores=2, server=server, log=lambda *a: None
        )
        assert (winner["model"], winner["instances"], dest.name) == (model, 2, "tiny_cnn")
        server.load("tiny_cnn_image")  # the entry in front of the winner, as torchship run reloads it
        assert check_served(server.url, int8_export, models=["tiny_cnn", "tiny_cnn_image"])["pass"]
