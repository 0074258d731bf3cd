"""The seeded cross-chunk texts: determinism, variety, names only in A, sizes in SmolLM2 tokens."""

from __future__ import annotations

import os
import re

import pytest

from tools.bench import datasets as patch_texts
from tools.bench.datasets import Case, make_case

SEEDS = range(10)
FIRST_NAMES = set(patch_texts.FEMALE_NAMES) | set(patch_texts.MALE_NAMES)
SURNAMES = set(patch_texts.SURNAMES)


def _names(case: Case) -> list[str]:
    """The full names A introduces, in order."""
    pairs = re.findall(r"\b([A-Z][a-z]+) ([A-Z][a-z]+)\b", case.a)
    return [f"{f} {s}" for f, s in pairs if f in FIRST_NAMES and s in SURNAMES]


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text) is not None


def test_same_seed_same_case():
    for seed in SEEDS:
        assert make_case(seed) == make_case(seed)
    assert make_case(3).seed == 3


def test_does_not_touch_global_random():
    import random

    random.seed(123)
    expected = random.random()
    random.seed(123)
    make_case(5)
    assert random.random() == expected


def test_seeds_vary():
    cases = [make_case(seed) for seed in SEEDS]
    for field in ("a", "b", "queries", "extra_chunks"):
        assert len({getattr(c, field) for c in cases}) == len(cases), field
    name_sets = [frozenset(_names(c)) for c in cases]
    assert len(set(name_sets)) == len(cases)


def test_template_variety():
    for templates in (patch_texts.A_OPENINGS, patch_texts.ROLE_INTROS, patch_texts.VISITOR_INTROS,
                      patch_texts.KEEPS, patch_texts.ATTRIBUTES, patch_texts.EVENTS,
                      patch_texts.FOLLOW_UPS, patch_texts.OPENERS, patch_texts.B_OPENINGS,
                      patch_texts.EXTRA_OPENINGS):
        assert len(templates) >= 10
    for seed in SEEDS:
        sentences = [s.strip() for s in make_case(seed).b.split(".") if s.strip()]
        assert len(set(sentences)) == len(sentences)


def test_entities_and_chunks_shape():
    for seed in SEEDS:
        case = make_case(seed)
        names = _names(case)
        assert 6 <= len(names) <= 8 and len(set(names)) == len(names)
        assert len(case.extra_chunks) == 2 and all(case.extra_chunks)
        assert len(case.queries) >= 6 and len(set(case.queries)) == len(case.queries)


def test_names_only_in_a():
    for seed in range(50):
        case = make_case(seed)
        for name in _names(case):
            assert name in case.a
            for text in (case.b, *case.extra_chunks):
                for word in name.split():
                    assert not _has_word(text, word), (seed, name, text)


def test_b_refers_to_a_indirectly():
    for seed in SEEDS:
        case = make_case(seed)
        assert re.search(r"\b(first|second|third) visitor\b", case.b)
        assert re.search(r"\b(She|He|she|he|her|him|his)\b", case.b)


def test_every_query_names_an_entity_of_a():
    for seed in SEEDS:
        case = make_case(seed)
        names = _names(case)
        for query in case.queries:
            assert query.startswith(" Question: ") and query.endswith(" Answer:"), query
            assert sum(name in query for name in names) == 1, query
        # Every entity is asked about.
        assert {n for n in names if any(n in q for q in case.queries)} == set(names)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """The SmolLM2 tokenizer alone (no model weights)."""
    from transformers import AutoTokenizer

    from agentwin.models.zoo import smollm2_gguf_path

    folder, name = os.path.split(smollm2_gguf_path())
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.mark.slow
def test_token_lengths(smollm2_tokenizer):
    def count(text: str) -> int:
        return len(smollm2_tokenizer(text, add_special_tokens=False)["input_ids"])

    for seed in SEEDS:
        case = make_case(seed)
        assert 170 <= count(case.a) <= 240, (seed, count(case.a))
        assert 350 <= count(case.b) <= 450, (seed, count(case.b))
        for chunk in case.extra_chunks:
            assert 110 <= count(chunk) <= 200, (seed, count(chunk))
