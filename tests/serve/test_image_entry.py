"""The image entry (torchship repo --image-entry): an encoded image file in, prepared in the server exactly as
training prepared its images, the model's answer out; a request that is not a usable image is refused alone."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from serve.client import TritonClient
from serve.config import RepoConfig, ServeConfig
from serve.embedded import TritonServer
from serve.image_entry import entry_names
from serve.model_config import CONFIG, read_config
from serve.repository import build_repository
from tests.conftest import run_cli
from torchship.errors import ClientError, ConfigError
from torchship.imageio import decode_image, image_array
from torchship.runtime import PROVENANCE, sha256_file
from train.data import _resize

ENTRY, PRE = entry_names("tiny_cnn")
DIGITS = load_digits().images[:12]  # the raw 8x8 digits, values 0..16, as training read them


def png(a: np.ndarray, mode: str = "L") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a.astype(np.uint8), mode=mode).save(buf, format="PNG")
    return buf.getvalue()


def truncated() -> bytes:
    """A JPEG cut short in its image data, as an interrupted upload leaves it."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()[: len(buf.getvalue()) * 2 // 3]


def trained_inputs() -> np.ndarray:
    """The digits as training fed them to the model (train/data.py: /16, torch's bilinear resize, 3 channels)."""
    x = torch.from_numpy(DIGITS.astype(np.float32) / 16.0).unsqueeze(1)
    return _resize(x, 32).clamp_(0.0, 1.0).repeat(1, 3, 1, 1).numpy()


@pytest.fixture(scope="module")
def image_repo(exported, tmp_path_factory):
    out = tmp_path_factory.mktemp("image") / "repo"
    build_repository(exported, RepoConfig(out=str(out), formats=("onnx",), cores=1, image_entry=True))
    return out


def served_pair(url: str, files: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(the image entry's logits for ``files``, the tensor model's logits for the same digits as training
    prepared them)."""
    client = TritonClient(url)
    raw = np.concatenate([client.infer_all(ENTRY, {"image": np.frombuffer(f, np.uint8)[None]})["logits"]
                          for f in files])
    tensors = client.infer_batches("tiny_cnn_onnx", {"images": trained_inputs()[:len(files)]})["logits"]
    client.close()
    return raw, tensors


def http_top1(host_port: str, data: bytes) -> int:
    """The class index the entry answers for ``data`` over plain HTTP (the request docs/serving.md shows)."""
    import urllib.request

    header = json.dumps({"inputs": [{"name": "image", "shape": [1, len(data)], "datatype": "UINT8",
                                     "parameters": {"binary_data_size": len(data)}}],
                         "outputs": [{"name": "logits", "parameters": {"classification": 1}}]}).encode()
    req = urllib.request.Request(f"http://{host_port}/v2/models/{ENTRY}/infer", data=header + data, method="POST",
                                 headers={"Inference-Header-Content-Length": str(len(header)),
                                          "Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(req, timeout=30) as r:
        body = json.loads(r.read())
    return int(body["outputs"][0]["data"][0].split(":")[1])


def test_the_decoder_prepares_a_file_exactly_as_training_did():
    pre = {"image_size": [32, 32], "channels": 3, "source_scale": "pixel / 16"}
    got = np.stack([decode_image(png(d), pre) for d in DIGITS])
    np.testing.assert_array_equal(got, trained_inputs())  # Pillow's float bilinear is torch's, bit for bit
    # planted skews, each caught by the same comparison: a nearest-neighbour resize, a missing scale, swapped channels
    nearest = np.stack([np.repeat(np.asarray(Image.open(io.BytesIO(png(d))).convert("F").resize(
        (32, 32), Image.NEAREST), np.float32)[None] / 16.0, 3, 0) for d in DIGITS])
    unscaled = np.stack([decode_image(png(d), {**pre, "source_scale": "pixel / 1"}) for d in DIGITS])
    rgb = {"image_size": [32, 32], "source_scale": "pixel / 255"}
    photo = np.random.default_rng(0).integers(0, 256, (40, 48, 3), np.uint8)
    straight = decode_image(png(photo, "RGB"), rgb)
    swapped = decode_image(png(photo[..., ::-1], "RGB"), rgb)
    for planted, want in ((nearest, trained_inputs()), (unscaled, trained_inputs()), (swapped, straight)):
        assert np.abs(planted - want).max() > 0.05
    # 8-bit photos: RGB, resized in 8 bits, / 255, as the ImageFolder data set reads them (grayscale, RGBA too)
    assert straight.shape == (3, 32, 32) and 0.0 <= straight.min() and straight.max() <= 1.0
    for mode, a in (("L", photo[..., 0]), ("RGBA", np.dstack([photo, photo[..., :1]]))):
        np.testing.assert_array_equal(decode_image(png(a, mode), rgb),
                                      image_array(Image.open(io.BytesIO(png(a, mode))), rgb))


@pytest.mark.parametrize("data, why", [
    (b"", "holds no bytes"),
    (b"not an image at all", "not an image Pillow can read"),
    (truncated(), "damaged or truncated"),
    (png(np.zeros((300, 400))), "300 pixels, more than the 0.1 megapixels"),  # max_pixels 100,000 below
])
def test_bad_files_are_refused_with_the_reason(data, why):
    with pytest.raises(ValueError, match=why):
        decode_image(data, {"image_size": [32, 32], "source_scale": "pixel / 255"}, max_pixels=100_000)


@pytest.mark.slow
def test_the_served_entry_answers_as_the_model_does_on_trainings_preprocessing(image_repo, exported, capsys):
    assert sorted(p.name for p in image_repo.iterdir() if p.is_dir()) == [ENTRY, PRE, "tiny_cnn_onnx"]
    ens = read_config(image_repo / ENTRY / CONFIG)
    assert ens.platform == "ensemble" and [s.model_name for s in ens.ensemble_scheduling.step] == [PRE, "tiny_cnn_onnx"]
    with TritonServer(ServeConfig(repo=str(image_repo))).start() as s:
        raw, tensors = served_pair(s.url, [png(d) for d in DIGITS])
        np.testing.assert_allclose(raw, tensors, atol=1e-5)
        client = TritonClient(s.url)
        # each bad request is refused alone, with its reason; the server answers the next
        for data, why in ((b"", "holds no bytes"), (b"GIF89a garbage", "not an image"),
                          (truncated(), "damaged or truncated")):
            with pytest.raises(ClientError, match=why):
                client.infer_all(ENTRY, {"image": np.frombuffer(data, np.uint8)[None] if data else
                                         np.zeros((1, 0), np.uint8)})
        # a 12-megapixel photo straight from a phone is served
        grad = np.linspace(0, 255, 4000, dtype=np.float32)
        big = np.dstack([np.tile(grad, (3000, 1))] * 3).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(big).save(buf, format="JPEG", quality=90)
        out = client.infer_all(ENTRY, {"image": np.frombuffer(buf.getvalue(), np.uint8)[None]})["logits"]
        assert out.shape == (1, 10) and np.isfinite(out).all()
        client.close()
        # plain HTTP, as docs/serving.md shows it: KServe v2 with the binary-data extension, the file as it is
        assert http_top1(f"{s.cfg.host}:{s.http_port}", png(DIGITS[7])) == int(np.argmax(tensors[7]))
        path = image_repo.parent / "seven.png"
        path.write_bytes(png(DIGITS[7]))
        assert run_cli("infer", "--url", s.url, "--model", ENTRY, str(path)) == 0
        assert not s.healer.heals, s.healer.heals  # the ensemble has no backend process, and none was "healed"
        assert "seven.png" in capsys.readouterr().out


@pytest.mark.slow
def test_a_planted_nearest_neighbour_resize_in_the_server_is_caught(image_repo, tmp_path):
    """The same check on a repository whose preprocessing resizes nearest-neighbour: the entry's answers move
    away from the model's on training's preprocessing, beyond the bound the real one meets."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(image_repo, repo)
    vdir = repo / PRE / "1"
    code = (vdir / "torchship_imageio.py").read_text()
    (vdir / "torchship_imageio.py").write_text(code.replace(".convert(\"F\").resize((w, h), Image.BILINEAR)",
                                                            ".convert(\"F\").resize((w, h), Image.NEAREST)"))
    files = json.loads((vdir / PROVENANCE).read_text())
    files["files"]["torchship_imageio.py"] = sha256_file(vdir / "torchship_imageio.py")
    (vdir / PROVENANCE).write_text(json.dumps(files))
    with TritonServer(ServeConfig(repo=str(repo))).start() as s:
        raw, tensors = served_pair(s.url, [png(d) for d in DIGITS])
    assert np.abs(raw - tensors).max() > 1e-2


def test_an_image_entry_for_a_model_that_takes_no_images_is_refused(exported, tmp_path):
    from torchship.manifest import Export

    export = Export(exported)
    manifest = {**export.manifest, "preprocessing": None}
    with pytest.raises(ConfigError, match="is not an image model"):
        build_repository(Export(exported, manifest), RepoConfig(out=str(tmp_path / "r"), formats=("onnx",),
                                                               image_entry=True))
    assert not (tmp_path / "r").exists()
