"""fit="residual" (`agentwin.models.residual`): the residual stream it reads, checked against the
model's own forward; the output projections it weighs by; refusals at construction."""

from __future__ import annotations

import pytest
import torch

from agentwin.models import residual
from tools.bench.conditioned import conditioned_pass
from agentwin.window import Window
from kamera_core import fit_metric as fm
from tests.agentwin.test_guard import A, B, _km


@pytest.mark.parametrize("name", ["tiny-llama-gqa", "tiny-gpt-neox", "tiny-gemma3"])
def test_recorded_residual_is_the_models_own_hidden_states(name):
    """Per layer, ||h||² of each row entering it equals transformers' `output_hidden_states`
    (index l: the input of layer l) of the same forward; the conditioned pass keeps the chunk's rows."""
    km = _km(name)
    ids = torch.cat([km.tokenize(A), km.tokenize(B)])
    layers = len(km.specs)
    outputs: dict[int, torch.Tensor] = {}  # Gemma-3: the attention output entering its post-attention norm
    hooks = [layer.post_attention_layernorm.register_forward_pre_hook(
        lambda module, args, i=i: outputs.__setitem__(i, args[0][0].double()))
        for i, layer in enumerate(residual.decoder_layers(km.model)) if residual.post_attention_norm(layer) is not None]
    try:
        with torch.no_grad():
            ref = km.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    finally:
        for hook in hooks:
            hook.remove()
    assert (len(outputs) == layers) == (name == "tiny-gemma3")  # only Gemma normalises its attention output

    def want(layer: int, rows: slice) -> torch.Tensor:
        stream = ref[layer][0, rows].double().square().sum(-1)
        if layer not in outputs:
            return stream
        eps = km.model.model.layers[layer].post_attention_layernorm.eps
        return stream / (1 / (outputs[layer][rows].square().mean(-1) + eps)).mean()

    with residual.recording(km.model) as found, torch.no_grad():
        km.model(input_ids=ids[None])
    assert sorted(found) == list(range(layers))
    for layer in range(layers):
        assert torch.allclose(found[layer], want(layer, slice(None)), rtol=1e-6), layer
    start = len(km.tokenize(A))
    cp = conditioned_pass(km.model, ids, start, km.specs, km.layout)
    for layer in range(layers):
        assert torch.allclose(cp.residual[layer], want(layer, slice(start, None)), rtol=1e-5)
    assert residual.residual_norms(found, layers) == pytest.approx([float(found[i].sum()) for i in range(layers)])
    with pytest.raises(RuntimeError, match="recorded no residual stream"):
        residual.residual_norms({0: found[0]}, layers)


def test_the_window_reads_the_residual_stream_of_its_own_pass():
    """With fit="residual" the pass that fits B's patch records every row's residual stream: the
    same numbers as the model's own forward over A then B, and no extra forward is run."""
    km = _km("tiny-llama-gqa")
    win = Window(km, patch="origin-akin", budget_tokens=4096, fit="residual")
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
    plain = Window(km, patch="origin-akin", budget_tokens=4096, fit="output")
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
            Window(km, patch="origin-akin", fit="residual")
        Window(km, patch="origin-akin", fit="output")  # the other fits do not read it
    finally:
        km.model.model.layers[1].self_attn.o_proj = saved
    metrics = residual.projection_metrics(km.model, km.layout.num_kv_heads, km.layout.value_dim)
    assert torch.equal(metrics[1], fm.projection_metric(saved.weight, km.layout.num_kv_heads, km.layout.value_dim))


def test_mla_models_take_the_allocator_instead():
    km = _km("tiny-deepseek-v2")
    assert Window(km, patch="origin-akin", fit="residual").fit == "alloc"


def test_gemma_post_attention_norm_is_weighed_to_first_order():
    """Gemma-3 adds norm(o_proj(a)) to the stream: a small error δ in the attention output a lands
    there as g ⊙ W_o·δ / rms(y) (y = o_proj(a)), which the model's own norm and projection confirm
    to first order; the layer's projection metric carries g (`norm_gain`, read from the module:
    Gemma's weight w acts as 1 + w)."""
    km = _km("tiny-gemma3")
    layer = km.model.model.layers[0]
    norm, proj = layer.post_attention_layernorm, layer.self_attn.o_proj
    weight = proj.weight.detach().double()
    hidden, width = weight.shape
    gain, eps = residual.norm_gain(norm, hidden)
    assert torch.allclose(gain, 1 + norm.weight.double(), rtol=1e-6)
    g = torch.Generator().manual_seed(3)
    ratios = []
    for _ in range(8):
        a = torch.randn(1, width, generator=g)
        delta = 1e-3 * torch.randn(1, width, generator=g)
        with torch.no_grad():
            y = proj(a)
            moved = (norm(proj(a + delta)) - norm(y)).double().square().sum()
        weighted = gain[:, None] * weight
        predicted = (weighted @ delta[0].double()).square().sum() / (y.double().square().mean() + eps)
        ratios.append(float(moved / predicted))
    assert 0.9 < min(ratios) and max(ratios) < 1.01  # the norm also removes δ's part along y
    metrics = residual.projection_metrics(km.model, km.layout.num_kv_heads, km.layout.value_dim)
    assert torch.allclose(metrics[0], fm.projection_metric(gain[:, None] * weight, km.layout.num_kv_heads,
                                                           km.layout.value_dim), rtol=1e-9)
    llama = _km("tiny-llama-gqa").model.model.layers[0]
    assert residual.post_attention_norm(llama) is None  # Llama's post_attention_layernorm is the MLP's input norm
