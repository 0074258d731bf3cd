"""`agentwin.content`: chunks are checked when they are made, so text no model can read never
reaches the tokenizer or the patch fit."""

import pytest

from agentwin import Text


@pytest.mark.parametrize("text", [" ", "   ", "\n", "\t \n\r ", "\u00a0\u2003", "\u3000"])
def test_text_of_whitespace_only_is_refused(text):
    with pytest.raises(ValueError, match=r"Text is only whitespace .*at least one visible character"):
        Text(text)


@pytest.mark.parametrize("text, where", [("a\ud800b", "index 1"), ("\udfff", "index 0"),
                                         ("ok \udcff", "index 3"), ("\ud800\udc00", "index 0")])
def test_text_not_encodable_as_utf8_is_refused_at_construction(text, where):
    with pytest.raises(ValueError, match=rf"lone surrogate .*at {where}.*errors='replace'"):
        Text(text)


def test_ordinary_text_is_kept_as_given():
    for text in (" Tobias keeps the lighthouse.", "x", "\n[page 1/2]\nfacts\n", "π ≈ 3.14 🌊", " a "):
        assert Text(text).text == text


def test_the_other_checks_still_hold():
    with pytest.raises(TypeError, match="Text needs a str, got bytes"):
        Text(b"abc")
    with pytest.raises(ValueError, match="Text needs at least one character"):
        Text("")
