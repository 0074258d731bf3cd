"""Batched fits (`kamera_core.fit_batch`): every block's factors, gains and energy are the ones the
block's own `fit_with_gains` gives, on both of its routes (fewer tokens than features and more),
with and without a metric, in the weighted error measured directly; blocks it cannot batch (a
head no query reads, another shape) go their own way with the same result, and bad input gets
the same errors. Metric roots are reused only for the very same, unmodified tensor."""

from __future__ import annotations

import pytest
import torch

from kamera_core import fit_batch
from kamera_core.fit_batch import fit_with_gains_batch, metric_roots
from kamera_core.fit_metric import metric_sqrt
from kamera_core.patch import fit_with_gains
from tests.kamera_core.test_patch import _metric, _weighted_err

H, D = 2, 8


def _deltas(count: int, t: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, H, D, generator=g) * torch.logspace(0, -1, D) for _ in range(count)]


@pytest.mark.parametrize("tokens", [9, 16, 23])  # T < F, T = F, T > F (F = 16)
@pytest.mark.parametrize("weighted", [False, True])
def test_each_block_is_its_own_fit(tokens, weighted):
    deltas = _deltas(5, tokens, tokens)
    metrics = [_metric(H, D, 10 + i) for i in range(5)] if weighted else None
    got = fit_with_gains_batch(deltas, metrics)
    for i, (f, g, energy) in enumerate(got):
        m = None if metrics is None else metrics[i]
        f1, g1, e1 = fit_with_gains(deltas[i], m)
        assert f.rank == f1.rank == min(tokens, H * D)
        assert torch.allclose(g, g1, rtol=1e-9, atol=1e-12 * float(g1[0])) and energy == pytest.approx(e1, rel=1e-12)
        for r in (1, 3, f.rank):  # truncations: same product, error = energy − kept gains, measured directly
            approx = f.truncate(r).dense()
            assert torch.allclose(approx, f1.truncate(r).dense(), atol=1e-5 * float(deltas[i].abs().max()))
            want = energy - float(g[:r].sum())
            assert _weighted_err(deltas[i], approx, m) == pytest.approx(want, rel=1e-4, abs=1e-6 * energy)


@pytest.mark.parametrize("tokens", [9, 23])  # both routes: the T×T and the F×F Gram matrix
@pytest.mark.parametrize("weighted", [False, True])
def test_float32_precision_keeps_the_float64_fit_where_it_is_stored(tokens, weighted):
    """precision=float32 (the window's route for rounded factors): the leading components and
    their gains are the float64 fit's up to float32 rounding, each truncation's weighted error is
    still energy minus its kept gains, measured directly in float64; a lone block is batched too."""
    deltas = _deltas(4, tokens, 40 + tokens)
    metrics = [_metric(H, D, 30 + i) for i in range(4)] if weighted else None
    got = fit_with_gains_batch(deltas, metrics, precision=torch.float32)
    got += fit_with_gains_batch(deltas[:1], None if metrics is None else metrics[:1], precision=torch.float32)
    for i, (f, g, energy) in enumerate(got):
        i %= 4
        m = None if metrics is None else metrics[i]
        f1, g1, e1 = fit_with_gains(deltas[i], m)
        assert f.u.dtype == torch.float32 and g.dtype == torch.float64 and f.rank == f1.rank
        assert torch.allclose(g, g1, rtol=1e-4, atol=1e-6 * float(g1[0])) and energy == pytest.approx(e1, rel=1e-5)
        for r in (1, 3, 6):
            approx = f.truncate(r).dense()
            assert torch.allclose(approx, f1.truncate(r).dense(), atol=1e-4 * float(deltas[i].abs().max()))
            want = e1 - float(g1[:r].sum())
            assert _weighted_err(deltas[i], approx, m) == pytest.approx(want, rel=1e-3, abs=1e-5 * e1)
    with pytest.raises(ValueError, match="precision must be torch.float64 or torch.float32"):
        fit_with_gains_batch(deltas, precision=torch.float16)


def test_odd_blocks_take_their_own_route():
    deltas = _deltas(4, 11, 3) + [torch.randn(7, H, D)]  # a fifth block of another shape
    metrics = [_metric(H, D, i) for i in range(5)]
    metrics[1] = metrics[1].clone()
    metrics[1][0] = 0  # a head no query reads: metric_sqrt lends it the mean scale
    got = fit_with_gains_batch(deltas, metrics)
    for i in range(5):
        f1, g1, e1 = fit_with_gains(deltas[i], metrics[i])
        assert torch.allclose(got[i][1], g1, rtol=1e-9, atol=1e-12 * float(g1[0]))
        assert torch.allclose(got[i][0].dense(), f1.dense(), atol=1e-5)
    roots, _ = metric_roots(metrics[:4])
    assert torch.equal(roots[1], metric_sqrt(metrics[1].double(), H, D, inverse=False)[0])


def test_bad_input_is_refused_as_fit_with_gains_refuses_it():
    deltas = _deltas(3, 9, 4)
    bad = [deltas[0], deltas[1].clone(), deltas[2]]
    bad[1][0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        fit_with_gains_batch(bad)
    with pytest.raises(ValueError, match="metric must be"):
        fit_with_gains_batch(deltas, [torch.eye(5, dtype=torch.float64)] * 3)
    negative = -_metric(H, D, 1)
    with pytest.raises(ValueError, match="positive semi-definite"):
        fit_with_gains_batch(deltas, [negative] * 3)
    with pytest.raises(ValueError, match="3 metrics for 2"):
        fit_with_gains_batch(deltas[:2], [None] * 3)


def test_roots_are_reused_only_for_the_same_unmodified_tensor():
    m = _metric(H, D, 7)
    first, _ = metric_roots([m])
    again, _ = metric_roots([m])
    assert again.data_ptr() == first.data_ptr() or torch.equal(again, first)
    m.mul_(4)  # modified in place: its version moves on, the root is taken afresh
    scaled, _ = metric_roots([m])
    assert torch.allclose(scaled, 2 * first, rtol=1e-9)
    copy = m.clone()
    assert torch.equal(metric_roots([copy])[0], scaled)  # another tensor, same values, same root
    _, inv = metric_roots([copy], inverse=True)  # a kept root without its inverse is completed
    assert torch.allclose(inv[0] @ scaled[0], torch.eye(D, dtype=torch.float64).expand(H, D, D), atol=1e-9)


def test_kept_roots_stay_within_their_bytes(monkeypatch):
    one = H * D * D * 8  # one root's float64 bytes
    monkeypatch.setattr(fit_batch, "_ROOTS", type(fit_batch._ROOTS)())
    monkeypatch.setattr(fit_batch, "_ROOTS_BYTES", 3 * one)
    metrics = [_metric(H, D, 20 + i) for i in range(5)]
    for m in metrics:
        metric_roots([m])
    kept = [held[0]() for held in fit_batch._ROOTS.values()]
    assert len(kept) == 3 and all(k is m for k, m in zip(kept, metrics[2:]))  # the least recently used went first
    metric_roots([metrics[2]])  # used again: now the most recent
    metric_roots([metrics[0]])
    kept = [held[0]() for held in fit_batch._ROOTS.values()]
    assert [id(k) for k in kept] == [id(metrics[i]) for i in (4, 2, 0)]
