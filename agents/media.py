"""Image size guard for every agent: huge images give a clear error or are downscaled with a notice.

An observation's pixels go to a vision encoder whose cost grows with the pixel count, and an image
file can declare a size (say 20000×20000) whose decoded pixels alone take gigabytes. Two limits:

- `max_pixels`: above it an image is refused without being decoded (`ImageTooLarge`). The default
  is Pillow's own decompression-bomb limit (`PIL.Image.MAX_IMAGE_PIXELS`), which stays enabled:
  Pillow's `DecompressionBombError` / `DecompressionBombWarning` become `ImageTooLarge` here.
- `fit_pixels`: an image over it (but within `max_pixels`) is downscaled, aspect ratio kept, and
  the returned notice says so. JPEGs are reduced while decoding (draft mode), so the full-size
  pixels never exist in memory.

`open_image(path_or_bytes)` reads a file or bytes; `fit_image(image)` applies the same rules to an
image already in memory (a rendered page, a screenshot).
"""

from __future__ import annotations

import io
import math
import os
import warnings
from dataclasses import dataclass
from typing import BinaryIO

from PIL import Image

from agents.base import ActionError

# Qwen-VL's default ceiling for one image: 16384 visual tokens of 28×28 pixels.
DEFAULT_FIT_PIXELS = 16384 * 28 * 28


def default_max_pixels() -> int:
    """Pillow's decompression-bomb limit (read at call time, so a caller's lower setting holds)."""
    limit = Image.MAX_IMAGE_PIXELS
    return int(limit) if limit else 89_478_485


class ImageTooLarge(ActionError):
    """An image over the pixel limit; it was not decoded. Recoverable: the agent can go on."""


@dataclass(frozen=True)
class GuardedImage:
    """An image within the limits; `notice` says what was done to it (None: left as it was)."""

    image: Image.Image
    notice: str | None = None
    original_size: tuple[int, int] = (0, 0)


def _too_large(name: str, size: tuple[int, int] | None, pixels: int | None, limit: int) -> ImageTooLarge:
    dims = f"{size[0]}×{size[1]} pixels ({size[0] * size[1] / 1e6:.1f} MP)" if size else (
        f"{pixels / 1e6:.1f} MP" if pixels else "larger than Pillow's decompression-bomb limit")
    return ImageTooLarge(
        f"image {name} is {dims}, over the limit of {limit / 1e6:.1f} MP, so it was not decoded; "
        f"downscale it before use (e.g. `convert in.png -resize 4000x4000 out.png`); max_pixels= "
        f"sets the limit, within Pillow's own (PIL.Image.MAX_IMAGE_PIXELS)"
    )


def _fit_size(size: tuple[int, int], fit_pixels: int) -> tuple[int, int]:
    w, h = size
    scale = math.sqrt(fit_pixels / (w * h))
    return max(1, int(w * scale)), max(1, int(h * scale))


def check_size(size: tuple[int, int], max_pixels: int | None = None, name: str = "") -> None:
    """Raise `ImageTooLarge` when `size` (width, height) is over `max_pixels`."""
    limit = default_max_pixels() if max_pixels is None else int(max_pixels)
    w, h = size
    if w <= 0 or h <= 0:
        raise ActionError(f"image {name or ''} has an empty size {w}×{h}".replace("  ", " "))
    if w * h > limit:
        raise _too_large(name or "(in memory)", (w, h), None, limit)


def fit_image(image: Image.Image, fit_pixels: int | None = DEFAULT_FIT_PIXELS,
              max_pixels: int | None = None, name: str = "") -> GuardedImage:
    """Apply the limits to an image in memory: refuse it over `max_pixels`, downscale it (with a
    notice) over `fit_pixels`. `fit_pixels=None` keeps the size."""
    check_size(image.size, max_pixels, name)
    original = image.size
    if fit_pixels is not None and original[0] * original[1] > fit_pixels:
        target = _fit_size(original, fit_pixels)
        image = image.resize(target, Image.Resampling.LANCZOS, reducing_gap=3.0)
        return GuardedImage(image, _notice(name, original, target, fit_pixels), original)
    return GuardedImage(image, None, original)


def _notice(name: str, original: tuple[int, int], target: tuple[int, int], fit_pixels: int) -> str:
    label = f"image {name}" if name else "image"
    return (f"{label} downscaled from {original[0]}×{original[1]} to {target[0]}×{target[1]} pixels "
            f"(limit {fit_pixels / 1e6:.1f} MP); small details may be lost")


def open_image(source: str | os.PathLike | bytes | BinaryIO, fit_pixels: int | None = DEFAULT_FIT_PIXELS,
               max_pixels: int | None = None) -> GuardedImage:
    """Open an image file (path, bytes or binary file) within the limits, as RGB.

    Raises `ImageTooLarge` (an `ActionError`) for an image over `max_pixels` (default: Pillow's
    decompression-bomb limit) before any pixel is decoded, `ActionError` for a missing or
    unreadable file; downscales an image over `fit_pixels` with a notice."""
    limit = default_max_pixels() if max_pixels is None else int(max_pixels)
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        if not os.path.exists(name):
            raise ActionError(f"image {name} does not exist; check the path")
        fp: BinaryIO | str = name
    elif isinstance(source, (bytes, bytearray)):
        name, fp = "(bytes)", io.BytesIO(bytes(source))
    else:
        name, fp = getattr(source, "name", "(stream)"), source
    try:
        with warnings.catch_warnings():
            # Pillow warns between its limit and twice it; such an image is refused here too.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(fp)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _too_large(name, None, _pixels_in(str(e)), min(limit, default_max_pixels())) from None
    except OSError as e:  # PIL.UnidentifiedImageError is an OSError
        raise ActionError(f"cannot read {name} as an image ({e}); is it an image file?") from None
    try:
        size = im.size
        check_size(size, limit, name)
        target = size
        if fit_pixels is not None and size[0] * size[1] > fit_pixels:
            target = _fit_size(size, fit_pixels)
            if im.format == "JPEG":
                im.draft("RGB", target)  # decode at 1/2, 1/4 or 1/8 scale: the full size never exists
        try:
            rgb = im.convert("RGB")
        except (OSError, ValueError) as e:
            raise ActionError(f"cannot decode {name} ({e}); the file may be truncated or damaged") from None
        if rgb.size != target:
            rgb = rgb.resize(target, Image.Resampling.LANCZOS, reducing_gap=3.0)
        notice = _notice(name, size, target, fit_pixels) if target != size else None
        return GuardedImage(rgb, notice, size)
    finally:
        im.close()


def _pixels_in(message: str) -> int | None:
    """The pixel count in Pillow's bomb message ("Image size (400000000 pixels) exceeds ...")."""
    head, _, tail = message.partition("(")
    number = tail.split(" ", 1)[0]
    return int(number) if number.isdigit() else None
