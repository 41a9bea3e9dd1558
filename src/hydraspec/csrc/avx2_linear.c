/* hydraspec: y[n, out] = x[n, in] @ w[out, in]^T (+ bias) for bf16 and int8 weights on AVX2 CPUs.

   The AVX2 (+FMA) counterpart of bf16_linear.c for CPUs without AVX-512 (e.g. AMD Zen 2/3, Intel
   before Skylake-SP): torch's bf16 GEMM emulates bf16 there row by row (a Qwen2.5-1.5B forward: 213 ms
   for 1 token, 2446 ms for 16), and oneDNN refuses to prepack bf16 weights at all. Same packed layout
   as the AVX-512 kernel ([out/32][in][32], bf16 or int8 with a per-output scale), so the Python side is
   shared. With 16 vector registers of 8 floats, a pass covers all 32 outputs of a block for 1-2 rows
   (4 weight vectors, 8 accumulators), or one half of the block (16 outputs) for up to 6 rows
   (2 weight vectors, 12 accumulators); the second half re-reads the block from cache, not memory.

   Every (row, output) sum runs over the inputs in order 0..in-1 in fp32 with fused multiply-adds from
   zero, as in the AVX-512 kernel, so results equal that kernel's bit for bit and a row's result never
   depends on the rows computed beside it.
   Build: cc -O3 -mavx2 -mfma -fopenmp -shared -fPIC. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define OB 32 /* outputs per packed block, as in bf16_linear.c */
#define NB 6  /* rows per pass of the half-block kernels */
#define NF 2  /* rows per pass of the full-block kernels */

static inline uint16_t f2bf(float f) { /* round to nearest even, as torch; NaN stays a quiet NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* 16 weights of one half block -> two vectors of 8 fp32. bf16: one load and two interleaves with
   zero (a bf16 is the top half of its fp32), which leaves the outputs of a vector in the order of
   bf_out below; int8: sign-extend and convert, in order. */
static inline void ld16_bf(const uint16_t* p, __m256* w0, __m256* w1) {
    __m256i v = _mm256_loadu_si256((const __m256i*)p), z = _mm256_setzero_si256();
    *w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v)); /* outputs 0-3, 8-11 */
    *w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v)); /* outputs 4-7, 12-15 */
}
static inline int bf_out(int t) { int v = t >> 3, e = t & 7; return (e < 4 ? e : e + 4) + 4 * v; }
static inline void ld16_q8(const int8_t* p, __m256* w0, __m256* w1) {
    *w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
    *w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))));
}
static inline int q8_out(int t) { return t; }

/* store N rows x V vectors of accumulators (V/2 half blocks from output `off` on) to y as bf16, each
   output scaled (int8) and biased; OUT maps a position within a half block's two vectors to its output */
#define STORE(V, N, off, OUT) \
    float buf[V * 8]; \
    _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) { \
        _Pragma("GCC unroll 4") for (int v = 0; v < V; v++) _mm256_storeu_ps(buf + 8 * v, a[j][v]); \
        uint16_t* yr = y + j * out + o0; \
        for (int t = 0; t < V * 8; t++) { \
            int64_t k = (off) + 16 * (t >> 4) + OUT(t & 15); \
            if (k >= width) continue; \
            float s = buf[t]; \
            if (scale) s *= scale[o0 + k]; \
            yr[k] = f2bf(s + (bias ? bias[o0 + k] : 0.0f)); } }

/* full block: N (<= 2) rows x 32 outputs; half block: N (<= 6) rows x 16 outputs starting at `off`.
   xt: [in][N] fp32 rows of this pass; wb: the block's [in][32] weights of type T */
#define DEF(NAME, T, N) \
static void NAME##_full_##N(const float* xt, int64_t in, const T* wb, uint16_t* y, int64_t out, int64_t o0, \
                            int64_t width, const float* scale, const float* bias) { \
    __m256 a[N][4]; \
    _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) for (int v = 0; v < 4; v++) a[j][v] = _mm256_setzero_ps(); \
    for (int64_t i = 0; i < in; i++) { \
        __m256 w0, w1, w2, w3; \
        ld16_##NAME(wb + i * OB, &w0, &w1); ld16_##NAME(wb + i * OB + 16, &w2, &w3); \
        _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) { __m256 xv = _mm256_broadcast_ss(xt + i * N + j); \
            a[j][0] = _mm256_fmadd_ps(w0, xv, a[j][0]); a[j][1] = _mm256_fmadd_ps(w1, xv, a[j][1]); \
            a[j][2] = _mm256_fmadd_ps(w2, xv, a[j][2]); a[j][3] = _mm256_fmadd_ps(w3, xv, a[j][3]); } \
    } \
    STORE(4, N, 0, NAME##_out) \
} \
static void NAME##_half_##N(const float* xt, int64_t in, const T* wb, uint16_t* y, int64_t out, int64_t o0, \
                            int64_t width, const float* scale, const float* bias, int64_t off) { \
    __m256 a[N][2]; \
    _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) { a[j][0] = _mm256_setzero_ps(); a[j][1] = _mm256_setzero_ps(); } \
    for (int64_t i = 0; i < in; i++) { \
        __m256 w0, w1; \
        ld16_##NAME(wb + i * OB + off, &w0, &w1); \
        _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) { __m256 xv = _mm256_broadcast_ss(xt + i * N + j); \
            a[j][0] = _mm256_fmadd_ps(w0, xv, a[j][0]); a[j][1] = _mm256_fmadd_ps(w1, xv, a[j][1]); } \
    } \
    STORE(2, N, off, NAME##_out) \
}
#define DEFALL(NAME, T) \
    DEF(NAME, T, 1) DEF(NAME, T, 2) DEF(NAME, T, 3) DEF(NAME, T, 4) DEF(NAME, T, 5) DEF(NAME, T, 6)
DEFALL(bf, uint16_t)
DEFALL(q8, int8_t)

typedef void (*fullfn)(const float*, int64_t, const void*, uint16_t*, int64_t, int64_t, int64_t, const float*,
                       const float*);
typedef void (*halffn)(const float*, int64_t, const void*, uint16_t*, int64_t, int64_t, int64_t, const float*,
                       const float*, int64_t);
#define F(x) ((fullfn)(x))
#define H(x) ((halffn)(x))
static const fullfn BF_FULL[NF + 1] = {0, F(bf_full_1), F(bf_full_2)};
static const fullfn Q8_FULL[NF + 1] = {0, F(q8_full_1), F(q8_full_2)};
static const halffn BF_HALF[NB + 1] = {0, H(bf_half_1), H(bf_half_2), H(bf_half_3), H(bf_half_4), H(bf_half_5),
                                       H(bf_half_6)};
static const halffn Q8_HALF[NB + 1] = {0, H(q8_half_1), H(q8_half_2), H(q8_half_3), H(q8_half_4), H(q8_half_5),
                                       H(q8_half_6)};

/* w [out, in] bf16 -> wp [ceil(out/32)][in][32] bf16, zero padded (the layout of bf16_linear.c) */
void hs_pack_bf16(const uint16_t* w, int64_t out, int64_t in, uint16_t* wp) {
    int64_t nblk = (out + OB - 1) / OB;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblk; b++)
        for (int64_t i = 0; i < in; i++)
            for (int64_t k = 0; k < OB; k++) {
                int64_t o = b * OB + k;
                wp[(b * in + i) * OB + k] = o < out ? w[o * in + i] : 0;
            }
}

/* x [n, in] bf16 times packed weights wp (element size esize) -> y [n, out] bf16. 1-2 rows: one pass
   over all 32 outputs of a block; more rows: passes of up to 6 rows over each half of a block. */
static int run(const fullfn* full, const halffn* half, size_t esize, const uint16_t* xb, int64_t n, int64_t in,
               const void* wp, const float* scale, int64_t out, uint16_t* y, const float* bias, int nthreads) {
    int rb = n <= NF ? NF : NB;
    int64_t nrb = (n + rb - 1) / rb;
    float* xt = (float*)malloc((size_t)(nrb * rb * in) * sizeof(float));
    if (!xt) return -1;
    for (int64_t r = 0; r < nrb; r++) { /* row block r: [in][nr] fp32 */
        int64_t j0 = r * rb, nr = n - j0 < rb ? n - j0 : rb;
        float* dst = xt + r * rb * in;
        for (int64_t j = 0; j < nr; j++) {
            const uint16_t* src = xb + (j0 + j) * in;
            for (int64_t i = 0; i < in; i++) { uint32_t u = (uint32_t)src[i] << 16; memcpy(dst + i * nr + j, &u, 4); }
        }
    }
    int64_t nblk = (out + OB - 1) / OB;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < nblk; b++) {
        int64_t o0 = b * OB, width = out - o0 < OB ? out - o0 : OB;
        const char* wb = (const char*)wp + (size_t)(b * in * OB) * esize;
        for (int64_t r = 0; r < nrb; r++) {
            int64_t j0 = r * rb, nr = n - j0 < rb ? n - j0 : rb;
            const float* x = xt + r * rb * in;
            if (rb == NF) {
                full[nr](x, in, wb, y + j0 * out, out, o0, width, scale, bias);
            } else {
                half[nr](x, in, wb, y + j0 * out, out, o0, width, scale, bias, 0);
                if (width > 16) half[nr](x, in, wb, y + j0 * out, out, o0, width, scale, bias, 16);
            }
        }
    }
    free(xt);
    return 0;
}

/* bf16 weights packed by hs_pack_bf16; bias [out] fp32 or NULL. Returns 0, or -1 when out of memory. */
int hs_linear_bf16(const uint16_t* xb, int64_t n, int64_t in, const uint16_t* wp, int64_t out,
                   uint16_t* y, const float* bias, int nthreads) {
    return run(BF_FULL, BF_HALF, sizeof(uint16_t), xb, n, in, wp, NULL, out, y, bias, nthreads);
}

/* int8 weights [ceil(out/32)][in][32] with a per-output fp32 scale (draft models); y = (x @ wq^T) * scale (+ bias) */
int hs_linear_i8(const uint16_t* xb, int64_t n, int64_t in, const int8_t* wq, const float* scale, int64_t out,
                 uint16_t* y, const float* bias, int nthreads) {
    return run(Q8_FULL, Q8_HALF, sizeof(int8_t), xb, n, in, wq, scale, out, y, bias, nthreads);
}
