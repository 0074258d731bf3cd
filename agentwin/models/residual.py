"""What fit="residual" reads from the model: each decoder layer's attention output projection and the squared norm
of the residual stream it reads, recorded by forward pre-hooks during a pass the window runs anyway (no extra
forward). Both weightings are first order, not exact."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch

from kamera_core import fit_metric as fm

_METRICS: "weakref.WeakKeyDictionary[Any, list[torch.Tensor]]" = weakref.WeakKeyDictionary()


class ResidualUnsupported(ValueError):
    """The model's decoder layers do not expose what fit="residual" reads."""


def decoder_layers(model: Any) -> list[Any]:
    """The text decoder's layers, in order (their index is the attention's `layer_idx`)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ResidualUnsupported(f"{type(model).__name__} has no decoder layers at model.get_decoder().layers; "
                                  f"fit='residual' cannot read it: use fit='output'")
    return list(layers)


def projection_metrics(model: Any, num_kv_heads: int, value_dim: int) -> list[torch.Tensor]:
    """Per layer, `kamera_core.fit_metric.projection_metric` of the attention output projection, its rows scaled by
    the gain of a post-attention norm where there is one; float64, computed once per model. `ResidualUnsupported` for a
    layer with no projection, or a post-attention norm that is not an RMS norm."""
    if model in _METRICS:
        return _METRICS[model]
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        weight = _projection(layer)
        if weight is None:
            raise ResidualUnsupported(f"decoder layer {i} of {type(model).__name__} shows no attention output "
                                      f"projection (self_attn.o_proj, attention.dense, ...); fit='residual' cannot "
                                      f"weigh its output: use fit='output'")
        norm = post_attention_norm(layer)
        if norm is not None:
            weight = norm_gain(norm, int(weight.shape[0]), i)[0].to(weight.device)[:, None] * weight.detach().double()
        out.append(fm.projection_metric(weight, num_kv_heads, value_dim))  # it detaches the weight
    _METRICS[model] = out
    return out


def post_attention_norm(layer: Any) -> Any:
    """The norm applied to the attention output before it joins the stream (Gemma-2/3), or None; only layers that also
    have `pre_feedforward_layernorm` have one (elsewhere `post_attention_layernorm` is the MLP's input norm)."""
    if getattr(layer, "pre_feedforward_layernorm", None) is None:
        return None
    return getattr(layer, "post_attention_layernorm", None)


def _eps(norm: Any) -> float:
    return float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))


def norm_gain(norm: Any, hidden: int, index: int = 0) -> tuple[torch.Tensor, float]:
    """`(g [hidden] float64 on CPU, ε)` of an RMS norm y = x / sqrt(mean(x²) + ε) ⊙ g, read by running the module (any
    weight convention, e.g. Gemma's 1 + w); `ResidualUnsupported` if a random-vector check shows another form."""
    eps = _eps(norm)
    param = next(iter(norm.parameters()), None)
    dtype = torch.float32 if param is None else param.dtype
    device = None if param is None else param.device
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    with torch.no_grad():
        gain = norm(torch.ones(1, hidden, device=device, dtype=dtype))[0].double() * (1 + eps) ** 0.5
        got = norm(x)[0].double()
    want = x[0].double() * torch.rsqrt(x[0].double().square().mean() + eps) * gain
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
        raise ResidualUnsupported(f"decoder layer {index}'s post-attention norm ({type(norm).__name__}) is not an RMS "
                                  f"norm; fit='residual' cannot weigh the attention's output through it: use fit='output'")
    return gain.cpu(), eps


# (attention module, output projection) names across the RoPE families transformers ships.
_PROJECTIONS = tuple((a, p) for a in ("self_attn", "attention", "self_attention", "attn")
                     for p in ("o_proj", "dense", "out_proj"))


def _projection(layer: Any) -> torch.Tensor | None:
    """The attention output projection weight `[hidden, Hq·Dv]` (`self_attn.o_proj`, `attention.dense`...), or None."""
    for attention, name in _PROJECTIONS:
        module = getattr(getattr(layer, attention, None), name, None)
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return weight
    return None


@contextlib.contextmanager
def recording(model: Any, rows: slice | None = None) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, each forward fills the yielded dict {layer: `[n]` float64} with the squared residual norm
    entering each decoder layer, for `rows` of the single sequence (default all; the last forward wins). Behind a
    post-attention norm of input y it is divided by the rows' mean of 1 / (mean(y²) + ε), the unit of
    `projection_metrics`."""
    found: dict[int, torch.Tensor] = {}
    pick = rows if rows is not None else slice(None)

    def hook(index: int):
        def record(module: Any, args: tuple, kwargs: dict) -> None:
            h = args[0] if args else kwargs.get("hidden_states")
            if isinstance(h, torch.Tensor) and h.dim() == 3:
                found[index] = h[0, pick].detach().double().square().sum(-1)
        return record

    def post(index: int, eps: float):
        def rescale(module: Any, args: tuple) -> None:
            y = args[0] if args else None
            if isinstance(y, torch.Tensor) and y.dim() == 3 and index in found:
                inverse = 1.0 / (y[0, pick].detach().double().square().mean(-1) + eps)
                found[index] = found[index] / inverse.mean()
        return rescale

    layers = decoder_layers(model)
    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    for i, layer in enumerate(layers):
        norm = post_attention_norm(layer)
        if norm is not None:
            handles.append(norm.register_forward_pre_hook(post(i, _eps(norm))))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def residual_norms(found: dict[int, torch.Tensor], layers: int) -> list[float]:
    """Σ over the recorded rows of ||h||² per layer (what `recording` filled), checked complete."""
    missing = [i for i in range(layers) if i not in found]
    if missing:
        raise RuntimeError(f"the pass recorded no residual stream for layers {missing[:5]}; "
                           f"the model's decoder layers were not called as expected")
    return [float(found[i].sum()) for i in range(layers)]
