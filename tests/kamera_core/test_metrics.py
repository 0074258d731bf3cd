import math

import pytest
import torch

from kamera_core.metrics import kl_divergence, top1_agrees


def test_kl_matches_closed_form_and_is_zero_on_itself():
    p = torch.tensor([2.0, 0.0, -1.0])
    q = torch.tensor([0.0, 1.0, 0.5])
    pp, qq = torch.softmax(p.double(), -1), torch.softmax(q.double(), -1)
    expected = float(sum(a * math.log(a / b) for a, b in zip(pp.tolist(), qq.tolist())))
    assert kl_divergence(p, q) == pytest.approx(expected, rel=1e-12)
    assert kl_divergence(p, p) == pytest.approx(0.0, abs=1e-15)
    assert kl_divergence(torch.log_softmax(p, -1), torch.log_softmax(q, -1), log_probs=True) == pytest.approx(
        expected, rel=1e-6)


def test_kl_rejects_shape_mismatch_and_top1():
    with pytest.raises(ValueError, match="shape"):
        kl_divergence(torch.zeros(3), torch.zeros(4))
    assert top1_agrees(torch.tensor([0.0, 3.0, 1.0]), torch.tensor([0.5, 2.0, 1.9]))
    assert not top1_agrees(torch.tensor([0.0, 3.0, 1.0]), torch.tensor([0.5, 2.0, 2.1]))
