"""Segment attention on CPU for few query rows (decoding steps, short queries): a C kernel.

`segment_attention_cpu` returns what `kamera_core.segment.segment_attention_reference` returns
(same arguments, same validation by `check_segments`, the same ValueError for a query row that
sees no key), computed in one pass over the cached keys and values where they lie
(`cpu_segment.c`):

- one online softmax (running max and sum, base 2) per (query row, head) across all segments, so
  each key and value row is read from memory once, for every query head of its KV head (GQA) and
  every query row together;
- the segments' visible keys, end to end, are cut into one contiguous part per thread
  (`torch.get_num_threads()`, OpenMP), whose partial states are merged by log-sum-exp (a part
  streams one contiguous run of the cache, which splitting by head would not);
- each segment's query rows are counter-rotated by −shift inside the kernel, from cos/sin rows
  computed here exactly as `relocate.phases(spec, -shift)` computes them (float64 angles, one
  rounding to float32) and cached per (spec, shift), so a decoding step pays no torch op for the
  rotation; the kernel makes `rotate_reference`'s float32 operations in its order;
- patches (`LayerPatch`) are dequantised to float32 here (`Factors.factors`, skipped for float32
  factors) and applied in the kernel: scores gain `u_k[t]·(q_s·vt_k)`, the output gains
  `(Σ_t p_t u_v[t])·vt_v`;
- the segment table goes to C as one packed int64 array of records (pointers, strides, lengths,
  first token, phase row, patch pointers and ranks): packing is a few microseconds per segment.

Inputs: query `[Tq, Hq, D]` float32 / bfloat16 / float16 (16-bit keys and values are read as
16-bit and converted one block at a time; all arithmetic is float32); keys `[T, Hkv, D]`, values
`[T, Hkv, Dv]` with any token and head strides (a last dim of stride != 1 is copied); output
`[Tq, Hq, Dv]` in the query's dtype. The reference runs instead for float64 inputs, tensors off
the CPU, segments that differ in Hkv or Dv, and where the kernel cannot be built (no C compiler,
or `KAMERA_CPU_KERNEL=0`; a build failure warns once). Results agree with the reference to
float32 rounding (a few 1e-7 relative), not bit for bit: the kernel pre-scales the query and sums
in another order. Rows whose scores are NaN come out NaN (the reference returns zeros there).
The build is cached like `kamera_core.relocate.cpu`'s, whose machinery this module uses;
`kernel_status()` says which path is in use.
"""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path
from typing import Sequence

import torch

from kamera_core.relocate.cpu import LazyKernel, _load_library
from kamera_core.patch import Factors
from kamera_core.rope import RopeSpec
from kamera_core.segment.reference import Segment, check_segments, segment_attention_reference

Tensor = torch.Tensor

_C_SOURCE = (Path(__file__).parent / "cpu_segment.c").read_text(encoding="utf-8")
_ABI = 1
_NFIELDS = 15  # int64 fields per segment record, in the C enum's order
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_int,  # query, dtype code
    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # tq, hq, hkv, d, dv
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # query_index, segment records, nseg
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,  # cos, sin, half, interleaved
    ctypes.c_double, ctypes.c_int, ctypes.c_double, ctypes.c_int64,  # scaling, has_softcap, softcap, window
    ctypes.c_void_p, ctypes.c_int, ctypes.c_int,  # out, nthreads, simd
]
# Tests set this False to run the kernel's portable scalar path on machines with AVX2.
_USE_SIMD = True


class _SegmentKernel:
    """The built C kernel (`kamera_segment_attention`)."""

    def __init__(self, path: Path, flags: tuple[str, ...], cached: bool) -> None:
        self.path = path
        self.flags = flags
        self.cached = cached
        self.build_s = 0.0  # seconds to build (or, when cached, to load); set by _load_library
        lib = ctypes.CDLL(str(path))
        if lib.kamera_segment_abi() != _ABI or lib.kamera_segment_nfields() != _NFIELDS:
            raise OSError(f"{path} is not ABI {_ABI} with {_NFIELDS} segment fields")
        self.simd = bool(lib.kamera_segment_has_simd())
        fn = lib.kamera_segment_attention
        fn.argtypes = _ARGTYPES
        fn.restype = ctypes.c_int64
        self.fn = fn
        self._lib = lib  # keeps the library loaded


_KERNEL: LazyKernel[_SegmentKernel] = LazyKernel(
    lambda: _load_library(_C_SOURCE, "cpu_segment", _SegmentKernel), "cpu_segment",
    "segment attention on CPU uses the slower segment_attention_reference")


def _kernel() -> _SegmentKernel | None:
    """The loaded kernel, building it on first use; None (after one warning) when unavailable."""
    return _KERNEL.get()


def kernel_status() -> dict[str, object]:
    """Which CPU path segment attention uses: builds the kernel if not tried yet.

    Keys: available (bool), path (the .so or None), flags, build_s (seconds to build, or to load
    when cached), cached (the build came from an earlier process), simd ("avx2" or "scalar"),
    dtypes (query/key dtypes the kernel takes; others use the reference), reason (why not
    available, else None).
    """
    return _KERNEL.status(lambda k: {"simd": ("avx2" if k.simd else "scalar") if k else None,
                                     "dtypes": [str(d).replace("torch.", "") for d in _DTYPE_CODES] if k else []})


# spec.inv_freq -> {shift: (cos bytes, sin bytes)}: float32 rows `[rotary_dim // 2]` of −shift·f.
_PHASE_ROWS: dict[tuple[float, ...], dict[int, tuple[bytes, bytes]]] = {}
_PHASE_CACHE_MAX = 1 << 16  # rows per spec before the cache starts over


def _phase_tables(spec: RopeSpec, shifts: list[int]) -> tuple[bytes, bytes]:
    """cos, sin `[len(shifts), rotary_dim // 2]` float32 (packed bytes) of −shift·f for each
    shift: the values `relocate.phases(spec, -shift)` gives (float64 angles, one rounding to
    float32). Rows are cached per spec, so a decoding step (every layer, every token) reuses the
    rows of shifts it has seen and computes the new ones in one batch."""
    rows = _PHASE_ROWS.get(spec.inv_freq)
    if rows is None or len(rows) > _PHASE_CACHE_MAX:
        if len(_PHASE_ROWS) > 64:
            _PHASE_ROWS.clear()
        rows = _PHASE_ROWS[spec.inv_freq] = {}
    missing = [s for s in shifts if s not in rows]
    if missing:
        inv = torch.tensor(spec.inv_freq, dtype=torch.float64)
        angles = torch.tensor([-float(s) for s in missing], dtype=torch.float64)[:, None] * inv[None, :]  # (M, half)
        cos = angles.cos().to(torch.float32).numpy().tobytes()
        sin = angles.sin().to(torch.float32).numpy().tobytes()
        width = 4 * len(spec.inv_freq)
        for n, s in enumerate(missing):
            rows[s] = (cos[n * width:(n + 1) * width], sin[n * width:(n + 1) * width])
    return b"".join(rows[s][0] for s in shifts), b"".join(rows[s][1] for s in shifts)


def _factors(f: Factors | None) -> tuple[Tensor, Tensor] | None:
    """Dequantised float32 contiguous `(u [T, m], vt [m, *F])` of a patch slot (`Factors.factors`,
    skipped when already float32), or None (no patch, rank 0)."""
    if f is None:
        return None
    u, vt = f.u, f.vt
    if f.rank == 0:
        return None
    if f.u_scale is not None or u.dtype != torch.float32 or vt.dtype != torch.float32:
        u, vt = f.factors(torch.float32)
    return u.contiguous(), vt.contiguous()


def segment_attention_cpu(query: Tensor, query_index: Tensor, segments: Sequence[Segment], spec: RopeSpec,
                          scaling: float, window: int | None = None, softcap: float | None = None) -> Tensor:
    """Attention of `query` over `segments`: `segment_attention_reference`'s contract and result.

    query: `[Tq, Hq, D]` post-RoPE at its own positions (float32, bfloat16, float16; float64 and
    non-CPU tensors go to the reference); query_index: `[Tq]` integer token indices, strictly
    increasing; segments: `Segment`s with keys `[T, Hkv, D]`, values `[T, Hkv, Dv]` of the
    query's dtype; scaling: the score scale; window: sliding window or None; softcap: tanh cap or
    None. Returns `[Tq, Hq, Dv]` in the query's dtype (computed in float32). Raises what
    `check_segments` raises, and ValueError when a query row sees no key.
    """
    check_segments(query, query_index, segments, spec, window)
    code = _DTYPE_CODES.get(query.dtype)
    kernel = _kernel() if code is not None and query.is_cpu else None
    if kernel is None:
        return segment_attention_reference(query, query_index, segments, spec, scaling, window, softcap)
    num_q, num_heads, head_dim = query.shape
    num_kv, value_dim = segments[0].keys.shape[1], segments[0].values.shape[2]
    keep: list[Tensor] = []  # tensors the records point into, alive until the call returns
    records: list[int] = []
    rotations: dict[int, int] = {}  # shift -> row of the phase tables
    for seg in segments:
        k, v = seg.keys, seg.values
        shape = v.shape  # (T, Hkv, Dv); keys agree on (T, Hkv) (check_segments)
        if shape[1] != num_kv or shape[2] != value_dim or not (k.is_cpu and v.is_cpu):
            # mixed head counts or value widths across segments, or tensors off the CPU
            return segment_attention_reference(query, query_index, segments, spec, scaling, window, softcap)
        ks, vs = k.stride(), v.stride()
        if ks[2] != 1:
            k = k.contiguous()
            keep.append(k)
            ks = k.stride()
        if vs[2] != 1:
            v = v.contiguous()
            keep.append(v)
            vs = v.stride()
        shift = seg.shift
        rot = rotations.setdefault(shift, len(rotations)) if shift else -1
        patch = seg.patch
        if patch is None:
            records += (k.data_ptr(), v.data_ptr(), ks[0], ks[1], vs[0], vs[1], shape[0], seg.first, rot,
                        0, 0, 0, 0, 0, 0)
            continue
        uk, uv = _factors(patch.k), _factors(patch.v)
        for t in (uk or ()) + (uv or ()):
            if not t.is_cpu:
                return segment_attention_reference(query, query_index, segments, spec, scaling, window, softcap)
            keep.append(t)
        records += (
            k.data_ptr(), v.data_ptr(), ks[0], ks[1], vs[0], vs[1], shape[0], seg.first, rot,
            uk[0].data_ptr() if uk else 0, uk[0].shape[1] if uk else 0, uk[1].data_ptr() if uk else 0,
            uv[0].data_ptr() if uv else 0, uv[0].shape[1] if uv else 0, uv[1].data_ptr() if uv else 0,
        )
    cos, sin = _phase_tables(spec, list(rotations)) if rotations else (None, None)
    table = struct.pack(f"{len(records)}q", *records)
    q = query.contiguous()
    qidx = query_index.to(device="cpu", dtype=torch.int64).contiguous()
    out = torch.empty((num_q, num_heads, value_dim), dtype=torch.float32)
    has_cap = softcap is not None
    unseen = kernel.fn(
        q.data_ptr(), code, num_q, num_heads, num_kv, head_dim, value_dim,
        qidx.data_ptr(), table, len(segments),
        cos, sin, len(spec.inv_freq), int(spec.pairing == "interleaved"),
        float(scaling), int(has_cap), float(softcap) if has_cap else 0.0, min(int(window or 0), 1 << 62),
        out.data_ptr(), torch.get_num_threads(), int(_USE_SIMD),
    )
    del keep  # the kernel has returned: the tensors it read may go
    if unseen < 0:
        raise MemoryError("kamera_core.segment.cpu: the kernel could not allocate its work buffers")
    if unseen:
        raise ValueError("a query row sees no key (every key is masked): the query rows must follow their own keys")
    return out if query.dtype == torch.float32 else out.to(query.dtype)


__all__ = ["segment_attention_cpu", "kernel_status"]
