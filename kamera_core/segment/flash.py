"""Segment attention for CPU passes with many query rows (a chunk's in-context pass): each
segment through torch's CPU flash-attention kernel, merged by log-sum-exp."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from kamera_core.relocate import relocate_keys
from kamera_core.rope import RopeSpec
from kamera_core.segment.reference import Segment, check_segments, merge_states, segment_attention_reference, visible

Tensor = torch.Tensor


def _flash_state(query: Tensor, query_index: Tensor, seg: Segment, spec: RopeSpec, scaling: float,
                 window: int | None) -> tuple[Tensor, Tensor]:
    """`segment_state` through torch's CPU flash-attention kernel (which returns the log-sum-exp
    merging needs): grouped query heads folded into rows so KV heads are read as they lie, patch
    terms carried as extra feature columns (q·[K | U_k]ᵀ with q' = [q | q·V_kᵀ]; P·[V | U_v] then
    ·V_v), masks only where a key is hidden from some row. Inputs' dtype throughout (the kernel
    accumulates in float32). `(out [Tq, Hq, Dv], lse [Tq, Hq])`, float32."""
    num_q, num_heads, head_dim = query.shape
    num_kv, value_dim = seg.keys.shape[1], seg.values.shape[2]
    groups = num_heads // num_kv
    dtype = query.dtype
    q = relocate_keys(query, spec, -seg.shift, backend="torch") if seg.shift else query  # (Tq, Hq, D)
    q = q.reshape(num_q, num_kv, groups, head_dim)  # (Tq, Hkv, G, D)
    k, v = seg.keys, seg.values  # (T, Hkv, D), (T, Hkv, Dv)
    pk = seg.patch.k if seg.patch is not None and seg.patch.k is not None and seg.patch.k.rank else None
    pv = seg.patch.v if seg.patch is not None and seg.patch.v is not None and seg.patch.v.rank else None
    q_cols, k_cols, v_cols = [q], [k], [v]
    if pk is not None:
        u, vt = pk.factors(dtype)  # (T, m), (m, Hkv, D)
        q_cols.append(torch.einsum("qkgd,mkd->qkgm", q, vt))
        k_cols.append(u[:, None, :].expand(-1, num_kv, -1))
    if pv is not None:
        u_v, vt_v = pv.factors(dtype)
        v_cols.append(u_v[:, None, :].expand(-1, num_kv, -1))
    width = max(sum(c.shape[-1] for c in q_cols), sum(c.shape[-1] for c in v_cols))

    def padded(cols: list[Tensor]) -> Tensor:
        extra = width - sum(c.shape[-1] for c in cols)
        if extra:
            cols = [*cols, cols[0].new_zeros(*cols[0].shape[:-1], extra)]
        return cols[0] if len(cols) == 1 else torch.cat(cols, dim=-1)

    qf = padded(q_cols).permute(1, 2, 0, 3).reshape(1, num_kv, groups * num_q, width)  # rows (g, t)
    kf = padded(k_cols).transpose(0, 1)[None]  # (1, Hkv, T, W)
    vf = padded(v_cols).transpose(0, 1)[None]
    key_index = torch.arange(seg.first, seg.end, device=query.device)
    seen = visible(query_index.to(query.device), key_index, window)  # (Tq, T)
    mask = None
    if not bool(seen.all()):
        mask = torch.zeros(seen.shape, dtype=dtype, device=query.device).masked_fill_(~seen, -math.inf)
        mask = mask.repeat(groups, 1)[None, None]  # (1, 1, G*Tq, T)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qf, kf, vf, 0.0, False, attn_mask=mask,
                                                                          scale=scaling)
    out = out[0].reshape(num_kv, groups, num_q, width).permute(2, 0, 1, 3).float()  # (Tq, Hkv, G, W)
    lse = lse[0].reshape(num_kv, groups, num_q).permute(2, 0, 1).float()  # (Tq, Hkv, G)
    result = out[..., :value_dim]
    if pv is not None:
        m = pv.rank
        result = result + torch.einsum("qkgm,mkd->qkgd", out[..., value_dim:value_dim + m], vt_v.float())
    blind = ~seen.any(dim=1)  # rows that see no key of this segment
    if bool(blind.any()):
        result = result.masked_fill(blind[:, None, None, None], 0.0)
        lse = lse.masked_fill(blind[:, None, None], -math.inf)
    return result.reshape(num_q, num_heads, value_dim), lse.reshape(num_q, num_heads)


def segment_attention_flash(query: Tensor, query_index: Tensor, segments: Sequence[Segment], spec: RopeSpec,
                            scaling: float, window: int | None = None, softcap: float | None = None) -> Tensor:
    """The reference's result for CPU passes with many query rows (a chunk's in-context pass): each
    segment through torch's CPU flash-attention kernel, merged by log-sum-exp. Soft-capped
    attention and float64 go to the reference."""
    if softcap is not None or query.dtype == torch.float64 or query.device.type != "cpu":
        return segment_attention_reference(query, query_index, segments, spec, scaling, window, softcap)
    check_segments(query, query_index, segments, spec, window)
    out, lse = merge_states([_flash_state(query, query_index, s, spec, scaling, window) for s in segments])
    if bool(torch.isinf(lse).any()):
        raise ValueError("a query row sees no key (every key is masked): the query rows must follow their own keys")
    return out.to(query.dtype)
