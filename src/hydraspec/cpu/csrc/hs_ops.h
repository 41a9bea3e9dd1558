/* hydraspec: the small per-layer operations of a decoding step, fused, for both builds of the CPU
   kernel (included by bf16_linear.c and avx2_linear.c): the RMSNorm in plain C that the compiler
   vectorises, the attention with 256-bit AVX2/FMA intrinsics, which both builds compile (-mfma).

   A decoding or verify step of a 0.5-1.5B model on a CPU spends 20-40 % of its time outside the
   matrix products: an RMSNorm is 8 torch operations, few-query attention 10-15, each costing a few
   microseconds of dispatch for a few hundred numbers of work. Here each is one call.

   hs_rmsnorm: y = w * round(x * rsqrt(mean(x^2) + eps)), the Llama/Qwen2/Mistral RMSNorm: statistics
   in fp32, the normalised row rounded to the input dtype before the weight multiplies it (in fp32,
   rounded once more), as the stock module does. The sum of squares runs in a fixed order of 8 lanes.

   hs_attention: softmax(scale * q k^T + mask) v for up to a few dozen query rows against the cache,
   grouped-query heads reading their shared kv head, in fp32 from bf16 or fp32 inputs. Each query row
   is computed on its own and every sum over keys runs over them in order, skipping keys the mask
   hides (their weight is exactly 0). So a row's result does not depend on the rows beside it, nor on
   masked-out keys between the ones it sees: a tree node's attention output equals, bit for bit, that
   of the same token decoded alone after its ancestors.

   hs_rope_bf16: transformers' rotate-half rotary embedding (apply_rotary_pos_emb of Llama, Qwen2, Mistral
   ...) of bf16 q and k in one call: out = x * cos + rotate_half(x) * sin with each product and the sum
   rounded to bf16, as torch's bf16 operations round them, so the result equals the stock function's bit
   for bit.

   hs_silu_mul_bf16: silu(gate) * up of a gated MLP (gate and up rows, or the two halves of a joined
   gate/up output), silu rounded to bf16 before the product as in the stock act_fn(gate) * up. Each
   element on its own; the exponential is hs_exp_neg's, not torch's, so a value may differ from torch's
   in its last bf16 bit (and values below 1e-36 in size become zero). */
#ifndef HS_OPS_H
#define HS_OPS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>
#include "hs_common.h" /* f2bf, bf2f */

static inline float ld_f32(const void* p, int64_t i) { return ((const float*)p)[i]; }
static inline float ld_bf16(const void* p, int64_t i) { return bf2f(((const uint16_t*)p)[i]); }

/* hs_exp_neg's constants, shared by its scalar, 8-lane and 16-lane forms: ln 2 split in two, the polynomial */
#define HS_LOG2E 1.44269504088896341f
#define HS_LN2_HI 0.693359375f
#define HS_LN2_LO 2.12194440e-4f
#define HS_EXP_P0 1.9875691500e-4f
#define HS_EXP_P1 1.3981999507e-3f
#define HS_EXP_P2 8.3334519073e-3f
#define HS_EXP_P3 4.1665795894e-2f
#define HS_EXP_P4 1.6666665459e-1f
#define HS_EXP_P5 5.0000001201e-1f
/* the polynomial's Horner steps on p (holding HS_EXP_P0) in a vector form: K(c) broadcasts c, FMA(a, b, c) is a*b+c */
#define HS_EXP_HORNER(p, r, K, FMA)                                                                      \
    do {                                                                                                 \
        p = FMA(p, r, K(HS_EXP_P1)); p = FMA(p, r, K(HS_EXP_P2)); p = FMA(p, r, K(HS_EXP_P3));           \
        p = FMA(p, r, K(HS_EXP_P4)); p = FMA(p, r, K(HS_EXP_P5));                                        \
    } while (0)

/* e^x for x <= 0 (softmax after subtracting the row maximum): 2^n * p(r), r = x - n ln2 in
   [-ln2/2, ln2/2], with the Cephes single-precision polynomial (relative error ~1e-7). Branch-free so
   that loops over it vectorise; x below -87 gives 0. */
static inline float hs_exp_neg(float x) {
    float xc = x < -87.0f ? -87.0f : x;
    float n = floorf(xc * HS_LOG2E + 0.5f);
    float r = xc - n * HS_LN2_HI + n * HS_LN2_LO;
    float p = HS_EXP_P0;
    p = p * r + HS_EXP_P1;
    p = p * r + HS_EXP_P2;
    p = p * r + HS_EXP_P3;
    p = p * r + HS_EXP_P4;
    p = p * r + HS_EXP_P5;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s; memcpy(&s, &e, 4);
    return x < -87.0f ? 0.0f : p * s;
}

/* RND: the normalised value rounded to the row's dtype, as the stock module's .to(input_dtype) does */
#define HS_RMSNORM(NAME, T, LD, ST, RND, VEC)                                                         \
static void NAME(const T* x, const T* w, int64_t n, int64_t dim, float eps, T* y, int nthreads) {    \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads) if(n >= 8)")                    \
    for (int64_t r = 0; r < n; r++) {                                                                 \
        const T* xr = x + r * dim;                                                                    \
        T* yr = y + r * dim;                                                                          \
        float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                                        \
        int64_t t = 0;                                                                                \
        for (; t + 8 <= dim; t += 8)                                                                  \
            for (int l = 0; l < 8; l++) { float v = LD(xr, t + l); a[l] += v * v; }                   \
        for (; t < dim; t++) { float v = LD(xr, t); a[t & 7] += v * v; }                              \
        float ss = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));                 \
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);                                              \
        t = 0;                                                                                        \
        VEC                                                                                           \
        for (; t < dim; t++) yr[t] = ST(LD(w, t) * RND(LD(xr, t) * inv));                             \
    }                                                                                                 \
}

/* mask kinds: 0 none (every key), 1 bool bytes (nonzero = attend), 2 additive fp32, 3 additive bf16.
   An additive value below -1e30 (-inf, or the dtype's lowest as transformers writes it) hides its key:
   its weight would underflow to exactly 0 beside any key the row sees. */
static inline float mask_at(const void* m, int kind, int64_t i, int* hidden) {
    if (kind == 1) { *hidden = ((const uint8_t*)m)[i] == 0; return 0.0f; }
    float v = kind == 2 ? ((const float*)m)[i] : bf2f(((const uint16_t*)m)[i]);
    *hidden = v < -1e30f;
    return v;
}

/* 8 consecutive elements -> fp32 (AVX2; the AVX-512 build has it too) */
static inline __m256 ld8_f32(const void* p, int64_t i) { return _mm256_loadu_ps((const float*)p + i); }
static inline __m256 ld8_bf16(const void* p, int64_t i) {
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float lane_sum(__m256 a) {
    float l[8];
    _mm256_storeu_ps(l, a);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* e^x for 8 lanes of x <= 0: hs_exp_neg's range reduction and polynomial, lane by lane */
static inline __m256 exp_neg8(__m256 x) {
    const __m256 lim = _mm256_set1_ps(-87.0f);
    const __m256 xc = _mm256_max_ps(x, lim);
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(HS_LOG2E), _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(HS_LN2_LO), _mm256_fnmadd_ps(n, _mm256_set1_ps(HS_LN2_HI), xc));
    __m256 p = _mm256_set1_ps(HS_EXP_P0);
    HS_EXP_HORNER(p, r, _mm256_set1_ps, _mm256_fmadd_ps);
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_cmp_ps(x, lim, _CMP_GE_OQ));
}

/* s[j] = e^(s[j] - mx) for j < L (mx finite, every s[j] <= mx or -inf; those give 0). Every element, the last
   few too, goes through the same vector code, so its value does not depend on where the span of keys starts
   or ends. */
static inline void exp_shifted(float* s, int64_t L, float mx) {
    const __m256 m = _mm256_set1_ps(mx);
    int64_t j = 0;
    for (; j + 8 <= L; j += 8) _mm256_storeu_ps(s + j, exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m)));
    if (j < L) {
        float t[8];
        for (int i = 0; i < 8; i++) t[i] = j + i < L ? s[j + i] : -INFINITY;
        _mm256_storeu_ps(t, exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(t), m)));
        for (int i = 0; j + i < L; i++) s[j + i] = t[i];
    }
}

/* lane_sum of eight vectors at once: out[i] = lane_sum(a[i]), the lanes added in the same order
   ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) */
static inline __m256 sum8x8(const __m256* a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0 = [a0 lo, a1 lo, a2 lo, a3 lo | a0 hi, a1 hi, a2 hi, a3 hi], u1 the same for a4..a7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* [*lo, *hi): the span of keys a mask row lets its query see (empty: *lo >= *hi); byte masks 32 at a time */
static inline void visible_span(const void* m, int mkind, int64_t L, int64_t* lo, int64_t* hi) {
    int64_t a = 0, b = L;
    int hidden = 0;
    if (mkind == 1) {
        const uint8_t* mb = (const uint8_t*)m;
        const __m256i z = _mm256_setzero_si256();
        for (; a + 32 <= L; a += 32) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(mb + a));
            unsigned zero = (unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, z));
            if (zero != 0xffffffffu) { a += __builtin_ctz(~zero); break; }
        }
        while (a < L && !mb[a]) a++;
        for (; b - 32 >= a; b -= 32) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(mb + b - 32));
            unsigned zero = (unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, z));
            if (zero != 0xffffffffu) { b -= __builtin_clz(~zero); break; }
        }
        while (b > a && !mb[b - 1]) b--;
    } else {
        while (a < L) { mask_at(m, mkind, a, &hidden); if (!hidden) break; a++; }
        while (b > a) { mask_at(m, mkind, b - 1, &hidden); if (!hidden) break; b--; }
    }
    *lo = a, *hi = b;
}

/* whether key j is hidden from every one of the block's nr query rows (its scores are then skipped) */
static inline int hidden_for_all(const void* const* m, int nr, int mkind, int64_t j) {
    for (int r = 0; r < nr; r++) {
        int hidden = 0;
        mask_at(m[r], mkind, j, &hidden);
        if (!hidden) return 0;
    }
    return 1;
}

/* One query row's scores s[0 .. L) after the dot products: -inf where the mask hides key j (or the score is
   -inf already), else the score plus the mask's value (0 for a bool mask); returns their maximum (-inf if
   none). Eight keys at a time, each with the same operations as one at a time. */
static inline float mask_scores(float* s, const void* m, int mkind, int64_t L) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 mx8 = ninf;
    int64_t j = 0;
    for (; j + 8 <= L; j += 8) {
        __m256 x = _mm256_loadu_ps(s + j);
        if (mkind) {
            __m256 add, hid;
            if (mkind == 1) {
                const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)((const uint8_t*)m + j)));
                hid = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, _mm256_setzero_si256()));
                add = _mm256_setzero_ps();
            } else {
                add = mkind == 2 ? ld8_f32(m, j) : ld8_bf16(m, j);
                hid = _mm256_cmp_ps(add, _mm256_set1_ps(-1e30f), _CMP_LT_OQ);
            }
            hid = _mm256_or_ps(hid, _mm256_cmp_ps(x, ninf, _CMP_EQ_OQ));
            x = _mm256_blendv_ps(_mm256_add_ps(x, add), ninf, hid);
            _mm256_storeu_ps(s + j, x);
        }
        mx8 = _mm256_max_ps(x, mx8); /* x NaN: mx8 kept, as the scalar x > mx */
    }
    float l[8], mx = -INFINITY;
    _mm256_storeu_ps(l, mx8);
    for (int i = 0; i < 8; i++) if (l[i] > mx) mx = l[i];
    for (; j < L; j++) {
        if (mkind) {
            int hidden = 0;
            float add = mask_at(m, mkind, j, &hidden);
            s[j] = (hidden || s[j] == -INFINITY) ? -INFINITY : s[j] + add;
        }
        if (s[j] > mx) mx = s[j];
    }
    return mx;
}

/* AB query rows of one kv head against its L keys (rows past nr repeat row 0 and are dropped): scores,
   softmax and the weighted values, into o[AB][DV] fp32. Each key and value vector is converted once for the
   AB rows; a key hidden from all of them (another row's slots, padding) is not read, except beside a key they
   see in the AVX-512 build's pairs (below), where its sums are dropped. Every dot product runs
   over the dimensions in 8 lanes, summed in a fixed order, and every weighted sum visits the keys in order
   (keys every row weighs exactly 0 are skipped: they would add exact zeros), so a row's result depends on
   nothing but the row and the keys it sees: not on the rows beside it, nor on hidden keys between those it
   sees. The rows' sums are interleaved, which changes no row's order of operations. D and DV are multiples
   of 8 (checked by the caller); live has room for L indices. */
/* The AVX-512 build computes two keys' dot products in one 16-lane vector (one key a half: the q of every row
   stored twice in qf, each 8 dims in both halves) and weighs 16 value dimensions at a time: every lane does the
   8-lane code's operations in its order, so the results are the same bit for bit, in half the instructions.
   PAIR_KEYS: keys j (low half) and, when pair, j + 1 (high half) against the AB rows -> acc[r][jj], [jj + 1];
   WIDE_VALUES: o's dimensions t0 .. in steps of 16 while 16 remain (t0 is left where the 8-lane loop goes on). */
#define QF(r, t) (qf + KEYS_AT_ONCE * ((r) * D + (t))) /* row r's query from dim t, KEYS_AT_ONCE copies */
#ifdef __AVX512F__
#define KEYS_AT_ONCE 2
static inline __m512 join8(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
static inline __m256 high8(__m512 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); }
static inline __m512 ld16_f32(const void* p, int64_t i) { return _mm512_loadu_ps((const float*)p + i); }
static inline __m512 ld16_bf16(const void* p, int64_t i) {
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#define PAIR_KEYS(AB, LD8) {                                                                          \
    __m512 a[AB];                                                                                     \
    _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++) a[r] = _mm512_setzero_ps();                  \
    const int64_t kj = j * ks, kn = pair ? kj + ks : kj;                                              \
    for (int64_t t = 0; t < D; t += 8) {                                                              \
        const __m512 kv = join8(LD8(k, kj + t), LD8(k, kn + t));                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++)                                          \
            a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(QF(r, t)), kv, a[r]);                              \
    }                                                                                                 \
    _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++) {                                            \
        acc[r][jj] = _mm512_castps512_ps256(a[r]);                                                    \
        if (pair) acc[r][jj + 1] = high8(a[r]);                                                       \
    } }
#define WIDE_VALUES(AB, LD16)                                                                         \
    for (; t0 + 16 <= DV; t0 += 16) {                                                                 \
        __m512 c[AB];                                                                                 \
        _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++) c[r] = _mm512_loadu_ps(o + r * DV + t0); \
        for (int64_t i = i0; i < i1; i++) {                                                           \
            const int64_t j = live[i];                                                                \
            const __m512 vv = LD16(v, j * vs + t0);                                                   \
            _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++)                                      \
                c[r] = _mm512_fmadd_ps(_mm512_set1_ps(s[r * L + j]), vv, c[r]);                       \
        }                                                                                             \
        _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++) _mm512_storeu_ps(o + r * DV + t0, c[r]); \
    }
/* CPUs with AVX512_BF16 (hs_attention_dp): the dot products of bf16 queries and keys with vdpbf16ps, 16
   dimensions a step, two keys per vector (8 lanes each, a lane summing two dimensions' products), so a
   (row, key) score is a sum in a fixed order of that row's and that key's numbers only: the same whichever
   rows and keys are beside it. It differs from the fp32 path by the pairwise rounding (D a multiple of 16).
   QB(r, t): row r's 16 bf16 dims from t, stored twice (one copy per key). */
#define HS_ATTN_DP __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define QB(r, t) ((const uint16_t*)qf + 2 * ((r) * D + (t)))
#define QB_PREP(AB, LD8)                                                                              \
    for (int r = 0; r < AB; r++)                                                                      \
        for (int64_t t = 0; t < D; t += 16) {                                                         \
            const __m256i qv = _mm256_loadu_si256((const __m256i*)((const uint16_t*)q[r < nr ? r : 0] + t));\
            _mm256_storeu_si256((__m256i*)QB(r, t), qv);                                              \
            _mm256_storeu_si256((__m256i*)QB(r, t) + 1, qv);                                          \
        }
#define DP_KEYS(AB, LD8) {                                                                            \
    __m512 a[AB];                                                                                     \
    _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++) a[r] = _mm512_setzero_ps();                  \
    const uint16_t* kj = (const uint16_t*)k + j * ks;                                                 \
    const uint16_t* kn = pair ? kj + ks : kj;                                                         \
    for (int64_t t = 0; t < D; t += 16) {                                                             \
        const __m512i kv = _mm512_inserti64x4(_mm512_castsi256_si512(                                 \
            _mm256_loadu_si256((const __m256i*)(kj + t))), _mm256_loadu_si256((const __m256i*)(kn + t)), 1);\
        _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++)                                          \
            a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_loadu_si512(QB(r, t)), (__m512bh)kv);      \
    }                                                                                                 \
    _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++) {                                            \
        acc[r][jj] = _mm512_castps512_ps256(a[r]);                                                    \
        if (pair) acc[r][jj + 1] = high8(a[r]);                                                       \
    } }
#else
#define KEYS_AT_ONCE 1
#define PAIR_KEYS(AB, LD8) {                                                                          \
    __m256 a[AB];                                                                                     \
    _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++) a[r] = _mm256_setzero_ps();                  \
    const int64_t kj = j * ks;                                                                        \
    (void)pair;                                                                                       \
    for (int64_t t = 0; t < D; t += 8) {                                                              \
        const __m256 kv = LD8(k, kj + t);                                                             \
        _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++)                                          \
            a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(QF(r, t)), kv, a[r]);                              \
    }                                                                                                 \
    _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++) acc[r][jj] = a[r]; }
#define WIDE_VALUES(AB, LD16)
#endif
#define HS_ATTN_KEYS 32 /* keys per tile of the weighted sum of values */
/* the queries as PAIR_KEYS reads them: fp32, KEYS_AT_ONCE copies (one key per half) */
#define QF_PREP(AB, LD8)                                                                              \
    for (int r = 0; r < AB; r++)                                                                      \
        for (int64_t t = 0; t < D; t += 8) {                                                          \
            const __m256 qv = LD8(q[r < nr ? r : 0], t);                                              \
            _mm256_storeu_ps(QF(r, t), qv);                                                           \
            if (KEYS_AT_ONCE == 2) _mm256_storeu_ps(QF(r, t) + 8, qv);                                \
        }
/* HS_ATTN_BLOCK_WITH: ATTR the function's attributes, QPREP the queries' copy, KEYS the dot products */
#define HS_ATTN_BLOCK(NAME, LD8, LD16, AB) HS_ATTN_BLOCK_WITH(NAME, LD8, LD16, AB, , QF_PREP, PAIR_KEYS)
#define HS_ATTN_BLOCK_WITH(NAME, LD8, LD16, AB, ATTR, QPREP, KEYS)                                    \
ATTR static void NAME(const void* const* q, const void* const* m, int nr, int mkind, const void* k,   \
                 int64_t ks, const void* v, int64_t vs, int64_t L, int64_t D, int64_t DV, float scale,\
                 float* qf, float* s, float* o, int32_t* live) {                                      \
    QPREP(AB, LD8)                                                                                    \
    __m256 acc[AB][8];                                                                                \
    int hid[8];                                                                                       \
    for (int64_t j0 = 0; j0 < L; j0 += 8) {                                                           \
        const int nk = L - j0 < 8 ? (int)(L - j0) : 8;                                                \
        for (int jj = 0; jj < nk; jj++) hid[jj] = mkind && hidden_for_all(m, nr, mkind, j0 + jj);     \
        for (int jj = 0; jj < nk; jj += KEYS_AT_ONCE) {                                               \
            const int64_t j = j0 + jj;                                                                \
            const int pair = KEYS_AT_ONCE == 2 && jj + 1 < nk && !hid[jj + 1];                        \
            if (pair || !hid[jj]) KEYS(AB, LD8)                                                       \
            for (int u = jj; u < jj + KEYS_AT_ONCE && u < nk; u++) /* a hidden key weighs 0 */        \
                if (hid[u]) for (int r = 0; r < AB; r++) acc[r][u] = _mm256_setzero_ps();             \
        }                                                                                             \
        for (int r = 0; r < AB; r++) {                                                                \
            float* sr = s + r * L + j0;                                                               \
            if (nk == 8) {                                                                            \
                _mm256_storeu_ps(sr, _mm256_mul_ps(sum8x8(acc[r]), _mm256_set1_ps(scale)));           \
            } else {                                                                                  \
                for (int jj = 0; jj < nk; jj++) sr[jj] = lane_sum(acc[r][jj]) * scale;                \
            }                                                                                         \
            for (int jj = 0; jj < nk; jj++) if (hid[jj]) sr[jj] = -INFINITY;                          \
        }                                                                                             \
    }                                                                                                 \
    float den[AB];                                                                                    \
    for (int r = 0; r < AB; r++) {                                                                    \
        float* sr = s + r * L;                                                                        \
        const float mx = mask_scores(sr, m[r < nr ? r : 0], mkind, L);                                \
        if (mx == -INFINITY) {                                                                        \
            for (int64_t j = 0; j < L; j++) sr[j] = 0.0f;                                             \
        } else {                                                                                      \
            exp_shifted(sr, L, mx);                                                                   \
        }                                                                                             \
        den[r] = 0.0f;                                                                                \
    }                                                                                                 \
    int64_t nlive = 0;                                                                                \
    for (int64_t j = 0; j < L; j++) { /* each row's sum in key order; the keys some row weighs */    \
        int any = 0;                                                                                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++) { den[r] += s[r * L + j]; any |= s[r * L + j] != 0.0f; } \
        if (any) live[nlive++] = (int32_t)j;                                                          \
    }                                                                                                 \
    memset(o, 0, (size_t)(AB * DV) * sizeof(float));                                                  \
    for (int64_t i0 = 0; i0 < nlive; i0 += HS_ATTN_KEYS) { /* a tile of values stays in L1 */          \
        const int64_t i1 = nlive - i0 < HS_ATTN_KEYS ? nlive : i0 + HS_ATTN_KEYS;                     \
        int64_t t0 = 0;                                                                               \
        WIDE_VALUES(AB, LD16)                                                                         \
        for (; t0 < DV; t0 += 8) {                                                                    \
            __m256 c[AB];                                                                             \
            _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++) c[r] = _mm256_loadu_ps(o + r * DV + t0); \
            for (int64_t i = i0; i < i1; i++) {                                                       \
                const int64_t j = live[i];                                                            \
                const __m256 vv = LD8(v, j * vs + t0);                                                \
                _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++)                                  \
                    c[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(s + r * L + j), vv, c[r]);             \
            }                                                                                         \
            _Pragma("GCC unroll 8") for (int r = 0; r < AB; r++) _mm256_storeu_ps(o + r * DV + t0, c[r]); \
        }                                                                                             \
    }                                                                                                 \
    for (int r = 0; r < AB; r++) {                                                                    \
        const __m256 dn = _mm256_set1_ps(den[r] > 0.0f ? den[r] : 1.0f);                              \
        for (int64_t t0 = 0; t0 < DV; t0 += 8)                                                        \
            _mm256_storeu_ps(o + r * DV + t0, _mm256_div_ps(_mm256_loadu_ps(o + r * DV + t0), dn));   \
    }                                                                                                 \
}
HS_ATTN_BLOCK(attn_block4_f32, ld8_f32, ld16_f32, 4)
HS_ATTN_BLOCK(attn_block4_bf16, ld8_bf16, ld16_bf16, 4)
HS_ATTN_BLOCK(attn_block6_f32, ld8_f32, ld16_f32, 6)
HS_ATTN_BLOCK(attn_block6_bf16, ld8_bf16, ld16_bf16, 6)
HS_ATTN_BLOCK(attn_block8_f32, ld8_f32, ld16_f32, 8)
HS_ATTN_BLOCK(attn_block8_bf16, ld8_bf16, ld16_bf16, 8)
#ifdef __AVX512F__
HS_ATTN_BLOCK_WITH(attn_block4_dp, ld8_bf16, ld16_bf16, 4, HS_ATTN_DP, QB_PREP, DP_KEYS)
HS_ATTN_BLOCK_WITH(attn_block6_dp, ld8_bf16, ld16_bf16, 6, HS_ATTN_DP, QB_PREP, DP_KEYS)
HS_ATTN_BLOCK_WITH(attn_block8_dp, ld8_bf16, ld16_bf16, 8, HS_ATTN_DP, QB_PREP, DP_KEYS)
static int g_attention_dp = 0;
/* bf16 attention's dot products with AVX512_BF16 from now on (on: nonzero; the caller checks the CPU) */
void hs_attention_dp(int on) { g_attention_dp = on; }
#endif

/* q [B, H, N, D] with element strides qs = {b, h, n} (d contiguous); k [B, HKV, L, D] and v [B, HKV, L, DV]
   with strides ks / vs = {b, h, l}; mask [B, N, L] with strides ms = {b, n} (l contiguous), shared by
   all heads; out [B, N, H, DV] contiguous. Query head i reads kv head i / (H / HKV); the H / HKV query
   heads of one kv head and one query position are neighbours in a block, so positions that see few keys
   (or none: a packed forward's padding) make blocks that read few. All tensors fp32 (bf16 = 0) or bf16
   (bf16 = 1), additive masks too. Returns -1 when out of memory. */
int hs_attention(const void* q, const int64_t* qs, const void* k, const int64_t* ks, const void* v,
                 const int64_t* vs, const void* mask, const int64_t* ms, int mkind, int bf16, int64_t B,
                 int64_t H, int64_t HKV, int64_t N, int64_t L, int64_t D, int64_t DV, float scale,
                 void* out, int nthreads) {
    const int64_t g = H / HKV, rows = g * N, nblk = (rows + 7) / 8, tasks = B * HKV * nblk;
    const size_t es = bf16 ? 2 : 4, mes = mkind == 1 ? 1 : (mkind == 2 ? 4 : 2);
    int err = 0;
    #pragma omp parallel num_threads(nthreads) if(tasks > 1)
    {
        float* buf = (float*)malloc((size_t)(8 * (2 * D + L + DV) + L) * sizeof(float));
        if (!buf) {
            #pragma omp atomic write
            err = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (!buf) continue;
            const int64_t b = task / (HKV * nblk), kvh = (task / nblk) % HKV, r0 = (task % nblk) * 8;
            const int nr = rows - r0 < 8 ? (int)(rows - r0) : 8;
            const void* qp[8];
            const void* mp[8];
            int64_t head[8], qi[8];
            for (int r = 0; r < nr; r++) {
                head[r] = kvh * g + (r0 + r) % g, qi[r] = (r0 + r) / g;
                qp[r] = (const char*)q + (size_t)(b * qs[0] + head[r] * qs[1] + qi[r] * qs[2]) * es;
                mp[r] = mkind ? (const char*)mask + (size_t)(b * ms[0] + qi[r] * ms[1]) * mes : NULL;
            }
            int64_t lo = 0, hi = L;  /* the keys some row of the block sees; the rest weigh exactly 0 */
            if (mkind) {
                lo = L, hi = 0;
                for (int r = 0; r < nr; r++) {
                    int64_t a, e;
                    visible_span(mp[r], mkind, L, &a, &e);
                    if (a < e) { lo = a < lo ? a : lo; hi = e > hi ? e : hi; }
                }
                if (lo >= hi) lo = hi = 0;
                for (int r = 0; r < nr; r++) mp[r] = (const char*)mp[r] + (size_t)lo * mes;
            }
            const char* kp = (const char*)k + (size_t)(b * ks[0] + kvh * ks[1] + lo * ks[2]) * es;
            const char* vp = (const char*)v + (size_t)(b * vs[0] + kvh * vs[1] + lo * vs[2]) * es;
            float *qf = buf, *s = buf + 16 * D, *o = buf + 8 * (2 * D + L);
            int32_t* live = (int32_t*)(buf + 8 * (2 * D + L + DV));
            typedef void (*blockfn)(const void* const*, const void* const*, int, int, const void*, int64_t,
                                    const void*, int64_t, int64_t, int64_t, int64_t, float, float*, float*, float*,
                                    int32_t*);
            blockfn run = nr <= 4 ? (bf16 ? attn_block4_bf16 : attn_block4_f32)  /* the fewest rows that fit */
                              : nr <= 6 ? (bf16 ? attn_block6_bf16 : attn_block6_f32)
                                        : (bf16 ? attn_block8_bf16 : attn_block8_f32);
#ifdef __AVX512F__
            if (bf16 && g_attention_dp && D % 16 == 0)
                run = nr <= 4 ? attn_block4_dp : nr <= 6 ? attn_block6_dp : attn_block8_dp;
#endif
            run(qp, mp, nr, mkind, kp, ks[2], vp, vs[2], hi - lo, D, DV, scale, qf, s, o, live);
            for (int r = 0; r < nr; r++) {
                const int64_t off = ((b * N + qi[r]) * H + head[r]) * DV;
                if (bf16) for (int64_t t = 0; t < DV; t++) ((uint16_t*)out)[off + t] = f2bf(o[r * DV + t]);
                else memcpy((float*)out + off, o + r * DV, (size_t)DV * sizeof(float));
            }
        }
        free(buf);
    }
    return err ? -1 : 0;
}

/* 8 fp32 values rounded to bf16 as f2bf rounds them (nearest even; NaN stays a quiet NaN), as fp32 bits */
static inline __m256i round_bf16_8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i absu = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i nan = _mm256_cmpgt_epi32(absu, _mm256_set1_epi32(0x7f800000));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    return _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
}

/* One head's row: out[i] = bf(bf(x[i] * c[i]) + bf(r[i] * s[i])), r = (-x[h:], x[:h]), h = D / 2 */
static inline void rope_row(const uint16_t* x, const uint16_t* c, const uint16_t* sn, uint16_t* out, int64_t D) {
    const int64_t h = D / 2;
    int64_t i = 0;
    if (h % 8 == 0) {
        const __m256 neg = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
        for (; i < D; i += 8) {
            __m256 r = i < h ? _mm256_xor_ps(ld8_bf16(x, i + h), neg) : ld8_bf16(x, i - h);
            __m256 a = _mm256_castsi256_ps(round_bf16_8(_mm256_mul_ps(ld8_bf16(x, i), ld8_bf16(c, i))));
            __m256 b = _mm256_castsi256_ps(round_bf16_8(_mm256_mul_ps(r, ld8_bf16(sn, i))));
            __m256i y = _mm256_srli_epi32(round_bf16_8(_mm256_add_ps(a, b)), 16);
            _mm_storeu_si128((__m128i*)(out + i),
                             _mm_packus_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1)));
        }
    }
    for (; i < D; i++) {
        float r = i < h ? -bf2f(x[i + h]) : bf2f(x[i - h]);
        float a = bf2f(f2bf(bf2f(x[i]) * bf2f(c[i])));
        float b = bf2f(f2bf(r * bf2f(sn[i])));
        out[i] = f2bf(a + b);
    }
}

/* q [B, Hq, N, D] and k [B, Hk, N, D] with element strides {b, h, n} (d contiguous), written to qo / ko with
   their own strides; cos / sin [Bc, N, D] with strides {b, n} (Bc 1 or B: a b stride of 0 broadcasts).
   dims: B, N, D, Hq, Hk, then the strides of q, qo, k, ko (3 each) and of cos / sin (2). */
int hs_rope_bf16(const uint16_t* q, uint16_t* qo, const uint16_t* k, uint16_t* ko, const uint16_t* cs,
                 const uint16_t* sn, const int64_t* dims) {
    const int64_t B = dims[0], N = dims[1], D = dims[2], Hq = dims[3], Hk = dims[4];
    const int64_t *qs = dims + 5, *qos = dims + 8, *ks = dims + 11, *kos = dims + 14, *cst = dims + 17;
    for (int64_t b = 0; b < B; b++)
        for (int64_t n = 0; n < N; n++) {
            const uint16_t* c = cs + b * cst[0] + n * cst[1];
            const uint16_t* s = sn + b * cst[0] + n * cst[1];
            for (int64_t h = 0; h < Hq; h++)
                rope_row(q + b * qs[0] + h * qs[1] + n * qs[2], c, s, qo + b * qos[0] + h * qos[1] + n * qos[2], D);
            for (int64_t h = 0; h < Hk; h++)
                rope_row(k + b * ks[0] + h * ks[1] + n * ks[2], c, s, ko + b * kos[0] + h * kos[1] + n * kos[2], D);
        }
    return 0;
}


/* silu(x) * u for one element, rounded as the vector loop rounds: silu to bf16, then the product */
static inline uint16_t silu_mul1(float x, float u) {
    float e = hs_exp_neg(x < 0 ? x : -x); /* e^-|x| */
    float sg = (x >= 0 ? 1.0f : e) / (1.0f + e);
    return f2bf(bf2f(f2bf(x * sg)) * u);
}

#ifdef __AVX512F__
/* exp_neg8 on 16 lanes: the same operations lane by lane */
static inline __m512 exp_neg16(__m512 x) {
    const __m512 lim = _mm512_set1_ps(-87.0f);
    const __m512 xc = _mm512_max_ps(x, lim);
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(HS_LOG2E),
                                                          _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(HS_LN2_LO),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(HS_LN2_HI), xc));
    __m512 p = _mm512_set1_ps(HS_EXP_P0);
    HS_EXP_HORNER(p, r, _mm512_set1_ps, _mm512_fmadd_ps);
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lim, _CMP_GE_OQ);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(e));
}

/* round_bf16_8 on 16 lanes */
static inline __m512i round_bf16_16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i absu = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(absu, _mm512_set1_epi32(0x7f800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}

/* 16 elements of hs_silu_mul_bf16's vector loop (the AVX-512 build): the same arithmetic lane by lane */
static inline __m256i silu_mul16(const uint16_t* g, const uint16_t* u) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 x = ld16_bf16(g, 0);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    const __m512 e = exp_neg16(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign))); /* e^-|x| */
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sg = _mm512_div_ps(_mm512_mask_mov_ps(one, neg, e), _mm512_add_ps(one, e));
    const __m512 sx = _mm512_castsi512_ps(round_bf16_16(_mm512_mul_ps(x, sg)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_16(_mm512_mul_ps(sx, ld16_bf16(u, 0))), 16));
}
#endif

/* g, u: [n, I] bf16 rows at row strides gs, us (a joined gate/up output: u = g + I, gs = us = 2I)
   -> out [n, I] = bf(bf(silu(g)) * u), silu = x * (x >= 0 ? 1 : e) / (1 + e) with e = e^-|x| */
int hs_silu_mul_bf16(const uint16_t* g, int64_t gs, const uint16_t* u, int64_t us, int64_t n, int64_t I,
                     uint16_t* out, int nthreads) {
    /* tasks: rows x column chunks (multiples of 8, so each element takes the same path as in one pass) */
    const int64_t parts = n >= nthreads || I < 2048 ? 1 : nthreads, chunk = ((I + parts - 1) / parts + 7) / 8 * 8;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if(n * I >= 4096)
    for (int64_t t = 0; t < n * parts; t++) {
        const int64_t r = t / parts, lo = (t % parts) * chunk, hi = lo + chunk < I ? lo + chunk : I;
        const uint16_t* gr = g + r * gs;
        const uint16_t* ur = u + r * us;
        uint16_t* o = out + r * I;
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
        int64_t i = lo;
#ifdef __AVX512F__
        for (; i + 16 <= hi; i += 16) _mm256_storeu_si256((__m256i*)(o + i), silu_mul16(gr + i, ur + i));
#endif
        for (; i + 8 <= hi; i += 8) {
            const __m256 x = ld8_bf16(gr, i);
            const __m256 e = exp_neg8(_mm256_or_ps(x, sign)); /* e^-|x| */
            const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
            const __m256 sg = _mm256_div_ps(_mm256_blendv_ps(one, e, neg), _mm256_add_ps(one, e));
            const __m256 sx = _mm256_castsi256_ps(round_bf16_8(_mm256_mul_ps(x, sg)));
            const __m256i y = _mm256_srli_epi32(round_bf16_8(_mm256_mul_ps(sx, ld8_bf16(ur, i))), 16);
            _mm_storeu_si128((__m128i*)(o + i),
                             _mm_packus_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1)));
        }
        for (; i < hi; i++) o[i] = silu_mul1(bf2f(gr[i]), bf2f(ur[i]));
    }
    return 0;
}
/* The bf16 rows' scaling in the AVX-512 build: 16 elements at a time, the scalar loop's roundings lane by lane */
#ifdef __AVX512F__
#define RMS_BF16_VEC                                                                                  \
    for (const __m512 iv = _mm512_set1_ps(inv); t + 16 <= dim; t += 16) {                             \
        const __m512 v = _mm512_castsi512_ps(round_bf16_16(_mm512_mul_ps(ld16_bf16(xr, t), iv)));     \
        const __m512i r = _mm512_srli_epi32(round_bf16_16(_mm512_mul_ps(ld16_bf16(w, t), v)), 16);    \
        _mm256_storeu_si256((__m256i*)(yr + t), _mm512_cvtepi32_epi16(r));                            \
    }
#else
#define RMS_BF16_VEC
#endif
#define AS_F32(v) (v)
#define BF16_ROUND(v) bf2f(f2bf(v))
HS_RMSNORM(rmsnorm_f32, float, ld_f32, AS_F32, AS_F32, )
HS_RMSNORM(rmsnorm_bf16, uint16_t, ld_bf16, f2bf, BF16_ROUND, RMS_BF16_VEC)

/* x, w, y: [n, dim] contiguous rows and [dim] weight, all fp32 (bf16 = 0) or all bf16 (bf16 = 1) */
int hs_rmsnorm(const void* x, const void* w, int64_t n, int64_t dim, float eps, int bf16, void* y, int nthreads) {
    if (bf16) rmsnorm_bf16((const uint16_t*)x, (const uint16_t*)w, n, dim, eps, (uint16_t*)y, nthreads);
    else rmsnorm_f32((const float*)x, (const float*)w, n, dim, eps, (float*)y, nthreads);
    return 0;
}
#endif
