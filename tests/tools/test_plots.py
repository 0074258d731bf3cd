"""The benchmark figures: PNG files, created folders, and refusal of empty input."""

from __future__ import annotations

import pytest

from tools.bench import plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

ROWS = [
    {"method": "blind", "bytes_frac": 0.0, "kl": 0.8},
    {"method": "low-rank", "bytes_frac": 0.10, "kl": 0.05},
    {"method": "low-rank", "bytes_frac": 0.02, "kl": 0.3},
    {"method": "low-rank", "bytes_frac": 0.05, "kl": 0.12},
    {"method": "token recompute", "bytes_frac": 0.25, "kl": 0.02},
    {"method": "token recompute", "bytes_frac": 0.50, "kl": 0.0},  # exact: drawn at the floor
]


def _is_png(path) -> bool:
    return path.read_bytes()[: len(PNG_SIGNATURE)] == PNG_SIGNATURE


def test_kl_vs_bytes_writes_png_and_creates_folder(tmp_path):
    path = tmp_path / "figs" / "deep" / "kl_vs_bytes.png"
    plots.plot_kl_vs_bytes(ROWS, str(path), "KL vs patch bytes (test)")
    assert path.stat().st_size > 1000 and _is_png(path)


def test_token_recompute_writes_png(tmp_path):
    rows = [{"frac_tokens": f, "kl": 0.5 * (1 - f) ** 3 + 1e-6} for f in (0.0, 0.1, 0.25, 0.5, 1.0)]
    path = tmp_path / "oracle.png"
    plots.plot_token_recompute(rows, str(path))
    assert _is_png(path)


@pytest.mark.parametrize("plot", [
    lambda path: plots.plot_kl_vs_bytes([], path, "empty"),
    lambda path: plots.plot_token_recompute([], path),
])
def test_empty_rows_raise(tmp_path, plot):
    path = tmp_path / "empty.png"
    with pytest.raises(ValueError):
        plot(str(path))
    assert not path.exists()


def test_negative_or_nan_kl_raises(tmp_path):
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError):
            plots.plot_kl_vs_bytes([{"method": "x", "bytes_frac": 0.1, "kl": bad}],
                                   str(tmp_path / "bad.png"), "bad")
