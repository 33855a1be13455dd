"""The README's text-model command, run on a Hugging Face BertForSequenceClassification: the default formats and
the ExportedProgram export and verify down to S=1 (where random 0/1 masks drew rows with no token, on which ONNX and
eager disagree), and the served models pass infer --check over gRPC. The AOTInductor formats of BERT, at S down to
1, run in the zoo (python -m pytest -m zoo -k bert)."""

from __future__ import annotations

import importlib.util
import shlex

import pytest

from tests.conftest import ROOT, run_cli
from torchship.manifest import read_manifest

# looked up, not imported: importing transformers costs each test worker about 1 s as the tests are collected
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)


def export_bert(folder, flags: list[str], *extra, out=None) -> int:
    """torchship export of a seeded Hugging Face BERT from its plain weights file (written into ``folder``) with
    the signature ``flags``, as a user's --model/--weights line, into ``out`` (default: folder/export)."""
    import torch

    from tests.anymodel.models import hf_bert

    torch.manual_seed(0)
    torch.save(hf_bert().state_dict(), folder / "bert.pt")
    model = ["--model", "tests.anymodel.models:hf_bert", "--weights", folder / "bert.pt"]
    return run_cli("export", *model, *flags, *extra, "--max-batch", "8", "--out", out or folder / "export")


def readme_text_flags() -> list[str]:
    """The signature flags (--input, --dim, --input-range) of the README's text-model export command."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.startswith("torchship export --model mypkg.models:make_classifier")
    )
    command = ""
    for line in lines[start:]:
        command += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            break
    words = shlex.split(command)
    return [
        w
        for i, w in enumerate(words)
        for flag in [words[i - 1] if i else ""]
        if w in ("--input", "--dim", "--input-range") or flag in ("--input", "--dim", "--input-range")
    ]


@pytest.mark.slow
def test_the_readme_text_command_exports_serves_and_checks_hf_bert(tmp_path):

    from torchship.serve.config import RepoConfig, ServeConfig
    from torchship.serve.embedded import TritonServer
    from torchship.serve.parity import check_served
    from torchship.serve.repository import build_repository

    flags = readme_text_flags()
    assert "--input-range" in flags and "attention_mask=mask" in flags, flags
    out = tmp_path / "export"
    assert export_bert(tmp_path, flags, "--formats", "torchscript", "exported_program", "onnx") == 0
    m = read_manifest(out)
    v = m["verification"]
    assert v["pass"] and all(e["pass"] for e in v["artifacts"].values()) and len(v["artifacts"]) == 3
    assert {"random_b1_S=1", "random_b8_S=1"} <= set(m["reference"]["sets"])  # S down to 1, at batch 1 and the max
    res = build_repository(out, RepoConfig(out=str(tmp_path / "repo")))
    with TritonServer(ServeConfig(repo=res["path"])) as server:
        report = check_served(server.url, out)
    assert report["pass"] and len(report["models"]) == 2


@pytest.mark.slow
def test_uniform_masks_fail_onnx_only_on_rows_without_a_token_and_the_error_says_so(tmp_path, capsys):
    """The hole the mask kind closes, kept visible: independent 0/1 masks draw rows with no token at S=1, on which
    the ONNX graph and eager disagree; the refusal names those rows and the flag that draws real masks."""

    flags = [f.replace("attention_mask=mask", "attention_mask=uniform:0..1") for f in readme_text_flags()]
    assert export_bert(tmp_path, flags, "--formats", "onnx", "torchscript") == 3
    err = capsys.readouterr().err
    assert "onnx: random_b" in err and "torchscript:" not in err, err
    assert "only on rows whose attention_mask holds no 1" in err and "--input-range attention_mask=mask" in err, err
