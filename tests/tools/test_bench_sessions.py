"""`agentwin bench sessions`: the generated sessions are seeded, slide, recall and ask, and a quick
run of the command writes every figure the page and the targets read, with the default window
exact and never above prefix caching's tokens on every session."""

from __future__ import annotations

import json

import pytest

from agentwin import KameraModel
from tools.bench.sessions import KINDS, TEST_SEEDS, VALIDATION_SEEDS, make_session, session_parts
from tools.cli import main

KEYS = ("default_kl_over_floor", "default_greedy16", "floor_greedy16", "default_tokens_over_prefix",
        "worst_session_tokens_over_prefix", "default_tokens_over_lower_bound", "default_wall_over_prefix", "frontier")


@pytest.fixture(scope="module")
def smol(smollm2) -> KameraModel:
    model, tokenizer = smollm2
    return KameraModel(model, tokenizer, name="smollm2")


@pytest.mark.parametrize("kind", KINDS)
def test_sessions_come_from_their_seed_and_slide_recall_and_ask(smol, kind):
    a, b = make_session(kind, 2, smol, reads=12), make_session(kind, 2, smol, reads=12)
    assert a.to_json() == b.to_json()  # the seed fixes everything
    assert make_session(kind, 3, smol, reads=12).chunks != a.chunks
    ops = [op["op"] for op in a.ops]
    assert ops.count("decide") == 12 and ops.count("recall") >= 1 and ops.count("evict") >= 1 and a.revisits
    assert a.meta["split"] == "test" and make_session(kind, VALIDATION_SEEDS[0], smol, reads=12).meta["split"] == "validation"
    head = a.chunks[0]
    assert all(op["chunk"] != 0 for op in a.ops if op["op"] == "evict")  # the head stays
    order, tokens = [], {c: len(smol.tokenize(t)) for c, t in a.chunks.items()}
    for op in a.ops:  # the window never holds more than its budget
        if op["op"] == "append":
            order.append(op["chunk"])
        elif op["op"] == "evict":
            order.remove(op["chunk"])
        elif op["op"] == "recall":
            order.insert(op["at"], op["chunk"])
        assert sum(tokens[c] for c in order) <= a.budget_tokens
    assert "<|im_start|>system" in head and all(op["query"].endswith("<|im_start|>assistant\n")
                                                  for op in a.ops if op["op"] == "decide")
    assert set(TEST_SEEDS).isdisjoint(VALIDATION_SEEDS)


def test_thread_entries_lean_on_the_entry_that_introduced_the_crew():
    parts = session_parts("thread", 0, 6)
    names = [f.answer for f in parts[0].facts if f.question.startswith("Who is")]
    later = " ".join(p.text for p in parts[1:])
    assert names and all(n not in later for n in names)  # only roles and pronouns after the introduction
    with pytest.raises(ValueError, match="kind"):
        session_parts("poems", 0, 3)


@pytest.mark.slow
def test_quick_run_writes_every_figure_and_the_default_is_exact_and_never_above_prefix(tmp_path):
    out, page = tmp_path / "sessions.json", tmp_path / "SESSIONS.md"
    assert main(["bench", "sessions", "--quick", "--kinds", "notes", "--json", str(out), "--page", str(page)]) == 0
    r = json.loads(out.read_text())
    for key in KEYS:
        assert key in r
    assert r["contract"]["faithful"] and r["contract"]["never_more_than_prefix"]
    assert r["default_kl_over_floor"] < 0.01  # exact: far below the bfloat16 floor
    test = {name: entry for name, entry in r["sessions"].items() if entry["split"] == "test"}
    assert test and len(test) < len(r["sessions"])
    for name, entry in r["sessions"].items():  # validation runs prefix caching and the swept settings only
        assert ("default" in entry["strategies"]) == (name in test), name
    for name, entry in test.items():
        st = entry["strategies"]
        assert st["default"]["forwarded_tokens"] <= st["prefix"]["forwarded_tokens"], name
        assert entry["lower_bound_tokens"] <= st["default"]["forwarded_tokens"]
        assert st["survive"]["forwarded_tokens"] < st["prefix"]["forwarded_tokens"]  # the slides it skips
        assert st["default"]["kl_max"] < 1e-4 and st["survive"]["kl_max"] > st["default"]["kl_max"]
    assert set(r["frontier"]) >= {"prefix", "default", "survive", "refresh", "blind"}
    assert r["selection"]["refresh"]["chosen"] is not None
    text = page.read_text()
    assert text.startswith("# Chat sessions") and "agentwin bench sessions --model smollm2" in text
    assert main(["bench", "sessions", "--quick", "--kinds", "poems"]) == 2


def test_test_seeds_must_be_seeds_outside_the_validation_split(capsys):
    for bad in ("0", "x", ",", "-1"):
        assert main(["bench", "sessions", "--test-seeds", bad]) == 2, bad
        assert "--test-seeds" in capsys.readouterr().err
