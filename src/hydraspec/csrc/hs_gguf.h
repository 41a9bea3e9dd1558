/* hydraspec: the plain-C half of the GGUF-precision matmul shared by both builds (bf16_linear.c, avx2_linear.c).

   A GGUF weight is held as it is in the file: unsigned integer codes (4-bit, two to a byte, or 8-bit), one
   fp32 scale per output and group of G inputs, and either an integer zero point z (w = scale * (code - z):
   Q8_0, Q6_K, Q5_0, Q4_0) or one fp32 min per output and group (w = scale * code - min: Q4_K, Q5_K, Q4_1).
   Activations are quantised to int8 per row and per group of G inputs (absmax/127, round half to even), as
   llama.cpp quantises them per block. A group's integer sum of code * x is exact, so each row's result
   depends on that row alone. K-quants keep two levels instead of sc / mn: an fp32 d (and dmin) per output
   and super-block of per_d groups, times an int8 sub-scale (and sub-min) per output and group, multiplied
   in fp32 as gguf-py does.

   Packed weights: 4-bit [ceil(out/32)][in/4][16][4] bytes (byte 4k+t of step p: input 4p+t of output k in the
   low nibble, of output k+16 in the high one); 8-bit [ceil(out/32)][in/4][32][4]; 6-bit (codes below 64)
   the 4-bit layout of the low four bits plus [ceil(out/32)][in/4][32] bytes of the top two: with lane L
   (0..63) standing for byte L of the low nibbles, byte i holds lane i's and lane i+32's top bits of the low
   nibble's output (bits 0-1, 2-3) and of the high nibble's output (bits 4-5, 6-7). Scales and mins:
   [ceil(out/32)][in/G][32] fp32 (sub-scales int8, d and dmin [ceil(out/32)][in/G/per_d][32] fp32). */
#ifndef HS_GGUF_H
#define HS_GGUF_H
#include "hs_common.h"

/* One row block's activations: codes [in4][nr] (four int8 to an int32), and per group [ng][nr]: the row's
   scale sx, its code sum xs, and sx * xs (for the min form). */
typedef struct { int32_t* xq; float* sx; int32_t* xs; float* mxs; } gguf_rows;

static inline void free_gguf_rows(gguf_rows* r) { free(r->xq); free(r->sx); free(r->xs); free(r->mxs); }

/* x [n, in] bf16 (in a multiple of G, G a multiple of 4) -> row blocks of nb rows. 0, or -1 out of memory. */
static int make_gguf_rows(const uint16_t* xb, int64_t n, int64_t in, int64_t G, int64_t nb, gguf_rows* r) {
    int64_t nrb = (n + nb - 1) / nb, in4 = in / 4, ng = in / G, cap = nrb * nb;
    r->xq = (int32_t*)malloc((size_t)(cap * in4) * sizeof(int32_t));
    r->sx = (float*)malloc((size_t)(cap * ng) * sizeof(float));
    r->xs = (int32_t*)malloc((size_t)(cap * ng) * sizeof(int32_t));
    r->mxs = (float*)malloc((size_t)(cap * ng) * sizeof(float));
    int8_t* codes = (int8_t*)malloc((size_t)in);
    if (!r->xq || !r->sx || !r->xs || !r->mxs || !codes) { free_gguf_rows(r); free(codes); return -1; }
    for (int64_t row = 0; row < n; row++) {
        const uint16_t* x = xb + row * in;
        int64_t rb = row / nb, j = row % nb, nr = n - rb * nb < nb ? n - rb * nb : nb;
        for (int64_t g = 0; g < ng; g++) {
            float amax = 0.0f;
            for (int64_t i = g * G; i < (g + 1) * G; i++) {
                float a = bf2f(x[i]);
                a = a < 0 ? -a : a;
                if (a > amax) amax = a;
            }
            float s = amax > 0.0f ? amax / 127.0f : 1.0f;
            int32_t sum = 0;
            for (int64_t i = g * G; i < (g + 1) * G; i++) {
                int q = _mm_cvtss_si32(_mm_set_ss(bf2f(x[i]) / s)); /* round half to even */
                q = q > 127 ? 127 : (q < -127 ? -127 : q);
                codes[i] = (int8_t)q;
                sum += q;
            }
            int64_t at = rb * nb * ng + g * nr + j;
            r->sx[at] = s;
            r->xs[at] = sum;
            r->mxs[at] = s * (float)sum;
        }
        for (int64_t p = 0; p < in4; p++) memcpy(r->xq + rb * nb * in4 + p * nr + j, codes + 4 * p, 4);
    }
    free(codes);
    return 0;
}

/* One GGUF-precision call: bits 4, 6 or 8; mn NULL for the zero-point form */
typedef struct {
    int64_t in, out, G, bits, zero, per_d;
    const uint8_t* wq;
    const uint8_t* wh; /* 6-bit: the top two bits */
    const float* sc;
    const float* mn;
    const float* d;
    const int8_t* ssc;
    const float* dmin;
    const int8_t* smn;
    uint16_t* y;
    const float* bias;
} gguf_call;

/* rows j0 .. j0+nr-1 x weight block b; the rows' data start at row block j0/nb */
typedef void (*gguf_tile)(const gguf_call* c, const gguf_rows* q, int64_t b, int64_t j0, int64_t nr);

static int run_gguf(const uint16_t* xb, int64_t n, int64_t nb, const gguf_call* c, gguf_tile tile, int nthreads) {
    gguf_rows q;
    if (make_gguf_rows(xb, n, c->in, c->G, nb, &q)) return -1;
    int64_t nrb = (n + nb - 1) / nb, nblk = (c->out + OB - 1) / OB;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < nblk; b++)
        for (int64_t r = 0; r < nrb; r++) tile(c, &q, b, r * nb, n - r * nb < nb ? n - r * nb : nb);
    free_gguf_rows(&q);
    return 0;
}

/* Write one row's 32 fp32 sums (+ bias) as bf16 outputs o0 .. o0+width-1 */
static inline void gguf_store(const float* acc, uint16_t* yr, int64_t o0, int64_t width, const float* bias) {
    for (int64_t k = 0; k < width; k++) yr[k] = f2bf(acc[k] + (bias ? bias[o0 + k] : 0.0f));
}
#endif
