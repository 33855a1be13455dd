"""The image entry (torchship repo --image-entry): an encoded image file in, prepared in the server exactly as
training prepared its images, the model's answer out; a request that is not a usable image is refused alone."""

import io
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import run_cli
from torchship.errors import ClientError, ConfigError
from torchship.imageio import decode_image, image_array
from torchship.runtime import PROVENANCE, sha256_file
from torchship.serve.client import TritonClient
from torchship.serve.config import RepoConfig, ServeConfig
from torchship.serve.embedded import TritonServer
from torchship.serve.entries import entry_names
from torchship.serve.model_config import CONFIG, read_config
from torchship.serve.repository import build_repository
from torchship.train.bundled import digits, sample_photos
from torchship.train.data import _resize

ENTRY, PRE = entry_names("tiny_cnn")
DIGITS = digits()[0][:12]  # the raw 8x8 digits, values 0..16, as training read them


def png(a: np.ndarray, mode: str = "L") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a.astype(np.uint8), mode=mode).save(buf, format="PNG")
    return buf.getvalue()


def bomb() -> bytes:
    """A 24 KB PNG that decodes to 200 megapixels."""
    buf = io.BytesIO()
    Image.new("1", (20000, 10000)).save(buf, format="PNG")
    return buf.getvalue()


def entry_answer(url: str, data: bytes):
    """The image entry's logits for one file, or "megapixels" where it refused it for its size."""
    with TritonClient(url) as client:
        try:
            return client.infer_all(ENTRY, {"image": np.frombuffer(data, np.uint8)[None]})["logits"]
        except ClientError as e:
            return "megapixels" if "megapixels this server decodes" in str(e) else str(e)


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
    raw = np.concatenate(
        [client.infer_all(ENTRY, {"image": np.frombuffer(f, np.uint8)[None]})["logits"] for f in files]
    )
    tensors = client.infer_batches("tiny_cnn_onnx", {"images": trained_inputs()[: len(files)]})["logits"]
    client.close()
    return raw, tensors


def http_top1(host_port: str, data: bytes) -> int:
    """The class index the entry answers for ``data`` over plain HTTP (the request docs/serving.md shows)."""
    import urllib.request

    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": [1, len(data)],
                    "datatype": "UINT8",
                    "parameters": {"binary_data_size": len(data)},
                }
            ],
            "outputs": [{"name": "logits", "parameters": {"classification": 1}}],
        }
    ).encode()
    req = urllib.request.Request(
        f"http://{host_port}/v2/models/{ENTRY}/infer",
        data=header + data,
        method="POST",
        headers={"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        body = json.loads(r.read())
    return int(body["outputs"][0]["data"][0].split(":")[1])


def test_the_decoder_prepares_a_file_exactly_as_training_did():
    pre = {"image_size": [32, 32], "channels": 3, "source_scale": "pixel / 16"}
    got = np.stack([decode_image(png(d), pre) for d in DIGITS])
    np.testing.assert_array_equal(got, trained_inputs())  # Pillow's float bilinear is torch's, bit for bit
    # planted skews, each caught by the same comparison: a nearest-neighbour resize, a missing scale, swapped channels
    nearest = np.stack(
        [
            np.repeat(
                np.asarray(Image.open(io.BytesIO(png(d))).convert("F").resize((32, 32), Image.NEAREST), np.float32)[
                    None
                ]
                / 16.0,
                3,
                0,
            )
            for d in DIGITS
        ]
    )
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
        np.testing.assert_array_equal(
            decode_image(png(a, mode), rgb), image_array(Image.open(io.BytesIO(png(a, mode))), rgb)
        )


@pytest.mark.parametrize("mode", ["1", "P", "LA", "I;16", "CMYK", "RGB"])
def test_every_pixel_mode_users_send_becomes_the_rgb_the_model_takes(mode):
    """Palette, gray with alpha, 16-bit gray, CMYK, 1-bit and RGB files: each decoded as Pillow's own conversion
    to RGB gives it, resized in 8 bits and / 255 (TIFF for CMYK, PNG for the rest)."""
    rgb = {"image_size": [24, 20], "source_scale": "pixel / 255"}
    photo = Image.fromarray(np.random.default_rng(2).integers(0, 256, (30, 40, 3), np.uint8))
    gray16 = Image.fromarray((np.asarray(photo.convert("L"), np.uint16) * 200).astype("<u2"))
    im = gray16 if mode == "I;16" else photo.convert(mode)
    assert im.mode == mode
    buf = io.BytesIO()
    im.save(buf, format="TIFF" if mode == "CMYK" else "PNG")
    got = decode_image(buf.getvalue(), rgb)
    with Image.open(io.BytesIO(buf.getvalue())) as back:
        want = np.asarray(back.convert("RGB").resize((20, 24), Image.BILINEAR), np.float32).transpose(2, 0, 1) / 255
    assert got.shape == (3, 24, 20) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "make, why",
    [  # each file made when its case runs, not in every test worker as the tests are collected
        (lambda: b"", "holds no bytes"),
        (lambda: b"not an image at all", "not an image Pillow can read"),
        (truncated, "damaged or truncated"),
        (lambda: png(np.zeros((300, 400))), "300 pixels, more than the 0.1 megapixels"),  # max_pixels 100,000 below
        (bomb, "200000000 pixels, more than the 0.1 megapixels"),  # past Pillow's own limit
        (lambda: b"\x89PNG" + bytes(200_000), "200004 bytes, more than the 100000"),  # max_bytes below
    ],
    ids=["empty", "not-an-image", "truncated", "too-many-pixels", "bomb", "too-many-bytes"],
)
def test_bad_files_are_refused_with_the_reason(make, why):
    data = make()
    with pytest.raises(ValueError, match=why):
        pre = {"image_size": [32, 32], "source_scale": "pixel / 255"}
        decode_image(data, pre, max_pixels=100_000, max_bytes=100_000)


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
        for data, why in (
            (b"", "holds no bytes"),
            (b"GIF89a garbage", "not an image"),
            (truncated(), "damaged or truncated"),
        ):
            with pytest.raises(ClientError, match=why):
                client.infer_all(
                    ENTRY, {"image": np.frombuffer(data, np.uint8)[None] if data else np.zeros((1, 0), np.uint8)}
                )
        # a decompression bomb among 16 good files, all sent at once: the 16 are answered as before, the bomb alone
        # is refused (Pillow refuses it inside open(), before the entry's own limit)
        good = [png(d) for d in DIGITS] + [png(d) for d in DIGITS[:4]]
        with ThreadPoolExecutor(17) as pool:
            answers = list(pool.map(entry_answer, [s.url] * 17, good[:8] + [bomb()] + good[8:]))
        assert [a for a in answers if isinstance(a, str)] == ["megapixels"], answers
        served = np.concatenate([a for a in answers if not isinstance(a, str)])
        np.testing.assert_allclose(served, raw[[*range(12), 0, 1, 2, 3]], atol=1e-5)
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
        assert "seven.png" in capsys.readouterr().out
        # a file sent to the tensor model goes to the entry in front of it, as it is; --no-raw sends the tensor
        assert run_cli("infer", "--url", s.url, "--model", "tiny_cnn_onnx", str(path)) == 0
        assert f"sending the files as they are to {ENTRY}" in capsys.readouterr().err
        assert run_cli("infer", "--url", s.url, "--model", "tiny_cnn_onnx", "--no-raw", str(path)) == 0
        assert "sending" not in capsys.readouterr().err
        # served parity from the export's held-out digit files, through the entry
        assert run_cli("infer", "--url", s.url, "--check", exported) == 0
        assert f"| {ENTRY} | raw | 16 |" in capsys.readouterr().out
        assert not s.healer.heals, s.healer.heals  # the ensemble has no backend process, and none was "healed"


def plant(vdir, old: str, new: str) -> None:
    """Rewrite the preprocessing the server carries (``old`` -> ``new`` in its copy of the decoder), as a
    skewed deployment would hold it, with its provenance rehashed so that it loads."""
    code = (vdir / "torchship_imageio.py").read_text()
    assert old in code, old
    (vdir / "torchship_imageio.py").write_text(code.replace(old, new))
    files = json.loads((vdir / PROVENANCE).read_text())
    files["files"]["torchship_imageio.py"] = sha256_file(vdir / "torchship_imageio.py")
    (vdir / PROVENANCE).write_text(json.dumps(files))


@pytest.mark.slow
def test_a_planted_nearest_neighbour_resize_in_the_server_fails_the_check(image_repo, exported, tmp_path, capsys):
    """infer --check from the export's held-out digit files, on a repository whose preprocessing resizes
    nearest-neighbour: the entry's answers leave the bound the real one meets (exit 3, naming the entry)."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(image_repo, repo)
    plant(repo / PRE / "1", 'convert("F").resize((w, h), Image.BILINEAR)', 'convert("F").resize((w, h), Image.NEAREST)')
    with TritonServer(ServeConfig(repo=str(repo))).start() as s:
        capsys.readouterr()
        assert run_cli("infer", "--url", s.url, "--check", exported, "--model", ENTRY) == 3
    assert f"{ENTRY}: raw output 'logits'" in capsys.readouterr().err


PHOTO_KINDS = (
    ("jpg", "RGB", "JPEG"),
    ("png", "RGB", "PNG"),
    ("webp", "RGB", "WEBP"),
    ("gray.png", "L", "PNG"),
    ("rgba.png", "RGBA", "PNG"),
)


def photo_folder(root, per_class: int = 20, seed: int = 0):
    """An ImageFolder of two classes, crops of scikit-learn's two photos at random places and sizes, saved as
    users keep photos: JPEG, PNG, WebP, grayscale and RGBA files in turn."""
    g = np.random.default_rng(seed)
    for c, photo in zip(("temple", "flower"), sample_photos()):
        (root / c).mkdir(parents=True)
        h, w = photo.shape[:2]
        for k in range(per_class):
            side = int(g.integers(min(h, w) // 3, min(h, w) + 1))
            y, x = int(g.integers(0, h - side + 1)), int(g.integers(0, w - side + 1))
            size = int(g.integers(40, 121))
            crop = Image.fromarray(photo[y : y + side, x : x + side]).resize((size, size), Image.BILINEAR)
            suffix, mode, fmt = PHOTO_KINDS[k % len(PHOTO_KINDS)]
            crop.convert(mode).save(root / c / f"{k:02d}.{suffix}", format=fmt)
    return root


@pytest.fixture(scope="module")
def photo_served(tmp_path_factory):
    """A tiny CNN trained on photo files (RGB, 32x32), exported to ONNX with its held-out files, and served with
    its image entry: (server, export directory, repository)."""
    from torchship.config import build
    from torchship.export.config import ExportConfig
    from torchship.export.pipeline import run_export
    from torchship.train.config import TrainConfig
    from torchship.train.loop import train

    tmp = tmp_path_factory.mktemp("photos")
    data = photo_folder(tmp / "data")
    train(
        build(
            TrainConfig,
            {
                "arch": "tiny_cnn",
                "data": str(data),
                "image_size": 32,
                "epochs": 2,
                "batch_size": 8,
                "val_fraction": 0.5,
                "out": str(tmp / "train"),
                "progress": False,
                "seed": 0,
                "amp": "off",
            },
        )
    )
    run_export(
        build(
            ExportConfig,
            {"checkpoint": str(tmp / "train"), "out": str(tmp / "export"), "max_batch": 8, "formats": ["onnx"]},
        ),
        log=lambda *a: None,
    )
    build_repository(tmp / "export", RepoConfig(out=str(tmp / "repo"), formats=("onnx",), cores=1, image_entry=True))
    with TritonServer(ServeConfig(repo=str(tmp / "repo"))).start() as s:
        yield s, tmp / "export", tmp / "repo"


RGB_SKEWS = {  # what a client or server that prepared photos otherwise than training did would hold
    "a nearest-neighbour resize": (
        'convert("RGB").resize((w, h), Image.BILINEAR)',
        'convert("RGB").resize((w, h), Image.NEAREST)',
    ),
    "a missing /255": ("dtype=np.float32) / 255.0", "dtype=np.float32)"),
    "channels swapped": ("hwc.transpose(2, 0, 1)", "hwc[..., ::-1].transpose(2, 0, 1)"),
}


@pytest.mark.slow
def test_check_from_photo_files_passes_and_catches_each_skew(photo_served, capsys):
    """infer --check sends the export's held-out photo files (JPEG, PNG, WebP, grayscale, RGBA) to the entry as
    they are and holds the answers to the model's bound against eager on training's tensors of the same files;
    each skew planted in the server's preprocessing fails it with exit 3, and the server answers on."""
    server, export, repo = photo_served
    kept = sorted(p.name for p in (export / "raw").iterdir())
    assert {k.split(".", 1)[1] for k in kept} == {k[0] for k in PHOTO_KINDS}, kept
    capsys.readouterr()
    assert run_cli("infer", "--url", server.url, "--check", export) == 0
    out = capsys.readouterr().out
    assert f"| {ENTRY} | raw | {len(kept)} |" in out and "served parity: PASS (2 models" in out
    vdir = repo / PRE / "1"
    original = (vdir / "torchship_imageio.py").read_text(), (vdir / PROVENANCE).read_text()
    for what, (old, new) in RGB_SKEWS.items():
        plant(vdir, old, new)
        server.load(PRE)
        assert run_cli("infer", "--url", server.url, "--check", export, "--model", ENTRY) == 3, what
        assert f"{ENTRY}: raw output 'logits'" in capsys.readouterr().err, what
        (vdir / "torchship_imageio.py").write_text(original[0])
        (vdir / PROVENANCE).write_text(original[1])
        server.load(PRE)
    assert run_cli("infer", "--url", server.url, "--check", export, "--model", ENTRY) == 0


def test_an_image_entry_for_a_model_that_takes_no_images_is_refused(exported, tmp_path):
    from torchship.manifest import Export

    export = Export(exported)
    manifest = {**export.manifest, "preprocessing": None}
    with pytest.raises(ConfigError, match="is not an image model"):
        build_repository(
            Export(exported, manifest), RepoConfig(out=str(tmp_path / "r"), formats=("onnx",), image_entry=True)
        )
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_an_entry_in_front_of_an_int8_model_is_checked_against_that_models_own_answers(int8_export, tmp_path, capsys):
    """Behind the entry, a reduced precision: the files' answers are held to its answers on training's tensors of
    the same files (the same top-1, the gate's SQNR floor); a skew planted in the server fails it."""
    repo = tmp_path / "repo"
    build_repository(int8_export, RepoConfig(out=str(repo), formats=("onnx_int8",), cores=1))
    assert read_config(repo / ENTRY / CONFIG).ensemble_scheduling.step[-1].model_name == "tiny_cnn_onnx_int8"
    with TritonServer(ServeConfig(repo=str(repo))).start() as s:
        assert run_cli("infer", "--url", s.url, "--check", int8_export) == 0
        assert f"| {ENTRY} | raw | 16 |" in capsys.readouterr().out
        plant(
            repo / PRE / "1",
            'convert("F").resize((w, h), Image.BILINEAR)',
            'convert("F").resize((w, h), Image.NEAREST)',
        )
        s.load(PRE)
        assert run_cli("infer", "--url", s.url, "--check", int8_export, "--model", ENTRY) == 3
        assert f"{ENTRY}: raw" in capsys.readouterr().err


def test_the_entry_moved_in_front_of_a_model_that_batches_less_batches_no_more_than_it(image_repo, tmp_path):
    """Triton refuses an ensemble whose max batch exceeds a model in it: the strategy's winner may batch less."""
    import shutil

    from torchship.serve.entries import retarget
    from torchship.serve.model_config import config_text

    repo = tmp_path / "repo"
    shutil.copytree(image_repo, repo)
    c = read_config(repo / "tiny_cnn_onnx" / CONFIG)
    before = read_config(repo / ENTRY / CONFIG).max_batch_size
    c.max_batch_size = 4
    (repo / "tiny_cnn_onnx" / CONFIG).write_text(config_text(c))
    assert before > 4 and retarget(repo, "tiny_cnn", "tiny_cnn_onnx")
    assert read_config(repo / ENTRY / CONFIG).max_batch_size == 4


@pytest.mark.slow
def test_each_server_gets_the_entry_naming_the_tensors_as_its_config_of_the_model_behind_does(exported, tmp_path):
    """The official container's torch_aoti names an AOTInductor package's tensors ARGS[0] and RESULT, the embedded
    server's config images and logits: with the aoti model behind it, the entry's config.pbtxt maps the former,
    its embedded.pbtxt the latter, and the embedded server runs it, checked from the files."""
    from torchship.serve.entries import retarget
    from torchship.serve.model_config import EMBEDDED_CONFIG
    from torchship.serve.parity import check_served

    repo = tmp_path / "repo"
    build_repository(exported, RepoConfig(out=str(repo), formats=("onnx", "aoti"), cores=1, image_entry=True))
    assert retarget(repo, "tiny_cnn", "tiny_cnn_aoti")
    container, embedded = (read_config(repo / ENTRY / f).ensemble_scheduling.step[1] for f in (CONFIG, EMBEDDED_CONFIG))
    assert container.model_name == embedded.model_name == "tiny_cnn_aoti"
    assert dict(container.input_map) == {"ARGS[0]": "prepared_images"} and dict(container.output_map) == {
        "RESULT": "logits"
    }
    assert dict(embedded.input_map) == {"images": "prepared_images"} and dict(embedded.output_map) == {
        "logits": "logits"
    }
    with TritonServer(ServeConfig(repo=str(repo))) as s:
        report = check_served(s.url, exported, [ENTRY])
    assert report["pass"] and report["models"][ENTRY]["raw"]["batch"] == 16


@pytest.mark.slow
def test_a_weights_export_with_image_files_serves_an_entry_checked_from_those_files(tmp_path, capsys):
    """export --model ... --image-files DIR: the preprocessing the entry applies is recorded, 16 of the files kept
    and the rest read as real samples; the entry passes infer --check from the files, and a planted
    nearest-neighbour resize fails it with exit 3."""
    from torchship.manifest import read_manifest
    from torchship.models import TinyCNN

    torch.manual_seed(0)
    torch.save(TinyCNN(num_classes=2).state_dict(), tmp_path / "w.pt")
    data = photo_folder(tmp_path / "data", per_class=12)
    out = tmp_path / "export"
    assert (
        run_cli(
            "export",
            "--model",
            "torchship.models:TinyCNN",
            "--model-arg",
            "num_classes=2",
            "--weights",
            tmp_path / "w.pt",
            "--input",
            "images:float32:B,3,32,32",
            "--image-files",
            data,
            "--formats",
            "onnx",
            "--max-batch",
            "8",
            "--out",
            out,
        )
        == 0
    )
    m = read_manifest(out)
    assert m["preprocessing"]["image_size"] == [32, 32] and m["reference"]["raw"]["batch"] == 16
    assert m["reference"]["samples"] == "examples" and m["reference"]["sets"]["examples"] == 24
    build_repository(out, RepoConfig(out=str(tmp_path / "repo"), formats=("onnx",), cores=1))
    entry, pre = entry_names(m["name"])
    with TritonServer(ServeConfig(repo=str(tmp_path / "repo"))).start() as s:
        capsys.readouterr()
        assert run_cli("infer", "--url", s.url, "--check", out) == 0
        assert f"| {entry} | raw | 16 |" in capsys.readouterr().out
        plant(tmp_path / "repo" / pre / "1", *RGB_SKEWS["a nearest-neighbour resize"])
        s.load(pre)
        assert run_cli("infer", "--url", s.url, "--check", out, "--model", entry) == 3
    assert f"{entry}: raw output 'output0'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--input", "features:float32:B,20"], "must take one float32 RGB image input [B, 3, H, W]"),
        (["--input", "images:float32:B,3,32,32", "--model", "torchship.models:TinyCNN"], "no image files in it"),
    ],
)
def test_image_files_for_a_model_that_takes_no_images_or_a_folder_without_any_are_refused(
    tmp_path, capsys, flags, message
):
    from tests.anymodel.models import mlp
    from torchship.models import TinyCNN

    model = "torchship.models:TinyCNN" if "--model" in flags else "tests.anymodel.models:mlp"
    torch.save((TinyCNN() if "--model" in flags else mlp()).state_dict(), tmp_path / "w.pt")
    (tmp_path / "empty").mkdir()
    flags = [f for f in flags if f not in ("--model", "torchship.models:TinyCNN")]
    assert (
        run_cli(
            "export",
            "--model",
            model,
            "--weights",
            tmp_path / "w.pt",
            *flags,
            "--image-files",
            tmp_path / "empty",
            "--out",
            tmp_path / "export",
        )
        == 2
    )
    assert message in capsys.readouterr().err
    assert not (tmp_path / "export").exists()
