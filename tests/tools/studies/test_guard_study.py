"""The guard study's noise floor: a bfloat16 re-prefill of the window's whole input against the
float32 model's own forward, and the record of the CPU path that decides it."""

from __future__ import annotations

import copy

import pytest
import torch

from tools.studies import guard_study as gs
from tools.bench.hard_cases import hard_case
from tools.bench.runs import bf16_path
from agentwin.models.adapter import KameraModel


@pytest.fixture(scope="module")
def km() -> KameraModel:
    return KameraModel.from_pretrained("tiny-llama-gqa")


def test_floor_only_measures_blind_reuse_and_the_floor_against_the_models_own_forward(km):
    case = hard_case("roles")
    same = gs.measure_case(km, case, bf16=km.model, log=lambda *a: None, floor_only=True)
    # The float32 model as its own "bf16" copy: the references are its forward of the same input.
    assert same["noise_floor"] < 1e-9 and same["budgets"] == [] and "max_kl" not in same
    low = copy.deepcopy(km.model).to(torch.bfloat16)
    row = gs.measure_case(km, case, bf16=low, log=lambda *a: None, floor_only=True)
    assert row["noise_floor"] > 1e-7 and row["blind"] > 0
    assert row["blind"] == pytest.approx(same["blind"], rel=1e-6)


def test_bf16_path_records_what_decides_the_floor(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    path = bf16_path()
    assert path["onednn_max_cpu_isa"] == "AVX2" and path["torch"] == torch.__version__
    assert path["mkldnn"] == (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)
    assert set(path["cpu_flags"]) <= {"amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2"}


def test_unknown_cases_and_contradictory_flags_are_refused(capsys):
    with pytest.raises(SystemExit):
        gs.main(["--cases", "code,nope"])
    assert "unknown case(s) nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gs.main(["--floor-only", "--no-floor"])
    assert "drop --no-floor" in capsys.readouterr().err


def test_a_case_records_both_fidelity_ladders(km):
    """One budget on a tiny model: each fit's row, and `Window(max_kl=...)` at the window's
    defaults (its own fit by bytes) and with one rank everywhere, each with what it kept and the
    probe forwards it ran."""
    from tools.bench.harness import TARGET_KL

    row = gs.measure_case(km, hard_case("code"), budgets=(0.06,), log=lambda *a: None)
    (entry,) = row["budgets"]
    assert entry["budget"] == 0.06 and entry["window"]["bytes_frac"] <= 0.06 + 1e-9
    for key in ("max_kl", "max_kl_rank"):
        got = row[key]
        assert got["target"] == TARGET_KL and len(got["ranks_kept"]) == 1 and got["probe_forwards"] >= 1
        assert (got["ranks_kept"] == [0]) == (got["bytes_frac"] == 0)
