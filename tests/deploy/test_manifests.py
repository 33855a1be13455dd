"""deploy/: offline schema validation, lint, and cross-checks against the code's own defaults."""

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from torchship.export.config import default_formats
from torchship.names import model_names
from torchship.serve.config import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_METRICS_PORT,
    REPOSITORY_DIR,
    TRITON_IMAGE,
    RepoConfig,
)
from torchship.serve.repository import servable_formats
from torchship.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.33.0"
BIN = Path(sys.executable).parent


def docs(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def k8s(kind, name=None):
    for p in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for d in docs(p):
            if d["kind"] == kind and (name is None or d["metadata"]["name"] == name):
                return d
    raise AssertionError(f"no {kind} {name or ''} in deploy/k8s")


def tool(name):
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    assert path, (
        f"{name} is not installed (pip install --no-deps -r requirements-test.lock -e ., or the test and scan extras)"
    )
    return str(path)


def test_kubernetes_manifests_pass_strict_schema_validation():
    files = sorted(str(p) for p in (DEPLOY / "k8s").glob("*.yaml"))
    r = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, *files], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed") == sum(len(docs(Path(f))) for f in files)


def test_kubernetes_validation_can_fail(tmp_path):
    d = k8s("Deployment")
    d["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}  # a typo strict mode must catch
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(d))
    r = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, str(tmp_path / "bad.yaml")],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0


def test_compose_file_passes_the_compose_spec_schema(tmp_path):
    check = [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec"]
    assert subprocess.run([*check, str(DEPLOY / "compose.yaml")], capture_output=True).returncode == 0
    bad = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    bad["services"]["triton"]["portz"] = ["1:1"]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    assert subprocess.run([*check, str(tmp_path / "bad.yaml")], capture_output=True).returncode != 0


@pytest.mark.parametrize("name", ["Dockerfile", "triton-images.Dockerfile"])
def test_dockerfile_passes_hadolint(name):
    r = subprocess.run([tool("hadolint"), str(DEPLOY / name)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_user_ci_workflow_is_valid_and_gates_on_verify_and_served_parity():
    path = DEPLOY / "github" / "torchship-verify.yml"
    r = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout
    steps = yaml.safe_load(path.read_text())["jobs"]["verify"]["steps"]
    runs = [s.get("run", "") for s in steps]
    assert any(r.startswith("torchship verify") for r in runs)
    assert any("torchship serve" in r for r in runs)
    assert any(r.startswith("torchship infer") and "--check" in r for r in runs)
    assert steps[-1].get("if") == "always()"


# what the default export on a GPU machine (the one deploy/ serves) says of its artifacts: each exported and verified
DEFAULT_EXPORT = {
    "artifacts": [{"format": f, "name": f} for f in default_formats("cuda")[0]],
    "verification": {"artifacts": {f: {"pass": True} for f in default_formats("cuda")[0]}},
}


def triton_args(args):
    return {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if a.startswith("--") and "=" in a}, [
        a.split("=", 1)[1] for a in args if a.startswith("--load-model=")
    ]


def test_compose_and_kubernetes_agree_with_the_code():
    """Ports, repository path, model names and image tag: one truth, read from both sides."""
    ports = {DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT, DEFAULT_METRICS_PORT}
    names = sorted(model_names({"name": TrainConfig().arch}, servable_formats(DEFAULT_EXPORT)).values())

    svc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["triton"]
    assert svc["image"] == TRITON_IMAGE
    assert (
        {int(p.split(":")[0]) for p in svc["ports"]} == ports == {int(p.split(":")[1].split()[0]) for p in svc["ports"]}
    )
    opts, loads = triton_args(svc["command"])
    vol = svc["volumes"][0]
    assert (
        (DEPLOY / vol["source"]).resolve() == (ROOT / REPOSITORY_DIR).resolve() == (ROOT / RepoConfig().out).resolve()
    )
    assert vol["read_only"] and opts["--model-repository"] == vol["target"]
    assert sorted(loads) == names
    assert "/v2/health/ready" in " ".join(svc["healthcheck"]["test"])
    assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]

    dep = k8s("Deployment", "torchship-triton")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == TRITON_IMAGE
    assert {p["containerPort"] for p in c["ports"]} == ports
    opts, loads = triton_args(c["args"])
    assert sorted(loads) == names
    mount = next(m for m in c["volumeMounts"] if m["name"] == "models")
    assert opts["--model-repository"] == mount["mountPath"] and mount["readOnly"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"].startswith("/v2/health/")
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(DEFAULT_METRICS_PORT)
    service = k8s("Service", "torchship-triton")
    assert {p["port"] for p in service["spec"]["ports"]} == ports
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "http": DEFAULT_HTTP_PORT,
        "grpc": DEFAULT_GRPC_PORT,
        "metrics": DEFAULT_METRICS_PORT,
    }
    assert k8s("HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    readme = (DEPLOY / "README.md").read_text()
    assert TRITON_IMAGE in readme


def test_training_job_runs_torchrun_with_flags_the_trainer_accepts():

    from torchship.config import add_dataclass_arguments, build, namespace_overrides

    job = k8s("Job", "torchship-train")
    assert job["spec"]["completionMode"] == "Indexed"
    cmd = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[0] == "torchrun" and "--rdzv-backend=c10d" in cmd
    nnodes = int(next(a for a in cmd if a.startswith("--nnodes=")).split("=")[1])
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nnodes
    svc = k8s("Service", "torchship-train")
    assert (
        svc["spec"]["clusterIP"] == "None" and job["spec"]["template"]["spec"]["subdomain"] == svc["metadata"]["name"]
    )
    endpoint = next(a for a in cmd if a.startswith("--rdzv-endpoint=")).split("=")[1]
    assert endpoint.startswith(f"{job['metadata']['name']}-0.{svc['metadata']['name']}:")
    train_args = cmd[cmd.index("train") + 1 :]
    p = argparse.ArgumentParser()
    add_dataclass_arguments(p, TrainConfig, exclude=("nproc",))
    cfg = build(TrainConfig, namespace_overrides(p.parse_args(train_args), TrainConfig))
    assert cfg.resume == "auto" and cfg.out.startswith("/checkpoints")
    assert all(isinstance(a, str) for a in cmd), (
        cmd
    )  # YAML reads a bare 2 or true as a number or a bool, which k8s refuses


def kserve_problems(isvc: dict) -> list[str]:
    """What is wrong with deploy/kserve's InferenceService against KServe's v1beta1 fields and this project's
    own truths (image tag, model names, the repository's PVC, explicit model control)."""
    problems = []
    if (isvc.get("apiVersion"), isvc.get("kind")) != ("serving.kserve.io/v1beta1", "InferenceService"):
        problems.append("not a serving.kserve.io/v1beta1 InferenceService")
    pred = isvc.get("spec", {}).get("predictor", {})
    canary = pred.get("canaryTrafficPercent")
    if not isinstance(canary, int) or not 0 <= canary <= 100:
        problems.append(f"canaryTrafficPercent {canary!r} is not a percentage")
    model = pred.get("model", {})
    if model.get("modelFormat", {}).get("name") != "triton" or model.get("protocolVersion") != "v2":
        problems.append("not the Triton runtime over the v2 protocol")
    if model.get("runtimeVersion") != TRITON_IMAGE.split(":")[1]:
        problems.append(f"runtimeVersion {model.get('runtimeVersion')} is not the image tag {TRITON_IMAGE}")
    pvc = k8s("PersistentVolumeClaim")["metadata"]["name"]
    if not str(model.get("storageUri", "")).startswith(f"pvc://{pvc}/"):
        problems.append(f"storageUri {model.get('storageUri')} is not on the repository's PVC {pvc}")
    opts, loads = triton_args(["tritonserver", *model.get("args", [])])
    if opts.get("--model-control-mode") != "explicit":
        problems.append("rollout needs --model-control-mode=explicit")
    if sorted(loads) != sorted(model_names({"name": TrainConfig().arch}, servable_formats(DEFAULT_EXPORT)).values()):
        problems.append(f"loads {loads}, not the repository's models")
    # the predictor takes the pod's fields, and its model the container's (KServe's PredictorSpec)
    unknown = set(pred) - {
        "canaryTrafficPercent",
        "minReplicas",
        "maxReplicas",
        "model",
        "scaleMetric",
        "scaleTarget",
        "automountServiceAccountToken",
        "securityContext",
        "volumes",
    }
    unknown |= set(model) - {
        "modelFormat",
        "protocolVersion",
        "runtimeVersion",
        "storageUri",
        "args",
        "ports",
        "resources",
        "env",
        "securityContext",
        "volumeMounts",
    }
    problems += [f"unknown field {f}" for f in sorted(unknown)]
    return problems


def test_the_kserve_canary_agrees_with_kserve_and_the_code():
    isvc = docs(DEPLOY / "kserve" / "inferenceservice.yaml")[0]
    assert kserve_problems(isvc) == []
    bad = yaml.safe_load(yaml.safe_dump(isvc))
    bad["spec"]["predictor"]["canaryTrafficPercent"] = 150
    bad["spec"]["predictor"]["model"]["args"].remove("--model-control-mode=explicit")
    bad["spec"]["predictor"]["model"]["storgeUri"] = "pvc://x/y"  # a typo
    assert len(kserve_problems(bad)) == 3
