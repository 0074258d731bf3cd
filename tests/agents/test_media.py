"""Image size guard: huge image files are refused before decoding or downscaled with a notice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from agents.base import ActionError
from agents.media import ImageTooLarge, fit_image, open_image

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def huge_png(tmp_path_factory) -> Path:
    """A real 20000×20000 PNG (400 MP; 1.2 GB as RGB) of one colour, written from a 1-bit image."""
    path = tmp_path_factory.mktemp("images") / "huge.png"
    Image.new("1", (20000, 20000), 1).save(path)
    return path


def test_huge_image_is_refused_without_decoding(huge_png):
    limit = Image.MAX_IMAGE_PIXELS
    with pytest.raises(ImageTooLarge, match=r"huge\.png is 400\.0 MP, over the limit.*downscale it"):
        open_image(huge_png)
    assert Image.MAX_IMAGE_PIXELS == limit and limit  # Pillow's bomb guard is left on
    assert issubclass(ImageTooLarge, ActionError)  # recoverable: an agent can go on


def test_huge_image_does_not_eat_memory(huge_png):
    """Peak memory of a fresh process that opens the file: far below the decoded 1.2 GB. (VmHWM,
    the process's own peak: ru_maxrss would carry the forking parent's peak over exec.)"""
    code = (
        "import json\n"
        "from agents.media import open_image, ImageTooLarge\n"
        "try:\n"
        f"    open_image({str(huge_png)!r}); outcome = 'opened'\n"
        "except ImageTooLarge as e:\n"
        "    outcome = str(e)\n"
        "peak = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]\n"
        "print(json.dumps([outcome, int(peak)]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    outcome, peak_kib = json.loads(done.stdout.strip().splitlines()[-1])
    assert "over the limit" in outcome
    assert peak_kib < 300 * 1024, f"peak {peak_kib / 1024:.0f} MiB"


def test_image_between_pillows_warning_and_error_is_refused_too(tmp_path):
    # 10000×10000 is over Pillow's limit but under twice it: Pillow only warns, then would decode.
    path = tmp_path / "big.png"
    Image.new("1", (10000, 10000), 0).save(path)
    with pytest.raises(ImageTooLarge, match="over the limit"):
        open_image(path)


def test_configurable_limit_and_downscale_with_notice(tmp_path):
    path = tmp_path / "wide.png"
    Image.new("RGB", (3000, 2000), (10, 120, 200)).save(path)
    with pytest.raises(ImageTooLarge, match=r"3000×2000 pixels \(6\.0 MP\), over the limit of 1\.0 MP"):
        open_image(path, max_pixels=1_000_000)
    got = open_image(path, fit_pixels=1_000_000)
    w, h = got.image.size
    assert w * h <= 1_000_000 and w * h > 0.98 * 1_000_000 and abs(w / h - 1.5) < 0.01
    assert got.image.getpixel((w // 2, h // 2)) == (10, 120, 200)
    assert got.original_size == (3000, 2000)
    assert got.notice.startswith(f"image {path} downscaled from 3000×2000 to {w}×{h}")
    same = open_image(path, fit_pixels=None)
    assert same.image.size == (3000, 2000) and same.notice is None


def test_jpeg_is_reduced_while_decoding(tmp_path):
    path = tmp_path / "photo.jpg"
    Image.new("RGB", (4000, 3000), (200, 40, 40)).save(path, quality=90)
    got = open_image(path, fit_pixels=500_000)
    w, h = got.image.size
    assert w * h <= 500_000 and abs(w / h - 4 / 3) < 0.01 and got.notice


def test_in_memory_images_and_unreadable_files(tmp_path):
    big = Image.new("RGB", (2000, 2000), (0, 0, 0))
    fitted = fit_image(big, fit_pixels=250_000, name="page 3")
    assert fitted.image.size == (500, 500) and "page 3 downscaled from 2000×2000" in fitted.notice
    assert fit_image(Image.new("RGB", (10, 10))).notice is None
    with pytest.raises(ImageTooLarge, match="page 4"):
        fit_image(big, max_pixels=1_000_000, name="page 4")
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    with pytest.raises(ActionError, match="cannot read .*notes.png as an image"):
        open_image(text)
    with pytest.raises(ActionError, match="does not exist"):
        open_image(tmp_path / "missing.png")
