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


def test_a_read_scores_a_continuation_as_the_model_does_in_one_pass(km):
    """read(query, continuation=ids): the log-probabilities after the query and after each given
    token are the model's own forward of the same tokens; one forward, the reply counted as
    decoding; and greedy tokens read off the forced pass equal the window's own greedy decode."""
    import torch

    from tools.bench.strategies import forced_tokens
    from tests.support import assert_close, forward_growth

    win = Window(km)
    win.append("the harbour master keeps the tide log")
    win.append(" and the keeper climbs the tower at dawn")
    own = win.read(" who climbs?", max_new_tokens=6)
    reply = list(own.token_ids) + ([own.end_token] if own.end_token is not None else [])
    fresh = Window(km)
    fresh.append("the harbour master keeps the tide log")
    fresh.append(" and the keeper climbs the tower at dawn")
    read = fresh.read(" who climbs?", continuation=reply[:-1])
    s = fresh.stats()
    assert s.passes == 1 and s.forward_tokens["decode"] == len(reply) - 1
    ids = torch.cat([fresh.input_ids(" who climbs?"), torch.tensor(reply[:-1], dtype=torch.long)])
    with torch.no_grad():
        theirs = torch.log_softmax(km.model(input_ids=ids[None]).logits[0].float(), -1)[-len(reply):]
    growth = forward_growth(km.model.config)
    assert_close(read.logprobs, theirs[0], what="after the query", growth=growth)
    assert_close(read.continuation_logprobs, theirs[1:], what="after each reply token", growth=growth)
    eos = {km.model.config.eos_token_id} if km.model.config.eos_token_id is not None else set()
    assert forced_tokens(read.logprobs, read.continuation_logprobs, reply, eos) == reply
    other = [t + 1 for t in reply]  # a reply this window would not give: it departs at once
    assert forced_tokens(read.logprobs, read.continuation_logprobs, other, eos) == reply[:1]
    with pytest.raises(ValueError, match="not both"):
        fresh.read(" who climbs?", max_new_tokens=2, continuation=reply)
    with pytest.raises(ValueError, match="token ids"):
        fresh.read(" who climbs?", continuation=[-1])
    empty = fresh.read(" who climbs?", continuation=[])
    assert empty.continuation_logprobs.shape == (0, read.logprobs.numel())
    assert_close(empty.logprobs, theirs[0], what="an empty continuation", growth=growth)
