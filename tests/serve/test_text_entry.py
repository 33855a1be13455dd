"""The text entry (an export made with --tokenizer): a text in, tokenized in the server exactly as the export's
reference was, the model's answer out; a request that is not usable text is refused alone."""

import json
import shutil

import numpy as np
import pytest

from tests.anymodel.texts import make_tokenizer, sample_texts
from tests.conftest import run_cli
from torchship.errors import ClientError, ConfigError
from torchship.runtime import PROVENANCE, sha256_file
from torchship.serve.client import TritonClient
from torchship.serve.config import RepoConfig, ServeConfig
from torchship.serve.embedded import TritonServer
from torchship.serve.repository import build_repository
from torchship.signature import parse_signature
from torchship.textio import bucket, decode_text, encode, load_tokenizer

pytest.importorskip("transformers")

ENTRY, PRE = "hf_bert_text", "hf_bert_text_pre"
SPEC = {
    "inputs": {"ids": "input_ids", "mask": "attention_mask", "type_ids": "token_type_ids"},
    "dtypes": {"input_ids": "int64", "attention_mask": "int64", "token_type_ids": "int32"},
    "dim": "S",
    "min_length": 1,
    "max_length": 16,
    "pad_id": 0,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_the_tokenizer_cuts_pads_and_masks_as_the_spec_says(tokenizer):
    tok = load_tokenizer(str(tokenizer), SPEC)
    long = "Return the JSON object. " * 20
    feeds = encode(tok, ["Return the JSON object.", long], SPEC)
    ids, mask, types = feeds["input_ids"], feeds["attention_mask"], feeds["token_type_ids"]
    assert ids.shape == (2, 16) and ids.dtype == np.int64 and types.dtype == np.int32
    n = int(mask[0].sum())
    assert ids[0, 0] == tok.token_to_id("[CLS]") and ids[0, n - 1] == tok.token_to_id("[SEP]")
    assert (ids[0, n:] == 0).all() and (mask[0, n:] == 0).all() and mask[1].all()  # padded; the long one cut
    assert ids[1, -1] == tok.token_to_id("[SEP]")  # cut to max_length with its closing token kept
    assert [bucket(n, SPEC) for n in (1, 8, 16, 40)] == [16, 16, 16, 16]  # within the exported range
    wide = {**SPEC, "max_length": 100}
    assert [bucket(n, wide) for n in (1, 16, 17, 40, 99)] == [16, 16, 32, 48, 100]
    assert encode(tok, ["Return the JSON object."], wide, bucketed=True)["input_ids"].shape == (1, 16)


@pytest.mark.parametrize(
    "data, why", [(b"", "holds no bytes"), (b"\xff\xfeabc", "not UTF-8"), (b"x" * 33, "more than the 32")]
)
def test_bad_text_is_refused_with_the_reason(data, why):
    with pytest.raises(ValueError, match=why):
        decode_text(data, max_bytes=32)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tokenizer):
    from tokenizers import Tokenizer

    from torchship.export.text import text_spec

    sig = parse_signature(
        ["input_ids:int64:B,S", "attention_mask:int64:B,S"], ["S=1..64"], ["input_ids=0..99", "attention_mask=mask"]
    )
    with pytest.raises(ConfigError, match="vocabulary holds 1000 tokens, more than input_ids's range 0..99"):
        text_spec(sig, Tokenizer.from_file(str(tokenizer)))
    sig = parse_signature(["input_ids:int64:B,S", "pixels:float32:B,S"], ["S=1..64"], ["input_ids=0..1999"])
    with pytest.raises(ConfigError, match="must be token tensors"):
        text_spec(sig, Tokenizer.from_file(str(tokenizer)))


@pytest.fixture(scope="module")
def text_served(tokenizer, tmp_path_factory):
    """A Hugging Face BERT exported with the README's text flags, its tokenizer and sample texts, served with its
    text entry: (server, export directory, repository)."""

    from tests.anymodel.test_hf_bert import export_bert, readme_text_flags

    tmp = tmp_path_factory.mktemp("text")
    texts = ["--tokenizer", tokenizer, "--text-samples", sample_texts(tmp / "texts.txt"), "--formats", "onnx"]
    assert export_bert(tmp, readme_text_flags(), *texts) == 0
    build_repository(tmp / "export", RepoConfig(out=str(tmp / "repo"), formats=("onnx",), cores=1))
    with TritonServer(ServeConfig(repo=str(tmp / "repo"))).start() as s:
        yield s, tmp / "export", tmp / "repo"


def plant_lowercasing(vdir) -> None:
    """The server's copy of the tokenizer made to lowercase (the training tokenizer is cased), as a deployment
    that picked up the uncased tokenizer would hold it, with its provenance rehashed so that it loads."""
    tok = json.loads((vdir / "tokenizer.json").read_text())
    assert tok["normalizer"]["lowercase"] is False
    tok["normalizer"]["lowercase"] = True
    (vdir / "tokenizer.json").write_text(json.dumps(tok))
    files = json.loads((vdir / PROVENANCE).read_text())
    files["files"]["tokenizer.json"] = sha256_file(vdir / "tokenizer.json")
    (vdir / PROVENANCE).write_text(json.dumps(files))


@pytest.mark.slow
def test_check_from_text_passes_and_catches_a_lowercasing_tokenizer(text_served, capsys):
    """infer --check sends the export's sample texts to the text entry and holds the answers to the model's bound
    against eager on the tokenizer's tensors of the same texts; a server tokenizer that lowercases fails it with
    exit 3, and passes again once put back."""
    server, export, repo = text_served
    kept = sorted((export / "raw").iterdir())
    assert len(kept) == 12 and all(p.suffix == ".txt" for p in kept)
    capsys.readouterr()
    assert run_cli("infer", "--url", server.url, "--check", export) == 0
    out = capsys.readouterr().out
    assert f"| {ENTRY} | raw | 12 |" in out and "served parity: PASS (2 models" in out, out
    vdir = repo / PRE / "1"
    kept_files = {n: (vdir / n).read_bytes() for n in ("tokenizer.json", PROVENANCE)}
    plant_lowercasing(vdir)
    server.load(PRE)
    assert run_cli("infer", "--url", server.url, "--check", export, "--model", ENTRY) == 3
    assert f"{ENTRY}: raw output 'logits'" in capsys.readouterr().err
    for n, data in kept_files.items():
        (vdir / n).write_bytes(data)
    server.load(PRE)
    assert run_cli("infer", "--url", server.url, "--check", export, "--model", ENTRY) == 0


@pytest.mark.slow
def test_infer_text_goes_to_the_entry_and_bad_text_is_refused_alone(text_served, capsys):
    """infer --text sends the text to the entry in front of the model, and the answer is the model's on the
    export's tokenizer's tensors (what --no-raw --export sends); bytes that are not text are refused, naming why,
    and the server answers the next request."""
    server, export, _ = text_served
    text = "Return the JSON object."
    capsys.readouterr()
    assert run_cli("infer", "--url", server.url, "--model", "hf_bert_onnx", "--text", text, "--json") == 0
    captured = capsys.readouterr()
    assert f"sending the texts to {ENTRY}" in captured.err
    served = np.array(json.loads(captured.out)["results"][0]["outputs"]["logits"])
    assert (
        run_cli(
            "infer",
            "--url",
            server.url,
            "--model",
            "hf_bert_onnx",
            "--no-raw",
            "--export",
            export,
            "--text",
            text,
            "--json",
        )
        == 0
    )
    local = np.array(json.loads(capsys.readouterr().out)["results"][0]["outputs"]["logits"])
    np.testing.assert_allclose(served, local, atol=1e-6)
    assert run_cli("infer", "--url", server.url, "--model", "hf_bert_onnx", "--no-raw", "--text", text) == 2
    assert "--export EXPORT_DIR" in capsys.readouterr().err
    client = TritonClient(server.url)
    with pytest.raises(ClientError, match="not UTF-8"):
        client.infer_all(ENTRY, {"text": np.frombuffer(b"\xff\xfeabc", np.uint8)[None]})
    assert client.infer_all(ENTRY, {"text": np.frombuffer(text.encode(), np.uint8)[None]})["logits"].shape == (1, 4)


def test_a_text_entry_for_an_export_without_a_tokenizer_is_refused(exported, tmp_path):
    with pytest.raises(ConfigError, match="keeps no tokenizer; export it with --tokenizer"):
        build_repository(exported, RepoConfig(out=str(tmp_path / "repo"), formats=("onnx",), text_entry=True))


def test_an_export_keeps_the_tokenizer_and_refuses_an_altered_one(text_served, tmp_path):
    """The tokenizer is hashed in the manifest like the artifacts: an altered copy is refused by name."""
    from torchship.errors import ArtifactError
    from torchship.manifest import Export

    _, export, _ = text_served
    copy = tmp_path / "export"
    shutil.copytree(export, copy)
    Export(copy).check_files()
    (copy / "tokenizer" / "tokenizer.json").write_text("{}")
    with pytest.raises(ArtifactError, match="tokenizer/tokenizer.json was altered"):
        Export(copy).check_files()


def test_after_the_runs_switch_the_text_entry_runs_the_winner_and_is_checked(text_served, monkeypatch):
    """torchship run's switch on a text model: the winner copied under the plain name, the text entry pointed at
    it on disk, then reloaded in the live server and checked there. The planted fault, the image entry's name
    asked for (as the run once did), reloads nothing, and the live entry keeps running the old model."""
    import torchship.serve.entries
    from torchship.manifest import Export
    from torchship.pipeline.run import reload_entry
    from torchship.serve.bench.served_as import copy_as
    from torchship.serve.entries import entry_target, retarget
    from torchship.serve.parity import check_served

    server, export, repo = text_served
    manifest = Export(export).manifest
    client = TritonClient(server.url)
    copy_as(repo, "hf_bert_onnx", "onnx", "hf_bert")
    server.load("hf_bert")
    retarget(repo, "hf_bert", "hf_bert")
    try:
        with monkeypatch.context() as m:
            m.setattr(
                torchship.serve.entries,
                "entry_of",
                lambda mf: torchship.serve.entries.Entry("image", "hf_bert_image", "", ""),
            )
            assert reload_entry(server, repo, manifest) == []
        assert entry_target(client.config(ENTRY, fresh=True)) == "hf_bert_onnx"  # the fault: left behind
        assert reload_entry(server, repo, manifest) == [ENTRY]
        assert entry_target(client.config(ENTRY, fresh=True)) == "hf_bert"
        report = check_served(server.url, export, models=["hf_bert", ENTRY])
        assert sorted(report["models"]) == ["hf_bert", ENTRY]
    finally:
        retarget(repo, "hf_bert", "hf_bert_onnx")
        server.load(ENTRY)
        client.unload("hf_bert")
        shutil.rmtree(repo / "hf_bert")
        client.close()


def test_the_text_entry_pads_with_the_tokenizers_own_padding_token():
    """Its padding setting's id, else its padding token's (RoBERTa's <pad> is 1, and 0 its <s>); a tokenizer that
    names none is refused, rather than padded with a guessed 0."""
    from tokenizers import Tokenizer, models

    from torchship.export.text import pad_id

    roberta = Tokenizer(models.WordLevel({"<s>": 0, "<pad>": 1, "</s>": 2, "hi": 3}, unk_token="<s>"))
    assert pad_id(roberta) == 1
    roberta.enable_padding(pad_id=2, pad_token="</s>")
    assert pad_id(roberta) == 2
    with pytest.raises(ConfigError, match="names no padding token"):
        pad_id(Tokenizer(models.WordLevel({"<s>": 0, "hi": 1}, unk_token="<s>")))
