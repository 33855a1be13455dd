"""Detection data: the built-in set's boxes hold exactly their digit's ink and its labels are the digits drawn; a
COCO folder reads back as written, and a broken one is refused naming the problem; the letterbox maps boxes to the
model's square and back."""

import json

import numpy as np
import pytest

from torchship.boxes import PAD_VALUE, iou, letterbox
from torchship.errors import DataError
from torchship.train.detection_data import DIGIT_CLASSES, INK, builtin_detection, compose, read_coco

BACKGROUND = 0.2  # a flat background: a pixel that differs from it is ink


def change(img: np.ndarray) -> np.ndarray:
    return np.abs(img / 255 - BACKGROUND).sum(-1)


def test_each_box_holds_exactly_its_digits_ink_and_its_label_is_that_digit():
    """On a flat background, ink is what differs from it: each box's four edges touch ink, no strong ink lies
    outside every box, and the ink inside a box, shrunk to 8 x 8, is recognized as its label's digit by a
    nearest-neighbour classifier of scikit-learn's digits."""
    from sklearn.datasets import load_digits  # here: importing it costs every test worker 1 s
    from sklearn.neighbors import KNeighborsClassifier

    digits = load_digits()
    knn = KNeighborsClassifier(3).fit(digits.data, digits.target)
    rng = np.random.default_rng(0)
    right = total = 0
    for _ in range(40):
        picks = rng.integers(len(digits.images), size=3)
        img, boxes, labels = compose(
            np.full((96, 96, 3), BACKGROUND, np.float32),
            [(digits.images[k], int(digits.target[k])) for k in picks],
            rng,
        )
        ink = change(img)
        outside = np.ones_like(ink, dtype=bool)
        for (x0, y0, x1, y1), label in zip(boxes.astype(int), labels):
            crop = ink[y0:y1, x0:x1]
            assert crop.size and crop.max() > 0, (x0, y0, x1, y1)
            edge = INK * crop.max() * 0.9
            assert min(crop[0].max(), crop[-1].max(), crop[:, 0].max(), crop[:, -1].max()) >= edge, (x0, y0, x1, y1)
            outside[y0:y1, x0:x1] = False
            side = max(y1 - y0, x1 - x0)  # the ink, centred in a square as scikit-learn's digits are
            square = np.zeros((side, side), np.float32)
            oy, ox = (side - (y1 - y0)) // 2, (side - (x1 - x0)) // 2
            square[oy : oy + y1 - y0, ox : ox + x1 - x0] = crop
            idx = np.arange(8) * side // 8 + side // 16
            right += int(knn.predict((16 * square[idx][:, idx] / square.max()).reshape(1, -1))[0]) == label - 1
            total += 1
        assert ink[outside].max(initial=0) < 0.5 * ink.max()
    assert total > 60 and right / total >= 0.8, (right, total)


def test_the_built_in_set_is_real_photos_and_repeats_with_its_seed():
    a, b, c = builtin_detection(12, seed=0), builtin_detection(12, seed=0), builtin_detection(12, seed=1)
    assert a.classes == DIGIT_CLASSES and len(a) == 12
    assert all(np.array_equal(x, y) for x, y in zip(a.images, b.images))
    assert all(np.array_equal(x, y) for x, y in zip(a.boxes, b.boxes))
    assert not all(np.array_equal(x, y) for x, y in zip(a.images, c.images))
    assert len({img.shape for img in a.images}) > 6  # pictures of many sizes, which the letterbox scales
    for img, boxes, labels in zip(a.images, a.boxes, a.labels):
        h, w, c = img.shape
        assert c == 3 and 96 <= min(h, w) and max(h, w) <= 192 and img.dtype == np.uint8  # 8-bit, as a photo is
        assert img.std() / 255 > 0.05  # a photo under the digits, not a flat fill
        assert 1 <= len(boxes) == len(labels) <= 3 and ((1 <= labels) & (labels <= 10)).all()
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= w).all() and (boxes[:, 3] <= h).all()
        assert (boxes[:, 2:] > boxes[:, :2]).all()
        assert (iou(boxes, boxes) - np.eye(len(boxes)) < 1e-9).all()  # none overlaps another


def write_coco(folder, pictures, anns, cats, sizes=None):
    """A COCO folder: each picture (float CHW) as a PNG under images/, and the instances JSON."""
    from PIL import Image

    (folder / "images").mkdir(parents=True)
    images = []
    for i, pic in enumerate(pictures):
        Image.fromarray((pic.transpose(1, 2, 0) * 255).round().astype(np.uint8)).save(folder / "images" / f"{i}.png")
        h, w = pic.shape[1:]
        width, height = (sizes or {}).get(i, (w, h))
        images.append({"id": 100 + i, "file_name": f"{i}.png", "width": width, "height": height})
    doc = {"images": images, "annotations": anns, "categories": cats}
    (folder / "instances.json").write_text(json.dumps(doc))
    return folder


def test_a_coco_folder_reads_back_as_written(tmp_path):
    """COCO's x, y, width, height become xyxy; category ids 5 and 9 become labels 1 and 2; a crowd annotation is
    left out; pictures of different sizes keep their own."""
    wide = np.random.default_rng(0).random((3, 40, 64)).astype(np.float32)
    tall = np.random.default_rng(1).random((3, 50, 30)).astype(np.float32)
    anns = [
        {"id": 1, "image_id": 100, "category_id": 9, "bbox": [10, 5, 20, 30]},
        {"id": 2, "image_id": 100, "category_id": 5, "bbox": [0, 0, 64, 40]},
        {"id": 3, "image_id": 101, "category_id": 5, "bbox": [2.5, 3, 10, 12.5]},
        {"id": 4, "image_id": 101, "category_id": 9, "bbox": [0, 0, 5, 5], "iscrowd": 1},
    ]
    cats = [{"id": 9, "name": "nine"}, {"id": 5, "name": "five"}]
    got = read_coco(write_coco(tmp_path / "coco", [wide, tall], anns, cats))
    assert got.classes == ["five", "nine"] and got.names == ["0.png", "1.png"]
    assert [im.shape for im in got.images] == [(40, 64, 3), (50, 30, 3)]
    assert np.array_equal(got.images[0], (wide.transpose(1, 2, 0) * 255).round())  # the PNG's 8-bit pixels
    assert got.boxes[0].tolist() == [[10, 5, 30, 35], [0, 0, 64, 40]] and got.labels[0].tolist() == [2, 1]
    assert got.boxes[1].tolist() == [[2.5, 3, 12.5, 15.5]] and got.labels[1].tolist() == [1]
    assert read_coco(tmp_path / "coco" / "instances.json").boxes[1].tolist() == got.boxes[1].tolist()


GOOD = [{"id": 1, "image_id": 100, "category_id": 1, "bbox": [1, 1, 4, 4]}]


@pytest.mark.parametrize(
    "anns, cats, sizes, says",
    [
        ([{**GOOD[0], "image_id": 7}], [{"id": 1}], None, "refers to image 7, which is not listed"),
        ([{**GOOD[0], "category_id": 3}], [{"id": 1}], None, "has category 3, which is not listed"),
        (
            [{**GOOD[0], "bbox": [10, 10, 8, 4]}],
            [{"id": 1}],
            None,
            "bbox [10, 10, 8, 4] (x, y, width, height) is empty or leaves 0.png (16 x 16)",
        ),
        ([{**GOOD[0], "bbox": [1, 1, 0, 4]}], [{"id": 1}], None, "is empty or leaves"),
        (GOOD, [{"id": 1}], {0: (20, 16)}, "0.png is 16 x 16 pixels, the JSON says 20 x 16"),
        (GOOD, [], None, "no categories"),
    ],
)
def test_a_broken_coco_set_is_refused_naming_the_problem(tmp_path, anns, cats, sizes, says):
    folder = write_coco(tmp_path / "coco", [np.zeros((3, 16, 16), np.float32)], anns, cats, sizes)
    with pytest.raises(DataError, match=r"instances\.json: ") as e:
        read_coco(folder)
    assert says in str(e.value)


def test_a_coco_folder_without_its_json_or_its_images_is_refused(tmp_path):
    with pytest.raises(DataError, match="no COCO instances JSON file"):
        read_coco(tmp_path)
    folder = write_coco(tmp_path / "coco", [np.zeros((3, 16, 16), np.float32)], GOOD, [{"id": 1}])
    (folder / "images" / "0.png").unlink()
    with pytest.raises(DataError, match="image 100's file '0.png' is not an image file beside it or under images/"):
        read_coco(folder)
    (folder / "other.json").write_text("{}")
    with pytest.raises(DataError, match="2 COCO instances JSON file"):
        read_coco(folder)
    with pytest.raises(DataError, match="not a COCO instances file"):
        read_coco(folder / "other.json")


def test_the_letterbox_keeps_the_aspect_and_maps_boxes_there_and_back():
    """A 60 x 100 picture into a 50 square: scaled by 0.5 to 30 x 50 at the top left, the rest padded; a box
    maps to half its coordinates and back, and a model's box past the picture is clipped to it."""
    pic = np.random.default_rng(0).integers(0, 256, (60, 100, 3), dtype=np.uint8)
    out, lb = letterbox(pic, 50)
    assert out.shape == (3, 50, 50) and lb.scale == 0.5
    assert (out[:, 30:, :] == PAD_VALUE).all() and not (out[:, :30, :] == PAD_VALUE).all()
    assert abs(out[:, :30, :].mean() - pic.mean() / 255) < 0.01
    boxes = np.array([[10, 20, 60, 50]], np.float32)
    assert lb.to_model(boxes).tolist() == [[5, 10, 30, 25]]
    assert np.allclose(lb.to_picture(lb.to_model(boxes)), boxes)
    assert lb.to_picture(np.array([[-4, 20, 55, 40]])).tolist() == [[0, 40, 100, 60]]
    assert np.allclose(iou([[0, 0, 10, 10]], [[5, 0, 15, 10], [20, 20, 30, 30], [0, 0, 10, 10]]), [[1 / 3, 0, 1]])


def test_a_picture_file_is_letterboxed_exactly_as_training_letterboxed_its_pixels():
    """The served image entry decodes a file and letterboxes it (decode_picture); training letterboxes the same
    8-bit pixels (boxes.letterbox): the two squares are equal bit for bit, for pictures of six sizes. A
    letterbox that resized in float instead (as torchship's first one did) is caught by the same comparison."""
    import io

    from PIL import Image

    from torchship.imageio import decode_picture, letterbox_pixels

    data = builtin_detection(6, size=64, seed=3)
    for pixels in data.images:
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        square, (w, h) = decode_picture(buf.getvalue(), 64)
        np.testing.assert_array_equal(square, letterbox(pixels, 64)[0])
        assert (w, h) == (pixels.shape[1], pixels.shape[0])
    nh, nw = round(h * 64 / max(w, h)), round(w * 64 / max(w, h))
    in_float = [
        np.asarray(Image.fromarray(p).resize((nw, nh), Image.BILINEAR), np.float32)
        for p in (pixels / 255).astype(np.float32).transpose(2, 0, 1)
    ]
    assert np.abs(np.stack(in_float) - square[:, :nh, :nw]).max() > 0
    with pytest.raises(ValueError, match="8-bit RGB pixels"):
        letterbox_pixels(pixels.astype(np.float32) / 255, 64)
