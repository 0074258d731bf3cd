"""Small parts of the window's public surface that users read: membership and length, a stats
summary a person can read, and clear errors for queries that are not text."""

from __future__ import annotations

import pytest

from agentwin import KameraModel, Window


@pytest.fixture(scope="module")
def km() -> KameraModel:
    return KameraModel.from_pretrained("tiny-llama-gqa")


def test_in_and_len_follow_the_window(km):
    win = Window(km)
    a, b = win.append("the harbour master"), win.append("keeps the tide log")
    assert len(win) == 2 and a in win and b in win and 99 not in win and "a" not in win
    win.evict(a)
    assert len(win) == 1 and a not in win
    win.recall(a)
    assert len(win) == 2 and a in win


def test_stats_read_as_a_summary_and_a_table(km):
    win = Window(km)
    win.append("the harbour master keeps the tide log")
    win.next_token_logprobs("who?")
    s = win.stats()
    text = repr(s)
    assert text.startswith("WindowStats(") and "tokens forwarded in 1 passes" in text and len(text) < 400
    assert f"{s.forwarded_tokens} tokens forwarded" in text and "in_context" in text
    table = s.table().splitlines()
    assert table[0].split()[-4:] == [str(s.forwarded_tokens), "in", "1", "passes"]
    assert any(line.strip().startswith("query") for line in table)


def test_a_query_that_is_not_text_is_refused_before_anything_runs(km):
    win = Window(km)
    win.append("the harbour master")
    with pytest.raises(ValueError, match="not valid text"):
        win.next_token_logprobs("who\ud800?")
    with pytest.raises(TypeError, match="str"):
        win.generate(b"who?")
    with pytest.raises(ValueError, match="no tokens"):
        win.read("")
    assert win.stats().passes == 0
