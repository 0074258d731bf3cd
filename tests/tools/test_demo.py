"""`agentwin demo` (the document navigator on the real SmolLM2) and the relocation demo."""

import json
import re

import pytest

from tools.bench import relocation_demo
from tools import cli, demo


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
    ran = []  # tokens of every forward of the model, whoever ran it
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: ran.append(int(kwargs["input_ids"].shape[-1])), with_kwargs=True)
    try:
        assert cli.main(["demo", "--quiet", "--json", str(out), "--pdf", str(tmp_path / "v.pdf")]) == 0
    finally:
        hook.remove()
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    f, s = data["figures"], data["summary"]
    assert (tmp_path / "v.pdf").read_bytes().startswith(b"%PDF-")
    # The window was too small for the document: pages left it and came back.
    assert s["evictions"] >= 2 and s["recalls"] >= 2 and s["content_hits"] >= 1
    events = [step["event"] for step in data["steps"]]
    assert events.count("recall") == s["recalls"] and events[-1] == "answer"
    # Every forward of the run belongs to one side: the window's (counted by kind) or the
    # re-prefill baseline's; nothing forwarded goes uncounted and no side claims the other's work.
    a, b = f["agentwin"], f["reprefill"]
    assert sum(ran) == a["forwarded_tokens"] + b["forwarded_tokens"]
    assert a["forwarded_tokens"] == sum(a["by_kind"].values()) and a["by_kind"]["query"] > 0
    assert f["decision_points"] == len(f["kl_at_decisions"]) == len(data["steps"]) - 1
    assert not any(k in json.dumps(data) for k in ("avoided", "time_saved"))
    assert f"{a['forwarded_tokens']} tokens forwarded" in printed and f"{b['forwarded_tokens']} tokens forwarded" in printed
    # The exact window by default, in SmolLM2's chat format: every recall within 1e-4 nats of a
    # re-prefill, same answer; never more tokens than prefix caching counted on the same reads.
    assert f["patch"] == "exact" and f["chat"] and len(f["kl_at_recalls"]) == s["recalls"]
    assert a["forwarded_tokens"] <= f["prefix_caching_tokens"] and a["by_kind"].get("encode", 0) == 0
    assert all(abs(k) < 1e-4 for k in f["kl_at_recalls"])
    assert f["answer"] == s["answer"] == f["reference_answer"] and f["answer_matches_reprefill"]
    assert f["answer_correct"] == (demo.EXPECTED.lower() in f["answer"].lower())
    assert f["answer_correct"], f"SmolLM2 answered {f['answer']!r}"
    # What is printed is what was measured.
    assert "moves by a fixed heuristic, not the model" in printed
    assert f"answer through the window : {f['answer']!r}" in printed
    assert "(identical)" in printed and re.search(rf"recalls\s+{s['recalls']} chunks", printed)
    assert f"{f['kl_at_recalls'][0]:.2e}" in printed
    assert re.search(rf"evictions\s+{s['evictions']} chunks", printed)


def test_demo_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--rank", "zero"])
    assert "--rank must be 'budget', a positive integer or 'exact'" in capsys.readouterr().err
    assert cli.main(["demo", "--new-tokens", "0"]) == 2
    assert "--new-tokens must be positive" in capsys.readouterr().err


def test_demo_refuses_window_options_that_contradict_each_other_before_loading(capsys, monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(demo, "load_model", load)
    assert cli.main(["demo", "--max-kl", "0.002"]) == 2  # the demo's window is exact by default: no patches
    assert "--max-kl set(s) the patches of a patch policy, and --patch exact fits none" in capsys.readouterr().err
    assert cli.main(["demo", "--patch", "origin", "--rank", "exact", "--max-kl", "0.002"]) == 2
    assert "--max-kl is a fidelity target for low-rank patches" in capsys.readouterr().err
    assert cli.main(["demo", "--patch", "origin", "--rank", "exact", "--patch-bytes", "0.1"]) == 2
    assert "use it with --rank budget, not --rank exact" in capsys.readouterr().err
