"""`agentwin bench steps`: the figures and the results page, checked on a tiny model (doc agent)."""

import json

from tools import cli


def test_bench_steps_writes_its_figures_and_page(tmp_path, capsys):
    out, md = tmp_path / "steps.json", tmp_path / "STEPS.md"
    code = cli.main(["bench", "steps", "--model", "tiny-llama-gqa", "--allow-random-weights", "--agents", "doc",
                     "--steps", "2", "--threads", "1", "--budget-tokens", "600", "--guard", "--json", str(out), "--md", str(md)])
    assert code == 0
    f = json.loads(out.read_text())
    for key in ("step_s_median", "overhead_share", "tokens_after_action_close", "load_average_before",
                "load_average_after", "threads", "forward_s_median", "decisions"):
        assert key in f, key
    assert f["threads"] == 1 and f["decisions"] == 2 and f["budget_tokens"] == 600
    assert f["guard"] is True and "--guard" in f["command"] and "patch guard on" in md.read_text()
    doc = f["agents"]["doc"]
    decisions = [s for s in doc["steps"] if s["step"] >= 1]
    assert len(decisions) == 2 and all(s["forward_s"] > 0 and s["step_s"] >= s["forward_s"] for s in decisions)
    assert 0 <= f["overhead_share"] < 1
    # a random model rarely closes its action; what it generated after a close is counted either way
    assert f["tokens_after_action_close"] == sum(s["tokens_after_close"] or 0 for s in decisions)
    page = md.read_text()
    assert page.splitlines()[2] == f"Written by `{f['command']}`."
    assert f["command"].startswith("agentwin bench steps --model tiny-llama-gqa") and "| doc | 2 |" in page
    assert "overhead share" in capsys.readouterr().out


def test_bench_steps_refuses_random_weights_and_bad_agents(capsys):
    assert cli.main(["bench", "steps", "--model", "tiny-llama-gqa"]) == 2
    assert "random weights" in capsys.readouterr().err
    assert cli.main(["bench", "steps", "--agents", "doc,tv"]) == 2
    assert "--agents takes" in capsys.readouterr().err
