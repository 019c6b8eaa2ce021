/*
 * The q8 matmul's activations quantized, one row at a time, for q8.c (static functions:
 * q8.c includes this header once). As ggml's x86 code does: Q8_0/Q8_1 d = amax / 127
 * (kept as float16), q = round-half-even(x * (127 / amax)), Q8_1's s = float16(d * sum q);
 * Q8_K (quantize_row_q8_K_ref) d = max / -127 for the value of largest magnitude,
 * q = min(127, round-half-even(x * (-127 / max))), with the sums of each 16 quants. And
 * for AVX2's Q8_0 batch tiles (q8_avx2.h), the blocks' quants widened to int16.
 */
#ifndef MESHNET_Q8_QUANTIZE_H
#define MESHNET_Q8_QUANTIZE_H

#include <math.h>
#include <string.h>

#include "native.h"

static float f16_round(float v) { return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT)); }

static int32_t int16_pair(int32_t lo, int32_t hi) {
    return (int32_t)(((uint32_t)(uint16_t)(int16_t)lo) | ((uint32_t)(uint16_t)(int16_t)hi << 16));
}

/* The largest of 8 lanes (max is exact: any order). */
static float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* |v| lane by lane, and the running largest: vmaxps returns its second operand where the
 * first is NaN, so a NaN is passed over as fmaxf and the scalar comparisons pass it. */
static __m256 abs_max(__m256 v, __m256 amax) {
    return _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v), amax);
}

/* 32 int32 quants (each within int8) as 32 bytes in order. */
static void store_quants32(int8_t *q, __m256i q0, __m256i q1, __m256i q2, __m256i q3) {
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    /* the packs work within 128-bit halves: dwords come out as 0 2 4 6 1 3 5 7 of the order */
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* The sums of each of four vectors' 8 int32 lanes. */
static __m128i hsum4x8(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* Blocks of 32 of one row: quants q, per block d (float16-rounded), Q8_1's s and the sum
 * of q; q = round-half-even(x * (127 / amax)) by the vector conversion in the default
 * rounding mode, as nearbyintf. */
static void quantize_q8_0(const float *x, Py_ssize_t nb, int8_t *q, float *d, float *s,
                          int32_t *sums) {
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *v = x + b * QK;
        __m256 f[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            f[i] = _mm256_loadu_ps(v + 8 * i);
            amax = abs_max(f[i], amax);
        }
        const float a = hmax256(amax);
        const float dd = a / 127.0f, id = a != 0.0f ? 127.0f / a : 0.0f;
        __m256i qi[4];
        for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], _mm256_set1_ps(id)));
        store_quants32(q + b * QK, qi[0], qi[1], qi[2], qi[3]);
        const __m128i four = hsum4x8(qi[0], qi[1], qi[2], qi[3]);
        const int32_t sum = _mm_cvtsi128_si32(_mm_hadd_epi32(_mm_hadd_epi32(four, four), four));
        d[b] = f16_round(dd);
        if (s != NULL) s[b] = f16_round(dd * (float)sum);
        if (sums != NULL) sums[b] = sum;
    }
}

/* Super-blocks of 256 of one row (Q8_K): quants, d, and the sums of each 32 quants
 * (pairs32) and each 16 (pairs16) packed in int16 pairs (see q8job_t); either may be NULL.
 * q = min(127, round-half-even(x * (-127 / max))) for max the first value of largest
 * magnitude, as quantize_row_q8_K_ref. */
static void quantize_q8_k(const float *x, Py_ssize_t supers, int8_t *q, float *d,
                          int32_t *pairs32, int32_t *pairs16) {
    for (Py_ssize_t sb = 0; sb < supers; sb++) {
        const float *v = x + sb * QK_K;
        int8_t *qs = q + sb * QK_K;
        __m256 amax8 = _mm256_setzero_ps();
        for (int i = 0; i < QK_K; i += 8) amax8 = abs_max(_mm256_loadu_ps(v + i), amax8);
        const float amax = hmax256(amax8);
        int32_t s16[16] = {0};
        if (amax == 0.0f) {
            memset(qs, 0, QK_K);
            d[sb] = 0.0f;
        } else {
            int first = 0;
            while (fabsf(v[first]) != amax) first++;
            const float iscale = -127.0f / v[first];
            const __m256 scale = _mm256_set1_ps(iscale);
            const __m256i top = _mm256_set1_epi32(127);
            __m256i part[16];
            for (int k = 0; k < 8; k++) { /* 32 quants at a time */
                __m256i qi[4];
                for (int i = 0; i < 4; i++) {
                    const __m256 f = _mm256_loadu_ps(v + 32 * k + 8 * i);
                    qi[i] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(scale, f)), top);
                }
                store_quants32(qs + 32 * k, qi[0], qi[1], qi[2], qi[3]);
                part[2 * k] = _mm256_add_epi32(qi[0], qi[1]);
                part[2 * k + 1] = _mm256_add_epi32(qi[2], qi[3]);
            }
            for (int k = 0; k < 16; k += 4)
                _mm_storeu_si128((__m128i *)(s16 + k), hsum4x8(part[k], part[k + 1], part[k + 2], part[k + 3]));
            d[sb] = 1.0f / iscale;
        }
        if (pairs16 != NULL)
            for (int k = 0; k < 16; k += 2) pairs16[sb * 8 + k / 2] = int16_pair(s16[k], s16[k + 1]);
        if (pairs32 != NULL)
            for (int k = 0; k < 16; k += 4)
                pairs32[sb * 4 + k / 4] = int16_pair(s16[k] + s16[k + 1], s16[k + 2] + s16[k + 3]);
    }
}

/* One row's block quants widened to int16, each four (x0, x1, x2, x3) as x0, x2, x1, x3. */
static void widen_pairs(const int8_t *q, Py_ssize_t cols, int16_t *w) {
    const __m128i order = _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    for (Py_ssize_t c = 0; c < cols; c += 16) {
        const __m128i b = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(q + c)), order);
        _mm256_storeu_si256((__m256i *)(w + c), _mm256_cvtepi8_epi16(b));
    }
}

#endif
