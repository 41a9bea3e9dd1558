/* hydraspec: y[n, out] = x[n, in] @ w[out, in]^T (+ bias) for bf16 and int8 weights on AVX2 CPUs, the
   int8-activation formats of draft models (w8a8, w4a8; second half of this file) and GGUF weights at the
   file's precision (last part).

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
#ifdef _OPENMP
#include <omp.h>
#endif
#include "hs_common.h" /* OB, f2bf, hs_pack_bf16, run_f32, run_int8 */
#include "hs_ops.h"    /* hs_rmsnorm, hs_attention */

#define NB 6  /* rows per pass of the half-block kernels */
#define NF 2  /* rows per pass of the full-block kernels */

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

/* the kernel tables of one weight type */
typedef struct { const fullfn* full; const halffn* half; } f32_kern;

/* 1-2 rows: one pass over all 32 outputs of a block */
static void full_tile(const f32_call* c, const float* xt, const char* wb, int64_t j0, int64_t nr, int64_t o0,
                      int64_t width) {
    ((const f32_kern*)c->kern)->full[nr](xt, c->in, wb, c->y + j0 * c->out, c->out, o0, width, c->scale, c->bias);
}
/* more rows: a pass of up to 6 rows over each half of a block */
static void half_tile(const f32_call* c, const float* xt, const char* wb, int64_t j0, int64_t nr, int64_t o0,
                      int64_t width) {
    halffn h = ((const f32_kern*)c->kern)->half[nr];
    uint16_t* y = c->y + j0 * c->out;
    h(xt, c->in, wb, y, c->out, o0, width, c->scale, c->bias, 0);
    if (width > 16) h(xt, c->in, wb, y, c->out, o0, width, c->scale, c->bias, 16);
}

/* x [n, in] bf16 times packed weights wp (element size esize) -> y [n, out] bf16. 1-2 rows: one pass
   over all 32 outputs of a block; more rows: passes of up to 6 rows over each half of a block. */
static int run(const fullfn* full, const halffn* half, size_t esize, const uint16_t* xb, int64_t n, int64_t in,
               const void* wp, const float* scale, int64_t out, uint16_t* y, const float* bias, int nthreads) {
    f32_kern k = {full, half};
    f32_call c = {in, out, wp, esize, scale, y, bias, &k};
    return n <= NF ? run_f32(xb, n, NF, &c, full_tile, nthreads) : run_f32(xb, n, NB, &c, half_tile, nthreads);
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

/* ---- int8 activations ("w8a8", "w4a8": draft models) ----
   The AVX2 counterpart of bf16_linear.c's AVX512_VNNI kernels, with the same packed weights, the same
   activation codes and the same exact integer sums, so the two builds give the same results. Without
   vpdpbusd the products go through vpmaddubsw (32 u8 x s8 products into 16 saturating int16 pair sums)
   and vpmaddwd (pairs of int16 into int32); the operands are chosen so that nothing saturates:
   - w8a8: the activation's sign moves onto the weight (vpsignb), so |x| <= 127 times a weight in
     [-127, 127]: a pair sum is at most 2 * 127 * 127 = 32258 < 32767;
   - w4a8: the unsigned 4-bit code (q + 8 <= 15) times x: a pair sum is at most 2 * 15 * 127 = 3810, so
     8 steps (32 inputs) add up in int16 before they are widened.
   Passes cover half a block (16 outputs, two vectors of 8 outputs x 4 inputs) for up to NQ rows; w4a8 takes a
   whole block a pass for 1-2 rows (a draft model's steps), its bytes loaded once. */
#define NQ 3 /* rows per pass of the int8-activation kernels */

/* w8a8, N rows x the 16 outputs of half `h` of a block. wb: the block's [in4][32][4] int8 weights */
#define DEFW8(N) \
static void w8_##N(const int32_t* xq, int64_t in4, const int8_t* wb, int h, const float* sx, const float* scale, \
                   uint16_t* y, int64_t out, int64_t o0, int64_t width, const float* bias) { \
    __m256i a[N][2]; \
    const __m256i ones = _mm256_set1_epi16(1); \
    _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) { a[j][0] = _mm256_setzero_si256(); a[j][1] = _mm256_setzero_si256(); } \
    for (int64_t p = 0; p < in4; p++) { \
        const int8_t* w = wb + p * 4 * OB + 64 * h; \
        __m256i w0 = _mm256_loadu_si256((const __m256i*)w), w1 = _mm256_loadu_si256((const __m256i*)(w + 32)); \
        _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) { \
            __m256i xv = _mm256_set1_epi32(xq[p * N + j]), ax = _mm256_abs_epi8(xv); \
            a[j][0] = _mm256_add_epi32(a[j][0], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xv)), ones)); \
            a[j][1] = _mm256_add_epi32(a[j][1], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xv)), ones)); } \
    } \
    int32_t buf[16]; \
    _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) { \
        _mm256_storeu_si256((__m256i*)buf, a[j][0]); _mm256_storeu_si256((__m256i*)(buf + 8), a[j][1]); \
        uint16_t* yr = y + j * out + o0; \
        for (int t = 0; t < 16; t++) { \
            int64_t k = 16 * h + t; \
            if (k >= width) break; \
            float v = (float)buf[t] * sx[j] * scale[o0 + k]; \
            yr[k] = f2bf(v + (bias ? bias[o0 + k] : 0.0f)); } } \
}
DEFW8(1) DEFW8(2) DEFW8(3)
typedef void (*w8fn)(const int32_t*, int64_t, const int8_t*, int, const float*, const float*, uint16_t*, int64_t,
                     int64_t, int64_t, const float*);
static const w8fn W8[NQ + 1] = {0, w8_1, w8_2, w8_3};

static void w8_tile(const int8_call* c, const int8_rows* q, int64_t b, int64_t j0, int64_t nr, int64_t o0,
                    int64_t width) {
    int64_t in4 = (c->in + 3) / 4;
    const int8_t* wb = (const int8_t*)c->wq + (size_t)(b * in4 * 4 * OB);
    for (int h = 0; h < 2 && 16 * h < width; h++)
        W8[nr](q->xq + j0 * in4, in4, wb, h, q->sx + j0, c->scale, c->y + j0 * c->out, c->out, o0, width, c->bias);
}

/* x [n, in] bf16 times w8a8-packed int8 weights ([ceil(out/32)][in4][32][4], as bf16_linear.c; wsum is
   not needed: the codes here are signed) -> y [n, out] bf16. 0, or -1 when out of memory. */
int hs_linear_w8a8(const uint16_t* xb, int64_t n, int64_t in, const int8_t* wq, const int32_t* wsum,
                   const float* scale, int64_t out, uint16_t* y, const float* bias, int nthreads) {
    int8_call c = {in, out, 0, wq, wsum, scale, y, bias};
    return run_int8(xb, n, NQ, 0, &c, w8_tile, nthreads);
}

/* w4a8, N rows x the 16 outputs of half `h` of a block (h = 0: the low nibbles, outputs 0-15; h = 1: the
   high nibbles, outputs 16-31). wb: the block's [in4][16][4] bytes; sb: its [in/G][32] fp32 scales; xs: each
   row's code sum per group ([ng][N]). Per group: the exact sum of (q + 8) * x, less 8 * sum(x), times the
   group's scale, added in fp32 in group order (one fused multiply-add); the row's scale last: the
   arithmetic of the VNNI kernel. */
#define DEFW4(N) \
static void w4_##N(const int32_t* xq, const int32_t* xs, int64_t in4, int64_t g4, const uint8_t* wb, int h, \
                   const float* sb, const float* sx, uint16_t* y, int64_t out, int64_t o0, int64_t width, \
                   const float* bias) { \
    __m256 f[N][2]; \
    const __m256i lo = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1); \
    const int64_t pf = g_pf_ahead; \
    _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) { f[j][0] = _mm256_setzero_ps(); f[j][1] = _mm256_setzero_ps(); } \
    for (int64_t p0 = 0, g = 0; p0 < in4; p0 += g4, g++) { \
        __m256i a[N][2]; \
        _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) { a[j][0] = _mm256_setzero_si256(); a[j][1] = _mm256_setzero_si256(); } \
        for (int64_t c0 = p0; c0 < p0 + g4; c0 += 8) { /* 8 steps at most in int16 */ \
            int64_t c1 = c0 + 8 < p0 + g4 ? c0 + 8 : p0 + g4; \
            __m256i s[N][2]; \
            _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) { s[j][0] = _mm256_setzero_si256(); s[j][1] = _mm256_setzero_si256(); } \
            for (int64_t p = c0; p < c1; p++) { \
                if (!h) _mm_prefetch((const char*)(wb + p * 64 + pf), _MM_HINT_T0); /* half 1 reads it again */ \
                __m256i v0 = _mm256_loadu_si256((const __m256i*)(wb + p * 64)); \
                __m256i v1 = _mm256_loadu_si256((const __m256i*)(wb + p * 64 + 32)); \
                if (h) { v0 = _mm256_srli_epi16(v0, 4); v1 = _mm256_srli_epi16(v1, 4); } \
                v0 = _mm256_and_si256(v0, lo); v1 = _mm256_and_si256(v1, lo); \
                _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) { __m256i xv = _mm256_set1_epi32(xq[p * N + j]); \
                    s[j][0] = _mm256_add_epi16(s[j][0], _mm256_maddubs_epi16(v0, xv)); \
                    s[j][1] = _mm256_add_epi16(s[j][1], _mm256_maddubs_epi16(v1, xv)); } \
            } \
            _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) { \
                a[j][0] = _mm256_add_epi32(a[j][0], _mm256_madd_epi16(s[j][0], ones)); \
                a[j][1] = _mm256_add_epi32(a[j][1], _mm256_madd_epi16(s[j][1], ones)); } \
        } \
        __m256 s0 = _mm256_loadu_ps(sb + g * OB + 16 * h), s1 = _mm256_loadu_ps(sb + g * OB + 16 * h + 8); \
        _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) { \
            __m256i c = _mm256_set1_epi32(8 * xs[g * N + j]); \
            f[j][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a[j][0], c)), s0, f[j][0]); \
            f[j][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a[j][1], c)), s1, f[j][1]); } \
    } \
    float buf[16]; \
    _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) { \
        _mm256_storeu_ps(buf, f[j][0]); _mm256_storeu_ps(buf + 8, f[j][1]); \
        uint16_t* yr = y + j * out + o0; \
        for (int t = 0; t < 16; t++) { \
            int64_t k = 16 * h + t; \
            if (k >= width) break; \
            yr[k] = f2bf(buf[t] * sx[j] + (bias ? bias[o0 + k] : 0.0f)); } } \
}
DEFW4(1) DEFW4(2) DEFW4(3)
/* w4a8, N rows x all 32 outputs of a block in one pass (both nibbles of a step's bytes, loaded once): the same
   integer sums and float steps per output as w4_N above, so the same results; 1-2 rows 0.8-0.9x the two half
   passes (docs/cpu-kernels.md) */
#define DEFW4F(N) \
static void w4f_##N(const int32_t* xq, const int32_t* xs, int64_t in4, int64_t g4, const uint8_t* wb, \
                    const float* sb, const float* sx, uint16_t* y, int64_t out, int64_t o0, int64_t width, \
                    const float* bias) { \
    __m256 f[N][4]; \
    const __m256i lo = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1); \
    const int64_t pf = g_pf_ahead; \
    _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) \
        for (int v = 0; v < 4; v++) f[j][v] = _mm256_setzero_ps(); \
    for (int64_t p0 = 0, g = 0; p0 < in4; p0 += g4, g++) { \
        __m256i a[N][4]; \
        _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) \
            for (int v = 0; v < 4; v++) a[j][v] = _mm256_setzero_si256(); \
        for (int64_t c0 = p0; c0 < p0 + g4; c0 += 8) { /* 8 steps at most in int16 */ \
            int64_t c1 = c0 + 8 < p0 + g4 ? c0 + 8 : p0 + g4; \
            __m256i s[N][4]; \
            _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) \
                for (int v = 0; v < 4; v++) s[j][v] = _mm256_setzero_si256(); \
            for (int64_t p = c0; p < c1; p++) { \
                _mm_prefetch((const char*)(wb + p * 64 + pf), _MM_HINT_T0); \
                __m256i b0 = _mm256_loadu_si256((const __m256i*)(wb + p * 64)); \
                __m256i b1 = _mm256_loadu_si256((const __m256i*)(wb + p * 64 + 32)); \
                __m256i w[4] = {_mm256_and_si256(b0, lo), _mm256_and_si256(b1, lo), \
                                _mm256_and_si256(_mm256_srli_epi16(b0, 4), lo), \
                                _mm256_and_si256(_mm256_srli_epi16(b1, 4), lo)}; \
                _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) { __m256i xv = _mm256_set1_epi32(xq[p * N + j]); \
                    _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) \
                        s[j][v] = _mm256_add_epi16(s[j][v], _mm256_maddubs_epi16(w[v], xv)); } \
            } \
            _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) for (int v = 0; v < 4; v++) \
                a[j][v] = _mm256_add_epi32(a[j][v], _mm256_madd_epi16(s[j][v], ones)); \
        } \
        _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) { \
            __m256 sv = _mm256_loadu_ps(sb + g * OB + 8 * v); \
            _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) { \
                __m256i c = _mm256_set1_epi32(8 * xs[g * N + j]); \
                f[j][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a[j][v], c)), sv, f[j][v]); } } \
    } \
    float buf[32]; \
    _Pragma("GCC unroll 4") for (int j = 0; j < N; j++) { \
        for (int v = 0; v < 4; v++) _mm256_storeu_ps(buf + 8 * v, f[j][v]); \
        uint16_t* yr = y + j * out + o0; \
        for (int64_t k = 0; k < width; k++) yr[k] = f2bf(buf[k] * sx[j] + (bias ? bias[o0 + k] : 0.0f)); } \
}
DEFW4F(1) DEFW4F(2)
typedef void (*w4fn)(const int32_t*, const int32_t*, int64_t, int64_t, const uint8_t*, int, const float*,
                     const float*, uint16_t*, int64_t, int64_t, int64_t, const float*);
static const w4fn W4[NQ + 1] = {0, w4_1, w4_2, w4_3};

static void w4_tile(const int8_call* c, const int8_rows* q, int64_t b, int64_t j0, int64_t nr, int64_t o0,
                    int64_t width) {
    int64_t in4 = c->in / 4, ng = c->in / c->group;
    if (nr <= 2) { /* one pass over the whole block */
        (nr == 1 ? w4f_1 : w4f_2)(q->xq + j0 * in4, q->xs + j0 * ng, in4, c->group / 4,
                                  (const uint8_t*)c->wq + (size_t)(b * in4 * 64), c->scale + (size_t)(b * ng * OB),
                                  q->sx + j0, c->y + j0 * c->out, c->out, o0, width, c->bias);
        return;
    }
    for (int h = 0; h < 2 && 16 * h < width; h++)
        W4[nr](q->xq + j0 * in4, q->xs + j0 * ng, in4, c->group / 4, (const uint8_t*)c->wq + (size_t)(b * in4 * 64), h,
               c->scale + (size_t)(b * ng * OB), q->sx + j0, c->y + j0 * c->out, c->out, o0, width, c->bias);
}

/* x [n, in] bf16 times w4a8-packed weights (as bf16_linear.c: [ceil(out/32)][in/4][16][4] bytes, scales
   [ceil(out/32)][in/G][32] fp32; in a multiple of group, group a multiple of 4) -> y [n, out] bf16.
   0, or -1 when out of memory. */
int hs_linear_w4a8(const uint16_t* xb, int64_t n, int64_t in, const uint8_t* wq, const float* scale, int64_t group,
                   int64_t out, uint16_t* y, const float* bias, int nthreads) {
    int8_call c = {in, out, group, wq, NULL, scale, y, bias};
    return run_int8(xb, n, NQ, 0, &c, w4_tile, nthreads);
}

/* ---- GGUF-precision weights (hs_gguf.h has the formats) ----
   The AVX2 counterpart of bf16_linear.c's AVX512_VNNI GGUF kernel: the same activation codes (per row and
   group of G inputs), the same exact int32 group sums, and per group the same fp32 operations in the same
   order (the K-quant scale product d * sub-scale, then one multiply and one fused multiply-add, and for the
   min form one fused multiply-subtract), so the two builds agree bit for bit, and a row's result never
   depends on the rows beside it. A pass covers up to NG rows x the 32 outputs of a weight block, in vectors
   of 8 outputs x 4 inputs (outputs 0-7, 8-15: the low nibbles of a step's two 32-byte halves; 16-23, 24-31:
   their high nibbles), all four at once for up to 3 rows of 4- and 6-bit codes (some of their sums then spill,
   which costs less than a second pass's loads, unpacking and broadcasts: docs/cpu-kernels.md), two at a time
   (0 and 2, then 1 and 3: the same bytes) for 4 rows and for 8-bit codes, so that the int16 sums of every row
   stay in registers through a group.
   vpmaddubsw (u8 x s8 -> saturating int16 pair sums) and vpmaddwd by ones (-> int32) make the integer
   sums, with operands chosen so that nothing saturates:
   - 4-bit codes (<= 15): a pair sum is at most 2 * 15 * 127 = 3810, so 8 steps (32 inputs) add up in int16;
   - 6-bit codes (<= 63): at most 2 * 63 * 127 = 16002, so 2 steps add up in int16 (32004);
   - 8-bit codes (0..255): code - 128 as a signed byte times x by the sign trick: |code - 128| (unsigned,
     <= 128) times x carrying the weight's sign (|x| <= 127), a pair sum at most 2 * 128 * 127 = 32512,
     widened every step. sum(code * x) = sum((code - 128) * x) + 128 * sum(x) exactly in int32, so the
     zero point form (code - z) and the min form get the VNNI kernel's integers. */
#include "hs_gguf.h" /* make_gguf_rows, run_gguf, gguf_store */

#define NG 4 /* rows per pass of the GGUF kernels */

static inline __m256 ld8x8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

/* Weight vector v (outputs 8v .. 8v+7 x 4 inputs) of step p of a block (wb: its codes, hb: 6-bit top bits):
   the codes as u8, or for 8 bits code - 128 as s8. B and v are constants where it is inlined. */
static inline __attribute__((always_inline)) __m256i gguf_wv(int B, const uint8_t* wb, const uint8_t* hb,
                                                             int64_t p, int v) {
    if (B == 8) return _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(wb + p * 128 + 32 * v)),
                                        _mm256_set1_epi8((char)0x80));
    __m256i w = _mm256_loadu_si256((const __m256i*)(wb + p * 64 + 32 * (v & 1)));
    w = _mm256_and_si256(v < 2 ? w : _mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0f));
    if (B == 6) { /* lane i of vector v: bits 2v, 2v+1 of top-bit byte i (v = 0, 1, 2, 3 as in hs_gguf.h) */
        __m256i h = _mm256_loadu_si256((const __m256i*)(hb + p * 32));
        h = v == 0 ? _mm256_slli_epi16(h, 4) : v == 1 ? _mm256_slli_epi16(h, 2) : v == 2 ? h : _mm256_srli_epi16(h, 2);
        w = _mm256_or_si256(w, _mm256_and_si256(h, _mm256_set1_epi8(0x30)));
    }
    return w;
}

/* acc + t in int16 (vpaddw), written into acc's register: with _mm256_add_epi16, GCC 12 copies every
   loop-carried sum to another register each step (a third more instructions in the inner loop) */
static inline __attribute__((always_inline)) __m256i add16_to(__m256i acc, __m256i t) {
    __asm__("vpaddw %1, %0, %0" : "+x"(acc) : "x"(t));
    return acc;
}

/* N rows x one weight block; B bits, M the min form; GC the steps of a group (G / 4) where the function is
   made for one group size (a loop of known length), else 0. The output vectors are taken V at a time. */
#define DEFG(N, B, M, GC) \
static void g##B##M##_##GC##_##N(const gguf_call* c, const gguf_rows* q, int64_t b, int64_t j0) { \
    enum { V = N == 1 || (B != 8 && N <= 3) ? 4 : 2 }; \
    const int64_t in4 = c->in / 4, g4 = GC ? GC : c->G / 4, ng = c->in / c->G, o0 = b * OB; \
    const int64_t width = c->out - o0 < OB ? c->out - o0 : OB; \
    const int64_t R = B == 4 ? 8 : B == 6 ? 2 : 1; /* steps summed in int16 before widening */ \
    GGUF_BLOCK_PTRS(B, M) \
    const __m256i ones = _mm256_set1_epi16(1); \
    const int64_t pf = g_pf_ahead; \
    float acc[N][OB]; \
    memset(acc, 0, sizeof(acc)); \
    for (int64_t g = 0, sub = 0, gi = 0; g < ng; g++) { /* group g is group gi of K-quant super-block sub */ \
        const int64_t p0 = g * g4, pe = p0 + g4; \
        _Pragma("GCC unroll 4") for (int sw = 0; sw < 4 / V; sw++) { \
            __m256i a[N][V]; \
            _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) \
                _Pragma("GCC unroll 4") for (int k = 0; k < V; k++) a[j][k] = _mm256_setzero_si256(); \
            for (int64_t c0 = p0; c0 < pe; c0 += R) { \
                const int64_t c1 = c0 + R < pe ? c0 + R : pe; \
                __m256i s[N][V]; \
                _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) \
                    _Pragma("GCC unroll 4") for (int k = 0; k < V; k++) s[j][k] = _mm256_setzero_si256(); \
                int64_t p = c0; \
                _Pragma("GCC unroll 1") do { \
                    if (sw == 0) { /* the first pass over a step streams its weights: fetch ahead */ \
                        _mm_prefetch((const char*)(wb + p * (B == 8 ? 128 : 64) + pf), _MM_HINT_T0); \
                        if (B == 8) _mm_prefetch((const char*)(wb + p * 128 + 64 + pf), _MM_HINT_T0); \
                        if (B == 6 && (p & 1) == 0) _mm_prefetch((const char*)(hb + p * 32 + pf / 2), _MM_HINT_T0); } \
                    _Pragma("GCC unroll 4") for (int k = 0; k < V; k++) { \
                        __m256i w = gguf_wv(B, wb, hb, p, sw + k * (4 / V)), u = B == 8 ? _mm256_abs_epi8(w) : w; \
                        _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) { \
                            __m256i xv = _mm256_set1_epi32(xq[p * N + j]); \
                            s[j][k] = add16_to(s[j][k], _mm256_maddubs_epi16(u, B == 8 ? _mm256_sign_epi8(xv, w) : xv)); } } \
                } while (++p < c1); \
                _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) \
                    _Pragma("GCC unroll 4") for (int k = 0; k < V; k++) \
                        a[j][k] = _mm256_add_epi32(a[j][k], _mm256_madd_epi16(s[j][k], ones)); \
            } \
            _Pragma("GCC unroll 4") for (int k = 0; k < V; k++) { \
                const int v = sw + k * (4 / V); \
                __m256 sc, mn = _mm256_setzero_ps(); \
                if (two) { \
                    sc = _mm256_mul_ps(_mm256_loadu_ps(db + sub * OB + 8 * v), ld8x8(ssb + g * OB + 8 * v)); \
                    if (M) mn = _mm256_mul_ps(_mm256_loadu_ps(dmb + sub * OB + 8 * v), ld8x8(smb + g * OB + 8 * v)); \
                } else { \
                    sc = _mm256_loadu_ps(sb + g * OB + 8 * v); \
                    if (M) mn = _mm256_loadu_ps(mb + g * OB + 8 * v); \
                } \
                _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) { \
                    __m256 xsv = _mm256_set1_ps(sx[g * N + j]), f = _mm256_loadu_ps(acc[j] + 8 * v); \
                    if (M) { /* sum(code * x) */ \
                        __m256i isum = B == 8 ? _mm256_add_epi32(a[j][k], _mm256_set1_epi32(128 * xs[g * N + j])) : a[j][k]; \
                        f = _mm256_fnmadd_ps(mn, _mm256_set1_ps(mxs[g * N + j]), \
                                             _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isum), sc), xsv, f)); \
                    } else { /* sum((code - zero) * x) */ \
                        __m256i zc = _mm256_set1_epi32((int32_t)(B == 8 ? c->zero - 128 : c->zero) * xs[g * N + j]); \
                        f = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a[j][k], zc)), sc), xsv, f); \
                    } \
                    _mm256_storeu_ps(acc[j] + 8 * v, f); } \
            } \
        } \
        if (two && ++gi == c->per_d) { gi = 0; sub++; } \
    } \
    _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) gguf_store(acc[j], c->y + (j0 + j) * c->out + o0, o0, width, c->bias); \
}
/* every format for any group size and for groups of 32 (all GGUF types but Q6_K, which q6k_N below take) */
#define DEFG_G(B, M, GC) DEFG(1, B, M, GC) DEFG(2, B, M, GC) DEFG(3, B, M, GC) DEFG(4, B, M, GC)
#define DEFG_ALL(B, M) DEFG_G(B, M, 0) DEFG_G(B, M, 8)
DEFG_ALL(4, 0) DEFG_ALL(4, 1) DEFG_ALL(6, 0) DEFG_ALL(6, 1) DEFG_ALL(8, 0) DEFG_ALL(8, 1)
/* Q6_K (6-bit codes, a zero point, groups of 16 inputs = 4 steps): the kernel above for this one shape, with
   the group's steps unrolled, two rounds of two steps in int16 (2 * 63 * 127 * 2 = 32004), the group's int32
   sums in registers, 1-2 rows over all four vectors a pass and 3-4 rows two at a time: the same integers and
   float steps, a sixth to a quarter cheaper from 2-3 rows on (docs/cpu-kernels.md). */
#define DEFQ6(N) \
static void q6k_##N(const gguf_call* c, const gguf_rows* q, int64_t b, int64_t j0) { \
    enum { V = N <= 2 ? 4 : 2 }; \
    const int64_t in4 = c->in / 4, ng = c->in / c->G, o0 = b * OB; \
    const int64_t width = c->out - o0 < OB ? c->out - o0 : OB; \
    GGUF_BLOCK_PTRS(6, 0) \
    (void)mxs; (void)mb; (void)smb; (void)dmb; \
    const __m256i ones = _mm256_set1_epi16(1); \
    const int64_t pf = g_pf_ahead; \
    float acc[N][OB]; \
    memset(acc, 0, sizeof(acc)); \
    for (int64_t g = 0, sub = 0, gi = 0; g < ng; g++) { \
        const int64_t p0 = g * 4; \
        _Pragma("GCC unroll 4") for (int sw = 0; sw < 4 / V; sw++) { \
            __m256i a[N][V]; \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) { \
                __m256i s[N][V]; \
                _Pragma("GCC unroll 2") for (int t = 2 * h; t < 2 * h + 2; t++) { \
                    const int64_t p = p0 + t; \
                    if (sw == 0) { \
                        _mm_prefetch((const char*)(wb + p * 64 + pf), _MM_HINT_T0); \
                        if ((t & 1) == 0) _mm_prefetch((const char*)(hb + p * 32 + pf / 2), _MM_HINT_T0); } \
                    __m256i xv[N]; \
                    _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) xv[j] = _mm256_set1_epi32(xq[p * N + j]); \
                    _Pragma("GCC unroll 4") for (int k = 0; k < V; k++) { \
                        __m256i w = gguf_wv(6, wb, hb, p, sw + k * (4 / V)); \
                        _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) { \
                            __m256i m = _mm256_maddubs_epi16(w, xv[j]); \
                            s[j][k] = (t & 1) ? add16_to(s[j][k], m) : m; } } \
                } \
                _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) \
                    _Pragma("GCC unroll 4") for (int k = 0; k < V; k++) { \
                        __m256i m = _mm256_madd_epi16(s[j][k], ones); \
                        a[j][k] = h ? _mm256_add_epi32(a[j][k], m) : m; } \
            } \
            _Pragma("GCC unroll 4") for (int k = 0; k < V; k++) { \
                const int v = sw + k * (4 / V); \
                __m256 sc = two ? _mm256_mul_ps(_mm256_loadu_ps(db + sub * OB + 8 * v), ld8x8(ssb + g * OB + 8 * v)) \
                                : _mm256_loadu_ps(sb + g * OB + 8 * v); \
                _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) { \
                    __m256 xsv = _mm256_set1_ps(sx[g * N + j]), f = _mm256_loadu_ps(acc[j] + 8 * v); \
                    __m256i isum = _mm256_sub_epi32(a[j][k], _mm256_set1_epi32((int32_t)c->zero * xs[g * N + j])); \
                    f = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isum), sc), xsv, f); \
                    _mm256_storeu_ps(acc[j] + 8 * v, f); } \
            } \
        } \
        if (two && ++gi == c->per_d) { gi = 0; sub++; } \
    } \
    _Pragma("GCC unroll 8") for (int j = 0; j < N; j++) \
        gguf_store(acc[j], c->y + (j0 + j) * c->out + o0, o0, width, c->bias); \
}
DEFQ6(1) DEFQ6(2) DEFQ6(3) DEFQ6(4)
typedef void (*gfn)(const gguf_call*, const gguf_rows*, int64_t, int64_t);
#define GROWS(B, M, GC) {0, g##B##M##_##GC##_1, g##B##M##_##GC##_2, g##B##M##_##GC##_3, g##B##M##_##GC##_4}
/* [bits 4, 6, 8][zero point, min][groups of any size, of 16, of 32][rows] */
static const gfn GK[3][2][3][NG + 1] = {
    {{GROWS(4, 0, 0), GROWS(4, 0, 0), GROWS(4, 0, 8)}, {GROWS(4, 1, 0), GROWS(4, 1, 0), GROWS(4, 1, 8)}},
    {{GROWS(6, 0, 0), GROWS(6, 0, 0), GROWS(6, 0, 8)}, {GROWS(6, 1, 0), GROWS(6, 1, 0), GROWS(6, 1, 8)}},
    {{GROWS(8, 0, 0), GROWS(8, 0, 0), GROWS(8, 0, 8)}, {GROWS(8, 1, 0), GROWS(8, 1, 0), GROWS(8, 1, 8)}}};

static const gfn Q6K[NG + 1] = {0, q6k_1, q6k_2, q6k_3, q6k_4};

static void g_tile(const gguf_call* c, const gguf_rows* q, int64_t b, int64_t j0, int64_t nr) {
    int m = c->mn != NULL || c->dmin != NULL, gs = c->G == 16 ? 1 : c->G == 32 ? 2 : 0;
    if (c->bits == 6 && !m && c->G == 16) { Q6K[nr](c, q, b, j0); return; }
    GK[c->bits == 4 ? 0 : c->bits == 6 ? 1 : 2][m][gs][nr](c, q, b, j0);
}

/* hs_gguf_apply: x [n, in] bf16 times a GGUF-precision weight (hs_gguf.h) -> y [n, out] bf16, with the
   arithmetic of the AVX-512 build */
GGUF_ENTRIES(NG, g_tile)
