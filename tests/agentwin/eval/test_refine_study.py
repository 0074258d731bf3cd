"""The refinement study's pieces against the model's own forward: the probes' targets are the
model's single forward, refining keeps the patch's storage and bytes and lowers its probes' KL,
and bad arguments are refused before any model loads."""

from __future__ import annotations

import pytest
import torch

from agentwin.eval import baselines as bl, contexts as cx, refine_study as rs
from agentwin.models.zoo import build_tiny
from kamera_core import patch as kp


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
    assert exact < 1e-9 < 1e-4 < blind


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


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--lr", "0"], ["--cases", "nope"], ["--budget", "1.5"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        rs.main(argv)
    assert "error" in capsys.readouterr().err
