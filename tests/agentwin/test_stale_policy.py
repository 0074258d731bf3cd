"""The stale-patch policy `origin-akin` (the patch policies' guard) on the real SmolLM2: a hard case's
chunk B, fitted after (filler, A), read after the filler alone once A has left the window. There
the origin patch was measured worse than blind reuse (`agentwin bench fidelity`); the default
must not be, judged against the transformers model's own forward of the same tokens."""

from __future__ import annotations

import pytest

from agentwin import KameraModel, Window
from agentwin.eval.fidelity import FILLER
from agentwin.eval.hard_cases import hard_case
from kamera_core.metrics import kl_divergence


@pytest.fixture(scope="module")
def km(smollm2) -> KameraModel:
    model, tokenizer = smollm2
    return KameraModel(model, tokenizer)


def _after_filler(km: KameraModel, case: str, **window_args) -> tuple[float, int]:
    """KL(model's own forward || window) after the case's first question, and the stale patches
    the window served, with B read after the filler alone."""
    c = hard_case(case)
    win = Window(km, budget_tokens=4096, **window_args)
    win.append(FILLER)
    a = win.append(c.a)
    win.append(c.b)
    win.materialize()  # B's pass after (filler, A): its origin patch
    win.evict(a)
    q = c.questions[0]
    kl = kl_divergence(win.reference_logprobs(q), win.next_token_logprobs(q), log_probs=True)
    return kl, win.stats().stale_patches


@pytest.mark.slow
@pytest.mark.parametrize("case", ["code", "roles", "table"])
def test_default_policy_is_no_worse_than_blind_behind_an_unrelated_neighbour(km, case):
    blind, _ = _after_filler(km, case, patch="none")
    origin, served = _after_filler(km, case, patch="origin")
    akin, stale = _after_filler(km, case, patch="origin-akin")
    exact, _ = _after_filler(km, case)
    assert served == 1  # the origin patch was served there, stale
    assert origin > blind  # and read worse than no patch at all (the hazard)
    assert stale == 0  # origin-akin declined it: the neighbour (the filler) is unlike A
    assert akin == pytest.approx(blind, rel=1e-4, abs=1e-7)  # blind reuse, not worse
    assert exact < 1e-5 < blind  # the default window recomputes B there: the model's own KV
