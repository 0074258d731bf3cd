"""Patches end to end on tiny models: the conditioned pass, the deficit in the chunk-local frame,
a full-rank patch restoring KV(B|A) exactly, and the next-token logits of [A, B, query] with B's
canonical KV + patch placed after A matching the full forward. Covers an image chunk after a text
chunk (Qwen2.5-VL M-RoPE) and MLA (DeepSeek-V3: c_KV and k_rope patched)."""

from __future__ import annotations

import math

import pytest
import torch

from tools.bench.conditioned import conditioned_pass
from agentwin.models.kv import build_cache, concat_kv, relocate_kv
from kamera_core import fit_metric as fm, kv_layout, patch as kp, rope_specs
from tests.support import (Chunk, assert_close, concat, forward, forward_growth, image_chunk, layer_kv, make_chunk,
                           position_ids, text_chunk, tiny, tolerance)

CASES = ["tiny-qwen2.5-vl", "tiny-deepseek-v3", "tiny-llama-gqa", "tiny-qwen3-vl"]


def _setup(name: str):
    model = tiny(name)
    a = make_chunk(model, text_chunk(13, seed=21))
    if name.startswith("tiny-qwen"):
        ids, mm = image_chunk(model, seed=22)
        b = make_chunk(model, ids, mm)
    else:
        b = make_chunk(model, text_chunk(23, seed=22))
    return model, a, b


def _conditioned(model, a: Chunk, b: Chunk):
    specs, layout = list(rope_specs(model.config)), kv_layout(model.config)
    ab = concat(model, a, b)
    mm = {k: v for k, v in ab.mm.items()}
    cp = conditioned_pass(model, ab.input_ids, len(a), specs, layout, position_ids=position_ids(ab, 0), **mm)
    # B's first token sits at the same position on every M-RoPE axis (text precedes the image).
    b_start = int(position_ids(ab, 0).reshape(-1, len(ab))[0, len(a)])
    return cp, relocate_kv(cp.chunk_kv(), specs, layout, -b_start), b_start, specs, layout


@pytest.mark.parametrize("name", CASES)
def test_full_rank_patch_restores_conditioned_kv_and_logits(name):
    model, a, b = _setup(name)
    cp, cond_local, b_start, specs, layout = _conditioned(model, a, b)
    canonical = layer_kv(forward(model, b, 0).cache, model)
    deltas = kp.deficit(cond_local, canonical)
    # Conditioning must matter in the deep layers, or this test shows nothing.
    assert float(deltas[-1][0].abs().max()) > 1e-3
    full = max(t[0].numel() for t in canonical[0])
    patch = kp.build_patch(deltas, [(full, full)] * len(deltas), "svd", storage="fp32")
    restored = kp.apply_patch(canonical, patch)
    for (rk, rv), (ck, cv) in zip(restored, cond_local):
        for mine, want in ((rk, ck), (rv, cv)):
            # float32 factors: the product sums `full` rank-one terms (√full) at the KV's scale
            assert_close(mine, want, what="restored KV", growth=math.sqrt(full))

    # In the window: A's exact KV, then B's canonical + patch relocated to where B sits.
    query = make_chunk(model, text_chunk(5, seed=23))
    whole = concat(model, a, b, query)
    reference = forward(model, whole, 0).logits[0, -1]
    a_kv = [(k[: len(a)], v[: len(a)]) for k, v in cp.kv]
    cache = build_cache(concat_kv(a_kv, relocate_kv(restored, specs, layout, b_start)), model.config, layout)
    q = Chunk(whole.input_ids[len(a) + len(b):], whole.positions[..., len(a) + len(b):], {})
    q_pos = q.positions[None] if q.positions.dim() == 1 else q.positions[:, None]
    logits = forward(model, q, 0, cache=cache, positions=q_pos).logits[0, -1]
    growth = forward_growth(model.config)  # float32 rounding through the forward
    assert_close(logits, reference, what="logits", growth=growth)

    # Blind reuse (no patch) must be measurably different on the same check.
    blind = build_cache(concat_kv(a_kv, relocate_kv(canonical, specs, layout, b_start)), model.config, layout)
    blind_logits = forward(model, q, 0, cache=blind, positions=q_pos).logits[0, -1]
    assert float((blind_logits - reference).abs().max()) > tolerance(torch.float32, float(reference.abs().max()), growth)


@pytest.mark.parametrize("name", CASES)
def test_low_rank_fits_run_and_shrink_the_deficit(name):
    model, a, b = _setup(name)
    cp, cond_local, _, specs, layout = _conditioned(model, a, b)
    canonical = layer_kv(forward(model, b, 0).cache, model)
    deltas = kp.deficit(cond_local, canonical)
    if layout.family == "mla":
        metrics = [(None, None)] * len(deltas)
    else:
        metrics = [(fm.query_second_moment(q, layout.num_kv_heads), None) for q in cp.queries]
    weights = [(None, m) for m in cp.mass]
    patch = kp.build_patch(deltas, [(2, 2)] * len(deltas), "query+value", metrics, weights, storage="int8")
    restored = kp.apply_patch(canonical, patch)
    before = sum(float(d.pow(2).sum()) for pair in deltas for d in pair)
    after = sum(float((c.float() - r.float()).pow(2).sum()) for cr, rr in zip(cond_local, restored) for c, r in zip(cr, rr))
    assert after < before
    assert patch.nbytes > 0 and patch.ranks()[0] == (2, 2)
    assert all(m.shape == (len(b),) for m in cp.mass)
