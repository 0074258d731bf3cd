"""The refinement study's pieces against the model's own forward: the probes' targets are the
model's single forward, refining keeps the patch's storage and bytes and lowers its probes' KL,
and bad arguments are refused before any model loads."""

from __future__ import annotations

import pytest
import torch

from tools.bench import baselines as bl, contexts as cx
from tools.studies import refine_study as rs
from agentwin.models.zoo import build_tiny
from kamera_core import patch as kp
from tests.support import forward_growth, tolerance


@pytest.fixture(scope="module")
def ctx():
    model = build_tiny("tiny-llama-gqa")
    g = torch.Generator().manual_seed(5)
    chunks = [cx.text_chunk(torch.randint(3, 240, (n,), generator=g)) for n in (13, 19)]
    queries = [torch.randint(3, 240, (4,), generator=g) for _ in range(2)]
    return cx.build_context(model, chunks, queries, greedy=2)


def _patch(ctx, storage):
    deltas = kp.deficit(bl.conditioned_local(ctx, 1), ctx.canonical[1])
    if storage != "mixed":
        return kp.build_patch(deltas, [(2, 2)] * len(deltas), "svd", storage=storage)
    full = [tuple(kp.fit_with_gains(x)[0] for x in pair) for pair in deltas]
    return kp.truncated_patch(full, [(3, 3)] * len(deltas), "svd", "mixed", [(1, 1)] * len(deltas))


def test_exact_patch_reads_zero_probe_kl_and_blind_does_not(ctx):
    probes = rs.row_probes(ctx, 5, 3) + rs.question_probes(ctx, [1])
    assert [p.cut for p in probes] == [5, 9, 14, 19]
    with torch.no_grad():
        exact = float(rs.probe_loss(ctx, bl.conditioned_local(ctx, 1), probes))
        blind = float(rs.probe_loss(ctx, ctx.canonical[1], probes))
    # The exact patch reads the model's own KV: its true KL is ½·δ² of the two forwards' gap δ
    # (forward_growth), ~1e-14 here. But probe_loss sums p·(target − read) over float32
    # log-probabilities, each rounded by itself to half an ulp of |log p|: that leaves a
    # first-order term of either sign up to eps·max|log p| (~1e-8 here, negative on some CPUs),
    # the floor no exact read can go below.
    logp = max(float(p.target.abs().max()) for p in probes)
    delta = tolerance(torch.float32, logp, forward_growth(ctx.model.config))
    floor = tolerance(torch.float32, logp) + delta ** 2 / 2
    assert abs(exact) <= floor < 1e-4 < blind


@pytest.mark.parametrize("storage", ["fp16", "int8", "mixed"])
def test_refining_keeps_storage_and_bytes_and_lowers_the_probes_kl(ctx, storage):
    patch = _patch(ctx, storage)
    probes = rs.row_probes(ctx, 5, 2)
    flags = [p.requires_grad for p in ctx.model.parameters()]
    refined, curve = rs.refine(ctx, patch, probes, 6, 3e-3, log=lambda _: None)
    assert [p.requires_grad for p in ctx.model.parameters()] == flags
    assert all(p.grad is None for p in ctx.model.parameters())
    assert refined.nbytes == patch.nbytes and refined.ranks() == patch.ranks()
    assert all(rs.storage_of(a.k) == rs.storage_of(b.k) for a, b in zip(refined.layers, patch.layers))
    with torch.no_grad():
        before = float(rs.probe_loss(ctx, kp.apply_patch(ctx.canonical[1], patch), probes))
    assert curve[0] == pytest.approx(before, rel=1e-4)
    assert curve[-1] < 0.9 * before


def test_each_question_is_read_by_the_refinement_that_did_not_see_it():
    rows = [{"method": "window", "kls": [1.0, 2.0, 3.0]},
            {"method": "refined-questions-1", "kls": [10.0, 20.0, 30.0]},
            {"method": "refined-questions-2", "kls": [100.0, 200.0, 300.0]}]
    assert rs.held_out(rows, [[0, 1], [2]], 3) == [100.0, 200.0, 30.0]
    assert rows[1]["held_out_kl"] == 30.0 and rows[2]["held_out_kl"] == 150.0
    assert rows[1]["trained_on"] == [0, 1] and "held_out_kl" not in rows[0]
    one = [{"method": "refined-questions-1", "kls": [5.0]}]
    assert rs.held_out(one, [[0]], 1) == [None] and one[0]["held_out_kl"] is None


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--lr", "0"], ["--cases", "nope"], ["--budget", "1.5"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        rs.main(argv)
    assert "error" in capsys.readouterr().err


def test_page_names_every_row_and_each_case_held_out_against_its_floor():
    row = {"kl": 2e-3, "top1": 1.0, "greedy_same": 0.5}
    rows = [{**row, "method": "window"}, {**row, "method": "refined-rows"},
            {**row, "method": "refined-questions-1", "held_out_kl": 3e-3}]
    probe = {"before": 4e-3, "loss": [4e-3, 1e-3], "seconds": 7.0}
    case = {"case": "code", "noise_floor": 1e-3, "held_out_kl": 3e-3, "rows": rows,
            "probes": {"rows": probe, "questions-1": probe}}
    data = {"command": "c", "threads": 2, "loadavg_start": [0], "loadavg_end": [0], "budget": 0.06, "steps": 2,
            "lr": 1e-3, "probe": 32, "cuts": 4, "bf16_path": {"cpu_capability": "x", "onednn_max_cpu_isa": None},
            "cases": [case]}
    page = rs.render(data)
    assert "| code | refined-questions-1 | 4.00e-03 → 1.00e-03 | 2.00e-03 | 2.00 | 3.00e-03 | 100% | 50% | 7 |" in page
    assert "| code | 1.00e-03 | 2.00 | 2.00 | 3.00 |" in page
    assert "bf16 path: oneDNN unrecorded with instruction-set cap unset, torch's CPU capability x, CPU flags unrecorded" \
        in page  # an older record: what it lacks is said, not guessed


def test_pages_name_the_cpu_path_the_floor_ran_on():
    """AMX and AVX-512 bf16 kernels round differently, so the floor moves between machines: the study
    pages and the fidelity page name the flags the run recorded."""
    from tools.bench.runs import bf16_path, describe_bf16_path
    amx = {"onednn_max_cpu_isa": "unset", "mkldnn": True, "cpu_capability": "AVX512",
           "cpu_flags": ["amx_bf16", "amx_tile", "avx512_bf16"]}
    assert describe_bf16_path(amx) == ("oneDNN on with instruction-set cap unset, torch's CPU capability AVX512, "
                                       "CPU flags amx_bf16, amx_tile, avx512_bf16")
    assert describe_bf16_path({**amx, "cpu_flags": []}).endswith("CPU flags none of the bf16 / AVX ones")
    here = bf16_path()
    assert ", ".join(here["cpu_flags"]) in describe_bf16_path(here)
