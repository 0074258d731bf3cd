"""Segment attention kernels: one online softmax over keys that stay where they lie.

Only `@triton.jit` code lives here; `kamera_core.segment.triton_launch.segment_attention_triton`
validates, builds the segment table and launches. Whether the kernels are compiled or interpreted
is decided by `triton.jit` when this module is imported, so TRITON_INTERPRET=1 must be set before
then to run on CPU tensors.

Memory layout the launcher guarantees:
- q: `[Tq, Hq, HEAD_DIM]` contiguous, the query's dtype, post-RoPE;
- qi: int64 `[Tq]` token index of each query row;
- table: int64 `[pieces, FIELDS]`, one row per piece (a run of keys of one segment given to one
  split), fields as the F_* constants below. Keys and values are read through the raw addresses
  in the table (int64 cast to pointers of KV_DTYPE), so each segment stays in its own tensor;
  the last dim of keys and values is contiguous, token and head strides come from the table;
- splits: int64 `[num_splits + 1]`: split s owns pieces splits[s] .. splits[s + 1] - 1;
- cos, sin: float32 `[phase_rows, HALF]`, one row per distinct segment shift: the phases of the
  rotation by −shift that carries the query into the segment keys' frame (row of a zero shift:
  cos 1, sin 0, exactly the identity);
- patch factors (float32, contiguous, addresses in the table, 0 when absent): key patch
  u `[T, rank_k]`, vt `[rank_k, Hkv, HEAD_DIM]`; value patch u `[T, rank_v]`, vt `[rank_v, Hkv, V_DIM]`;
- out: `[Tq, Hq, V_DIM]` in the query dtype (written when SINGLE); otherwise part_out float32
  `[num_splits, Tq, Hq, V_DIM]` (each split's softmax-normalised output, 0 where it sees no key)
  and part_lse float32 `[num_splits, Tq, Hq]` (−inf where it sees no key), merged by
  `segment_merge_kernel`.

Rows of a program: BLOCK_M (query row, head-in-group) pairs of one KV head, row r = tq·GROUPS + g
reading query head kvh·GROUPS + g, so the GROUPS query heads that share a KV head read each key
once (decode has Tq = 1 and still fills the rows of the dot with GQA).
"""

import triton
import triton.language as tl

# Fields of one table row (int64).
F_FIRST = tl.constexpr(0)  # token index of the segment's key 0
F_BEGIN = tl.constexpr(1)  # first key (segment-local) of the piece
F_END = tl.constexpr(2)  # one past its last key
F_K = tl.constexpr(3)  # address of keys[0, 0, 0]
F_V = tl.constexpr(4)  # address of values[0, 0, 0]
F_K_ST = tl.constexpr(5)  # keys token stride (elements)
F_K_SH = tl.constexpr(6)  # keys head stride
F_V_ST = tl.constexpr(7)  # values token stride
F_V_SH = tl.constexpr(8)  # values head stride
F_PHASE = tl.constexpr(9)  # row of cos / sin
F_UK = tl.constexpr(10)  # key patch u address (0: none)
F_VTK = tl.constexpr(11)  # key patch vt address
F_RK = tl.constexpr(12)  # key patch rank (0: none)
F_UV = tl.constexpr(13)  # value patch u address
F_VTV = tl.constexpr(14)  # value patch vt address
F_RV = tl.constexpr(15)  # value patch rank
FIELDS = tl.constexpr(16)


@triton.jit
def _split_operand(a, HALF_DOT: tl.constexpr, KV_DTYPE: tl.constexpr):
    """float32 `a` as (hi, lo) for `_dot_kv`: hi + lo = a to ~2^-16 relative (two half-precision
    parts) when HALF_DOT, else (a, a) with only the first used."""
    if HALF_DOT:
        hi = a.to(KV_DTYPE)
        lo = (a - hi.to(tl.float32)).to(KV_DTYPE)
    else:
        hi = a
        lo = a
    return hi, lo


@triton.jit
def _dot_kv(a_hi, a_lo, b, HALF_DOT: tl.constexpr, F32_DOT: tl.constexpr):
    """float32 `a @ b` for `b` in the KV dtype: `[M, K] @ [K, N]` -> float32 `[M, N]`.

    HALF_DOT (bfloat16 / float16 KV on a GPU): two tensor-core dots, hi·b + lo·b, with float32
    accumulation; b is exact in its dtype, so this is the float32 product to ~2^-16 relative
    (flash attention rounds the query and the probabilities to half precision instead, ~2^-8).
    Otherwise one float32 dot of precision F32_DOT ("ieee", or "tf32x3": three TF32 tensor-core
    products, float32 accuracy to ~2^-21 relative; never plain TF32)."""
    if HALF_DOT:
        acc = tl.dot(a_hi, b, out_dtype=tl.float32)
        acc = tl.dot(a_lo, b, acc, out_dtype=tl.float32)
    else:
        acc = tl.dot(a_hi, b.to(tl.float32), input_precision=F32_DOT, out_dtype=tl.float32)
    return acc


@triton.jit
def _tanh(x):
    """tanh in float32 without overflow: sign(x)·(1 − e)/(1 + e), e = exp(−2|x|)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def segment_attention_kernel(
    q_ptr,
    qi_ptr,
    table_ptr,
    splits_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    num_q,
    num_heads,
    num_kv,
    scaling,
    softcap,
    window,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    GROUPS: tl.constexpr,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    KV_DTYPE: tl.constexpr,
    HALF_DOT: tl.constexpr,
    F32_DOT: tl.constexpr,
    ALIGN: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_PATCH_K: tl.constexpr,
    HAS_PATCH_V: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Program (row block, KV head, split): online softmax over the keys of the split's pieces.

    Per piece: the query rows are rotated by −shift into the segment's frame (per column j:
    q[j]·cos + q[partner(j)]·(∓sin), the reference's o1 = x1·cos − x2·sin, o2 = x2·cos + x1·sin;
    dims past 2·HALF pass through), then for each BLOCK_N keys:
        s = (q_s·K[t] + (q_s·vt_k)·u_k[t]) · scaling, softcap·tanh(s/softcap) if HAS_SOFTCAP,
        visible iff 0 <= qi − (first + t) (< window if HAS_WINDOW),
    and acc += p·V, pu += p·u_v (rescaled with acc), folded in as acc += pu·vt_v at the piece's
    end (vt_v belongs to the segment). The key range of a piece is first clamped to what the
    block's rows can see (causal and window), so fully masked keys are never read.
    ALIGN: elements per 16 bytes when the launcher checked 16-byte aligned key/value bases and
    strides (the loads are then vectorised), 0 otherwise.
    F32_DOT: input precision of the float32 dots (patches; float32 KV), "ieee" or "tf32x3".
    BLOCK_*: powers of two >= 16 (dot operands) covering rows, keys, HEAD_DIM, V_DIM, patch rank.
    """
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_ok = rows < num_q * GROUPS
    tq = (rows // GROUPS).to(tl.int64)
    head = kvh * GROUPS + rows % GROUPS
    qi = tl.load(qi_ptr + tq, mask=row_ok, other=0)  # (BLOCK_M,) int64
    qmax = tl.max(tl.where(row_ok, qi, -1), axis=0)
    qmin = tl.min(tl.where(row_ok, qi, qmax), axis=0)

    # Column j of the rotated query is q[j]·cos[f(j)] + q[partner(j)]·sign(j)·sin[f(j)].
    cols = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    col_ok = cols < HEAD_DIM
    rot = cols < 2 * HALF
    if INTERLEAVED:
        partner = tl.where(rot, cols ^ 1, cols)
        freq = cols // 2
        sign = tl.where(rot, tl.where(cols % 2 == 0, -1.0, 1.0), 0.0)
    else:
        first_half = cols < HALF
        partner = tl.where(first_half, cols + HALF, tl.where(rot, cols - HALF, cols))
        freq = tl.where(first_half, cols, cols - HALF)
        sign = tl.where(first_half, -1.0, tl.where(rot, 1.0, 0.0))
    q_rows = (tq * num_heads + head) * HEAD_DIM  # (BLOCK_M,)
    q_mask = row_ok[:, None] & col_ok[None, :]

    vcols = tl.arange(0, BLOCK_DV)  # (BLOCK_DV,)
    vcol_ok = vcols < V_DIM
    ranks = tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)

    piece_begin = tl.load(splits_ptr + split)
    piece_end = tl.load(splits_ptr + split + 1)
    for piece in range(piece_begin, piece_end):
        row = table_ptr + piece * FIELDS
        first = tl.load(row + F_FIRST)
        lo = tl.load(row + F_BEGIN)
        hi = tl.minimum(tl.load(row + F_END), qmax - first + 1)  # keys after the last row: unseen
        if HAS_WINDOW:
            lo = tl.maximum(lo, qmin - window + 1 - first)  # keys before every row's window
        k_addr = tl.load(row + F_K)
        v_addr = tl.load(row + F_V)
        k_st = tl.load(row + F_K_ST)
        k_sh = tl.load(row + F_K_SH)
        v_st = tl.load(row + F_V_ST)
        v_sh = tl.load(row + F_V_SH)
        k_ptr = k_addr.to(tl.pointer_type(KV_DTYPE))
        v_ptr = v_addr.to(tl.pointer_type(KV_DTYPE))
        if ALIGN > 0:
            # 16-byte bases and strides: rows load as 16-byte vectors. The hint must sit on the
            # pointer (divisibility in bytes); one on the integer does not survive the cast.
            k_ptr = tl.multiple_of(k_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
            k_st = tl.multiple_of(k_st, ALIGN)
            k_sh = tl.multiple_of(k_sh, ALIGN)
            v_st = tl.multiple_of(v_st, ALIGN)
            v_sh = tl.multiple_of(v_sh, ALIGN)
        k_base = k_ptr + kvh * k_sh
        v_base = v_ptr + kvh * v_sh

        # The query tile is re-read per piece (from cache) rather than held in registers across
        # the loop: qa and qb would double the live registers of a 64-row block.
        qa = tl.load(q_ptr + q_rows[:, None] + cols[None, :], mask=q_mask, other=0.0).to(tl.float32)
        qb = tl.load(q_ptr + q_rows[:, None] + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
        phase = tl.load(row + F_PHASE)
        c = tl.load(cos_ptr + phase * HALF + freq, mask=rot, other=1.0)  # (BLOCK_D,)
        s_ = tl.load(sin_ptr + phase * HALF + freq, mask=rot, other=0.0)
        q_s = qa * c[None, :] + qb * (sign * s_)[None, :]  # (BLOCK_M, BLOCK_D) in the segment's frame
        q_hi, q_lo = _split_operand(q_s, HALF_DOT, KV_DTYPE)

        # Patch addresses are 0 where the piece's segment has none (rank 0): never dereferenced.
        qv = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
        if HAS_PATCH_K:
            rank_k = tl.load(row + F_RK)
            uk_ptr = tl.load(row + F_UK).to(tl.pointer_type(tl.float32))
            if rank_k > 0:
                vtk_ptr = tl.load(row + F_VTK).to(tl.pointer_type(tl.float32))
                r_ok = ranks < rank_k
                vtk = tl.load(
                    vtk_ptr + (ranks[:, None] * num_kv + kvh) * HEAD_DIM + cols[None, :],
                    mask=r_ok[:, None] & col_ok[None, :],
                    other=0.0,
                )  # (BLOCK_R, BLOCK_D)
                qv = tl.dot(q_s, tl.trans(vtk), input_precision=F32_DOT)  # (BLOCK_M, BLOCK_R)
        pu = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)  # Σ p·u_v of this piece, scaled as acc
        if HAS_PATCH_V:
            rank_v = tl.load(row + F_RV)
            uv_ptr = tl.load(row + F_UV).to(tl.pointer_type(tl.float32))

        for t0 in range(lo, hi, BLOCK_N):
            t = t0 + offs_n  # (BLOCK_N,) segment-local key index
            t_ok = t < hi
            k = tl.load(
                k_base + t[:, None] * k_st + cols[None, :], mask=t_ok[:, None] & col_ok[None, :], other=0.0
            )  # (BLOCK_N, BLOCK_D)
            s = _dot_kv(q_hi, q_lo, tl.trans(k), HALF_DOT, F32_DOT)  # (BLOCK_M, BLOCK_N)
            if HAS_PATCH_K:
                if rank_k > 0:
                    uk = tl.load(
                        uk_ptr + t[:, None] * rank_k + ranks[None, :],
                        mask=t_ok[:, None] & (ranks < rank_k)[None, :],
                        other=0.0,
                    )  # (BLOCK_N, BLOCK_R)
                    s += tl.dot(qv, tl.trans(uk), input_precision=F32_DOT)
            s = s * scaling
            if HAS_SOFTCAP:
                s = softcap * _tanh(s / softcap)
            diff = qi[:, None] - (first + t)[None, :]  # (BLOCK_M, BLOCK_N) query index − key index
            ok = row_ok[:, None] & t_ok[None, :] & (diff >= 0)
            if HAS_WINDOW:
                ok = ok & (diff < window)
            s = tl.where(ok, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])  # (BLOCK_M, BLOCK_N), 0 where masked
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_base + t[:, None] * v_st + vcols[None, :], mask=t_ok[:, None] & vcol_ok[None, :], other=0.0
            )  # (BLOCK_N, BLOCK_DV)
            p_hi, p_lo = _split_operand(p, HALF_DOT, KV_DTYPE)
            acc = acc * alpha[:, None] + _dot_kv(p_hi, p_lo, v, HALF_DOT, F32_DOT)
            if HAS_PATCH_V:
                pu = pu * alpha[:, None]
                if rank_v > 0:
                    uv = tl.load(
                        uv_ptr + t[:, None] * rank_v + ranks[None, :],
                        mask=t_ok[:, None] & (ranks < rank_v)[None, :],
                        other=0.0,
                    )  # (BLOCK_N, BLOCK_R)
                    pu += tl.dot(p, uv, input_precision=F32_DOT)
            m_i = m_new

        if HAS_PATCH_V:
            if rank_v > 0:
                vtv_ptr = tl.load(row + F_VTV).to(tl.pointer_type(tl.float32))
                vtv = tl.load(
                    vtv_ptr + (ranks[:, None] * num_kv + kvh) * V_DIM + vcols[None, :],
                    mask=(ranks < rank_v)[:, None] & vcol_ok[None, :],
                    other=0.0,
                )  # (BLOCK_R, BLOCK_DV)
                acc += tl.dot(pu, vtv, input_precision=F32_DOT)

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]  # (BLOCK_M, BLOCK_DV)
    out_rows = tq * num_heads + head  # (BLOCK_M,) row of [Tq · Hq]
    o_mask = row_ok[:, None] & vcol_ok[None, :]
    if SINGLE:
        tl.store(out_ptr + out_rows[:, None] * V_DIM + vcols[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        part_rows = split.to(tl.int64) * num_q * num_heads + out_rows
        tl.store(part_out_ptr + part_rows[:, None] * V_DIM + vcols[None, :], o, mask=o_mask)
        tl.store(part_lse_ptr + part_rows, lse, mask=row_ok)


@triton.jit
def segment_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_rows,
    num_splits,
    V_DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Merge split states: out[r] = Σ_s w_s·part_out[s, r], w_s = exp(lse_s − logsumexp_s lse).

    part_out: float32 `[num_splits, num_rows, V_DIM]`; part_lse: float32 `[num_splits, num_rows]`
    (−inf: the split saw no key of that row); out: `[num_rows, V_DIM]` in the output dtype.
    One program merges BLOCK_ROWS rows (num_rows = Tq · Hq)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # (BLOCK_ROWS,)
    row_ok = rows < num_rows
    vcols = tl.arange(0, BLOCK_DV)
    mask = row_ok[:, None] & (vcols < V_DIM)[None, :]
    m = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(part_lse_ptr + s * num_rows + rows, mask=row_ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros((BLOCK_ROWS,), tl.float32)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_DV), tl.float32)
    for s in range(num_splits):
        w = tl.exp(tl.load(part_lse_ptr + s * num_rows + rows, mask=row_ok, other=float("-inf")) - m_safe)
        o = tl.load(part_out_ptr + (s * num_rows + rows)[:, None] * V_DIM + vcols[None, :], mask=mask, other=0.0)
        den += w
        acc += w[:, None] * o
    o = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * V_DIM + vcols[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)
