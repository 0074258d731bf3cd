"""fit="residual" (`agentwin.models.residual`): the residual stream it reads, checked against the
model's own forward; the output projections it weighs by; refusals at construction."""

from __future__ import annotations

import pytest
import torch

from agentwin.models import residual
from agentwin.models.conditioned import conditioned_pass
from agentwin.window import Window
from kamera_core import patch as kp
from tests.agentwin.test_guard import A, B, _km


@pytest.mark.parametrize("name", ["tiny-llama-gqa", "tiny-gpt-neox", "tiny-gemma3"])
def test_recorded_residual_is_the_models_own_hidden_states(name):
    """Per layer, ||h||² of each row entering it equals transformers' `output_hidden_states`
    (index l: the input of layer l) of the same forward; the conditioned pass keeps the chunk's rows."""
    km = _km(name)
    ids = torch.cat([km.tokenize(A), km.tokenize(B)])
    with torch.no_grad():
        ref = km.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    layers = len(km.specs)
    with residual.recording(km.model) as found, torch.no_grad():
        km.model(input_ids=ids[None])
    assert sorted(found) == list(range(layers))
    for layer in range(layers):
        want = ref[layer][0].double().square().sum(-1)
        assert torch.allclose(found[layer], want, rtol=1e-6), layer
    start = len(km.tokenize(A))
    cp = conditioned_pass(km.model, ids, start, km.specs, km.layout)
    for layer in range(layers):
        assert torch.allclose(cp.residual[layer], ref[layer][0, start:].double().square().sum(-1), rtol=1e-5)
    assert residual.residual_norms(found, layers) == pytest.approx([float(found[i].sum()) for i in range(layers)])
    with pytest.raises(RuntimeError, match="recorded no residual stream"):
        residual.residual_norms({0: found[0]}, layers)


def test_the_window_reads_the_residual_stream_of_its_own_pass():
    """With fit="residual" the pass that fits B's patch records every row's residual stream: the
    same numbers as the model's own forward over A then B, and no extra forward is run."""
    km = _km("tiny-llama-gqa")
    win = Window(km, budget_tokens=4096, fit="residual")
    probes = []
    encode_after = km.encode_after

    def spy(*args, **kwargs):
        probes.append(args[-1] if len(args) > 5 else kwargs.get("probe"))
        return encode_after(*args, **kwargs)

    km.encode_after = spy
    try:
        win.append(A)
        b = win.append(B)
    finally:
        del km.encode_after
    (probe,) = [p for p in probes if p is not None]
    ids = torch.cat([km.tokenize(A), km.tokenize(B)])
    with torch.no_grad():
        ref = km.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    start = len(km.tokenize(A))
    for layer in range(len(km.specs)):
        assert torch.allclose(probe.residual[layer], ref[layer][0, start:].double().square().sum(-1), rtol=1e-5)
    plain = Window(km, budget_tokens=4096, fit="output")
    plain.append(A)
    plain.append(B)
    assert win.stats().forward_tokens == plain.stats().forward_tokens  # no forward of its own
    assert next(iter(win._chunks[b].patches.values())).method == "residual"


def test_models_without_an_output_projection_are_refused_when_the_window_is_built():
    km = _km("tiny-llama-gqa")
    saved = km.model.model.layers[1].self_attn.o_proj
    residual._METRICS.pop(km.model, None)
    del km.model.model.layers[1].self_attn.o_proj
    try:
        with pytest.raises(ValueError, match="fit='residual' cannot weigh its output: use fit='output'"):
            Window(km, fit="residual")
        Window(km, fit="output")  # the other fits do not read it
    finally:
        km.model.model.layers[1].self_attn.o_proj = saved
    metrics = residual.projection_metrics(km.model, km.layout.num_kv_heads, km.layout.value_dim)
    assert torch.equal(metrics[1], kp.projection_metric(saved.weight, km.layout.num_kv_heads, km.layout.value_dim))


def test_mla_models_take_the_allocator_instead():
    km = _km("tiny-deepseek-v2")
    assert Window(km, fit="residual").fit == "alloc"
