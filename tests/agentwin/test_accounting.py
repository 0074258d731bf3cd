"""Every token the model computes is counted, and no computed token is counted as relocated.

The model's own forward is hooked, so the count is checked against what really ran, not against
the window's counters. A relocation is a chunk served at a placement by a shift (and patch) with
no forward of it there; tokens a forward computed at that placement must never be counted so."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from agentwin.models.adapter import KameraModel
from agentwin.window import Text, Window

TEXTS = ["the harbour master keeps the tide log", "she wrote the storm surge in it",
         "the keeper climbed the tower at dawn", "he replaced the cracked diaphragm",
         "the ferry left two hours late", "nobody asked why"]
QUERY = "who climbed the tower?"


@functools.lru_cache(maxsize=None)
def _km(name: str) -> KameraModel:
    return KameraModel.from_pretrained(name)


class ForwardLog:
    """(token ids, first position) of every forward of the transformers model, and the token rows
    each computed (batch × length: the patch guard's probe forward is a batch of two)."""

    def __init__(self, km: KameraModel) -> None:
        self.calls: list[tuple[tuple[int, ...], int]] = []
        self.rows: list[int] = []
        self._handle = km.model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids")
        ids = args[0] if ids is None and args else ids
        if ids is None:
            raise AssertionError("a forward without input_ids: this test cannot see its tokens")
        positions = kwargs.get("position_ids")
        first = 0 if positions is None else int(positions.reshape(-1)[0])
        self.calls.append((tuple(int(t) for t in ids[0]), first))
        self.rows.append(int(ids.numel()))

    @property
    def tokens(self) -> int:
        return sum(self.rows)

    def close(self) -> None:
        self._handle.remove()


def _placements(win: Window) -> list[tuple[tuple[int, ...], int, int]]:
    """(ids, start, index) of each chunk in window order (text chunks: one position per token)."""
    out, start = [], 0
    ids = win.input_ids()
    for index, cid in enumerate(win.chunks()):
        n = win.chunk_tokens(cid)
        out.append((tuple(int(t) for t in ids[start:start + n]), start, index))
        start += n
    return out


def _computed_here(chunk: tuple[int, ...], start: int, calls) -> bool:
    """Whether a forward in `calls` computed these tokens at this first position."""
    for ids, first in calls:
        for offset in range(len(ids) - len(chunk) + 1):
            if first + offset == start and ids[offset:offset + len(chunk)] == chunk:
                return True
    return False


@pytest.mark.parametrize("rank", [None, 2], ids=["exact", "rank2"])
@pytest.mark.parametrize("policy", ["origin", "origin-akin", "fresh"])
@pytest.mark.parametrize("seed", range(2))
def test_forwarded_tokens_are_counted_and_never_called_relocated(rank, policy, seed):
    km = _km("tiny-llama-gqa")
    win = Window(km, budget_tokens=120, patch=policy, rank=rank)
    rng = random.Random(seed)
    log = ForwardLog(km)
    evicted: list = []
    try:
        for step in range(14):
            op = rng.choice(["append", "append", "evict", "recall", "reorder", "query"])
            before = (log.tokens, len(log.calls), win.stats().relocated_tokens)
            if op == "append":
                win.append(Text(TEXTS[rng.randrange(len(TEXTS))]))
            elif op == "evict" and win.chunks():
                victim = rng.choice(win.chunks())
                win.evict(victim)
                evicted.append(victim)
            elif op == "recall" and evicted:
                try:
                    win.recall(evicted.pop(rng.randrange(len(evicted))))
                except ValueError:
                    pass
            elif op == "reorder" and win.chunks():
                order = win.chunks()
                rng.shuffle(order)
                win.reorder(order)
            if not win.chunks():
                continue
            calls_before = len(log.calls)
            win.next_token_logprobs(QUERY)
            s = win.stats()
            assert s.forwarded_tokens == log.tokens, f"step {step} ({op}): counted {s.forwarded_tokens}, ran {log.tokens}"
            relocated = s.relocated_tokens - before[2]
            calls = log.calls[before[1]:]
            # Chunks not computed at their placement during this operation, and not at (nothing, 0)
            # where canonical KV is the chunk's own first computation: the most that can be relocated.
            movable = sum(len(ids) for ids, start, index in _placements(win)
                          if index > 0 and not _computed_here(ids, start, calls))
            assert relocated <= movable, f"step {step} ({op}): {relocated} relocated, at most {movable} were not computed"
            assert len(log.calls) > calls_before  # the query itself ran
    finally:
        log.close()


def test_a_window_that_reads_everything_from_the_store_relocates_all_but_the_first_chunk():
    km = _km("tiny-llama-gqa")
    first = Window(km, patch="origin", rank=2)
    for t in TEXTS[:3]:
        first.append(t)
    again = Window(km, patch="origin", rank=2, store=first.store)
    log = ForwardLog(km)
    try:
        for t in TEXTS[:3]:
            again.append(t)
        again.next_token_logprobs(QUERY)
    finally:
        log.close()
    s = again.stats()
    assert log.tokens == s.forwarded_tokens == s.forward_tokens["query"] == len(km.tokenize(QUERY))
    assert s.relocated_tokens == sum(len(km.tokenize(t)) for t in TEXTS[1:3])
    assert s.store_hit_tokens == sum(len(km.tokenize(t)) for t in TEXTS[:3])


def test_wall_time_counts_each_public_operation_once():
    km = _km("tiny-llama-gqa")
    win = Window(km, budget_tokens=80, patch="origin", rank=2)
    for t in TEXTS[:4]:  # the later appends evict inside the append
        win.append(t)
    win.next_token_logprobs(QUERY)
    s = win.stats()
    assert s.evictions >= 1 and s.seconds["evict"] > 0
    outer = s.seconds["append"] + s.seconds["next_token_logprobs"]
    assert s.wall_s == pytest.approx(outer, rel=1e-9)
    assert s.wall_s < outer + s.seconds["evict"]
