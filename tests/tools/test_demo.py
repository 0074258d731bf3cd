"""`agentwin demo` (the document navigator on the real SmolLM2) and the relocation demo."""

import json

import pytest

from tools import cli, demo, relocation_demo


@pytest.mark.slow
def test_demo_relocated_reuse_matches_reprefill(smollm2):
    model, tokenizer = smollm2
    r = relocation_demo.measure(model, tokenizer, start=30000, new_tokens=8, log=lambda *a: None)
    assert r["relocated_top1_agrees"] and r["greedy_identical"]
    assert r["relocated_kl"] < 1e-6
    # Blind reuse (B without its antecedent) must visibly differ, or the demo shows nothing.
    assert r["blind_reuse_kl"] > 100 * r["relocated_kl"]
    assert r["relocate_ms"] < r["reprefill_ab_ms"]


@pytest.mark.slow
def test_agentwin_demo_navigates_recalls_exactly_and_reports(smollm2, tmp_path, monkeypatch, capsys):
    """The command as `make demo` runs it (the model comes from the session fixture instead of a
    second load): evictions and recalls happen, each recall reads like a re-prefill, the answer
    is the model's and matches a re-prefill's, and the printed and JSON figures agree."""
    from agentwin import KameraModel

    model, tokenizer = smollm2
    monkeypatch.setattr(demo, "load_model", lambda name, progress=True: KameraModel(model, tokenizer, name="smollm2"))
    out = tmp_path / "demo.json"
    assert cli.main(["demo", "--quiet", "--json", str(out), "--pdf", str(tmp_path / "v.pdf")]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    f, s = data["figures"], data["summary"]
    assert (tmp_path / "v.pdf").read_bytes().startswith(b"%PDF-")
    # The window was too small for the document: pages left it and came back.
    assert s["evictions"] >= 2 and s["recalls"] >= 2 and s["content_hits"] >= 1
    events = [step["event"] for step in data["steps"]]
    assert events.count("recall") == s["recalls"] and events[-1] == "answer"
    assert s["recalled_tokens"] > 0 and s["prefill_tokens_avoided"] > 0 and s["time_saved_s"] > 0
    # Exact patches by default: every recall within 1e-4 nats of a re-prefill, same answer.
    assert f["rank"] == "exact" and len(f["kl_at_recalls"]) == s["recalls"]
    assert all(abs(k) < 1e-4 for k in f["kl_at_recalls"])
    assert f["answer"] == s["answer"] == f["reference_answer"] and f["answer_matches_reprefill"]
    assert f["answer_correct"] == (demo.EXPECTED.lower() in f["answer"].lower())
    assert f["answer_correct"], f"SmolLM2 answered {f['answer']!r}"
    # What is printed is what was measured.
    assert "moves by a fixed heuristic, not the model" in printed
    assert f"answer through the window : {f['answer']!r}" in printed
    assert "(identical)" in printed and f"{s['recalls']} recalls" in printed
    assert f"{f['kl_at_recalls'][0]:.2e}" in printed
    assert f"evictions / recalls  {s['evictions']} / {s['recalls']}" in printed


def test_demo_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--rank", "zero"])
    assert "--rank must be a positive integer or 'exact'" in capsys.readouterr().err
    assert cli.main(["demo", "--new-tokens", "0"]) == 2
    assert "--new-tokens must be positive" in capsys.readouterr().err
