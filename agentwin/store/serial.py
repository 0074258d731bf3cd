"""Named-tensor forms of per-layer KV and of `kamera_core.patch.ChunkPatch`, for `ChunkStore`.
KV: `{"k.{i}", "v.{i}"}` per layer i, token-major `[T, H, D]` (MLA `[T, R]` / `[T, r]`). Patch:
`{"p.{i}.{k|v}.{part}"}`, part "u" `[T, m]`, "vt" `[m, *F]`, for int8 factors "u_scale"/"vt_scale" `[m]`
float32, for mixed ones also the packed 4-bit "u4"/"vt4" uint8; a slot without a patch has no tensors."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from kamera_core.patch import ChunkPatch, Factors, LayerPatch

Tensor = torch.Tensor
PATCH_FORMAT = "kamera.ChunkPatch/1"
_KV_NAME = re.compile(r"([kv])\.(0|[1-9][0-9]*)")
_PATCH_NAME = re.compile(r"p\.(0|[1-9][0-9]*)\.([kv])\.(u|vt|u_scale|vt_scale|u4|vt4)")


def _tensor(x: object, what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    return x


def kv_to_tensors(kv: Sequence[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    """`{"k.{i}", "v.{i}"}` for each layer's `(k, v)` pair (the same tensors, not copies)."""
    if isinstance(kv, (str, bytes, Mapping)) or not isinstance(kv, Sequence):
        raise TypeError(f"kv must be a sequence of (k, v) tensor pairs, got {type(kv).__name__}")
    out: dict[str, Tensor] = {}
    for i, pair in enumerate(kv):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"kv[{i}] must be a (k, v) pair of tensors, got {type(pair).__name__}")
        out[f"k.{i}"] = _tensor(pair[0], f"kv[{i}].k")
        out[f"v.{i}"] = _tensor(pair[1], f"kv[{i}].v")
    return out


def tensors_to_kv(d: Mapping[str, Tensor]) -> list[tuple[Tensor, Tensor]]:
    """Inverse of `kv_to_tensors`: exactly "k.0".."k.{L-1}" and "v.0".."v.{L-1}", else ValueError."""
    if not isinstance(d, Mapping):
        raise TypeError(f"tensors must be a mapping of names to tensors, got {type(d).__name__}")
    layers: dict[int, dict[str, Tensor]] = {}
    for name, t in d.items():
        m = _KV_NAME.fullmatch(name) if isinstance(name, str) else None
        if m is None:
            raise ValueError(f"unexpected tensor name {name!r} in KV tensors (want 'k.{{i}}' / 'v.{{i}}')")
        layers.setdefault(int(m[2]), {})[m[1]] = _tensor(t, name)
    if sorted(layers) != list(range(len(layers))):
        raise ValueError(f"KV layers must be numbered 0..{len(layers) - 1}, got {sorted(layers)}")
    for i, slots in layers.items():
        if set(slots) != {"k", "v"}:
            raise ValueError(f"KV layer {i} needs both 'k.{i}' and 'v.{i}', got {sorted(slots)}")
    return [(layers[i]["k"], layers[i]["v"]) for i in range(len(layers))]


def patch_to_tensors(p: ChunkPatch) -> tuple[dict[str, Tensor], dict[str, object]]:
    """(named tensors, meta) of a ChunkPatch; `tensors_to_patch` inverts it exactly."""
    if not isinstance(p, ChunkPatch):
        raise TypeError(f"patch must be a kamera_core ChunkPatch, got {type(p).__name__}")
    out: dict[str, Tensor] = {}
    for i, lp in enumerate(p.layers):
        for slot, f in (("k", lp.k), ("v", lp.v)):
            if f is None:
                continue
            out[f"p.{i}.{slot}.u"], out[f"p.{i}.{slot}.vt"] = f.u, f.vt
            if f.u_scale is not None:
                out[f"p.{i}.{slot}.u_scale"], out[f"p.{i}.{slot}.vt_scale"] = f.u_scale, f.vt_scale
            if f.u4 is not None:
                out[f"p.{i}.{slot}.u4"], out[f"p.{i}.{slot}.vt4"] = f.u4, f.vt4
    return out, {"format": PATCH_FORMAT, "method": p.method, "num_layers": len(p.layers)}


def tensors_to_patch(d: Mapping[str, Tensor], meta: Mapping[str, object]) -> ChunkPatch:
    """Inverse of `patch_to_tensors` (extra meta keys are ignored; extra tensors are an error)."""
    if not isinstance(d, Mapping) or not isinstance(meta, Mapping):
        raise TypeError("tensors_to_patch needs a mapping of tensors and a meta mapping")
    if meta.get("format") != PATCH_FORMAT:
        raise ValueError(f"meta format must be {PATCH_FORMAT!r}, got {meta.get('format')!r}")
    n, method = meta.get("num_layers"), meta.get("method")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"meta num_layers must be an int >= 0, got {n!r}")
    if not isinstance(method, str):
        raise ValueError(f"meta method must be a str, got {method!r}")
    parts: dict[tuple[int, str], dict[str, Tensor]] = {}
    for name, t in d.items():
        m = _PATCH_NAME.fullmatch(name) if isinstance(name, str) else None
        if m is None or int(m[1]) >= n:
            raise ValueError(f"unexpected tensor name {name!r} for a {n}-layer patch")
        parts.setdefault((int(m[1]), m[2]), {})[m[3]] = _tensor(t, name)

    def factors(i: int, slot: str) -> Factors | None:
        got = parts.get((i, slot))
        if got is None:
            return None
        if set(got) not in ({"u", "vt"}, {"u", "vt", "u_scale", "vt_scale"}, {"u", "vt", "u_scale", "vt_scale", "u4", "vt4"}):
            raise ValueError(f"patch layer {i} slot {slot} has parts {sorted(got)}; want u, vt (+ both scales "
                             f"(+ u4, vt4))")
        return Factors(got["u"], got["vt"], got.get("u_scale"), got.get("vt_scale"), got.get("u4"), got.get("vt4"))

    return ChunkPatch(tuple(LayerPatch(factors(i, "k"), factors(i, "v")) for i in range(n)), method)
