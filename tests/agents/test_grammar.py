"""Action schemas from the environments' action lists, and decoding held to them (xgrammar)."""

import pytest

from agents.doc import PdfEnv, write_text_pdf
from agents.grammar import action_schema


def _variants(schema):
    return {v["properties"]["action"]["const"]: v for v in schema["anyOf"] if v["properties"]["action"]["const"] != "recall"}


def test_schema_types_come_from_the_action_descriptions(tmp_path):
    with PdfEnv(write_text_pdf(tmp_path / "a.pdf", ["one", "two", "three"])) as env:
        schema = action_schema(env.actions(), env.action_arguments())
    v = _variants(schema)
    assert set(v) == {"next", "previous", "goto", "search", "answer"}
    assert v["next"]["required"] == ["action"] and v["next"]["additionalProperties"] is False
    assert v["goto"]["properties"]["page"] == {"type": "integer", "minimum": 1, "maximum": 3}
    assert v["search"]["properties"]["text"]["type"] == "string" and v["answer"]["required"] == ["action", "text"]
    recalls = [v["properties"] for v in schema["anyOf"] if v["properties"]["action"]["const"] == "recall"]
    assert [sorted(set(p) - {"action"}) for p in recalls] == [["step"], ["query"], ["time"]]
    web = _variants(action_schema({"type": '{"element": N, "text": "...", "submit": false} - fill',
                                   "seek": '{"time": SECONDS} - go', "back": "{} - back"}))
    assert web["type"]["required"] == ["action", "element", "text"]  # the boolean is optional
    assert web["type"]["properties"]["submit"] == {"type": "boolean"}
    assert web["seek"]["properties"]["time"] == {"type": "number"} and web["back"]["required"] == ["action"]
    with pytest.raises(ValueError, match="non-empty dict"):
        action_schema({})
    with pytest.raises(ValueError, match="cannot read the arguments"):
        action_schema({"goto": "{page: N} open it"})


@pytest.mark.slow
def test_the_constraint_is_a_transformers_logits_processor(smollm2):
    """`ActionConstraint` plugs into transformers' `LogitsProcessorList`: after the prime, only
    tokens that continue a valid action survive, and the object closes on the schema's last token."""
    import torch
    from transformers import LogitsProcessorList

    from agents.grammar import ActionGrammar

    model, tokenizer = smollm2
    vocab = model.config.vocab_size
    grammar = ActionGrammar(tokenizer, vocab)
    schema = action_schema({"next": "go on", "goto": '{"page": N} open page N'})
    constraint = grammar.constraint(schema, '{"action": "')
    prompt = torch.tensor([tokenizer("Action: {\"action\": \"", add_special_tokens=False).input_ids])
    scores = LogitsProcessorList([constraint])(prompt, torch.zeros(1, vocab))
    allowed = {tokenizer.decode([int(t)]) for t in torch.nonzero(scores[0] > float("-inf")).flatten()}
    assert {"next", "goto"} & allowed and "fly" not in allowed and not any("}" in a for a in allowed)
    ids = prompt
    for piece in tokenizer('next"}', add_special_tokens=False).input_ids:
        assert not constraint.closed
        scores = LogitsProcessorList([constraint])(ids, torch.zeros(1, vocab))
        assert scores[0, piece] == 0  # allowed
        ids = torch.cat([ids, torch.tensor([[piece]])], 1)
    constraint(ids, torch.zeros(1, vocab))  # accepts the last token
    assert constraint.closed
