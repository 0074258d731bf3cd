"""The compute study's pieces against the model's own forward: recompute started from patched KV
is recompute (every token recomputed reproduces the prefill; a partial one changes only its
rows and starts from the patched ones), the stored selection picks the rows the patch leaves
furthest, and every method is charged what it stores and forwards."""

from __future__ import annotations

import math

import pytest
import torch

from tools.bench import baselines as bl, contexts as cx, metrics as mt
from tools.studies import compute_study as cs
from agentwin.models.zoo import build_tiny
from kamera_core import patch as kp
from tests.tools.bench.test_baselines import _kl_tol, _same_kv
from tests.support import assert_close, forward_growth


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for (k1, v1), (k2, v2) in zip(a, b) for x, y in ((k1, k2), (v1, v2)))


@pytest.fixture(scope="module")
def ctx():
    model = build_tiny("tiny-llama-gqa")
    g = torch.Generator().manual_seed(3)
    chunks = [cx.text_chunk(torch.randint(3, 240, (n,), generator=g)) for n in (14, 21)]
    queries = [torch.randint(3, 240, (4,), generator=g) for _ in range(2)]
    return cx.build_context(model, chunks, queries, greedy=3)


def _patch(ctx, rank=2):
    deltas = kp.deficit(bl.conditioned_local(ctx, 1), ctx.canonical[1])
    return kp.build_patch(deltas, [(rank, rank)] * len(deltas), "svd", storage="fp16")


def test_recompute_from_patched_kv_reproduces_the_models_forward(ctx):
    patched = kp.apply_patch(ctx.canonical[1], _patch(ctx))
    locals_ = [ctx.canonical[0], patched]
    base = bl.placed_kv(ctx, locals_)
    assert _max_diff(base, ctx.full_kv) > 1e-3  # a rank-2 patch is not exact here
    lo = ctx.bounds[1][0]
    res = bl.method_tokens(ctx, "t", "", torch.arange(lo, ctx.length), locals_)
    _same_kv(ctx.model, res.kv, ctx.full_kv)
    whole = cx.join_chunks(ctx.model, [*ctx.chunks, cx.text_chunk(ctx.queries[0])])
    with torch.no_grad():  # the model's own single forward of [A, B, query]
        ref = ctx.model(input_ids=whole.ids[None], position_ids=cx.position_ids(whole.positions)).logits[0, -1]
    logits = cx.query_logits(ctx.model, ctx.layout, res.kv, ctx.queries[0], ctx.query_pos[0])
    assert_close(logits, ref, what="logits", growth=forward_growth(ctx.model.config))


def test_partial_recompute_starts_from_the_given_kv(ctx):
    patched = kp.apply_patch(ctx.canonical[1], _patch(ctx))
    locals_ = [ctx.canonical[0], patched]
    base = bl.placed_kv(ctx, locals_)
    blind = bl.method_blind(ctx).kv
    lo = ctx.bounds[1][0]
    res = bl.method_prefix(ctx, "window+epic", "k=5", lambda c, t: 5, locals_)
    assert res.token_layers == 5 * len(res.kv)
    for (k, v), (pk, pv), (bk, bv) in zip(res.kv, base, blind):
        assert torch.equal(k[lo + 5:], pk[lo + 5:]) and torch.equal(v[lo + 5:], pv[lo + 5:])
        assert not torch.equal(k[lo + 5:], bk[lo + 5:])
    # B's first tokens see only A's exact rows before them: recomputed, they are exact.
    _same_kv(ctx.model, [(k[lo:lo + 5], v[lo:lo + 5]) for k, v in res.kv],
             [(k[lo:lo + 5], v[lo:lo + 5]) for k, v in ctx.full_kv])
    # CacheBlend from exact KV: its selection recomputes rows that were already right.
    exact = bl.method_cacheblend(ctx, 0.15, [ctx.canonical[0], bl.conditioned_local(ctx, 1)])
    _same_kv(ctx.model, exact.kv, ctx.full_kv)
    assert _max_diff(bl.method_cacheblend(ctx, 0.15).kv, ctx.full_kv) > 1e-3


def test_stored_selection_picks_the_rows_the_patch_leaves_furthest():
    g = torch.Generator().manual_seed(0)
    conditioned = [(torch.randn(10, 2, 4, generator=g), torch.randn(10, 2, 4, generator=g)) for _ in range(3)]
    served = [(k + 1e-3 * torch.randn(k.shape, generator=g), v.clone()) for k, v in conditioned]
    served[1][1][7] += 5.0  # one layer's values, one row
    served[2][0][2] += 12.0
    assert cs.stored_selection(conditioned, served, 2).tolist() == [2, 7]
    assert cs.stored_selection(conditioned, served, 1).tolist() == [2]
    # Relative to each block's energy: the same error weighs more in a block with less energy.
    scaled = [(k * 100, v) for k, v in conditioned]
    served_scaled = [(k * 100, v) for k, v in served]
    served_scaled[2] = (served_scaled[2][0].clone(), served_scaled[2][1])
    served_scaled[2][0][2] = scaled[2][0][2] + 12.0  # the same error in a 100× block: now small
    assert cs.stored_selection(scaled, served_scaled, 1).tolist() == [7]
    with pytest.raises(ValueError, match="cannot select 11 of 10"):
        cs.stored_selection(conditioned, served, 11)


def test_every_method_is_charged_what_it_stores_and_forwards(ctx):
    patch = _patch(ctx)
    results = cs.methods(ctx, patch, log=lambda *_: None)
    rows = {(r["method"], r["setting"]): r for r in mt.score_many(ctx, results, greedy=3)}
    tokens, layers = ctx.reused_tokens(), len(ctx.full_kv)
    fp16 = ctx.reused_kv_bytes()
    assert rows[("full", "")]["kl"] <= _kl_tol(ctx) and rows[("full", "")]["compute_frac"] == 1.0
    assert rows[("window", "")]["bytes_frac"] == pytest.approx(patch.nbytes / fp16)
    assert rows[("window", "")]["compute_frac"] == 0.0
    assert rows[("window", "")]["kl"] < rows[("blind", "")]["kl"]
    for ratio in cs.STORED:
        count = min(tokens, math.ceil(ratio * tokens))
        row = rows[("window+stored", f"{ratio:.0%}")]
        assert row["bytes_frac"] == pytest.approx((patch.nbytes + count * cs.INDEX_BYTES) / fp16)
        assert row["token_layers"] == count * layers
        assert row["build_compute_frac"] == pytest.approx(2.0)  # B's canonical encode and its conditioned pass
    for k in (2, 16):
        assert rows[("window+epic", f"k={k}")]["token_layers"] == min(k, tokens) * layers
        assert rows[("epic", f"k={k}")]["bytes_frac"] == 0.0
    assert {m for m, _ in rows} == {"blind", "window", "cacheblend", "window+cacheblend", "epic", "window+epic",
                                   "window+stored", "full"}


def test_the_page_reports_the_least_compute_at_the_floor():
    rows = [{"method": "m", "setting": s, "kl": kl, "compute_frac": c}
            for s, kl, c in (("a", 3.0, 0.1), ("b", 0.9, 0.3), ("c", 0.5, 0.6))]
    assert cs.at_floor(rows, "m", 1.0)["setting"] == "b"
    assert cs.at_floor(rows, "m", 0.1) is None
    assert cs.best_within(rows, "m", 0.35)["setting"] == "b"
    assert cs.best_within(rows, "m", 0.05) is None


@pytest.mark.parametrize("argv, message", [(["--cases", "code,poems"], "unknown case(s) poems"),
                                           (["--budget", "6"], "--budget is a share"),
                                           (["--threads", "0"], "--threads must be at least 1")])
def test_the_command_refuses_bad_arguments_before_loading_anything(argv, message, capsys):
    with pytest.raises(SystemExit):
        cs.main(argv)
    assert message in capsys.readouterr().err
