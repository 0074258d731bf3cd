/* Segment attention for few query rows on CPU, loaded by kamera_core/segment/cpu.py via ctypes.

   out[i, h] = softmax over every visible key of every segment, read where the keys lie. One
   online softmax (running max m, running sum l, running output acc, in base 2) per (head, query
   row) walks the keys in blocks of BLOCK, so each key and value row is read from memory once:
   for each block and KV head, the rows that read that head (its GQA query heads, for every query
   row that sees the same keys of the block) are served together while the block is in L1, three
   rows at a time (each key or value vector loaded once feeds three rows). The visible keys of
   all segments, laid end to end, are cut into one contiguous part per thread (OpenMP); each part
   keeps its own states, merged by log-sum-exp at the end.

   Per segment the query rows are counter-rotated into the keys' frame here, from cos/sin rows of
   the segment's shift computed in Python (one row per distinct shift), with the reference's
   float32 operations (x1·cos − x2·sin, x2·cos + x1·sin; built with -ffp-contract=off), then
   pre-scaled by scaling·log2(e) (by scaling alone with a softcap, which is applied first).
   Patches arrive dequantised as float32: key patch u_k [T, mk] and vt_k [mk, Hkv, D], contiguous
   (the scores gain u_k[t]·(q_s·vt_k)); value patch u_v [T, mv], vt_v [mv, Hkv, Dv] (the output
   gains (Σ_t p_t u_v[t])·vt_v, accumulated at the running scale and folded in at the end of each
   segment's range).

   Layouts: query [Tq, Hq, D] contiguous in its dtype; keys [T, Hkv, D] and values [T, Hkv, Dv]
   with any token / head strides (in elements) and a contiguous last dim; out [Tq, Hq, Dv]
   float32 contiguous. Key dtypes: float32 (read in place), bfloat16, float16 (converted to
   float32 one block at a time); all arithmetic is float32. AVX2+FMA code where the compiler
   targets it, portable scalar code otherwise (and when the caller asks: simd = 0). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h> /* INFINITY, NAN only: no libm calls */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

#define BLOCK 32 /* keys per block (a multiple of 8): 32 measured best for float32 and bfloat16 */
#define LOG2E 1.44269504088896340736f

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
/* Fields of one segment record (int64 each), in this order. */
enum { S_K, S_V, S_KST, S_KSH, S_VST, S_VSH, S_LEN, S_FIRST, S_ROT, S_UK, S_MK, S_VTK, S_UV, S_MV, S_VTV, S_NF };

int kamera_segment_abi(void) { return 1; }
int kamera_segment_nfields(void) { return S_NF; }
int kamera_segment_has_simd(void) { return HAVE_AVX2; }

/* ---------------------------------------------------------------- conversions */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}

/* IEEE binary16 -> binary32, exact for every input (normals, subnormals, zeros, inf, NaN). */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, mant = h & 0x3ffu, u;
    if (e == 0x1f) {
        u = sign | 0x7f800000u | (mant << 13);
    } else if (e != 0) {
        u = sign | ((e + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        u = sign;
    } else { /* subnormal: mant · 2^-24, exact in float32 */
        float f = (float)mant * 5.9604644775390625e-08f; uint32_t m; memcpy(&m, &f, 4); u = sign | m;
    }
    float f; memcpy(&f, &u, 4); return f;
}

/* n values of `dtype` at src -> float32 dst[0, n), zeros in dst[n, np). */
static void load_row(const void *src, int dtype, int64_t n, int64_t np, float *dst, int simd) {
    int64_t j = 0;
    (void)simd;
    if (dtype == DT_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        j = n;
    } else if (dtype == DT_BF16) {
        const uint16_t *s = (const uint16_t *)src;
#if HAVE_AVX2
        if (simd)
            for (; j + 8 <= n; j += 8) {
                __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + j)));
                _mm256_storeu_ps(dst + j, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
            }
#endif
        for (; j < n; ++j) dst[j] = bf16_to_f32(s[j]);
    } else {
        const uint16_t *s = (const uint16_t *)src;
#if HAVE_AVX2 && defined(__F16C__)
        if (simd)
            for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + j))));
#endif
        for (; j < n; ++j) dst[j] = f16_to_f32(s[j]);
    }
    for (; j < np; ++j) dst[j] = 0.0f;
}

/* ---------------------------------------------------------------- exp2, tanh (no libm) */

/* 2^f on [-0.5, 0.5]: Taylor coefficients ln2^k / k!, k <= 7 (truncation < 2e-9 relative). */
#define EXP2_C1 0.693147180559945309f
#define EXP2_C2 0.240226506959100712f
#define EXP2_C3 0.0555041086648215800f
#define EXP2_C4 0.00961812910762847717f
#define EXP2_C5 0.00133335581464284434f
#define EXP2_C6 0.000154035303933816099f
#define EXP2_C7 1.52527338040598403e-05f

/* 2^x for x <= 0 (x > 0 is read as 0); exactly 0 below -127, NaN stays NaN. */
static inline float exp2_s(float x) {
    if (x != x) return x;
    if (x < -127.0f) return 0.0f;
    if (x > 0.0f) x = 0.0f;
    int n = (int)(x - 0.5f); /* truncation toward zero: x - n in (-0.5, 0.5] */
    float f = x - (float)n;
    float p = EXP2_C7;
    p = p * f + EXP2_C6; p = p * f + EXP2_C5; p = p * f + EXP2_C4;
    p = p * f + EXP2_C3; p = p * f + EXP2_C2; p = p * f + EXP2_C1; p = p * f + 1.0f;
    uint32_t bits = (uint32_t)(n + 127) << 23; /* n = -127: 0, so the result is 0 */
    float scale; memcpy(&scale, &bits, 4);
    return p * scale;
}

/* tanh(y): odd Taylor series below 0.3 (error < 1e-9), (1 - e)/(1 + e) with e = exp(-2|y|) above. */
static inline float tanh_s(float y) {
    float a = y < 0 ? -y : y;
    if (a < 0.3f) {
        float y2 = y * y;
        float p = -1382.0f / 155925.0f;
        p = p * y2 + 62.0f / 2835.0f; p = p * y2 - 17.0f / 315.0f; p = p * y2 + 2.0f / 15.0f;
        p = p * y2 - 1.0f / 3.0f;
        return y + y * y2 * p;
    }
    if (y != y) return y;
    if (a > 9.0f) return y > 0 ? 1.0f : -1.0f; /* tanh(9) rounds to 1 in float32 */
    float e = exp2_s(-2.0f * LOG2E * a);
    float r = (1.0f - e) / (1.0f + e);
    return y < 0 ? -r : r;
}

#if HAVE_AVX2
static inline __m256 exp2_v(__m256 x) { /* 2^x, x <= 0; -inf -> 0; NaN -> NaN */
    x = _mm256_min_ps(_mm256_setzero_ps(), _mm256_max_ps(_mm256_set1_ps(-127.0f), x)); /* NaN kept: 2nd operand */
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(EXP2_C7);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hsum_v(__m256 x) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

static inline float hmax_v(__m256 x) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* [sum(a0), ..., sum(a7)] */
static inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
    __m256 h45 = _mm256_hadd_ps(a4, a5), h67 = _mm256_hadd_ps(a6, a7);
    __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* [sum(a0), sum(a1), sum(a2), sum(a3)] */
static inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* s[t] = q · k[t*ks .. +dp) (add: s[t] +=), t < n; dp % 8 == 0. */
static void scores1_v(const float *q, const float *k, int64_t ks, int64_t dp, int64_t n, float *s, int add) {
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const float *k0 = k + t * ks;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t d = 0; d < dp; d += 8) {
            __m256 x = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + d), a0);
            a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + ks + d), a1);
            a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + 2 * ks + d), a2);
            a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + 3 * ks + d), a3);
            a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + 4 * ks + d), a4);
            a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + 5 * ks + d), a5);
            a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + 6 * ks + d), a6);
            a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + 7 * ks + d), a7);
        }
        __m256 r = hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7);
        _mm256_storeu_ps(s + t, add ? _mm256_add_ps(_mm256_loadu_ps(s + t), r) : r);
    }
    for (; t < n; ++t) {
        const float *kt = k + t * ks;
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < dp; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kt + d), a);
        s[t] = add ? s[t] + hsum_v(a) : hsum_v(a);
    }
}

/* Three query rows (q, q + qst, q + 2*qst) against the same keys: s[j*ss + t] (add: +=), j < 3.
   Each key vector loaded serves three rows (12 accumulators: 4 keys x 3 rows). */
static void scores3_v(const float *q, int64_t qst, const float *k, int64_t ks, int64_t dp, int64_t n, float *s,
                      int64_t ss, int add) {
    const float *q0 = q, *q1 = q + qst, *q2 = q + 2 * qst;
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        const float *k0 = k + t * ks, *k1 = k0 + ks, *k2 = k1 + ks, *k3 = k2 + ks;
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
               a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
        for (int64_t d = 0; d < dp; d += 8) {
            const __m256 x0 = _mm256_loadu_ps(q0 + d), x1 = _mm256_loadu_ps(q1 + d), x2 = _mm256_loadu_ps(q2 + d);
            __m256 kk = _mm256_loadu_ps(k0 + d);
            a00 = _mm256_fmadd_ps(x0, kk, a00); a10 = _mm256_fmadd_ps(x1, kk, a10); a20 = _mm256_fmadd_ps(x2, kk, a20);
            kk = _mm256_loadu_ps(k1 + d);
            a01 = _mm256_fmadd_ps(x0, kk, a01); a11 = _mm256_fmadd_ps(x1, kk, a11); a21 = _mm256_fmadd_ps(x2, kk, a21);
            kk = _mm256_loadu_ps(k2 + d);
            a02 = _mm256_fmadd_ps(x0, kk, a02); a12 = _mm256_fmadd_ps(x1, kk, a12); a22 = _mm256_fmadd_ps(x2, kk, a22);
            kk = _mm256_loadu_ps(k3 + d);
            a03 = _mm256_fmadd_ps(x0, kk, a03); a13 = _mm256_fmadd_ps(x1, kk, a13); a23 = _mm256_fmadd_ps(x2, kk, a23);
        }
        __m128 r0 = hsum4x8(a00, a01, a02, a03), r1 = hsum4x8(a10, a11, a12, a13), r2 = hsum4x8(a20, a21, a22, a23);
        if (add) {
            r0 = _mm_add_ps(_mm_loadu_ps(s + t), r0);
            r1 = _mm_add_ps(_mm_loadu_ps(s + ss + t), r1);
            r2 = _mm_add_ps(_mm_loadu_ps(s + 2 * ss + t), r2);
        }
        _mm_storeu_ps(s + t, r0);
        _mm_storeu_ps(s + ss + t, r1);
        _mm_storeu_ps(s + 2 * ss + t, r2);
    }
    for (; t < n; ++t) {
        const float *kt = k + t * ks;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0;
        for (int64_t d = 0; d < dp; d += 8) {
            const __m256 kk = _mm256_loadu_ps(kt + d);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), kk, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + d), kk, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + d), kk, a2);
        }
        if (add) { s[t] += hsum_v(a0); s[ss + t] += hsum_v(a1); s[2 * ss + t] += hsum_v(a2); }
        else { s[t] = hsum_v(a0); s[ss + t] = hsum_v(a1); s[2 * ss + t] = hsum_v(a2); }
    }
}

/* acc[0, 8*NV) = acc·alpha + Σ_t p[t]·v[t*vs ..]: NV vectors held in registers across the block. */
#define DEFINE_ACC(NV)                                                                          \
static inline void acc1_v##NV(float *acc, float alpha, const float *p, int64_t n, const float *v, \
                              int64_t vs) {                                                     \
    __m256 a[NV];                                                                               \
    const __m256 al = _mm256_set1_ps(alpha);                                                    \
    _Pragma("GCC unroll 8") for (int j = 0; j < NV; ++j) a[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * j), al); \
    for (int64_t t = 0; t < n; ++t) {                                                           \
        const __m256 pt = _mm256_set1_ps(p[t]);                                                 \
        const float *vr = v + t * vs;                                                           \
        _Pragma("GCC unroll 8") for (int j = 0; j < NV; ++j)                                    \
            a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr + 8 * j), a[j]);                      \
    }                                                                                           \
    _Pragma("GCC unroll 8") for (int j = 0; j < NV; ++j) _mm256_storeu_ps(acc + 8 * j, a[j]);    \
}
DEFINE_ACC(1) DEFINE_ACC(2) DEFINE_ACC(3) DEFINE_ACC(4) DEFINE_ACC(5) DEFINE_ACC(6) DEFINE_ACC(7) DEFINE_ACC(8)

/* One row: acc[0, width) = acc·alpha + Σ_t p[t]·v[t*vs ..]; width % 8 == 0. */
static void acc1_v(float *acc, float alpha, const float *p, int64_t n, const float *v, int64_t vs, int64_t width) {
    for (int64_t c = 0; c < width; c += 64) {
        int64_t nv = (width - c) / 8;
        switch (nv > 8 ? 8 : nv) {
        case 1: acc1_v1(acc + c, alpha, p, n, v + c, vs); break;
        case 2: acc1_v2(acc + c, alpha, p, n, v + c, vs); break;
        case 3: acc1_v3(acc + c, alpha, p, n, v + c, vs); break;
        case 4: acc1_v4(acc + c, alpha, p, n, v + c, vs); break;
        case 5: acc1_v5(acc + c, alpha, p, n, v + c, vs); break;
        case 6: acc1_v6(acc + c, alpha, p, n, v + c, vs); break;
        case 7: acc1_v7(acc + c, alpha, p, n, v + c, vs); break;
        default: acc1_v8(acc + c, alpha, p, n, v + c, vs); break;
        }
    }
}

/* Three rows sharing the value rows: acc[j*as + (0, width)] = acc·alpha[j] + Σ_t p[j*ps + t]·v[t],
   j < 3; 32 dims at a time (12 accumulators), each value vector loaded once for three rows. */
#define DEFINE_ACC3(NV)                                                                          \
static inline void acc3_v##NV(float *acc, int64_t as, const float *alpha, const float *p, int64_t ps, \
                              int64_t n, const float *v, int64_t vs) {                           \
    __m256 a0[NV], a1[NV], a2[NV];                                                               \
    const __m256 l0 = _mm256_set1_ps(alpha[0]), l1 = _mm256_set1_ps(alpha[1]), l2 = _mm256_set1_ps(alpha[2]); \
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; ++j) {                                       \
        a0[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * j), l0);                                 \
        a1[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + as + 8 * j), l1);                            \
        a2[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + 2 * as + 8 * j), l2);                        \
    }                                                                                            \
    for (int64_t t = 0; t < n; ++t) {                                                            \
        const __m256 p0 = _mm256_broadcast_ss(p + t), p1 = _mm256_broadcast_ss(p + ps + t),      \
                     p2 = _mm256_broadcast_ss(p + 2 * ps + t);                                   \
        const float *vr = v + t * vs;                                                            \
        _Pragma("GCC unroll 4") for (int j = 0; j < NV; ++j) {                                   \
            const __m256 x = _mm256_loadu_ps(vr + 8 * j);                                        \
            a0[j] = _mm256_fmadd_ps(p0, x, a0[j]);                                               \
            a1[j] = _mm256_fmadd_ps(p1, x, a1[j]);                                               \
            a2[j] = _mm256_fmadd_ps(p2, x, a2[j]);                                               \
        }                                                                                        \
    }                                                                                            \
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; ++j) {                                       \
        _mm256_storeu_ps(acc + 8 * j, a0[j]);                                                    \
        _mm256_storeu_ps(acc + as + 8 * j, a1[j]);                                               \
        _mm256_storeu_ps(acc + 2 * as + 8 * j, a2[j]);                                           \
    }                                                                                            \
}
DEFINE_ACC3(1) DEFINE_ACC3(2) DEFINE_ACC3(3) DEFINE_ACC3(4)

static void acc3_v(float *acc, int64_t as, const float *alpha, const float *p, int64_t ps, int64_t n, const float *v,
                   int64_t vs, int64_t width) {
    for (int64_t c = 0; c < width; c += 32) {
        int64_t nv = (width - c) / 8;
        switch (nv > 4 ? 4 : nv) {
        case 1: acc3_v1(acc + c, as, alpha, p, ps, n, v + c, vs); break;
        case 2: acc3_v2(acc + c, as, alpha, p, ps, n, v + c, vs); break;
        case 3: acc3_v3(acc + c, as, alpha, p, ps, n, v + c, vs); break;
        default: acc3_v4(acc + c, as, alpha, p, ps, n, v + c, vs); break;
        }
    }
}

/* s[t] += q · k[t*ks .. +len), t < n, any len (key patch: q = qv row, k = u_k rows). */
static void dots_add_v(const float *q, const float *k, int64_t ks, int64_t len, int64_t n, float *s) {
    const int64_t l8 = len & ~(int64_t)7;
    for (int64_t t = 0; t < n; ++t) {
        const float *kt = k + t * ks;
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < l8; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kt + d), a);
        float x = hsum_v(a);
        for (int64_t d = l8; d < len; ++d) x += q[d] * kt[d];
        s[t] += x;
    }
}
#endif /* HAVE_AVX2 */

static void scores_s(const float *q, const float *k, int64_t ks, int64_t dp, int64_t n, float *s) {
    for (int64_t t = 0; t < n; ++t) {
        const float *kt = k + t * ks;
        float a = 0.0f;
        for (int64_t d = 0; d < dp; ++d) a += q[d] * kt[d];
        s[t] = a;
    }
}

/* acc[0, width) = acc·alpha + Σ_t p[t]·v[t*vs ..] */
static void acc_s(float *acc, float alpha, const float *p, int64_t n, const float *v, int64_t vs, int64_t width) {
    for (int64_t e = 0; e < width; ++e) acc[e] *= alpha;
    for (int64_t t = 0; t < n; ++t) {
        const float pt = p[t], *vr = v + t * vs;
        for (int64_t e = 0; e < width; ++e) acc[e] += pt * vr[e];
    }
}

/* ---------------------------------------------------------------- the walk */

#define PAD16(x) (((x) + 15) & ~(int64_t)15)

static void *alloc64(size_t nbytes) { /* 64-byte aligned: vector loads never split a cache line */
    void *p = 0;
    return posix_memalign(&p, 64, nbytes ? nbytes : 64) ? 0 : p;
}

typedef struct {
    int dtype, simd, interleaved, has_softcap;
    int64_t tq, hq, hkv, g, d, dv, dp, dvp, half, window, rows, mkmax, mvmax;
    size_t esize;
    const int64_t *qidx, *segs, *ulo, *uhi, *off;
    int64_t nseg;
    const float *cs, *sn, *qf; /* qf: converted query rows, dp floats each, in row order (below) */
    float qscale, softcap, cap2;
} Ctx;

/* Rows (one online-softmax state each) are ordered r = (kvh*tq + i)*g + gi for query row i and
   head h = kvh*g + gi: the rows that read one KV head for a run of query rows are contiguous. */
typedef struct {
    int64_t g0, g1; /* this part's range of the visible keys laid end to end */
    float *m, *l, *acc, *pu, *qs, *qv, *kb, *vb, *sc, *alpha;
    unsigned char *poison;
} Part;

/* Keys t of a segment (first, len) that query row i sees: [lo, hi). */
static inline void row_range(const Ctx *c, int64_t i, int64_t first, int64_t len, int64_t *lo, int64_t *hi) {
    int64_t rel = c->qidx[i] - first; /* key t visible iff t <= rel and rel - t < window */
    int64_t h = rel + 1 < len ? rel + 1 : len;
    if (h < 0) h = 0;
    int64_t l = 0;
    if (c->window > 0) l = rel - c->window + 1 > 0 ? rel - c->window + 1 : 0;
    *lo = l < h ? l : h;
    *hi = h;
}

/* Query rows in the segment's key frame, scaled: qs[r] = R(-shift)·q[r]·qscale; and, with a key
   patch, qv[r, j] = qs[r] · vt_k[j, kvh(r)]. The rotation makes the reference's float32
   operations (x1·cos − x2·sin, x2·cos + x1·sin) before the scaling. */
static void prep_query(const Ctx *c, Part *p, const int64_t *sg) {
    const int64_t rot = sg[S_ROT], dp = c->dp, half = c->half;
    const float sc = c->qscale;
    for (int64_t r = 0; r < c->rows; ++r) {
        const float *x = c->qf + r * dp;
        float *o = p->qs + r * dp;
        int64_t j = 0;
        if (rot >= 0) {
            const float *cs = c->cs + rot * half, *sn = c->sn + rot * half;
            if (c->interleaved) {
                for (int64_t k = 0; k < half; ++k) {
                    float x1 = x[2 * k], x2 = x[2 * k + 1];
                    float o1 = x1 * cs[k] - x2 * sn[k], o2 = x2 * cs[k] + x1 * sn[k];
                    o[2 * k] = o1 * sc; o[2 * k + 1] = o2 * sc;
                }
            } else {
                for (int64_t k = 0; k < half; ++k) {
                    float x1 = x[k], x2 = x[half + k];
                    float o1 = x1 * cs[k] - x2 * sn[k], o2 = x2 * cs[k] + x1 * sn[k];
                    o[k] = o1 * sc; o[half + k] = o2 * sc;
                }
            }
            j = 2 * half;
        }
        for (; j < dp; ++j) o[j] = x[j] * sc;
    }
    const int64_t mk = sg[S_MK];
    if (mk) {
        const float *vt = (const float *)(intptr_t)sg[S_VTK]; /* [mk, hkv, d] */
        for (int64_t r = 0; r < c->rows; ++r) {
            const int64_t kvh = r / (c->tq * c->g);
            for (int64_t j = 0; j < mk; ++j) {
                const float *w = vt + (j * c->hkv + kvh) * c->d, *qr = p->qs + r * dp;
                float a = 0.0f;
                int64_t e = 0;
#if HAVE_AVX2
                if (c->simd) {
                    __m256 a8 = _mm256_setzero_ps();
                    for (; e + 8 <= c->d; e += 8) a8 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + e), _mm256_loadu_ps(w + e), a8);
                    a = hsum_v(a8);
                }
#endif
                for (; e < c->d; ++e) a += qr[e] * w[e];
                p->qv[r * mk + j] = a;
            }
        }
    }
}

/* Rows [r0, r0 + R) against the same n keys (kb, row stride ks): raw scores into sc rows. */
static void group_scores(const Ctx *c, Part *p, int64_t r0, int64_t R, const float *kb, int64_t ks, int64_t n) {
    const int64_t dp = c->dp;
    int64_t j = 0;
#if HAVE_AVX2
    if (c->simd) {
        for (; j + 3 <= R; j += 3) scores3_v(p->qs + (r0 + j) * dp, dp, kb, ks, dp, n, p->sc + j * BLOCK, BLOCK, 0);
        for (; j < R; ++j) scores1_v(p->qs + (r0 + j) * dp, kb, ks, dp, n, p->sc + j * BLOCK, 0);
        return;
    }
#endif
    for (; j < R; ++j) scores_s(p->qs + (r0 + j) * dp, kb, ks, dp, n, p->sc + j * BLOCK);
}

/* Row r, one block: log2-unit scores s[0, n) -> probabilities relative to the row's new running
   max (in place); *alpha = how the row's earlier state rescales; m, l updated. A block whose
   scores are all -inf or NaN adds nothing (s zeroed, alpha 1); a NaN poisons the row. s has room
   for n rounded up to 8. */
static void row_softmax(const Ctx *c, Part *p, int64_t r, float *s, int64_t n, float *alpha) {
    (void)c;
    float *m = p->m + r, *l = p->l + r;
    float bm = -INFINITY, sum = 0.0f;
#if HAVE_AVX2
    const int64_t n8 = (n + 7) & ~(int64_t)7;
    if (c->simd) {
        for (int64_t t = n; t < n8; ++t) s[t] = -INFINITY;
        __m256 mx = _mm256_set1_ps(-INFINITY);
        for (int64_t t = 0; t < n8; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t));
        bm = hmax_v(mx);
    } else
#endif
        for (int64_t t = 0; t < n; ++t) bm = s[t] > bm ? s[t] : bm;
    if (!(bm > -INFINITY)) {
        for (int64_t t = 0; t < n; ++t) {
            if (s[t] != s[t]) p->poison[r] = 1;
            s[t] = 0.0f;
        }
        *alpha = 1.0f;
        return;
    }
    const float mnew = *m > bm ? *m : bm;
    const float a = *m == mnew ? 1.0f : exp2_s(*m - mnew); /* 0 while the row is empty (m = -inf) */
#if HAVE_AVX2
    if (c->simd) {
        const __m256 mm = _mm256_set1_ps(mnew);
        __m256 acc8 = _mm256_setzero_ps();
        for (int64_t t = 0; t < n8; t += 8) {
            __m256 e = exp2_v(_mm256_sub_ps(_mm256_loadu_ps(s + t), mm));
            _mm256_storeu_ps(s + t, e);
            acc8 = _mm256_add_ps(acc8, e);
        }
        sum = hsum_v(acc8);
    } else
#endif
        for (int64_t t = 0; t < n; ++t) { s[t] = exp2_s(s[t] - mnew); sum += s[t]; }
    *l = *l * a + sum;
    *m = mnew;
    *alpha = a;
}

/* Rows [r0, r0 + R): acc = acc·alpha + Σ_t p[t]·v[t] over the same n value rows (vb, stride vs). */
static void group_values(const Ctx *c, Part *p, int64_t r0, int64_t R, const float *vb, int64_t vs, int64_t n) {
    const int64_t dvp = c->dvp;
    int64_t j = 0;
#if HAVE_AVX2
    if (c->simd) {
        for (; j + 3 <= R; j += 3)
            acc3_v(p->acc + (r0 + j) * dvp, dvp, p->alpha + j, p->sc + j * BLOCK, BLOCK, n, vb, vs, dvp);
        for (; j < R; ++j) acc1_v(p->acc + (r0 + j) * dvp, p->alpha[j], p->sc + j * BLOCK, n, vb, vs, dvp);
        return;
    }
#endif
    for (; j < R; ++j) acc_s(p->acc + (r0 + j) * dvp, p->alpha[j], p->sc + j * BLOCK, n, vb, vs, dvp);
}

/* Key patch of rows [r0, r0 + R): s[t] += qv[r] · u_k[t] over n keys (ut: u_k rows, stride mk). */
static void group_key_patch(const Ctx *c, Part *p, int64_t r0, int64_t R, int64_t mk, const float *ut, int64_t n) {
    (void)c;
    int64_t j = 0;
#if HAVE_AVX2
    if (c->simd) {
        if (mk % 8 == 0) {
            for (; j + 3 <= R; j += 3) scores3_v(p->qv + (r0 + j) * mk, mk, ut, mk, mk, n, p->sc + j * BLOCK, BLOCK, 1);
            for (; j < R; ++j) scores1_v(p->qv + (r0 + j) * mk, ut, mk, mk, n, p->sc + j * BLOCK, 1);
        } else
            for (; j < R; ++j) dots_add_v(p->qv + (r0 + j) * mk, ut, mk, mk, n, p->sc + j * BLOCK);
        return;
    }
#endif
    for (; j < R; ++j) {
        const float *qv = p->qv + (r0 + j) * mk;
        float *s = p->sc + j * BLOCK;
        for (int64_t t = 0; t < n; ++t) {
            float x = 0.0f;
            for (int64_t q = 0; q < mk; ++q) x += ut[t * mk + q] * qv[q];
            s[t] += x;
        }
    }
}

/* Value patch weights of rows [r0, r0 + R): pu = pu·alpha + Σ_t p[t]·u_v[t] (ut: stride mv). */
static void group_value_patch(const Ctx *c, Part *p, int64_t r0, int64_t R, int64_t mv, const float *ut, int64_t n) {
    const int64_t ps = c->mvmax;
    int64_t q0 = 0; /* columns [0, q0) by vectors, the rest below */
#if HAVE_AVX2
    if (c->simd && (q0 = mv & ~(int64_t)7)) {
        int64_t j = 0;
        for (; j + 3 <= R; j += 3) acc3_v(p->pu + (r0 + j) * ps, ps, p->alpha + j, p->sc + j * BLOCK, BLOCK, n, ut, mv, q0);
        for (; j < R; ++j) acc1_v(p->pu + (r0 + j) * ps, p->alpha[j], p->sc + j * BLOCK, n, ut, mv, q0);
    }
#endif
    for (int64_t j = 0; j < R; ++j) {
        float *pu = p->pu + (r0 + j) * ps;
        const float *s = p->sc + j * BLOCK, al = p->alpha[j];
        for (int64_t q = q0; q < mv; ++q) pu[q] *= al;
        for (int64_t t = 0; t < n; ++t)
            for (int64_t q = q0; q < mv; ++q) pu[q] += s[t] * ut[t * mv + q];
    }
}

/* Keys [a, b) of one segment into the part's states. */
static void run_segment(const Ctx *c, Part *p, const int64_t *sg, int64_t a, int64_t b) {
    const int64_t first = sg[S_FIRST], len = sg[S_LEN], tq = c->tq, g = c->g, dp = c->dp, dvp = c->dvp;
    const int64_t kst = sg[S_KST], ksh = sg[S_KSH], vst = sg[S_VST], vsh = sg[S_VSH];
    const char *K = (const char *)(intptr_t)sg[S_K], *V = (const char *)(intptr_t)sg[S_V];
    const int64_t mk = sg[S_MK], mv = sg[S_MV];
    const float *uk = (const float *)(intptr_t)sg[S_UK], *uv = (const float *)(intptr_t)sg[S_UV];
    const int kdirect = c->dtype == DT_F32 && dp == c->d, vdirect = c->dtype == DT_F32 && dvp == c->dv;
    prep_query(c, p, sg);
    if (mv) memset(p->pu, 0, sizeof(float) * (size_t)(c->rows * c->mvmax));
    for (int64_t t0 = a; t0 < b; t0 += BLOCK) {
        const int64_t n = b - t0 < BLOCK ? b - t0 : BLOCK;
        for (int64_t kvh = 0; kvh < c->hkv; ++kvh) {
            const float *kb = 0, *vb = 0;
            int64_t ks = dp, vs = dvp;
            for (int64_t i = 0; i < tq;) {
                /* a run of query rows [i, i1) that see the same keys [ta, tb) of this block */
                int64_t lo, hi;
                row_range(c, i, first, len, &lo, &hi);
                const int64_t ta = lo > t0 ? lo : t0, tb = hi < t0 + n ? hi : t0 + n;
                int64_t i1 = i + 1;
                for (; i1 < tq; ++i1) {
                    int64_t lo1, hi1;
                    row_range(c, i1, first, len, &lo1, &hi1);
                    if ((lo1 > t0 ? lo1 : t0) != ta || (hi1 < t0 + n ? hi1 : t0 + n) != tb) break;
                }
                if (ta >= tb) { i = i1; continue; }
                if (!kb) { /* this (block, KV head) has a visible key: locate or stage it */
                    const char *k0 = K + (size_t)(t0 * kst + kvh * ksh) * c->esize;
                    const char *v0 = V + (size_t)(t0 * vst + kvh * vsh) * c->esize;
                    if (kdirect) { kb = (const float *)k0; ks = kst; }
                    else {
                        for (int64_t t = 0; t < n; ++t)
                            load_row(k0 + (size_t)(t * kst) * c->esize, c->dtype, c->d, dp, p->kb + t * dp, c->simd);
                        kb = p->kb;
                    }
                    if (vdirect) { vb = (const float *)v0; vs = vst; }
                    else {
                        for (int64_t t = 0; t < n; ++t)
                            load_row(v0 + (size_t)(t * vst) * c->esize, c->dtype, c->dv, dvp, p->vb + t * dvp, c->simd);
                        vb = p->vb;
                    }
                }
                const int64_t r0 = (kvh * tq + i) * g, R = (i1 - i) * g, o = ta - t0, nn = tb - ta;
                group_scores(c, p, r0, R, kb + o * ks, ks, nn);
                if (mk) group_key_patch(c, p, r0, R, mk, uk + ta * mk, nn);
                for (int64_t j = 0; j < R; ++j) {
                    float *s = p->sc + j * BLOCK;
                    if (c->has_softcap)
                        for (int64_t t = 0; t < nn; ++t) s[t] = c->cap2 * tanh_s(s[t] / c->softcap);
                    row_softmax(c, p, r0 + j, s, nn, p->alpha + j);
                }
                group_values(c, p, r0, R, vb + o * vs, vs, nn);
                if (mv) group_value_patch(c, p, r0, R, mv, uv + ta * mv, nn);
                i = i1;
            }
        }
    }
    if (mv) { /* acc += pu · vt_v, both at the running scale */
        const float *vt = (const float *)(intptr_t)sg[S_VTV]; /* [mv, hkv, dv] */
        for (int64_t r = 0; r < c->rows; ++r) {
            const int64_t kvh = r / (tq * g);
            float *acc = p->acc + r * dvp;
            for (int64_t j = 0; j < mv; ++j) {
                const float w = p->pu[r * c->mvmax + j], *row = vt + (j * c->hkv + kvh) * c->dv;
                for (int64_t e = 0; e < c->dv; ++e) acc[e] += w * row[e];
            }
        }
    }
}

static void run_part(const Ctx *c, Part *p) {
    for (int64_t s = 0; s < c->nseg; ++s) {
        const int64_t n = c->uhi[s] - c->ulo[s], o = c->off[s];
        if (n <= 0 || o + n <= p->g0) continue;
        if (o >= p->g1) break;
        const int64_t a = (p->g0 > o ? p->g0 : o) - o, b = (p->g1 < o + n ? p->g1 : o + n) - o;
        run_segment(c, p, c->segs + s * S_NF, c->ulo[s] + a, c->ulo[s] + b);
    }
}

/* out [tq, hq, dv] float32 = attention of query [tq, hq, d] (dtype) over the nseg segments
   described by segs [nseg, S_NF]. cs, sn: [distinct shifts, half] float32 (cos and sin of -shift
   times each inverse frequency); interleaved: the RoPE pairing. softcap used iff has_softcap;
   window <= 0: none. Returns the number of query rows that see no key (their output is 0), or -1
   when memory runs out. */
int64_t kamera_segment_attention(const void *q, int dtype, int64_t tq, int64_t hq, int64_t hkv, int64_t d, int64_t dv,
                                 const int64_t *qidx, const int64_t *segs, int64_t nseg, const float *cs,
                                 const float *sn, int64_t half, int interleaved, double scaling, int has_softcap,
                                 double softcap, int64_t window, float *out, int nthreads, int simd) {
    Ctx c;
    memset(&c, 0, sizeof c);
    c.dtype = dtype; c.simd = simd && HAVE_AVX2; c.interleaved = interleaved; c.has_softcap = has_softcap;
    c.tq = tq; c.hq = hq; c.hkv = hkv; c.g = hq / hkv; c.d = d; c.dv = dv;
    c.dp = (d + 7) & ~(int64_t)7; c.dvp = (dv + 7) & ~(int64_t)7;
    c.half = half; c.window = window; c.rows = hq * tq; c.esize = dtype == DT_F32 ? 4 : 2;
    c.qidx = qidx; c.segs = segs; c.nseg = nseg; c.cs = cs; c.sn = sn;
    c.softcap = (float)softcap;
    c.cap2 = (float)(softcap * 1.4426950408889634);
    c.qscale = has_softcap ? (float)scaling : (float)(scaling * 1.4426950408889634);

    int64_t *ranges = (int64_t *)malloc(sizeof(int64_t) * (size_t)(3 * nseg + 1));
    float *qf = (float *)malloc(sizeof(float) * (size_t)(c.rows * c.dp));
    if (!ranges || !qf) { free(ranges); free(qf); return -1; }
    int64_t *ulo = ranges, *uhi = ranges + nseg, *off = ranges + 2 * nseg, total = 0;
    for (int64_t s = 0; s < nseg; ++s) { /* keys of segment s that some row sees: [ulo, uhi) */
        const int64_t *sg = segs + s * S_NF;
        int64_t lo = INT64_MAX, hi = 0;
        for (int64_t i = 0; i < tq; ++i) {
            int64_t a, b;
            row_range(&c, i, sg[S_FIRST], sg[S_LEN], &a, &b);
            if (a < b) { lo = a < lo ? a : lo; hi = b > hi ? b : hi; }
        }
        if (sg[S_MK] > c.mkmax) c.mkmax = sg[S_MK];
        if (sg[S_MV] > c.mvmax) c.mvmax = sg[S_MV];
        if (lo >= hi) lo = hi = 0;
        ulo[s] = lo; uhi[s] = hi; off[s] = total; total += hi - lo;
    }
    c.ulo = ulo; c.uhi = uhi; c.off = off;
    for (int64_t i = 0; i < tq; ++i)
        for (int64_t h = 0; h < hq; ++h) {
            const int64_t r = ((h / c.g) * tq + i) * c.g + h % c.g;
            load_row((const char *)q + (size_t)((i * hq + h) * d) * c.esize, dtype, d, c.dp, qf + r * c.dp, c.simd);
        }
    c.qf = qf;

    /* One part per thread, unless the work is too small to share. */
    int64_t parts = nthreads > 1 ? nthreads : 1;
    if (total * hkv * (d + dv) < (1 << 15)) parts = 1;
    if (parts > total) parts = total > 0 ? total : 1;
    const int64_t group = tq * c.g; /* rows of one KV head */
    const int64_t n_m = PAD16(c.rows), n_acc = PAD16(c.rows * c.dvp), n_pu = PAD16(c.rows * c.mvmax),
                  n_qs = PAD16(c.rows * c.dp), n_qv = PAD16(c.rows * c.mkmax), n_kb = PAD16(BLOCK * c.dp),
                  n_vb = PAD16(BLOCK * c.dvp), n_al = PAD16(group), n_sc = PAD16(group * BLOCK + 8);
    const size_t per_part = (size_t)(2 * n_m + n_acc + n_pu + n_qs + n_qv + n_kb + n_vb + n_al + n_sc);
    float *work = (float *)alloc64(sizeof(float) * per_part * (size_t)parts); /* sub-arrays 64-byte aligned */
    Part *pp = (Part *)calloc((size_t)parts, sizeof(Part));
    unsigned char *poison = (unsigned char *)calloc((size_t)(c.rows * parts), 1);
    if (!work || !pp || !poison) {
        free(work); free(pp); free(poison); free(ranges); free(qf);
        return -1;
    }
    for (int64_t k = 0; k < parts; ++k) {
        Part *p = pp + k;
        float *w = work + per_part * (size_t)k;
        p->g0 = total * k / parts; p->g1 = total * (k + 1) / parts;
        p->m = w; w += n_m;
        p->l = w; w += n_m;
        p->acc = w; w += n_acc;
        p->pu = w; w += n_pu;
        p->qs = w; w += n_qs;
        p->qv = w; w += n_qv;
        p->kb = w; w += n_kb;
        p->vb = w; w += n_vb;
        p->alpha = w; w += n_al;
        p->sc = w;
        p->poison = poison + c.rows * k;
        for (int64_t r = 0; r < c.rows; ++r) { p->m[r] = -INFINITY; p->l[r] = 0.0f; }
        memset(p->acc, 0, sizeof(float) * (size_t)(c.rows * c.dvp));
    }

#pragma omp parallel for num_threads((int)parts) schedule(static, 1) if (parts > 1)
    for (int64_t k = 0; k < parts; ++k) run_part(&c, pp + k);

    /* Merge the parts' states by log-sum-exp (base 2) and normalise. */
    int64_t unseen = 0;
    for (int64_t i = 0; i < tq; ++i) {
        int row_unseen = 0;
        for (int64_t h = 0; h < hq; ++h) {
            const int64_t r = ((h / c.g) * tq + i) * c.g + h % c.g;
            float *o = out + (i * hq + h) * dv;
            float mx = -INFINITY;
            int bad = 0;
            for (int64_t k = 0; k < parts; ++k) {
                bad |= pp[k].poison[r];
                mx = pp[k].m[r] > mx ? pp[k].m[r] : mx;
            }
            if (bad || mx == -INFINITY) {
                for (int64_t e = 0; e < dv; ++e) o[e] = bad ? NAN : 0.0f;
                row_unseen |= !bad;
                continue;
            }
            float lsum = 0.0f;
            for (int64_t e = 0; e < dv; ++e) o[e] = 0.0f;
            for (int64_t k = 0; k < parts; ++k) {
                const float w = exp2_s(pp[k].m[r] - mx);
                if (w == 0.0f) continue;
                lsum += w * pp[k].l[r];
                const float *a = pp[k].acc + r * c.dvp;
                for (int64_t e = 0; e < dv; ++e) o[e] += w * a[e];
            }
            const float inv = 1.0f / lsum;
            for (int64_t e = 0; e < dv; ++e) o[e] *= inv;
        }
        unseen += row_unseen;
    }
    free(work); free(pp); free(poison); free(ranges); free(qf);
    return unseen;
}
