"""The stale-patch policy `origin-akin` (the patch policies' guard) on the real SmolLM2: a hard case's
chunk B, fitted after (filler, A), read after the filler alone once A has left the window. There
the origin patch was measured worse than blind reuse (`agentwin bench fidelity`); the default
must not be, judged against the transformers model's own forward of the same tokens."""

from __future__ import annotations

import pytest
import torch

from agentwin import KameraModel, Window
from tools.bench.fidelity import FILLER
from tools.bench.hard_cases import hard_case
from kamera_core.metrics import kl_divergence
from tests.support import assert_close, forward_growth, tolerance


@pytest.fixture(scope="module")
def km(smollm2) -> KameraModel:
    model, tokenizer = smollm2
    return KameraModel(model, tokenizer)


def _after_filler(km: KameraModel, case: str, **window_args) -> tuple[float, int, torch.Tensor, torch.Tensor]:
    """KL(model's own forward || window) after the case's first question, the stale patches the
    window served, with B read after the filler alone, and the two next-token log-probabilities
    (the model's own forward's, the window's)."""
    c = hard_case(case)
    win = Window(km, budget_tokens=4096, **window_args)
    win.append(FILLER)
    a = win.append(c.a)
    win.append(c.b)
    win.materialize()  # B's pass after (filler, A): its origin patch
    win.evict(a)
    q = c.questions[0]
    reference, read = win.reference_logprobs(q), win.next_token_logprobs(q)
    return kl_divergence(reference, read, log_probs=True), win.stats().stale_patches, reference, read


@pytest.mark.slow
@pytest.mark.parametrize("case", ["code", "roles", "table"])
def test_default_policy_is_no_worse_than_blind_behind_an_unrelated_neighbour(km, case):
    blind, _, reference, blind_read = _after_filler(km, case, patch="none")
    origin, served, _, _ = _after_filler(km, case, patch="origin")
    akin, stale, _, akin_read = _after_filler(km, case, patch="origin-akin")
    exact, _, _, _ = _after_filler(km, case)
    assert served == 1  # the origin patch was served there, stale
    assert origin > blind  # and read worse than no patch at all (the hazard)
    assert stale == 0  # origin-akin declined it: the neighbour (the filler) is unlike A
    # blind reuse, not worse: the same read as blind reuse's, to float32 rounding through the forward
    growth = forward_growth(km.model.config)
    assert_close(akin_read, blind_read, what="origin-akin against blind reuse", growth=growth)
    # The default window recomputes B there: the model's own KV. Its KL is summed from float32
    # log-probabilities, each rounded by itself: first order, up to eps·max|log p| per side
    # (tests.support.tolerance), plus ½δ² of the forwards' log-probability gap δ.
    delta = tolerance(torch.float32, float(reference.abs().max()), growth)
    floor = tolerance(torch.float32, float(reference.abs().max()), 2) + delta ** 2 / 2
    assert abs(exact) <= floor < blind
