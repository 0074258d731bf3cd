"""Conditioning patches on synthetic tensors: the fitted objective is the stated one, gains are
exact error drops, byte counts are exact, int8 stays within half a step, allocation is optimal."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kamera_core.budget import allocate_ranks, bytes_per_rank
from kamera_core.patch import (
    ChunkPatch,
    Factors,
    LayerPatch,
    apply_patch,
    build_patch,
    deficit,
    fit,
    gains,
    orbit_deficit,
    quantize,
)
from kamera_core.fit_metric import attention_mass, query_second_moment
import kamera_core.patch as kp
from kamera_core.relocate import relocate_keys
from kamera_core.rope import RopeSpec

T, H, D, R = 40, 3, 16, 24  # tokens, kv heads, head_dim, MLA latent width


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _metric(heads: int, dim: int, seed: int) -> torch.Tensor:
    """A full-rank but strongly anisotropic per-head second moment, as queries give."""
    g = _gen(seed)
    q = torch.randn(200, heads, dim, generator=g, dtype=torch.float64)
    q = q * torch.logspace(1, -2, dim, dtype=torch.float64)  # a few dominant query directions
    return query_second_moment(q, heads)


def _weights(t: int, seed: int) -> torch.Tensor:
    return torch.rand(t, generator=_gen(seed), dtype=torch.float64) * 0.95 + 0.05


def _weighted_err(delta, approx, metric=None, row_weights=None) -> float:
    """|| diag(√w) (Δ − Δ̂) M^½ ||²_F computed directly: Σ_t w_t Σ_h e_thᵀ Σ_h e_th."""
    e = (delta.double() - approx.double()).reshape(delta.shape[0], -1)  # (T, F)
    w = torch.ones(delta.shape[0], dtype=torch.float64) if row_weights is None else row_weights.double()
    if metric is None:
        return float((w[:, None] * e.square()).sum())
    m = metric if metric.dim() == 3 else metric[None]
    e = e.reshape(e.shape[0], m.shape[0], m.shape[1])  # (T, H, D)
    return float(torch.einsum("t,thd,hde,the->", w, e, m.double(), e))


CASES = {
    "mha": (T, H, D),
    "mla": (T, R),
    "wide": (10, H, D),  # fewer tokens than features (as is "mha": 40 < 48): the T×T route
    "tall": (60, H, D),  # more tokens than features: the F×F route with per-head metric blocks
}


def _case(name: str, seed: int = 0):
    shape = CASES[name]
    delta = torch.randn(*shape, generator=_gen(seed))
    metric = _metric(H, D, seed + 1) if len(shape) == 3 else _metric(1, R, seed + 1)
    return delta, metric, _weights(shape[0], seed + 2)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("method", ["plain", "query", "rows", "query+rows"])
def test_full_rank_reproduces_delta(name, method):
    delta, metric, w = _case(name)
    m = metric if "query" in method else None
    rw = w if "rows" in method else None
    f = fit(delta, 10_000, m, rw)
    full = min(delta.shape[0], delta[0].numel())
    assert f.rank == full and f.u.dtype == torch.float32 and tuple(f.vt.shape[1:]) == tuple(delta.shape[1:])
    err = (f.dense() - delta).abs().max() / delta.abs().max()
    assert err < 2e-5, f"{name}/{method}: relative error {err:.2e}"


@pytest.mark.parametrize("name", ["mha", "mla"])
@pytest.mark.parametrize("use_metric", [False, True])
def test_planted_low_rank_is_recovered(name, use_metric):
    delta, metric, _ = _case(name)
    t, feat = delta.shape[0], delta[0].numel()
    g = _gen(7)
    planted = (torch.randn(t, 4, generator=g) @ torch.randn(4, feat, generator=g)).reshape(delta.shape)
    noisy = planted + 1e-4 * torch.randn(delta.shape, generator=g)
    f = fit(noisy, 4, metric if use_metric else None)
    assert f.rank == 4
    assert (f.dense() - planted).abs().max() < 1e-3 * planted.abs().max()


@pytest.mark.parametrize("name", ["mha", "mla"])
@pytest.mark.parametrize("rank", [1, 3, 8])
def test_metric_fit_minimises_its_own_objective(name, rank):
    delta, metric, w = _case(name, seed=3)
    plain = fit(delta, rank).dense()
    query = fit(delta, rank, metric).dense()
    rows = fit(delta, rank, row_weights=w).dense()
    both = fit(delta, rank, metric, w).dense()
    assert _weighted_err(delta, query, metric) < _weighted_err(delta, plain, metric)
    assert _weighted_err(delta, plain) < _weighted_err(delta, query)
    assert _weighted_err(delta, rows, row_weights=w) < _weighted_err(delta, plain, row_weights=w)
    assert _weighted_err(delta, both, metric, w) < min(
        _weighted_err(delta, d, metric, w) for d in (plain, query, rows)
    )


@pytest.mark.parametrize("name", ["mha", "mla", "wide"])
@pytest.mark.parametrize("weighted", [False, True])
def test_gains_are_exact_error_drops(name, weighted):
    delta, metric, w = _case(name, seed=5)
    m, rw = (metric, w) if weighted else (None, None)
    g, total = gains(delta, m, rw)
    assert g.dtype == torch.float64 and g.shape == (min(delta.shape[0], delta[0].numel()),)
    assert bool((g[1:] <= g[:-1]).all())
    assert abs(float(g.sum()) - total) < 1e-9 * total
    assert abs(total - _weighted_err(delta, torch.zeros_like(delta), m, rw)) < 1e-5 * total
    for rank in (1, 2, 5, 9):
        direct = _weighted_err(delta, fit(delta, rank, m, rw).dense(), m, rw)
        predicted = total - float(g[:rank].sum())
        assert abs(direct - predicted) < 1e-5 * total, (rank, direct, predicted)


def test_truncate_agrees_with_dense_and_refit():
    delta, metric, w = _case("mha", seed=9)
    for m, rw in ((None, None), (metric, None), (metric, w)):
        full = fit(delta, 20, m, rw)
        for r in (0, 1, 6):
            cut = full.truncate(r)
            assert cut.rank == r
            expected = full.u[:, :r] @ full.vt[:r].reshape(r, H * D)  # (T, H*D)
            torch.testing.assert_close(cut.dense(), expected.reshape(delta.shape))
            torch.testing.assert_close(cut.dense(), fit(delta, r, m, rw).dense(), atol=1e-4, rtol=0)
    assert fit(delta, 0).dense().abs().max() == 0
    with pytest.raises(ValueError, match="truncate rank"):
        full.truncate(21)


def _stored_bytes(f: Factors) -> int:
    return sum(t.numel() * t.element_size() for t in (f.u, f.vt, f.u_scale, f.vt_scale) if t is not None)


@pytest.mark.parametrize("storage", ["fp32", "fp16", "bf16", "int8"])
def test_bytes_are_exact(storage):
    delta, _, _ = _case("mha")
    feat = H * D
    f = quantize(fit(delta, 7), storage)
    assert f.nbytes == _stored_bytes(f) == 7 * bytes_per_rank(T, feat, storage)
    assert quantize(fit(delta, 8), storage).nbytes - f.nbytes == bytes_per_rank(T, feat, storage)
    assert bytes_per_rank(T, feat, storage) == (T + feat) * {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}[storage] + (
        8 if storage == "int8" else 0
    )
    lp = LayerPatch(f, None)
    cp = ChunkPatch((lp, LayerPatch(None, None), LayerPatch(f, f)), "svd")
    assert lp.nbytes == f.nbytes and cp.nbytes == 3 * f.nbytes
    assert cp.ranks() == [(7, 0), (0, 0), (7, 7)]


def test_int8_round_trip_within_half_a_step():
    delta, metric, _ = _case("mha", seed=11)
    f = fit(delta, 12, metric)
    q = quantize(f, "int8")
    assert q.u.dtype == q.vt.dtype == torch.int8 and q.u_scale.dtype == torch.float32
    u, vt = q.factors()
    # Half a quantisation step, plus float32 rounding of the division and of the product.
    assert bool(((u - f.u).abs() <= q.u_scale * (0.5 + 1e-5) + 1e-7).all())
    vt_err = (vt - f.vt).abs().reshape(12, -1)  # (m, H*D)
    assert bool((vt_err <= q.vt_scale[:, None] * (0.5 + 1e-5) + 1e-7).all())
    assert (q.dense() - f.dense()).abs().max() < 0.05 * f.dense().abs().max()
    zero = quantize(Factors(torch.zeros(T, 2), torch.zeros(2, H, D)), "int8")
    assert zero.dense().abs().max() == 0 and bool(torch.isfinite(zero.u_scale).all())
    again = quantize(q, "fp32")
    torch.testing.assert_close(again.dense(), q.dense())
    with pytest.raises(ValueError, match="int8"):
        quantize(f, "int4")


def test_allocation_follows_normalised_gain_and_budget():
    big = torch.tensor([9.0, 4.0, 1.0])
    small = torch.tensor([9.0, 4.0, 1.0])
    # Same raw gains, but "a" is measured against a 10× smaller energy: its relative gains win.
    cands = {"a": (big, 1.0, 100), "b": (small, 10.0, 100)}
    assert allocate_ranks(cands, 200) == {"a": 2, "b": 0}
    assert allocate_ranks(cands, 299) == {"a": 2, "b": 0}
    assert allocate_ranks(cands, 10_000) == {"a": 3, "b": 3}
    assert allocate_ranks(cands, 10_000, max_rank={"a": 1}) == {"a": 1, "b": 3}
    assert allocate_ranks(cands, 0) == {"a": 0, "b": 0}
    # Ties go to the first key; a candidate too expensive for the rest is skipped, not blocking.
    tie = {"x": (torch.tensor([1.0]), 1.0, 10), "y": (torch.tensor([1.0]), 1.0, 10)}
    assert allocate_ranks(tie, 10) == {"x": 1, "y": 0}
    mixed = {"dear": (torch.tensor([100.0]), 1.0, 90), "cheap": (torch.tensor([1.0, 1.0]), 1.0, 10)}
    assert allocate_ranks(mixed, 95) == {"dear": 1, "cheap": 0}
    assert allocate_ranks(mixed, 50) == {"dear": 0, "cheap": 2}
    with pytest.raises(ValueError, match="non-increasing"):
        allocate_ranks({"z": (torch.tensor([1.0, 2.0]), 1.0, 1)}, 10)


def test_allocation_equals_brute_force_on_tiny_instance():
    g = _gen(13)
    cands = {}
    for key in [(0, "k"), (0, "v"), (1, "k"), (1, "v")]:
        gain = torch.rand(4, generator=g, dtype=torch.float64).sort(descending=True).values
        cands[key] = (gain, float(torch.rand(1, generator=g)) + 0.1, 24)
    keys = list(cands)

    def value(ranks) -> float:
        return sum(float(cands[k][0][:r].sum()) / cands[k][1] for k, r in zip(keys, ranks))

    for budget in (0, 24, 71, 24 * 5, 24 * 9 + 3, 24 * 16):
        got = allocate_ranks(cands, budget)
        assert sum(got[k] * 24 for k in keys) <= budget
        best = max(
            (value(rs), rs) for rs in itertools.product(range(5), repeat=4) if sum(rs) * 24 <= budget
        )
        assert abs(value([got[k] for k in keys]) - best[0]) < 1e-12, (budget, got, best)


def test_query_second_moment_groups_like_repeat_kv():
    tq, hq, hkv = 5, 6, 2
    q = torch.randn(tq, hq, D, generator=_gen(17))
    sigma = query_second_moment(q, hkv)
    assert sigma.shape == (hkv, D, D) and sigma.dtype == torch.float64
    # repeat_kv: kv head j serves query heads j·n_rep … j·n_rep + n_rep − 1.
    n_rep = hq // hkv
    for j in range(hkv):
        rows = q[:, j * n_rep : (j + 1) * n_rep].double().reshape(-1, D)  # (Tq*n_rep, D)
        torch.testing.assert_close(sigma[j], rows.T @ rows / rows.shape[0])
    with pytest.raises(ValueError, match="divide"):
        query_second_moment(q, 4)


def test_attention_mass():
    w = torch.softmax(torch.randn(4, 7, 9, generator=_gen(19)), dim=-1)
    mass = attention_mass(w)
    assert mass.shape == (9,) and mass.dtype == torch.float64
    torch.testing.assert_close(mass, w.double().sum(dim=(0, 1)) / 28)
    assert abs(float(mass.sum()) - 1) < 1e-6  # float32 softmax rows


def test_singular_metric_is_ridged():
    """Queries spanning 2 of 16 directions, and a head no query reads: the ridge keeps W invertible,
    so full rank is still exact and low rank still beats plain SVD in the (unridged) metric."""
    delta, _, _ = _case("mha", seed=25)
    q = torch.randn(30, H, 2, generator=_gen(26)) @ torch.randn(2, D, generator=_gen(27))  # (Tq, H, D) rank 2
    q[:, 2] = 0
    metric = query_second_moment(q, H)
    full = fit(delta, 10_000, metric)
    assert (full.dense() - delta).abs().max() < 1e-4 * delta.abs().max()
    low = fit(delta, 4, metric).dense()
    assert _weighted_err(delta, low, metric) < _weighted_err(delta, fit(delta, 4).dense(), metric)
    g, total = gains(delta, metric)
    assert abs(float(g.sum()) - total) < 1e-9 * total


def test_zero_row_weights_are_floored_not_fatal():
    delta, _, w = _case("mha", seed=21)
    w = w.clone()
    w[:5] = 0
    w[5] = -1
    f = fit(delta, 10_000, row_weights=w)
    assert bool(torch.isfinite(f.u).all())
    assert (f.dense() - delta).abs().max() < 1e-3 * delta.abs().max()
    with pytest.raises(ValueError, match="positive weight"):
        fit(delta, 2, row_weights=torch.zeros(T))


def _kv(layers: int, seed: int, dtype=torch.float32):
    g = _gen(seed)
    return [(torch.randn(T, H, D, generator=g).to(dtype), torch.randn(T, H, D, generator=g).to(dtype)) for _ in range(layers)]


def test_build_and_apply_patch_round_trip_and_fused_relocation():
    canonical = _kv(3, 23)
    conditioned = [(k + 0.1 * torch.randn_like(k), v + 0.1 * torch.randn_like(v)) for k, v in canonical]
    deltas = deficit(conditioned, canonical)
    assert all(dk.dtype == torch.float32 and dk.shape == (T, H, D) for dk, _ in deltas)
    full = [(10_000, 10_000)] * 3
    metrics = [(_metric(H, D, i), None) for i in range(3)]
    masses = [(None, _weights(T, i)) for i in range(3)]
    patch = build_patch(deltas, full, "query+value", metrics, masses, storage="fp32")
    for (k, v), (ck, cv) in zip(apply_patch(canonical, patch), conditioned):
        torch.testing.assert_close(k, ck, atol=2e-5, rtol=0)
        torch.testing.assert_close(v, cv, atol=2e-5, rtol=0)
    partial = build_patch(deltas, [(0, 2), (3, 0), (0, 0)], "svd")
    assert partial.ranks() == [(0, 2), (3, 0), (0, 0)] and partial.layers[0].v.u.dtype == torch.float16
    patched = apply_patch(canonical, partial)
    assert patched[2][0] is canonical[2][0] and patched[0][1].dtype == torch.float32
    bf = apply_patch(_kv(3, 23, torch.bfloat16), partial)
    assert bf[1][0].dtype == torch.bfloat16
    # The fused relocate of (canonical K, patch factors) equals relocating the patched keys.
    spec = RopeSpec(inv_freq=tuple(10000.0 ** (-i / (D // 2)) for i in range(D // 2)), head_dim=D)
    k_patch = partial.layers[1].k
    fused = relocate_keys(canonical[1][0], spec, 777, patch=k_patch.factors(), backend="torch")
    torch.testing.assert_close(fused, relocate_keys(patched[1][0], spec, 777, backend="torch"), atol=1e-5, rtol=0)


def test_orbit_deficit_and_shape_errors():
    orders = [deficit(_kv(2, s), _kv(2, 99)) for s in (1, 2)]
    orders.append([(torch.zeros(T, H, D), torch.zeros(T, H, D))] * 2)  # the chunk came first
    mean = orbit_deficit(orders)
    torch.testing.assert_close(mean[1][0], (orders[0][1][0] + orders[1][1][0]) / 3)
    with pytest.raises(ValueError, match="shape"):
        orbit_deficit([orders[0], [(torch.zeros(T, H, D), torch.zeros(T - 1, H, D))] * 2])
    with pytest.raises(ValueError, match="layers"):
        orbit_deficit([orders[0], orders[1][:1]])
    with pytest.raises(ValueError, match="at least one"):
        orbit_deficit([])
    with pytest.raises(ValueError, match="canonical"):
        deficit(_kv(1, 1), [(torch.zeros(T, H, D), torch.zeros(T, H, D + 1))])
    with pytest.raises(ValueError, match="layers"):
        deficit(_kv(2, 1), _kv(1, 1))


def test_bad_inputs_name_the_value():
    delta, metric, _ = _case("mha")
    with pytest.raises(ValueError, match="metric must be"):
        fit(delta, 2, metric[:, :4, :4])
    with pytest.raises(ValueError, match="positive semi-definite"):
        fit(delta, 2, -metric)
    with pytest.raises(ValueError, match="row_weights must be"):
        fit(delta, 2, row_weights=torch.ones(T + 1))
    with pytest.raises(ValueError, match="rank must be >= 0"):
        fit(delta, -1)
    with pytest.raises(TypeError, match="rank must be an int"):
        fit(delta, 2.5)
    with pytest.raises(ValueError, match="storage must be one of"):
        bytes_per_rank(T, 48, "fp8")
    with pytest.raises(ValueError, match="scales are only for int8"):
        Factors(torch.zeros(T, 1), torch.zeros(1, 4), torch.ones(1), torch.ones(1))
    with pytest.raises(ValueError, match=r"vt \[m, \*F\]"):
        Factors(torch.zeros(T, 2), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="overflow fp16"):
        quantize(Factors(torch.full((T, 1), 1e6), torch.ones(1, 4)), "fp16")
    with pytest.raises(ValueError, match="ranks has"):
        build_patch(deficit(_kv(2, 1), _kv(2, 2)), [(1, 1)], "svd")


@pytest.mark.parametrize("shape", [(5, 3, 8), (40, 2, 4), (7, 16)])
def test_identity_factors_reproduce_the_deficit_bit_for_bit(shape):
    g = torch.Generator().manual_seed(1)
    delta = torch.randn(shape, generator=g) * 1e-3
    canonical = torch.randn(shape, generator=g)
    f = kp.identity_factors(delta)
    assert f.rank == min(shape[0], math.prod(shape[1:]))
    patched = kp.apply_patch([(canonical, canonical)], kp.exact_patch([(delta, delta)]))[0][0]
    assert torch.equal(patched, canonical + delta)
    with pytest.raises(ValueError, match="tokens and features"):
        kp.identity_factors(torch.zeros(0, 4))


@pytest.mark.parametrize("method", ["plain", "query", "rows", "query+rows"])
def test_short_chunk_fit_matches_the_full_decomposition(method):
    # Fewer tokens than features: a truncated fit takes the T×T route; its product must be the
    # full decomposition's truncated to the same rank.
    delta, metric, w = _case("wide", seed=11)
    m = metric if "query" in method else None
    rw = w if "rows" in method else None
    full = kp.fit_with_gains(delta, m, rw)[0]
    for rank in (1, 4, 9):
        got, ref = fit(delta, rank, m, rw), full.truncate(rank)
        assert got.rank == rank
        assert (got.dense() - ref.dense()).abs().max() < 1e-5 * delta.abs().max(), (method, rank)


def test_output_metric_weighs_key_errors_by_what_they_do_to_the_attention_output():
    """Where a head's values are all equal, no key error can move its attention output (the
    weights still sum to one): the metric is zero there. Elsewhere it is the queries' second
    moment scaled by the values' spread over D, so a head whose values spread twice as far
    weighs its key errors twice as much."""
    from kamera_core.fit_metric import output_metric

    gen = torch.Generator().manual_seed(3)
    t, heads, dim = 12, 3, 8
    q = torch.randn(20, heads, dim, generator=gen)
    values = torch.randn(t, heads, 5, generator=gen)
    values[:, 1] = torch.randn(5, generator=gen)  # head 1: one value for every token
    values[:, 2] = 2 * values[:, 0]  # head 2: head 0's values, spread 4x (squared)
    sigma = query_second_moment(q, heads)
    m = output_metric(sigma, values)
    assert m.shape == sigma.shape and m.dtype == torch.float64
    assert float(m[1].abs().max()) == 0.0
    spread0 = float((values[:, 0] - values[:, 0].mean(0)).square().sum(-1).mean())
    assert torch.allclose(m[0], sigma[0] * spread0 / dim)
    assert torch.allclose(m[2], sigma[2] * 4 * spread0 / dim)
    # A key error in the zero-metric head changes that head's attention output by nothing.
    k = torch.randn(t, dim, generator=gen)
    dk = torch.randn(t, dim, generator=gen)
    out = lambda keys: torch.softmax(q[:, 1] @ keys.T / dim ** 0.5, -1) @ values[:, 1]  # noqa: E731
    assert torch.allclose(out(k), out(k + dk), atol=1e-6)
    with pytest.raises(ValueError, match="values must be"):
        output_metric(sigma, values[:, :2])
    with pytest.raises(ValueError, match="query_metric must be"):
        output_metric(sigma[0], values)


def test_layer_normaliser_by_exponent():
    """Exponent 1: T times the values' summed spread (the layer's output scale); 0: no
    normalisation (absolute errors); 0.5: the root; out-of-range exponents are refused."""
    from kamera_core.fit_metric import OUTPUT_FITS, layer_normaliser

    values = torch.randn(7, 2, 4, generator=_gen(3), dtype=torch.float64)
    scale = 7 * float((values - values.mean(0)).square().sum(-1).mean(0).sum())
    assert layer_normaliser(values, 1.0) == pytest.approx(scale, rel=1e-12)
    assert layer_normaliser(values, 0.5) == pytest.approx(scale ** 0.5, rel=1e-12)
    assert layer_normaliser(values, 0) == 1.0 and layer_normaliser(3 * values, 0) == 1.0
    assert layer_normaliser(3 * values, 1) == pytest.approx(9 * scale, rel=1e-12)
    assert OUTPUT_FITS == {"output": 1.0, "output-half": 0.5, "output-abs": 0.0}
    for bad in (-0.5, 2, True, "1"):
        with pytest.raises(ValueError, match="exponent must be"):
            layer_normaliser(values, bad)


def test_projection_metric_is_the_residual_energy_of_a_value_error():
    """Δvᵀ·M_h·Δv equals ||W·a||² for the attention output a (flattened head-major) in which every
    query head that reads KV head h (g // group, as repeat_kv) carries the same error Δv and the
    others none; the spread in that metric is the mean of (v − v̄)ᵀ·M_h·(v − v̄), and the identity
    metric gives the plain spread and the plain output metric."""
    from kamera_core.fit_metric import output_metric, projection_metric, query_second_moment, value_spread

    gen = _gen(11)
    hidden, hq, hkv, dv, t = 10, 6, 2, 4, 9
    weight = torch.randn(hidden, hq * dv, generator=gen, dtype=torch.float64)
    m = projection_metric(weight, hkv, dv)
    assert m.shape == (hkv, dv, dv) and m.dtype == torch.float64
    for h in range(hkv):
        dv_err = torch.randn(dv, generator=gen, dtype=torch.float64)
        attn = torch.zeros(hq, dv, dtype=torch.float64)
        attn[h * (hq // hkv):(h + 1) * (hq // hkv)] = dv_err
        assert float(dv_err @ m[h] @ dv_err) == pytest.approx(float((weight @ attn.reshape(-1)).square().sum()),
                                                              rel=1e-10)
    values = torch.randn(t, hkv, dv, generator=gen, dtype=torch.float64)
    c = values - values.mean(0)
    want = torch.stack([torch.stack([c[j, h] @ m[h] @ c[j, h] for j in range(t)]).mean() for h in range(hkv)])
    assert torch.allclose(value_spread(values, m), want, rtol=1e-12)
    eye = torch.eye(dv, dtype=torch.float64).expand(hkv, dv, dv)
    assert torch.allclose(value_spread(values, eye), value_spread(values), rtol=1e-12)
    sigma = query_second_moment(torch.randn(5, hq, 3, generator=gen), hkv)
    assert torch.allclose(output_metric(sigma, values, eye), output_metric(sigma, values), rtol=1e-12)
    with pytest.raises(ValueError, match="weight must be"):
        projection_metric(weight[:, :-1], hkv, dv)
    with pytest.raises(ValueError, match="metric must be"):
        value_spread(values, m[:, :2])
