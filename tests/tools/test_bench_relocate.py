"""`agentwin bench relocate` end to end on a small shape (the 0.7 target is for the full shape)."""

from __future__ import annotations

import json
import math
import sys

import pytest

import tools
from tools import cli

SMALL = ["bench", "relocate", "--tokens", "256", "--layers", "2", "--repeats", "3", "--warmup", "1"]


def test_bench_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main([*SMALL, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ratio_vs_copy" in printed and str(out) in printed

    result = json.loads(out.read_text())
    for key in ("ratio_vs_copy", "gbytes_per_s", "copy_gbytes_per_s", "speedup_vs_reference"):
        assert math.isfinite(result[key]) and result[key] > 0, (key, result[key])
    for section in ("into", "inplace"):
        assert math.isfinite(result[section]["ratio_vs_copy_into"]) and result[section]["ratio_vs_copy_into"] > 0
    assert result["tokens"] == 256 and result["layers"] == 2
    assert result["total_bytes"] == 2 * 256 * 4 * 128 * 2  # layers × tokens × heads × dim × bf16
    assert result["max_abs_err_vs_reference"] == 0.0 and result["numerics_ok"]
    assert result["threads"] >= 1 and result["timing"]["repeats"] == 3
    assert len(result["times_s"]["relocate"]) == 3
    expected_path = "C kernel" if result["kernel"]["available"] else "rotate_reference fallback"
    assert result["path"].startswith(expected_path)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tokens", "-5"], "must be a positive integer"),
        (["--tokens", "0"], "must be a positive integer"),
        (["--head-dim", "127"], "must be even"),
        (["--dtype", "int8"], "unknown dtype"),
        (["--repeats", "x"], "must be a positive integer"),
    ],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "relocate", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_needs_a_benchmark_name(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench"])
    assert exc.value.code == 2


def test_demo_rejects_bad_arguments_before_loading_anything(capsys):
    assert cli.main(["demo", "--relocation", "--start", "-5"]) == 2
    assert "non-negative" in capsys.readouterr().err
    assert cli.main(["relocation-demo", "--start", "-5"]) == 2
    assert "non-negative" in capsys.readouterr().err
    assert cli.main(["demo", "--start", "100"]) == 2  # the document demo has no start position
    assert "--relocation" in capsys.readouterr().err

