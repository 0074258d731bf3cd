"""`agentwin doc | web | video` from the command line: a run to its summary, and bad input."""

import json

import pytest

from agents.doc import write_text_pdf
from agents import console
from tools import cli, options


def test_doc_command_runs_the_model_to_the_step_limit_and_reports(tmp_path, capsys):
    """A random-weight tiny model (allowed explicitly) cannot write JSON: every decision is
    malformed, the loop says so to the model, stops at --max-steps and reports it (exit 1)."""
    pdf = write_text_pdf(tmp_path / "a.pdf", ["The harbour master is Anja Roth.", "The keeper is Tobias."])
    out, log = tmp_path / "run.json", tmp_path / "steps.jsonl"
    code = cli.main(["doc", str(pdf), "--question", "Who is the keeper?", "--model", "tiny-llama-gqa",
                     "--max-steps", "3", "--max-new-tokens", "4", "--budget-tokens", "400", "--rank", "exact",
                     "--json", str(out), "--log", str(log), "--quiet", "--allow-random-weights"])
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


@pytest.fixture
def no_model_load(monkeypatch):
    """Input checks must fail before any model is loaded: loading one fails the test."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")
    import agents.console

    monkeypatch.setattr(agents.console, "load_model", load)  # what run_agent calls


def test_doc_command_refuses_a_file_that_is_not_a_pdf(tmp_path, capsys, no_model_load):
    notes = tmp_path / "notes.pdf"
    notes.write_text("not a pdf at all")
    assert cli.main(["doc", str(notes), "--question", "q", "--quiet"]) == 2
    assert "not a PDF (a PDF starts with '%PDF-'" in capsys.readouterr().err


def test_video_command_needs_a_vision_language_model(tmp_path, capsys, no_model_load):
    video = tmp_path / "v.mp4"
    video.write_bytes(b"\x00" * 16)
    assert cli.main(["video", str(video), "--question", "q", "--model", "smollm2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "smollm2 is a text-only model" in err and "Qwen2.5-VL" in err
    assert cli.main(["video", str(video), "--question", "q", "--quiet"]) == 2  # no default model
    err = capsys.readouterr().err
    assert "needs a vision-language model" in err and "Hugging Face id" in err and "tiny" not in err


def test_video_command_checks_the_file_before_loading_a_model(tmp_path, capfd, no_model_load):
    video = tmp_path / "v.mp4"
    video.write_text("a text file, not a video")
    code = cli.main(["video", str(video), "--question", "q", "--model", "tiny-qwen2.5-vl",
                     "--allow-random-weights", "--quiet"])
    err = capfd.readouterr().err
    assert code == 2 and "cannot read" in err and "as a video" in err
    assert "video_reader.cc" not in err  # decord's own log line stays out of the output


def test_random_weight_models_are_refused_unless_asked(tmp_path, capsys, no_model_load):
    pdf = write_text_pdf(tmp_path / "a.pdf", ["x"])
    assert cli.main(["doc", str(pdf), "--question", "q", "--model", "tiny-llama-gqa", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "random weights" in err and "cannot read" in err and "--allow-random-weights" in err
    assert cli.main(["video", str(pdf), "--question", "q", "--model", "tiny-qwen2.5-vl", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "random weights" in err and "Qwen2.5-VL" in err and "Hugging Face id" in err


@pytest.mark.parametrize("command", ["doc", "web", "video"])
def test_help_gives_exit_codes_and_says_tiny_models_cannot_answer(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 the agent answered; 1 no answer within --max-steps; 2 an error" in text
    assert "random weights: they cannot read or answer" in text and "Qwen2.5-VL" in text
    assert "default tiny" not in text


def test_web_command_refuses_a_file_url(capsys, no_model_load):
    assert cli.main(["web", "file:///etc/passwd", "--task", "read it", "--quiet"]) == 2
    assert "is not an http(s) URL" in capsys.readouterr().err


def test_web_command_checks_the_start_page_before_loading_a_model(capsys, no_model_load):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    assert cli.main(["web", f"http://127.0.0.1:{port}/", "--task", "t", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "cannot be reached (connection refused" in err


def test_quiet_model_loading_prints_no_progress_bar(monkeypatch, capsys):
    """The library's weight-loading bar is dropped under --quiet; other lines are kept."""
    import sys

    from agentwin import KameraModel

    def fake(name):
        sys.stderr.write("Loading weights:   0%|          | 0/272 [00:00<?, ?it/s]\r"
                         "Loading weights: 100%|##########| 272/272 [00:00<00:00, 7549.65it/s]\n")
        sys.stderr.write("UserWarning: something worth seeing\n")
        return "model"

    monkeypatch.setattr(KameraModel, "from_pretrained", staticmethod(fake))
    assert console.load_model("smollm2", progress=False) == "model"
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "something worth seeing" in err and "loading" not in err
    console.load_model("smollm2", progress=True)  # stderr is not a terminal here: plain lines, no bar
    err = capsys.readouterr().err
    assert "loading smollm2 ..." in err and "loaded smollm2 in" in err and "Loading weights" not in err


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


def test_patch_options_are_checked_before_a_model_is_loaded(tmp_path, capsys, no_model_load):
    pdf = write_text_pdf(tmp_path / "a.pdf", ["x"])
    code = cli.main(["doc", str(pdf), "--question", "q", "--patch", "origin-akin", "--rank", "8", "--patch-bytes", "0.1",
                     "--quiet"])
    assert code == 2 and "use it with --rank budget, not --rank 8" in capsys.readouterr().err
    code = cli.main(["doc", str(pdf), "--question", "q", "--rank", "8", "--quiet"])  # the exact default fits no patch
    assert code == 2 and "--rank set(s) the patches of a patch policy, and --patch exact" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["doc", str(pdf), "--question", "q", "--patch-bytes", "2", "--quiet"])
    assert "expected a fraction in (0, 1]" in capsys.readouterr().err
    assert options.rank_arg("budget") == "budget" and options.rank_arg("exact") is None


def test_a_fidelity_target_is_checked_and_reaches_the_window(tmp_path, capsys, no_model_load):
    from types import SimpleNamespace

    from agentwin.models.adapter import KameraModel

    pdf = write_text_pdf(tmp_path / "a.pdf", ["x"])
    assert cli.main(["doc", str(pdf), "--question", "q", "--patch", "origin", "--rank", "exact", "--max-kl", "0.002",
                     "--quiet"]) == 2
    assert "--max-kl is a fidelity target for low-rank patches" in capsys.readouterr().err
    for bad in ("0", "-1", "inf", "nats"):
        with pytest.raises(SystemExit):
            cli.main(["doc", str(pdf), "--question", "q", "--max-kl", bad, "--quiet"])
        assert "expected a positive KL in nats" in capsys.readouterr().err
    km = KameraModel.from_pretrained("tiny-llama-gqa")
    args = SimpleNamespace(store=None, budget_tokens=512, patch="origin-akin", rank="budget", patch_bytes=None,
                           max_kl=0.002)
    window = options.make_window(km, args)
    assert window.max_kl == 0.002 and window.rank == "budget"
    assert options.make_window(km, SimpleNamespace(**{**vars(args), "max_kl": None})).max_kl is None


# ---- bad input is refused in one line, with exit status 2, before a model loads ----------------

@pytest.fixture
def inputs(tmp_path):
    """argv up to the question or task for each agent command, on inputs that would run."""
    from agents.local_site import serve

    pdf = write_text_pdf(tmp_path / "a.pdf", ["The keeper is Tobias."])
    with serve({"/index.html": "<title>Keeper</title><p>Tobias keeps the lighthouse.</p>"}) as site:
        yield {"doc": ["doc", str(pdf)], "web": ["web", f"{site}/"],
               "video": ["video", str(pdf), "--model", "tiny-qwen2.5-vl", "--allow-random-weights"]}


def _refused(argv, capsys) -> str:
    """The one error line of a command refused while its arguments were parsed (exit status 2)."""
    with pytest.raises(SystemExit) as exit:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("value", ["", "   ", "\t\n"])
@pytest.mark.parametrize("command, option", [("doc", "--question"), ("web", "--task"), ("video", "--question")])
def test_an_empty_question_or_task_is_refused_before_a_model_loads(command, option, value, inputs, capsys,
                                                                    no_model_load):
    err = _refused(inputs[command] + [option, value, "--quiet"], capsys)
    assert f"argument {option}: is empty" in err and "say what the agent should" in err


def test_a_question_that_is_not_utf8_is_refused_before_a_model_loads(inputs, capsys, no_model_load):
    # what Python makes of argv bytes that are not UTF-8 (surrogateescape)
    err = _refused(inputs["doc"] + ["--question", "Who \udcff?", "--quiet"], capsys)
    assert "argument --question: is not valid UTF-8 text" in err


@pytest.mark.parametrize("option, value", [("--fps", "inf"), ("--fps", "nan"), ("--fps", "0"), ("--fps", "two"),
                                           ("--segment-seconds", "-4"), ("--segment-seconds", "1e999")])
def test_video_numbers_are_refused_before_a_model_loads(option, value, inputs, capsys, no_model_load):
    err = _refused(inputs["video"] + ["--question", "q", option, value, "--quiet"], capsys)
    assert f"argument {option}: expected a positive, finite number, got {value!r}" in err


@pytest.mark.parametrize("command", ["doc", "video"])
def test_a_missing_file_is_one_line_before_a_model_loads(command, inputs, tmp_path, capsys, no_model_load):
    argv = list(inputs[command])
    argv[1] = str(tmp_path / "gone")
    assert cli.main(argv + ["--question", "q", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "gone" in err and "does not exist" in err or "no such file" in err
    assert len(err.strip().splitlines()) == 1, err


# ---- --threads --------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
@pytest.mark.parametrize("command", ["doc", "web", "video"])
def test_threads_must_be_a_positive_integer(command, value, inputs, capsys, no_model_load):
    err = _refused(inputs[command] + ["--question" if command != "web" else "--task", "q", "--threads", value], capsys)
    assert f"argument --threads: expected a positive integer, got {value!r}" in err


@pytest.mark.parametrize("command", ["doc", "web", "video"])
def test_threads_hold_while_the_model_loads_and_runs_and_are_restored(command, inputs, tmp_path, monkeypatch, capsys):
    """--threads N sets torch's threads for the run (1 by default, as the demo's), and the
    caller's count is back afterwards."""
    import torch

    import agents.console

    seen = []

    def load(name, progress=True):
        seen.append(torch.get_num_threads())
        raise ValueError("stopped here by the test")

    monkeypatch.setattr(agents.console, "load_model", load)
    torch.set_num_threads(2)
    ask = "--task" if command == "web" else "--question"
    argv = inputs[command] + [ask, "q", "--quiet"]
    if command == "video":  # the file is checked before the model loads: a real video
        from tests.agents.test_video import _write_mp4

        _write_mp4(tmp_path / "clip.mp4")
        argv[1] = str(tmp_path / "clip.mp4")
    assert cli.main(argv + ["--threads", "3"]) == 2 and cli.main(argv) == 2
    assert seen == [3, 1] and torch.get_num_threads() == 2
    assert "stopped here by the test" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["demo"], ["demo", "--relocation"], ["relocation-demo"], ["diagnose", "--case", "code"],
                                  ["bench", "patches"], ["bench", "engine"], ["batch", "tasks.jsonl"]])
def test_every_command_that_runs_a_model_checks_its_threads_option(argv, capsys, no_model_load):
    err = _refused(argv + ["--threads", "0"], capsys)
    assert "argument --threads: expected a positive integer, got '0'" in err


@pytest.mark.parametrize("argv, loader", [(["relocation-demo"], "load_smollm2"), (["demo", "--relocation"], "load_smollm2"),
                                          (["diagnose", "--case", "code"], "load_text_model")])
def test_the_demos_and_diagnose_load_and_run_on_their_threads(argv, loader, monkeypatch, capsys):
    import torch

    import agentwin.models.zoo

    seen = []

    def load(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise FileNotFoundError("stopped here by the test")

    import tools.diagnose

    monkeypatch.setattr(tools.diagnose if loader == "load_text_model" else agentwin.models.zoo, loader, load)
    torch.set_num_threads(2)
    assert cli.main(argv + ["--threads", "3"]) == 2 and cli.main(argv) == 2
    assert seen == [3, 1] and torch.get_num_threads() == 2
    assert "stopped here by the test" in capsys.readouterr().err
