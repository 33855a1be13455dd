"""A verdict is never lost: `verify --only` keeps every other artifact's verdict, the overall one is recomputed
from all of them, and a repository serves only artifacts with a passing verdict on their files as they are."""

import pytest

from tests.conftest import run_cli
from tests.helpers import copy_export, rehash
from torchship.errors import ArtifactError
from torchship.manifest import read_manifest, write_manifest


def fail_onnx(d):
    """The manifest as a failed verification of onnx leaves it (the figures kept, the verdict FAIL)."""
    m = read_manifest(d)
    entry = m["verification"]["artifacts"]["onnx"]
    entry.update(
        {"pass": False, "failures": ["onnx: random_b1 output 'logits' (batch 1) max abs error 0.3 exceeds the bound"]}
    )
    m["verification"]["pass"] = False
    write_manifest(d, m)


def test_verify_only_keeps_a_failed_format_failed_and_repo_does_not_serve_it(exported, tmp_path, capsys):
    d = copy_export(exported, tmp_path)
    fail_onnx(d)
    capsys.readouterr()
    assert run_cli("verify", d, "--only", "torchscript") == 3  # torchscript passes; the export as a whole does not
    err = capsys.readouterr().err
    assert "onnx: random_b1 output 'logits'" in err and "(verified " in err, err
    v = read_manifest(d)["verification"]
    assert v["artifacts"]["torchscript"]["pass"] and not v["artifacts"]["onnx"]["pass"] and not v["pass"]
    assert set(v["artifacts"]) == {"torchscript", "exported_program", "aoti", "aoti_buckets", "onnx"}
    assert run_cli("repo", d, "--out", tmp_path / "repo") == 0
    out = capsys.readouterr().out
    assert "not served: onnx: failed verification" in out and str(d / "parity.md") in out, out
    assert not (tmp_path / "repo" / "tiny_cnn_onnx").exists() and (tmp_path / "repo" / "tiny_cnn_torchscript").exists()


def test_an_artifact_without_a_verdict_is_not_served(exported, tmp_path, capsys):
    d = copy_export(exported, tmp_path)
    m = read_manifest(d)
    del m["verification"]["artifacts"]["torchscript"]
    write_manifest(d, m)
    assert run_cli("repo", d, "--out", tmp_path / "repo") == 0
    assert "not served: torchscript: not verified (torchship verify" in capsys.readouterr().out
    assert not (tmp_path / "repo" / "tiny_cnn_torchscript").exists()
    m = read_manifest(d)
    m.pop("verification")  # exported with --no-verify
    write_manifest(d, m)
    assert run_cli("repo", d, "--out", tmp_path / "repo2") == 2
    err = capsys.readouterr().err
    assert "nothing to serve" in err and "not verified (torchship verify" in err and not (tmp_path / "repo2").exists()


def test_a_verdict_on_other_files_does_not_count(exported, tmp_path):
    """An artifact changed after it passed (and its manifest hash updated to match, as a careless re-export
    would) is no longer verified: its verdict was reached on other bytes."""
    from torchship.serve.config import RepoConfig
    from torchship.serve.repository import build_repository

    d = copy_export(exported, tmp_path)
    with open(d / "torchscript" / "model.pt", "ab") as f:
        f.write(b"\0")
    rehash(d, "torchscript/model.pt")
    res = build_repository(d, RepoConfig(out=str(tmp_path / "repo")))
    assert "torchscript" not in res["models"] and res["not_served"]["torchscript"].startswith("verified on other files")


def test_repo_refuses_a_file_altered_after_verification(exported, tmp_path):
    from torchship.serve.config import RepoConfig
    from torchship.serve.repository import build_repository

    d = copy_export(exported, tmp_path)
    with open(d / "onnx" / "model.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ArtifactError, match="onnx/model.onnx was altered or truncated"):
        build_repository(d, RepoConfig(out=str(tmp_path / "repo")))
    assert not (tmp_path / "repo").exists()
