"""An encoded image file (JPEG, PNG, WebP, ...) to the float32 CHW array a model takes, exactly as training
prepared its images: the one decoder the ImageFolder data set and the served image entry both run. It needs
numpy and Pillow only (not torch), so the server's preprocessing model can carry it as one file.

Refuses, with the reason in words (ValueError): an empty request, a file of more than MAX_BYTES, bytes that are
not an image Pillow reads, a truncated or damaged file, and an image of more than MAX_PIXELS pixels (a
decompression bomb: a small file that decodes to gigabytes), whatever size Pillow's own limit says."""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any

import numpy as np

MAX_PIXELS = 100_000_000  # 100 megapixels: a phone's largest photos are about half of it
MAX_BYTES = 64 << 20  # 64 MiB: a 100-megapixel JPEG is a tenth of it


def source_scale(pre: dict[str, Any]) -> float:
    """The divisor that takes raw pixels to [0, 1] ("pixel / 255" -> 255.0)."""
    return float(str(pre.get("source_scale", "pixel / 255")).split("/")[-1])


def image_array(im, pre: dict[str, Any]) -> np.ndarray:
    """A decoded Pillow image as float32 CHW in [0, 1] at pre["image_size"], as training made its inputs:
    8-bit pixels (/255) become RGB and are resized bilinearly in 8 bits, as the ImageFolder data set does; any
    other scale (the digits' 0..16) is gray, resized bilinearly in float (which is what torch's bilinear
    interpolation computes), divided, clipped and repeated to the model's channels."""
    from PIL import Image

    h, w = (int(v) for v in pre["image_size"])
    scale = source_scale(pre)
    if scale == 255.0:
        hwc = np.asarray(im.convert("RGB").resize((w, h), Image.BILINEAR), dtype=np.float32) / 255.0
        return np.ascontiguousarray(hwc.transpose(2, 0, 1))
    gray = np.asarray(im.convert("L").convert("F").resize((w, h), Image.BILINEAR), dtype=np.float32) / scale
    return np.ascontiguousarray(np.repeat(np.clip(gray, 0.0, 1.0)[None], int(pre.get("channels", 3)), axis=0))


def letterbox_pixels(rgb: np.ndarray, size: int, pad: float = 0.5) -> tuple[np.ndarray, tuple[int, int]]:
    """An 8-bit RGB picture (uint8 HWC, as a photo is) fitted into a ``size`` x ``size`` square: float32 CHW in
    [0, 1] (pixel / 255), scaled so that its longer side fills the square, resized bilinearly in 8 bits (as the
    classifier's images are), its aspect kept, placed at the top left, the rest ``pad``. Returns the square and
    the picture's (width, height), which map boxes back (torchship.boxes.Letterbox). The one letterbox training
    and the served image entry both run (decode_picture runs it on a file's pixels)."""
    from PIL import Image

    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"a letterbox takes 8-bit RGB pixels (uint8, height x width x 3), not {rgb.dtype} {rgb.shape}")
    return _letterbox(Image.fromarray(rgb, "RGB"), size, pad)


def _letterbox(im, size: int, pad: float = 0.5) -> tuple[np.ndarray, tuple[int, int]]:
    """letterbox_pixels of a Pillow RGB image (a file's is never copied at its full size into an array)."""
    from PIL import Image

    w, h = im.size
    scale = size / max(w, h)
    nw, nh = max(1, round(w * scale)), max(1, round(h * scale))
    if (nw, nh) != (w, h):
        im = im.resize((nw, nh), Image.BILINEAR)
    out = np.full((3, size, size), pad, dtype=np.float32)
    out[:, :nh, :nw] = np.asarray(im, dtype=np.float32).transpose(2, 0, 1) / 255.0
    return out, (w, h)


def decode_picture(
    data: bytes, size: int, max_pixels: int = MAX_PIXELS, max_bytes: int = MAX_BYTES
) -> tuple[np.ndarray, tuple[int, int]]:
    """An encoded image file's bytes as a detector's input: its RGB pixels letterboxed into a ``size`` square
    (letterbox_pixels); with the picture's (width, height). ValueError as decode_image's."""
    with _opened(data, max_pixels, max_bytes) as im:
        return _letterbox(im.convert("RGB"), size)


def decode_image(
    data: bytes, pre: dict[str, Any], max_pixels: int = MAX_PIXELS, max_bytes: int = MAX_BYTES
) -> np.ndarray:
    """An encoded image file's bytes as the model's float32 CHW input (image_array); ValueError saying why
    where the bytes are not a usable image."""
    with _opened(data, max_pixels, max_bytes) as im:
        return image_array(im, pre)


@contextlib.contextmanager
def _opened(data: bytes, max_pixels: int, max_bytes: int):
    """The decoded Pillow image of ``data``; ValueError saying why where the bytes are not a usable image."""
    from PIL import Image, UnidentifiedImageError

    if not len(data):
        raise ValueError("the request holds no bytes: send the image file's contents")
    if len(data) > max_bytes:
        raise ValueError(f"{len(data)} bytes, more than the {max_bytes} this server takes in an image; send it smaller")
    too_big = f"more than the {max_pixels / 1e6:g} megapixels this server decodes (a decompression bomb?)"
    try:
        with warnings.catch_warnings():  # the limit is max_pixels, not Pillow's warning
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(bytes(data))) as im:
                w, h = im.size
                if w * h > max_pixels:
                    raise ValueError(f"the image is {w} x {h} pixels, {too_big}; send it smaller")
                im.load()
                yield im
    except Image.DecompressionBombError as e:  # beyond twice Pillow's own limit: refused inside open()
        size = str(e).split(" pixels")[0].removeprefix("Image size (")
        raise ValueError(f"the image is {size} pixels, {too_big}; send it smaller") from None
    except UnidentifiedImageError:
        raise ValueError(
            f"{len(data)} bytes that are not an image Pillow can read (send a JPEG, PNG, WebP, BMP, "
            "GIF or TIFF file as it is)"
        ) from None
    except (OSError, SyntaxError) as e:  # Pillow's truncated or damaged file
        raise ValueError(f"a damaged or truncated image: {e}") from None
