"""The eviction policies behind one interface (`agentwin.eviction`): FIFO, LRU and relevance, the
chunks a caller keeps for one operation, and relevance through the window's own key summaries."""

from __future__ import annotations

import pytest
import torch

from agentwin import KameraModel, Text, Window
from agentwin.eviction import Fifo, Lru, Relevant, make_eviction

TOPICS = ["the harbour master keeps the tide log and the storm book",
          "0123456789 0123456789 0123456789 0123456789 0123",
          "zzzz yyyy xxxx wwww zzzz yyyy xxxx wwww zzzz yyyy x"]


@pytest.fixture(scope="module")
def km() -> KameraModel:
    torch.manual_seed(0)
    return KameraModel.from_pretrained("tiny-llama-gqa")


def test_each_policy_ranks_and_plans_behind_one_interface():
    order, sizes = ["a", "b", "c", "d"], {"a": 3, "b": 3, "c": 3, "d": 3}
    assert Fifo().plan(order, sizes, set(), 3, 12) == ["a"]
    lru = Lru()
    for c in ("b", "a", "d", "c"):
        lru.used(c)
    assert lru.plan(order, sizes, set(), 3, 12) == ["b"]
    rel = Relevant()
    assert rel.plan(order, sizes, set(), 3, 12) == ["a"]  # no target yet: oldest first
    rel.target(lambda chunks: {"a": 0.9, "b": 0.1, "c": 0.1, "d": 0.5})
    assert rel.plan(order, sizes, set(), 6, 12) == ["b", "c"]  # least relevant first, ties in window order
    assert rel.plan(order, sizes, {"b"}, 6, 12) == ["c", "d"]  # pinned (or kept) never chosen
    asked = []
    rel.target(lambda chunks: asked.append(list(chunks)) or {c: 0.0 for c in chunks})
    rel.plan(order, sizes, {"a"}, 3, 12)
    assert asked == [["b", "c", "d"]]  # only the candidates are scored
    with pytest.raises(ValueError, match="pinned"):
        Fifo().plan(order, sizes, {"a", "b", "c"}, 6, 12)
    assert isinstance(make_eviction("relevant"), Relevant)
    with pytest.raises(ValueError, match="relevant"):
        make_eviction("random")


def test_a_relevance_window_drops_the_chunk_least_like_the_query(km):
    budget = sum(len(km.tokenize(t)) for t in TOPICS)
    win = Window(km, budget_tokens=budget, evict="relevant")
    ids = [win.append(Text(t)) for t in TOPICS]
    query = "the harbour master keeps the storm book"  # like the oldest chunk: FIFO would drop it
    win.relevant_to(query)
    # The expected victim from the model's own key summaries, not from the window's code.
    probe = km.key_summary(km.tokenize(query))
    cosine = {c: float(torch.nn.functional.cosine_similarity(km.key_summary(km.tokenize(t)), probe, dim=-1).mean())
              for c, t in zip(ids, TOPICS)}
    least = min(ids, key=lambda c: (cosine[c], c))
    assert least != ids[0]
    win.append(Text("x"))  # one token over: one chunk goes
    assert [c for c in ids if c not in win.chunks()] == [least]
    assert win.stats().forwards["retrieval"] == 1  # the query encoded once
    win.relevant_to(None)  # oldest first again
    first = win.chunks()[0]
    filler = "y" * (win.budget_tokens - win.tokens() + 1)  # one token over: the oldest goes
    assert len(km.tokenize(filler)) == len(filler) < win.budget_tokens
    win.append(Text(filler))
    assert first not in win.chunks()
    win.check_integrity()


def test_relevance_needs_its_window_and_a_query(km):
    with pytest.raises(ValueError, match="evict='relevant'"):
        Window(km).relevant_to("q")
    win = Window(km, evict="relevant")
    with pytest.raises(TypeError, match="str"):
        win.relevant_to(3)
    with pytest.raises(ValueError, match="no tokens"):
        win.relevant_to("")


def test_slide_and_recall_keep_what_the_caller_names(km):
    sizes = [len(km.tokenize(t)) for t in TOPICS]
    win = Window(km, budget_tokens=sum(sizes))
    a, b, c = (win.append(Text(t)) for t in TOPICS)
    assert win.slide(sizes[1], keep=[a]) == [b]  # FIFO would take a: kept, so the next oldest
    d = win.append(Text("q" * 5))
    assert win.recall(b, keep=[a]) == [c]  # needs room: a kept, c the oldest of the rest
    assert win.chunks() == [a, b, d]
    state = win.chunks()
    with pytest.raises(ValueError, match="kept"):
        win.slide(sum(sizes), keep=win.chunks())
    assert win.chunks() == state  # refused before anything changed
