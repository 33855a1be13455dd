"""How a served model uses the cores: the repository's default configs share out the cores torchship is given
(--cores, else the process's CPU affinity), what oversubscribes them is refused, and each instance Triton starts
runs with the threads its config gives, as its runtime reports them from inside the instance."""

import os
import re
import subprocess
import sys

import pytest
from google.protobuf import json_format

from torchship.errors import ConfigError
from torchship.serve.bench.placement import candidates, grid_of, placement_edit, placement_of
from torchship.serve.config import RepoConfig, ServeConfig, default_placement
from torchship.serve.embedded import TritonServer
from torchship.serve.embedded.process import stub_processes
from torchship.serve.model_config import CONFIGS, edit_configs, read_config, repository_models
from torchship.serve.repository import build_repository

ENTRY = "tiny_cnn_image"


def placements(repo):
    """{(model, config file): (instances, threads)} over every config of the repository's tensor models (the
    image entry is an ensemble, and its preprocessing runs one instance per core: pre_instances)."""
    found = {
        (m, name): placement_of(read_config(repo / m / name))
        for m in repository_models(repo)
        for name in CONFIGS
        if (repo / m / name).exists() and not m.startswith(f"{ENTRY}")
    }
    for (m, name), placement in found.items():  # the JSON form a server reports reads the same
        as_json = json_format.MessageToDict(read_config(repo / m / name), preserving_proto_field_name=True)
        assert placement_of(as_json) == placement, (m, name)
    return found


def pre_instances(repo) -> int:
    return read_config(repo / f"{ENTRY}_pre" / "config.pbtxt").instance_group[0].count


@pytest.mark.parametrize(
    "given, expected",
    [
        ({"cores": 2}, (1, 1)),  # one core left to the server and the client, one thread an instance
        ({"cores": 4}, (3, 1)),
        ({"cores": 10}, (4, 2)),  # up to four instances, which share out more cores
        ({"cores": 4, "instance_count": 1}, (1, 4)),
        ({"cores": 4, "instance_count": 2}, (2, 2)),
        ({"cores": 4, "threads": 2}, (2, 2)),
        ({"cores": 3, "instance_count": 2}, (2, 1)),
    ],
)
def test_the_default_configs_share_out_the_cores_given(exported, tmp_path, given, expected):
    build_repository(exported, RepoConfig(out=str(tmp_path / "repo"), **given))
    found = placements(tmp_path / "repo")
    assert len(found) >= 4 and set(found.values()) == {expected}, found  # every format, both configs where two
    assert pre_instances(tmp_path / "repo") == expected[0] * expected[1]  # the image entry decodes on each core
    readme = (tmp_path / "repo" / "README.md").read_text()
    assert f"{expected[0]} instance(s) of {expected[1]} intra-op thread(s) each" in readme


def test_a_compute_bound_model_gets_every_core_as_one_instance(exported, tmp_path):
    """A model whose own compute dwarfs a request's round trip (resnet50 at 224, as torchvision builds it: 8.2
    GFLOP a sample) gets every core as one instance by default; a small one keeps a core for the server and
    client; what is given is kept either way. The export's count of the model's cost is what decides."""
    import shutil

    import torch
    import torchvision

    from torchship.eager import flops_per_sample
    from torchship.manifest import read_manifest, write_manifest
    from torchship.serve.config import COMPUTE_BOUND_FLOPS

    flops = flops_per_sample(torchvision.models.resnet50().eval(), (torch.rand(1, 3, 224, 224),))
    assert 8.1e9 < flops < 8.3e9 and flops >= COMPUTE_BOUND_FLOPS
    assert default_placement(2, flops) == (1, 2) and default_placement(8, flops) == (1, 8)
    small = read_manifest(exported)["flops_per_sample"]
    assert default_placement(2, small) == default_placement(2) == (1, 1)
    costly = tmp_path / "export"
    shutil.copytree(exported, costly)
    m = read_manifest(costly)
    m["flops_per_sample"] = flops
    write_manifest(costly, m)
    build_repository(costly, RepoConfig(out=str(tmp_path / "repo"), cores=2))
    assert set(placements(tmp_path / "repo").values()) == {(1, 2)}
    readme = (tmp_path / "repo" / "README.md").read_text()
    assert "The model costs 8.2 GFLOP a sample, at or above 1: compute-bound" in readme
    build_repository(costly, RepoConfig(out=str(tmp_path / "given"), cores=2, instance_count=2))
    assert set(placements(tmp_path / "given").values()) == {(2, 1)}


def test_more_threads_than_cores_are_refused_before_anything_is_written(exported, tmp_path):
    with pytest.raises(
        ConfigError, match=r"2 instance\(s\) x 2 thread\(s\) = 4 threads on 2 core\(s\) would take turns"
    ):
        build_repository(exported, RepoConfig(out=str(tmp_path / "repo"), cores=2, instance_count=2, threads=2))
    assert not (tmp_path / "repo").exists()


def test_without_cores_the_configs_use_the_cpus_this_process_may_run_on(exported, tmp_path):
    """The CPU affinity (a container's cpuset, taskset), not the host's count: one CPU allowed, one thread."""
    code = (
        "import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from torchship.serve.config import RepoConfig; from torchship.serve.repository import build_repository; "
        f"build_repository({str(exported)!r}, RepoConfig(out={str(tmp_path / 'one')!r}))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.getcwd())
    assert set(placements(tmp_path / "one").values()) == {(1, 1)}
    build_repository(exported, RepoConfig(out=str(tmp_path / "all")))
    assert set(placements(tmp_path / "all").values()) == {default_placement(len(os.sched_getaffinity(0)))}


def test_the_grid_uses_every_core_without_oversubscribing():
    assert candidates(1) == [(1, 1)]
    assert candidates(2) == [(1, 2), (2, 1)]
    assert candidates(6) == [(1, 6), (2, 3), (3, 2), (6, 1)]
    assert grid_of(2) == [(1, 1), (1, 2), (2, 1)] and grid_of(1) == [(1, 1)]  # the default first
    assert RepoConfig(instance_count=2).search_cores() is None and RepoConfig(threads=1).search_cores() is None
    assert RepoConfig(cores=10_000).search_cores() is None  # built for a larger machine: not measured here
    assert RepoConfig().search_cores() == len(os.sched_getaffinity(0))


RUNS_WITH = re.compile(
    r"instance (\S+) \(pid (\d+)\) runs with runtime=(\w+), intra_op=(\d+), inter_op=(\d+)"
    r"(?:, spinning=(\w+))?"
)


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "fmt, instances, threads",
    [
        ("onnx", 2, 1),
        pytest.param("onnx", 1, 2, marks=SLOW),
        pytest.param("torchscript", 2, 1, marks=SLOW),
        ("torchscript", 1, 2),
        pytest.param("aoti", 2, 1, marks=SLOW),
    ],
)
def test_each_instance_runs_with_the_threads_its_config_gives(exported, tmp_path, fmt, instances, threads):
    """Read back from inside each instance, after it ran (Triton's warm-up runs every instance once at load):
    the runtime's own intra- and inter-op thread counts, one report per instance from a distinct backend
    process of the server, and ONNX Runtime's idle threads sleeping where instances share the cores."""
    repo = tmp_path / "repo"
    build_repository(exported, RepoConfig(out=str(repo), formats=(fmt,), cores=2, image_entry=False))
    (model,) = repository_models(repo)
    edit_configs(repo / model, placement_edit(instances, threads))
    log = tmp_path / "triton.log"
    with TritonServer(ServeConfig(repo=str(repo), log=str(log))) as s:
        stubs = {p for (m, _), pids in stub_processes(s.proc.pid).items() if m == model for p in pids}
    said = [m.groups() for m in RUNS_WITH.finditer(log.read_text())]
    assert len(said) == instances, log.read_text()[-3000:]
    assert {name for name, *_ in said} == {f"{model}_0_{i}" for i in range(instances)}
    assert {int(pid) for _, pid, *_ in said} == stubs and len(stubs) == instances
    for _, _, runtime, intra, inter, spinning in said:
        assert (runtime, int(intra), int(inter)) == ("onnxruntime" if fmt == "onnx" else "torch", threads, 1)
        if fmt == "onnx":
            assert spinning == ("true" if instances == 1 else "false")
