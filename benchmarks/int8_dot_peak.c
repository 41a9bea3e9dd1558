/* The ceiling of the GGUF kernels' inner loop on an AVX512_VNNI core: how many 512-bit vpdpbusd (64 int8
   multiply-adds each) one core retires a second, alone and with one other instruction for every three of
   them (an fp32 fused multiply-add, an int32 multiply, an int32 add, a broadcast load as the kernels' rows
   use). Twelve independent sums, so latency does not bound it. Run one copy per core at once to see both
   cores together.

       cc -O3 -o int8_dot_peak benchmarks/int8_dot_peak.c && ./int8_dot_peak
*/
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

static int32_t xs[64] __attribute__((aligned(64)));
static const char* names[] = {"vpdpbusd alone", "+ vfmadd231ps", "+ vpmulld", "+ vpaddd", "+ vpbroadcastd m32"};

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double run(int mode, long iters) {
    __m512i a[12];
    for (int j = 0; j < 12; j++) a[j] = _mm512_set1_epi32(j);
    const __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    __m512 f[4];
    for (int j = 0; j < 4; j++) f[j] = _mm512_set1_ps((float)j);
    const __m512 s = _mm512_set1_ps(1.0001f);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < iters; i++) {
        if (mode == 4) {
            _Pragma("GCC unroll 6") for (int j = 0; j < 6; j++) {
                __m512i xv = _mm512_set1_epi32(((volatile int32_t*)xs)[j + (i & 7)]);
                a[2 * j] = _mm512_dpbusd_epi32(a[2 * j], w, xv);
                a[2 * j + 1] = _mm512_dpbusd_epi32(a[2 * j + 1], x, xv);
            }
        } else {
            _Pragma("GCC unroll 12") for (int j = 0; j < 12; j++) a[j] = _mm512_dpbusd_epi32(a[j], w, x);
        }
        if (mode == 1) _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) f[j] = _mm512_fmadd_ps(f[j], s, s);
        if (mode == 2) _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) a[j] = _mm512_mullo_epi32(a[j], w);
        if (mode == 3) _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) a[j + 4] = _mm512_add_epi32(a[j + 4], w);
        __asm__ volatile("" ::"v"(a[0]), "v"(a[1]), "v"(a[2]), "v"(a[3]), "v"(a[4]), "v"(a[5]), "v"(a[6]),
                         "v"(a[7]), "v"(a[8]), "v"(a[9]), "v"(a[10]), "v"(a[11]), "v"(f[0]), "v"(f[1]), "v"(f[2]),
                         "v"(f[3]));
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}

int main(void) {
    const long iters = 200000000;
    for (int mode = 0; mode < 5; mode++) {
        double sec = run(mode, iters);
        printf("%-20s %.2f G vpdpbusd/s, %.2f ns per 12\n", names[mode], 12.0 * (double)iters / sec / 1e9,
               sec / (double)iters * 1e9);
    }
    return 0;
}
