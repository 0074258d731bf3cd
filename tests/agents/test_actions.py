"""Tolerant parsing of the model's JSON actions and the retry message for what cannot be read."""

import pytest

from agents.actions import MalformedAction, describe_actions, parse_action, retry_message


@pytest.mark.parametrize("reply, expected", [
    ('{"action": "next"}', {"action": "next"}),
    ('```json\n{"action": "goto", "page": 3}\n```', {"action": "goto", "page": 3}),
    ("```\n{'action': 'search', 'text': 'fog horn'}\n```", {"action": "search", "text": "fog horn"}),
    ("{'action': 'goto', 'page': 2,}", {"action": "goto", "page": 2}),
    ('Sure. {"action": "Next"} I moved on. {"action": "previous"}', {"action": "next"}),
    ('I think {maybe} then {"action": "previous"}', {"action": "previous"}),
    ('{"action": "answer", "text": "it\'s {not} a brace"}', {"action": "answer", "text": "it's {not} a brace"}),
    ('{"action": "answer", "text": "Anja Roth", "sure": true, "note": null}',
     {"action": "answer", "text": "Anja Roth", "sure": True, "note": None}),
    ('{"action": "answer", "text": "The keeper is Tobias', {"action": "answer", "text": "The keeper is Tobias"}),
    ('{"action": "recall", "step": 2, "why": {"page": 1}}', {"action": "recall", "step": 2, "why": {"page": 1}}),
])
def test_parse_action_tolerates_common_model_output(reply, expected):
    assert parse_action(reply) == expected


@pytest.mark.parametrize("reply, message", [
    ("", "empty"),
    ("   \n", "empty"),
    ("I will go to the next page.", "no JSON object"),
    ('["next"]', "no JSON object"),
    ('{"page": 3}', 'no "action"'),
    ('{"action": 7}', 'no "action"'),
    ("{action: next}", "could not read"),
])
def test_parse_action_rejects_unusable_replies_with_a_reason(reply, message):
    with pytest.raises(MalformedAction, match=message):
        parse_action(reply)


def test_parse_action_refuses_unknown_actions_and_names_the_choices():
    with pytest.raises(MalformedAction, match="unknown action 'fly'; choose one of answer, next"):
        parse_action('{"action": "fly"}', allowed={"next", "answer"})
    assert parse_action('{"action": " NEXT "}', allowed={"next"}) == {"action": "next"}


def test_parse_action_needs_text():
    with pytest.raises(MalformedAction, match="must be text"):
        parse_action(None)


def test_retry_message_quotes_the_error_and_shows_an_example():
    message = retry_message(MalformedAction("no JSON object in the reply 'hello'"))
    assert "no JSON object in the reply 'hello'" in message
    assert parse_action(message) == {"action": "answer", "text": "..."}  # its example parses


def test_describe_actions_gives_one_json_example_per_action():
    text = describe_actions({"next": "go on", "goto": '{"page": N} open page N', "seek": '{"time": S} - that second',
                             "stay": "{} - nothing"})
    lines = text.splitlines()
    assert lines[:4] == ['- {"action": "next"} go on', '- {"action": "goto", "page": N} open page N',
                         '- {"action": "seek", "time": S} that second', '- {"action": "stay"} nothing']
    assert lines[4].startswith('- {"action": "recall", "step": N} ') and lines[5].startswith('- {"action": "answer", "text": "..."}')
    assert parse_action(lines[0]) == {"action": "next"}
