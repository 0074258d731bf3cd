"""Conversion between transformers' `[batch, kv_heads, seq, head_dim]` caches and kamera_core's token-major
`[tokens, kv_heads, head_dim]` layout (MLA: c_KV in `.keys`, k_rope in `.values`, one head each); only here."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kamera_core import KVLayout, RopeSpec, relocate_keys, relocate_mla

LayerKV = tuple[torch.Tensor, torch.Tensor]


def extract_kv(cache: Any, layout: KVLayout, batch_index: int = 0) -> list[LayerKV]:
    """Per-layer (keys, values) of batch row `batch_index`, token-major views (no copy): MHA/GQA
    `([T, kv_heads, head_dim], [T, kv_heads, value_dim])`, MLA `(c_KV [T, kv_lora_rank], k_rope [T, rope_dim])`."""
    out = []
    for layer in cache.layers:
        k = layer.keys[batch_index].transpose(0, 1)  # (T, H, D)
        v = layer.values[batch_index].transpose(0, 1)  # (T, H, D)
        if layout.family == "mla":
            k, v = k[:, 0], v[:, 0]  # (T, R), (T, r)
        out.append((k, v))
    return out


def relocate_kv(kv: Sequence[LayerKV], specs: Sequence[RopeSpec], layout: KVLayout, delta: int) -> list[LayerKV]:
    """Every layer's KV moved by `delta` positions: keys (MLA: k_rope) rotated into new tensors, values and c_KV
    returned as they are. ValueError when the layer counts of `kv` and `specs` differ."""
    if len(kv) != len(specs):
        raise ValueError(f"{len(kv)} layers of KV but {len(specs)} RoPE specs")
    out = []
    for (k, v), spec in zip(kv, specs):
        if layout.family == "mla":
            out.append(relocate_mla(k, v, spec, delta))
        else:
            out.append((relocate_keys(k, spec, delta), v))
    return out


def build_cache(kv: Sequence[LayerKV], config: Any, layout: KVLayout) -> Any:
    """A transformers `DynamicCache` (batch 1) holding `kv`, ready to pass as `cache=`."""
    return build_cache_parts([kv], config, layout)


def build_cache_parts(parts: Sequence[Sequence[LayerKV]], config: Any, layout: KVLayout) -> Any:
    """`build_cache(concat_kv(*parts))` with one copy per layer, straight into `[1, kv_heads, tokens, head_dim]`."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for index in range(len(parts[0])):
        ks = [p[index][0] for p in parts]
        vs = [p[index][1] for p in parts]
        if layout.family == "mla":
            ks, vs = [k[:, None] for k in ks], [v[:, None] for v in vs]
        k = torch.cat([k.transpose(0, 1) for k in ks], dim=1)[None]
        v = torch.cat([v.transpose(0, 1) for v in vs], dim=1)[None]
        cache.update(k, v, index)
    return cache


def concat_kv(*parts: Sequence[LayerKV]) -> list[LayerKV]:
    """Layer-wise concatenation along tokens of several chunks' KV."""
    return [(torch.cat([p[i][0] for p in parts]), torch.cat([p[i][1] for p in parts])) for i in range(len(parts[0]))]
