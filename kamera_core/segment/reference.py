"""Segment attention's contract and its torch reference (the package's docstring has the math):
the segment record, the input checks, visibility masks, one segment's partial softmax state, the
log-sum-exp merge, and `segment_attention_reference`, which every other path is tested against."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from kamera_core.patch import LayerPatch
from kamera_core.relocate import relocate_keys
from kamera_core.rope import RopeSpec

Tensor = torch.Tensor


@dataclass(frozen=True, slots=True)
class Segment:
    """One run of cached keys and values as attention reads them.

    keys: `[T, Hkv, D]` in the frame they were computed in (canonical KV: the chunk-local frame);
    values: `[T, Hkv, Dv]`.
    first: token index of the first key in the sequence (masks compare token indices).
    shift: positions the keys are placed at relative to their frame (canonical KV of a chunk that
        starts at position p: shift p; KV already computed in place: shift 0).
    patch: low-rank correction in the keys' frame (`LayerPatch`: `k` for keys, `v` for values),
        or None.
    """

    keys: Tensor
    values: Tensor
    first: int
    shift: int = 0
    patch: LayerPatch | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[0])

    @property
    def end(self) -> int:
        """Token index one past the last key."""
        return self.first + self.num_tokens


def check_segments(query: Tensor, query_index: Tensor, segments: Sequence[Segment], spec: RopeSpec,
                   window: int | None = None) -> None:
    """ValueError / TypeError naming what is wrong with a segment table; nothing is read otherwise.

    Checks shapes against the query, patch factor shapes against their segment, that segments do
    not overlap in token index, that query indices are increasing, and the window."""
    if not isinstance(query, Tensor) or query.dim() != 3:
        raise ValueError(f"query must be a [Tq, Hq, D] tensor, got {getattr(query, 'shape', type(query).__name__)}")
    num_q, num_heads, head_dim = query.shape
    if not isinstance(query_index, Tensor) or query_index.dim() != 1 or query_index.shape[0] != num_q:
        raise ValueError(f"query_index must be a [{num_q}] tensor of token indices, got "
                         f"{getattr(query_index, 'shape', type(query_index).__name__)}")
    if num_q > 1 and bool((query_index[1:] <= query_index[:-1]).any()):
        raise ValueError("query_index must be strictly increasing (query rows are consecutive tokens)")
    if head_dim < spec.rotary_dim:
        raise ValueError(f"query head_dim {head_dim} is smaller than the RoPE spec's rotary_dim {spec.rotary_dim}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if not segments:
        raise ValueError("segment attention needs at least one segment (the query's own keys at least)")
    spans = []
    for n, seg in enumerate(segments):
        if not isinstance(seg, Segment):
            raise TypeError(f"segments[{n}] must be a Segment, got {type(seg).__name__}")
        k, v = seg.keys, seg.values
        if k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
            raise ValueError(f"segment {n}: keys [T, Hkv, D] and values [T, Hkv, Dv] must agree, got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if k.shape[0] == 0:
            raise ValueError(f"segment {n} holds no tokens")
        if k.shape[2] != head_dim or num_heads % k.shape[1]:
            raise ValueError(f"segment {n}: keys {tuple(k.shape)} do not fit query heads {num_heads} x {head_dim} "
                             "(head_dim must match and Hq must be a multiple of Hkv): a cache from another model?")
        if k.dtype != query.dtype or v.dtype != query.dtype:
            raise TypeError(f"segment {n}: keys/values dtype {k.dtype}/{v.dtype} differ from the query's {query.dtype}")
        if isinstance(seg.first, bool) or not isinstance(seg.first, int) or seg.first < 0:
            raise ValueError(f"segment {n}: first must be a non-negative int token index, got {seg.first!r}")
        if isinstance(seg.shift, bool) or not isinstance(seg.shift, int):
            raise ValueError(f"segment {n}: shift must be an int, got {seg.shift!r}")
        if seg.patch is not None:
            for slot, f, feat in (("k", seg.patch.k, k.shape[1:]), ("v", seg.patch.v, v.shape[1:])):
                if f is None:
                    continue
                if f.u.shape[0] != k.shape[0] or tuple(f.vt.shape[1:]) != tuple(feat):
                    raise ValueError(f"segment {n}: {slot} patch u {tuple(f.u.shape)}, vt {tuple(f.vt.shape)} does not "
                                     f"match the segment's {k.shape[0]} tokens x {tuple(feat)}")
        spans.append((seg.first, seg.end, n))
    spans.sort()
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"segments {an} [{a0}, {a1}) and {bn} [{b0}, {b1}) overlap in token index")


def visible(query_index: Tensor, key_index: Tensor, window: int | None) -> Tensor:
    """`[Tq, T]` bool: which keys each query row may read (causal, and within `window`)."""
    diff = query_index[:, None] - key_index[None, :]  # (Tq, T)
    ok = diff >= 0
    if window is not None:
        ok &= diff < window
    return ok


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def segment_state(query: Tensor, query_index: Tensor, seg: Segment, spec: RopeSpec, scaling: float,
                  window: int | None = None, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """One segment's partial attention: `(out [Tq, Hq, Dv], lse [Tq, Hq])` in the compute dtype
    (float32, float64 for float64 inputs). Rows that see no key of the segment get out 0 and
    lse −inf."""
    return patch_option_states(query, query_index, seg, spec, scaling, window, softcap)[0]


def patch_option_states(query: Tensor, query_index: Tensor, seg: Segment, spec: RopeSpec, scaling: float,
                        window: int | None = None, softcap: float | None = None, options: Sequence[str] = ("kv",)
                        ) -> list[tuple[Tensor, Tensor]]:
    """`segment_state` of `seg` with parts of its patch left out, one state per option: "kv" the
    whole patch, "k" the key patch only, "v" the value patch only, "none" no patch (a part the
    segment has no patch for is simply absent). The scores and probabilities are computed once
    per key-patch setting and shared, so the options cost about two states, not four."""
    if any(o not in ("none", "k", "v", "kv") for o in options):
        raise ValueError(f"options must be among 'none', 'k', 'v', 'kv', got {list(options)}")
    compute = _compute_dtype(query.dtype)
    num_q, num_heads, head_dim = query.shape
    num_kv = seg.keys.shape[1]
    groups = num_heads // num_kv
    q = query.to(compute)
    if seg.shift:
        q = relocate_keys(q, spec, -seg.shift, backend="torch")  # (Tq, Hq, D) into the keys' frame
    q = q.reshape(num_q, num_kv, groups, head_dim)  # (Tq, Hkv, G, D): query head h reads KV head h // G
    base = torch.einsum("qkgd,tkd->kgqt", q, seg.keys.to(compute))  # (Hkv, G, Tq, T)
    pk = seg.patch.k if seg.patch is not None and seg.patch.k is not None and seg.patch.k.rank else None
    pv = seg.patch.v if seg.patch is not None and seg.patch.v is not None and seg.patch.v.rank else None
    key_index = torch.arange(seg.first, seg.end, device=query.device)
    hidden = ~visible(query_index.to(query.device), key_index, window)
    values = seg.values.to(compute)
    read: dict[bool, tuple[Tensor, Tensor, Tensor]] = {}  # key patch used -> (lse, probs, probs · V)

    def reading(with_k: bool) -> tuple[Tensor, Tensor, Tensor]:
        if with_k not in read:
            scores = base
            if with_k and pk is not None:
                u, vt = pk.factors(compute)  # (T, m), (m, Hkv, D)
                scores = scores + torch.einsum("qkgd,mkd->kgqm", q, vt) @ u.T  # (Hkv, G, Tq, T)
            scores = scores * scaling
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(hidden, -math.inf)
            lse = torch.logsumexp(scores, dim=-1)  # (Hkv, G, Tq)
            probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # rows with no visible key: 0
            read[with_k] = (lse, probs, torch.einsum("kgqt,tkd->qkgd", probs, values))  # (Tq, Hkv, G, Dv)
        return read[with_k]

    states = []
    for option in options:
        lse, probs, out = reading("k" in option)
        if "v" in option and pv is not None:
            u, vt = pv.factors(compute)  # (T, m), (m, Hkv, Dv)
            out = out + torch.einsum("kgqm,mkd->qkgd", probs @ u, vt)
        states.append((out.reshape(num_q, num_heads, -1), lse.permute(2, 0, 1).reshape(num_q, num_heads)))
    return states


def merge_states(states: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge partial attention states `(out [Tq, Hq, Dv], lse [Tq, Hq])` over disjoint key sets
    into the state over their union (log-sum-exp weighting). Rows no segment sees stay 0 / −inf."""
    if not states:
        raise ValueError("merge_states needs at least one state")
    lses = torch.stack([lse for _, lse in states])  # (S, Tq, Hq)
    total = torch.logsumexp(lses, dim=0)  # (Tq, Hq)
    weights = torch.exp(lses - total[None]).nan_to_num(0.0)  # (S, Tq, Hq)
    out = sum(w[..., None] * o for w, (o, _) in zip(weights, states))
    return out, total


def segment_attention_reference(query: Tensor, query_index: Tensor, segments: Sequence[Segment], spec: RopeSpec,
                                scaling: float, window: int | None = None, softcap: float | None = None) -> Tensor:
    """Attention of `query` `[Tq, Hq, D]` (token indices `query_index` `[Tq]`) over `segments`:
    `[Tq, Hq, Dv]` in the query's dtype. The plain torch path every other implementation is
    tested against. A row that sees no key at all is a caller error (ValueError)."""
    check_segments(query, query_index, segments, spec, window)
    out, lse = merge_states([segment_state(query, query_index, s, spec, scaling, window, softcap) for s in segments])
    if bool(torch.isinf(lse).any()):
        raise ValueError("a query row sees no key (every key is masked): the query rows must follow their own keys")
    return out.to(query.dtype)
