/* One-pass CPU relocate: out = R·keys (+ delta), loaded by kamera_core/relocate/cpu.py via ctypes. */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#define BLOCK 64          /* pairs per block: loads of a block finish before its stores */
#define ROWBUF_BYTES 4096 /* largest row (bytes) staged for non-temporal stores */

static inline float load_bf16(const uint16_t *p) {
    uint32_t u = (uint32_t)*p << 16; float f; memcpy(&f, &u, 4); return f;
}
/* float -> bfloat16, round to nearest even; NaN -> 0x7fc0 (torch's c10::BFloat16 rule). */
static inline void store_bf16(uint16_t *p, float f) {
    uint32_t u; memcpy(&u, &f, 4);
    *p = ((u & 0x7fffffffu) > 0x7f800000u) ? (uint16_t)0x7fc0
                                            : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float load_f32(const float *p) { return *p; }
static inline void store_f32(float *p, float f) { *p = f; }
static inline double load_f64(const double *p) { return *p; }
static inline void store_f64(double *p, double f) { *p = f; }
/* float16: F16C instructions on x86 (vectorised below), else the compiler's _Float16. */
#if defined(__F16C__)
#define HAVE_F16 1
static inline float load_f16(const uint16_t *p) { return _cvtsh_ss(*p); }
static inline void store_f16(uint16_t *p, float f) { *p = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#elif defined(__FLT16_MAX__)
#define HAVE_F16 1
static inline float load_f16(const uint16_t *p) { _Float16 h; memcpy(&h, p, 2); return (float)h; }
static inline void store_f16(uint16_t *p, float f) { _Float16 h = (_Float16)f; memcpy(p, &h, 2); }
#else
#define HAVE_F16 0
#endif

int kamera_has_f16(void) { return HAVE_F16; }
int kamera_abi(void) { return 1; }

/* n pairs (xa[k*step], xb[k*step]) -> (oa[k*step], ob[k*step]), k < n; da/db: patch or NULL. */
#define DEFINE_BLOCK(NAME, T, C, LOAD, STORE)                                                  \
static inline __attribute__((always_inline)) void NAME(                                        \
    const T *xa, const T *xb, T *oa, T *ob, int64_t step, const C *cs, const C *sn,            \
    const C *da, const C *db, int64_t n) {                                                     \
    C a[BLOCK], b[BLOCK];                                                                      \
    for (int64_t k = 0; k < n; ++k) { a[k] = LOAD(xa + k * step); b[k] = LOAD(xb + k * step); } \
    for (int64_t k = 0; k < n; ++k) {                                                          \
        C o1 = a[k] * cs[k] - b[k] * sn[k];                                                    \
        C o2 = b[k] * cs[k] + a[k] * sn[k];                                                    \
        if (da) { o1 = o1 + da[k * step]; o2 = o2 + db[k * step]; }                            \
        STORE(oa + k * step, o1);                                                              \
        STORE(ob + k * step, o2);                                                              \
    }                                                                                          \
}

/* One row: pairs in blocks (step 1: pairs (i, half+i); step 2: pairs (2i, 2i+1)), then the
   dims past rotary_dim = 2*half: copied, or plus the patch. */
#define DEFINE_ROW(NAME, BLOCKFN, T, C, LOAD, STORE)                                           \
static inline __attribute__((always_inline)) void NAME(                                        \
    const T *xr, T *orow, const C *dr, int64_t head_dim, int64_t half, int64_t step,           \
    const C *cs, const C *sn) {                                                                \
    for (int64_t i0 = 0; i0 < half; i0 += BLOCK) {                                             \
        int64_t n = half - i0 < BLOCK ? half - i0 : BLOCK;                                     \
        int64_t a0 = step == 1 ? i0 : 2 * i0, b0 = step == 1 ? half + i0 : 2 * i0 + 1;         \
        if (n == BLOCK)                                                                        \
            BLOCKFN(xr + a0, xr + b0, orow + a0, orow + b0, step, cs + i0, sn + i0,            \
                    dr ? dr + a0 : 0, dr ? dr + b0 : 0, BLOCK);                                \
        else                                                                                   \
            BLOCKFN(xr + a0, xr + b0, orow + a0, orow + b0, step, cs + i0, sn + i0,            \
                    dr ? dr + a0 : 0, dr ? dr + b0 : 0, n);                                    \
    }                                                                                          \
    for (int64_t j = 2 * half; j < head_dim; ++j) {                                            \
        if (dr) STORE(orow + j, LOAD(xr + j) + dr[j]);                                         \
        else if (orow != xr) orow[j] = xr[j];                                                  \
    }                                                                                          \
}

static inline void stream_row(void *dst, const void *src, int64_t nbytes) {
#if defined(__AVX512F__)
    for (int64_t j = 0; j < nbytes / 64; ++j)
        _mm512_stream_si512((__m512i *)dst + j, _mm512_load_si512((const __m512i *)src + j));
#elif defined(__AVX__)
    for (int64_t j = 0; j < nbytes / 32; ++j)
        _mm256_stream_si256((__m256i *)dst + j, _mm256_load_si256((const __m256i *)src + j));
#elif defined(__SSE2__)
    for (int64_t j = 0; j < nbytes / 16; ++j)
        _mm_stream_si128((__m128i *)dst + j, _mm_load_si128((const __m128i *)src + j));
#else
    memcpy(dst, src, (size_t)nbytes);
#endif
}

static inline void stream_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* out[r] = R·x[r] (+ delta[r]) for rows r; x, out, delta: [rows, head_dim] contiguous; out may be
   x. cs, sn: [half]. stream: out-of-place rows of whole 64-byte lines go out non-temporally. */
#define DEFINE_ROTATE(NAME, ROWFN, T, C)                                                       \
void NAME(const T *x, T *out, const C *delta, int64_t rows, int64_t head_dim, int64_t half,    \
          int interleaved, const C *cs, const C *sn, int nthreads, int stream) {               \
    const int64_t row_bytes = head_dim * (int64_t)sizeof(T);                                   \
    const int nt = stream && x != out && row_bytes % 64 == 0 && row_bytes <= ROWBUF_BYTES      \
                   && ((uintptr_t)out % 64) == 0;                                              \
    _Pragma("omp parallel num_threads(nthreads) if(rows * head_dim >= 65536)")                 \
    {                                                                                          \
        _Alignas(64) unsigned char rowbuf[ROWBUF_BYTES];                                       \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t r = 0; r < rows; ++r) {                                                   \
            const T *xr = x + r * head_dim;                                                    \
            T *orow = nt ? (T *)rowbuf : out + r * head_dim;                                   \
            const C *dr = delta ? delta + r * head_dim : 0;                                    \
            if (interleaved) {                                                                 \
                if (dr) ROWFN(xr, orow, dr, head_dim, half, 2, cs, sn);                        \
                else ROWFN(xr, orow, 0, head_dim, half, 2, cs, sn);                            \
            } else {                                                                           \
                if (dr) ROWFN(xr, orow, dr, head_dim, half, 1, cs, sn);                        \
                else ROWFN(xr, orow, 0, head_dim, half, 1, cs, sn);                            \
            }                                                                                  \
            if (nt) stream_row(out + r * head_dim, rowbuf, row_bytes);                         \
        }                                                                                      \
        if (nt) stream_fence();                                                                \
    }                                                                                          \
}

DEFINE_BLOCK(block_bf16, uint16_t, float, load_bf16, store_bf16)
DEFINE_ROW(row_bf16, block_bf16, uint16_t, float, load_bf16, store_bf16)
DEFINE_ROTATE(kamera_rotate_bf16, row_bf16, uint16_t, float)

DEFINE_BLOCK(block_f32, float, float, load_f32, store_f32)
DEFINE_ROW(row_f32, block_f32, float, float, load_f32, store_f32)
DEFINE_ROTATE(kamera_rotate_f32, row_f32, float, float)

DEFINE_BLOCK(block_f64, double, double, load_f64, store_f64)
DEFINE_ROW(row_f64, block_f64, double, double, load_f64, store_f64)
DEFINE_ROTATE(kamera_rotate_f64, row_f64, double, double)

#if HAVE_F16
/* float16 rows are staged through float32: contiguous conversions vectorise where a converting
   load per pair does not; the conversions are exact one way and round to nearest even back. */
#define STAGE_MAX 1024
static inline void f16_row_to_f32(const uint16_t *src, float *dst, int64_t n) {
    int64_t k = 0;
#if defined(__AVX512F__)
    for (; k + 16 <= n; k += 16)
        _mm512_storeu_ps(dst + k, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + k))));
#elif defined(__F16C__)
    for (; k + 8 <= n; k += 8)
        _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + k))));
#endif
    for (; k < n; ++k) dst[k] = load_f16(src + k);
}
static inline void f32_row_to_f16(const float *src, uint16_t *dst, int64_t n) {
    int64_t k = 0;
#if defined(__AVX512F__)
    for (; k + 16 <= n; k += 16)
        _mm256_storeu_si256((__m256i *)(dst + k),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + k), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    for (; k + 8 <= n; k += 8)
        _mm_storeu_si128((__m128i *)(dst + k),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + k), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; k < n; ++k) store_f16(dst + k, src[k]);
}
DEFINE_BLOCK(block_f16, uint16_t, float, load_f16, store_f16)
DEFINE_ROW(row_f16_direct, block_f16, uint16_t, float, load_f16, store_f16)
static inline __attribute__((always_inline)) void row_f16(
    const uint16_t *xr, uint16_t *orow, const float *dr, int64_t head_dim, int64_t half, int64_t step,
    const float *cs, const float *sn) {
    if (head_dim > STAGE_MAX) { row_f16_direct(xr, orow, dr, head_dim, half, step, cs, sn); return; }
    float row[STAGE_MAX];
    f16_row_to_f32(xr, row, head_dim);
    row_f32(row, row, dr, head_dim, half, step, cs, sn);
    f32_row_to_f16(row, orow, head_dim);
}
DEFINE_ROTATE(kamera_rotate_f16, row_f16, uint16_t, float)
#endif
