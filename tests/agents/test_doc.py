"""The PDF navigator against real PDFs written by the test and read by pypdfium2."""

import pytest

from agents.base import ActionError, Env, EnvError
from agents.doc import PdfEnv, SkimSearchDecider, write_text_pdf

PAGES = [
    "Harbour. The harbour master is Anja Roth. She keeps the tide log (in ink).",
    "Lighthouse. The keeper is Tobias Mertens; he repairs the fog horn every spring.",
    "Ferry. Captain Lena Okafor sails the Grey Heron at 07:15 from the north pier.",
    "School. Pavel Ilic runs the school and plays the organ on Sundays.",
]


@pytest.fixture
def pdf(tmp_path):
    return write_text_pdf(tmp_path / "island.pdf", PAGES)


def test_pages_text_and_moves(pdf):
    with PdfEnv(pdf) as env:
        assert isinstance(env, Env) and env.pages == 4
        first = env.reset()
        assert first.label == "page 1/4" and "Anja Roth" in first.text and "(in ink)" in first.text
        assert first.images == ()
        assert "Tobias Mertens" in env.act({"action": "next"}).text
        assert "Anja Roth" in env.act({"action": "previous"}).text
        third = env.act({"action": "goto", "page": "3"})
        assert third.label == "page 3/4" and "Grey Heron" in third.text and env.page == 3
        # The same page reached twice is the same content (what the loop's recall keys on).
        assert env.act({"action": "goto", "page": 3}).content_key() == third.content_key()
        assert env.act({"action": "goto", "page": 2}).content_key() != third.content_key()


def test_search_lists_pages_with_snippets(pdf):
    with PdfEnv(pdf) as env:
        env.reset()
        found = env.act({"action": "search", "text": "FOG   horn"})
        assert found.meta["pages"] == [2] and "Pages containing" in found.text and "fog horn" in found.text
        assert env.page == 1  # searching does not move
        many = env.act({"action": "search", "text": "the"})
        assert many.meta["pages"] == [1, 2, 3, 4]
        none = env.act({"action": "search", "text": "volcano"})
        assert none.meta["pages"] == [] and "No page contains" in none.text


@pytest.mark.parametrize("action, message", [
    ({"action": "goto", "page": 9}, "page 9 is out of range; the document has pages 1 to 4"),
    ({"action": "goto", "page": 0}, "out of range"),
    ({"action": "goto", "page": "two"}, "goto needs a page number"),
    ({"action": "goto"}, "goto needs a page number"),
    ({"action": "previous"}, "already at the first page"),
    ({"action": "search", "text": "  "}, "search needs a non-empty"),
    ({"action": "fly"}, "unknown action 'fly'"),
])
def test_refused_actions_say_why_and_leave_the_page(pdf, action, message):
    with PdfEnv(pdf) as env:
        env.reset()
        with pytest.raises(ActionError, match=message):
            env.act(action)
        assert env.page == 1


def test_next_at_the_last_page_is_refused(pdf):
    with PdfEnv(pdf) as env:
        env.act({"action": "goto", "page": 4})
        with pytest.raises(ActionError, match="already at the last page"):
            env.act({"action": "next"})


def test_render_gives_bounded_page_images(pdf):
    with PdfEnv(pdf, render=True, scale=4.0, max_pixels=200_000) as env:
        obs = env.reset()
        (image,) = obs.images
        assert image.mode == "RGB" and image.size[0] * image.size[1] <= 200_000
        assert image.size[1] > image.size[0]  # portrait Letter page
        assert image.getextrema() != ((255, 255), (255, 255), (255, 255))  # the text was drawn


def test_long_pages_are_cut_for_the_observation_but_searched_whole(tmp_path):
    path = write_text_pdf(tmp_path / "long.pdf", ["word " * 300 + "needle at the end"])
    with PdfEnv(path, max_chars=200) as env:
        obs = env.reset()
        assert len(obs.text) < 300 and "cut at 200 characters" in obs.text
        assert env.act({"action": "search", "text": "needle"}).meta["pages"] == [1]


def test_not_a_pdf_missing_damaged_and_encrypted_files_are_refused(tmp_path, pdf):
    text = tmp_path / "notes.pdf"
    text.write_text("just some notes, not a PDF\n")
    with pytest.raises(EnvError, match=r"not a PDF \(a PDF starts with '%PDF-'"):
        PdfEnv(text)
    with pytest.raises(EnvError, match="no such file"):
        PdfEnv(tmp_path / "missing.pdf")
    with pytest.raises(EnvError, match="not a file"):
        PdfEnv(tmp_path)
    damaged = tmp_path / "damaged.pdf"
    damaged.write_bytes(pdf.read_bytes()[:150])
    with pytest.raises(EnvError, match="damaged"):
        PdfEnv(damaged)
    # An /Encrypt dictionary whose empty user password does not match: pdfium asks for a password.
    encrypted = tmp_path / "encrypted.pdf"
    secret = (b"/Encrypt << /Filter /Standard /V 1 /R 2 /O <" + b"11" * 32 + b"> /U <" + b"22" * 32
              + b"> /P -4 >> /ID [<" + b"33" * 16 + b"> <" + b"33" * 16 + b">] ")
    encrypted.write_bytes(pdf.read_bytes().replace(b"trailer\n<< ", b"trailer\n<< " + secret))
    with pytest.raises(EnvError, match="encrypted; decrypt it first"):
        PdfEnv(encrypted)


def test_write_text_pdf_keeps_latin1_and_escapes(tmp_path):
    path = write_text_pdf(tmp_path / "x.pdf", ["Café (main) \\ back", "second\n\nparagraph"])
    with PdfEnv(path) as env:
        assert env.page_text(1) == "Café (main) \\ back"
        assert "second" in env.page_text(2) and "paragraph" in env.page_text(2)
    with pytest.raises(ValueError):
        write_text_pdf(tmp_path / "y.pdf", [])


def test_skim_search_policy_follows_observations(pdf):
    """The heuristic reads every page, searches, goes to the hit, recalls, answers."""
    import json

    policy = SkimSearchDecider("organ", answer_fn=lambda window: "Pavel Ilic", recall_step=0)
    moves = []
    with PdfEnv(pdf) as env:
        policy.observe(env.reset())
        while True:
            action = json.loads(policy.decide(None, ""))
            moves.append(action)
            if action["action"] in ("answer", "recall"):
                if action["action"] == "answer":
                    break
                continue
            policy.observe(env.act(action))
    assert [m["action"] for m in moves] == ["next", "next", "next", "search", "goto", "recall", "answer"]
    assert moves[4] == {"action": "goto", "page": 4} and moves[-1]["text"] == "Pavel Ilic"
