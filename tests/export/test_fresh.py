"""The verifier's fresh processes: a host that imported torch once forks a child per artifact."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from torchship.export import fresh
from torchship.export.verify import _runner_failure, verify_export
from torchship.manifest import read_manifest

ROOT = Path(__file__).resolve().parents[2]


def children_of(pid: int) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(d.name))
    return found


def writes_to(pid: int, path: str) -> bool:
    """Whether process ``pid``'s stdout is ``path`` (a forked child's, once it set up its log): the import of
    torch may start short-lived children of its own."""
    try:
        return os.readlink(f"/proc/{pid}/fd/1") == path
    except OSError:
        return False


def test_the_host_runs_each_request_in_a_child_names_a_kill_and_exits_when_idle(tmp_path):
    """A child killed by a signal is answered with the signal, and the host goes on; a request that fails
    fails in its own child, with the reason in that child's log; an idle host exits by itself."""
    blocked = tmp_path / "blocked.json"
    os.mkfifo(blocked)  # the child blocks reading its spec until killed
    host = subprocess.Popen(
        [sys.executable, "-m", "torchship.export.runner", "--host", "3"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        host.stdin.write(json.dumps({"spec": str(blocked), "env": dict(os.environ)}) + "\n")
        host.stdin.flush()
        deadline = time.monotonic() + 120  # the host imports torch first
        while not (child := [c for c in children_of(host.pid) if writes_to(c, f"{blocked}.log")]):
            assert time.monotonic() < deadline and host.poll() is None
            time.sleep(0.05)
        os.kill(child[0], signal.SIGKILL)
        code = int(host.stdout.readline())
        assert code == -signal.SIGKILL and fresh.exit_text(code).startswith("was killed by SIGKILL")

        crashed = tmp_path / "crashed.json"  # a crash in native code: its Python frame is named
        os.mkfifo(crashed)
        host.stdin.write(json.dumps({"spec": str(crashed), "env": dict(os.environ)}) + "\n")
        host.stdin.flush()
        while not (child := [c for c in children_of(host.pid) if writes_to(c, f"{crashed}.log")]):
            assert time.monotonic() < deadline and host.poll() is None
            time.sleep(0.05)
        os.kill(child[0], signal.SIGSEGV)
        assert int(host.stdout.readline()) == -signal.SIGSEGV
        log = Path(f"{crashed}.log").read_text()
        site = fresh.crash_site(log)  # blocked opening its spec: the innermost frame is pathlib's open
        assert "export/runner.py" in log and re.fullmatch(r"in open \(\S*pathlib\S*\.py:\d+\)", site), log
        assert _runner_failure(-signal.SIGSEGV, log) == f"runner {fresh.exit_text(-signal.SIGSEGV)} {site}"

        missing = tmp_path / "missing.json"
        host.stdin.write(json.dumps({"spec": str(missing), "env": dict(os.environ)}) + "\n")
        host.stdin.flush()
        assert host.stdout.readline().strip() == "1"
        assert "missing.json" in Path(f"{missing}.log").read_text()
        assert host.wait(timeout=60) == 0  # 3 s without a request
    finally:
        if host.poll() is None:
            host.kill()


def test_a_host_that_ends_as_it_is_asked_is_replaced_and_the_artifact_still_verified(exported, tmp_path):
    """A pooled host may reach its idle time just as a request comes: it reads the request and ends without an
    answer. The request goes to a new host."""
    d = tmp_path / "export"
    shutil.copytree(exported, d)
    verify_export(d, only=["torchscript"], log=lambda *a: None)
    hosts = [h for pool in fresh._free.values() for h in pool]
    assert hosts
    for h in hosts:
        h.close()
        h.proc = subprocess.Popen(  # alive when taken from the pool, gone once it has read the request
            [sys.executable, "-c", "import sys; sys.stdin.readline()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    verify_export(d, only=["torchscript"], log=lambda *a: None)
    assert read_manifest(d)["verification"]["artifacts"]["torchscript"]["pass"]


def test_an_artifacts_memory_figure_is_its_own_process_not_the_verifiers(exported, tmp_path):
    """getrusage's peak of a process started by fork and exec keeps its parent's when that was larger: a
    verifier holding 1.5 GiB would have reported 1.5 GiB for a tiny ONNX model."""
    d = tmp_path / "export"
    shutil.copytree(exported, d)
    ballast = np.ones(3 << 26)  # 1.5 GiB, touched, in the verifier's process
    verify_export(d, only=["onnx", "torchscript"], log=lambda *a: None)
    del ballast
    peaks = {n: e["peak_rss_bytes"] for n, e in read_manifest(d)["verification"]["artifacts"].items()}
    assert 0 < peaks["onnx"] < 1 << 30 and 0 < peaks["torchscript"] < 1 << 30, peaks


def test_an_exported_programs_loader_is_imported_by_its_host_and_only_there(exported, tmp_path):
    """The modules torch.export.load imports beyond torch are imported once, by the host, before it forks a child
    per ExportedProgram; a TorchScript artifact's host does not hold them (its children's memory figure stays its
    own). A host imports what it is started with, in itself, not in each child."""
    from torchship.procfs import cmdline
    from torchship.runtime import LOADER_MODULES

    d = tmp_path / "export"
    shutil.copytree(exported, d)
    verify_export(d, only=["exported_program", "torchscript"], log=lambda *a: None)
    assert all(e["pass"] for e in read_manifest(d)["verification"]["artifacts"].values())
    argv = {key[-1]: cmdline(h.proc.pid) for key, pool in fresh._free.items() for h in pool}
    loader = LOADER_MODULES["exported_program"]
    assert argv[loader][-len(loader) :] == list(loader) and argv[()][-2:] == ["--host", str(fresh.IDLE_S)], argv

    (tmp_path / "marks_its_import.py").write_text(
        "import os\nopen(os.environ['MARK'], 'a').write(f'{os.getpid()}\\n')\n"
    )
    mark, spec = tmp_path / "mark", tmp_path / "missing.json"
    env = dict(os.environ, MARK=str(mark), PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    host = subprocess.Popen(
        [sys.executable, "-m", "torchship.export.runner", "--host", "3", "marks_its_import"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    try:
        for _ in range(2):  # two children: each fails, on a spec that is not there, after the fork
            host.stdin.write(json.dumps({"spec": str(spec), "env": env}) + "\n")
            host.stdin.flush()
            assert host.stdout.readline().strip() == "1"
        host.stdin.close()
        assert host.wait(timeout=60) == 0
    finally:
        if host.poll() is None:
            host.kill()
    assert mark.read_text().split() == [str(host.pid)]  # imported once, by the host


def test_an_exported_program_loads_and_runs_without_importing_what_its_host_did_not(exported):
    """Past the modules its host imported (LOADER_MODULES), loading and running an ExportedProgram imports none of
    torch's tracing machinery (torch.export, dynamo, functorch): each child would pay for it again."""
    from torchship.manifest import read_manifest
    from torchship.runtime import LOADER_MODULES

    art = next(a for a in read_manifest(exported)["artifacts"] if a["format"] == "exported_program")
    script = (
        "import importlib, json, sys, numpy as np, torch\n"
        f"for name in {LOADER_MODULES['exported_program']!r}: importlib.import_module(name)\n"
        "before = set(sys.modules)\n"
        f"program = torch.export.load({str(exported / art['file'])!r})\n"
        f"images = np.load({str(exported / 'reference.npz')!r})['input/random_b5/images']\n"
        "program.module()(torch.from_numpy(images))\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    new = json.loads(out.stdout.strip().splitlines()[-1])
    assert not [m for m in new if m.startswith(("torch.export", "torch._dynamo", "torch._functorch"))], new


NMS_LOAD = """
import json, sys
import numpy as np
from torchship import runtime
if sys.argv[1] == "no-library":  # as where torchvision's extension library is not found
    runtime.torchvision_library = lambda: False
with np.load(sys.argv[2]) as feed:
    keep = runtime.load(sys.argv[3], sys.argv[4], ["boxes", "scores"], ["keep"]).run(dict(feed))["keep"]
print(json.dumps([keep.tolist(), "torchvision" in sys.modules, "torch._dynamo" in sys.modules]))
"""


class _NMS(torch.nn.Module):
    """A model's own postprocessing: torchvision's NMS operator (what torchvision.ops.nms and batched_nms call)."""

    def forward(self, boxes, scores):
        return torch.ops.torchvision.nms(boxes, scores, 0.4)


def nms_case(tmp_path):
    """Boxes and scores saved as feed.npz, and the boxes eager keeps."""
    import torchvision

    g = torch.Generator().manual_seed(0)
    corners = torch.rand(40, 2, generator=g) * 60
    boxes, scores = torch.cat([corners, corners + 8 + 20 * torch.rand(40, 2, generator=g)], 1), torch.rand(40)
    np.savez(tmp_path / "feed.npz", boxes=boxes.numpy(), scores=scores.numpy())
    want = torchvision.ops.nms(boxes, scores, 0.4).tolist()
    assert 5 < len(want) < 40  # boxes suppressed and boxes kept
    return want, (boxes, scores)


def scripted_nms(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script's deprecation
        torch.jit.script(_NMS()).save(tmp_path / "nms.pt")
    return tmp_path / "nms.pt"


def loads_as_eager(tmp_path, fmt, file, want, hows=("library", "no-library")):
    """``file`` loaded and run in a fresh process for each of ``hows``, with torchvision's library found and
    without: it keeps eager's boxes, and torchvision is imported only without the library (and with it
    torch._dynamo, which loading a TorchScript file does not import otherwise)."""
    for how in hows:
        args = [sys.executable, "-c", NMS_LOAD, how, tmp_path / "feed.npz", fmt, file]
        done = subprocess.run(args, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        keep, imported, dynamo = json.loads(done.stdout.splitlines()[-1])
        assert keep == want, (fmt, how)
        assert imported == (how == "no-library"), (fmt, how)
        if fmt == "torchscript":
            assert dynamo == (how == "no-library"), (fmt, how)


def test_a_torchscript_file_that_calls_torchvisions_operators_loads_them_from_its_library_alone(tmp_path):
    """A TorchScript file that calls torchvision::nms loads in a fresh process (the verifier's, a served
    stand-in's) with torchvision's operators registered from its extension library, the package itself (and the
    torch._dynamo it imports) not imported. (Where no library is found, importing torchvision registers them: the
    next test, in the slow tier.)"""
    want, _ = nms_case(tmp_path)
    loads_as_eager(tmp_path, "torchscript", scripted_nms(tmp_path), want, hows=("library",))


@pytest.mark.slow  # an AOTInductor compile: about 30 s of CPU
def test_an_exported_program_and_an_aoti_package_that_call_torchvisions_operators_load_them(tmp_path):
    """The same for an ExportedProgram (whose loader fails without naming the operator: its graph is read for
    them first) and an AOTInductor package (whose loader fails naming it); and for each of the three formats,
    where no library is found, importing torchvision registers them."""
    from torchship.export.exporters import compile_package

    want, example = nms_case(tmp_path)
    ep = torch.export.export(_NMS(), example)
    torch.export.save(ep, tmp_path / "nms.pt2")
    with torch.no_grad():
        compile_package(ep, tmp_path / "nms_aoti.pt2")
    loads_as_eager(tmp_path, "torchscript", scripted_nms(tmp_path), want, hows=("no-library",))
    for fmt, file in (("exported_program", "nms.pt2"), ("aoti", "nms_aoti.pt2")):  # each in processes of its own
        loads_as_eager(tmp_path, fmt, tmp_path / file, want)
