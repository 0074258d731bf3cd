"""Deciders: scripted replies for tests, and the window's model with a primed JSON reply."""

import pytest

from agents.actions import parse_action
from agents.model import Decider, ScriptedDecider, ScriptExhausted, WindowDecider


class _Window:
    """Records the query and answers like Window.generate."""

    def __init__(self, continuation):
        self.continuation, self.queries = continuation, []

    def generate(self, query, max_new_tokens=32):
        self.queries.append((query, max_new_tokens))
        return self.continuation


def test_window_decider_primes_a_json_action():
    window = _Window('next"} and then some prose')
    decider = WindowDecider(max_new_tokens=7)
    assert isinstance(decider, Decider)
    reply = decider.decide(window, "Task: x\\nAction:")
    assert reply == '{"action": "next"} and then some prose' and parse_action(reply) == {"action": "next"}
    assert window.queries == [('Task: x\\nAction: {"action": "', 7)]
    plain = WindowDecider(prime="")
    assert plain.decide(_Window("free text"), "Q") == "free text"


def test_window_decider_checks_its_arguments():
    with pytest.raises(ValueError, match="max_new_tokens"):
        WindowDecider(max_new_tokens=0)
    with pytest.raises(TypeError, match="prime"):
        WindowDecider(prime=None)


def test_scripted_decider_replays_lists_and_functions():
    script = ScriptedDecider(["raw text", {"action": "next"}])
    assert script.decide(None, "p1") == "raw text"
    assert script.decide(None, "p2") == '{"action": "next"}'
    assert script.prompts == ["p1", "p2"]
    with pytest.raises(ScriptExhausted, match="has 2 replies and was asked for reply 3"):
        script.decide(None, "p3")
    counter = ScriptedDecider(lambda window, prompt: {"action": "goto", "page": len(prompt)})
    assert counter.decide(None, "abc") == '{"action": "goto", "page": 3}'
    with pytest.raises(TypeError, match="str or dict"):
        ScriptedDecider([1])


class _Tokens:
    """One token per character (ids = code points), enough for a decoder test."""

    def decode(self, ids):
        return "".join(map(chr, ids))


class _DecodingWindow:
    """Decodes a fixed continuation token by token, as `Window.generate_ids` does: the stop
    function is asked after each token, the processor (when given) before each choice."""

    def __init__(self, continuation):
        self.km = type("Km", (), {"tokenizer": _Tokens()})()
        self.continuation, self.calls = continuation, []

    def generate_ids(self, query, max_new_tokens=32, logits_processor=None, stop=None):
        self.calls.append((query, max_new_tokens, logits_processor))
        out = []
        for ch in self.continuation[:max_new_tokens]:
            out.append(ord(ch))
            if stop is not None and stop(out):
                break
        return out


def test_window_decider_stops_where_the_action_closes():
    """Decoding ends at the token that closes the action object, not at max_new_tokens: nothing
    is generated after it, and the decision says so."""
    window = _DecodingWindow('next"} and then some prose that would run on and on')
    decider = WindowDecider(max_new_tokens=48)
    reply = decider.decide(window, "Task: x\\nAction:")
    assert reply == '{"action": "next"}' and parse_action(reply) == {"action": "next"}
    assert decider.last == {"generated_tokens": 6, "tokens_after_close": 0, "constrained": False}
    quoted = _DecodingWindow('answer", "text": "a } inside"} more')
    assert WindowDecider().decide(quoted, "Q") == '{"action": "answer", "text": "a } inside"}'
    unfinished = WindowDecider(max_new_tokens=5)
    assert unfinished.decide(_DecodingWindow('goto", "page": 3}'), "Q") == '{"action": "goto"'
    assert unfinished.last["tokens_after_close"] is None  # cut off before it closed


@pytest.mark.slow
def test_window_decider_holds_the_reply_to_the_action_schema(smollm2):
    """With the actions known, every token is masked to the schema (xgrammar): a model that would
    write an unknown action and prose writes a valid action instead and stops at its close."""
    import torch

    from agentwin import KameraModel

    model, tokenizer = smollm2
    km = KameraModel(model, tokenizer, name="smollm2")
    wanted = tokenizer('fly", "to": "moon"} and more', add_special_tokens=False).input_ids
    close = tokenizer('"}', add_special_tokens=False).input_ids[-1]

    class Window:
        def __init__(self):
            self.km = km

        def generate_ids(self, query, max_new_tokens=32, logits_processor=None, stop=None):
            out, ids = [], torch.tensor([tokenizer(query, add_special_tokens=False).input_ids])
            for i in range(max_new_tokens):
                scores = torch.zeros(1, km.model.config.vocab_size)
                scores[0, close] = 5.0  # its second choice, once the prose runs out
                if i < len(wanted):
                    scores[0, wanted[i]] = 10.0  # the model's favourite
                scores = logits_processor(torch.cat([ids, torch.tensor([out], dtype=torch.long)], 1), scores)
                out.append(int(scores[0].argmax()))
                if stop(out):
                    break
            return out

    decider = WindowDecider(max_new_tokens=40)
    decider.use_actions({"next": "go to the next page", "goto": '{"page": N} open page N'})
    reply = decider.decide(Window(), "Task: x\\nAction:")
    action = parse_action(reply, allowed={"next", "goto", "recall", "answer"})
    assert reply.endswith("}") and decider.last["constrained"] and decider.last["tokens_after_close"] == 0
    assert set(action) <= {"action", "page", "step", "query", "time", "text"}
