"""resnet50 at 224 on a CUDA GPU, in the phases of the GPU plan, each the commands a user runs:

    A  served on the GPU: the embedded Triton with KIND_GPU instances serving TorchScript (fp32) and AOTInductor
       (bf16), infer --check over gRPC, then a concurrency sweep beside the in-process figures
    B  verification on CUDA that can fail: fp32 TorchScript and AOTInductor verified strictly (TF32 off) in fresh
       processes, and a TorchScript weight scaled by 1 + 1e-3 refused
    C  training per precision (fp32, fp16, bf16 through --amp auto under torchrun), then bf16 channels-last
    D  exports in fp32 and bf16 verified on the device, in-process speed, and bf16 with the batch resident on the
       device against the bf16 matmul peak

    python -m tests.gpu.run --out runs/gpu                            # about 9 minutes on one H100/H200
    python -m tests.gpu.run --out runs/gpu --quick --device cpu       # the same steps, small, on any machine

Phases run in order within --budget seconds; one that no longer fits is recorded as skipped, not started. By
default a run takes the phases that no record in --history (docs/benchmarks/gpu) has done yet. Prints a table at
the end and writes OUT/gpu.json (after every step), OUT/gpu.log (each command's output) and the bench reports.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
TS = [sys.executable, "-m", "torchship.pipeline.cli"]
FP32_FORMATS = ("torchscript", "exported_program", "aoti", "aoti_buckets", "onnx")
BF16_FORMATS = ("torchscript", "exported_program", "aoti")
TIMED = ("--iters", "20", "--blocks", "2", "--warmup", "3")  # the in-process timing every bench here asks for


class Run:
    """The run's settings, its deadline, its log and its results (written after every phase)."""

    def __init__(self, args: argparse.Namespace):
        self.a, self.out, self.work = args, Path(args.out), Path(args.work)
        self.out.mkdir(parents=True, exist_ok=True)
        if not args.skip:  # a run that leaves phases out reuses what an earlier one made
            shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.log = self.out / "gpu.log"
        self.log.write_text("")
        self.deadline = time.monotonic() + args.budget
        self.results: dict[str, Any] = {"argv": sys.argv[1:], "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        q = args.quick
        self.arch = "resnet18" if q else "resnet50"
        self.size = 64 if q else 224
        self.max_batch = 8 if q else 256
        self.buckets = ["1", "8"] if q else ["1", "16", "256"]
        self.batches = ["1", "8"] if q else ["1", "8", "32", "128", "256"]

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        tmp = self.out / "gpu.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        tmp.replace(self.out / "gpu.json")

    def say(self, text: str) -> None:
        print(text, flush=True)
        with open(self.log, "a") as f:
            f.write(f"# {text}\n")

    def start(self, argv: list[str]) -> tuple[subprocess.Popen, Path]:
        part = self.work / f"cmd{len(list(self.work.glob('cmd*.log')))}.log"
        f = open(part, "w")
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # carried wheels too
        env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env), part

    def finish(self, proc: subprocess.Popen, part: Path, timeout: float, t0: float) -> dict[str, Any]:
        try:
            code = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = "timeout"
        text = part.read_text(errors="replace")
        with open(self.log, "a") as f:
            f.write(text + f"\n# exit {code} after {time.monotonic() - t0:.1f} s\n")
        return {"code": code, "seconds": round(time.monotonic() - t0, 1), "output": text}

    def cmd(self, argv: list[str], timeout: float) -> dict[str, Any]:
        t0 = time.monotonic()
        return self.finish(*self.start(argv), timeout, t0)


def phase(run: Run, name: str, need_s: float, fn: Callable[[Run], Any]) -> None:
    """Run one phase if ``need_s`` seconds are left; record its result, or its error, or that it was skipped."""
    if run.left() < need_s:
        run.results[name] = {"skipped": f"{run.left():.0f} s left of the budget, {need_s:.0f} s needed"}
        run.say(f"{name}: skipped ({run.results[name]['skipped']})")
    else:
        t0 = time.monotonic()
        run.say(f"{name}: started, {run.left():.0f} s left")
        try:
            run.results[name] = fn(run)
        except Exception as e:  # one phase failing must not lose the others' figures
            run.results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        run.say(f"{name}: done in {time.monotonic() - t0:.1f} s")
    run.save()


def environment(run: Run) -> dict[str, Any]:
    import torch

    from torchship.serve.bench.stats import device_peak, machine_info

    info = machine_info()
    info["torch_cuda"] = torch.version.cuda
    info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    info["peak"] = device_peak(run.a.device, os.cpu_count() or 1)
    return info


def train(run: Run, channels_last: bool = False) -> dict[str, Any]:
    """Training images/s per precision (median over the epochs after the first, steps only), and which AMP
    --amp auto chose."""
    q = run.a.quick
    common = [
        "--arch",
        run.arch,
        "--data",
        "synthetic",
        "--image-size",
        "32" if q else "224",
        "--batch-size",
        "16" if q else "128",
        "--synthetic-samples",
        "160" if q else "2176",
        "--val-fraction",
        "0.2" if q else "0.06",
        "--epochs",
        "3",
        "--device",
        run.a.device,
        "--no-progress",
        "--keep-last",
        "1",
    ]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        "-m",
        "torchship.train",
    ]
    plain = [*TS, "train", "--nproc", "1"]
    cases = [("fp32", plain, ["--amp", "off"]), ("amp auto, DDP world 1", torchrun, ["--amp", "auto"])]
    if run.a.device == "cuda":
        cases.insert(1, ("fp16 + GradScaler", plain, ["--amp", "fp16"]))
    if channels_last:
        cases = [("bf16 channels_last", plain, ["--amp", "bf16", "--channels-last"])]
    out: dict[str, Any] = {}
    for label, launcher, flags in cases:
        if run.left() < 60:
            out[label] = {"skipped": "budget"}
            continue
        d = run.work / f"train_{'cl_' if channels_last else ''}{len(out)}"
        r = run.cmd([*launcher, *common, *flags, "--out", str(d)], min(150, run.left() - 30))
        rec: dict[str, Any] = {"code": r["code"], "seconds": r["seconds"]}
        lines = [ln for ln in r["output"].splitlines() if ln.startswith("training ") or "amp" in ln and "auto" in ln]
        rec["log"] = lines[:3]
        metrics = d / "metrics.jsonl"
        if metrics.exists():
            epochs = [json.loads(ln) for ln in metrics.read_text().splitlines()]
            later = [e["epoch_images_per_s"] for e in epochs[1:]] or [epochs[-1]["epoch_images_per_s"]]
            rec.update(
                first_epoch_images_per_s=epochs[0]["epoch_images_per_s"],
                images_per_s=statistics.median(later),
                val_acc=epochs[-1]["val_acc"],
            )
        else:
            rec["error"] = r["output"][-1500:]
        out[label] = rec
        if label.startswith("amp auto") and metrics.exists():
            out["checkpoint_on_cpu"] = checkpoint_on_cpu(run, d)
        run.results["train_channels_last" if channels_last else "train"] = out
        run.save()
    return out


def checkpoint_on_cpu(run: Run, train_dir: Path) -> dict[str, Any]:
    """The checkpoint written on the device, loaded on the CPU (map_location): its outputs against the
    same weights run on the device in fp32."""
    import torch

    from torchship.checkpoint import resolve_checkpoint
    from torchship.eager import checkpoint_model
    from torchship.models import WithPreprocessing

    model, meta = checkpoint_model(resolve_checkpoint(train_dir))
    model = WithPreprocessing(model, meta["preprocessing"]["mean"], meta["preprocessing"]["std"]).eval()
    x = torch.rand(8, *meta["input_shape"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cpu = model(x)
        dev = model.to(run.a.device)(x.to(run.a.device)).cpu()
    scale = float(cpu.abs().max())
    return {
        "max_abs_diff": float((cpu - dev).abs().max()),
        "logit_scale": scale,
        "top1_agreement": float((cpu.argmax(1) == dev.argmax(1)).float().mean()),
        "param_device_in_file": "cpu (weights are saved from the unwrapped model, loaded with map_location)",
    }


def export_argv(run: Run) -> list[str]:
    """`torchship export` of the run's torchvision model with realistic weights (made once per work folder)."""
    sys.path.insert(0, str(ROOT))
    from tests.zoo import models as zoo
    from tests.zoo.run import weights_for

    image = ("--input", f"images:float32:B,3,{run.size},{run.size}")
    path = run.work / "weights.pt"
    weights = (
        path
        if path.exists()
        else weights_for(zoo.Entry(run.arch, "torchvision_model", {"arch": run.arch}, image), path)
    )
    return [
        *TS,
        "export",
        "--model",
        "tests.zoo.models:torchvision_model",
        "--model-arg",
        f'arch="{run.arch}"',
        "--weights",
        str(weights),
        *image,
        "--name",
        run.arch,
        "--device",
        run.a.device,
        "--max-batch",
        str(run.max_batch),
        "--threads",
        str(max(1, (os.cpu_count() or 2) // 2)),
        "--overwrite",
    ]


def served(run: Run) -> dict[str, Any]:
    """Phase A: TorchScript fp32 and AOTInductor bf16, each exported and verified on the device, served by the
    embedded Triton with KIND_GPU instances (`torchship repo --instance-kind gpu`, `torchship serve`), checked with
    `torchship infer --check`, and swept at concurrency 1, 8, 32, 128 with the in-process figures beside."""
    out: dict[str, Any] = {}
    cases = [("fp32 torchscript", ["--formats", "torchscript"])]
    if not run.a.skip_aoti:
        cases.append(("bf16 aoti", ["--dtype", "bfloat16", "--formats", "aoti"]))
    for key, flags in cases:
        if run.left() < 90:
            out[key] = {"skipped": f"{run.left():.0f} s left"}
            continue
        d = run.work / f"served_{key.split()[0]}"
        r = run.cmd([*export_argv(run), *flags, "--out", str(d)], min(300, run.left() - 60))
        rec: dict[str, Any] = {"export": {"code": r["code"], "seconds": r["seconds"], **export_record(d)}}
        if r["code"] != 0:
            rec["export"]["tail"] = r["output"][-2000:]
        else:
            rec.update(serve_and_sweep(run, d, key.split()[1]))
        out[key] = rec
        run.results["A_served"] = out
        run.save()
    return out


def serve_and_sweep(run: Run, export: Path, fmt: str) -> dict[str, Any]:
    from torchship.serve.client import TritonClient
    from torchship.serve.embedded.process import free_ports

    gpu = run.a.device == "cuda"
    repo = export.parent / f"{export.name}_repo"
    r = run.cmd(
        [*TS, "repo", str(export), "--out", str(repo), "--instance-kind", "gpu" if gpu else "cpu", "--overwrite"], 120
    )
    rec: dict[str, Any] = {"repo": {"code": r["code"], "tail": r["output"][-600:]}}
    if r["code"] != 0:
        return rec
    port, t0 = free_ports()[0], time.monotonic()
    server, part = run.start([*TS, "serve", str(repo), "--grpc-port", str(port)])
    url = f"127.0.0.1:{port}"
    try:
        client, ready = TritonClient(url), []
        while time.monotonic() - t0 < 240 and server.poll() is None and not ready:
            try:
                ready = client.ready_models()
            except Exception:  # not up yet
                time.sleep(1.0)
        rec["server"] = {"ready_models": ready, "seconds_to_ready": round(time.monotonic() - t0, 1)}
        if not ready:
            return rec
        config = client.config(ready[0])
        rec["server"]["instance_group"] = config.get("instance_group")
        c = run.cmd([*TS, "infer", "--url", url, "--check", str(export)], 180)
        rec["infer_check"] = {"code": c["code"], "seconds": c["seconds"], "tail": c["output"][-1200:]}
        levels = ["1", "8"] if run.a.quick else ["1", "8", "32", "128"]
        bout = export.parent / f"{export.name}_bench"
        b = run.cmd(
            [
                *TS,
                "bench",
                str(export),
                "--url",
                url,
                "--out",
                str(bout),
                "--concurrency",
                *levels,
                "--variants",
                fmt,
                "--batch-sizes",
                *run.batches,
                *TIMED,
                "--window-s",
                "0.5",
                "--max-windows",
                "6",
                "--no-noop",
                "--no-cross-check",
                "--no-plots",
                "--no-progress",
            ],
            min(300, run.left() - 20),
        )
        rec["bench"] = {"code": b["code"], "seconds": b["seconds"]}
        if (bout / "results.json").exists():
            shutil.copy(bout / "results.json", run.out / f"served_{export.name}.json")
            rec["bench"].update(sweep_summary(json.loads((bout / "results.json").read_text())))
        else:
            rec["bench"]["tail"] = b["output"][-2000:]
    finally:
        server.send_signal(signal.SIGINT)  # torchship serve stops its server and stubs on Ctrl-C
        rec["serve_exit"] = run.finish(server, part, 60, t0)["code"]
    return rec


def sweep_summary(res: dict[str, Any]) -> dict[str, Any]:
    """Served rows (concurrency, req/s, p50/p99, the batch Triton formed, responses checked) and the in-process
    images/s at the batch sizes measured: served over in-process at the top level, at the nearest batch."""
    in_proc = {
        r["batch"]: r["images_per_s"] for r in res.get("in_process", {}).get("rows", []) if r.get("variant") != "eager"
    }
    out: dict[str, Any] = {"in_process": in_proc, "models": {}, "errors": res.get("errors")}
    for model, m in res.get("served", {}).get("models", {}).items():
        rows = [
            {
                "concurrency": row.get("concurrency"),
                "req_per_s": row.get("requests_per_s"),
                "p50_ms": row.get("p50_ms"),
                "p99_ms": row.get("p99_ms"),
                "avg_batch": (row.get("server") or {}).get("avg_batch"),
                "failed": row.get("failed"),
                "checked": row.get("checked"),
                "wrong": row.get("wrong"),
            }
            for row in m.get("rows", [])
        ]
        top = max(rows, key=lambda row: row["concurrency"] or 0, default={})
        formed = top.get("avg_batch") or 1  # held against the in-process batch at or above it: the stricter ratio
        near = min((b for b in in_proc if b >= formed), default=max(in_proc, default=None))
        ratio = top["req_per_s"] / in_proc[near] if top.get("req_per_s") and near else None
        out["models"][model] = {
            "rows": rows,
            "served_over_in_process": ratio,
            "in_process_batch": near,
            "instance_group": m.get("instance_group"),
        }
    return out


def strict(run: Run) -> dict[str, Any]:
    """Phase B: fp32 TorchScript and AOTInductor exported and verified on the device in strict fp32 (each in a
    fresh process, as a deployment loads it), then the TorchScript artifact with one weight scaled by 1 + 1e-3
    (the manifest rehashed, as a faulty exporter writes it): `torchship verify` must refuse it (exit 3)."""
    import torch

    from torchship.io import sha256_file
    from torchship.manifest import read_manifest, write_manifest

    d = run.work / "strict_fp32"
    formats = ["torchscript"] if run.a.skip_aoti else ["torchscript", "aoti", "--optional", "aoti"]
    r = run.cmd(
        [*export_argv(run), "--formats", *formats, "--out", str(d)],
        min(300, run.left() - 45),
    )
    out: dict[str, Any] = {"export": {"code": r["code"], "seconds": r["seconds"], **export_record(d)}}
    m = read_manifest(d) if (d / "manifest.json").exists() else None
    ts = next((a for a in (m or {}).get("artifacts", []) if a["format"] == "torchscript"), None)
    if ts is None:
        out["export"]["tail"] = r["output"][-2000:]
        return out
    aoti = next((a for a in m["artifacts"] if a["format"] == "aoti"), None)
    if aoti and not out["export"]["artifacts"].get("aoti", {}).get("pass"):
        out["aoti_loads"] = aoti_loads(run, d / aoti["file"])
    fault = run.work / "strict_fault"
    shutil.rmtree(fault, ignore_errors=True)
    shutil.copytree(d, fault)
    path = fault / ts["file"]
    module = torch.jit.load(str(path), map_location="cpu")
    # a frozen module holds its weights as constants of its graph: scale the largest one in place
    tensors = [
        (n.output().debugName(), n.t("value"))
        for n in module.forward.graph.findAllNodes("prim::Constant")
        if n.kindOf("value") == "t"
    ] + list(module.named_parameters())
    name, weight = max(tensors, key=lambda kv: kv[1].numel())
    name = f"{name} {list(weight.shape)}"
    with torch.no_grad():
        weight.mul_(1 + 1e-3)
    torch.jit.save(module, str(path))
    fm = read_manifest(fault)
    for a in fm["artifacts"]:
        for rel in a["files"]:
            a["files"][rel] = sha256_file(fault / rel)
    write_manifest(fault, fm)
    v = run.cmd([*TS, "verify", str(fault), "--only", "torchscript"], min(180, run.left() - 10))
    caught = [ln for ln in v["output"].splitlines() if "torchscript" in ln][-3:]
    out["planted_weight_fault"] = {
        "weight": name,
        "scale": 1 + 1e-3,
        "verify_exit": v["code"],
        "caught": v["code"] == 3,
        "lines": caught,
    }
    return out


# warm-ups before loading an AOTInductor package in a fresh interpreter: on the H200 every fresh load crashed
# (SIGSEGV), while the first run loaded one in a process that had run cuBLAS matmuls first
LOAD_FIRST = {
    "nothing": "",
    "a matmul": "x = torch.ones(256, 256, device=DEV); (x @ x).sum().item()",
    "a convolution": "x = torch.ones(1, 3, 8, 8, device=DEV); torch.conv2d(x, x[:, :, :3, :3]).sum().item()",
}


def aoti_loads(run: Run, package: Path) -> dict[str, Any]:
    """The package loaded (torch's public loader) in a fresh interpreter after each warm-up of LOAD_FIRST: its
    exit and last line."""
    out = {}
    for name, first in LOAD_FIRST.items():
        load = f"torch._inductor.aoti_load_package({str(package)!r})"
        code = f"import torch\nDEV = {run.a.device!r}\n{first}\n{load}\nprint('loaded')"
        r = run.cmd([sys.executable, "-X", "faulthandler", "-c", code], 90)
        out[name] = {"exit": r["code"], "last": r["output"].strip().splitlines()[-1:]}
    return out


def exports(run: Run) -> dict[str, Any]:
    """The fp32 exports (aoti_buckets apart, the longest compile) and the bf16 one, side by side: they compile
    on the CPU cores. Each is verified on the device."""
    common = export_argv(run)
    core = [f for f in FP32_FORMATS if f != "aoti_buckets"]
    jobs = {
        "fp32": [*common, "--formats", *core, "--optional", *core, "--out", str(run.work / "export_fp32")],
        "buckets": [
            *common,
            "--formats",
            "aoti_buckets",
            "--buckets",
            *run.buckets,
            "--out",
            str(run.work / "export_buckets"),
        ],
        "bf16": [
            *common,
            "--dtype",
            "bfloat16",
            "--formats",
            *BF16_FORMATS,
            "--optional",
            *BF16_FORMATS,
            "--out",
            str(run.work / "export_bf16"),
        ],
    }
    t0 = time.monotonic()
    started = {k: run.start(argv) for k, argv in jobs.items()}
    timeout = run.left() - run.a.reserve
    out = {}
    for k, (proc, part) in started.items():
        r = run.finish(proc, part, timeout - (time.monotonic() - t0), t0)
        out[k] = {"code": r["code"], "seconds": r["seconds"], **export_record(run.work / f"export_{k}")}
        if not out[k].get("artifacts"):
            out[k]["tail"] = r["output"][-2000:]
    return out


def export_record(d: Path) -> dict[str, Any]:
    """Per artifact: bytes, export seconds, verified or not, and its worst error against the bound."""
    if not (d / "manifest.json").exists():
        return {}
    from torchship.parity import artifact_summary

    m = json.loads((d / "manifest.json").read_text())
    v = m.get("verification", {}).get("artifacts", {})
    arts = {}
    for a in m["artifacts"]:
        e = v.get(a["name"], {})
        worst, bound, multiple, top1 = artifact_summary(e, m["tolerances"]) if e.get("sets") else (None, None, None, "")
        arts[a["name"]] = {
            "bytes": a.get("bytes"),
            "export_seconds": a.get("export_seconds"),
            "pass": e.get("pass"),
            "worst": worst,
            "bound": bound,
            "x_eager_error": multiple,
            "top1": top1,
            "error": e.get("error"),
        }
    failed = {f["format"]: f["error"] for f in m.get("export_failures", [])}
    return {"artifacts": arts, "failed": failed, "dtype": m.get("dtype"), "device": m.get("device")}


def bench(run: Run, which: str) -> dict[str, Any]:
    d = run.work / f"export_{which}"
    if not (d / "manifest.json").exists():
        return {"skipped": f"no {which} export"}
    have = [a["format"] for a in json.loads((d / "manifest.json").read_text())["artifacts"]]
    variants = (["eager"] if which != "buckets" else []) + [
        f for f in ("torchscript", "exported_program", "aoti", "aoti_buckets") if f in have
    ]
    out = run.work / f"bench_{which}"
    r = run.cmd(
        [
            *TS,
            "bench",
            str(d),
            "--skip-served",
            "--variants",
            *variants,
            "--batch-sizes",
            *run.batches,
            *TIMED,
            "--no-plots",
            "--no-progress",
            "--out",
            str(out),
        ],
        min(240, run.left() - 20),
    )
    for src, dst in (("results.json", f"bench_{which}.json"), ("report.md", f"bench_{which}.md"))[
        : 1 if which == "buckets" else 2
    ]:
        if (out / src).exists():
            shutil.copy(out / src, run.out / dst)
    if not (out / "results.json").exists():
        return {"code": r["code"], "tail": r["output"][-2000:]}
    res = json.loads((out / "results.json").read_text())
    return {
        "code": r["code"],
        "seconds": r["seconds"],
        "limits": res.get("limits"),
        "rows": [
            {k: row.get(k) for k in ("variant", "batch", "p50_ms", "p99_ms", "images_per_s")}
            for row in res.get("in_process", {}).get("rows", [])
        ],
        "notes": res.get("in_process", {}).get("notes"),
        "errors": res.get("errors"),
    }


def resident(run: Run) -> dict[str, Any]:
    """Images/s with the batch already on the device (no host copies), timed with CUDA events, for eager
    and aoti in bf16 at the largest batch: the figure to hold against the bf16 matmul roofline."""
    import torch

    from torchship.eager import eager_from_manifest
    from torchship.manifest import read_manifest
    from torchship.serve.bench.stats import flops_per_sample

    d = run.work / "export_bf16"
    m = read_manifest(d)
    eager = eager_from_manifest(m)
    import numpy as np

    flops = flops_per_sample(eager, [np.random.default_rng(0).random((2, 3, run.size, run.size), dtype=np.float32)])
    peak = run.results.get("environment", {}).get("peak", {}).get("bf16_flops")
    out: dict[str, Any] = {"flops_per_sample": flops, "bf16_peak_flops": peak, "rows": []}
    models = {"eager bf16 (autocast off, weights bf16)": eager.to(run.a.device, torch.bfloat16)}
    aoti = next((a for a in m["artifacts"] if a["format"] == "aoti"), None)
    if aoti:
        models["aoti bf16"] = torch._inductor.aoti_load_package(str(d / aoti["file"]))
    for batch in (int(run.batches[-2]), int(run.batches[-1])):
        x32 = torch.rand(batch, 3, run.size, run.size, device=run.a.device)
        for name, mod in models.items():
            x = x32.to(torch.bfloat16) if name.startswith("eager") else x32
            with torch.inference_mode():
                for _ in range(3):
                    mod(x)
                if run.a.device == "cuda":
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(20):
                        mod(x)
                    end.record()
                    end.synchronize()
                    ms = start.elapsed_time(end) / 20
                else:
                    t0 = time.perf_counter()
                    for _ in range(3):
                        mod(x)
                    ms = (time.perf_counter() - t0) / 3 * 1e3
            ips = batch / (ms / 1e3)
            out["rows"].append(
                {
                    "model": name,
                    "batch": batch,
                    "ms": ms,
                    "images_per_s": ips,
                    "pct_bf16_peak": 100 * ips * flops / peak if peak else None,
                }
            )
    return out


def table(run: Run) -> str:
    r = run.results
    lines = []
    env = r.get("environment", {})
    lines.append(
        f"device: {env.get('nvidia_smi') or env.get('gpu') or env.get('cpu')}; torch "
        f"{env.get('versions', {}).get('torch')} (CUDA {env.get('torch_cuda')}, cuDNN {env.get('cudnn')})"
    )
    peak = env.get("peak", {})
    if peak:
        lines.append(
            f"matmul peak: fp32 {peak.get('fp32_flops', 0) / 1e12:.1f} TFLOP/s, bf16 "
            f"{peak.get('bf16_flops', 0) / 1e12:.1f} TFLOP/s"
        )
    for key, rec in (r.get("A_served") or {}).items() if isinstance(r.get("A_served"), dict) else ():
        if not isinstance(rec, dict) or "skipped" in rec:
            lines.append(f"served {key}: {rec}"[:300])
            continue
        srv = rec.get("server", {})
        lines.append(
            f"served {key}: export exit {rec.get('export', {}).get('code')}, ready {srv.get('ready_models')} "
            f"in {srv.get('seconds_to_ready')} s, instances {srv.get('instance_group')}, "
            f"infer --check exit {rec.get('infer_check', {}).get('code')}"
        )
        for model, m in rec.get("bench", {}).get("models", {}).items():
            for row in m["rows"]:
                lines.append(
                    f"  {model} c{row['concurrency']}: {row['req_per_s'] or 0:.0f} req/s, p50 "
                    f"{row['p50_ms'] or 0:.2f} ms, "
                    f"p99 {row['p99_ms'] or 0:.2f} ms, batch {row['avg_batch'] or 0:.1f}, {row['wrong']} wrong of "
                    f"{row['checked']}"
                )
            if m.get("served_over_in_process"):
                lines.append(
                    f"  {model}: served {100 * m['served_over_in_process']:.0f} % of in-process at batch "
                    f"{m['in_process_batch']}"
                )
    b = r.get("B_strict") or {}
    if isinstance(b, dict) and b.get("export"):
        for name, a in (b["export"].get("artifacts") or {}).items():
            lines.append(f"strict fp32 {name}: pass {a['pass']}, worst {a['worst']} vs bound {a['bound']}")
        for name, v in (b.get("aoti_loads") or {}).items():
            lines.append(f"strict fp32 aoti loaded fresh after {name}: exit {v['exit']} {v['last']}")
        if b.get("planted_weight_fault"):
            f = b["planted_weight_fault"]
            lines.append(
                f"strict fp32: {f['weight']} x {f['scale']} -> verify exit {f['verify_exit']} (caught: {f['caught']})"
            )
    for label, t in [*r.get("train", {}).items(), *r.get("train_channels_last", {}).items()]:
        if "images_per_s" in t:
            lines.append(
                f"train {label}: {t['images_per_s']:.0f} img/s (first epoch {t['first_epoch_images_per_s']:.0f}); "
                + " | ".join(t.get("log", [])[:1])[:160]
            )
        elif "max_abs_diff" in t:
            lines.append(
                f"checkpoint on CPU vs device: max |diff| {t['max_abs_diff']:.3g} of scale {t['logit_scale']:.3g}, "
                f"top-1 agreement {t['top1_agreement']:.3f}"
            )
        else:
            lines.append(f"train {label}: {t}"[:300])
    for k, e in r.get("exports", {}).items() if isinstance(r.get("exports"), dict) else ():
        if not isinstance(e, dict):
            continue
        lines.append(f"export {k}: exit {e.get('code')} in {e.get('seconds')} s; failed: {e.get('failed')}")
        for name, a in (e.get("artifacts") or {}).items():
            lines.append(
                f"  {name}: pass {a['pass']}, {(a['bytes'] or 0) / 1e6:.0f} MB, export {a['export_seconds']} s, "
                f"worst {a['worst']} vs bound {a['bound']} ({a['x_eager_error']}x eager's own)"
            )
    for k in ("bench_fp32", "bench_bf16", "bench_buckets"):
        if k not in r:
            continue
        b = r[k]
        for row in b.get("rows", []):
            lines.append(
                f"{k} {row['variant']} b{row['batch']}: p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms, "
                f"{row['images_per_s']:.0f} img/s"
            )
        if not b.get("rows"):
            lines.append(f"{k}: {str(b)[:400]}")
    for row in r.get("resident", {}).get("rows", []):
        lines.append(
            f"resident {row['model']} b{row['batch']}: {row['ms']:.2f} ms, {row['images_per_s']:.0f} img/s, "
            f"{row['pct_bf16_peak'] or 0:.1f} % of bf16 peak"
        )
    for k, v in r.items():
        if isinstance(v, dict) and ("error" in v or "skipped" in v) and k not in ("exports", "A_served"):
            lines.append(f"{k}: {v.get('error') or v.get('skipped')}")
    return "\n".join(lines)


PHASES = {
    "A": [("A_served", 200, served)],
    "B": [("B_strict", 120, strict)],
    "C": [("train", 100, train), ("train_channels_last", 45, lambda r: train(r, channels_last=True))],
    "D": [
        ("exports", 200, exports),
        ("bench_fp32", 40, lambda r: bench(r, "fp32")),
        ("bench_bf16", 40, lambda r: bench(r, "bf16")),
        ("resident", 15, resident),
        ("bench_buckets", 40, lambda r: bench(r, "buckets")),
    ],
}


def succeeded(rec: Any) -> bool:
    """A step's record holds no failed command or check, no error and nothing skipped (a planted fault's
    expected refusal is its "verify_exit", not a "code")."""
    if isinstance(rec, list):
        return all(succeeded(v) for v in rec)
    if not isinstance(rec, dict):
        return True
    if rec.get("error") or rec.get("failed") or "skipped" in rec or rec.get("wrong"):
        return False
    if rec.get("pass") is False or rec.get("caught") is False or rec.get("code", 0) != 0:
        return False
    return all(succeeded(v) for v in rec.values())


def phase_done(results: dict[str, Any], letter: str) -> bool:
    """Every step of phase ``letter`` recorded and succeeded; A and B count only with AOTInductor in them."""
    if letter in "AB" and "--skip-aoti" in results.get("argv", []):
        return False
    return all(name in results and succeeded(results[name]) for name, _, _ in PHASES[letter])


def done_before(history: Path, quick: bool) -> set[str]:
    """The phases an earlier full-size run did (judged from the results in --history's gpu.json records)."""
    done: set[str] = set()
    for f in sorted(history.glob("*.json")) if history.is_dir() else ():
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and "argv" in rec and "--quick" not in rec["argv"] and not quick:
            done |= {letter for letter in PHASES if phase_done(rec, letter)}
    return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu.json, gpu.log and the bench reports")
    ap.add_argument("--work", default="/tmp/torchship-gpu", help="scratch folder for checkpoints and exports")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="resnet18 at 64x64, small batches: the plumbing only")
    ap.add_argument("--budget", type=float, default=550, help="seconds for the whole run")
    ap.add_argument("--reserve", type=float, default=150, help="seconds phase D's exports leave for its benches")
    ap.add_argument(
        "--skip-aoti",
        action="store_true",
        help="leave AOTInductor out of phases A and B (where loading its packages is known to fail)",
    )
    ap.add_argument(
        "--phases",
        nargs="*",
        choices=sorted(PHASES),
        default=None,
        help="phases to run, in order (default: those no record in --history has done)",
    )
    ap.add_argument(
        "--history", default=str(ROOT / "docs" / "benchmarks" / "gpu"), help="folder of earlier runs' gpu.json records"
    )
    a = ap.parse_args()
    done = done_before(Path(a.history), a.quick)
    phases = a.phases if a.phases is not None else [p for p in PHASES if p not in done] or list(PHASES)
    a.skip = []
    run = Run(a)
    run.results["phases"] = phases
    run.results["phases_done"] = []
    phase(run, "environment", 10, environment)
    for letter in phases:
        for name, need, fn in PHASES[letter]:
            phase(run, name, need, fn)
        if phase_done(run.results, letter):
            run.results["phases_done"].append(letter)
            run.save()
    text = table(run)
    (run.out / "table.txt").write_text(text + "\n")
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
