import math

import pytest
import torch

from kamera_core.metrics import kl_divergence, layer_cosine, top1_agrees


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


def test_layer_cosine_averages_over_layers_not_over_the_flattened_summary():
    # Candidate 0 matches the query on layer 0 only, whose keys are 100× larger; candidate 1 on
    # layers 1 and 2. Over the flattened vector candidate 0 would win; per layer, candidate 1 does.
    e = torch.eye(3)
    query = torch.stack([100 * e[0], e[1], e[2]])
    cands = torch.stack([torch.stack([100 * e[0], e[0], e[0]]), torch.stack([100 * e[1], e[1], e[2]])])
    flat = [torch.nn.functional.cosine_similarity(c.flatten(), query.flatten(), dim=0).item() for c in cands]
    assert flat[0] > flat[1]
    scores = layer_cosine(query, cands)
    assert scores.tolist() == pytest.approx([1 / 3, 2 / 3])


def test_layer_cosine_refuses_summaries_of_another_model():
    with pytest.raises(ValueError, match="one model"):
        layer_cosine(torch.ones(2, 4), torch.ones(3, 3, 4))
    with pytest.raises(ValueError, match="one model"):
        layer_cosine(torch.ones(2, 4), torch.ones(2, 4))
