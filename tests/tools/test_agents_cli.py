"""`agentwin doc | web | video` from the command line: a run to its summary, and bad input."""

import json

import pytest

from agents.doc import write_text_pdf
from tools import cli


def test_doc_command_runs_the_model_to_the_step_limit_and_reports(tmp_path, capsys):
    """A random-weight tiny model cannot write JSON: every decision is malformed, the loop says so
    to the model, stops at --max-steps and reports it (exit 1: no answer)."""
    pdf = write_text_pdf(tmp_path / "a.pdf", ["The harbour master is Anja Roth.", "The keeper is Tobias."])
    out, log = tmp_path / "run.json", tmp_path / "steps.jsonl"
    code = cli.main(["doc", str(pdf), "--question", "Who is the keeper?", "--model", "tiny-llama-gqa",
                     "--max-steps", "3", "--max-new-tokens", "4", "--budget-tokens", "400", "--rank", "exact",
                     "--json", str(out), "--log", str(log), "--quiet"])
    assert code == 1
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["steps"] == 3 and s["stopped"] == "step limit" and s["answer"] is None
    decisions = data["steps"][1:]
    assert all((step["action"] is None) == bool(step["error"]) or step["error"] for step in decisions)
    assert s["malformed_replies"] == sum(step["action"] is None for step in decisions)
    assert s["model"] == "tiny-llama-gqa" and s["budget_tokens"] == 400
    assert [step["step"] for step in data["steps"]] == [0, 1, 2, 3]
    assert len(log.read_text().splitlines()) == 5  # four steps and the summary
    printed = capsys.readouterr().out
    assert "summary:" in printed and "stopped: step limit" in printed and "page 1/2" in printed


def test_doc_command_refuses_a_file_that_is_not_a_pdf(tmp_path, capsys):
    notes = tmp_path / "notes.pdf"
    notes.write_text("not a pdf at all")
    assert cli.main(["doc", str(notes), "--question", "q", "--model", "tiny-llama-gqa", "--quiet"]) == 2
    assert "not a PDF (a PDF starts with '%PDF-'" in capsys.readouterr().err


def test_video_command_needs_a_vision_language_model(tmp_path, capsys):
    video = tmp_path / "v.mp4"
    video.write_bytes(b"\x00" * 16)
    assert cli.main(["video", str(video), "--question", "q", "--model", "tiny-llama-gqa", "--quiet"]) == 2
    assert "needs a vision-language model" in capsys.readouterr().err


def test_web_command_refuses_a_file_url(capsys):
    assert cli.main(["web", "file:///etc/passwd", "--task", "read it", "--model", "tiny-llama-gqa", "--quiet"]) == 2
    assert "is not an http(s) URL" in capsys.readouterr().err


def test_unknown_model_is_a_clear_error(tmp_path, capsys):
    pdf = write_text_pdf(tmp_path / "a.pdf", ["x"])
    assert cli.main(["doc", str(pdf), "--question", "q", "--model", str(tmp_path / "no-model"), "--quiet"]) == 2
    assert "cannot load model" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["doc", "x.pdf"], "--question"),
    (["doc", "x.pdf", "--question", "q", "--budget-tokens", "0"], "expected a positive integer"),
    (["web", "http://127.0.0.1/"], "--task"),
])
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert message in capsys.readouterr().err
