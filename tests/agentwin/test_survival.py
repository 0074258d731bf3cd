"""Survival and its repair (`patch="survive"`, `agentwin.patches.policies.Refresh`), checked against the
transformers model's own forward: survivors keep the KV they were computed with, moved by exact
re-rotation; the repair recomputes the survivors near a change (their KV is then the model's own
for the new placement) and those too many evictions old, and nothing else."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from agentwin import KameraModel, Window
from agentwin.models.kv import relocate_kv
from agentwin.patches.policies import Refresh
from tests.agentwin.test_exact_window import Hook
from tests.support import assert_close, forward_growth

TEXTS = ["the harbour master keeps the tide log", "she wrote the storm surge in it",
         "the keeper climbed the tower at dawn", "he replaced the cracked diaphragm",
         "the ferry left two hours late", "nobody asked why", "the gulls came back"]
QUERY = "who climbed the tower?"


@functools.lru_cache(maxsize=None)
def _km(name: str = "tiny-llama-gqa") -> KameraModel:
    return KameraModel.from_pretrained(name)


def _model_kv(km: KameraModel, texts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token-major KV of the model's own forward over the texts in order."""
    return km.prefill_kv([km.tokenize(t) for t in texts])


def _window(patch, n=4) -> tuple[Window, list]:
    """A pinned head and three chunks, read, then one more appended: the first unpinned chunk leaves."""
    km = _km()
    sizes = [len(km.tokenize(t)) for t in TEXTS]
    win = Window(km, budget_tokens=sum(sizes[:n]) + 2, patch=patch)
    ids = [win.append(TEXTS[0], pin=True)] + [win.append(t) for t in TEXTS[1:n]]
    win.next_token_logprobs(QUERY)
    win.append(TEXTS[n])  # TEXTS[1] leaves
    assert win.chunks() == [ids[0], *ids[2:], n]
    return win, sizes


def test_survivors_keep_their_kv_moved_by_exact_rotation():
    km = _km()
    win, sizes = _window("survive")
    segments = win.segments()
    before = _model_kv(km, TEXTS[:4])  # the KV the survivors were computed with
    start_old = sizes[0] + sizes[1]
    seg = segments[0][1]  # TEXTS[2], now right after the head
    assert seg.first == sizes[0] and seg.shift == sizes[0] - start_old
    old = [(k[start_old:start_old + sizes[2]], v[start_old:start_old + sizes[2]]) for k, v in before]
    moved = relocate_kv(old, km.specs, km.layout, seg.shift)[0]
    placed = relocate_kv([(s.keys, s.values) for s in (segments[0][1],)], km.specs[:1], km.layout, seg.shift)[0]
    # the window's forward and the model's prefill of the same tokens round differently (forward_growth)
    growth = forward_growth(km.model.config)
    assert_close(placed[0], moved[0], what="moved keys", growth=growth)
    assert_close(seg.values, old[0][1], what="kept values", growth=growth)
    # ... and not the model's own KV there: the chunk that left is still in them
    now = _model_kv(km, [TEXTS[0], TEXTS[2]])
    # layer 0 values are token-local: one projection over hidden_size terms apart (√hidden_size)
    assert_close(seg.values, now[0][1][sizes[0]:], what="layer 0 values", growth=math.sqrt(km.model.config.hidden_size))
    deep = [s for s in segments[-1] if s.first == sizes[0]][0]
    assert float((deep.values - now[-1][1][sizes[0]:]).abs().max()) > 1e-3
    s = win.stats()
    assert "recompute" not in s.forward_tokens and s.approximate > 0


def test_refresh_recomputes_the_survivors_near_the_change_with_the_models_own_kv():
    km = _km()
    _, sizes = _window("survive")
    near = sizes[2]  # the first survivor, not the second
    win, _ = _window(Refresh(near_tokens=near, max_age=None))
    with Hook(km) as hook:
        segments = win.segments()
    assert win.stats().forward_tokens["recompute"] == sizes[2]
    own = _model_kv(km, [TEXTS[0], TEXTS[2]])
    first = [s for s in segments[-1] if s.first == sizes[0]][0]
    assert first.shift == 0
    assert_close(first.values, own[-1][1][sizes[0]:], what="recomputed values", growth=forward_growth(km.model.config))
    second = [s for s in segments[-1] if s.first == sizes[0] + sizes[2]][0]
    assert second.shift != 0  # kept and moved
    # two forwards: the recomputed survivor after the head, then (after the kept one) the new chunk
    assert [(len(ids), first) for ids, first in hook.calls] == [(sizes[2], sizes[0]),
                                                                (sizes[4], sizes[0] + sizes[2] + sizes[3])]


def test_refresh_bounds_and_limits():
    km = _km()
    exact, _ = _window("exact")
    wide, _ = _window(Refresh(near_tokens=10 ** 6, max_age=None))
    kept, _ = _window(Refresh(near_tokens=0, max_age=None))
    survive, _ = _window("survive")
    ref = exact.reference_logprobs(QUERY)
    exact.next_token_logprobs(QUERY)
    # everything recomputed: exact, to float32 rounding through the forward (forward_growth)
    assert_close(wide.next_token_logprobs(QUERY), ref, what="next-token log-probabilities", growth=forward_growth(km.model.config))
    assert wide.stats().forward_tokens == exact.stats().forward_tokens
    assert torch.equal(kept.next_token_logprobs(QUERY), survive.next_token_logprobs(QUERY))  # nothing: survival
    assert float((survive.next_token_logprobs(QUERY) - ref).abs().max()) > 1e-3
    with pytest.raises(ValueError):
        Refresh(near_tokens=-1)
    with pytest.raises(ValueError):
        Refresh(max_age=0)
    with pytest.raises(ValueError, match="patch"):
        Window(km, patch=Refresh(), rank=4)


def test_refresh_recomputes_a_survivor_once_it_is_max_age_evictions_old():
    km = _km()
    win = Window(km, patch=Refresh(near_tokens=0, max_age=2))
    win.append(TEXTS[0], pin=True)
    for t in TEXTS[1:4]:
        win.append(t)
    win.next_token_logprobs(QUERY)
    recomputed = []
    for t in TEXTS[4:7]:  # one eviction each: the oldest after the head
        win.evict(win.chunks()[1])
        win.append(t)
        before = win.stats().forward_tokens.get("recompute", 0)
        win.next_token_logprobs(QUERY)
        recomputed.append(win.stats().forward_tokens.get("recompute", 0) - before)
    assert win.stats().evictions == 3
    # the first eviction: every survivor one eviction old, kept; the second: two old, recomputed
    assert recomputed[0] == 0 and recomputed[1] > 0
