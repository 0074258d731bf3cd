"""The demo's measurement on the real SmolLM2: relocated reuse must match a full re-prefill."""

import pytest

from tools import demo


@pytest.mark.slow
def test_demo_relocated_reuse_matches_reprefill(smollm2):
    model, tokenizer = smollm2
    r = demo.measure(model, tokenizer, start=30000, new_tokens=8, log=lambda *a: None)
    assert r["relocated_top1_agrees"] and r["greedy_identical"]
    assert r["relocated_kl"] < 1e-6
    # Blind reuse (B without its antecedent) must visibly differ, or the demo shows nothing.
    assert r["blind_reuse_kl"] > 100 * r["relocated_kl"]
    assert r["relocate_ms"] < r["reprefill_ab_ms"]
