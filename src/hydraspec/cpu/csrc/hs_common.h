/* hydraspec: the scalar parts shared by both builds of the CPU kernel (bf16_linear.c for AVX-512,
   avx2_linear.c for AVX2): bf16 rounding, the packed weight layout, and the activation rows as the
   micro-kernels read them (fp32 transposed, or int8 codes). Everything here is plain C, so the two
   builds prepare their inputs identically. */
#ifndef HS_COMMON_H
#define HS_COMMON_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define OB 32 /* outputs per packed weight block */
/* 4-bit and GGUF kernels prefetch their weights this many bytes ahead: with one or a few rows they stream the
   weights, and a load issued by the loop itself reached ~70-85 % of a bare read loop's speed. How far ahead pays
   depends on the CPU (docs/cpu-kernels.md): the loader sets it (hs_prefetch_ahead) before any call. */
static int64_t g_pf_ahead = 1024;
void hs_prefetch_ahead(int64_t bytes) { g_pf_ahead = bytes; }

/* How the matmul drivers hand weight blocks to threads: 1 (default) in chunks taken as each thread finishes
   its last (dynamic), 0 in one fixed share per thread (static). A block's outputs do not depend on which
   thread computes it, so both give the same bits; dynamic keeps both cores busy when one is slowed. */
static int hs_dynamic = 1;
void hs_set_dynamic(int on) { hs_dynamic = on; }

/* Set the schedule of the next `schedule(runtime)` loop over nblk blocks: dynamic chunks of about an
   eighth of a thread's share (at least one block), or static */
static inline void hs_schedule(int64_t nblk, int nthreads) {
#ifdef _OPENMP
    int64_t chunk = nblk / ((int64_t)(nthreads > 0 ? nthreads : 1) * 8);
    omp_set_schedule(hs_dynamic ? omp_sched_dynamic : omp_sched_static, hs_dynamic ? (int)(chunk > 0 ? chunk : 1) : 0);
#else
    (void)nblk; (void)nthreads;
#endif
}

/* fp32 -> bf16 bits, round to nearest even (as torch's conversion); NaN stays a quiet NaN */
static inline uint16_t f2bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4);
    return f;
}

/* w [out, in] bf16 -> wp [ceil(out/32)][in][32] bf16, zero padded */
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

/* bf16 rows x [n, in] -> fp32 row blocks of nb rows, block r laid out [in][nr] (nr = rows in the block)
   at xt + r * nb * in: one broadcast scalar per (input, row) for the micro-kernels */
static inline void transpose_rows(const uint16_t* xb, int64_t n, int64_t in, int64_t nb, float* xt) {
    for (int64_t r = 0; r * nb < n; r++) {
        int64_t j0 = r * nb, nr = n - j0 < nb ? n - j0 : nb;
        float* dst = xt + r * nb * in;
        for (int64_t j = 0; j < nr; j++) {
            const uint16_t* src = xb + (j0 + j) * in;
            for (int64_t i = 0; i < in; i++) dst[i * nr + j] = bf2f(src[i]);
        }
    }
}

/* Activation rows x [n, in] bf16 -> int8 codes, 4 to an int32 lane, in row blocks of nb rows (block r laid
   out [in4][nr]), and each row's scale (absmax/127, 1 for an all-zero row; round half to even: the
   arithmetic of hydraspec.kernels.quantize_rows). Codes are q + offset: 128 gives vpdpbusd's unsigned
   operand, 0 the signed one. Inputs past `in` are coded as zeros. 0, or -1 when out of memory. */
/* Eight bf16 values as fp32 lanes */
static inline __m256 load_bf16x8(const uint16_t* x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)x)), 16));
}

/* Eight bf16 values over the scale s (sv: s in every lane), rounded half to even and clamped to [-127, 127]: the
   arithmetic of one value at a time, eight lanes at once */
static inline __m256i codes_x8(const uint16_t* x, __m256 sv) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_div_ps(load_bf16x8(x), sv));
    return _mm256_max_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
}

/* Eight int32 lanes in [-127, 127] as eight int8, in order, in the low eight bytes */
static inline __m128i bytes_x8(__m256i q) {
    const __m128i h16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    return _mm_packs_epi16(h16, h16);
}

/* The largest |x| of n bf16 values, eight lanes at a time (a NaN input is skipped); the same maximum as one at a
   time */
static inline float absmax_bf16(const uint16_t* x, int64_t n) {
    __m256 m = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        m = _mm256_max_ps(_mm256_and_ps(load_bf16x8(x + i), abs_mask), m);
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, m);
    for (int t = 0; t < 8; t++) if (lanes[t] > amax) amax = lanes[t];
    for (; i < n; i++) {
        float a = bf2f(x[i]);
        a = a < 0 ? -a : a;
        if (a > amax) amax = a;
    }
    return amax;
}

static int quantize_rows(const uint16_t* xb, int64_t n, int64_t in, int64_t in4, int64_t nb, int offset,
                         int32_t* xq, float* sx) {
    uint8_t* codes = (uint8_t*)malloc((size_t)(in4 * 4));
    if (!codes) return -1;
    for (int64_t row = 0; row < n; row++) {
        const uint16_t* x = xb + row * in;
        const float amax = absmax_bf16(x, in);
        float s = amax > 0.0f ? amax / 127.0f : 1.0f;
        const __m256 sv = _mm256_set1_ps(s);
        int64_t i = 0;
        for (; i + 8 <= in; i += 8) { /* the same divisions and roundings, eight at a time */
            const __m128i b8 = _mm_add_epi8(bytes_x8(codes_x8(x + i, sv)), _mm_set1_epi8((char)offset)); /* mod 256 */
            _mm_storel_epi64((__m128i*)(codes + i), b8);
        }
        for (; i < in4 * 4; i++) {
            float f = i < in ? bf2f(x[i]) : 0.0f;
            int q = _mm_cvtss_si32(_mm_set_ss(f / s)); /* round half to even (the default rounding mode) */
            q = q > 127 ? 127 : (q < -127 ? -127 : q);
            codes[i] = (uint8_t)(q + offset);
        }
        int64_t r = row / nb, j = row % nb, nr = n - r * nb < nb ? n - r * nb : nb;
        for (int64_t p = 0; p < in4; p++) memcpy(xq + r * nb * in4 + p * nr + j, codes + 4 * p, 4);
        sx[row] = s;
    }
    free(codes);
    return 0;
}

/* Signed codes from quantize_rows (offset 0), row blocks of nb rows -> each row's code sum per group of g4
   int32 lanes (ng groups), row block r laid out [ng][nr] at xs + r * nb * ng (w4a8: the 4-bit weights
   are stored as q + 8, and 8 * this sum takes the offset out) */
static inline void group_code_sums(const int32_t* xq, int64_t n, int64_t in4, int64_t nb, int64_t g4, int64_t ng,
                                   int32_t* xs) {
    for (int64_t r = 0; r * nb < n; r++) {
        int64_t nr = n - r * nb < nb ? n - r * nb : nb;
        const int8_t* c = (const int8_t*)(xq + r * nb * in4); /* [in4][nr][4] codes */
        for (int64_t j = 0; j < nr; j++)
            for (int64_t g = 0; g < ng; g++) {
                int32_t sum = 0;
                for (int64_t p = g * g4; p < (g + 1) * g4; p++)
                    for (int t = 0; t < 4; t++) sum += c[(p * nr + j) * 4 + t];
                xs[r * nb * ng + g * nr + j] = sum;
            }
    }
}

/* The int8 activation rows of one w8a8 / w4a8 call: codes and row scales (quantize_rows, row blocks of nb
   rows) and, with group > 0, each row's code sum per group (group_code_sums). */
typedef struct { int32_t* xq; int32_t* xs; float* sx; } int8_rows;

static inline void free_int8_rows(int8_rows* r) { free(r->xq); free(r->xs); free(r->sx); }

/* 0, or -1 when out of memory (then nothing stays allocated) */
static int make_int8_rows(const uint16_t* xb, int64_t n, int64_t in, int64_t nb, int offset, int64_t group,
                          int8_rows* r) {
    int64_t nrb = (n + nb - 1) / nb, in4 = (in + 3) / 4, ng = group > 0 ? in / group : 0;
    r->xq = (int32_t*)malloc((size_t)(nrb * nb * in4) * sizeof(int32_t));
    r->sx = (float*)malloc((size_t)(nrb * nb) * sizeof(float));
    r->xs = ng ? (int32_t*)malloc((size_t)(nrb * nb * ng) * sizeof(int32_t)) : NULL;
    if (!r->xq || !r->sx || (ng && !r->xs) || quantize_rows(xb, n, in, in4, nb, offset, r->xq, r->sx)) {
        free_int8_rows(r);
        return -1;
    }
    if (ng) group_code_sums(r->xq, n, in4, nb, group / 4, ng, r->xs);
    return 0;
}

/* One w8a8 / w4a8 call's arguments (group 0 for w8a8; wsum only where the build needs it) */
typedef struct {
    int64_t in, out, group;
    const void* wq;
    const int32_t* wsum;
    const float* scale;
    uint16_t* y;
    const float* bias;
} int8_call;

/* rows j0 .. j0+nr-1 (their codes start at q->xq + j0 * in4) times weight block b (outputs o0 .. o0+width-1) */
typedef void (*int8_tile)(const int8_call* c, const int8_rows* q, int64_t b, int64_t j0, int64_t nr, int64_t o0,
                          int64_t width);

/* The int8-activation driver of both builds: quantise the rows (row blocks of nb, code offset, group code
   sums), then run `tile` for every 32-output weight block and row block, the weight blocks split over
   the threads. 0, or -1 when out of memory. */
static int run_int8(const uint16_t* xb, int64_t n, int64_t nb, int offset, const int8_call* c, int8_tile tile,
                    int nthreads) {
    int8_rows q;
    if (make_int8_rows(xb, n, c->in, nb, offset, c->group, &q)) return -1;
    int64_t nrb = (n + nb - 1) / nb, nblk = (c->out + OB - 1) / OB;
    hs_schedule(nblk, nthreads);
    #pragma omp parallel for schedule(runtime) num_threads(nthreads)
    for (int64_t b = 0; b < nblk; b++) {
        int64_t o0 = b * OB, width = c->out - o0 < OB ? c->out - o0 : OB;
        for (int64_t r = 0; r < nrb; r++) {
            int64_t j0 = r * nb;
            tile(c, &q, b, j0, n - j0 < nb ? n - j0 : nb, o0, width);
        }
    }
    free_int8_rows(&q);
    return 0;
}

/* One bf16 / int8-weight call with fp32 activations: packed weights wp ([ceil(out/32)][in][32], element size
   esize), per-output scale (int8) or NULL, output y [n, out], bias or NULL, and the build's kernel table */
typedef struct {
    int64_t in, out;
    const void* wp;
    size_t esize;
    const float* scale;
    uint16_t* y;
    const float* bias;
    const void* kern;
} f32_call;

/* rows j0 .. j0+nr-1 (xt: their fp32 row block, [in][nr]) times the weight block wb (outputs o0 .. o0+width-1) */
typedef void (*f32_tile)(const f32_call* c, const float* xt, const char* wb, int64_t j0, int64_t nr, int64_t o0,
                         int64_t width);

/* The fp32-activation driver of both builds: widen and transpose the rows into row blocks of nb
   (transpose_rows), then run `tile` for every 32-output weight block and row block, the weight blocks split
   over the threads. 0, or -1 when out of memory. */
static int run_f32(const uint16_t* xb, int64_t n, int64_t nb, const f32_call* c, f32_tile tile, int nthreads) {
    int64_t in = c->in, nrb = (n + nb - 1) / nb, nblk = (c->out + OB - 1) / OB;
    float* xt = (float*)malloc((size_t)(nrb * nb * in) * sizeof(float));
    if (!xt) return -1;
    transpose_rows(xb, n, in, nb, xt);
    hs_schedule(nblk, nthreads);
    #pragma omp parallel for schedule(runtime) num_threads(nthreads)
    for (int64_t b = 0; b < nblk; b++) {
        int64_t o0 = b * OB, width = c->out - o0 < OB ? c->out - o0 : OB;
        const char* wb = (const char*)c->wp + (size_t)(b * in * OB) * c->esize;
        for (int64_t r = 0; r < nrb; r++) {
            int64_t j0 = r * nb;
            tile(c, xt + r * nb * in, wb, j0, n - j0 < nb ? n - j0 : nb, o0, width);
        }
    }
    free(xt);
    return 0;
}

/* The GGUF kernels of both builds (hs_gguf.h: gguf_call c, gguf_rows q): row j0's activation codes, scales and
   group sums, and weight block b's codes and scales, for B bits and M the min form; in4, ng, b, j0 in scope */
#define GGUF_BLOCK_PTRS(B, M) \
    const int32_t* xq = q->xq + j0 * in4; \
    const float* sx = q->sx + j0 * ng; \
    const int32_t* xs = q->xs + j0 * ng; \
    const float* mxs = q->mxs + j0 * ng; \
    const uint8_t* wb = c->wq + (size_t)(b * in4 * (B == 8 ? 128 : 64)); \
    const uint8_t* hb = B == 6 ? c->wh + (size_t)(b * in4 * 32) : NULL; \
    const int two = c->sc == NULL; /* K-quants: d * sub-scale */ \
    const int64_t nsb = two ? ng / c->per_d : 0; \
    const float* sb = two ? NULL : c->sc + (size_t)(b * ng * OB); \
    const float* mb = M && !two ? c->mn + (size_t)(b * ng * OB) : NULL; \
    const int8_t* ssb = two ? c->ssc + (size_t)(b * ng * OB) : NULL; \
    const int8_t* smb = M && two ? c->smn + (size_t)(b * ng * OB) : NULL; \
    const float* db = two ? c->d + (size_t)(b * nsb * OB) : NULL; \
    const float* dmb = M && two ? c->dmin + (size_t)(b * nsb * OB) : NULL;
#endif
