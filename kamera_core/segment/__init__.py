"""Segment attention: attention over cached KV read where it lies, each run of keys ("segment")
placed by a RoPE shift that is applied to the query instead of the keys.

R is orthogonal, so for keys K stored in their own frame and placed `shift` positions later,
q·(R(shift)(K + U_k V_kᵀ))ᵀ = (R(−shift) q)·Kᵀ + ((R(−shift) q)·V_kᵀ)·U_kᵀ, and the value side is
P·V + (P·U_v)·V_v. Each segment is attended on its own (its partial softmax state: output and
log-sum-exp), and the states are merged by log-sum-exp (as cascade attention does). Moving or
reordering segments therefore writes no KV bytes: only the small query rows are rotated.

Masks are by token index (the index each key and query row has in the sequence a plain prefill
of the window would read): key j is visible to query row i iff j <= i and, for a sliding-window
layer, i − j < window. Segments never overlap in token index.

Layouts (token-major, as everywhere in kamera_core):
- query `[Tq, Hq, D]`, post-RoPE at the query rows' own positions;
- segment keys `[T, Hkv, D]`, values `[T, Hkv, Dv]`, Hq a multiple of Hkv (query head h reads KV
  head h // (Hq / Hkv), as transformers' `repeat_kv`);
- patch factors (`kamera_core.patch.Factors`): keys `u [T, m]`, `vt [m, Hkv, D]`; values
  `u [T, m]`, `vt [m, Hkv, Dv]`, in the keys' own frame.

Implementations, one contract (`reference`: the checks and `segment_attention_reference`, plain
torch written for clarity; every other path is tested against it): the C kernel (`cpu`, for the
few query rows of a query or a decoding step), torch's flash-attention kernel per segment
(`flash`, for long CPU passes) and the Triton kernel (`triton_launch` / `triton_kernel`);
`kamera_core.backends` picks one per call.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kamera_core import backends
from kamera_core.backends import CPU_KERNEL_MAX_ROWS, Backend
from kamera_core.rope import RopeSpec
from kamera_core.segment.flash import segment_attention_flash
from kamera_core.segment.reference import (Segment, check_segments, merge_states, patch_option_states,
                                           segment_attention_reference, segment_state, visible)

Tensor = torch.Tensor
__all__ = ["Backend", "CPU_KERNEL_MAX_ROWS", "Segment", "check_segments", "merge_states", "patch_option_states",
           "segment_attention", "segment_attention_flash", "segment_attention_reference", "segment_state", "visible"]


def segment_attention(query: Tensor, query_index: Tensor, segments: Sequence[Segment], spec: RopeSpec,
                      scaling: float, window: int | None = None, softcap: float | None = None,
                      backend: Backend = "auto") -> Tensor:
    """`segment_attention_reference`'s result by the chosen implementation.

    backend: "torch" (reference), "cpu" (the C kernel; falls back to torch where it cannot be
    built), "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "auto": Triton for CUDA tensors; on
    CPU the C kernel for few query rows (decoding and short queries, where per-segment work is
    small and the kernel reads each key once) and torch's flash-attention kernel per segment for
    long passes (`segment_attention_flash`); the reference elsewhere."""
    chosen = backends.for_segment(query, backend)
    if chosen == "flash":
        return segment_attention_flash(query, query_index, segments, spec, scaling, window, softcap)
    if chosen == "cpu":
        from kamera_core.segment.cpu import segment_attention_cpu

        return segment_attention_cpu(query, query_index, segments, spec, scaling, window, softcap)
    if chosen == "triton":
        from kamera_core.segment.triton_launch import segment_attention_triton

        return segment_attention_triton(query, query_index, segments, spec, scaling, window, softcap)
    return segment_attention_reference(query, query_index, segments, spec, scaling, window, softcap)
