"""agentwin.chat: a window built from a head, parts and a question reads exactly the tokens of the
model's own chat template (the tokenizer's `apply_chat_template`, an oracle not written here), and
its reads equal the model's own forward of them."""

from __future__ import annotations

import pytest
import torch

from agentwin import KameraModel, Window
from agentwin.chat import Chat, chat_format
from tests.support import assert_close, forward_growth

SYSTEM = "You answer questions about the pages. Answer briefly."
PARTS = [
    "Page 1\n| item | price |\n|---|---|\n| tea | 3 EUR |\n| rope | 12 EUR |",
    "   def pump_speed(mode):\n    return {'eco': 40, 'boost': 90}[mode]\n\n",  # code, ragged whitespace
    "Mira Olsen runs the bakery on Dock Street since 2019. She opens at six.",
    "\n\n[video 00:10-00:20] A red van stops by the gate; 4 crates are unloaded.  ",
    "2024-03-01: the ferry left at 07:15, two hours late.",
]
QUESTION = "Who runs the bakery?"


@pytest.fixture(scope="module")
def smol(smollm2) -> KameraModel:
    model, tokenizer = smollm2
    return KameraModel(model, tokenizer, name="smollm2")


def _window(km: KameraModel, chat: Chat, parts) -> Window:
    win = Window(km, budget_tokens=4096)
    win.append(chat.head(SYSTEM), pin=True)
    for p in parts:
        win.append(chat.part(p))
    return win


@pytest.mark.parametrize("count", [1, 3, len(PARTS)])
def test_chunks_concatenate_to_the_models_own_template(smol, count):
    chat = Chat(smol)
    win = _window(smol, chat, PARTS[:count])
    ids = win.input_ids(chat.question(QUESTION))
    content = "".join(p.strip() + "\n" for p in PARTS[:count]) + QUESTION
    text = smol.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
                                              tokenize=False, add_generation_prompt=True)
    assert ids.tolist() == smol.tokenizer(text, add_special_tokens=False).input_ids
    assert torch.equal(ids, chat.reference_ids(SYSTEM, PARTS[:count], QUESTION))


def test_a_chat_window_reads_and_answers_as_the_model_does(smol):
    chat = Chat(smol)
    win = _window(smol, chat, PARTS)
    q = chat.question(QUESTION)
    ids = chat.reference_ids(SYSTEM, PARTS, QUESTION)
    with torch.no_grad():
        ref = smol.model(input_ids=ids[None]).logits[0, -1].float()
    # float32 rounding through the forward (tests.support.forward_growth)
    assert_close(win.next_token_logprobs(q), torch.log_softmax(ref, -1), what="next-token log-probabilities",
                 growth=forward_growth(smol.model.config))
    answer = win.generate(q, max_new_tokens=8)
    with torch.no_grad():
        theirs = smol.model.generate(ids[None], max_new_tokens=8, do_sample=False,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert answer == smol.tokenizer.decode(theirs[0, len(ids):], skip_special_tokens=True)
    assert "Mira" in answer  # the assistant's reply, not a continuation of the document


def test_without_a_system_text_the_template_default_opens_the_turn(smol):
    chat = Chat(smol)
    head = chat.head()
    text = smol.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                              add_generation_prompt=True)
    assert text.startswith(head.text) and "SmolLM" in head.text


def test_gemma3_has_a_built_in_format_and_tokenizes_at_chunk_boundaries_as_a_whole():
    km = KameraModel.from_pretrained("gemma3-270m")
    chat = Chat(km)
    assert chat.format.prefix.startswith("<bos><start_of_turn>user")
    whole = km.tokenize(chat.reference_text(SYSTEM, PARTS, QUESTION))
    win = _window(km, chat, PARTS)
    assert torch.equal(win.input_ids(chat.question(QUESTION)), whole)


def test_bad_input_is_refused_with_what_to_do():
    tiny = KameraModel.from_pretrained("tiny-llama-gqa")  # its byte tokenizer has no template
    with pytest.raises(ValueError, match="no chat template"):
        Chat(tiny)

    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="template="):
        chat_format(NoTemplate(), "llama")
    with pytest.raises(TypeError):
        Chat(object())


def test_parts_and_questions_must_hold_text(smol):
    chat = Chat(smol)
    with pytest.raises(ValueError, match="empty"):
        chat.part("  \n ")
    with pytest.raises(ValueError, match="empty"):
        chat.question("")
    with pytest.raises(TypeError):
        chat.part(3)
    custom = Chat(smol, template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                                 "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert custom.head(SYSTEM).text == f"<system>{SYSTEM}</s><user>"
    assert custom.question(QUESTION) == QUESTION + "</s><assistant>"
    with pytest.raises(ValueError, match="template"):
        Chat(smol, template="   ")
