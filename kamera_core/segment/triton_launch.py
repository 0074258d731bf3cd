"""Launcher of the Triton segment attention (`kamera_core.segment.triton_kernel`).

`segment_attention_triton` has exactly the meaning, arguments and result of
`kamera_core.segment.segment_attention_reference`: attention of query rows over cached segments
read where they lie, each placed by a RoPE shift applied to the query.

How the work is laid out:
- The segment table. Keys are never concatenated: each segment's keys and values stay in their
  own tensors and the kernel reads them through their raw addresses (int64 in the table, cast to
  pointers in the kernel), with their own token and head strides. The keys of all segments are
  cut into pieces: a piece is a run of one segment's keys given to one split. A table row per
  piece holds the segment's first token index, the piece's key range, the key/value addresses and
  strides, the row of its phase table, and its patch factors' addresses and ranks (0: none).
- The shift is applied inside the kernel, not here: the launcher builds one float32 cos/sin row
  per distinct shift (the phases of −shift, from float64 angles as `relocate.phases` forms them)
  and each program rotates its query tile once per piece from that row. Rotating in the launcher
  with `relocate_keys` would cost several torch launches per segment per call and an
  `[S, Tq, Hq, D]` copy of the query; in the kernel it is a few multiply-adds per piece on a tile
  already in registers. The result is the reference's rotation (same products, float32).
- Split-K: programs are (row block, KV head, split); each split walks its pieces with one online
  softmax and writes its state (normalised output, log-sum-exp), and `segment_merge_kernel`
  merges the splits. With one split the kernel writes the output directly. Splits are chosen so
  that decoding (a single row block per KV head) still fills the GPU.
- Rows of a program are (query row, query head in the GQA group) pairs of one KV head, so the
  query heads sharing a KV head read each key once.
- Precision: float32 throughout. For bfloat16/float16 KV on a GPU, q·K and p·V are two
  half-precision tensor-core dots each (float32 operand split into hi + lo parts, float32
  accumulation), which is the float32 product to ~2^-16 relative; float32 KV uses IEEE float32
  dots. Patches are dequantised to float32 (`Factors.factors`) and applied in float32.

Triton is optional (`pip install triton`, or the `kernels` extra): it is imported only when a
launch is asked for. CUDA tensors run the compiled kernel. CPU tensors run only under the Triton
interpreter, which `triton.jit` picks when the kernel module is first imported, so
TRITON_INTERPRET=1 must be in the environment before that import; otherwise use backend="torch".
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kamera_core import backends
from kamera_core.patch import Factors
from kamera_core.rope import RopeSpec
from kamera_core.segment.reference import Segment, check_segments

Tensor = torch.Tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FIELDS = 16  # int64 fields per table row; order as kamera_core.segment.triton_kernel.F_*
_MAX_BLOCK_M = 64
_MIN_DOT = 16  # tl.dot needs every dim >= 16
# Split-K: aim for this many programs per streaming multiprocessor, and give every split at
# least this many keys (fewer would spend more on the merge than they save).
_PROGRAMS_PER_SM = 2
_MIN_KEYS_PER_SPLIT = 512
_MAX_SPLITS = 128
_MERGE_ROWS = 16


def _load_kernels() -> tuple[Any, Any, Any]:
    """(segment_attention_kernel, segment_merge_kernel, triton.language), or an ImportError
    telling how to get Triton."""
    try:
        import triton.language as tl

        from kamera_core.segment.triton_kernel import segment_attention_kernel, segment_merge_kernel
    except ImportError as err:
        if err.name is None or not err.name.startswith("triton"):
            raise
        raise ImportError(
            "the Triton segment attention kernel needs the `triton` package: install it "
            "(pip install triton, or the project's `kernels` extra) or use backend='torch'"
        ) from err
    return segment_attention_kernel, segment_merge_kernel, tl


def _check_mode(kernel: Any, on_cuda: bool) -> None:
    """CPU launches need the interpreted kernel, CUDA launches the compiled one (the interpreter
    would read the table's device addresses as host memory)."""
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(kernel, InterpretedFunction)
    if not on_cuda and not interpreted:
        raise ValueError(
            "the query is on the CPU and TRITON_INTERPRET=1 is set, but kamera_core.segment.triton_kernel was "
            "imported before it was set, so the kernel is compiled for a GPU; set TRITON_INTERPRET=1 "
            "before the first import (e.g. in the environment of the process), or use backend='torch'"
        )
    if on_cuda and interpreted:
        raise ValueError(
            "the query is on CUDA but the segment kernel was imported under TRITON_INTERPRET=1; the "
            "interpreter cannot follow the table's device addresses: run without TRITON_INTERPRET on CUDA"
        )


def _check_device(query: Tensor) -> None:
    """CUDA tensors, or CPU tensors when the Triton interpreter is on."""
    if query.is_cuda:
        return
    if query.device.type != "cpu":
        raise ValueError(
            f"the Triton segment attention runs on CUDA tensors (or CPU ones under the interpreter); "
            f"the query is on {query.device}"
        )
    if not backends.interpreting():
        raise ValueError(
            "the query is on the CPU: the Triton kernel runs there only under the Triton interpreter "
            "(TRITON_INTERPRET=1 in the environment before kamera_core is imported: it is read once, then); use backend='torch' or 'cpu' on CPU"
        )


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check_scalars(scaling: object, softcap: object) -> tuple[float, float | None]:
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        raise ValueError(f"scaling must be a finite real number, got {scaling!r}")
    if softcap is None:
        return float(scaling), None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    return float(scaling), float(softcap)


def _patch_factors(factors: Factors | None, device: torch.device, n: int, slot: str) -> tuple[Tensor, Tensor] | None:
    """Dequantised float32 contiguous (u [T, m], vt [m, Hkv, F]) on `device`, or None (no patch, rank 0)."""
    if factors is None or factors.rank == 0:
        return None
    if factors.u.device != device or factors.vt.device != device:
        raise ValueError(f"segment {n}: {slot} patch factors are on {factors.u.device}, the query on {device}")
    u, vt = factors.factors(torch.float32)
    return u.contiguous(), vt.contiguous()


def _check_visible(query_index: list[int], segments: Sequence[Segment], window: int | None) -> None:
    """ValueError when a query row sees no key (as the reference raises), decided from token
    indices alone: row i sees segment s iff [first_s, end_s) meets [i − window + 1, i]."""
    qi = torch.tensor(query_index, dtype=torch.int64)  # (Tq,)
    first = torch.tensor([s.first for s in segments], dtype=torch.int64)  # (S,)
    last = torch.tensor([s.end - 1 for s in segments], dtype=torch.int64)
    low = qi - window + 1 if window is not None else torch.full_like(qi, -(2**62))
    seen = ((first[None, :] <= qi[:, None]) & (last[None, :] >= low[:, None])).any(dim=1)  # (Tq,)
    if not bool(seen.all()):
        row = int((~seen).nonzero()[0, 0])
        raise ValueError(
            f"query row {row} (token index {query_index[row]}) sees no key (every key is masked): "
            "the query rows must follow their own keys"
        )


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_splits(query: Tensor, programs: int, total_keys: int) -> int:
    """Splits that give about _PROGRAMS_PER_SM programs per SM (1 in the interpreter)."""
    if not query.is_cuda:
        return 1
    want = -(-_PROGRAMS_PER_SM * _sm_count(query.device.index or 0) // programs)
    by_keys = -(-total_keys // _MIN_KEYS_PER_SPLIT)
    return max(1, min(want, by_keys, _MAX_SPLITS))


def plan_pieces(lengths: Sequence[int], num_splits: int, block_n: int) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Cut segments of `lengths` keys into pieces `(segment, begin, end)` for `num_splits` splits
    of about equal keys (whole BLOCK_N blocks, in segment order). Returns (pieces, split_ptr) with
    split s owning pieces split_ptr[s] .. split_ptr[s + 1] − 1; len(split_ptr) − 1 may be less
    than num_splits when there are fewer blocks of keys than splits (no empty split is made)."""
    total = sum(lengths)
    per_split = -(-total // num_splits)
    per = -(-per_split // block_n) * block_n  # keys per split, whole blocks
    pieces: list[tuple[int, int, int]] = []
    split_ptr = [0]
    filled = 0  # keys given to the current split
    for n, length in enumerate(lengths):
        begin = 0
        while begin < length:
            end = min(length, begin + per - filled)
            pieces.append((n, begin, end))
            filled += end - begin
            begin = end
            if filled == per:
                split_ptr.append(len(pieces))
                filled = 0
    if filled:
        split_ptr.append(len(pieces))
    return pieces, split_ptr


@dataclass(frozen=True)
class _Table:
    """Host side of one launch: int64 words (query indices, split pointers, table rows), float32
    phases, the tensors whose addresses the table holds (kept alive until the launch is queued)."""

    ints: list[int]
    cos: Tensor
    sin: Tensor
    keep: list[Tensor]
    num_splits: int
    max_rank: int
    has_patch_k: bool
    has_patch_v: bool
    aligned: bool


def _build_table(query: Tensor, query_index: list[int], segments: Sequence[Segment], spec: RopeSpec,
                 num_splits: int, block_n: int) -> _Table:
    device = query.device
    shifts = sorted({seg.shift for seg in segments})
    phase_row = {shift: i for i, shift in enumerate(shifts)}
    # Phases of −shift exactly as relocate.phases forms them: float64 angles, float32 cos/sin.
    angles = torch.tensor([float(-s) for s in shifts], dtype=torch.float64)[:, None] * torch.tensor(
        spec.inv_freq, dtype=torch.float64
    )[None, :]  # (rows, rotary_dim // 2)
    cos, sin = angles.cos().to(torch.float32), angles.sin().to(torch.float32)

    pieces, split_ptr = plan_pieces([seg.num_tokens for seg in segments], num_splits, block_n)
    keep: list[Tensor] = []
    rows: list[list[int]] = []
    aligned = True
    max_rank = 0
    has_k = has_v = False
    for n, seg in enumerate(segments):
        if seg.keys.device != device or seg.values.device != device:
            raise ValueError(f"segment {n}: keys/values are on {seg.keys.device}/{seg.values.device}, "
                             f"the query on {device}")
        # Only a segment whose feature dim is strided is copied (the kernel reads whole rows).
        k = seg.keys if seg.keys.stride(-1) == 1 else seg.keys.contiguous()
        v = seg.values if seg.values.stride(-1) == 1 else seg.values.contiguous()
        keep += [k, v]
        size = k.element_size()
        for t in (k, v):
            aligned &= t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0 and (t.stride(1) * size) % 16 == 0
        pk = _patch_factors(seg.patch.k if seg.patch is not None else None, device, n, "k")
        pv = _patch_factors(seg.patch.v if seg.patch is not None else None, device, n, "v")
        words = [seg.first, 0, 0, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                 phase_row[seg.shift]]
        for factors in (pk, pv):
            if factors is None:
                words += [0, 0, 0]
            else:
                keep += list(factors)
                words += [factors[0].data_ptr(), factors[1].data_ptr(), factors[0].shape[1]]
                max_rank = max(max_rank, factors[0].shape[1])
        has_k |= pk is not None
        has_v |= pv is not None
        rows.append(words)
    ints = list(query_index) + split_ptr
    for n, begin, end in pieces:
        words = list(rows[n])
        words[1], words[2] = begin, end
        ints += words
    return _Table(ints, cos, sin, keep, len(split_ptr) - 1, max_rank, has_k, has_v, aligned)


def _to_device(table: _Table, device: torch.device) -> tuple[Tensor, Tensor]:
    """One host-to-device copy of the whole table: (int64 words, float32 [cos; sin])."""
    ints = torch.tensor(table.ints, dtype=torch.int64)
    floats = torch.cat([table.cos.reshape(-1), table.sin.reshape(-1)])
    host = torch.cat([ints.view(torch.uint8), floats.view(torch.uint8)])
    dev = host.to(device)
    n_int = ints.numel() * 8
    return dev[:n_int].view(torch.int64), dev[n_int:].view(torch.float32)


def segment_attention_triton(
    query: Tensor,
    query_index: Tensor,
    segments: Sequence[Segment],
    spec: RopeSpec,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    _half_dot: bool | None = None,
) -> Tensor:
    """`segment_attention_reference`'s result with the Triton kernel.

    query: `[Tq, Hq, D]` float16 / bfloat16 / float32, post-RoPE, on CUDA (or CPU under
    TRITON_INTERPRET=1); query_index: `[Tq]` integer token indices, strictly increasing (any
    device; read on the host); segments: `Segment`s whose keys `[T, Hkv, D]` and values
    `[T, Hkv, Dv]` are of the query's dtype and device (every segment the same Hkv and Dv; any
    token/head strides, the last dim contiguous or that segment is copied), patches on the same
    device (any `Factors` storage, dequantised to float32 here); spec: the layer's RoPE (shifts
    rotate the query by −shift); scaling, window (keys with 0 <= i − j < window), softcap
    (softcap·tanh(s/softcap) on the scaled scores) as the reference.
    num_splits: split-K count (default: enough programs to fill the GPU; 1 in the interpreter);
    block_n: keys per inner step (power of two >= 16; default 64); num_warps: warps per program
    (default 4, 8 for 64-row blocks).
    Returns a new `[Tq, Hq, Dv]` tensor in the query's dtype. ValueError when a query row sees no
    key (as the reference), TypeError for a float64 query (use backend='torch').
    """
    check_segments(query, query_index, segments, spec, window)
    scaling, softcap = _check_scalars(scaling, softcap)
    if query.dtype not in _DTYPES:
        raise TypeError(f"the Triton segment kernel takes float16, bfloat16 or float32, got {query.dtype}; "
                        "use backend='torch' for float64")
    num_q, num_heads, head_dim = query.shape
    num_kv, v_dim = segments[0].keys.shape[1], segments[0].values.shape[2]
    for n, seg in enumerate(segments):
        if seg.keys.shape[1] != num_kv or seg.values.shape[2] != v_dim:
            raise ValueError(f"segment {n}: {seg.keys.shape[1]} KV heads / value dim {seg.values.shape[2]}, "
                             f"segment 0 has {num_kv} / {v_dim}; the kernel needs one layout for all segments")
    if any(seg.shift for seg in segments) and spec.head_dim != head_dim:
        raise ValueError(f"spec.head_dim {spec.head_dim} differs from the query's head_dim {head_dim}")
    if block_n is None:
        block_n = 64 if max(head_dim, v_dim) <= 128 else 32
    if block_n < _MIN_DOT or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= {_MIN_DOT}, got {block_n}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {num_warps!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    half_dot = query.is_cuda and query.dtype != torch.float32 if _half_dot is None else bool(_half_dot)
    if half_dot and (query.dtype == torch.float32 or (not query.is_cuda and query.dtype == torch.bfloat16)):
        raise ValueError("half-precision dots need float16/bfloat16 KV (and the interpreter has no bfloat16 dot)")

    qi_host = [int(i) for i in query_index.tolist()]
    _check_visible(qi_host, segments, window)
    _check_device(query)

    kernel, merge_kernel, tl = _load_kernels()
    _check_mode(kernel, query.is_cuda)

    groups = num_heads // num_kv
    block_m = min(_MAX_BLOCK_M, max(_MIN_DOT, _next_pow2(num_q * groups)))
    row_blocks = -(-(num_q * groups) // block_m)
    total_keys = sum(seg.num_tokens for seg in segments)
    if num_splits is None:
        num_splits = _default_splits(query, row_blocks * num_kv, total_keys)
    table = _build_table(query, qi_host, segments, spec, num_splits, block_n)
    words, phases = _to_device(table, query.device)
    n_half = table.cos.shape[1]
    qi_dev = words[:num_q]
    splits_dev = words[num_q: num_q + table.num_splits + 1]
    table_dev = words[num_q + table.num_splits + 1:]
    cos_dev, sin_dev = phases[: phases.numel() // 2], phases[phases.numel() // 2:]

    q = query.contiguous()  # (Tq, Hq, D)
    out = torch.empty(num_q, num_heads, v_dim, dtype=query.dtype, device=query.device)
    single = table.num_splits == 1
    if single:
        part_out = part_lse = out  # never written: SINGLE stores into out
    else:
        part_out = torch.empty(table.num_splits, num_q, num_heads, v_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(table.num_splits, num_q, num_heads, dtype=torch.float32, device=query.device)
    kv_dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[query.dtype]
    grid = (row_blocks, num_kv, table.num_splits)
    with torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext():
        kernel[grid](
            q, qi_dev, table_dev, splits_dev, cos_dev, sin_dev, out, part_out, part_lse,
            num_q, num_heads, num_kv, scaling, softcap if softcap is not None else 1.0,
            window if window is not None else 0,
            HEAD_DIM=head_dim,
            V_DIM=v_dim,
            GROUPS=groups,
            HALF=n_half,
            INTERLEAVED=spec.pairing == "interleaved",
            KV_DTYPE=kv_dtype,
            HALF_DOT=half_dot,
            F32_DOT="tf32x3" if query.is_cuda else "ieee",
            ALIGN=16 // query.element_size() if table.aligned else 0,
            HAS_WINDOW=window is not None,
            HAS_SOFTCAP=softcap is not None,
            HAS_PATCH_K=table.has_patch_k,
            HAS_PATCH_V=table.has_patch_v,
            SINGLE=single,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=max(_MIN_DOT, _next_pow2(head_dim)),
            BLOCK_DV=max(_MIN_DOT, _next_pow2(v_dim)),
            BLOCK_R=max(_MIN_DOT, _next_pow2(table.max_rank)),
            num_warps=num_warps if num_warps is not None else (8 if block_m >= 64 else 4),
        )
        if not single:
            rows = num_q * num_heads
            merge_kernel[(-(-rows // _MERGE_ROWS),)](
                part_out, part_lse, out, rows, table.num_splits,
                V_DIM=v_dim, BLOCK_ROWS=_MERGE_ROWS, BLOCK_DV=max(_MIN_DOT, _next_pow2(v_dim)),
            )
    del table  # the tensors the table points at may go now: the launches are queued in stream order
    return out
