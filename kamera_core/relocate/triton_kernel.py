"""Fused relocate kernel: `out = R(δ)·K + U·Vᵀ` over rows of `HEAD_DIM` values.

Only `@triton.jit` code lives here; `kamera_core.relocate.triton_launch.rotate_triton` validates, lays out
and launches. Whether the kernel is compiled or interpreted is decided by `triton.jit` when this
module is imported, so TRITON_INTERPRET=1 must be set before then to run on CPU tensors.

Memory layout the launcher guarantees (all contiguous):
- keys, out: `[rows, HEAD_DIM]`, rows = tokens · rest (rest = product of the middle dims);
- cos, sin: `[HALF]` (float32, or float64 for float64 keys);
- u: `[tokens, rank]`; vt: `[rank, rest, HEAD_DIM]`.
Row r holds token r // rest and middle index (kv head) r % rest.
"""

import triton
import triton.language as tl


@triton.jit
def _patch_tile(
    u_ptr,
    vt_ptr,
    tok,
    head,
    row_ok,
    cols,
    col_ok,
    rank,
    rest,
    HEAD_DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    """Σ_r u[tok, r] · vt[r, head, cols] in the COMPUTE dtype: `[BLOCK_ROWS, BLOCK_COLS]`.

    tok, head, row_ok: `[BLOCK_ROWS]`; cols, col_ok: `[BLOCK_COLS]`. One outer product per rank
    step, so any rank >= 1 works; tl.dot would need every dim >= 16, and the patch is a small part
    of the traffic anyway (u is read once per row and vt, `rank · rest · HEAD_DIM` values, stays
    in cache).
    """
    mask = row_ok[:, None] & col_ok[None, :]
    vt_offsets = head[:, None] * HEAD_DIM + cols[None, :]  # (BLOCK_ROWS, BLOCK_COLS) inside one rank slice
    acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=COMPUTE)
    for r in range(rank):
        u_r = tl.load(u_ptr + tok * rank + r, mask=row_ok, other=0.0).to(COMPUTE)  # (BLOCK_ROWS,)
        vt_r = tl.load(vt_ptr + r * rest * HEAD_DIM + vt_offsets, mask=mask, other=0.0).to(COMPUTE)
        acc += u_r[:, None] * vt_r
    return acc


@triton.jit
def relocate_kernel(
    keys_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    u_ptr,
    vt_ptr,
    num_rows,
    rest,
    rank,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_PATCH: tl.constexpr,
    HAS_PASS: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """One program relocates BLOCK_ROWS rows: out = R·keys (+ u·vt), stored in out's dtype.

    Pair j (0 <= j < HALF) is columns (j, j + HALF) for "half" pairing and (2j, 2j + 1) when
    INTERLEAVED; it turns by the angle whose cosine and sine are cos_ptr[j], sin_ptr[j]:
        o1 = x1·cos − x2·sin,  o2 = x2·cos + x1·sin.
    Columns 2·HALF .. HEAD_DIM − 1 (partial rotary, HAS_PASS) are copied, plus the patch.
    Keys are read in their dtype, computed in COMPUTE (float32, or float64) and cast back once.
    BLOCK_* are powers of two >= the sizes they cover; masks handle the remainder. u_ptr, vt_ptr,
    rest and rank are ignored unless HAS_PATCH.
    """
    pid = tl.program_id(0)
    # int64 rows: rows · HEAD_DIM overflows int32 past 2^31 elements (a long multi-layer cache).
    rows = pid.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # (BLOCK_ROWS,)
    row_ok = rows < num_rows
    row_base = rows[:, None] * HEAD_DIM  # (BLOCK_ROWS, 1)

    pairs = tl.arange(0, BLOCK_HALF)  # (BLOCK_HALF,) frequency index j
    pair_ok = pairs < HALF
    c = tl.load(cos_ptr + pairs, mask=pair_ok, other=1.0).to(COMPUTE)[None, :]  # (1, BLOCK_HALF)
    s = tl.load(sin_ptr + pairs, mask=pair_ok, other=0.0).to(COMPUTE)[None, :]
    # Token and middle index of each row, for the patch factors u[tok] and vt[:, head].
    tok = rows // rest
    head = rows % rest
    out_ty = out_ptr.dtype.element_ty

    if INTERLEAVED:
        # Load the rotary dims as one contiguous tile and split even/odd columns in registers:
        # two stride-2 loads would not vectorize.
        rcols = tl.arange(0, 2 * BLOCK_HALF)  # (2 * BLOCK_HALF,)
        rcol_ok = rcols < 2 * HALF
        rmask = row_ok[:, None] & rcol_ok[None, :]  # (BLOCK_ROWS, 2 * BLOCK_HALF)
        x = tl.load(keys_ptr + row_base + rcols[None, :], mask=rmask, other=0.0).to(COMPUTE)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_ROWS, BLOCK_HALF, 2)))  # each (BLOCK_ROWS, BLOCK_HALF)
        o = tl.join(x1 * c - x2 * s, x2 * c + x1 * s)  # (BLOCK_ROWS, BLOCK_HALF, 2)
        o = tl.reshape(o, (BLOCK_ROWS, 2 * BLOCK_HALF))  # back to column order 2j, 2j + 1
        if HAS_PATCH:
            # The patch is already in the target frame: added after the rotation.
            o += _patch_tile(
                u_ptr, vt_ptr, tok, head, row_ok, rcols, rcol_ok, rank, rest,
                HEAD_DIM, BLOCK_ROWS, 2 * BLOCK_HALF, COMPUTE,
            )
        tl.store(out_ptr + row_base + rcols[None, :], o.to(out_ty), mask=rmask)
    else:
        col1 = pairs  # (BLOCK_HALF,) columns j and j + HALF
        col2 = pairs + HALF
        mask = row_ok[:, None] & pair_ok[None, :]  # (BLOCK_ROWS, BLOCK_HALF)
        x1 = tl.load(keys_ptr + row_base + col1[None, :], mask=mask, other=0.0).to(COMPUTE)
        x2 = tl.load(keys_ptr + row_base + col2[None, :], mask=mask, other=0.0).to(COMPUTE)
        o1 = x1 * c - x2 * s  # (BLOCK_ROWS, BLOCK_HALF)
        o2 = x2 * c + x1 * s
        if HAS_PATCH:
            o1 += _patch_tile(
                u_ptr, vt_ptr, tok, head, row_ok, col1, pair_ok, rank, rest,
                HEAD_DIM, BLOCK_ROWS, BLOCK_HALF, COMPUTE,
            )
            o2 += _patch_tile(
                u_ptr, vt_ptr, tok, head, row_ok, col2, pair_ok, rank, rest,
                HEAD_DIM, BLOCK_ROWS, BLOCK_HALF, COMPUTE,
            )
        tl.store(out_ptr + row_base + col1[None, :], o1.to(out_ty), mask=mask)
        tl.store(out_ptr + row_base + col2[None, :], o2.to(out_ty), mask=mask)

    if HAS_PASS:
        # Dims past rotary_dim carry no position: copied through, plus the patch (it spans all dims).
        pcols = 2 * HALF + tl.arange(0, BLOCK_PASS)  # (BLOCK_PASS,)
        pcol_ok = pcols < HEAD_DIM
        pmask = row_ok[:, None] & pcol_ok[None, :]  # (BLOCK_ROWS, BLOCK_PASS)
        xp = tl.load(keys_ptr + row_base + pcols[None, :], mask=pmask, other=0.0)
        if HAS_PATCH:
            xp = xp.to(COMPUTE) + _patch_tile(
                u_ptr, vt_ptr, tok, head, row_ok, pcols, pcol_ok, rank, rest,
                HEAD_DIM, BLOCK_ROWS, BLOCK_PASS, COMPUTE,
            )
        tl.store(out_ptr + row_base + pcols[None, :], xp.to(out_ty), mask=pmask)
