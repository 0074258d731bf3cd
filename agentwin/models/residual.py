"""What fit="residual" reads from the model besides the pass's queries: each decoder layer's
output projection (where the attention output lands in the residual stream) and the size of the
residual stream the layer reads, measured on the chunk's rows during the pass the window runs
anyway (forward pre-hooks: no extra forward, nothing kept but one number per row and layer).

A layer's attention error is added to the residual stream h; every later read of it goes through
a normalisation that divides by ||h||, so an error matters in proportion to the stream's size
where it lands. fit="residual" measures each layer's K and V error in the residual stream
(`kamera_core.patch.projection_metric`) relative to Σ ||h||² over the chunk's rows there. Gemma-3
normalises the attention's output again before adding it to the stream; the metric leaves that
rescaling out (a first-order weighting, not an exact one, on every family).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch

from kamera_core import patch as kp

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
    """Per layer `kamera_core.patch.projection_metric` of its attention's output projection
    (computed once per model, float64; `ResidualUnsupported` where a layer shows none)."""
    if model in _METRICS:
        return _METRICS[model]
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        weight = _projection(layer)
        if weight is None:
            raise ResidualUnsupported(f"decoder layer {i} of {type(model).__name__} shows no attention output "
                                      f"projection (self_attn.o_proj, attention.dense, ...); fit='residual' cannot "
                                      f"weigh its output: use fit='output'")
        out.append(kp.projection_metric(weight, num_kv_heads, value_dim))  # it detaches the weight
    _METRICS[model] = out
    return out


# (attention module, output projection) names across the RoPE families transformers ships.
_PROJECTIONS = tuple((a, p) for a in ("self_attn", "attention", "self_attention", "attn")
                     for p in ("o_proj", "dense", "out_proj"))


def _projection(layer: Any) -> torch.Tensor | None:
    """The attention's output projection weight `[hidden, Hq·Dv]`: `self_attn.o_proj` (Llama,
    Qwen, Gemma, Mistral families), `attention.dense` (GPT-NeoX), and the like."""
    for attention, name in _PROJECTIONS:
        module = getattr(getattr(layer, attention, None), name, None)
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return weight
    return None


@contextlib.contextmanager
def recording(model: Any, rows: slice | None = None) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, every forward records per decoder layer the squared norm of the residual
    stream entering it, `[n]` float64 for the rows `rows` of the (single) sequence (default all);
    the dict maps layer index to the last forward's rows."""
    found: dict[int, torch.Tensor] = {}

    def hook(index: int):
        def record(module: Any, args: tuple, kwargs: dict) -> None:
            h = args[0] if args else kwargs.get("hidden_states")
            if isinstance(h, torch.Tensor) and h.dim() == 3:
                found[index] = h[0, rows if rows is not None else slice(None)].detach().double().square().sum(-1)
        return record

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i, layer in enumerate(decoder_layers(model))]
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
