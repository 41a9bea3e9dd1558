/* hydraspec: y[n, out] = x[n, in] @ w[out, in]^T (+ bias) for bf16 weights on AVX-512 CPUs.

   CPUs without native bf16 arithmetic (no AVX512_BF16 / AMX) make oneDNN's bf16 GEMM emulate it,
   and its cost then grows with every extra row: exactly what a speculative verify step (a few to a
   few dozen rows) cannot afford. This kernel widens each weight vector to fp32 once (a shift) and
   multiplies it with up to 8 rows of activations widened to fp32, so the weight is read once per call
   and the cost stays close to the one-row, memory-bound cost. Each (row, output) dot product is
   summed in the same order whatever the number of rows, so a row's result does not depend on the
   rows computed beside it. Build: cc -O3 -mavx512f -mavx512bw -mavx512vl -fopenmp -shared -fPIC. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* fp32 -> bf16 bits, round to nearest even (as torch's conversion); NaN stays a quiet NaN */
static inline uint16_t f2bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline __m512 cvbf(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }
static inline __m512 ldbf(const uint16_t* p) { return cvbf(_mm256_loadu_si256((const __m256i*)p)); }
static inline __m512 ldbf_m(const uint16_t* p, __mmask16 m) { return cvbf(_mm256_maskz_loadu_epi16(m, p)); }

/* R output rows x N tokens per pass; summation order per (row, token) is independent of R and N */
#define DEF(R, N) \
static void blk_##R##_##N(const float* x, int64_t in, const uint16_t* w, int64_t o, int64_t out, uint16_t* y, const float* bias) { \
    int64_t full = in & ~15LL; __mmask16 tm = (__mmask16)((1u << (in & 15)) - 1u); \
    __m512 acc[R][N]; \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) _Pragma("GCC unroll 16") for (int j = 0; j < N; j++) acc[r][j] = _mm512_setzero_ps(); \
    for (int64_t i = 0; i < full; i += 16) { \
        __m512 wv[R]; \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) wv[r] = ldbf(w + (o + r) * in + i); \
        _Pragma("GCC unroll 16") for (int j = 0; j < N; j++) { __m512 xv = _mm512_loadu_ps(x + j * in + i); \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) acc[r][j] = _mm512_fmadd_ps(wv[r], xv, acc[r][j]); } \
    } \
    if (tm) { __m512 wv[R]; \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) wv[r] = ldbf_m(w + (o + r) * in + full, tm); \
        _Pragma("GCC unroll 16") for (int j = 0; j < N; j++) { __m512 xv = _mm512_maskz_loadu_ps(tm, x + j * in + full); \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) acc[r][j] = _mm512_fmadd_ps(wv[r], xv, acc[r][j]); } } \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) { float b = bias ? bias[o + r] : 0.0f; \
        _Pragma("GCC unroll 16") for (int j = 0; j < N; j++) y[j * out + o + r] = f2bf(_mm512_reduce_add_ps(acc[r][j]) + b); } \
}
#define DEFN(N) DEF(1, N) DEF(2, N)
DEFN(1) DEFN(2) DEFN(3) DEFN(4) DEFN(5) DEFN(6) DEFN(7) DEFN(8)
DEF(4, 1) DEF(4, 2) DEF(4, 3) DEF(4, 4)

typedef void (*blkfn)(const float*, int64_t, const uint16_t*, int64_t, int64_t, uint16_t*, const float*);
static blkfn F1[9] = {0, blk_1_1, blk_1_2, blk_1_3, blk_1_4, blk_1_5, blk_1_6, blk_1_7, blk_1_8};
static blkfn F2[9] = {0, blk_2_1, blk_2_2, blk_2_3, blk_2_4, blk_2_5, blk_2_6, blk_2_7, blk_2_8};
static blkfn F4[5] = {0, blk_4_1, blk_4_2, blk_4_3, blk_4_4};

#define BO 32
/* x [n, in], w [out, in], y [n, out]: bf16 bits, contiguous; bias [out]: fp32 or NULL.
   Returns 0, or -1 when out of memory. */
int hs_linear_bf16(const uint16_t* xb, int64_t n, int64_t in, const uint16_t* w, int64_t out,
                   uint16_t* y, const float* bias, int nthreads) {
    float* x = (float*)malloc((size_t)(n * in) * sizeof(float));
    if (!x) return -1;
    for (int64_t k = 0; k < n * in; k++) { uint32_t u = (uint32_t)xb[k] << 16; memcpy(x + k, &u, 4); }
    int64_t nblk = (out + BO - 1) / BO;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < nblk; b++) {
        int64_t o0 = b * BO, o1 = o0 + BO < out ? o0 + BO : out;
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
            int64_t nn = n - j0 < 8 ? n - j0 : 8;
            const float* xj = x + j0 * in; uint16_t* yj = y + j0 * out;
            int64_t o = o0;
            if (nn <= 4) for (; o + 4 <= o1; o += 4) F4[nn](xj, in, w, o, out, yj, bias);
            for (; o + 2 <= o1; o += 2) F2[nn](xj, in, w, o, out, yj, bias);
            for (; o < o1; o++) F1[nn](xj, in, w, o, out, yj, bias);
        }
    }
    free(x);
    return 0;
}
