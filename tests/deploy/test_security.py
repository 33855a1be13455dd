"""deploy/ at least privilege: checkov finds no failed check (each skip carries its reason), and the control key
each deployment gives Triton, run on a real Triton, refuses the planted attacks and lets torchship's own
calls through."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.test_manifests import DEPLOY, k8s, tool
from torchship.serve.access import KEY_HEADER, RESTRICTED

TEST_KEY = "a-test-key-0123456789"
# checkov's own network calls (its version check, Prisma Cloud's mappings) stay off: the scan is offline
CHECKOV_ENV = {"CHECKOV_NO_VERSION_CHECK": "1", "BC_SKIP_MAPPING": "TRUE", "BC_SKIP_DOWNLOAD": "TRUE"}


def checkov(path: Path) -> dict:
    """checkov's JSON report for ``path``: {framework: {"failed": [...], "skipped": [...], "passed": n}}."""
    r = subprocess.run(
        [tool("checkov"), "-d", str(path), "--framework", "kubernetes", "dockerfile", "--skip-download", "-o", "json"],
        capture_output=True,
        text=True,
        env={**os.environ, **CHECKOV_ENV},
    )
    reports = json.loads(r.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    out = {}
    for rep in reports:
        if "results" not in rep:  # a framework with nothing to scan
            continue
        res = rep["results"]
        out[rep["check_type"]] = {
            "failed": [(c["check_id"], c["resource"]) for c in res["failed_checks"]],
            "skipped": [
                (c["check_id"], (c.get("check_result") or {}).get("suppress_comment") or "")
                for c in res["skipped_checks"]
            ],
            "passed": len(res["passed_checks"]),
        }
    return out


def test_checkov_finds_no_failed_check_in_deploy():
    report = checkov(DEPLOY)
    assert set(report) == {"kubernetes", "dockerfile"}, report
    for framework, res in report.items():
        assert res["failed"] == [], (framework, res["failed"])
        assert res["passed"] > 0
        for check, why in res["skipped"]:  # each exception says why, beside the resource
            assert len(why) > 40, (framework, check, why)


def test_checkov_catches_a_privileged_server(tmp_path):
    """The planted fault: the Deployment as it was, root and writable with every default capability."""
    d = k8s("Deployment", "torchship-triton")
    del d["spec"]["template"]["spec"]["securityContext"]
    del d["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    (tmp_path / "k8s").mkdir()
    (tmp_path / "k8s" / "bad.yaml").write_text(yaml.safe_dump(d))
    failed = {c for c, _ in checkov(tmp_path)["kubernetes"]["failed"]}
    assert {"CKV_K8S_20", "CKV_K8S_22", "CKV_K8S_23", "CKV_K8S_28"} <= failed, failed


def pods():
    """(name, pod spec, its main container) for every pod deploy/ runs on Kubernetes and KServe."""
    isvc = yaml.safe_load((DEPLOY / "kserve" / "inferenceservice.yaml").read_text())["spec"]["predictor"]
    for name, spec in (
        ("triton", k8s("Deployment", "torchship-triton")["spec"]["template"]["spec"]),
        ("train", k8s("Job", "torchship-train")["spec"]["template"]["spec"]),
        ("kserve", isvc),
    ):
        yield name, spec, spec.get("containers", [spec.get("model")])[0]


@pytest.mark.parametrize("name", ["triton", "train", "kserve"])
def test_every_pod_runs_unprivileged_and_read_only(name):
    """checkov does not read KServe's resource, so the same floor is held here for every pod."""
    spec, c = next((s, c) for n, s, c in pods() if n == name)
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] > 0
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
    assert "/tmp" in mounts  # where Triton and torch write, the root being read-only


def test_network_policies_open_only_the_serving_ports():
    from torchship.serve.config import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT

    pol = k8s("NetworkPolicy", "torchship-triton")
    dep = k8s("Deployment", "torchship-triton")
    assert pol["spec"]["podSelector"]["matchLabels"] == dep["spec"]["template"]["metadata"]["labels"]
    assert sorted(pol["spec"]["policyTypes"]) == ["Egress", "Ingress"] and pol["spec"]["egress"] == []
    (rule,) = pol["spec"]["ingress"]
    assert {p["port"] for p in rule["ports"]} == {DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT, DEFAULT_METRICS_PORT}


def k8s_flags(args: list[str], env: list[dict]) -> list[str]:
    """The restricted-protocol flags of a container's args, with $(TRITON_ADMIN_KEY) expanded from a Secret the
    way Kubernetes expands it (the variable must come from the Secret the manifests name)."""
    (var,) = [e for e in env if e["name"] == "TRITON_ADMIN_KEY"]
    assert var["valueFrom"]["secretKeyRef"] == {"name": "torchship-triton-admin-key", "key": "key"}
    return [a.replace("$(TRITON_ADMIN_KEY)", TEST_KEY) for a in args if "restricted" in a]


def tritonserver_args(argv: list[str], tmp_path: Path) -> list[str]:
    """The arguments ``argv`` (a shell that ends by exec'ing tritonserver) gives tritonserver: run with a
    stand-in tritonserver first on PATH that prints them."""
    fake = tmp_path / "bin" / "tritonserver"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text("#!/bin/sh\nprintf '%s\\0' \"$@\"\n")
    fake.chmod(0o755)
    out = subprocess.run(
        argv, capture_output=True, check=True, env={**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    ).stdout.decode()
    return out.split("\0")[:-1]


def compose_flags(tmp_path: Path) -> list[str]:
    """The restricted-protocol flags compose's entrypoint gives tritonserver: the entrypoint run by a real sh
    (compose's $$ unescaped), its secret file holding TEST_KEY and tritonserver a stand-in that prints its
    arguments."""
    svc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["triton"]
    assert svc["secrets"] == ["triton_admin_key"] and svc["read_only"] and svc["cap_drop"] == ["ALL"]
    assert svc["user"] != "0" and "no-new-privileges:true" in svc["security_opt"]
    secret = tmp_path / "triton_admin_key"
    secret.write_text(TEST_KEY + "\n")
    entry = [a.replace("$$", "$").replace("/run/secrets/triton_admin_key", str(secret)) for a in svc["entrypoint"]]
    args = tritonserver_args([*entry, *svc["command"]], tmp_path)
    assert args[: len(svc["command"])] == svc["command"]
    return [a for a in args if "restricted" in a]


def test_every_deployment_gives_triton_the_same_key_flags_as_torchship_serve(tmp_path):
    from torchship.serve.access import restricted_flags

    dep = k8s("Deployment", "torchship-triton")["spec"]["template"]["spec"]["containers"][0]
    isvc = yaml.safe_load((DEPLOY / "kserve" / "inferenceservice.yaml").read_text())["spec"]["predictor"]["model"]
    flags = {
        "compose": compose_flags(tmp_path),
        "kubernetes": k8s_flags(dep["args"], dep["env"]),
        "kserve": k8s_flags(isvc["args"], isvc["env"]),
    }
    for where, got in flags.items():
        assert got == restricted_flags(TEST_KEY), where
    assert all(f",{p}" in flags["kubernetes"][0] or f"={p}" in flags["kubernetes"][0] for p in RESTRICTED)
    assert f":{KEY_HEADER}=" in flags["kubernetes"][0]


def test_the_repository_readmes_docker_command_restricts_the_control_plane(repo, tmp_path):
    """The docker run command in the README torchship repo writes, its sh -c script run by a real sh with the key
    file it reads holding TEST_KEY: Triton gets torchship serve's key flags."""
    from torchship.serve.access import restricted_flags

    readme = (repo / "README.md").read_text()
    (script,) = re.findall(r"sh -c '([^']*)'", readme)
    assert "--user 1000:1000 --read-only" in readme and "--cap-drop ALL" in readme
    secret = tmp_path / "key"
    secret.write_text(TEST_KEY + "\n")
    script = script.replace("\\\n", " ").replace("/run/secrets/triton_admin_key", str(secret))
    args = tritonserver_args(["sh", "-c", script], tmp_path)
    assert [a for a in args if "restricted" in a] == restricted_flags(TEST_KEY)
    assert "--model-control-mode=explicit" in args


def test_the_deployments_key_flags_refuse_the_attack_on_a_real_triton(repo, tmp_path, monkeypatch):
    """Triton started with the flags compose gives it (the same as Kubernetes' and KServe's, above): the planted
    attacks are refused without the key, and torchship's own control calls, presenting the key as --key-file
    would, load every model."""
    import torchship.serve.embedded.server as embedded
    from tests.helpers import plant_attacks
    from torchship.serve.config import ServeConfig
    from torchship.serve.embedded import TritonServer

    flags = compose_flags(tmp_path)
    monkeypatch.setattr(embedded, "restricted_flags", lambda key: flags)
    monkeypatch.setattr(embedded.secrets, "token_urlsafe", lambda n: TEST_KEY)  # torchship's calls present TEST_KEY
    with TritonServer(ServeConfig(repo=str(repo), models=("tiny_cnn_onnx",), heal=False)).start() as s:
        answers = plant_attacks(
            s.url, f"{s.cfg.host}:{s.http_port}", tmp_path / "marker", tmp_path / "log", "tiny_cnn_onnx"
        )
        assert set(answers.values()) == {"restricted"}, answers
        assert not (tmp_path / "marker").exists() and s.client().ready("tiny_cnn_onnx")
        s.client().unload("tiny_cnn_onnx")  # the key opens it
        s.load("tiny_cnn_onnx")


def test_the_compose_secret_file_is_ignored_by_git():
    r = subprocess.run(["git", "check-ignore", "-q", str(DEPLOY / "triton-admin-key")], cwd=DEPLOY.parent)
    assert r.returncode == 0


def test_the_deployments_tls_variant_is_a_valid_manifest(tmp_path):
    """The commented TLS lines of the Deployment, uncommented, make a valid Deployment serving gRPC over TLS with
    the certificate mounted from its Secret."""
    from tests.deploy.test_manifests import K8S_VERSION

    text = (DEPLOY / "k8s" / "triton-deployment.yaml").read_text()
    tls = re.sub(
        r"(?m)^(\s*)# (- --grpc-.*|- \{name: tls.*|- name: tls|  secret: \{secretName: torchship-triton-tls.*)$",
        r"\1\2",
        text,
    )
    assert tls.count("\n") == text.count("\n") and tls != text
    (tmp_path / "tls.yaml").write_text(tls)
    r = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, str(tmp_path / "tls.yaml")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    dep = next(d for d in yaml.safe_load_all(tls) if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    c = dep["containers"][0]
    assert "--grpc-use-ssl=true" in c["args"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
    assert all(
        a.split("=", 1)[1].startswith(mount["mountPath"] + "/") for a in c["args"] if a.startswith("--grpc-server-")
    )
    assert next(v for v in dep["volumes"] if v["name"] == "tls")["secret"]["secretName"] == "torchship-triton-tls"
