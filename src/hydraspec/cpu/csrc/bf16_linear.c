/* hydraspec: y[n, out] = x[n, in] @ w[out, in]^T (+ bias) for bf16 weights on AVX-512 CPUs.

   CPUs without native bf16 arithmetic (no AVX512_BF16 / AMX) make oneDNN's bf16 GEMM emulate it,
   and its cost then grows with every extra row: exactly what a speculative verify step (a few to a
   few dozen rows) cannot afford. This kernel keeps the weight in bf16, packed once into blocks of
   32 outputs ([out/32][in][32]), widens each weight vector to fp32 with a shift, and multiplies it with
   up to 12 activation rows at a time held as broadcast fp32 scalars (a register-blocked GEMM micro
   kernel: 24 accumulators, two weight vectors per input). One thread streams its own output blocks,
   so the weight is read from memory once per call and re-read from L2 for further row blocks.

   Every (row, output) sum runs over the inputs in order 0..in-1 in fp32, whatever the number of rows
   and whichever block a row falls in, so a row's result does not depend on the rows computed beside it.
   Build: cc -O3 -mavx512f -mavx512bw -mavx512vl -fopenmp -shared -fPIC. */
#ifdef _OPENMP
#include <omp.h>
#endif
#include "hs_common.h" /* OB, f2bf, hs_pack_bf16, run_f32, run_int8 */
#include "hs_ops.h"    /* hs_rmsnorm, hs_attention */
#include "hs_gguf.h"   /* make_gguf_rows, run_gguf */

#define NB 12 /* activation rows per micro-kernel pass */

static inline __m512 ldbf(const void* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m512 ld8(const void* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

/* One pass: rows [0, N) of a row block x all 32 outputs of one packed weight block.
   xt: [in][N] fp32 (the row block transposed); wb: [in][32] weights of type T, widened by LOAD;
   y rows of length `out`; each output is scaled by scale[o] (int8 weights) or not (scale NULL). */
#define DEF(NAME, T, LOAD, N) \
static void NAME##_##N(const float* xt, int64_t in, const void* wv, uint16_t* y, int64_t out, int64_t o0, \
                       int64_t width, const float* scale, const float* bias) { \
    const T* wb = (const T*)wv; \
    __m512 a0[N], a1[N]; \
    _Pragma("GCC unroll 12") for (int j = 0; j < N; j++) { a0[j] = _mm512_setzero_ps(); a1[j] = _mm512_setzero_ps(); } \
    for (int64_t i = 0; i < in; i++) { \
        __m512 w0 = LOAD(wb + i * OB), w1 = LOAD(wb + i * OB + 16); \
        _Pragma("GCC unroll 12") for (int j = 0; j < N; j++) { __m512 xv = _mm512_set1_ps(xt[i * N + j]); \
            a0[j] = _mm512_fmadd_ps(w0, xv, a0[j]); a1[j] = _mm512_fmadd_ps(w1, xv, a1[j]); } \
    } \
    float buf[OB]; \
    _Pragma("GCC unroll 12") for (int j = 0; j < N; j++) { \
        _mm512_storeu_ps(buf, a0[j]); _mm512_storeu_ps(buf + 16, a1[j]); \
        uint16_t* yr = y + j * out + o0; \
        for (int64_t k = 0; k < width; k++) { \
            float v = scale ? buf[k] * scale[o0 + k] : buf[k]; \
            yr[k] = f2bf(v + (bias ? bias[o0 + k] : 0.0f)); } } \
}
#define DEFALL(NAME, T, LOAD) \
    DEF(NAME, T, LOAD, 1) DEF(NAME, T, LOAD, 2) DEF(NAME, T, LOAD, 3) DEF(NAME, T, LOAD, 4) \
    DEF(NAME, T, LOAD, 5) DEF(NAME, T, LOAD, 6) DEF(NAME, T, LOAD, 7) DEF(NAME, T, LOAD, 8) \
    DEF(NAME, T, LOAD, 9) DEF(NAME, T, LOAD, 10) DEF(NAME, T, LOAD, 11) DEF(NAME, T, LOAD, 12)
DEFALL(mk, uint16_t, ldbf)
DEFALL(mq, int8_t, ld8)
typedef void (*mkfn)(const float*, int64_t, const void*, uint16_t*, int64_t, int64_t, int64_t, const float*,
                     const float*);
static const mkfn MK[NB + 1] = {0, mk_1, mk_2, mk_3, mk_4, mk_5, mk_6, mk_7, mk_8, mk_9, mk_10, mk_11, mk_12};
static const mkfn MQ[NB + 1] = {0, mq_1, mq_2, mq_3, mq_4, mq_5, mq_6, mq_7, mq_8, mq_9, mq_10, mq_11, mq_12};

/* CPUs with AVX512_BF16 (vdpbf16ps): the weight is packed in input pairs, [out/32][in/2][32][2] bf16,
   so that one instruction multiplies 16 outputs x 2 inputs with a broadcast bf16 pair of one activation
   row and adds both products to fp32 accumulators: twice the arithmetic of fp32 FMA per instruction,
   on bf16 activations as they are (no widening pass). The sums still run over the input pairs in
   order, the same for every row whatever the rows beside it, so a row's result stays independent of
   the batch; it differs from the fp32 kernel by the pairwise rounding of vdpbf16ps. */
#define BF16DP __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define DEFDP(N) \
BF16DP static void dp_##N(const uint32_t* xt, int64_t pairs, const uint16_t* wb, uint16_t* y, int64_t out, \
                          int64_t o0, int64_t width, const float* bias) { \
    __m512 a0[N], a1[N]; \
    _Pragma("GCC unroll 12") for (int j = 0; j < N; j++) { a0[j] = _mm512_setzero_ps(); a1[j] = _mm512_setzero_ps(); } \
    for (int64_t p = 0; p < pairs; p++) { \
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + p * 2 * OB), w1 = (__m512bh)_mm512_loadu_si512(wb + p * 2 * OB + OB); \
        _Pragma("GCC unroll 12") for (int j = 0; j < N; j++) { __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xt[p * N + j]); \
            a0[j] = _mm512_dpbf16_ps(a0[j], w0, xv); a1[j] = _mm512_dpbf16_ps(a1[j], w1, xv); } \
    } \
    float buf[OB]; \
    _Pragma("GCC unroll 12") for (int j = 0; j < N; j++) { \
        _mm512_storeu_ps(buf, a0[j]); _mm512_storeu_ps(buf + 16, a1[j]); \
        uint16_t* yr = y + j * out + o0; \
        for (int64_t k = 0; k < width; k++) yr[k] = f2bf(buf[k] + (bias ? bias[o0 + k] : 0.0f)); } \
}
DEFDP(1) DEFDP(2) DEFDP(3) DEFDP(4) DEFDP(5) DEFDP(6) DEFDP(7) DEFDP(8) DEFDP(9) DEFDP(10) DEFDP(11) DEFDP(12)
typedef void (*dpfn)(const uint32_t*, int64_t, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t, const float*);
static const dpfn DP[NB + 1] = {0, dp_1, dp_2, dp_3, dp_4, dp_5, dp_6, dp_7, dp_8, dp_9, dp_10, dp_11, dp_12};

/* w [out, in] bf16 -> wp [ceil(out/32)][ceil(in/2)][32][2] bf16 (input pairs), zero padded */
void hs_pack_bf16_pairs(const uint16_t* w, int64_t out, int64_t in, uint16_t* wp) {
    int64_t nblk = (out + OB - 1) / OB, pairs = (in + 1) / 2;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblk; b++)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t k = 0; k < OB; k++)
                for (int64_t h = 0; h < 2; h++) {
                    int64_t o = b * OB + k, i = 2 * p + h;
                    wp[((b * pairs + p) * OB + k) * 2 + h] = (o < out && i < in) ? w[o * in + i] : 0;
                }
}

/* x [n, in] bf16 times weights packed by hs_pack_bf16_pairs -> y [n, out] bf16. 0, or -1 when out of memory. */
int hs_linear_bf16_pairs(const uint16_t* xb, int64_t n, int64_t in, const uint16_t* wp, int64_t out,
                         uint16_t* y, const float* bias, int nthreads) {
    int64_t nrb = (n + NB - 1) / NB, pairs = (in + 1) / 2;
    uint32_t* xt = (uint32_t*)malloc((size_t)(nrb * NB * pairs) * sizeof(uint32_t));
    if (!xt) return -1;
    for (int64_t r = 0; r < nrb; r++) { /* row block r: [pairs][nr] bf16 pairs */
        int64_t j0 = r * NB, nr = n - j0 < NB ? n - j0 : NB;
        uint32_t* dst = xt + r * NB * pairs;
        for (int64_t j = 0; j < nr; j++) {
            const uint16_t* src = xb + (j0 + j) * in;
            for (int64_t p = 0; p < pairs; p++) {
                uint32_t lo = src[2 * p], hi = 2 * p + 1 < in ? src[2 * p + 1] : 0;
                dst[p * nr + j] = lo | (hi << 16);
            }
        }
    }
    int64_t nblk = (out + OB - 1) / OB;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < nblk; b++) {
        int64_t o0 = b * OB, width = out - o0 < OB ? out - o0 : OB;
        const uint16_t* wb = wp + (size_t)(b * pairs * 2 * OB);
        for (int64_t r = 0; r < nrb; r++) {
            int64_t j0 = r * NB, nr = n - j0 < NB ? n - j0 : NB;
            DP[nr](xt + r * NB * pairs, pairs, wb, y + j0 * out, out, o0, width, bias);
        }
    }
    free(xt);
    return 0;
}

/* one pass of the micro kernel: rows j0 .. j0+nr-1 x all 32 outputs of a weight block */
static void mk_tile(const f32_call* c, const float* xt, const char* wb, int64_t j0, int64_t nr, int64_t o0,
                    int64_t width) {
    ((const mkfn*)c->kern)[nr](xt, c->in, wb, c->y + j0 * c->out, c->out, o0, width, c->scale, c->bias);
}

/* x [n, in] bf16 times packed weights wp ([ceil(out/32)][in][32], element size esize) -> y [n, out] bf16 */
static int run(const mkfn* kern, size_t esize, const uint16_t* xb, int64_t n, int64_t in, const void* wp,
               const float* scale, int64_t out, uint16_t* y, const float* bias, int nthreads) {
    f32_call c = {in, out, wp, esize, scale, y, bias, kern};
    return run_f32(xb, n, NB, &c, mk_tile, nthreads);
}

/* bf16 weights packed by hs_pack_bf16; bias [out] fp32 or NULL. Returns 0, or -1 when out of memory. */
int hs_linear_bf16(const uint16_t* xb, int64_t n, int64_t in, const uint16_t* wp, int64_t out,
                   uint16_t* y, const float* bias, int nthreads) {
    return run(MK, sizeof(uint16_t), xb, n, in, wp, NULL, out, y, bias, nthreads);
}

/* int8 weights (per-output scale), for draft models: half the bytes of bf16 per token.
   wq: [ceil(out/32)][in][32] int8 (zero padded), scale: [out] fp32; y = (x @ wq^T) * scale (+ bias).
   Same blocking and the same in-order fp32 summation as the bf16 kernel. */
int hs_linear_i8(const uint16_t* xb, int64_t n, int64_t in, const int8_t* wq, const float* scale, int64_t out,
                 uint16_t* y, const float* bias, int nthreads) {
    return run(MQ, sizeof(int8_t), xb, n, in, wq, scale, out, y, bias, nthreads);
}

/* int8 weights x int8 activations on CPUs with AVX512_VNNI ("w8a8", draft models): each activation row is
   quantised to int8 with its own scale (absmax/127, round half to even) and stored as u8 = q + 128;
   vpdpbusd multiplies 4 u8 activations with 4 int8 weights of each of 16 outputs and adds the products to
   int32 accumulators: 64 multiply-adds an instruction, against 16 for fp32 FMA. The +128 offset is taken
   out with the weights' precomputed sums (wsum[o] = 128 * sum_i w[o][i]). Integer sums are exact, so a
   row's result never depends on the rows beside it.
   wq: [ceil(out/32)][in4][32][4] int8 (in4 = ceil(in/4), zero padded); scale: [out] fp32 (per output). */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
/* acc += u8 x s8 dot products in place: GCC 12 otherwise copies every accumulator in and out of the loop */
#define DPBUSD(acc, u, s) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s))
#define DEFVN(N) \
VNNI static void vn_##N(const int32_t* xq, int64_t in4, const int8_t* wb, const int32_t* wsum, const float* sx, \
                        const float* scale, uint16_t* y, int64_t out, int64_t o0, int64_t width, const float* bias) { \
    __m512i a0[N], a1[N]; \
    _Pragma("GCC unroll 12") for (int j = 0; j < N; j++) { a0[j] = _mm512_setzero_si512(); a1[j] = _mm512_setzero_si512(); } \
    for (int64_t p = 0; p < in4; p++) { \
        __m512i w0 = _mm512_loadu_si512(wb + p * 4 * OB), w1 = _mm512_loadu_si512(wb + p * 4 * OB + 64); \
        _Pragma("GCC unroll 12") for (int j = 0; j < N; j++) { __m512i xv = _mm512_set1_epi32(xq[p * N + j]); \
            DPBUSD(a0[j], xv, w0); DPBUSD(a1[j], xv, w1); } \
    } \
    int32_t buf[OB]; \
    _Pragma("GCC unroll 12") for (int j = 0; j < N; j++) { \
        _mm512_storeu_si512(buf, a0[j]); _mm512_storeu_si512(buf + 16, a1[j]); \
        uint16_t* yr = y + j * out + o0; \
        for (int64_t k = 0; k < width; k++) { \
            float v = (float)(buf[k] - wsum[o0 + k]) * sx[j] * scale[o0 + k]; \
            yr[k] = f2bf(v + (bias ? bias[o0 + k] : 0.0f)); } } \
}
DEFVN(1) DEFVN(2) DEFVN(3) DEFVN(4) DEFVN(5) DEFVN(6) DEFVN(7) DEFVN(8) DEFVN(9) DEFVN(10) DEFVN(11) DEFVN(12)
typedef void (*vnfn)(const int32_t*, int64_t, const int8_t*, const int32_t*, const float*, const float*, uint16_t*,
                     int64_t, int64_t, int64_t, const float*);
static const vnfn VN[NB + 1] = {0, vn_1, vn_2, vn_3, vn_4, vn_5, vn_6, vn_7, vn_8, vn_9, vn_10, vn_11, vn_12};

static void vn_tile(const int8_call* c, const int8_rows* q, int64_t b, int64_t j0, int64_t nr, int64_t o0,
                    int64_t width) {
    int64_t in4 = (c->in + 3) / 4;
    VN[nr](q->xq + j0 * in4, in4, (const int8_t*)c->wq + (size_t)(b * in4 * 4 * OB), c->wsum, q->sx + j0, c->scale,
           c->y + j0 * c->out, c->out, o0, width, c->bias);
}

/* x [n, in] bf16 times w8a8-packed int8 weights -> y [n, out] bf16. 0, or -1 when out of memory. */
int hs_linear_w8a8(const uint16_t* xb, int64_t n, int64_t in, const int8_t* wq, const int32_t* wsum,
                   const float* scale, int64_t out, uint16_t* y, const float* bias, int nthreads) {
    int8_call c = {in, out, 0, wq, wsum, scale, y, bias};
    return run_int8(xb, n, NB, 128, &c, vn_tile, nthreads);
}

/* 4-bit weights x int8 activations with AVX512_VNNI ("w4a8", draft models): half the weight bytes of int8
   and the integer arithmetic of w8a8. Weights: symmetric 4-bit, one fp32 scale per output and group of G
   inputs, stored as q + 8 in 0..15, which is vpdpbusd's unsigned operand; activations: int8 per row
   (scale absmax/127), the signed operand. Per group the exact int32 sum of (q + 8) * x, less 8 * sum(x),
   is scaled by the group's scale and added to an fp32 total in group order; the row's scale comes last.
   wq: [ceil(out/32)][in/4][16][4] bytes: byte 4k+t of step p holds input 4p+t of output k (low nibble) and
   of output k + 16 (high nibble); scale: [ceil(out/32)][in/G][32] fp32. Rows are independent. */
#define NB4 6
/* Step p (4 inputs of 32 outputs) of a packed 4-bit weight block at wb, or 6-bit (six) with its top bits at hb,
   as two vectors of codes: w0 for outputs 0-15, w1 for 16-31, four inputs to a 32-bit lane */
static inline void unpack_step(const uint8_t* wb, const uint8_t* hb, int six, int64_t p, __m512i* w0, __m512i* w1) {
    const __m512i lo = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    const __m512i v = _mm512_loadu_si512(wb + p * 64);
    *w0 = _mm512_and_si512(v, lo);
    *w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
    if (six) {
        const __m256i h = _mm256_loadu_si256((const __m256i*)(hb + p * 32));
        const __m512i hv = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
        *w0 = _mm512_or_si512(*w0, _mm512_and_si512(_mm512_slli_epi16(hv, 4), top));
        *w1 = _mm512_or_si512(*w1, _mm512_and_si512(hv, top));
    }
}

#define DEFW4(N) \
VNNI static void w4_##N(const int32_t* xq, const int32_t* xs, int64_t in4, int64_t g4, const uint8_t* wb, \
                        const float* sb, const float* sx, uint16_t* y, int64_t out, int64_t o0, int64_t width, \
                        const float* bias) { \
    const int64_t pf = g_pf_ahead; \
    __m512 f0[N], f1[N]; \
    _Pragma("GCC unroll 6") for (int j = 0; j < N; j++) { f0[j] = _mm512_setzero_ps(); f1[j] = _mm512_setzero_ps(); } \
    for (int64_t p0 = 0, g = 0; p0 < in4; p0 += g4, g++) { \
        __m512i a0[N], a1[N]; \
        _Pragma("GCC unroll 6") for (int j = 0; j < N; j++) { a0[j] = _mm512_setzero_si512(); a1[j] = _mm512_setzero_si512(); } \
        for (int64_t p = p0; p < p0 + g4; p++) { \
            _mm_prefetch((const char*)(wb + p * 64 + pf), _MM_HINT_T0); \
            __m512i w0, w1; \
            unpack_step(wb, NULL, 0, p, &w0, &w1); \
            _Pragma("GCC unroll 6") for (int j = 0; j < N; j++) { __m512i xv = _mm512_set1_epi32(xq[p * N + j]); \
                DPBUSD(a0[j], w0, xv); DPBUSD(a1[j], w1, xv); } \
        } \
        __m512 s0 = _mm512_loadu_ps(sb + g * OB), s1 = _mm512_loadu_ps(sb + g * OB + 16); \
        _Pragma("GCC unroll 6") for (int j = 0; j < N; j++) { \
            __m512i c = _mm512_set1_epi32(8 * xs[g * N + j]); \
            f0[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a0[j], c)), s0, f0[j]); \
            f1[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a1[j], c)), s1, f1[j]); } \
    } \
    float buf[OB]; \
    _Pragma("GCC unroll 6") for (int j = 0; j < N; j++) { \
        _mm512_storeu_ps(buf, f0[j]); _mm512_storeu_ps(buf + 16, f1[j]); \
        uint16_t* yr = y + j * out + o0; \
        for (int64_t k = 0; k < width; k++) yr[k] = f2bf(buf[k] * sx[j] + (bias ? bias[o0 + k] : 0.0f)); } \
}
DEFW4(1) DEFW4(2) DEFW4(3) DEFW4(4) DEFW4(5) DEFW4(6)
typedef void (*w4fn)(const int32_t*, const int32_t*, int64_t, int64_t, const uint8_t*, const float*, const float*,
                     uint16_t*, int64_t, int64_t, int64_t, const float*);
static const w4fn W4[NB4 + 1] = {0, w4_1, w4_2, w4_3, w4_4, w4_5, w4_6};

static void w4_tile(const int8_call* c, const int8_rows* q, int64_t b, int64_t j0, int64_t nr, int64_t o0,
                    int64_t width) {
    int64_t in4 = c->in / 4, ng = c->in / c->group;
    W4[nr](q->xq + j0 * in4, q->xs + j0 * ng, in4, c->group / 4, (const uint8_t*)c->wq + (size_t)(b * in4 * 64),
           c->scale + (size_t)(b * ng * OB), q->sx + j0, c->y + j0 * c->out, c->out, o0, width, c->bias);
}

/* x [n, in] bf16 times w4a8-packed weights (in a multiple of group, group a multiple of 4) -> y [n, out] bf16.
   0, or -1 when out of memory. */
int hs_linear_w4a8(const uint16_t* xb, int64_t n, int64_t in, const uint8_t* wq, const float* scale, int64_t group,
                   int64_t out, uint16_t* y, const float* bias, int nthreads) {
    int8_call c = {in, out, group, wq, NULL, scale, y, bias};
    return run_int8(xb, n, NB4, 0, &c, w4_tile, nthreads);
}

/* GGUF-precision weights x int8 activations with AVX512_VNNI (hs_gguf.h has the formats): per group of G
   inputs, vpdpbusd sums code * x exactly in int32 (codes are its unsigned operand, activations the signed
   one); the group's sum is then scaled, zero point or min taken out, and added to an fp32 total in group
   order. */
#define NBG 12
#define DEFG(N, B, M) \
VNNI static void g##B##M##_##N(const gguf_call* c, const gguf_rows* q, int64_t b, int64_t j0) { \
    int64_t in4 = c->in / 4, g4 = c->G / 4, ng = c->in / c->G, o0 = b * OB; \
    int64_t width = c->out - o0 < OB ? c->out - o0 : OB; \
    GGUF_BLOCK_PTRS(B, M) \
    const int64_t pf = g_pf_ahead; \
    __m512 d0 = _mm512_setzero_ps(), d1 = d0, dm0 = d0, dm1 = d0; \
    __m512 f0[N], f1[N]; \
    _Pragma("GCC unroll 12") for (int j = 0; j < N; j++) { f0[j] = _mm512_setzero_ps(); f1[j] = _mm512_setzero_ps(); } \
    for (int64_t g = 0; g < ng; g++) { \
        __m512i a0[N], a1[N]; \
        _Pragma("GCC unroll 12") for (int j = 0; j < N; j++) { a0[j] = _mm512_setzero_si512(); a1[j] = _mm512_setzero_si512(); } \
        for (int64_t p = g * g4; p < (g + 1) * g4; p++) { \
            __m512i w0, w1; \
            _mm_prefetch((const char*)(wb + p * (B == 8 ? 128 : 64) + pf), _MM_HINT_T0); \
            if (B == 8) _mm_prefetch((const char*)(wb + p * 128 + 64 + pf), _MM_HINT_T0); \
            if (B == 6 && (p & 1) == 0) _mm_prefetch((const char*)(hb + p * 32 + pf / 2), _MM_HINT_T0); \
            if (B != 8) unpack_step(wb, hb, B == 6, p, &w0, &w1); \
            else { w0 = _mm512_loadu_si512(wb + p * 128); w1 = _mm512_loadu_si512(wb + p * 128 + 64); } \
            _Pragma("GCC unroll 12") for (int j = 0; j < N; j++) { __m512i xv = _mm512_set1_epi32(xq[p * N + j]); \
                DPBUSD(a0[j], w0, xv); DPBUSD(a1[j], w1, xv); } \
        } \
        __m512 s0, s1, m0 = _mm512_setzero_ps(), m1 = m0; \
        if (two) { \
            if (g % c->per_d == 0) { int64_t at = (g / c->per_d) * OB; \
                d0 = _mm512_loadu_ps(db + at); d1 = _mm512_loadu_ps(db + at + 16); \
                if (M) { dm0 = _mm512_loadu_ps(dmb + at); dm1 = _mm512_loadu_ps(dmb + at + 16); } } \
            s0 = _mm512_mul_ps(d0, ld8(ssb + g * OB)); s1 = _mm512_mul_ps(d1, ld8(ssb + g * OB + 16)); \
            if (M) { m0 = _mm512_mul_ps(dm0, ld8(smb + g * OB)); m1 = _mm512_mul_ps(dm1, ld8(smb + g * OB + 16)); } \
        } else { \
            s0 = _mm512_loadu_ps(sb + g * OB); s1 = _mm512_loadu_ps(sb + g * OB + 16); \
            if (M) { m0 = _mm512_loadu_ps(mb + g * OB); m1 = _mm512_loadu_ps(mb + g * OB + 16); } \
        } \
        if (M) { \
            _Pragma("GCC unroll 12") for (int j = 0; j < N; j++) { \
                __m512 sv = _mm512_set1_ps(sx[g * N + j]), mv = _mm512_set1_ps(mxs[g * N + j]); \
                f0[j] = _mm512_fnmadd_ps(m0, mv, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a0[j]), s0), sv, f0[j])); \
                f1[j] = _mm512_fnmadd_ps(m1, mv, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a1[j]), s1), sv, f1[j])); } \
        } else { \
            _Pragma("GCC unroll 12") for (int j = 0; j < N; j++) { \
                __m512 sv = _mm512_set1_ps(sx[g * N + j]); \
                __m512i zc = _mm512_set1_epi32((int32_t)c->zero * xs[g * N + j]); \
                f0[j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a0[j], zc)), s0), sv, f0[j]); \
                f1[j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a1[j], zc)), s1), sv, f1[j]); } \
        } \
    } \
    float buf[OB]; \
    _Pragma("GCC unroll 12") for (int j = 0; j < N; j++) { \
        _mm512_storeu_ps(buf, f0[j]); _mm512_storeu_ps(buf + 16, f1[j]); \
        gguf_store(buf, c->y + (j0 + j) * c->out + o0, o0, width, c->bias); } \
}
#define DEFG_ALL(B, M) DEFG(1, B, M) DEFG(2, B, M) DEFG(3, B, M) DEFG(4, B, M) DEFG(5, B, M) DEFG(6, B, M) \
    DEFG(7, B, M) DEFG(8, B, M) DEFG(9, B, M) DEFG(10, B, M) DEFG(11, B, M) DEFG(12, B, M)
DEFG_ALL(4, 0) DEFG_ALL(4, 1) DEFG_ALL(6, 0) DEFG_ALL(6, 1) DEFG_ALL(8, 0) DEFG_ALL(8, 1)
typedef void (*gfn)(const gguf_call*, const gguf_rows*, int64_t, int64_t);
/* one table per weight form: the kernel for 1 .. NBG rows */
#define GTAB(BM) {0, g##BM##_1, g##BM##_2, g##BM##_3, g##BM##_4, g##BM##_5, g##BM##_6, \
                  g##BM##_7, g##BM##_8, g##BM##_9, g##BM##_10, g##BM##_11, g##BM##_12}
static const gfn G40[NBG + 1] = GTAB(40), G41[NBG + 1] = GTAB(41), G60[NBG + 1] = GTAB(60),
                 G61[NBG + 1] = GTAB(61), G80[NBG + 1] = GTAB(80), G81[NBG + 1] = GTAB(81);

static void g_tile(const gguf_call* c, const gguf_rows* q, int64_t b, int64_t j0, int64_t nr) {
    int m = c->mn != NULL || c->dmin != NULL;
    const gfn* t = c->bits == 4 ? (m ? G41 : G40) : c->bits == 6 ? (m ? G61 : G60) : (m ? G81 : G80);
    t[nr](c, q, b, j0);
}

/* Weight block b of a 4- or 6-bit call unpacked to the 8-bit layout ([in/4][32][4] codes, hs_gguf.h): the
   codes the kernels above take from the packed bytes at every pass, taken once */
static void unpack_block(const gguf_call* c, int64_t b, uint8_t* out) {
    const int64_t in4 = c->in / 4;
    const uint8_t* wb = c->wq + (size_t)(b * in4 * 64);
    const uint8_t* hb = c->bits == 6 ? c->wh + (size_t)(b * in4 * 32) : NULL;
    for (int64_t p = 0; p < in4; p++) {
        __m512i w0, w1;
        unpack_step(wb, hb, c->bits == 6, p, &w0, &w1);
        _mm512_storeu_si512(out + p * 128, w0);
        _mm512_storeu_si512(out + p * 128 + 64, w1);
    }
}

/* A prompt's rows (more than two passes over each weight block) on a 4- or 6-bit weight: each thread unpacks a
   block once into its own buffer and runs the 8-bit kernels of the same scale form over it, pass after pass.
   The same integer sums and the same float steps as the packed kernels: the same outputs bit for bit. */
static int run_gguf_unpacked(const uint16_t* xb, int64_t n, int64_t nb, const gguf_call* c, int nthreads) {
    gguf_rows q;
    if (make_gguf_rows(xb, n, c->in, c->G, nb, &q, nthreads)) return -1;
    const int m = c->mn != NULL || c->dmin != NULL;
    const gfn* t = m ? G81 : G80;
    const int64_t nrb = (n + nb - 1) / nb, nblk = (c->out + OB - 1) / OB, in4 = c->in / 4;
    int err = 0;
    hs_schedule(nblk, nthreads);
    #pragma omp parallel num_threads(nthreads)
    {
        uint8_t* buf = (uint8_t*)aligned_alloc(64, (size_t)(in4 * 128));
        if (!buf) {
            #pragma omp atomic write
            err = 1;
        }
        #pragma omp for schedule(runtime)
        for (int64_t b = 0; b < nblk; b++) {
            if (!buf) continue;
            unpack_block(c, b, buf);
            gguf_call u = *c; /* block b's codes at buf, where the 8-bit kernels look for them */
            u.bits = 8;
            u.wq = (const uint8_t*)((uintptr_t)buf - (uintptr_t)(b * in4 * 128));
            for (int64_t r = 0, first, nr; r < nrb; r++) {
                row_block(n, nb, r, &first, &nr);
                t[nr](&u, &q, b, first);
            }
        }
        free(buf);
    }
    free_gguf_rows(&q);
    return err ? -1 : 0;
}

/* hs_gguf_apply: x [n, in] bf16 times a GGUF-precision weight (hs_gguf.h) -> y [n, out] bf16; a prompt's rows
   on a 6-bit weight by run_gguf_unpacked (4-bit weights are quicker packed: docs/cpu-kernels.md) */
int hs_gguf_apply(const uint16_t* xb, int64_t n, const gguf_call* w, uint16_t* y, int nthreads) {
    gguf_call c = *w;
    c.y = y;
    const int64_t nb = pass_rows(NBG, c.in);
    if (c.bits == 6 && n > 2 * nb) return run_gguf_unpacked(xb, n, nb, &c, nthreads);
    return run_gguf(xb, n, nb, &c, g_tile, nthreads);
}
