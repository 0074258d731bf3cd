"""The evaluation harness against the transformers models' own forward: recomputing tokens with
the model's decoder layers over a cache of reused KV reproduces the full prefill when every
reused token is recomputed (text GQA, Qwen2.5-VL M-RoPE, Qwen3-VL deepstack), each method costs
what it says, and full-rank Kamera patches reproduce the re-prefill's logits."""

from __future__ import annotations

import math

import pytest
import torch

from agentwin.models.zoo import build_tiny
from tools.bench import baselines as bl, contexts as cx, fits as ek, metrics as mt
from tests.support import assert_close, forward_growth, tolerance


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for (k1, v1), (k2, v2) in zip(a, b) for x, y in ((k1, k2), (v1, v2)))


def _same_kv(model, got, want, what: str = "KV", magnitudes=None) -> None:
    """Per layer K and V equal to float32 rounding through the model's forward (forward_growth),
    at each tensor's own magnitude (or the given one per layer and slot)."""
    growth = forward_growth(model.config)
    for layer, ((k, v), (wk, wv)) in enumerate(zip(got, want)):
        for slot, x, y in ((0, k, wk), (1, v, wv)):
            scale = float(y.abs().max()) if magnitudes is None else magnitudes[layer][slot]
            assert_close(x, y, tolerance(torch.float32, scale, growth), f"{what} layer {layer} {'kv'[slot]}")


def _kl_tol(ctx, kl: float = 0.0) -> float:
    """How far `mt.score`'s KL can move when the read's logits move within float32 rounding δ
    through the forward (forward_growth, at the references' logits): it takes the KL of the
    logits' log-softmax in float64, so a read equal to the reference reads ½·δ² (second order);
    one at KL `kl` moves by at most 2·√(2·kl)·δ + 2·δ² (the log-probabilities move within 2δ,
    weighed by how far the distributions sit apart, Pinsker). Plus float64 rounding of the sum
    (first order, eps64 · max|log p|)."""
    logits = max(float(r.abs().max()) for r in ctx.reference)
    delta = tolerance(torch.float32, logits, forward_growth(ctx.model.config))
    logp = max(float(torch.log_softmax(r.double(), -1).abs().max()) for r in ctx.reference)
    floor = tolerance(torch.float64, logp)
    kl = max(kl, 0.0)  # a KL summed in float64 can read a rounding below zero
    return (delta ** 2 / 2 if kl == 0 else 2 * math.sqrt(2 * kl) * delta + 2 * delta ** 2) + floor


def _text_context(name="tiny-llama-gqa"):
    model = build_tiny(name)
    g = torch.Generator().manual_seed(0)
    chunks = [cx.text_chunk(torch.randint(3, 240, (n,), generator=g)) for n in (13, 23, 17)]
    return cx.build_context(model, chunks, [torch.randint(3, 240, (5,), generator=g)], greedy=3)


def _vl_context(name):
    model = build_tiny(name)
    chunks = [cx.random_text_chunk(model, 1, 12), cx.image_chunk(model, 2), cx.random_text_chunk(model, 3, 9),
              cx.image_chunk(model, 4, kind="frame")]
    return cx.build_context(model, chunks, [torch.randint(3, 240, (5,), generator=torch.Generator().manual_seed(5))])


@pytest.fixture(scope="module", params=["tiny-llama-gqa", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def ctx(request):
    return _text_context() if request.param == "tiny-llama-gqa" else _vl_context(request.param)


def test_recomputing_every_reused_token_reproduces_the_prefill(ctx):
    blind = bl.method_blind(ctx).kv
    assert _max_diff(blind, ctx.full_kv) > 1e-3  # the reused chunks' KV does depend on context here
    everything = torch.arange(ctx.bounds[1][0], ctx.length)
    kv, counts = bl.recompute(ctx.model, ctx.cap, blind, everything)
    assert counts == [ctx.reused_tokens()] * len(kv)
    _same_kv(ctx.model, kv, ctx.full_kv)
    for q, qpos in zip(ctx.queries, ctx.query_pos):
        whole = cx.join_chunks(ctx.model, [*ctx.chunks, cx.text_chunk(q)])
        dtype = next(ctx.model.parameters()).dtype
        mm = {k: (v.to(dtype) if k == "pixel_values" else v) for k, v in whole.mm.items()}
        with torch.no_grad():  # the model's own single forward of [context, query]
            ref = ctx.model(input_ids=whole.ids[None], position_ids=cx.position_ids(whole.positions), **mm).logits[0, -1]
        logits = cx.query_logits(ctx.model, ctx.layout, kv, q, qpos)
        assert_close(logits, ref, what="logits", growth=forward_growth(ctx.model.config))


def test_recomputing_one_middle_chunk_sees_exact_rows_before_and_after(ctx):
    """Only chunk 1 is reused (canonical); everything else is the prefill's KV. Recomputing chunk 1
    alone restores the prefill exactly: its tokens must see the rows before them, and no rows of
    later chunks (which sit in the cache too)."""
    lo, hi = ctx.bounds[1]
    mixed = []
    blind = bl.method_blind(ctx).kv
    for (fk, fv), (bk, bv) in zip(ctx.full_kv, blind):
        k, v = fk.clone(), fv.clone()
        k[lo:hi], v[lo:hi] = bk[lo:hi], bv[lo:hi]
        mixed.append((k, v))
    assert _max_diff(mixed, ctx.full_kv) > 1e-3
    kv, _ = bl.recompute(ctx.model, ctx.cap, mixed, torch.arange(lo, hi))
    _same_kv(ctx.model, kv, ctx.full_kv)


def test_partial_recompute_changes_only_the_selected_rows():
    ctx = _text_context()
    blind = bl.method_blind(ctx).kv
    res = bl.method_epic(ctx, 4)
    chosen = torch.cat([torch.arange(lo, lo + 4) for lo, _ in ctx.bounds[1:]])
    others = torch.ones(ctx.length, dtype=torch.bool)
    others[chosen] = False
    for (k, v), (bk, bv), (fk, fv) in zip(res.kv, blind, ctx.full_kv):
        assert torch.equal(k[others], bk[others]) and torch.equal(v[others], bv[others])
    # The first reused chunk's first 4 tokens see only exact rows before them: they become exact.
    lo = ctx.bounds[1][0]
    _same_kv(ctx.model, [(k[lo:lo + 4], v[lo:lo + 4]) for k, v in res.kv],
             [(k[lo:lo + 4], v[lo:lo + 4]) for k, v in ctx.full_kv])
    assert res.token_layers == 4 * 2 * len(res.kv)


def test_method_costs_and_kl_ordering():
    ctx = _text_context()
    layers, reused = len(ctx.full_kv), ctx.reused_tokens()
    sizes = [hi - lo for lo, hi in ctx.bounds[1:]]
    cb = bl.method_cacheblend(ctx, 0.15)
    deep = bl.cacheblend_ratios(0.15, 30)  # SmolLM2's depth
    assert deep[0] == 1.0 and deep[1] == pytest.approx(0.30) and deep[-1] == pytest.approx(0.15)
    assert all(x >= y for x, y in zip(deep[1:], deep[2:]))  # the selection only narrows
    ratios = bl.cacheblend_ratios(0.15, layers)
    assert cb.token_layers == reused + sum(min(n, max(1, round(r * n))) for r in ratios[1:] for n in sizes)
    vl = bl.method_vlcache(ctx, 0.05)  # text-only context: every reused chunk
    assert vl.token_layers == layers * sum(math.ceil(0.05 * n) for n in sizes)
    full = mt.score(ctx, bl.method_full(ctx), greedy=3)
    blind = mt.score(ctx, bl.method_blind(ctx), greedy=3)
    epic = mt.score(ctx, bl.method_epic(ctx, 32), greedy=3)  # k ≥ every chunk: everything recomputed
    assert full["kl"] <= _kl_tol(ctx) and full["greedy_same"] == 1.0 and full["compute_frac"] == 1.0
    assert blind["kl"] > 1e-6 and blind["compute_frac"] == 0.0 and blind["bytes_frac"] == 0.0
    assert epic["kl"] <= _kl_tol(ctx) and epic["compute_frac"] == 1.0


def test_cacheblend_narrows_its_selection_layer_by_layer():
    from agentwin.models.zoo import tiny_config

    cfg = tiny_config("tiny-llama-gqa")
    cfg.num_hidden_layers = 6
    model = build_tiny("tiny-llama-gqa", config=cfg)
    g = torch.Generator().manual_seed(1)
    chunks = [cx.text_chunk(torch.randint(3, 240, (n,), generator=g)) for n in (12, 40, 30)]
    ctx = cx.build_context(model, chunks, [torch.randint(3, 240, (4,), generator=g)])
    blind = bl.method_blind(ctx).kv
    res = bl.method_cacheblend(ctx, 0.15)
    ratios = bl.cacheblend_ratios(0.15, 6)
    reused = torch.arange(ctx.bounds[1][0], ctx.length)
    previous = None
    # Layer 0's values depend on the token alone (recomputing them changes nothing); from layer 1
    # on, a recomputed row differs from its reused one.
    for l, ((k, v), (bk, bv)) in list(enumerate(zip(res.kv, blind)))[1:]:
        changed = set(int(i) for i in reused if not torch.equal(v[i], bv[i]))
        want = sum(round(ratios[l] * (hi - lo)) for lo, hi in ctx.bounds[1:])
        assert len(changed) == want, (l, len(changed), want)
        if previous is not None:
            assert changed <= previous  # a token dropped at one layer is not picked up again
        previous = changed
    assert ctx.bounds[0][1] == 12 and all(int(i) >= 12 for i in previous)


def test_vlcache_recomputes_only_image_and_frame_chunks():
    ctx = _vl_context("tiny-qwen2.5-vl")
    res = bl.method_vlcache(ctx, 0.05)
    layers = len(ctx.full_kv)
    want = sum(math.ceil(0.05 * (hi - lo)) for c, (lo, hi) in zip(ctx.chunks[1:], ctx.bounds[1:]) if c.kind != "text")
    assert want > 0 and res.token_layers == want * layers


@pytest.mark.parametrize("maker", [lambda: _text_context(), lambda: _vl_context("tiny-qwen3-vl")])
def test_full_rank_kamera_patches_reproduce_the_reprefill(maker):
    ctx = maker()
    conds = [ek.conditioning(ctx.model, ctx.chunks[:i], ctx.chunks[i], ctx.canonical[i]) for i in range(1, len(ctx.chunks))]
    for method in ("kamera-svd", "kamera-query", "kamera-alloc"):
        patches = [ek.patch_at(ek.patch_fits(c, method, ctx.layout.num_kv_heads), 10**9, "fp32") for c in conds]
        res = ek.method_patched(ctx, method, "full", patches)
        _same_kv(ctx.model, res.kv, ctx.full_kv, method)
        row = mt.score(ctx, res)
        assert row["kl"] <= _kl_tol(ctx) and row["top1"] == 1.0
    # A budget is respected, and a small patch still moves KL below blind reuse.
    blind = mt.score(ctx, bl.method_blind(ctx))["kl"]
    for method in ("kamera-svd", "kamera-alloc"):
        budget = [int(0.12 * sum((k.numel() + v.numel()) * 2 for k, v in ctx.canonical[i])) for i in range(1, len(ctx.chunks))]
        patches = [ek.fit_patch(c, method, b) for c, b in zip(conds, budget)]
        assert all(p.nbytes <= b for p, b in zip(patches, budget))
    alloc = mt.score(ctx, ek.method_patched(ctx, "kamera-alloc", "12%", patches))
    assert 0 < alloc["bytes_frac"] <= 0.12 and alloc["kl"] < blind


@pytest.mark.parametrize("maker", [lambda: _text_context(), lambda: _vl_context("tiny-qwen2.5-vl")])
def test_one_conditioned_pass_serves_every_chunk(maker):
    ctx = maker()
    shared = ek.conditionings(ctx.model, ctx.chunks, ctx.canonical)
    for i in range(1, len(ctx.chunks)):
        alone = ek.conditioning(ctx.model, ctx.chunks[:i], ctx.chunks[i], ctx.canonical[i])
        # a deficit's rounding is the conditioned KV's, at the KV's magnitude, not the deficit's
        scales = [(float(k.abs().max()), float(v.abs().max())) for k, v in ctx.canonical[i]]
        _same_kv(ctx.model, shared[i - 1].deltas, alone.deltas, "deficit", scales)
        for q1, q2 in zip(shared[i - 1].queries, alone.queries):
            assert_close(q1, q2, what="queries", growth=forward_growth(ctx.model.config))


def test_orbit_deltas_average_over_orders():
    ctx = _text_context()
    members = [1, 2]
    deltas = ek.orbit_deltas(ctx.model, [ctx.chunks[0]], [ctx.chunks[i] for i in members],
                             [ctx.canonical[i] for i in members])
    # In this context's own order the orbit deficit differs from the origin deficit (it averages
    # two orders), but has its shape and is not zero.
    origin = ek.conditioning(ctx.model, ctx.chunks[:2], ctx.chunks[2], ctx.canonical[2]).deltas
    assert [tuple(d[0].shape) for d in deltas[1]] == [tuple(d[0].shape) for d in origin]
    assert float(deltas[1][-1][0].abs().max()) > 0
    assert _max_diff(deltas[1], origin) > 1e-6


def test_unknown_patch_method_is_refused():
    ctx = _text_context()
    cond = ek.conditioning(ctx.model, ctx.chunks[:1], ctx.chunks[1], ctx.canonical[1])
    with pytest.raises(ValueError, match="unknown patch method"):
        ek.patch_fits(cond, "kamera-magic")
    with pytest.raises(ValueError, match="queries"):
        ek.patch_fits(cond.deltas, "kamera-query", 2)
