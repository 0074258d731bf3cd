"""`SegmentCache`, a transformers `Cache` whose layers hold segment references plus a dense tail, and the "kamera"
attention function that reads them in place (docs/DESIGN.md, "The KV engine")."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kamera_core import KVLayout, RopeSpec
from kamera_core.patch import LayerPatch
from kamera_core.segment import Segment, segment_attention, visible

ATTENTION = "kamera"
_registered = False


def register() -> None:
    """Register the attention function and its mask function under `ATTENTION` (idempotent)."""
    global _registered
    if _registered:
        return
    AttentionInterface.register(ATTENTION, segment_attention_forward)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    _registered = True


class SegmentLayer(CacheLayerMixin):
    """One decoder layer of a `SegmentCache`: `segments` read in place (token-major `Segment`s; MLA: keys = c_KV
    `[T, R]`, values = k_rope `[T, r]`), then a dense tail `keys` / `values` `[1, kv_heads, tail, dim]` (None before the
    first update) starting at token index `first`, the number of tokens the segments hold."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, segments: Sequence[Segment], first: int) -> None:
        super().__init__()
        self.segments = tuple(segments)
        self.first = first
        # Batched forwards (`SegmentCache.variants`): batch row b reads variants[b], then its own tail.
        self.variants: tuple[tuple[Segment, ...], ...] | None = None
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `[1, kv_heads, new, dim]` states to the tail (mutates the layer); returns the whole tail."""
        if not self.is_initialized:
            self.keys, self.values, self.is_initialized = key_states, value_states, True
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    @property
    def tail_len(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[-2])

    def get_seq_length(self) -> int:
        return self.first + self.tail_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # transformers builds its mask over the tail only; the attention masks segments itself.
        return self.tail_len + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def tail_kv(self, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """The tail token-major: `([T, H, D], [T, H, Dv])` (MLA: `([T, R], [T, r])`), views."""
        k, v = self.keys[0].transpose(0, 1), self.values[0].transpose(0, 1)  # (T, H, D)
        return (k[:, 0], v[:, 0]) if layout.family == "mla" else (k, v)


class SegmentCache(Cache):
    """transformers `Cache` of one `SegmentLayer` per decoder layer; `specs` / `layout` (the model's RoPE specs and KV
    layout) place the segments. ValueError when the layer counts differ. `probe`: None or a `QueryProbe` that every
    layer's attention fills with the post-RoPE queries of a few rows."""

    def __init__(self, segments_per_layer: Sequence[Sequence[Segment]], first: int, specs: Sequence[RopeSpec],
                 layout: KVLayout) -> None:
        if len(segments_per_layer) != len(specs):
            raise ValueError(f"{len(segments_per_layer)} layers of segments for a model of {len(specs)} layers: "
                             "a cache from another model?")
        super().__init__(layers=[SegmentLayer(segs, first) for segs in segments_per_layer])
        self.specs, self.layout, self.first = tuple(specs), layout, first
        self.probe: Any = None  # an `agentwin.patches.guard.QueryProbe` the attention fills, or None

    @classmethod
    def variants(cls, per_row: Sequence[Sequence[Sequence[Segment]]], first: int, specs: Sequence[RopeSpec],
                 layout: KVLayout) -> "SegmentCache":
        """A cache for a forward of batch `len(per_row)`, row b reading `per_row[b][i]` in layer i (every row's segments
        holding the same `first` tokens). ValueError for no rows, an MLA layout, or a row without every layer."""
        if not per_row:
            raise ValueError("variants needs at least one batch row of segments")
        if layout.family == "mla":
            raise ValueError("batched segment variants are not supported for MLA models")
        if any(len(row) != len(specs) for row in per_row):
            raise ValueError(f"every batch row needs segments for each of the model's {len(specs)} layers")
        cache = cls([()] * len(specs), first, specs, layout)
        for i, layer in enumerate(cache.layers):
            layer.variants = tuple(tuple(row[i]) for row in per_row)
        return cache

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    @property
    def is_compileable(self) -> bool:
        return False

    def tail_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's tail, token-major views (`SegmentLayer.tail_kv`)."""
        return [layer.tail_kv(self.layout) for layer in self.layers]


def _dense(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
           dropout: float, scaling: float | None, first: int | None, window: int | None, **kwargs: Any
           ) -> torch.Tensor:
    """Attention of the query rows over the tail alone with SDPA; `[1, Tq, Hq, Dv]`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if first is None:  # a plain forward (no segment cache): transformers' own path and mask
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=window, **kwargs)[0]
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = None
    if q_len > 1 or (window is not None and kv_len > window):
        key_index = torch.arange(first, first + kv_len, device=query.device)
        mask = visible(key_index[kv_len - q_len:], key_index, window)  # (Tq, S)
        if window is None and q_len == kv_len:
            mask = None  # plain causal: let SDPA pick its causal kernel
    groups = query.shape[1] // key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, is_causal=mask is None and q_len > 1 and q_len == kv_len,
        enable_gqa=groups > 1)
    return out.transpose(1, 2)  # (1, Tq, Hq, Dv)


def _mla_segments(module: Any, layer: SegmentLayer, spec: RopeSpec, key: torch.Tensor, value: torch.Tensor
                  ) -> tuple[list[Segment], RopeSpec]:
    """MLA: each segment's c_KV / k_rope, patched, expanded with the module's own `expand_kv`, feature dims reordered
    rope-first because `RopeSpec` rotates the leading dims."""
    nope = int(module.qk_nope_head_dim)
    out = []
    for seg in layer.segments:
        ckv, krope = seg.keys, seg.values  # (T, R), (T, r)
        if seg.patch is not None:
            if seg.patch.k is not None:
                ckv = ckv + seg.patch.k.dense(ckv.dtype)
            if seg.patch.v is not None:
                krope = krope + seg.patch.v.dense(krope.dtype)
        k, v = module.expand_kv(ckv[None, None], krope[None, None])  # (1, H, T, Dn + r), (1, H, T, Dv)
        k = torch.cat([k[..., nope:], k[..., :nope]], dim=-1)[0].transpose(0, 1)  # (T, H, r + Dn)
        out.append(Segment(k, v[0].transpose(0, 1), seg.first, seg.shift))
    tail_k = torch.cat([key[..., nope:], key[..., :nope]], dim=-1)[0].transpose(0, 1)
    out.append(Segment(tail_k, value[0].transpose(0, 1), layer.first))
    return out, dataclasses.replace(spec, head_dim=int(key.shape[-1]))


def segment_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                              sliding_window: int | None = None, softcap: float | None = None,
                              segment_cache: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: query `[1, Hq, Tq, D]` post-RoPE, key / value the tail `[1, Hkv, S, D]` with
    the query's own keys last; returns `([1, Tq, Hq, Dv], None)`. Without `segment_cache` it is SDPA (ValueError for
    soft-capping there); ValueError for a batch over 1 unless the cache holds variants."""
    layer_idx = getattr(module, "layer_idx", None)
    if segment_cache is None or layer_idx is None:
        if softcap is not None:
            raise ValueError("logit soft-capping is not supported by agentwin's attention; use a model without it")
        return _dense(module, query, key, value, attention_mask, dropout, scaling, None, sliding_window, **kwargs), None
    layer = segment_cache.layers[layer_idx]
    if layer.variants is not None:
        return _variant_attention(layer, segment_cache.specs[layer_idx], query, key, value, scaling, sliding_window,
                                  softcap), None
    if query.shape[0] != 1:
        raise ValueError(f"segment attention reads one sequence at a time, got batch {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if segment_cache.probe is not None:
        segment_cache.probe.record(layer_idx, query, scale, sliding_window, softcap)
    if not layer.segments and softcap is None:
        return _dense(module, query, key, value, attention_mask, dropout, scale, layer.first, sliding_window), None
    spec = segment_cache.specs[layer_idx]
    q = query[0].transpose(0, 1)  # (Tq, Hq, D)
    if segment_cache.layout.family == "mla":
        nope = int(module.qk_nope_head_dim)
        q = torch.cat([q[..., nope:], q[..., :nope]], dim=-1)  # rope dims first, as the keys below
        segments, spec = _mla_segments(module, layer, spec, key, value)
    else:
        segments = [*layer.segments, Segment(key[0].transpose(0, 1), value[0].transpose(0, 1), layer.first)]
    end = layer.first + int(key.shape[2])
    query_index = torch.arange(end - q.shape[0], end, device=q.device)
    out = segment_attention(q, query_index, segments, spec, scale, window=sliding_window, softcap=softcap)
    return out[None], None  # (1, Tq, Hq, Dv)


def _variant_attention(layer: SegmentLayer, spec: RopeSpec, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, scaling: float | None, window: int | None, softcap: float | None
                       ) -> torch.Tensor:
    """Row b of `query` `[B, Hq, Tq, D]` over `layer.variants[b]` and its own tail: `[B, Tq, Hq, Dv]`."""
    if query.shape[0] != len(layer.variants):
        raise ValueError(f"a forward of batch {query.shape[0]} over a cache of {len(layer.variants)} variants")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    end = layer.first + int(key.shape[2])
    query_index = torch.arange(end - query.shape[2], end, device=query.device)
    outs = []
    for b, segments in enumerate(layer.variants):
        tail = Segment(key[b].transpose(0, 1), value[b].transpose(0, 1), layer.first)
        outs.append(segment_attention(query[b].transpose(0, 1), query_index, [*segments, tail], spec, scale,
                                      window=window, softcap=softcap))
    return torch.stack(outs)


def patch_of(patch: Any, layer: int) -> LayerPatch | None:
    """Layer `layer` of a `ChunkPatch` (None stays None)."""
    return None if patch is None else patch.layers[layer]
