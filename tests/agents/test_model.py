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
