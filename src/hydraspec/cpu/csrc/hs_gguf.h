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

#ifdef __AVX512F__
/* quantize_group for G a multiple of 16 in the AVX-512 build: 16 lanes at a time, the same maximum, divisions and
   roundings, so the same codes, scale and sum */
static inline float quantize_group16(const uint16_t* x, int64_t G, int32_t* words, int64_t stride, int32_t* sum) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    __m512 m = _mm512_setzero_ps();
    for (int64_t i = 0; i < G; i += 16) {
        const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x + i))), 16);
        m = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(u, abs_mask)), m); /* a NaN input is skipped */
    }
    const float amax = _mm512_reduce_max_ps(m);
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    const __m512 sv = _mm512_set1_ps(s);
    const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
    __m512i acc = _mm512_setzero_si512();
    for (int64_t i = 0; i < G; i += 16) {
        const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x + i))), 16);
        __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_castsi512_ps(u), sv)); /* round half to even */
        q = _mm512_max_epi32(_mm512_min_epi32(q, hi), lo);
        acc = _mm512_add_epi32(acc, q);
        const __m128i b8 = _mm512_cvtepi32_epi8(q); /* sixteen int8 in order: four words */
        words[(i / 4) * stride] = _mm_cvtsi128_si32(b8);
        words[(i / 4 + 1) * stride] = _mm_extract_epi32(b8, 1);
        words[(i / 4 + 2) * stride] = _mm_extract_epi32(b8, 2);
        words[(i / 4 + 3) * stride] = _mm_extract_epi32(b8, 3);
    }
    *sum = _mm512_reduce_add_epi32(acc);
    return s;
}
#endif

/* One group of G bf16 inputs (G a multiple of 4) -> int8 codes (round half to even), returns the scale; *sum
   gets the code sum. Inputs 4p .. 4p+3 go to the int32 word words[p * stride] (a row block's interleaving).
   Eight lanes at a time with AVX2 (both builds have it): the same divisions and roundings as one at a time. */
static inline float quantize_group(const uint16_t* x, int64_t G, int32_t* words, int64_t stride, int32_t* sum) {
#ifdef __AVX512F__
    if (G % 16 == 0) return quantize_group16(x, G, words, stride, sum);
#endif
    const float amax = absmax_bf16(x, G);
    int64_t i;
    float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    const __m256 sv = _mm256_set1_ps(s);
    __m256i acc = _mm256_setzero_si256();
    for (i = 0; i + 8 <= G; i += 8) {
        const __m256i q = codes_x8(x + i, sv);
        acc = _mm256_add_epi32(acc, q);
        const __m128i b8 = bytes_x8(q); /* two words */
        words[(i / 4) * stride] = _mm_cvtsi128_si32(b8);
        words[(i / 4 + 1) * stride] = _mm_extract_epi32(b8, 1);
    }
    int32_t q8[8];
    _mm256_storeu_si256((__m256i*)q8, acc);
    int32_t total = q8[0] + q8[1] + q8[2] + q8[3] + q8[4] + q8[5] + q8[6] + q8[7];
    for (int64_t k = i; k < G; k += 4) { /* a last half vector of four */
        uint32_t w = 0;
        for (int t = 0; t < 4; t++) {
            int q = _mm_cvtss_si32(_mm_set_ss(bf2f(x[k + t]) / s));
            q = q > 127 ? 127 : (q < -127 ? -127 : q);
            w |= (uint32_t)(uint8_t)(int8_t)q << (8 * t);
            total += q;
        }
        words[(k / 4) * stride] = (int32_t)w;
    }
    *sum = total;
    return s;
}

/* n rows in ceil(n / nb) blocks of near-equal size (9 rows by 8: 5 + 4, not 8 + 1): block rb's first row and
   size. A row's arithmetic does not depend on its block. */
static inline void row_block(int64_t n, int64_t nb, int64_t rb, int64_t* first, int64_t* size) {
    int64_t nrb = (n + nb - 1) / nb, base = n / nrb, extra = n % nrb;
    *size = base + (rb < extra);
    *first = rb * base + (rb < extra ? rb : extra);
}

/* x [n, in] bf16 (in a multiple of G, G a multiple of 4) -> the row blocks of row_block, each row's codes
   interleaved by 4 inputs within its block; the rows on the threads when there is enough work. 0, or -1 out
   of memory. */
static int make_gguf_rows(const uint16_t* xb, int64_t n, int64_t in, int64_t G, int64_t nb, gguf_rows* r,
                          int nthreads) {
    int64_t nrb = (n + nb - 1) / nb, in4 = in / 4, ng = in / G;
    r->xq = (int32_t*)malloc((size_t)(n * in4) * sizeof(int32_t));
    r->sx = (float*)malloc((size_t)(n * ng) * sizeof(float));
    r->xs = (int32_t*)malloc((size_t)(n * ng) * sizeof(int32_t));
    r->mxs = (float*)malloc((size_t)(n * ng) * sizeof(float));
    if (!r->xq || !r->sx || !r->xs || !r->mxs) { free_gguf_rows(r); return -1; }
    #pragma omp parallel for schedule(static) num_threads(nthreads) if(n * in >= 65536)
    for (int64_t row = 0; row < n; row++) {
        int64_t rb = 0, first = 0, nr = 1;
        for (; rb < nrb; rb++) {
            row_block(n, nb, rb, &first, &nr);
            if (row < first + nr) break;
        }
        const int64_t j = row - first;
        const uint16_t* x = xb + row * in;
        for (int64_t g = 0; g < ng; g++) {
            int32_t sum;
            float s = quantize_group(x + g * G, G, r->xq + first * in4 + (g * G / 4) * nr + j, nr, &sum);
            int64_t at = first * ng + g * nr + j;
            r->sx[at] = s;
            r->xs[at] = sum;
            r->mxs[at] = s * (float)sum;
        }
    }
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

/* rows j0 .. j0+nr-1 (one block of row_block) x weight block b */
typedef void (*gguf_tile)(const gguf_call* c, const gguf_rows* q, int64_t b, int64_t j0, int64_t nr);

static int run_gguf(const uint16_t* xb, int64_t n, int64_t nb, const gguf_call* c, gguf_tile tile, int nthreads) {
    gguf_rows q;
    if (make_gguf_rows(xb, n, c->in, c->G, nb, &q, nthreads)) return -1;
    int64_t nrb = (n + nb - 1) / nb, nblk = (c->out + OB - 1) / OB;
    hs_schedule(nblk, nthreads);
    #pragma omp parallel for schedule(runtime) num_threads(nthreads)
    for (int64_t b = 0; b < nblk; b++)
        for (int64_t r = 0, first, nr; r < nrb; r++) {
            row_block(n, nb, r, &first, &nr);
            tile(c, &q, b, first, nr);
        }
    free_gguf_rows(&q);
    return 0;
}

/* Write one row's 32 fp32 sums (+ bias) as bf16 outputs o0 .. o0+width-1 */
static inline void gguf_store(const float* acc, uint16_t* yr, int64_t o0, int64_t width, const float* bias) {
    for (int64_t k = 0; k < width; k++) yr[k] = f2bf(acc[k] + (bias ? bias[o0 + k] : 0.0f));
}
/* Output o's input i of a packed weight as its code (the layouts above) */
static inline int gguf_code(const gguf_call* c, int64_t o, int64_t i) {
    int64_t b = o / OB, k = o % OB, in4 = c->in / 4, p = i / 4, t = i % 4;
    if (c->bits == 8) return c->wq[((b * in4 + p) * OB + k) * 4 + t];
    uint8_t byte = c->wq[((b * in4 + p) * 16 + k % 16) * 4 + t];
    int code = k < 16 ? byte & 15 : byte >> 4;
    if (c->bits == 6) {
        int64_t lane = 4 * (k % 16) + t;
        int shift = 4 * (k >= 16) + 2 * (lane >= 32);
        code |= ((c->wh[(b * in4 + p) * 32 + lane % 32] >> shift) & 3) << 4;
    }
    return code;
}

/* Rows ids[0 .. n) of a GGUF weight dequantized (fp32, as GGUFLinear.dequantized computes them: K-quant
   scales d * sub-scale, then scale * code - min or scale * (code - zero), each product rounded on its own)
   and rounded to bf16: out [n, in]. An embedding lookup at the file's precision. */
void hs_gguf_rows(const gguf_call* c, const int64_t* ids, int64_t n, uint16_t* out) {
    int64_t ng = c->in / c->G, nsb = c->sc == NULL ? ng / c->per_d : 0;
    for (int64_t r = 0; r < n; r++) {
        int64_t o = ids[r], b = o / OB, k = o % OB;
        for (int64_t g = 0; g < ng; g++) {
            volatile float s, m = 0.0f; /* volatile: no fused multiply-add, as in torch */
            int has_min = c->mn != NULL || c->dmin != NULL;
            if (c->sc == NULL) {
                int64_t at = (b * nsb + g / c->per_d) * OB + k;
                s = c->d[at] * (float)c->ssc[(b * ng + g) * OB + k];
                if (has_min) m = c->dmin[at] * (float)c->smn[(b * ng + g) * OB + k];
            } else {
                s = c->sc[(b * ng + g) * OB + k];
                if (has_min) m = c->mn[(b * ng + g) * OB + k];
            }
            for (int64_t i = g * c->G; i < (g + 1) * c->G; i++) {
                int code = gguf_code(c, o, i);
                volatile float w;
                if (has_min) { w = s * (float)code; w = w - m; }
                else w = s * (float)(code - (int)c->zero);
                out[r * c->in + i] = f2bf(w);
            }
        }
    }
}

/* Rows a pass takes over a weight with `in` inputs, at most nb: a pass of more than 6 rows keeps its activation
   codes (nr x in bytes, read once per block of 32 outputs) within PASS_BYTES, beyond which a wide pass could
   cost more than two narrow ones (Zen 5: 12 rows of 8960 inputs 1.38x 6 + 6; in a fast hour a verify forward
   over 8 tokens 1.24x with 8 rows a pass there than with 4 + 4; docs/cpu-kernels.md). */
#define PASS_BYTES (64 << 10)
static inline int64_t pass_rows(int64_t nb, int64_t in) {
    int64_t fit = PASS_BYTES / in < 6 ? 6 : PASS_BYTES / in;
    return fit < nb ? fit : nb;
}

/* A build's GGUF entry point over its tile function: the weight's fields in one struct (y ignored), so a call
   from Python passes five arguments. */
#define GGUF_ENTRIES(NB_, TILE_) \
int hs_gguf_apply(const uint16_t* xb, int64_t n, const gguf_call* w, uint16_t* y, int nthreads) { \
    gguf_call c = *w; \
    c.y = y; \
    return run_gguf(xb, n, pass_rows(NB_, c.in), &c, TILE_, nthreads); \
}
#endif
