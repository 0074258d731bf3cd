"""Orbit patches (`tools.bench.orbit`), the study policy the benchmarks run: the orbit patch is
the mean deficit over the fitted orders, each deficit taken from the transformers model's own
forward; a fit reaches chunks already placed; on the real model it beats the origin patch after
reorders."""

from __future__ import annotations

import math

import pytest
import torch

from agentwin.models.adapter import KameraModel
from agentwin.window import Window
from tests.agentwin.test_window import QUERY, TEXTS, _km, _same_logprobs  # one model per name for both modules
from tests.support import assert_close, tolerance
from tools.bench.orbit import OrbitPolicy


def test_orbit_patch_is_the_mean_deficit_over_the_fitted_orders():
    """Full-rank orbit: after fit_orders, a chunk placed after an antecedent it has no stored patch
    for carries canonical + the mean of its deficits over the distinct antecedents seen (the empty
    one, where it came first, a zero deficit), each taken from the transformers model's own forward."""
    km = _km("tiny-llama-gqa")
    texts = TEXTS[:3]
    orbit = OrbitPolicy()
    win = Window(km, budget_tokens=4096, patch=orbit, rank=4096, storage="fp16")  # rank >= every block: full rank
    ids = [win.append(t) for t in texts]
    assert orbit.fit_orders(win, orders=6, seed=0) == 6  # all 3! orders
    win.reorder([ids[2], ids[1], ids[0]])
    tokens = [km.tokenize(t) for t in texts]
    start = len(tokens[2]) + len(tokens[1])
    # What attention reads for chunk 0: its segment (canonical KV, shift, patch) placed densely.
    from kamera_core import patch as kp
    segs = [next(s for s in layer if s.first == start) for layer in win.segments()]
    assert all(s.shift == start and s.patch is not None for s in segs)
    local = kp.apply_patch([(s.keys, s.values) for s in segs], kp.ChunkPatch(tuple(s.patch for s in segs), "orbit"))

    def local_kv_in(order: list[int], which: int):
        seq = torch.cat([tokens[i] for i in order])
        with torch.no_grad():
            out = km.model(input_ids=seq[None], use_cache=True)
        start = sum(len(tokens[i]) for i in order[: order.index(which)])
        n = len(tokens[which])
        from agentwin.models.kv import extract_kv, relocate_kv
        placed = [(k[start:start + n], v[start:start + n]) for k, v in extract_kv(out.cache, km.layout)]
        return relocate_kv(placed, km.specs, km.layout, -start)

    import itertools

    from agentwin.models.kv import relocate_kv
    # chunk 0's distinct antecedents over the 6 orders: (), (1,), (2,), (1, 2), (2, 1)
    antecedents = {o[: o.index(0)] for o in itertools.permutations(range(3))}
    assert len(antecedents) == 5
    canonical = local_kv_in([0], 0)
    deficits = [[(k - ck, v - cv) for (k, v), (ck, cv) in zip(local_kv_in([*a, 0], 0), canonical)]
                for a in antecedents]
    means = [(sum(d[i][0] for d in deficits) / 5, sum(d[i][1] for d in deficits) / 5) for i in range(len(canonical))]
    placed = relocate_kv([(ck + dk, cv + dv) for (ck, cv), (dk, dv) in zip(canonical, means)], km.specs, km.layout, start)
    for (k, v), (ek, ev), (dk, dv) in zip(relocate_kv(local, km.specs, km.layout, start), placed, means):
        for got, want, deficit in ((k, ek, dk), (v, ev, dv)):
            # fp16 factors of the full-rank mean deficit: fp16 rounding of u and vt at the deficit's
            # scale, summed over the rank (√rank); then float32 rounding where each side adds it to
            # the canonical KV and rotates the sum (two products and a sum): 4 roundings in all
            rank = min(deficit.shape[0], deficit[0].numel())
            atol = tolerance(torch.float16, float(deficit.abs().max()), math.sqrt(rank)) \
                + tolerance(torch.float32, float(want.abs().max()), 4)
            assert_close(got, want, atol, "orbit-patched KV")
    with pytest.raises(ValueError, match="OrbitPolicy"):
        OrbitPolicy().fit_orders(Window(km, patch="origin"))
    with pytest.raises(ValueError, match="one window"):
        Window(km, patch=orbit, rank=2).append(TEXTS[0])


@pytest.mark.slow
def test_orbit_patch_beats_origin_on_reorders_on_smollm2(smollm2):
    """Measured on the real model: rank-16 patches after reorders of four chunks; the orbit patch
    fitted over 6 orders keeps the KL to re-prefill well under the origin patch's."""
    from tools.bench.datasets import make_case

    model, tokenizer = smollm2
    km = KameraModel(model, tokenizer, name="smollm2")
    case = make_case(0)
    texts = [case.a, case.b, *case.extra_chunks[:2]]
    query = case.queries[0] if isinstance(case.queries[0], str) else case.queries[0][0]

    def kl(win: Window) -> float:
        p, r = win.next_token_logprobs(query).double(), win.reference_logprobs(query).double()
        p, r = p - p.logsumexp(-1), r - r.logsumexp(-1)
        return float((r.exp() * (r - p)).sum())

    mean = {}
    for policy in ("origin", "orbit"):
        placement = OrbitPolicy() if policy == "orbit" else policy
        win = Window(km, budget_tokens=8192, patch=placement, rank=16)
        ids = [win.append(t) for t in texts]
        win.materialize()  # the chunks' first passes in the appended order: their origin patches
        if policy == "orbit":
            placement.fit_orders(win, orders=6, seed=0)
        scores = []
        for perm in ([1, 0, 2, 3], [3, 2, 1, 0], [2, 3, 0, 1]):
            win.reorder([ids[i] for i in perm])
            scores.append(kl(win))
        mean[policy] = sum(scores) / len(scores)
    assert mean["orbit"] < 0.5 * mean["origin"], mean


def test_fit_orders_reaches_chunks_already_placed():
    """A chunk served with its orbit patch before `fit_orders` is served with the new fit after
    it: the same logits as a window that fitted the orbit before its first read."""
    km = _km("tiny-llama-gqa")

    def window():
        orbit = OrbitPolicy()
        win = Window(km, patch=orbit, rank=2)
        ids = [win.append(t) for t in TEXTS[:3]]
        win.materialize()  # first passes in the appended order, then a reorder the orbit serves
        win.reorder([ids[2], ids[0], ids[1]])
        return win, orbit

    placed, orbit = window()
    before = placed.next_token_logprobs(QUERY)
    assert orbit.fit_orders(placed, orders=3, seed=1) == 3
    after = placed.next_token_logprobs(QUERY)
    fresh, fresh_orbit = window()
    fresh_orbit.fit_orders(fresh, orders=3, seed=1)
    expected = fresh.next_token_logprobs(QUERY)
    _same_logprobs(km, after, expected)
    assert float((after - before).abs().max()) > 1e-4  # the fit changed what is served
