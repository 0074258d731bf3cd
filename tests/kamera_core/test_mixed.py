"""Mixed-precision patch factors (storage "mixed"): 4-bit packing is lossless for its codes, the
stored bytes are the ones counted, each component's quantisation error is what storing it adds in
the fit's metric, and the allocator spends a byte budget on 4-bit components or on int8 upgrades by
gain per byte without ever exceeding it."""

from __future__ import annotations

import pytest
import torch

from kamera_core import quant
from kamera_core.budget import budget_mixed, bytes_per_rank, mixed_bytes
from kamera_core.segment.cpu import segment_attention_cpu
from kamera_core.mixed import mixed_patch, quantisation_errors
from kamera_core.patch import ChunkPatch, Factors, LayerPatch, build_patch, fit_with_gains, quantize
from kamera_core.rope import RopeSpec
from kamera_core.segment import Segment, segment_attention_reference
from tests.kamera_core.test_patch import _metric, _weighted_err

T, H, D = 37, 2, 16


def _delta(seed: int, t: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    spectrum = torch.logspace(0, -2, min(t, H * D), dtype=torch.float64)
    u = torch.linalg.qr(torch.randn(t, len(spectrum), generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(H * D, len(spectrum), generator=g, dtype=torch.float64))[0]
    return ((u * spectrum) @ v.T).float().reshape(t, H, D)


@pytest.mark.parametrize("count", [1, 2, 5, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack4_round_trips_every_code(count, dim):
    g = torch.Generator().manual_seed(count)
    shape = (count, 6) if dim == 0 else (6, count)
    codes = torch.randint(-7, 8, shape, generator=g).to(torch.int8)
    packed = quant.pack4(codes, dim)
    assert packed.dtype == torch.uint8 and packed.shape[dim] == (count + 1) // 2
    assert torch.equal(quant.unpack4(packed, count, dim), codes)
    with pytest.raises(ValueError, match="codes in"):
        quant.pack4(torch.full((2, 2), 8, dtype=torch.int8), 0)


@pytest.mark.parametrize("head", [0, 1, 3, 9])
def test_mixed_factors_hold_what_they_count_and_stay_within_half_a_step(head):
    f, _, _ = fit_with_gains(_delta(1))
    f = f.truncate(9)
    q = quantize(f, "mixed", head)
    assert (q.rank, q.int4_rank) == (9, 9 - head)
    assert q.nbytes == mixed_bytes(T, H * D, 9, head)
    held = sum(t.numel() * t.element_size() for t in (q.u, q.vt, q.u_scale, q.vt_scale, q.u4, q.vt4) if t is not None)
    assert q.nbytes == held
    u, vt = f.factors()
    qu, qvt = q.factors()
    for j in range(9):  # each component within half a quantisation step of its own scale
        levels = 127 if j < head else 7
        assert float((qu[:, j] - u[:, j]).abs().max()) <= u[:, j].abs().max() / levels / 2 * (1 + 1e-5)
        assert float((qvt[j] - vt[j]).abs().max()) <= vt[j].abs().max() / levels / 2 * (1 + 1e-5)
    for r in (0, min(head, 4), 7, 9):  # truncation keeps the first r components, codes unchanged
        cut = q.truncate(r)
        assert cut.rank == r and cut.nbytes == mixed_bytes(T, H * D, r, min(r, head))
        assert torch.equal(cut.dense(), quantize(f.truncate(r), "mixed", head).dense())
    rows, full = q.first_rows(5).factors(), q.factors()
    assert torch.equal(rows[0], full[0][:5]) and torch.equal(rows[1], full[1])
    assert quantize(f, "mixed").int4_rank == 0 and quantize(f, "mixed").nbytes == quantize(f, "int8").nbytes


def test_mixed_bytes_count_packed_pairs():
    per8 = bytes_per_rank(T, 32, "int8")
    assert mixed_bytes(T, 32, 4, 4) == 4 * per8
    assert mixed_bytes(T, 32, 2, 0) == (T + 32) + 16  # one packed pair, two pairs of scales
    assert mixed_bytes(T, 32, 3, 0) == 2 * (T + 32) + 24  # an odd component takes a whole pair
    assert mixed_bytes(T, 32, 1, 0) + (T + 32) == per8 + (T + 32)
    with pytest.raises(ValueError, match="exceeds rank"):
        mixed_bytes(T, 32, 1, 2)
    with pytest.raises(ValueError, match="budget_mixed"):
        bytes_per_rank(T, 32, "mixed")


@pytest.mark.parametrize("use_metric", [False, True])
def test_quantisation_errors_are_each_components_weighted_error(use_metric):
    metric = _metric(H, D, 5) if use_metric else None
    f, g, _ = fit_with_gains(_delta(2), metric)
    errors = quantisation_errors(f, metric)
    u, vt = f.factors(torch.float64)
    for bits in (8, 4):
        qu = quant.dequantise(*quant.quantise(u.float(), bits, 1), 1, torch.float64)
        qvt = quant.dequantise(*quant.quantise(vt.float(), bits, 0), 0, torch.float64)
        for j in (0, 3, 11):
            exact = torch.outer(u[:, j], vt[j].flatten()).reshape(T, H, D)
            stored = torch.outer(qu[:, j], qvt[j].flatten()).reshape(T, H, D)
            assert float(errors[bits][j]) == pytest.approx(_weighted_err(exact, stored, metric), rel=1e-4)
    assert bool((errors[4][:12] > 10 * errors[8][:12]).all())  # 4 bits cost far more than 8
    assert bool((errors[4][:12] < 0.2 * g[:12]).all())  # and far less than the component's own gain


def test_budget_mixed_upgrades_a_dominant_component_before_buying_small_ones():
    g = torch.tensor([100.0, 1.0, 0.5, 0.25, 0.1], dtype=torch.float64)
    e4, e8 = 0.04 * g, torch.zeros_like(g)
    # Room for four 4-bit components (two packed columns). The 4-bit error of the first (4.0)
    # outweighs the gain of any other component (≤ 1): it goes to int8 (free while it is the odd
    # one out of a packed pair), and only two more fit. Without a dominant component all four
    # are kept in 4 bits.
    budget = mixed_bytes(T, 16, 4, 0)
    [(k, v)] = budget_mixed(T, [(16, 16)], budget, [((g, 1.0), (g * 1e-3, 1.0))], [((e8, e4), (e8, e4 * 1e-3))])
    assert k == (3, 1) and v == (0, 0)
    flat = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6], dtype=torch.float64)
    [(k, v)] = budget_mixed(T, [(16, 16)], budget, [((flat, 1.0), (flat * 1e-3, 1.0))],
                            [((e8, 0.04 * flat), (e8, e4 * 1e-3))])
    assert k == (4, 0) and v == (0, 0)
    # With int8 no better than 4 bits nothing is upgraded; the bytes are never exceeded.
    for b in range(0, 600, 7):
        [(k, v)] = budget_mixed(T, [(16, 16)], b, [((g, 1.0), (g / 3, 2.0))], [((e4, e4), (e4, e4))])
        assert k[1] == v[1] == 0
        left = b - mixed_bytes(T, 16, *k) - mixed_bytes(T, 16, *v)
        assert left >= 0
        for r, h in (k, v):  # nothing more fits: every block is full or its next component is dearer
            assert r == len(g) or mixed_bytes(T, 16, r + 1, h) - mixed_bytes(T, 16, r, h) > left
    with pytest.raises(ValueError, match="errors cover"):
        budget_mixed(T, [(16, 16)], 100, [((g, 1.0), (g, 1.0))], [((e8[:2], e4[:2]), (e8, e4))])


def test_mixed_patch_beats_int8_at_the_same_bytes_on_a_flat_spectrum():
    """A slowly decaying deficit: twice the components in 4 bits capture more than int8 ones at
    the same byte budget, and the allocator's patch is never over it."""
    g = torch.Generator().manual_seed(4)
    delta = (torch.randn(T, H * D, generator=g) @ torch.diag(torch.logspace(0, -0.5, H * D))).reshape(T, H, D)
    f, gains, energy = fit_with_gains(delta)
    for budget in (mixed_bytes(T, H * D, 6, 0), mixed_bytes(T, H * D, 12, 2)):
        patch = mixed_patch([(f, f)], [((gains, energy), (gains, energy))], [(None, None)], budget, "alloc")
        assert patch.nbytes <= budget
        rank8 = budget // (2 * bytes_per_rank(T, H * D, "int8"))
        int8_err = _weighted_err(delta, quantize(f.truncate(rank8), "int8").dense())
        assert _weighted_err(delta, patch.layers[0].k.dense()) < int8_err


def test_segment_attention_reads_mixed_factors_as_their_dequantised_values():
    g = torch.Generator().manual_seed(6)
    spec = RopeSpec(inv_freq=tuple(10000.0 ** (-i / (D // 2)) for i in range(D // 2)), head_dim=D, pairing="half")
    k, v = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    q = torch.randn(3, 2 * H, D, generator=g)
    fk = quantize(fit_with_gains(_delta(7))[0].truncate(6), "mixed", 2)
    fv = quantize(fit_with_gains(_delta(8))[0].truncate(5), "mixed", 0)
    plain = LayerPatch(Factors(*fk.factors()), Factors(*fv.factors()))
    idx = torch.arange(T, T + 3)
    got = segment_attention_cpu(q, idx, [Segment(k, v, first=0, shift=0, patch=LayerPatch(fk, fv))], spec, D ** -0.5)
    want = segment_attention_reference(q, idx, [Segment(k, v, first=0, shift=0, patch=plain)], spec, D ** -0.5)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert ChunkPatch((LayerPatch(fk, fv),), "alloc").ranks() == [(6, 5)]


def test_mixed_factors_refuse_inconsistent_parts():
    q = quantize(fit_with_gains(_delta(3))[0].truncate(5), "mixed", 2)
    with pytest.raises(ValueError, match="come together"):
        Factors(q.u, q.vt, q.u_scale, q.vt_scale, q.u4, None)
    with pytest.raises(ValueError, match="u4 must be"):
        Factors(q.u, q.vt, q.u_scale, q.vt_scale, q.u4[:, :1].contiguous(), q.vt4)
    with pytest.raises(ValueError, match="uint8"):
        Factors(q.u, q.vt, q.u_scale, q.vt_scale, q.u4.to(torch.int8), q.vt4)
    with pytest.raises(ValueError, match="only for int8"):
        Factors(*q.factors(), None, None, q.u4, q.vt4)
    with pytest.raises(ValueError, match="int8_ranks"):
        build_patch([(_delta(1), _delta(2))], [(2, 2)], "svd", storage="mixed")


def test_quantise_mixed_and_unpack4_values_match_their_two_step_forms():
    g = torch.Generator().manual_seed(9)
    for dim, shape in ((1, (11, 7)), (0, (7, 3, 5))):
        x = torch.randn(shape, generator=g)
        x.select(dim, 2).zero_()  # an all-zero component: scale 0, codes 0
        for head in (0, 3, 7):
            codes, scale = quant.quantise_mixed(x, head, dim)
            c8, s8 = quant.quantise(x.narrow(dim, 0, head), 8, dim)
            c4, s4 = quant.quantise(x.narrow(dim, head, 7 - head), 4, dim)
            assert torch.equal(codes, torch.cat([c8, c4], dim)) and torch.equal(scale, torch.cat([s8, s4]))
            if head < 7:
                packed = quant.pack4(c4, dim)
                want = quant.unpack4(packed, 7 - head, dim).float()
                assert torch.equal(quant.unpack4_values(packed, 7 - head, dim, torch.float32), want)


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.3])
def test_mixed_patch_computes_errors_lazily_and_plans_as_with_all_of_them(fraction, monkeypatch):
    """The plan from errors computed only as far as the allocator reaches is the plan from every
    component's errors, with one block (a K scaled up, all blocks in one unit) taking more
    components than the first look gives it."""
    import kamera_core.mixed as mixed

    t, layers = 40, 3
    deltas = [(_delta(20 + i, t) * (30 if i == 0 else 1), _delta(40 + i, t)) for i in range(layers)]  # one K dominates
    metrics = [(_metric(H, D, 60 + i), None) for i in range(layers)]
    fits = [(fit_with_gains(dk, mk), fit_with_gains(dv)) for (dk, dv), (mk, _) in zip(deltas, metrics)]
    full = [(fk[0], fv[0]) for fk, fv in fits]
    gains = [((fk[1], 1.0), (fv[1], 1.0)) for fk, fv in fits]  # one unit for all, as the output fits have
    errors = [tuple((lambda e: (e[8], e[4]))(quantisation_errors(f, m)) for f, m in zip(pair, ms))
              for pair, ms in zip(full, metrics)]
    budget = int(fraction * layers * 2 * t * H * D * 4)
    plan = budget_mixed(t, [(H * D, H * D)] * layers, budget, gains, errors)
    seen = []
    monkeypatch.setattr(mixed, "FIRST_COMPONENTS", 4)
    real = mixed._errors_batch
    monkeypatch.setattr(mixed, "_errors_batch", lambda *a, **k: seen.append((a[2], a[3])) or real(*a, **k))
    patch = mixed_patch(full, gains, metrics, budget, "alloc")
    got = [tuple((lp_f.rank - lp_f.int4_rank, lp_f.rank) if lp_f is not None else (0, 0) for lp_f in (lp.k, lp.v))
           for lp in patch.layers]
    assert got == [((hk, rk), (hv, rv)) for (rk, hk), (rv, hv) in plan]
    assert patch.nbytes <= budget
    if fraction < 0.3:  # the dominant block outgrew the first look, and no block needed every component
        assert any(first > 0 for first, _ in seen) and max(stop for _, stop in seen) < H * D
    else:  # the first look (twice the average 4-bit components) already covers every component
        assert seen == [(0, H * D)] * 2
