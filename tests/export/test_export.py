"""Export stage: every format, dynamic batch, names, preprocessing contract, and a verifier that can fail."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Tuple

import numpy as np
import onnx
import pytest
import torch

from tests.conftest import run_cli
from tests.helpers import copy_export, perturb_onnx, rehash
from torchship import runtime
from torchship.errors import ArtifactError, ParityError
from torchship.io import sha256_file
from torchship.manifest import read_manifest, write_manifest
from torchship.serve.config import COMPUTE_BOUND_FLOPS


def test_every_format_exported_and_verified(exported):
    m = read_manifest(exported)
    assert {a["format"] for a in m["artifacts"]} == set(runtime.FP32_FORMATS)
    assert m["verification"]["pass"], m["verification"]["failures"]
    assert (exported / "parity.md").read_text().count("| pass |") >= 5 * 4
    assert m["inputs"] == [{"name": "images", "dtype": "float32", "shape": ["batch", 3, 32, 32]}]
    assert 0 < m["flops_per_sample"] < COMPUTE_BOUND_FLOPS  # the model's cost, for the repository's placement
    for a in m["artifacts"]:
        for rel, sha in a["files"].items():
            assert sha256_file(exported / rel) == sha
        assert a["torch_version"] and a["exported_at"] and a["export_seconds"] >= 0
    onnx_entry = next(a for a in m["artifacts"] if a["format"] == "onnx")
    assert onnx_entry["opset"] >= 18 and not onnx_entry["external_data"]
    assert not list((exported / "onnx").glob("*.data")), "ONNX must be one self-contained file"
    # a small model on a CPU: each bucket's library holds its own prepacked weights, none in the archive to share,
    # and compiling the prepacked aoti package first in the same export left the buckets passing
    buckets = next(a for a in m["artifacts"] if a["format"] == "aoti_buckets")
    assert buckets["weights"] == "prepacked" and buckets["shared_constants"] == 0
    with zipfile.ZipFile(exported / buckets["file"]) as z:
        names = z.namelist()
    assert not [n for n in names if "/weights/" in n] and sum(n.endswith(".so") for n in names) == len(
        buckets["buckets"]
    )


def load(exported, fmt):
    m = read_manifest(exported)
    a = next(a for a in m["artifacts"] if a["format"] == fmt)
    return runtime.load_artifact(str(exported), a, ["images"], ["logits"]), m


@pytest.mark.parametrize("fmt", runtime.FP32_FORMATS)
def test_dynamic_batch_is_really_dynamic(exported, fmt):
    """Exported with an example batch of 2; batch 5 (and 7) must run and match eager."""
    from torchship.eager import eager_from_manifest

    r, m = load(exported, fmt)
    model = eager_from_manifest(m)
    for n in (5, 7):
        x = np.random.default_rng(n).random((n, 3, 32, 32), dtype=np.float32)
        got = r.run({"images": x})["logits"]
        with torch.no_grad():
            want = model(torch.from_numpy(x)).numpy()
        assert got.shape == (n, 10)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_names_agree_across_manifest_onnx_graph_and_loaders(exported):
    m = read_manifest(exported)
    ins, outs = [i["name"] for i in m["inputs"]], [o["name"] for o in m["outputs"]]
    g = onnx.load(str(exported / "onnx/model.onnx")).graph
    assert [i.name for i in g.input] == ins and [o.name for o in g.output] == outs
    assert g.input[0].type.tensor_type.shape.dim[0].dim_param, "ONNX batch dimension must be symbolic"
    for fmt in ("onnx", "torchscript", "exported_program"):
        r, _ = load(exported, fmt)
        assert r.input_names == ins, fmt
        if r.output_names is not None:
            assert r.output_names == outs


def test_normalization_lives_in_the_graph(exported):
    """The contract: raw [0, 1] images in; the artifact normalizes exactly as training did."""
    from torchship import checkpoint as ck
    from torchship.models import model_from_meta

    m = read_manifest(exported)
    assert m["preprocessing"]["normalization"] == "in_graph"
    ckdir = ck.resolve_checkpoint(m["source"]["path"])
    plain = model_from_meta(ck.load_meta(ckdir)).eval()
    plain.load_state_dict(ck.load_weights(ckdir))
    mean = torch.tensor(m["preprocessing"]["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(m["preprocessing"]["std"]).view(1, -1, 1, 1)
    x = torch.rand(4, 3, 32, 32)
    r, _ = load(exported, "onnx")
    with torch.no_grad():
        want = plain((x - mean) / std).numpy()
        unnormalized = plain(x).numpy()
    got = r.run({"images": x.numpy()})["logits"]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert np.abs(got - unnormalized).max() > 1e-2


def test_verifier_rejects_a_perturbed_onnx_initializer(exported, tmp_path):
    from torchship.export.verify import verify_export

    d = copy_export(exported, tmp_path)
    perturb_onnx(d, 0.05)
    with pytest.raises(ParityError, match="onnx"):
        verify_export(d, only=["onnx"])
    assert not read_manifest(d)["verification"]["pass"]
    assert "FAIL" in (d / "parity.md").read_text()


def test_verifier_rejects_a_perturbed_torchscript_weight(exported, tmp_path):
    from torchship.export.verify import verify_export

    d = copy_export(exported, tmp_path)
    m = torch.jit.load(str(d / "torchscript/model.pt"))
    # a frozen module keeps its weights as graph constants; perturb the first float constant
    g = m.graph
    for node in g.nodes():
        if node.kind() == "prim::Constant" and node.output().type().kind() == "TensorType":
            t = node.t("value")
            if t.is_floating_point() and t.numel() > 8:
                node.t_("value", t + 0.05)
                break
    m.save(str(d / "torchscript/model.pt"))
    rehash(d, "torchscript/model.pt")
    with pytest.raises(ParityError, match="torchscript"):
        verify_export(d, only=["torchscript"])


class _PlusOne(torch.nn.Module):
    def forward(self, x):
        return x + 1


def _times_ten(module, inputs: Tuple[torch.Tensor], output: torch.Tensor):
    return output * 10


def test_sha256_mismatch_and_missing_artifact_are_reported(exported, tmp_path):
    from torchship.export.verify import verify_export

    d = copy_export(exported, tmp_path)
    with open(d / "exported_program/model.pt2", "r+b") as f:
        f.truncate(1000)
    (d / "aoti" / "model.pt2").unlink()
    with pytest.raises(ArtifactError) as e:
        verify_export(d)
    assert "exported_program/model.pt2 was altered or truncated" in str(e.value)
    assert "aoti/model.pt2 is missing" in str(e.value)


# In a fresh process: load an artifact with 2 threads, run it on a thread other than the loader's, and say
# what OpenMP's setting is in that thread and how many threads the run started (a parallel region of 2
# starts a worker).
RUN_ON_ANOTHER_THREAD = """
import ctypes, json, os, sys, threading
import numpy as np
from torchship import runtime
from torchship.manifest import read_manifest
export_dir, fmt = sys.argv[1], sys.argv[2]
art = next(a for a in read_manifest(export_dir)["artifacts"] if a["format"] == fmt)
r = runtime.load_artifact(export_dir, art, ["images"], ["logits"], threads=2)
omp = ctypes.CDLL(next(line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line))
x = np.random.default_rng(0).random((1, 3, 32, 32), dtype=np.float32)
seen = []
def run():
    before = len(os.listdir("/proc/self/task"))
    r.run({"images": x})
    seen.extend([omp.omp_get_max_threads(), len(os.listdir("/proc/self/task")) - before])
t = threading.Thread(target=run)
t.start()
t.join()
print(json.dumps(seen))
"""


# In a fresh process: an AOTInductor package (sys.argv[2]: aoti, or aoti_buckets' archive) loaded by torchship's
# runtime, whether that imported inductor or dynamo, and the same package where the C++ loader refuses
# torchship's call, as one of another signature would (the public loader then, or load_pt2).
LOAD_AOTI = """
import json, sys
import numpy as np
import torch
from torchship import runtime
x = np.random.default_rng(0).random((3, 3, 32, 32), dtype=np.float32)
direct = runtime.load(sys.argv[2], sys.argv[1], ["images"], ["logits"]).run({"images": x})["logits"]
imported = [m for m in ("torch._inductor", "torch._dynamo") if m in sys.modules]
real = torch._C._aoti.AOTIModelPackageLoader
def other(*args, calls=[]):  # refuses torchship's call, as another signature would; the public loader's gets through
    calls.append(args)
    if len(calls) == 1:
        raise TypeError("__init__(): incompatible constructor arguments")
    return real(*args)
other.load_metadata_from_package = real.load_metadata_from_package
torch._C._aoti.AOTIModelPackageLoader = other
public = runtime.load(sys.argv[2], sys.argv[1], ["images"], ["logits"]).run({"images": x})["logits"]
print(json.dumps([imported, "torch._inductor" in sys.modules, float(np.abs(direct - public).max())]))
"""


def test_cpu_compiles_fork_from_a_server_that_imported_them_kept_for_the_next_export_while_idle(
    trained, tmp_path, monkeypatch
):
    """A CPU export's compile workers are forked from a fork server that imported what a compile imports
    (export/preload.py), each worker a fresh process of its own. The server outlives the export: the next export
    from the same state forks from it, one under another import variable gets a new one, and it ends IDLE_S after
    the last export. A CUDA export's workers are spawned."""
    import dataclasses

    from torchship.config import build
    from torchship.export import compile as compile_
    from torchship.export.compile import Compiler, start_method
    from torchship.export.config import ExportConfig
    from torchship.procfs import cmdline, processes

    assert start_method("cuda:0") == "spawn"
    cfg = build(ExportConfig, {"checkpoint": str(trained), "out": str(tmp_path / "out")})
    cfg = dataclasses.replace(cfg, checkpoint=str(tmp_path / "gone"))  # the job fails in the worker, at once

    def export_once() -> int:
        """One export's compiles (a job that fails at once): the fork server's pid, checked to be its workers'."""
        with Compiler(cfg, "cpu", 2, tmp_path / "work") as compiler:
            assert "error" in compiler.submit("aoti").result(timeout=300)
            for _ in range(100):  # the worker that ran the job is being replaced: until the pool holds two again
                parents = {p.pid: p.ppid for p in processes()}
                mine = [pid for pid, ppid in parents.items() if ppid == os.getpid()]
                servers = [pid for pid in mine if "forkserver" in " ".join(cmdline(pid))]
                workers = [w.pid for w in compiler.pool._pool if w.pid in parents]
                if len(workers) == 2:
                    break
                time.sleep(0.1)
            assert len(servers) == 1 and "torchship.export.preload" in " ".join(cmdline(servers[0])), servers
            assert len(workers) == 2 and all(parents[w] == servers[0] for w in workers), (workers, servers)
        return servers[0]

    def alive(pid: int) -> bool:
        return pid in {p.pid for p in processes()}

    first = export_once()  # the one an earlier test in this worker left, where it still fits: kept
    assert alive(first) and export_once() == first  # kept, and the next export forks from it
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # read on import: the server started under 1 no longer fits
    second = export_once()
    assert second != first and not alive(first)
    monkeypatch.setattr(compile_, "IDLE_S", 0.5)
    third = export_once()
    assert third == second
    for _ in range(100):
        if not alive(third):
            break
        time.sleep(0.1)
    assert not alive(third)  # ended and reaped, idle


def test_a_compile_job_runs_under_its_exports_environment(monkeypatch):
    """A job's worker is forked from a fork server that may have started under an earlier export's variables: the
    job sets its export's before it builds anything."""
    from torchship.export import compile as compile_

    server_env = {"FROM_THE_FORK_SERVER": "1"}
    monkeypatch.setattr(compile_.os, "environ", server_env)
    result = compile_._job(None, "cpu", "aoti", 0, "unused", {"TORCHSHIP_EXPORT": "the export's"})
    assert "error" in result  # no configuration: it fails, after setting the environment
    assert server_env == {"TORCHSHIP_EXPORT": "the export's"}


def test_compile_workers_that_cannot_start_fail_every_job_and_none_waits_forever(tmp_path):
    """A pool that cannot start fails each job with the reason, the ones submitted before it failed and after."""
    from torchship.export.compile import Compiler

    with Compiler(None, "cpu", 1, tmp_path / "work") as compiler:
        compiler.method = "no-such-start-method"
        first = compiler.submit("aoti")
        compiler._starter.join()
        later = compiler.submit("aoti_int8")
        for job in (first, later):
            assert "the compile workers could not start" in job.result(timeout=10)["error"]


@pytest.mark.parametrize("fmt", ["aoti", "aoti_buckets"])
def test_an_aoti_package_loads_without_inductor_and_with_the_public_loader_as_fallback(exported, fmt):
    """Every process that serves or verifies an AOTInductor package loads it: through torch's C++ loader it
    needs no import of inductor and dynamo (seconds of CPU a served instance); a torch whose loader takes
    other arguments gets the public loader (load_pt2 for a bucket archive), with the same outputs."""
    art = next(a for a in read_manifest(exported)["artifacts"] if a["format"] == fmt)
    out = subprocess.run(
        [sys.executable, "-c", LOAD_AOTI, str(exported / art["file"]), fmt],
        capture_output=True,
        text=True,
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    direct_imported, fallback_imported, diff = json.loads(out.stdout.strip().splitlines()[-1])
    assert direct_imported == [], f"loading an AOTInductor package imported {direct_imported}"
    assert fallback_imported and diff == 0.0, (fallback_imported, diff)


def test_a_runner_that_crashes_is_named_as_a_crash():
    """A runtime that crashes in native code kills the fresh-process runner with a signal: the failure
    says which, not a bare negative exit code."""
    from torchship.export.fresh import exit_text

    assert exit_text(3) == "exited 3"
    assert exit_text(-signal.SIGSEGV).startswith("was killed by SIGSEGV")


def test_default_buckets_are_the_powers_of_two_up_to_the_max_batch():
    """No batch computes more than twice its rows: the next bucket up from n rows is below 2n."""
    from torchship.config import build
    from torchship.export.config import ExportConfig
    from torchship.runtime import bucket_for

    assert build(ExportConfig, {"checkpoint": "c"}).buckets == (1, 2, 4, 8, 16, 32)
    for max_batch in (6, 8, 12, 32, 100):
        buckets = build(ExportConfig, {"checkpoint": "c", "max_batch": max_batch}).buckets
        assert buckets[-1] == max_batch and all(bucket_for(n, buckets) < 2 * n for n in range(2, max_batch + 1)), (
            buckets
        )
    assert build(ExportConfig, {"checkpoint": "c", "buckets": [8, 1, 32]}).buckets == (1, 8, 32)


@pytest.mark.parametrize("fmt", [pytest.param("aoti_buckets", marks=pytest.mark.slow), "torchscript"])
def test_a_torch_artifact_runs_with_its_thread_count_on_any_thread(exported, fmt):
    """Triton runs a model on its instance thread, not on the thread that loaded it. torch.set_num_threads
    sets OpenMP's thread count for the calling thread only, and AOTInductor's code reads the running
    thread's own (here OMP_NUM_THREADS=1), so a served AOTInductor model ran on one thread whatever the
    config asked. TorchScript's ATen ops re-apply the count themselves; it is checked alongside."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", RUN_ON_ANOTHER_THREAD, str(exported), fmt],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        cwd=str(Path(__file__).resolve().parents[2]),
    ).stdout
    omp_threads, started = json.loads(out.strip().splitlines()[-1])
    assert omp_threads == 2, f"{fmt} ran with OpenMP set to {omp_threads} thread(s) on a thread other than the loader's"
    assert started >= 1  # the run's parallel region started its second thread


def test_padded_rows_never_leak():
    """Bucket padding returns only the real rows; a planted leak (the padded rows returned too) is refused
    by the check verification runs on every output."""
    from torchship.parity import check_output

    fns = {1: lambda xs: [xs[0][:, :2] * 2 + xs[1]], 4: lambda xs: [xs[0][:, :2] * 2 + xs[1]]}
    x = np.arange(9, dtype=np.float32).reshape(3, 3)
    ones = np.ones((3, 1), np.float32)
    want = x[:, :2] * 2 + 1
    out = runtime.padded_call(fns, [x, ones])[0]  # two inputs, both padded on the batch dim only
    assert np.array_equal(out, want)
    big = runtime.padded_call(fns, [np.ones((9, 3), np.float32), np.ones((9, 1), np.float32)])[0]  # chunked
    assert big.shape == (9, 2)

    def leaky(fns, xs):
        b = runtime.bucket_for(xs[0].shape[0], fns)
        return fns[b]([np.concatenate([x, np.zeros((b - x.shape[0], *x.shape[1:]), x.dtype)]) for x in xs])

    tol = {"atol": 1e-5, "rtol": 0.0}
    assert check_output(out, want, tol, "logits", 3)[1] is None
    row, failure = check_output(leaky(fns, [x, ones])[0], want, tol, "logits", 3)
    assert not row["pass"] and failure == "logits has shape [4, 2], eager [3, 2]"


def test_cli_exit_codes(exported, tmp_path, capsys):
    assert run_cli("verify", exported, "--only", "onnx") == 0
    before = (exported / "manifest.json").read_text()
    capsys.readouterr()
    assert run_cli("verify", exported, "--only", "onxx", "onnx") == 2  # a typo must not verify nothing and pass
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--only onxx:" in err[0] and "no such artifact" in err[0], err
    assert (exported / "manifest.json").read_text() == before
    d = copy_export(exported, tmp_path)
    m = read_manifest(d)
    ref = np.load(d / "reference.npz")
    data = dict(ref)
    data["expected/random_b1/logits"] = data["expected/random_b1/logits"] + 1.0  # eager reference disagrees
    with open(d / "reference.npz", "wb") as f:
        np.savez(f, **data)
    m["reference"]["sha256"] = sha256_file(d / "reference.npz")
    write_manifest(d, m)
    capsys.readouterr()
    assert run_cli("verify", d, "--only", "onnx") == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "verification of" in err[0] and "random_b1" in err[0]


def test_checkpoint_without_metadata(trained, tmp_path, capsys):
    bad = tmp_path / "ckpt"
    shutil.copytree(trained, bad)
    (bad / "meta.json").unlink()
    assert run_cli("export", bad, "--out", tmp_path / "e", "--formats", "onnx") == 2
    assert "has no meta.json" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize(
    "text, says",
    [
        ('{"format": ', "is corrupt (Expecting value"),
        ("[1, 2]", "is corrupt (a JSON list, not an object)"),
        ('{"format": "torchship.export/0"}', "unknown format 'torchship.export/0'"),
    ],
)
def test_an_unreadable_manifest_is_named_in_one_line(tmp_path, capsys, text, says):
    (tmp_path / "manifest.json").write_text(text)
    assert run_cli("verify", tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path / 'manifest.json'}" in err[0] and says in err[0], err


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda m: m["artifacts"][0].pop("file"), "artifacts[0].file is missing"),
        (lambda m: m.update(max_batch="32"), "max_batch is not an integer"),
        (lambda m: m["inputs"].append(3), "inputs[1] is not an object"),
    ],
    ids=["no-file", "max-batch-string", "input-not-object"],
)
def test_a_manifest_without_a_field_the_stages_read_is_refused(exported, tmp_path, capsys, edit, says):
    d = tmp_path / "e"
    shutil.copytree(exported, d)
    m = read_manifest(d)
    edit(m)
    write_manifest(d, m)
    for argv in (("verify", d), ("repo", d, "--out", tmp_path / "repo")):
        assert run_cli(*argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0] and "export again" in err[0], err
    assert not (tmp_path / "repo").exists()


def test_corrupt_checkpoint_metadata(trained, tmp_path, capsys):
    bad = tmp_path / "ckpt"
    shutil.copytree(trained, bad)
    (bad / "meta.json").write_text("[]")  # valid JSON, but not the object a checkpoint records
    assert run_cli("export", bad, "--out", tmp_path / "e", "--formats", "onnx") == 2
    assert "meta.json is corrupt (a JSON list, not an object)" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_existing_export_dir_is_refused(exported, capsys):
    before = (exported / "manifest.json").read_text()
    assert run_cli("export", read_manifest(exported)["source"]["path"], "--out", exported) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (exported / "manifest.json").read_text() == before


def test_an_out_path_that_is_a_file_is_refused_and_kept(exported, tmp_path, capsys):
    """--overwrite replaces an export or repository directory, never a file of the user's."""
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    ckpt = read_manifest(exported)["source"]["path"]
    for argv in (("export", ckpt, "--out", f, "--overwrite"), ("repo", exported, "--out", f, "--overwrite")):
        assert run_cli(*argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{f} is a file, and --out takes a directory" in err[0], err
    assert f.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.slow
def test_unexportable_format_is_reported_and_others_kept(tmp_path, capsys):
    from torchship.config import build
    from torchship.train.config import TrainConfig
    from torchship.train.loop import train

    res = train(
        build(
            TrainConfig,
            {
                "arch": "tests.export.branchy:branchy",
                "data": "synthetic",
                "synthetic_samples": 32,
                "epochs": 1,
                "batch_size": 8,
                "out": str(tmp_path / "t"),
                "progress": False,
            },
        )
    )
    out = tmp_path / "e"
    argv = ("export", res.best, "--formats", "torchscript", "exported_program", "--max-batch", "4", "--odd-batch", "3")
    assert run_cli(*argv, "--out", out, "--optional", "exported_program") == 0
    m = read_manifest(out)
    assert [a["format"] for a in m["artifacts"]] == ["torchscript"]
    assert m["export_failures"][0]["format"] == "exported_program" and m["verification"]["pass"]
    assert "could not export: exported_program" in capsys.readouterr().out
    # not optional: the same export exits 3, names the format, and still writes what did export
    assert run_cli(*argv, "--out", tmp_path / "required") == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exported_program: cannot be exported" in err[0] and "--optional" in err[0], err
    m = read_manifest(tmp_path / "required")
    assert [a["format"] for a in m["artifacts"]] == ["torchscript"] and not m["verification"]["pass"]
    assert run_cli("verify", tmp_path / "required") == 3  # verify applies the same rule to the same folder
    assert run_cli("verify", tmp_path / "required", "--optional", "exported_program") == 0
