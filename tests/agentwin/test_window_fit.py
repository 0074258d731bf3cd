"""The window's patch fits (`agentwin.patches.fit`): `max_kl` (a fidelity target instead of a
rank) and `fit="query"`, checked against the model's own forward."""

from __future__ import annotations

import math

import pytest
import torch

from agentwin.models.adapter import KameraModel
from agentwin.window import Window
from agentwin.window_config import WindowConfig
from kamera_core.metrics import kl_divergence
from tests.agentwin.test_guard import A, B, _km  # the same two chunks and model cache as the guard's tests
from tests.support import forward_growth, tolerance

QUERY = " who wrote the surge?"


def _served_with_patch(km: KameraModel, **window_args):
    """A then B; B evicted and recalled at its slot, so it is read as canonical KV + its stored
    patch. Returns (window, KL of the window's next token against a re-prefill by the model's own
    forward)."""
    win = Window(km, budget_tokens=4096, **{"patch": "origin-akin", **window_args})
    win.append(A)
    b = win.append(B)
    win.evict(b)
    win.recall(b)
    return win, kl_divergence(win.reference_logprobs(QUERY), win.next_token_logprobs(QUERY), log_probs=True)


@pytest.mark.parametrize("name", ["tiny-llama-gqa", "tiny-gemma3", "tiny-gpt-neox"])
def test_a_tight_target_raises_the_rank_and_a_loose_one_spends_nothing(name):
    km = _km(name)
    _, blind = _served_with_patch(km, rank=1, patch="none")
    fixed, kl_fixed = _served_with_patch(km, rank=1, storage="fp32")  # fp32 factors: no rounding floor
    tight, kl_tight = _served_with_patch(km, rank=1, storage="fp32", max_kl=1e-12)
    loose, kl_loose = _served_with_patch(km, rank=1, storage="fp32", max_kl=1e6)
    assert fixed.stats().kl_ranks == []  # no target: the fixed rank, no probe
    # Tight: the ladder climbs past the first rank; the patch is larger and reads much closer to
    # the re-prefill than rank 1 and than blind reuse.
    (rank,) = tight.stats().kl_ranks
    assert rank > 1 and tight.stats().patch_bytes > fixed.stats().patch_bytes
    assert tight.stats().forward_tokens["guard"] > 0  # the probe forwards are counted
    assert kl_tight < 0.2 * blind
    # Against rank 1: much closer, unless rank 1 already reads at this comparison's float floor
    # (the exact patch's own KL; tiny-gpt-neox's rank-1 patch is there), where nothing can beat
    # it and the tight patch must read at that floor too.
    _, floor = _served_with_patch(km, rank=None)
    if kl_fixed > 2 * floor:
        assert kl_tight < 0.2 * kl_fixed
    else:
        assert kl_tight < 2 * floor
    # Loose: blind reuse already meets it, so no bytes are spent and B reads as blind reuse does.
    assert loose.stats().kl_ranks == [0] and loose.stats().patch_bytes == 0
    assert kl_loose == pytest.approx(blind, rel=1e-4, abs=1e-9)


def test_max_kl_keeps_the_plain_fit_at_the_rank_it_chose():
    """With one rank for every layer, the ladder decomposes each block once and truncates it per
    rung: the patch it keeps is the plain fit at that rank of a separate capture of the model's
    forward (`kamera_core.patch.build_patch`), and the ladder's time is counted as the guard's."""
    from kamera_core import patch as kp

    km = _km("tiny-llama-gqa")
    win = Window(km, patch="origin-akin", budget_tokens=4096, rank=1, storage="fp32", max_kl=1e-12)
    win.append(A)
    b = win.append(B)
    (rank,) = win.stats().kl_ranks
    assert rank > 1 and win.stats().seconds["guard"] > 0  # the target is out of reach: it climbed
    stored = next(iter(win._chunks[b].patches.values()))
    assert win.stats().kl_bytes == [stored.nbytes]
    deltas, _, _ = _captured(km, win, b)
    want = kp.build_patch(deltas, [(rank, rank)] * len(deltas), "svd", storage="fp32")
    assert _ranks(stored) == _ranks(want) and stored.nbytes == want.nbytes
    plain = [tuple(kp.fit_with_gains(d) for d in pair) for pair in deltas]  # the same fit, full rank
    _rounds_the_fit(km, win._chunks[b].canonical, stored, [tuple(f for f, _, _ in pair) for pair in plain],
                    [tuple(g for _, g, _ in pair) for pair in plain], "fp32")


# float32 factors (a float64 fit) on gpt-neox: mixed ones are fitted in float32, where the
# allocator's near-ties can fall the other way than in the evaluation's float64 fit.
@pytest.mark.parametrize("name, storage", [("tiny-llama-gqa", "mixed"), ("tiny-gpt-neox", "fp32")])
def test_max_kl_climbs_the_windows_own_fit_by_bytes(name, storage):
    """Under a byte budget with an allocator fit (the default: residual, mixed factors), the
    ladder's rungs are that fit within the budget, √2 times it, and so on: the patch kept is the
    evaluation's `kamera-residual` fit (in `storage`) of a separate capture of the model's forward
    at one of those budgets, larger than the budget itself when the target is out of reach."""
    from tools.bench.fits import Conditioning, patch_at, patch_fits
    from kamera_core import fit_metric as fm

    km = _km(name)
    win = Window(km, patch="origin-akin", budget_tokens=4096, max_kl=1e-12, storage=storage)
    assert win.fit == "residual" and win.storage == storage
    win.append(A)
    b = win.append(B)
    stored = next(iter(win._chunks[b].patches.values()))
    canonical = win._chunks[b].canonical
    full, first = _kv_bytes(canonical), int(0.06 * _kv_bytes(canonical))
    assert win.stats().kl_bytes == [stored.nbytes] and first < stored.nbytes <= full
    assert win.stats().kl_ranks == [max(r for pair in _ranks(stored) for r in pair)]
    assert win.stats().forwards["guard"] >= 3  # blind, then at least two rungs
    deltas, queries, residual = _captured(km, win, b)
    weights = [layer.attention.dense.weight if name == "tiny-gpt-neox" else layer.self_attn.o_proj.weight
               for layer in km.model.get_decoder().layers]
    projections = [fm.projection_metric(w, km.layout.num_kv_heads, km.layout.value_dim) for w in weights]
    rungs = []
    while not rungs or rungs[-1] < full:
        rungs.append(min(full, math.ceil(round(first * 2 ** (len(rungs) / 2), 6))))
    fits = patch_fits(Conditioning(deltas, queries, 0.0, residual), "kamera-residual", km.layout.num_kv_heads,
                      [v for _, v in canonical], projections)
    wants = [patch_at(fits, budget, storage) for budget in rungs]
    want = next(w for w in wants if w.nbytes == stored.nbytes)
    assert _ranks(stored) == _ranks(want)
    _rounds_the_fit(km, canonical, stored, fits.full, fits.gains, storage)


def test_max_kl_is_checked_and_ignored_for_exact_patches():
    km = _km("tiny-llama-gqa")
    for bad in (0, -1.0, "1e-3", True):
        with pytest.raises(ValueError, match="max_kl must be a positive number"):
            Window(km, patch="origin-akin", max_kl=bad)
    exact = Window(km, patch="origin-akin", rank=None, max_kl=1e-3)
    assert exact.max_kl is None
    exact.append(A)
    exact.append(B)
    assert exact.stats().kl_ranks == []


@pytest.mark.parametrize("name", ["tiny-llama-gqa", "tiny-gpt-neox"])
def test_query_fit_uses_the_metric_of_the_chunks_own_queries(name):
    """`fit="query"`: B's key patch is the fit in the second moment of the queries of all B's
    rows, taken in the chunk-local frame. Checked against the same metric built from a separate capture
    of the model's own transformers forward over A then B (`conditioned_pass`), rows and frame
    included; the values keep the plain fit."""
    import torch

    from agentwin.patches.guard import QueryProbe
    from tools.bench.conditioned import conditioned_pass
    from kamera_core import fit_metric as fm, patch as kp

    km = _km(name)
    win = Window(km, patch="origin-akin", budget_tokens=4096, rank=3, storage="fp32", fit="query", guard=False)  # the fit itself
    win.append(A)
    b = win.append(B)
    stored = next(iter(win._chunks[b].patches.values()))
    a_ids, b_ids = km.tokenize(A), km.tokenize(B)
    cp = conditioned_pass(km.model, torch.cat([a_ids, b_ids]), len(a_ids), km.specs, km.layout)
    metrics = [(fm.query_second_moment(q, km.layout.num_kv_heads), None) for q in cp.queries]
    last = QueryProbe.last_rows(len(b_ids)).rows  # the guard's probe rows: a different metric
    probe_only = [(fm.query_second_moment(q[last], km.layout.num_kv_heads), None) for q in cp.queries]
    deltas = kp.deficit(_local(cp, km), win._chunks[b].canonical)
    expected = kp.build_patch(deltas, [(3, 3)] * len(deltas), "query", metrics=metrics, storage="fp32")
    plain = kp.build_patch(deltas, [(3, 3)] * len(deltas), "svd", storage="fp32")
    lastrows = kp.build_patch(deltas, [(3, 3)] * len(deltas), "query", metrics=probe_only, storage="fp32")
    got, want, svd, tail = (kp.apply_patch(win._chunks[b].canonical, p) for p in (stored, expected, plain, lastrows))
    for (gk, gv), (wk, wv), (sk, _) in zip(got, want, svd):
        scale = float(wk.abs().max())
        assert float((gk - wk).abs().max()) <= 2e-3 * scale and float((gv - wv).abs().max()) <= 2e-3 * float(wv.abs().max())
    assert max(float((w[0] - s[0]).abs().max()) for w, s in zip(want, svd)) > 1e-2 * scale  # the metric matters
    assert max(float((w[0] - t[0]).abs().max()) for w, t in zip(want, tail)) > 1e-2 * scale  # and its rows


def _local(cp, km):
    from agentwin.models.kv import relocate_kv

    return relocate_kv(cp.chunk_kv(), km.specs, km.layout, -cp.chunk_start)


def _captured(km, win, b):
    """B's deficit and its rows' queries (chunk-local frame) from a separate capture of the
    model's own forward over A then B."""
    import torch

    from tools.bench.conditioned import conditioned_pass
    from kamera_core import patch as kp

    a_ids, b_ids = km.tokenize(A), km.tokenize(B)
    cp = conditioned_pass(km.model, torch.cat([a_ids, b_ids]), len(a_ids), km.specs, km.layout)
    return kp.deficit(_local(cp, km), win._chunks[b].canonical), cp.queries, cp.residual


def _kv_bytes(kv) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def test_a_sliding_window_model_takes_the_default_budget_too():
    km = _km("tiny-gemma3")
    win = Window(km, patch="origin-akin", budget_tokens=4096)
    win.append(A)
    b = win.append(B)
    stored = next(iter(win._chunks[b].patches.values()))
    assert 0 < stored.nbytes <= int(0.06 * _kv_bytes(win._chunks[b].canonical))


def _window_and_evaluation_fit(km, name: str, fit: str, storage: str):
    """B's patch from a window with `fit` (its default when "residual") at the default 6% budget
    (checked to be within it and counted), and the evaluation's `kamera-{fit}` fit in `storage` of a
    separate capture of the model's forward at that budget (`tools.bench.fits`). Returns
    (window, stored patch, B's canonical KV, the evaluation's patch, its full-rank fits)."""
    from tools.bench.fits import Conditioning, patch_at, patch_fits
    from kamera_core import fit_metric as fm

    win = Window(km, patch="origin-akin", budget_tokens=4096, storage=storage, **({} if fit == "residual" else {"fit": fit}))
    win.append(A)
    b = win.append(B)
    stored = next(iter(win._chunks[b].patches.values()))
    canonical = win._chunks[b].canonical
    budget = int(0.06 * _kv_bytes(canonical))
    assert 0 < stored.nbytes <= budget and win.stats().patch_bytes == stored.nbytes
    deltas, queries, residual = _captured(km, win, b)
    weights = [layer.attention.dense.weight if name == "tiny-gpt-neox" else layer.self_attn.o_proj.weight
               for layer in km.model.get_decoder().layers]
    projections = [fm.projection_metric(w, km.layout.num_kv_heads, km.layout.value_dim) for w in weights]
    fits = patch_fits(Conditioning(deltas, queries, 0.0, residual), f"kamera-{fit}", km.layout.num_kv_heads,
                      [v for _, v in canonical], projections)
    return win, stored, canonical, patch_at(fits, budget, storage), fits


def _storage_rounding(f) -> torch.Tensor:
    """`[T, *F]` float64: per element, the most that storing factors in their form moves their
    product. Each stored factor is within half a step of the fitted one (int8 and 4-bit codes: half
    their component's scale; fp16 / bf16 / fp32: half an ulp, eps/2 of the value), so over the
    components j, |u·vt − ũ·ṽt| ≤ Σ_j h_u·|ṽt| + (|ũ| + h_u)·h_vt, taken from the stored ũ, ṽt."""
    u, vt = f.factors(torch.float64)
    flat = vt.reshape(vt.shape[0], -1)
    if f.u_scale is not None:
        hu, hvt = (f.u_scale.double() / 2).expand_as(u), (f.vt_scale.double() / 2)[:, None].expand_as(flat)
    else:
        half = torch.finfo(f.u.dtype).eps / 2
        hu, hvt = u.abs() * half, flat.abs() * half
    return (hu @ flat.abs() + (u.abs() + hu) @ hvt).reshape(u.shape[0], *vt.shape[1:])


def _rounds_the_fit(km, canonical, stored, full, gains, storage: str) -> None:
    """`stored` corrects the canonical KV as the same fit of a separate capture does: per layer, K
    and V within what storing the factors rounds (`_storage_rounding`) of `full` (that fit's
    full-rank float factors, ordered by gain) cut to the stored ranks, plus what float rounding of
    the two fits explains. Two fits whose floats agree to rounding can still round a code the
    other way (one int8 step of a leading component, ~1/127 of it), so the stored codes are held to
    their own rounding of the fit, never to the other fit's codes.

    The float fits differ by the float32 forwards their deficits come from (`forward_growth`, at
    the KV's scale), and where the window decomposes in float32 (`precision_for`: int8, mixed,
    16-bit storage) by the Gram matrix's rounding, eps·√n·σ₀² over n = max(T, F) terms, which turns
    the kept subspace by at most that over the gap σ²_r − σ²_{r+1} at the cut (Davis-Kahan) and
    moves the product by twice that angle times σ_r/σ₀ of its scale."""
    from kamera_core.fit_batch import precision_for

    precision = precision_for(storage)
    forward = forward_growth(km.model.config)
    ranks = _ranks(stored)
    for layer, (lp, (ck, cv), pair, gpair, rpair) in enumerate(zip(stored.layers, canonical, full, gains, ranks)):
        for slot, got, base, fitted, g, r in zip("kv", (lp.k, lp.v), (ck, cv), pair, gpair, rpair):
            if got is None:
                continue
            want = fitted.truncate(r).dense(torch.float64)
            scale, kv, g = float(want.abs().max()), float(base.abs().max()), g.double()
            n = max(int(want.shape[0]), want[0].numel())
            gap = float(g[r - 1] - g[r]) if r < len(g) else math.inf
            perturbed = tolerance(precision, 1.0, math.sqrt(n)) + tolerance(torch.float32, kv / max(scale, 1e-30), forward)
            angle = min(1.0, perturbed * float(g[0]) / gap) if gap > 0 else 1.0
            turned = 2 * angle * math.sqrt(float(g[r - 1] / g[0])) * scale if float(g[0]) > 0 else 0.0
            rounding = _storage_rounding(got)
            bound = rounding + tolerance(torch.float32, kv, forward) + turned
            diff = (got.dense(torch.float64) - want).abs()
            assert bool((diff <= bound).all()), (
                f"layer {layer} {slot}: the stored patch is off the fit by {float(diff.max()):.3e}, past its bound by "
                f"{float((diff - bound).max()):.3e} (storage rounding up to {float(rounding.max()):.3e}, turned {turned:.3e})")


@pytest.mark.parametrize("name", ["tiny-llama-gqa", "tiny-gpt-neox"])
@pytest.mark.parametrize("fit", ["alloc", "query", "output", "output-half", "output-abs", "residual"])
def test_byte_budget_patches_are_the_evaluations_int8_fits_within_six_percent(name, fit):
    """A window fits B's patch within 6% of B's canonical KV bytes, as the evaluation's
    `kamera-alloc-int8`, `kamera-query-int8`, `kamera-output-int8` or `kamera-residual-int8` does at that budget
    (`tools.bench.fits`) from a separate capture of the model's forward: same ranks, same
    corrected KV. The patch guard then keeps each layer's key or value patch of that fit as
    fitted or drops it, never changes it."""
    km = _km(name)
    args = {} if fit == "residual" else {"fit": fit}  # residual: the default
    win, stored, canonical, want, fits = _window_and_evaluation_fit(km, name, fit, "int8")
    assert (win.rank, win.patch_bytes, win.fit, win.storage) == ("budget", 0.06, fit, "int8")  # no guard at 6%
    assert _ranks(stored) == _ranks(want) and stored.nbytes == want.nbytes
    if fit != "query":
        assert len(set(_ranks(stored))) > 1  # spread, not one rank for all
    _rounds_the_fit(km, canonical, stored, fits.full, fits.gains, "int8")
    checked = Window(km, patch="origin-akin", budget_tokens=4096, guard=True, storage="int8", **args)
    checked.append(A)
    guarded = next(iter(checked._chunks[checked.append(B)].patches.values()))
    assert checked.stats().guard_checked > 0
    for mine, fitted in zip(guarded.layers, stored.layers):
        for got, full in ((mine.k, fitted.k), (mine.v, fitted.v)):
            assert got is None or (torch.equal(got.u, full.u) and torch.equal(got.vt, full.vt))


def test_mixed_storage_patches_are_the_evaluations_mixed_fit():
    """storage="mixed": the window's residual patch is the evaluation's `kamera-residual-mixed` fit
    of a separate capture (same ranks, same int8 / 4-bit split, same bytes) within 6%; it needs
    the allocator, and max_kl's ladder takes int8 under it."""
    km = _km("tiny-llama-gqa")
    _, stored, canonical, want, fits = _window_and_evaluation_fit(km, "tiny-llama-gqa", "residual", "mixed")
    split = [[(f.rank, f.int4_rank) if f is not None else (0, 0) for f in (lp.k, lp.v)] for lp in stored.layers]
    assert split == [[(f.rank, f.int4_rank) if f is not None else (0, 0) for f in (lp.k, lp.v)] for lp in want.layers]
    assert stored.nbytes == want.nbytes and any(r4 > 0 for layer in split for _, r4 in layer)
    _rounds_the_fit(km, canonical, stored, fits.full, fits.gains, "mixed")
    for args in ({"fit": "svd"}, {"fit": "query"}, {"rank": 4}):
        with pytest.raises(ValueError, match="storage='mixed' is chosen per component"):
            Window(km, patch="origin-akin", storage="mixed", **args)
        assert Window(km, patch="origin-akin", storage="auto", **args).storage == "int8"  # "auto": int8 where one rank is set
    assert Window(km, patch="origin-akin", storage="auto").storage == "mixed" and Window(km, patch="origin-akin", storage="auto", fit="alloc").storage == "mixed"
    assert Window(km, patch="origin-akin", storage="auto", rank=None).storage == "fp32"
    targeted = Window(km, patch="origin-akin", budget_tokens=4096, storage="mixed", max_kl=1e-3)
    targeted.append(A)
    targeted.append(B)
    assert len(targeted.stats().kl_ranks) == 1


def _ranks(patch) -> list[tuple[int, int]]:
    return [(0 if lp.k is None else lp.k.rank, 0 if lp.v is None else lp.v.rank) for lp in patch.layers]


def test_alloc_spreads_the_budget_as_the_evaluations_allocator_does():
    from tools.bench.fits import fit_patch as eval_fit
    from kamera_core import budget as kb

    km = _km("tiny-llama-gqa")
    win = Window(km, patch="origin-akin", budget_tokens=4096, fit="alloc", storage="fp16", patch_bytes=0.1, guard=False)
    win.append(A)
    b = win.append(B)
    stored = next(iter(win._chunks[b].patches.values()))
    budget = int(0.1 * _kv_bytes(win._chunks[b].canonical))
    deltas, _, _ = _captured(km, win, b)
    assert _ranks(stored) == _ranks(eval_fit(deltas, "kamera-alloc", budget, "fp16"))
    assert len(set(_ranks(stored))) > 1 and stored.nbytes <= budget
    # A fixed rank with the allocator: the bytes of that rank in every layer, spread.
    ranked = Window(km, patch="origin-akin", budget_tokens=4096, rank=3, fit="alloc", storage="fp16", guard=False)
    ranked.append(A)
    b = ranked.append(B)
    stored = next(iter(ranked._chunks[b].patches.values()))
    tokens = int(deltas[0][0].shape[0])
    rank3 = 3 * sum(kb.bytes_per_rank(tokens, dk[0].numel(), "fp16") + kb.bytes_per_rank(tokens, dv[0].numel(), "fp16")
                    for dk, dv in deltas)
    assert _ranks(stored) == _ranks(eval_fit(deltas, "kamera-alloc", rank3, "fp16")) and stored.nbytes <= rank3
    assert _ranks(stored) != [(3, 3)] * len(deltas)


def test_patch_settings_are_checked():
    km = _km("tiny-llama-gqa")
    for args, match in [({"rank": 4, "patch_bytes": 0.1}, "patch_bytes sets the ranks"),
                        ({"rank": None, "patch_bytes": 0.1}, "patch_bytes sets the ranks"),
                        ({"patch_bytes": 0}, "patch_bytes must be a fraction"),
                        ({"patch_bytes": 1.5}, "patch_bytes must be a fraction"),
                        ({"fit": "ranks"}, "fit must be one of"),
                        ({"rank": "auto"}, "rank must be 'budget'"),
                        ({"storage": "int4"}, "storage must be one of")]:
        with pytest.raises(ValueError, match=match):
            Window(km, **{"patch": "origin-akin", **args})
    assert Window(km, rank=None).storage == "fp32" and Window(km, patch="origin-akin", rank=4).patch_bytes is None


def test_the_window_default_is_the_fit_the_evaluation_chose_on_validation():
    """The committed evaluation results (`agentwin bench eval`) name the Kamera method chosen on
    validation at a 6% byte cap in most groups; the window's defaults are that method."""
    import json
    from pathlib import Path

    from tools.bench.selection import window_default
    from agentwin.patches.fit import DEFAULT_PATCH_BYTES

    results = Path(__file__).resolve().parents[2] / "docs" / "results"
    chosen = window_default([json.loads((results / f"eval_{n}.json").read_text()) for n in ("binding", "smollm2")])
    from tools.bench.workloads import storage_of
    from agentwin.patches.fit import patch_settings

    fit, storage = storage_of(chosen["method"].removeprefix("kamera-"))
    defaults = vars(WindowConfig())
    settings = patch_settings(_km("tiny-llama-gqa"), defaults["rank"], defaults["patch_bytes"], defaults["storage"],
                              defaults["guard"], defaults["max_kl"], defaults["fit"])
    assert (settings.rank, settings.fit, settings.storage) == ("budget", fit, storage), chosen
    assert DEFAULT_PATCH_BYTES == 0.06


def test_byte_ladder_grows_by_root_two_and_skips_rungs_that_buy_nothing():
    from types import SimpleNamespace

    from kamera_core.fit_batch import byte_ladder

    asked, fits = [], []

    def fit():
        fits.append(1)

        def at(budget):
            asked.append(budget)
            return SimpleNamespace(nbytes=min(budget, 250) // 50 * 50)  # bought in steps of 50 bytes, at most 250
        return at

    ladder = byte_ladder(fit, 100, 1000)
    assert fits == []  # lazy: nothing is fitted before the first rung is asked for
    got = [p.nbytes for p in ladder]
    assert fits == [1]  # one decomposition for the whole ladder
    assert asked == [100, 142, 200, 283, 400, 566, 800, 1000]
    assert got == [100, 200, 250]  # 142 buys what 100 did; from 283 on, nothing more
    assert [p.nbytes for p in byte_ladder(fit, 100, 1000, step=2.0)] == [100, 200, 250]
    assert asked[8:] == [100, 200, 400, 800, 1000]
    with pytest.raises(ValueError, match="step must be above 1"):
        next(byte_ladder(fit, 100, 1000, step=1.0))
