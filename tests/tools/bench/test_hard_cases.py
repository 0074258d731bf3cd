"""The hard cases are complete: four kinds, 2-4 questions each, B referring to A only indirectly."""

import pytest

from tools.bench.hard_cases import CASES, hard_case, hard_case_names


def test_every_case_has_its_questions_and_answers():
    assert hard_case_names() == ["code", "roles", "table", "steps"]
    for name in hard_case_names():
        c = hard_case(name)
        assert c.name == name and c.a.strip() and c.b.strip()
        assert 2 <= len(c.questions) <= 4 and len(c.answers) == len(c.questions)
        assert c.texts() == (c.a, c.b, c.questions)


def test_b_needs_a():
    """What the answers name is defined in A; B alone never names it (except the code case,
    where B prints values only A's definitions determine)."""
    for name in ("roles", "table", "steps"):
        c = CASES[name]
        for answer in c.answers:
            if not answer.isdigit() and answer != "eighteen":
                assert answer.split()[0] in c.a and answer.split()[0] not in c.b, (name, answer)
    code = CASES["code"]
    assert all(f"def {fn}" in code.a and fn in code.b for fn in ("crate_count", "discounted", "label"))


def test_unknown_case_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown hard case"):
        hard_case("nope")
